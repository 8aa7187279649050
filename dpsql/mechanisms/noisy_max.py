"""Report-Noisy-Max (ALGORITHMS.md P2) and the ToPS threshold optimizer built on it (4.2).

Privacy cost: ``epsilon``-DP (pure) for scores whose sensitivity is ``sensitivity``.
When every score moves in the same direction on a neighbouring input
(``monotonic=True``) the noise scale is ``sensitivity / epsilon``; otherwise it is
``2 * sensitivity / epsilon`` (Dwork & Roth, Claim 3.9). Only the index is released.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from dpsql.mechanisms.laplace import LaplaceLattice
from dpsql.noise import MAX_NEG_LOG_UNIFORM, NoiseSource

# Relative slack on the draw bound: covers the rounding of log, of MAX_NEG_LOG_UNIFORM and
# of the product (a few ulps, ~1e-15) many times over.
_BOUND_SLACK = 1.0 + 2.0**-40


def report_noisy_max(scores: np.ndarray, *, epsilon: float, noise: NoiseSource,
                     sensitivity: float = 1.0, monotonic: bool = True) -> int:
    """Index of the largest ``score + Laplace`` (lattice noise, see :mod:`.laplace`).

    Noise is drawn only for the :func:`contenders`, the candidates that can still win
    whatever the noise; the output distribution is exactly that of drawing noise for every
    candidate (see :func:`contenders`). The work done, and so the run time, therefore
    depends on the scores: a timing side channel of the same kind as any data-dependent
    sort, visible only to whoever times the call.

    Examples
    --------
    >>> import dpsql
    >>> with dpsql.testing.seeded(0) as source:
    ...     report_noisy_max(np.array([0.0, 100.0, 3.0]), epsilon=10.0, noise=source)
    1
    """
    # Non-monotone scores need twice the scale of the *rounded* score change (lattice slack
    # included): halving epsilon doubles both, where doubling the sensitivity would not.
    lap = LaplaceLattice(sensitivity=sensitivity, epsilon=epsilon if monotonic else epsilon / 2)
    scores = np.asarray(scores, dtype=np.float64)
    alive = contenders(np.rint(scores / lap.granularity), lap.scale_units)
    return int(alive[np.argmax(lap.release(scores[alive], noise))])


def contenders(units: np.ndarray, scale_units: float) -> np.ndarray:
    """Indices of the scores that can be Report-Noisy-Max's answer, in increasing order.

    ``units`` are the scores rounded to the lattice (integral floats), the values
    :meth:`~dpsql.mechanisms.laplace.LaplaceLattice.release` adds integer draws to, and
    ``scale_units`` the draws' scale. Every draw of
    :meth:`~dpsql.noise.NoiseSource.discrete_laplace` satisfies
    ``|Z| <= b = scale_units * MAX_NEG_LOG_UNIFORM`` (:mod:`dpsql.noise`); ``bound`` below is
    ``b`` rounded up with a relative slack. If ``k_i < max_j k_j - 2 bound`` then
    ``k_i + Z_i <= k_i + bound < k_max - bound <= k_max + Z_max`` for *every* outcome of the
    noise: candidate ``i`` is strictly below another one, so it is never the (first) argmax.
    The argmax over the others, taken in their original order (so ties still go to the first
    index), is therefore the argmax over all candidates for every noise vector, and it
    depends only on the others' draws, which are i.i.d. exactly as before: drawing noise for
    the contenders only leaves the output distribution unchanged, exactly.

    The argument needs every noisy value ``k_i + Z_i`` exact in float64 (no rounding that
    could turn a strict inequality into a tie): when ``max |k| + bound`` reaches ``2**53``
    (or a score is not finite) every index is returned.

    Examples
    --------
    >>> contenders(np.array([0.0, 1000.0, 990.0, 700.0]), 1.0)  # bound 74: keep >= 1000 - 148
    array([1, 2])
    >>> contenders(np.array([0.0, 1000.0]), 10.0)  # bound 735: both can win
    array([0, 1])
    """
    bound = math.ceil(scale_units * MAX_NEG_LOG_UNIFORM * _BOUND_SLACK)
    if not units.size or not float(np.abs(units).max()) + bound < 2.0**53:
        return np.arange(units.size)
    return np.flatnonzero(units >= float(units.max()) - 2 * bound)


#: ``levels_for_nm`` choices: the paper's ``log_fanout(r)`` or the reference code's ``int(log_fanout r) + 1``.
NM_LEVELS = ("paper", "code")


def nm_slope(m: int, *, epsilon_perturber: float, r: int, fanout: int = 16, c: float = 60.0,
             levels_for_nm: str = "paper") -> float:
    """Noise-error coefficient of ToPS Eq. 6: ``3 m / (c r eps) * sqrt(2 (fanout - 1) levels^3)``.

    ``levels`` is ``log_fanout(r)`` (paper) or ``int(log_fanout r) + 1`` (reference code, where
    ``r`` is the stream length ``n - m``); ALGORITHMS.md 4.5.2.

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


