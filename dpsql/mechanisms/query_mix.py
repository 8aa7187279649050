"""A clipping threshold chosen for what the release is for: Report-Noisy-Max over a score
whose penalty for a larger threshold comes from the range sums the release should answer
(docs/algorithms.md, "tops").

Privacy cost: :func:`mix_thresholds` is ``epsilon``-DP on each hold-out (replace-one-value
neighbours, values in the public ``[0, upper]``): Report-Noisy-Max with sensitivity 1 on
monotone scores (derivation below); only the chosen candidate is released. Everything else
here (the query mix, the penalty, the candidates) is a function of public parameters.

The objective
-------------
A range of ``L`` rows released by a hierarchy clipped at ``theta`` is off by the noise, of
variance ``V theta**2`` (``V``, the *unit variance*, is the hierarchy's exact noise variance
of such a range at bound 1, public), and by the clipping: about ``L c / m`` of its rows exceed
``theta`` when ``c`` of the ``m`` hold-out values do, each by about ``theta`` (a heavy tail's
excess above a high threshold is of the threshold's order). Its squared error is modelled as

    MSE_L(theta) = theta**2 * (V + (L c / m)**2 + L c / m)       (noise, squared bias, its variance)

and ``log MSE_L`` moves by ``2`` per unit of ``log theta`` and by ``A' / (V + A)`` per value
counted above (``A(c) = (L c / m)**2 + L c / m``). The score

    q(theta) = -#{v > theta} - beta * ln(theta)

is the tangent of ``log MSE_L``, in counts, where ``beta = 2 (V + A) / A'``: raising the
threshold by a factor ``e`` is worth ``beta`` values clipped. Over counts that ratio is
smallest, ``beta_L = (m / L) sqrt(4 V - 1)`` (``2 V m / L`` when ``V < 1/2``), at the count
where bias and noise balance; a release for several lengths minimises the sum of their
``log MSE`` (so each length is weighed by its ratio to its own best), whose tangent penalty
is the harmonic mean of the ``beta_L``.

The selection's own noise (Laplace of scale ``1 / epsilon`` on every score) can lift a
candidate ``delta`` above a better one only by beating ``beta * delta``. ``beta`` is therefore
at least ``STABILITY * max(1 / epsilon, 1)``: over the candidates (8 per octave) more than
``sqrt(5)`` times above a better candidate (5 times its noise variance), the chances of beating
it add up to at most 10 %. The floor at ``epsilon = 1`` is the hold-out's own noise: another
sample of ``m`` values would put about ``c +- sqrt(c)`` above a threshold where this one puts
``c``, so near the top of the hold-out (``c`` about 1) its counts are as unsure as Laplace noise
of scale 1, whatever the budget. ``beta`` is at most ``m / (2 ln(upper / lowest candidate))``,
so that no candidate with more than half the hold-out above it can outscore ``upper``.

The floor moves the choice: where it raises ``beta`` above the mix's own ``beta_mix``, Noisy Max
settles where the count falls by ``beta``, not ``beta_mix``, per unit of ``ln theta``, about
``beta / beta_mix`` times as many values above it as the mix wants. Under the model's own tail
(a value above ``theta`` exceeds it by about ``theta``: a Pareto tail of index 2, whose count
above ``theta`` falls as ``theta**-2``) the mix's threshold is ``sqrt(beta / beta_mix)`` times
that choice, and that is the threshold released (:meth:`QueryMix.lift`: public, so
post-processing). This matters where the hold-out is short against the ranges asked: at
epsilon 1 a 4096-row hold-out for ranges of ``2**20`` rows has ``beta_mix`` 0.6 against the
floor's 9.1, and the floor's own choice clipped about 15 times the values those ranges can
bear. Where the cap lowers ``beta`` below ``beta_mix`` nothing is lifted or lowered: the tail
model is for the top of the hold-out, and the cap acts in its bulk.

What is counted above a candidate (:attr:`QueryMix.clipped`). The count ``c`` stands for the
clipped mass at one threshold per value: right on the model's own tail, on average, but a value
just above ``theta`` loses far less. Calendar totals (``focus="mixed"`` on a calendar layout) count
the *clipped excess* instead, ``E(theta) = sum_v min(v - theta, theta)+ / theta``: each value's part
above ``theta`` in thresholds, at most one (:func:`~dpsql.mechanisms.noisy_max.excess_units`). It
is exact for every value up to ``2 theta`` and equals the count for the values beyond, so it is
never further from the clipped mass than the count is, value by value; in the formulas above
``E`` takes ``c``'s place (on a tail of index 2, ``E`` falls as ``theta**-2`` too, and the lift
stands). Calendar totals are short: their ``beta`` (about 140) puts the choice where a few percent
of the hold-out is clipped, a part of the tail the hold-out shows, whose values mostly lie within
a threshold of it; on a light tail the count there books each by a whole threshold, several times
their excess, and the threshold came out 1.3 to 1.4 times what daily totals can bear
(docs/algorithms.md). Long ranges keep the count: their ``beta`` (1 to 10) puts the choice among
the hold-out's few largest values, where the mass that matters is the tail beyond what the
hold-out shows, which only the tail model (one threshold per value clipped) speaks for, and the
excess, capped at one threshold, would read it as half that: it chose thresholds too low for long
ranges (BENCHMARKS.md, threshold section).

Sensitivity: ``#{v > theta}`` moves by at most 1 for every ``theta`` when one value is
replaced, all counts in the same direction; so does ``E(theta)``, each value's term lying in
``[0, 1]`` and never falling as the value grows. ``beta * ln(theta)`` does not depend on the
data. The scores have sensitivity 1 and are monotone, so Report-Noisy-Max with Laplace noise of
scale ``1 / epsilon`` is ``epsilon``-DP (Dwork and Roth, Claim 3.9), exactly as for ToPS Eq. 6,
whose linear penalty ``slope * theta`` this replaces.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from dpsql.errors import InvalidParameter
from dpsql.mechanisms.noisy_max import CLIPPED, excess_units, nm_scores, noisy_max_lattice, noisy_max_thresholds
from dpsql.noise import BatchLaneDraws

#: The rows a release's ranges are taken to fall in when it has fewer, or when its length is unknown
#: (a stream's): 2**16, about seven years of hourly rows (:func:`ranges_span`).
DEFAULT_SPAN = 1 << 16
#: Long ranges in :data:`FOCUS_LENGTHS`: ranges anywhere in the release's span (:func:`focus_lengths`).
LONG = "long"
#: What a release is for (``focus=``): the lengths, in rows, of the range sums it should answer
#: well. ``"mixed"``: a day, a week and a month of hourly rows, and long ranges (on a calendar
#: layout :data:`CALENDAR_TOTALS` instead); ``"windows"``: a day and a week; ``"long"``: long ranges.
FOCUS_LENGTHS: dict[str, tuple[int | str, ...]] = {"mixed": (24, 168, 730, LONG), "windows": (24, 168),
                                                   "long": (LONG,)}
#: ``focus="mixed"`` on a calendar layout (rows on a time grid, blocks of days, levels of months and
#: years): the calendar totals that layout is for, whole UTC days, weeks and months of the grid's rows
#: (:func:`focus_lengths`).
CALENDAR_TOTALS = ("day", "week", "month")
#: Every ``focus=``: the query mixes, and ``"paper"``, ToPS Eq. 6 as published (:mod:`.noisy_max`).
FOCUSES = (*FOCUS_LENGTHS, "paper")
#: The options of ToPS Eq. 6 alone (``focus="paper"``).
PAPER_OPTIONS = ("c", "step", "levels_for_nm")


def refuse_paper_options(focus: str, options: dict) -> None:
    """Refuse Eq. 6's own options (:data:`PAPER_OPTIONS` in ``options`` that are not None) with any
    other ``focus``: they would be ignored.

    >>> refuse_paper_options("mixed", {"c": 30.0, "step": None})
    Traceback (most recent call last):
    ...
    dpsql.errors.InvalidParameter: c applies to ToPS Eq. 6 alone (focus='paper'), not to focus='mixed'
    """
    given = [k for k in PAPER_OPTIONS if options.get(k) is not None]
    if focus != "paper" and given:
        verb = "applies" if len(given) == 1 else "apply"
        raise InvalidParameter(f"{', '.join(given)} {verb} to ToPS Eq. 6 alone (focus='paper'), not to "
                               f"focus={focus!r}")


def ranges_span(rows: int | None, r: int | None) -> int:
    """The rows a release's ranges fall in: its ``rows`` (None: a stream's, unknown when its
    threshold is chosen), at least :data:`DEFAULT_SPAN`, so that a stream and the one-shot release
    of the same rows choose the same threshold up to that length, and at most the range ``r`` the
    release declares (the paper's range).

    >>> ranges_span(None, None), ranges_span(5000, None), ranges_span(2**20, None), ranges_span(2**21, 2**20)
    (65536, 65536, 1048576, 1048576)
    """
    span = max(rows or 0, DEFAULT_SPAN)
    return span if r is None else min(span, r)


def focus_lengths(focus: str, span: int, *, calendar: bool = False) -> tuple[int | str, ...]:
    """The range lengths ``focus`` stands for in a release whose ranges fall in ``span`` rows
    (:func:`ranges_span`): long ranges have both ends anywhere in it and are stood for by their
    root-mean-square length ``span / sqrt(6)`` (their squared clipping bias grows as their length
    squared, so that length carries their mean squared bias); no length is longer than ``span``.

    On a ``calendar`` layout ``"mixed"`` stands for :data:`CALENDAR_TOTALS` instead, named by their
    unit: the totals that layout serves as whole nodes, whatever the grid's step (a day is 24 hourly
    rows, 96 quarter hours). Not long ranges: a calendar layout is chosen for calendar totals
    (``calendar="none"`` keeps row-count blocks for arbitrary long ranges, and ``focus="long"`` asks
    for them), and a long range's clipping error is a small share of its total at any threshold the
    calendar totals can bear, while their log-MSE weighing would give it the same voice as a day's,
    whose noise at a threshold near the hold-out's top is several times the day's total.

    >>> focus_lengths("mixed", 2**16), focus_lengths("mixed", 2**20), focus_lengths("windows", 2**20)
    ((24, 168, 730, 26755), (24, 168, 730, 428079), (24, 168))
    >>> focus_lengths("mixed", 500), focus_lengths("mixed", 2**16, calendar=True)
    ((24, 168, 500, 204), ('day', 'week', 'month'))
    """
    if calendar and focus == "mixed":
        return CALENDAR_TOTALS
    return tuple(max(1, round(span / math.sqrt(6.0))) if length == LONG else min(int(length), span)
                 for length in FOCUS_LENGTHS[focus])


def clipped_measure(lengths: tuple[int | str, ...]) -> str:
    """What a threshold for the range sums ``lengths`` counts above a candidate
    (:attr:`QueryMix.clipped`): the clipped excess for calendar totals alone (every length a unit
    of :data:`CALENDAR_TOTALS`), the count of values otherwise (module docstring).

    >>> clipped_measure(CALENDAR_TOTALS), clipped_measure((24, 168, 730, 26755)), clipped_measure(("day", 24))
    ('excess', 'count', 'count')
    """
    return "excess" if lengths and all(length in CALENDAR_TOTALS for length in lengths) else "count"


#: Candidates per octave: ``upper * 2**(-j / 8)``, so the best candidate is within 9 % of any threshold.
PER_OCTAVE = 8
#: The candidates reach down to ``upper * 2**-20``.
OCTAVES = 20
#: The stability rule's tolerance: a threshold ``sqrt(5)`` times too large has 5 times the noise
#: variance, picked with probability at most 10 % (module docstring).
_TOLERATED_RATIO, _TOLERATED_CHANCE = 5.0, 0.1


@dataclass(frozen=True)
class QueryMix:
    """What a release is for: range sums of ``lengths`` rows, whose noise variance in the
    release clipped at ``theta`` is ``unit_variances * theta**2`` (public: a function of the
    layout and epsilon of the stream phase).

    >>> mix = QueryMix((24, 65536), (0.05, 225.0))
    >>> mix.penalties(4096).round(2)
    array([17.07,  1.87])
    >>> round(mix.penalty(4096, epsilon=0.5), 2)  # the stability floor: 4.56 / 0.5
    9.11
    >>> round(mix.penalty(65536, epsilon=0.5), 2)  # a longer hold-out counts finer: the mix's own
    54.03
    """

    lengths: tuple[int, ...]
    unit_variances: tuple[float, ...]
    #: What a candidate's score counts above it: ``"count"``, the values, or ``"excess"``, their
    #: clipped excess in thresholds (module docstring: calendar totals).
    clipped: str = "count"

    def __post_init__(self):
        if not self.lengths or len(self.lengths) != len(self.unit_variances):
            raise InvalidParameter("a query mix needs one unit variance per range length, and at least one length")
        if self.clipped not in CLIPPED:
            raise InvalidParameter(f"clipped must be one of {CLIPPED}, got {self.clipped!r}")
        if min(self.lengths) < 1 or not all(v > 0 and math.isfinite(v) for v in self.unit_variances):
            raise InvalidParameter(f"a query mix needs lengths >= 1 and positive finite unit variances, got "
                                   f"{self.lengths!r} and {self.unit_variances!r}")

    def penalties(self, m: int) -> np.ndarray:
        """Each length's ``beta_L`` for a hold-out of ``m`` values (module docstring)."""
        v = np.asarray(self.unit_variances, dtype=np.float64)
        per_row = np.where(v >= 0.5, np.sqrt(np.maximum(4.0 * v - 1.0, 0.0)), 2.0 * v)
        return m / np.asarray(self.lengths, dtype=np.float64) * per_row

    def own_penalty(self, m: int) -> float:
        """``beta_mix``: the harmonic mean of :meth:`penalties`."""
        return len(self.lengths) / float(np.sum(1.0 / self.penalties(m)))

    def penalty(self, m: int, *, epsilon: float) -> float:
        """``beta``: :meth:`own_penalty` raised to the stability floor ``STABILITY * max(1 / epsilon, 1)``
        and kept at most ``m / (2 ln 2**OCTAVES)`` (module docstring)."""
        return min(max(self.own_penalty(m), STABILITY * max(1.0 / epsilon, 1.0)), m / (2.0 * OCTAVES * math.log(2.0)))

    def lift(self, m: int, *, epsilon: float) -> float:
        """The factor the chosen candidate is raised by, ``sqrt(beta / beta_mix)`` where :meth:`penalty`
        is above :meth:`own_penalty`, else 1 (module docstring: the floor moves the choice).

        >>> mix = QueryMix((24, 2**20), (0.06, 423.0))  # epsilon 1's unit variances, roughly
        >>> round(mix.own_penalty(4096), 2), round(mix.penalty(4096, epsilon=0.5), 2)
        (0.32, 9.11)
        >>> round(mix.lift(4096, epsilon=0.5), 2)
        5.35
        >>> QueryMix((24,), (500.0,)).lift(4096, epsilon=0.5)  # the cap below the mix's own: none
        1.0
        """
        return math.sqrt(max(self.penalty(m, epsilon=epsilon) / self.own_penalty(m), 1.0))


