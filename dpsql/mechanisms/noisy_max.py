"""Report-Noisy-Max (Dwork and Roth, Claim 3.9) and the ToPS threshold optimizer built on it.

Privacy cost: ``epsilon``-DP (pure) for scores whose sensitivity is ``sensitivity``.
When every score moves in the same direction on a neighbouring input
(``monotonic=True``) the noise scale is ``sensitivity / epsilon``; otherwise it is
``2 * sensitivity / epsilon`` (Dwork & Roth, Claim 3.9). Only the index is released.

Exactness: the argmax is taken over int64 lattice units ``k_i + Z_i`` (no float rounding
at any magnitude). Float scores given by a caller are refused when they reach ``2**53``
lattice units with the noise: beyond that their own float rounding may move a score by
more than its sensitivity. ToPS's scores are formed in lattice units directly, exactly
(see :func:`score_units`), so they have no such limit.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from dpsql.errors import InvalidParameter
from dpsql.mechanisms.laplace import LaplaceLattice, draw_bound, largest_magnitude
from dpsql.noise import BatchLaneDraws, LaneDraws


def report_noisy_max(scores: np.ndarray, *, epsilon: float, noise: LaneDraws,
                     sensitivity: float = 1.0, monotonic: bool = True) -> int:
    """Index of the largest ``score + Laplace`` (lattice noise, see :mod:`.laplace`); candidate
    ``i``'s noise is the draw at index ``i`` of ``noise``.

    Noise is drawn only for the :func:`contenders`, the candidates that can still win
    whatever the noise; the output distribution is exactly that of drawing noise for every
    candidate (see :func:`contenders`). The work done, and so the run time, therefore
    depends on the scores: a timing side channel of the same kind as any data-dependent
    sort, visible only to whoever times the call.

    Examples
    --------
    >>> import dpsql
    >>> with dpsql.testing.seeded(0) as keys:
    ...     report_noisy_max(np.array([0.0, 100.0, 3.0]), epsilon=10.0,
    ...                      noise=keys.partition().lane(dpsql.noise.Lane.NOISY_MAX))
    1
    """
    scores = np.asarray(scores, dtype=np.float64)
    return int(report_noisy_max_rows(scores[None], epsilon=epsilon, noise=BatchLaneDraws.of(noise),
                                     sensitivity=sensitivity, monotonic=monotonic)[0])


def report_noisy_max_rows(scores: np.ndarray, *, epsilon: float, noise: BatchLaneDraws,
                          sensitivity: float = 1.0, monotonic: bool = True) -> np.ndarray:
    """:func:`report_noisy_max` on every row of the 2-D ``scores`` (one row per partition, with
    that partition's draws in ``noise``).

    Each row's index has exactly the distribution :func:`report_noisy_max` gives it alone
    (same lattice, same contenders, the same addressed draws). Scores must be finite and, with the largest
    possible draw, below ``2**53`` lattice units in magnitude
    (:class:`~dpsql.errors.InvalidParameter` otherwise; see the module docstring).

    Examples
    --------
    >>> import dpsql
    >>> with dpsql.testing.seeded(0) as keys:
    ...     draws = keys.partitions([b"a", b"b"]).lane(dpsql.noise.Lane.NOISY_MAX)
    ...     report_noisy_max_rows(np.array([[0.0, 100.0, 3.0], [50.0, 0.0, 0.0]]), epsilon=10.0, noise=draws)
    array([1, 0])
    """
    lap = noisy_max_lattice(epsilon, sensitivity=sensitivity, monotonic=monotonic)
    units = np.rint(np.asarray(scores, dtype=np.float64) / lap.granularity)
    largest = largest_magnitude(units)
    if not largest + draw_bound(lap.scale_units) < 2.0**53:
        raise InvalidParameter(
            f"report_noisy_max scores must be finite and, noise included, below 2**53 lattice units "
            f"({2.0**53 * lap.granularity:g} at sensitivity {sensitivity!r}), got magnitude "
            f"{largest * lap.granularity:g}: beyond that float scores cannot keep their sensitivity; subtract a "
            f"common public offset")
    units = units.astype(np.int64)
    alive = contenders(units, lap.scale_units)
    return _noisy_argmax(units.ravel()[alive], alive, units.shape, lap, noise)


def noisy_max_lattice(epsilon: float, *, sensitivity: float = 1.0, monotonic: bool = True) -> LaplaceLattice:
    """The lattice noise of Report-Noisy-Max at ``epsilon`` for scores of ``sensitivity``."""
    # Non-monotone scores need twice the scale of the *rounded* score change (lattice slack
    # included): halving epsilon doubles both, where doubling the sensitivity would not.
    return LaplaceLattice(sensitivity=sensitivity, epsilon=epsilon if monotonic else epsilon / 2)


def _noisy_argmax(alive_units: np.ndarray, alive: np.ndarray, shape: tuple[int, int], lap: LaplaceLattice,
                  noise: BatchLaneDraws, first_row: int = 0) -> np.ndarray:
    """Per row of a ``shape`` array of scores, the index of the first largest noisy score among
    the contenders ``alive`` (flat, row-major, each row's maximum among them) whose scores on
    the lattice are the int64 ``alive_units`` (magnitudes below ``2**62``); candidate ``c`` of
    row ``k`` gets the draw at index ``c`` of lane ``first_row + k``. ``alive_units + Z`` is exact in
    int64 (``|Z| < 2**40`` at the largest scale allowed)."""
    row_starts = np.arange(shape[0]) * shape[1]
    starts = np.searchsorted(alive, row_starts)
    # each contender's row from the rows' runs (alive is sorted): no integer division of every
    # contender (thousands a partition: nearly every candidate can win at small epsilon)
    rows = np.repeat(np.arange(shape[0]), np.diff(starts, append=len(alive)))
    noisy = alive_units + noise.discrete_laplace_at(lap.scale_units, rows + first_row, alive - row_starts[rows])
    return alive[_first_argmax(noisy, starts, rows)] - row_starts


def _first_argmax(values: np.ndarray, starts: np.ndarray, segment: np.ndarray) -> np.ndarray:
    """Position of the first largest value of every segment ``values[starts[i]:starts[i+1]]``
    (``np.argmax`` per segment; segments non-empty, values not NaN); ``segment`` is each
    value's segment number."""
    maxima = np.maximum.reduceat(values, starts)
    at_max = np.flatnonzero(values == maxima[segment])
    return at_max[np.searchsorted(at_max, starts)]


def contenders(units: np.ndarray, scale_units: float) -> np.ndarray:
    """Indices of the scores that can be Report-Noisy-Max's answer, in increasing order.

    ``units`` are the scores in lattice units (integers: int64, or integral floats below
    ``2**53``), the values integer draws are added to, and ``scale_units`` the draws' scale.
    Every draw of :meth:`~dpsql.noise.NoiseSource.discrete_laplace` satisfies
    ``|Z| <= bound`` (:func:`~dpsql.mechanisms.laplace.draw_bound`). If ``k_i < max_j k_j - 2 bound`` then
    ``k_i + Z_i <= k_i + bound < k_max - bound <= k_max + Z_max`` for *every* outcome of the
    noise: candidate ``i`` is strictly below another one, so it is never the (first) argmax.
    The argmax over the others, taken in their original order (so ties still go to the first
    index), is therefore the argmax over all candidates for every noise vector, and it
    depends only on the others' draws, which are i.i.d. exactly as before: drawing noise for
    the contenders only leaves the output distribution unchanged, exactly.

    The argument needs every noisy value ``k_i + Z_i`` computed exactly (no rounding that
    could turn a strict inequality into a tie), as :func:`report_noisy_max_rows` computes
    them (int64). A 2-D ``units`` holds independent rows (one per partition): each row is
    pruned on its own and the flat (row-major) indices are returned.

    Examples
    --------
    >>> contenders(np.array([0, 1000, 990, 700]), 1.0)  # bound 74: keep >= 1000 - 148
    array([1, 2])
    >>> contenders(np.array([0, 1000]), 10.0)  # bound 735: both can win
    array([0, 1])
    >>> contenders(np.array([[0, 1000, 990, 700], [5, 0, 0, 0]]), 1.0)
    array([1, 2, 4, 5, 6, 7])
    """
    if not units.size:
        return np.arange(units.size)
    top = units.max(axis=-1, keepdims=True)
    return np.flatnonzero(units >= top - 2 * draw_bound(scale_units))


#: ``levels_for_nm`` choices: the paper's ``log_fanout(r)`` or the reference code's ``int(log_fanout r) + 1``.
NM_LEVELS = ("paper", "code")


def nm_slope(m: int, *, epsilon_perturber: float, r: int, fanout: int = 16, c: float = 60.0,
             levels_for_nm: str = "paper") -> float:
    """Noise-error coefficient of ToPS Eq. 6: ``3 m / (c r eps) * sqrt(2 (fanout - 1) levels^3)``.

    ``levels`` is ``log_fanout(r)`` (paper) or ``int(log_fanout r) + 1`` (reference code, where
    ``r`` is the stream length ``n - m``).

    >>> round(nm_slope(65536, epsilon_perturber=0.05, r=2**20), 4)
    3.8273
    >>> round(nm_slope(65536, epsilon_perturber=0.05, r=2**20, levels_for_nm="code"), 4)
    5.0312
    """
    if levels_for_nm == "paper":
        levels = math.log(r) / math.log(fanout)
    else:
        levels, span = 0, 1
        while span * fanout <= r:
            levels, span = levels + 1, span * fanout
        levels += 1
    return 3.0 * m / (c * r * epsilon_perturber) * math.sqrt(2.0 * (fanout - 1) * levels**3)


def default_step(upper: float) -> float:
    """Candidate spacing when none is given: the paper's integer grid ``1, 2, ..., B`` when ``B``
    is a whole number from 64 to 65,536; otherwise 1,024 evenly spaced candidates ``B/1024, ..., B``
    (a bound that small or fractional says nothing about integer data, and one that large
    would make the grid needlessly long).

    >>> default_step(2000.0), default_step(1.0), default_step(1e9)
    (1.0, 0.0009765625, 976562.5)
    """
    if float(upper).is_integer() and 64 <= upper <= 65536:
        return 1.0
    return upper / 1024


# Cached: a partitioned release chooses one threshold per partition on the same public grid.
@functools.lru_cache(maxsize=16)
def candidate_grid(upper: float, step: float) -> np.ndarray:
    """The threshold candidates ``step, 2 step, ..., upper`` (the last one capped at ``upper``),
    increasing; read-only (shared between calls).

    >>> candidate_grid(2.5, 1.0)
    array([1. , 2. , 2.5])
    """
    count = max(1, math.ceil(upper / step - 1e-9))
    candidates = np.minimum(step * np.arange(1, count + 1), upper)
    candidates.flags.writeable = False
    return candidates


def nm_scores(holdout: np.ndarray, candidates: np.ndarray, slope: float, *,
              increasing: bool | None = None, is_sorted: bool = True) -> np.ndarray:
    """ToPS Eq. 6 scores ``q(theta) = -slope * theta - m_theta``, ``m_theta = #{v > theta}``.

    Replacing one value moves every ``m_theta`` by at most 1 and all in the same direction,
    so the scores have sensitivity 1 and are monotone. ``increasing=True`` says the
    candidates increase (a :func:`candidate_grid`), which is otherwise checked. A 2-D
    ``holdout`` holds one partition's hold-out per row and gives one row of scores per
    partition; ``is_sorted`` says whether its rows are sorted (they are sorted here when
    the counting needs it).

    >>> nm_scores(np.array([1., 1, 2, 2, 3, 3, 4, 5, 9, 20]), np.array([3., 4, 5, 6, 9]), 0.5)
    array([-5.5, -5. , -4.5, -5. , -5.5])
    """
    candidates = np.asarray(candidates, dtype=np.float64)
    if increasing is None:
        increasing = not np.any(candidates[1:] < candidates[:-1])
    above = holdout.shape[-1] - _count_not_above(holdout, candidates, increasing=increasing, is_sorted=is_sorted)
    return -slope * candidates - above


def score_units(holdout: np.ndarray, candidates: np.ndarray, public: np.ndarray, lap: LaplaceLattice, *,
                is_sorted: bool = True, clipped: str = "count") -> np.ndarray:
    """The scores ``public - m_theta`` of increasing ``candidates`` (``m_theta = #{v > theta}`` on
    the hold-out, ``public`` a finite data-independent part per candidate) in the lattice units of
    ``lap`` (the sensitivity-1 :func:`noisy_max_lattice`), exactly (int64), less a public constant.
    ``clipped="excess"`` puts the clipped excess :func:`excess_units` in place of the count: each
    value adds between 0 and ``1 / gamma`` units to it, more for a larger value, so everything
    below holds for it word for word.

    The public part does not depend on the data, so rounding it to the lattice first is a
    public change of the scoring function; the private part ``m_theta / gamma`` is an exact
    integer (``1 / gamma`` is a power of two). Replacing one value moves every score by at
    most ``1 / gamma`` units, all in the same direction: the sensitivity is exactly 1
    (``1 / gamma`` units, within the ``1 / gamma + 1`` units ``lap``'s scale is calibrated for)
    and the scores are monotone, at any magnitude. Report-Noisy-Max over these units has
    exactly the distribution of the ideal mechanism on the rounded scores, at the same
    privacy cost.

    The public parts are taken relative to the largest one (a constant shift, which no
    argmax sees) and raised to at most ``m / gamma + 2 b + 1`` units below it (``m`` the
    hold-out length, ``b`` the largest draw): a candidate that low scores below
    ``-m / gamma - 2 b`` whatever the data, where the candidate with the largest public part
    scores at least ``-m / gamma``, so it is never a :func:`contenders` member either way.
    All units therefore stay small whatever the public parts, and int64 is exact.

    >>> lap = noisy_max_lattice(1.0)
    >>> score_units(np.array([1., 5, 9]), np.array([2., 4, 8]), np.array([0., -0.5, -1.75]), lap) / 4096
    array([-2.  , -2.5 , -2.75])
    """
    inverse_gamma = round(1.0 / lap.granularity)
    public = np.rint(np.asarray(public, dtype=np.float64) / lap.granularity)
    if not np.all(np.isfinite(public)):
        raise InvalidParameter(f"Noisy-Max scores overflow: a public part is {public[~np.isfinite(public)][0]!r}")
    public -= public.max()
    reach = holdout.shape[-1] * inverse_gamma + 2 * draw_bound(lap.scale_units) + 1
    np.maximum(public, -reach, out=public)
    if clipped == "excess":
        return public.astype(np.int64) - excess_units(holdout, candidates, inverse_gamma)
    # -m_theta / gamma = (#{v <= theta} - m) / gamma: the hold-out length joins the public part
    units = _count_not_above(holdout, candidates, increasing=True, is_sorted=is_sorted)
    units *= inverse_gamma
    units += public.astype(np.int64) - holdout.shape[-1] * inverse_gamma
    return units


#: What a threshold's score counts against each candidate: the values above it (``"count"``), or
#: their excess above it in thresholds, at most one per value (``"excess"``, :func:`excess_units`).
CLIPPED = ("count", "excess")
#: Below ``_SURELY_DOUBLE * v`` a candidate ``theta`` has ``v - theta >= theta`` with room to spare
#: for float rounding, so its term is a whole unit without being computed.
_SURELY_DOUBLE = 0.49


def excess_units(holdout: np.ndarray, candidates: np.ndarray, inverse_gamma: int) -> np.ndarray:
    """``sum_v rint(inverse_gamma * min(v - theta, theta) / theta)`` over the values ``v > theta``
    of each row of ``holdout`` (values >= 0), for every increasing positive candidate ``theta``
    (int64): the clipped excess, each value's part above ``theta`` in thresholds, at most one, on
    the lattice of ``1 / inverse_gamma``.

    Each value's term lies in ``[0, inverse_gamma]`` and never decreases as the value grows (a
    float difference, a division by the same ``theta`` and ``rint`` are monotone): replacing one
    value moves every sum by at most ``inverse_gamma``, all in the same direction. A value is
    computed against the candidates within a factor of about two below it only (8 of them on a
    grid of 8 per octave); further below, its term is a whole unit (:data:`_SURELY_DOUBLE`), and
    those are counted. O(m) per row for a geometric grid.

    >>> excess_units(np.array([[1.0, 3.0, 10.0]]), np.array([2.0, 4.0, 8.0]), 4)  # 1/2 + 1, 1, 1/4
    array([[6, 4, 1]])
    """
    rows = holdout.reshape(-1, holdout.shape[-1])
    per_block = max(1, _EXCESS_VALUES_AT_ONCE // max(rows.shape[1], 1))
    blocks = [_excess_block(rows[a:a + per_block], candidates, inverse_gamma) for a in range(0, len(rows), per_block)]
    units = np.concatenate(blocks) if blocks else np.zeros((0, len(candidates)), dtype=np.int64)
    return units.reshape((*holdout.shape[:-1], len(candidates)))


#: Hold-out values whose clipped excess is computed at once: about 8 terms each (a few tens of MB).
_EXCESS_VALUES_AT_ONCE = 1 << 18


def _excess_block(rows: np.ndarray, candidates: np.ndarray, inverse_gamma: int) -> np.ndarray:
    """:func:`excess_units` of the 2-D ``rows``."""
    k, size = len(rows), len(candidates)
    flat = rows.ravel()
    near = _places(candidates, flat)  # #{theta < v}: the candidates v is above
    whole = _places(candidates, flat * _SURELY_DOUBLE)  # the candidates certainly half v or less
    row = np.repeat(np.arange(k), rows.shape[1])
    # whole units: candidate j gets one from every value with whole > j
    landed = np.bincount(whole + (size + 1) * row, minlength=k * (size + 1)).reshape(k, size + 1)
    units = (rows.shape[1] - np.cumsum(landed, axis=1)[:, :-1]) * inverse_gamma
    # the candidates in [whole, near) of each value: its term computed
    spans = near - whole
    owner = np.repeat(np.arange(len(flat)), spans)
    at = np.arange(len(owner)) - np.repeat(np.cumsum(spans) - spans, spans) + whole[owner]
    theta = candidates[at]
    terms = np.rint(np.minimum(flat[owner] - theta, theta) / theta * inverse_gamma)
    units += np.bincount(at + size * row[owner], weights=terms, minlength=k * size).reshape(k, size).astype(np.int64)
    return units


def _count_not_above(holdout: np.ndarray, candidates: np.ndarray, *, increasing: bool,
                     is_sorted: bool) -> np.ndarray:
    """``#{v <= theta}`` for every candidate (and every row of a 2-D ``holdout``), by placing
    the shorter array in the longer.

    For increasing candidates and fewer hold-out values than candidates (ToPS on short
    partitions: thousands of values, 8,000 grid points), each value ``v`` is placed among the
    candidates instead: it is at or below exactly the candidates after the ``#{theta < v}``
    first ones, so the counts are prefix sums of how many values land at each place (no sort
    needed; the rows of a 2-D hold-out land in disjoint ranges of one count). Both ways count
    the same set.
    """
    rows = holdout.reshape(-1, holdout.shape[-1])
    (k, m), size = rows.shape, len(candidates)
    if m >= size or not increasing:
        if not is_sorted:
            rows = np.sort(rows, axis=1)
        counts = np.stack([np.searchsorted(row, candidates, side="right") for row in rows])
    else:
        places = _places(candidates, rows.ravel()).reshape(k, m)
        places += (size + 1) * np.arange(k)[:, None]
        landed = np.bincount(places.ravel(), minlength=k * (size + 1)).reshape(k, size + 1)
        counts = np.cumsum(landed[:, :-1], axis=1)
    return counts.reshape((*holdout.shape[:-1], size))


def _places(candidates: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``np.searchsorted(candidates, values, side="left")`` (``#{theta < v}``) for increasing candidates.

    On a grid ``s, 2 s, ..., K s`` with ``s`` a power of two (ToPS's default integer grid,
    ``s = 1``) the place is ``ceil(v / s) - 1`` clipped to ``[0, K]``, exactly: dividing by a
    power of two and ``ceil`` do not round. Otherwise the place of each value is guessed as if
    the candidates were evenly spaced like their first two, checked against the candidates on
    both sides, and searched for where the check fails: exact for any increasing candidates,
    and faster than a search per value when the guess holds.
    """
    k = len(candidates)
    if k < 2 or not candidates[1] > candidates[0]:
        return np.searchsorted(candidates, values, side="left")
    guess = values - candidates[0]
    guess /= candidates[1] - candidates[0]
    np.ceil(guess, out=guess)
    np.clip(guess, 0, k, out=guess)
    places = guess.astype(np.intp)
    if _is_power_of_two_grid(candidates):
        return places
    wrong = (places > 0) & (np.take(candidates, places - 1, mode="clip") >= values)
    wrong |= (places < k) & (np.take(candidates, places, mode="clip") < values)
    misplaced = np.flatnonzero(wrong)
    if misplaced.size:
        places[misplaced] = np.searchsorted(candidates, values[misplaced], side="left")
    return places


def _is_power_of_two_grid(candidates: np.ndarray) -> bool:
    """Are the candidates exactly ``s, 2 s, ..., K s`` with ``s`` a positive power of two?

    Then :func:`_places`'s guess ``ceil((v - s) / s)`` is the place: with ``x = v / s``
    (exact), ``v - s = s (x - 1)`` is exact for ``1 <= x < 2**53`` (``x - 1`` is a multiple of
    the ulp of ``x``), and rounding elsewhere only moves a guess that the clip to ``[0, K]``
    sets right anyway (below ``s`` the place is 0, beyond ``2**53 s`` it is ``K``)."""
    step = float(candidates[0])
    if not (step > 0 and math.frexp(step)[0] == 0.5 and math.isfinite(step * len(candidates))):
        return False
    return bool(np.array_equal(candidates, step * np.arange(1, len(candidates) + 1)))


#: Scores (partitions x candidates) computed at once: bounds the memory of many partitions,
#: and a group this size stays in cache while it is scored and pruned.
_SCORES_AT_ONCE = 1 << 18


def nm_threshold(holdout_sorted: np.ndarray, *, epsilon: float, upper: float, epsilon_perturber: float, r: int,
                 fanout: int = 16, c: float = 60.0, step: float | None = None, levels_for_nm: str = "paper",
                 noise: LaneDraws) -> float:
    """ToPS threshold optimizer (ToPS §4.2, phase 1): Report-Noisy-Max over Eq. 6.

    Balances the hierarchy's noise, which grows with the threshold, against the truncation
    bias ``#{v > theta}`` on the sorted hold-out (values in ``[0, upper]``). Candidates are
    ``step, 2 step, ..., upper`` (the last one capped at ``upper``; default step: see
    :func:`default_step`).

    Privacy: ``epsilon``-DP on the hold-out (replace-one-value neighbours): Report-Noisy-Max
    with sensitivity 1 on monotone scores; only the chosen candidate is released.
    ``epsilon_perturber`` is the budget of the stream phase the threshold is for; it enters the
    scores as a public constant.

    Examples
    --------
    >>> import dpsql
    >>> holdout = np.sort(np.r_[np.full(990, 10.0), np.full(10, 1000.0)])
    >>> with dpsql.testing.seeded(3) as keys:
    ...     theta = nm_threshold(holdout, epsilon=5.0, upper=1000.0, epsilon_perturber=0.1, r=4096,
    ...                          noise=keys.partition().lane(dpsql.noise.Lane.NOISY_MAX))
    >>> theta
    10.0
    """
    return float(nm_thresholds(np.asarray(holdout_sorted)[None], epsilon=epsilon, upper=upper,
                               epsilon_perturber=epsilon_perturber, r=r, fanout=fanout, c=c, step=step,
                               levels_for_nm=levels_for_nm, noise=BatchLaneDraws.of(noise))[0])


def nm_thresholds(holdouts: np.ndarray, *, epsilon: float, upper: float, epsilon_perturber: float, r: int,
                  fanout: int = 16, c: float = 60.0, step: float | None = None, levels_for_nm: str = "paper",
                  is_sorted: bool = True, noise: BatchLaneDraws) -> np.ndarray:
    """:func:`nm_threshold` for every row of ``holdouts`` (partitions' hold-outs of one length,
    row ``k`` drawing from ``noise``'s partition ``k``), each with exactly the distribution it
    has alone (see :func:`report_noisy_max_rows`), by :func:`noisy_max_thresholds`.
    """
    candidates = candidate_grid(upper, default_step(upper) if step is None else step)
    slope = nm_slope(holdouts.shape[1], epsilon_perturber=epsilon_perturber, r=r, fanout=fanout, c=c,
                     levels_for_nm=levels_for_nm)
    with np.errstate(over="ignore"):  # refused by score_units, before any draw
        public = -slope * candidates
    return noisy_max_thresholds(holdouts, candidates, public, epsilon=epsilon, is_sorted=is_sorted, noise=noise)


def noisy_max_thresholds(holdouts: np.ndarray, candidates: np.ndarray, public: np.ndarray, *, epsilon: float,
                         is_sorted: bool, noise: BatchLaneDraws, clipped: str = "count") -> np.ndarray:
    """Report-Noisy-Max over the scores ``public - #{v > theta}`` of increasing ``candidates``
    (``public`` data-independent and finite; ``clipped="excess"``: the clipped excess
    :func:`excess_units` in place of the count) for every row of ``holdouts``, row ``k`` drawing
    from ``noise``'s partition ``k``: the chosen candidate of each row.

    Privacy: ``epsilon``-DP on each row (replace-one-value neighbours): the scores have
    sensitivity 1 and are monotone (:func:`score_units`), only the chosen candidate is released.

    Rows are scored, pruned and given their draws in groups of about ``2**18`` scores
    (cache-sized): arrays as large as all partitions' candidates are never made (with
    thousands of partitions, nearly every candidate can win, and memory fresh from the system
    costs more than the arithmetic). Scores are formed in lattice units exactly
    (:func:`score_units`), so the noisy argmax is exact for any candidates and epsilon.
    """
    lap = noisy_max_lattice(epsilon)
    group = max(1, _SCORES_AT_ONCE // len(candidates))
    chosen = np.empty(len(holdouts), dtype=np.int64)
    for a in range(0, len(holdouts), group):
        units = score_units(holdouts[a:a + group], candidates, public, lap, is_sorted=is_sorted, clipped=clipped)
        alive = contenders(units, lap.scale_units)
        chosen[a:a + group] = _noisy_argmax(units.ravel()[alive], alive, units.shape, lap, noise, first_row=a)
    return candidates[chosen]