def nm_scores(holdout_sorted: np.ndarray, candidates: np.ndarray, slope: float, *,
              increasing: bool | None = None) -> np.ndarray:
    """ToPS Eq. 6 scores ``q(theta) = -slope * theta - m_theta``, ``m_theta = #{v > theta}``.

    Replacing one value moves every ``m_theta`` by at most 1 and all in the same direction,
    so the scores have sensitivity 1 and are monotone. ``increasing=True`` says the
    candidates increase (a :func:`candidate_grid`), which is otherwise checked.

    >>> nm_scores(np.array([1., 1, 2, 2, 3, 3, 4, 5, 9, 20]), np.array([3., 4, 5, 6, 9]), 0.5)
    array([-5.5, -5. , -4.5, -5. , -5.5])
    """
    candidates = np.asarray(candidates, dtype=np.float64)
    if increasing is None:
        increasing = not np.any(candidates[1:] < candidates[:-1])
    return -slope * candidates - _count_above(holdout_sorted, candidates, increasing=increasing)


def _count_above(holdout_sorted: np.ndarray, candidates: np.ndarray, *, increasing: bool) -> np.ndarray:
    """``#{v > theta}`` for every candidate, by placing the shorter array in the longer.

    For increasing candidates and fewer hold-out values than candidates (ToPS on short
    partitions: thousands of values, 8,000 grid points), each value ``v`` is placed among the
    candidates instead: it is above exactly the ``#{theta < v}`` first ones, so the counts are
    suffix sums of how many values land at each place. Both ways count the same set.
    """
    m = len(holdout_sorted)
    if m >= len(candidates) or not increasing:
        return m - np.searchsorted(holdout_sorted, candidates, side="right")
    landed = np.bincount(_places(candidates, holdout_sorted), minlength=len(candidates) + 1)
    return m - np.cumsum(landed[:-1])


def _places(candidates: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``np.searchsorted(candidates, values, side="left")`` (``#{theta < v}``) for increasing candidates.

    The place of each value is guessed as if the candidates were evenly spaced like their
    first two (ToPS's grid, where the guess is off only where division rounds), checked
    against the candidates on both sides, and searched for where the check fails: exact for
    any increasing candidates, and faster than a search per value when the guess holds.
    """
    k = len(candidates)
    if k < 2 or not candidates[1] > candidates[0]:
        return np.searchsorted(candidates, values, side="left")
    guess = values - candidates[0]
    guess /= candidates[1] - candidates[0]
    np.ceil(guess, out=guess)
    np.clip(guess, 0, k, out=guess)
    places = guess.astype(np.intp)
    wrong = (places > 0) & (np.take(candidates, places - 1, mode="clip") >= values)
    wrong |= (places < k) & (np.take(candidates, places, mode="clip") < values)
    misplaced = np.flatnonzero(wrong)
    if misplaced.size:
        places[misplaced] = np.searchsorted(candidates, values[misplaced], side="left")
    return places


def nm_threshold(holdout_sorted: np.ndarray, *, epsilon: float, upper: float, epsilon_perturber: float, r: int,
                 fanout: int = 16, c: float = 60.0, step: float | None = None, levels_for_nm: str = "paper",
                 noise: NoiseSource) -> float:
    """ToPS threshold optimizer (ALGORITHMS.md 4.2 Phase 1): Report-Noisy-Max over Eq. 6.

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
    >>> with dpsql.testing.seeded(3) as source:
    ...     theta = nm_threshold(holdout, epsilon=5.0, upper=1000.0, epsilon_perturber=0.1, r=4096, noise=source)
    >>> theta
    10.0
    """
    candidates = candidate_grid(upper, default_step(upper) if step is None else step)
    slope = nm_slope(len(holdout_sorted), epsilon_perturber=epsilon_perturber, r=r, fanout=fanout, c=c,
                     levels_for_nm=levels_for_nm)
    scores = nm_scores(holdout_sorted, candidates, slope, increasing=True)
    return float(candidates[report_noisy_max(scores, epsilon=epsilon, noise=noise)])