def _stability_penalty() -> float:
    """The smallest ``y = beta * epsilon`` for which the candidates at least
    ``sqrt(_TOLERATED_RATIO)`` above a better one (``j >= j0`` grid steps of ``ln 2 / 8``) beat
    it with total probability at most ``_TOLERATED_CHANCE`` by the union bound: a difference of
    two Laplace draws of scale ``1 / epsilon`` exceeds ``x`` with probability
    ``exp(-epsilon x) (1 + epsilon x / 2) / 2``, and candidate ``j`` must overcome ``beta j ln 2 / 8``.

    >>> round(_stability_penalty(), 2)
    4.56
    """
    per_nat = PER_OCTAVE / math.log(2.0)
    first = math.ceil(per_nat * 0.5 * math.log(_TOLERATED_RATIO))
    steps = np.arange(first, first + 50 * PER_OCTAVE * OCTAVES) / per_nat

    def chance(y):
        return float(np.sum(0.5 * np.exp(-y * steps) * (1.0 + y * steps / 2.0)))

    low, high = 0.0, 64.0
    for _ in range(60):
        middle = 0.5 * (low + high)
        low, high = (middle, high) if chance(middle) > _TOLERATED_CHANCE else (low, middle)
    return high


#: ``beta * epsilon`` at least this (:func:`_stability_penalty`).
STABILITY = _stability_penalty()


# Cached: a partitioned release chooses one threshold per partition on the same public grid.
@functools.lru_cache(maxsize=16)
def mix_candidates(upper: float) -> np.ndarray:
    """The candidates ``upper * 2**(-j / PER_OCTAVE)``, ``j = PER_OCTAVE * OCTAVES, ..., 0``,
    increasing, the last one ``upper`` itself; read-only (shared between calls).

    >>> mix_candidates(1000.0)[-3:]
    array([ 840.89641525,  917.0040432 , 1000.        ])
    """
    exponents = np.arange(PER_OCTAVE * OCTAVES, -1, -1)
    candidates = upper * np.exp2(-exponents / PER_OCTAVE)
    candidates[-1] = upper
    if not (np.all(np.isfinite(candidates)) and candidates[0] > 0 and np.all(np.diff(candidates) > 0)):
        raise InvalidParameter(f"upper={upper!r} leaves no increasing positive threshold candidates "
                               f"upper * 2**(-j / {PER_OCTAVE}) down to 2**-{OCTAVES} of it")
    candidates.flags.writeable = False
    return candidates


def _public_scores(penalty: float) -> np.ndarray:
    """``-penalty * ln(theta)`` on :func:`mix_candidates`, less the public constant ``-penalty * ln(upper)``."""
    return penalty * np.arange(PER_OCTAVE * OCTAVES, -1, -1) * (math.log(2.0) / PER_OCTAVE)


def mix_scores(holdout_sorted: np.ndarray, *, upper: float, penalty: float, clipped: str = "count") -> np.ndarray:
    """The scores ``-#{v > theta} - penalty * ln(theta / upper)`` of :func:`mix_candidates`
    (``clipped="excess"``: the clipped excess in place of the count, on the Noisy-Max lattice;
    floats, for inspection; the selection forms them exactly on the lattice).

    >>> mix_candidates(8.0)[-9:].round(2)
    array([4.  , 4.36, 4.76, 5.19, 5.66, 6.17, 6.73, 7.34, 8.  ])
    >>> mix_scores(np.array([1.0, 3.0, 6.0]), upper=8.0, penalty=2.0)[-9:].round(2)
    array([ 0.39,  0.21,  0.04, -0.13, -0.31,  0.52,  0.35,  0.17,  0.  ])
    """
    candidates = mix_candidates(upper)
    if clipped == "excess":
        unit = round(1.0 / noisy_max_lattice(1.0).granularity)  # the sensitivity-1 lattice, whatever epsilon
        above = excess_units(np.asarray(holdout_sorted)[None], candidates, unit)[0] / unit
        return _public_scores(penalty) - above
    return nm_scores(holdout_sorted, candidates, 0.0, increasing=True) + _public_scores(penalty)


def mix_thresholds(holdouts: np.ndarray, *, epsilon: float, upper: float, mix: QueryMix, is_sorted: bool = True,
                   noise: BatchLaneDraws) -> np.ndarray:
    """A threshold for each row of ``holdouts`` (hold-outs of one length ``m``, values in
    ``[0, upper]``; row ``k`` draws from ``noise``'s partition ``k``): Report-Noisy-Max over
    :func:`mix_scores` with the penalty ``mix.penalty(m, epsilon=epsilon)`` (counting what
    ``mix.clipped`` says), the chosen candidate times ``mix.lift(m, epsilon=epsilon)``, at most ``upper``.

    Privacy: ``epsilon``-DP on each row under replace-one-value neighbours (sensitivity 1,
    monotone scores: module docstring). ``mix`` and ``upper`` are public. A pooled hold-out
    (one row of many partitions' first values, each value in it once) is one row here.

    Examples
    --------
    >>> import dpsql
    >>> holdout = np.r_[np.full(3990, 10.0), np.full(10, 1000.0)]
    >>> with dpsql.testing.seeded(3) as keys:
    ...     theta = mix_thresholds(holdout[None], epsilon=5.0, upper=1000.0, mix=QueryMix((24,), (0.05,)),
    ...                            noise=keys.partitions([b"a"]).lane(dpsql.noise.Lane.NOISY_MAX))
    >>> theta  # the candidate just above 10 (the one below would clip 3990 values)
    array([10.13155902])
    """
    m = holdouts.shape[-1]
    chosen = noisy_max_thresholds(holdouts, mix_candidates(upper), _public_scores(mix.penalty(m, epsilon=epsilon)),
                                  epsilon=epsilon, is_sorted=is_sorted, noise=noise, clipped=mix.clipped)
    return np.minimum(chosen * mix.lift(m, epsilon=epsilon), upper)
