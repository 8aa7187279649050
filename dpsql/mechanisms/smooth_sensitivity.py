"""Smooth sensitivity of the empirical quantile (Nissim, Raskhodnikova, Smith 2007) and the PAK
threshold built on it (PAK Mechanism 1; docs/algorithms.md, "pak").

Privacy cost (stated where it is defined): :func:`pak_threshold` is
``(epsilon, delta)``-DP under replace-one-value neighbours of the hold-out (values
in the public ``[0, upper]``; values outside are clipped, which is part of the
mechanism). Only the Laplace noise family is offered; PAK's Gaussian variant is not.

Smooth sensitivity
------------------
On the sorted values padded with ``x_0 = lower`` below and ``x_{m+1} = upper`` above
(1-indexed, rank ``P``), NRS07 gives::

    SS_b(P) = max_{k >= 0} exp(-k b) * max_{t = 0..k+1} (x_{P+t} - x_{P+t-k-1})

Writing ``lo = P+t-k-1`` and ``hi = P+t`` this is the maximum over ``lo <= P <= hi``,
``lo < hi`` of ``(x_hi - x_lo) * exp(-b (hi - lo - 1))``; padding beyond ``x_0`` and
``x_{m+1}`` only lengthens a window without widening it. The window is two-sided
(``t`` up to ``k + 1``): the reference code stops at ``t = k``, which misses the gap
above the quantile and under-states the sensitivity (a privacy bug). ``log(x_hi - x_lo)``
is supermodular in ``(lo, hi)`` on sorted data, so the largest optimal ``hi`` is
non-decreasing in ``lo`` and a divide and conquer over ``lo`` finds every row's optimum
in ``O(m log m)``, one vectorised pass per level.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from dpsql import _progress, _validate
from dpsql.errors import InvalidData, InvalidParameter
from dpsql.noise import LaneDraws
from dpsql.sampling import MAX_SCALE

# The threshold is released as gamma * integer; gamma is chosen from public quantities so
# that the integer noise scale stays at most 2**28 + 2**8 / a units even when SS = upper.
# The sampler turns a 53-bit uniform into a geometric variable, so a scale of s units
# reaches every integer only within ln(2**53 / s) scales of the centre: with s near 2**47
# (the former 54 bits) integers beyond ~4 scales (2 % of the mass) were unreachable and
# which ones depended on the centre, i.e. on the data. At 2**28 that region has mass
# below s / 2**53: 2**-25 at worst (SS = upper), about 2**-31 for SS = upper / 50. The
# remaining gap is the sampler's (see the report of the privacy audit).
_THRESHOLD_LATTICE_BITS = 28
# Added to the smooth bound, in lattice units: it absorbs the rounding to the lattice
# (one unit) and keeps the integer noise scale large enough (>= 2**8 / a units) that
# discrete and continuous Laplace agree closely (see pak_threshold's notes), while adding
# at most 2**-19 * kappa * upper / a**2 of scale in data units.
_SENSITIVITY_FLOOR_UNITS = 2.0**8
# Rough seconds per value and level of the divide and conquer of _best_log_window (2-core
# reference machine): what decides whether a search shows a progress bar (10^8 values: ~40 s).
_SECONDS_PER_VALUE_AND_LEVEL = 1.5e-8
# The noise scale is at most 2**28 + 2**8 / a units whatever the data (see pak_threshold's
# notes); with 2**8 / a <= 2**32 it stays below the sampler's limit (sampling.MAX_SCALE).
_SMALLEST_EPSILON = 2 * _SENSITIVITY_FLOOR_UNITS / (MAX_SCALE / 2)


def smooth_sensitivity_quantile(sorted_values, rank: int, *, b: float, upper: float, lower: float = 0.0) -> float:
    """``b``-smooth sensitivity of the order statistic at 0-indexed ``rank``.

    Parameters
    ----------
    sorted_values : array-like
        Non-decreasing values in ``[lower, upper]``.
    rank : int
        0-indexed position of the released order statistic (``x_(rank+1)``, 1-indexed).
    b : float
        Smoothing parameter (``b_ss``), ``b > 0``.
    upper, lower : float
        The public domain; they pad the sorted values on either side.

    Examples
    --------
    A hand-computed oracle: data 1..10, B = 20, rank 8 (value 9), ``b = 0.5``:
    the best window is ``[9, B]`` at ``k = 1``, ``(20 - 9) * exp(-0.5)``.

    >>> round(smooth_sensitivity_quantile(np.arange(1.0, 11.0), 8, b=0.5, upper=20.0), 4)
    6.6718
    """
    x = np.concatenate([[lower], np.asarray(sorted_values, dtype=np.float64), [upper]])
    rank = _validate.integer(rank, "rank", minimum=0)
    if rank >= len(x) - 2:
        raise InvalidParameter(f"rank must be < the number of values ({len(x) - 2}), got {rank}")
    b = _validate.real(b, "b", minimum=0.0, strict=True)
    return float(np.exp(_best_log_window(x, rank + 1, b)))


def _best_log_window(x: np.ndarray, p: int, b: float) -> float:
    """``max log(x_hi - x_lo) - b (hi - lo - 1)`` over ``0 <= lo <= p <= hi < len(x)``.

    Divide and conquer over ``lo``: the middle ``lo`` of each segment scans its allowed
    ``hi`` range, and its largest optimal ``hi`` splits the range for the two halves.
    All segments of one recursion level are evaluated in one flat numpy pass.
    """
    lo_first, lo_last = np.array([0]), np.array([p])
    hi_first, hi_last = np.array([p]), np.array([len(x) - 1])
    best = -np.inf
    levels = p.bit_length() + 1  # halving [0, p] until every segment is empty
    bar = _progress.bar(levels, seconds=len(x) * levels * _SECONDS_PER_VALUE_AND_LEVEL,
                        desc="smooth sensitivity", unit="level")
    while lo_first.size:
        mid = (lo_first + lo_last) // 2
        counts = hi_last - hi_first + 1
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        segment = np.repeat(np.arange(mid.size), counts)
        position = np.arange(segment.size)
        hi = hi_first[segment] + (position - starts[segment])
        lo = mid[segment]
        with np.errstate(divide="ignore"):  # equal values: log(0) = -inf, never the optimum
            score = np.log(x[hi] - x[lo]) - b * (hi - lo - 1)
        segment_best = np.maximum.reduceat(score, starts)
        last_best = np.maximum.reduceat(np.where(score == segment_best[segment], position, -1), starts)
        best_hi = hi[last_best]
        best = max(best, float(segment_best.max()))
        left = lo_first <= mid - 1
        right = mid + 1 <= lo_last
        lo_first = np.concatenate([lo_first[left], mid[right] + 1])
        lo_last = np.concatenate([mid[left] - 1, lo_last[right]])
        hi_first = np.concatenate([hi_first[left], best_hi[right]])
        hi_last = np.concatenate([best_hi[left], hi_last[right]])
        bar.update(1)
    bar.close()
    return best


def smoothing_parameter(epsilon: float, delta: float) -> float:
    """The Laplace-admissible smoothing parameter of NRS07 (Lemma 2.9):
    ``b_ss = epsilon / (2 ln(2 / delta))``.

    PAK and the ToPS code use ``epsilon / (2 ln(1 / delta))``, slightly larger; dpsql
    uses the NRS07 constant.

    Examples
    --------
    >>> round(smoothing_parameter(1.0, 2.0**-20), 6)
    0.03435
    """
    return epsilon / (2.0 * math.log(2.0 / delta))


def pak_kappa(*, b: float, a: float, beta_lt: float) -> float:
    """PAK Eq. 11: ``kappa = 1 / (1 - (e^b - 1) * off / a)`` with the Laplace offset
    ``off = -ln(2 beta_lt)`` (the ``1 - beta_lt`` quantile of Laplace(1)).

    ``kappa * SS`` is then a smooth upper bound on the local sensitivity of the shifted
    quantile ``x + kappa * SS * off / a`` (PAK Eqs. 8-10). Raises
    :class:`~dpsql.errors.InvalidParameter` when the denominator is not positive
    (``ln(2 / delta)`` too small against the offset: lower delta or raise ``beta_lt``).

    Examples
    --------
    A hand-computed oracle, with the paper's ``b_ss = 1 / (2 ln 2^20)``:

    >>> round(pak_kappa(b=1 / (2 * math.log(2.0**20)), a=0.5, beta_lt=0.006), 5)
    1.48118
    """
    offset = -math.log(2.0 * beta_lt)
    denominator = 1.0 - math.expm1(b) * offset / a
    if denominator <= 0:
        raise InvalidParameter(f"PAK kappa is undefined: (e^b - 1) * offset / a = {1 - denominator:.4g} >= 1 for "
                               f"b={b:.4g}, a={a:.4g}, beta_lt={beta_lt!r}; lower delta or raise beta_lt")
    return 1.0 / denominator


def quantile_miss_probability(m: int, *, tail_p: float, lam: float) -> float:
    """PAK Eq. 5: ``g(lam, p, m) = P[Binomial(m, p) <= floor(lam p m)]``, the probability
    that a hold-out of ``m`` values puts fewer than ``lam p m`` of them above the true
    upper-``p`` quantile, i.e. that the empirical ``lam p``-quantile falls below it.

    Examples
    --------
    >>> quantile_miss_probability(20_000, tail_p=0.005, lam=0.5) < 0.02
    True
    """
    top = math.floor(lam * tail_p * m)
    i = np.arange(top)
    # log pmf(i+1) - log pmf(i) = log((m - i) / (i + 1)) + log(p / (1 - p))
    steps = np.log((m - i) / (i + 1.0)) + math.log(tail_p) - math.log1p(-tail_p)
    log_pmf = m * math.log1p(-tail_p) + np.concatenate([[0.0], np.cumsum(steps)])
    return float(min(1.0, np.exp(log_pmf).sum()))


class PakThresholdParams(NamedTuple):
    """Validated public parameters of :func:`pak_threshold`, with the derived ``kappa``."""

    epsilon: float
    delta: float
    upper: float
    tail_p: float
    lam: float
    beta_lt: float
    rho: float
    kappa: float


def check_pak_threshold(*, epsilon, delta, upper, tail_p, lam, beta_lt, rho) -> PakThresholdParams:
    """Validate the public parameters of :func:`pak_threshold` (and that ``kappa`` exists)
    before anything is drawn.

    Examples
    --------
    >>> check_pak_threshold(epsilon=1.0, delta=0.05, upper=1.0, tail_p=0.005, lam=0.85,  # doctest: +ELLIPSIS
    ...                     beta_lt=0.006, rho=1.0)
    Traceback (most recent call last):
    ...
    dpsql.errors.InvalidParameter: PAK kappa is undefined: ...
    """
    epsilon = _validate.epsilon(epsilon)
    if epsilon < _SMALLEST_EPSILON:
        raise InvalidParameter(f"epsilon={epsilon!r} is too small for the PAK threshold: its noise scale could "
                               f"exceed 2**33 lattice units, the sampler's resolution limit; the smallest epsilon "
                               f"allowed is {_SMALLEST_EPSILON!r}")
    delta = _validate.delta(delta, pure=False, method="pak")
    if delta == 0:
        raise InvalidParameter("delta must be > 0 for the PAK threshold (smooth sensitivity is (epsilon, delta)-DP)")
    upper = _validate.real(upper, "upper", minimum=0.0, strict=True)
    tail_p = _validate.probability(tail_p, "tail_p")
    lam = _validate.real(lam, "lam", minimum=0.0, strict=True)
    if lam > 1:
        raise InvalidParameter(f"lam must satisfy 0 < lam <= 1, got {lam!r}")
    beta_lt = _validate.probability(beta_lt, "beta_lt")
    if beta_lt >= 0.5:
        raise InvalidParameter(f"beta_lt must be < 0.5, got {beta_lt!r}")
    rho = _validate.real(rho, "rho", minimum=1.0)
    kappa = pak_kappa(b=smoothing_parameter(epsilon, delta), a=epsilon / 2.0, beta_lt=beta_lt)
    return PakThresholdParams(epsilon, delta, upper, tail_p, lam, beta_lt, rho, kappa)


def pak_threshold(holdout_sorted, *, epsilon: float, delta: float, upper: float, tail_p: float = 0.005,
                  lam: float = 0.85, beta_lt: float = 0.006, rho: float = 1.0, noise: LaneDraws) -> float:
    """PAK's private threshold (Mechanism 1): the empirical upper ``lam * tail_p``
    quantile of the hold-out, raised by a smooth-sensitivity margin so that it falls
    below the true upper-``tail_p`` quantile with probability about ``beta_lt``.

    Privacy: ``(epsilon, delta)``-DP for the hold-out under replace-one-value neighbours
    (one value changes within ``[0, upper]``). Laplace family only; PAK's Gaussian
    variant is not offered.

    Parameters
    ----------
    holdout_sorted : array-like
        The hold-out values sorted ascending, already in ``[0, upper]`` (values outside
        are clipped to it: part of the mechanism).
    epsilon, delta : float
        The threshold's budget (PAK's ``epsilon_1``) and ``0 < delta < 1``.
    upper : float
        The public bound ``B``.
    tail_p : float
        Upper-tail probability ``p`` (PAK: ``p <= 0.005``).
    lam : float
        Quantile inflation ``0 < lam <= 1``: the released quantile is at CDF level
        ``1 - lam * tail_p``.
    beta_lt : float
        Target probability that the threshold falls below the true quantile,
        ``0 < beta_lt < 0.5``.
    rho : float
        Public multiplier ``>= 1`` (PAK §V-B), applied after release (post-processing).
    noise : LaneDraws
        The one noise draw is the draw at index 0 of this lane.

    Returns
    -------
    float
        ``min(upper, rho * clip(tau, 0, upper))``.

    Notes
    -----
    Choices where the paper is ambiguous:

    * the quantile is the order statistic at 0-indexed rank
      ``min(floor(m * (1 - lam * tail_p)), m - 1)`` (the reference code's ``int(m * q)``);
    * ``b_ss = epsilon / (2 ln(2 / delta))`` (NRS07, :func:`smoothing_parameter`), not
      PAK's ``ln(1 / delta)``; ``a = epsilon / 2``;
    * the smooth sensitivity window is two-sided (``t = 0..k+1``).

    Float safety: the threshold is released as ``gamma * (c + Z)`` with ``gamma`` a power
    of two fixed by public ``upper``, ``kappa`` and ``a``; ``c`` is the lattice-rounded
    ``x + kappa * SS * off / a`` and ``Z`` a discrete Laplace integer of scale
    ``S / a`` with ``S = kappa * SS / gamma + 2**8`` units. The released value is an
    integer multiple of a public ``gamma``, so it never carries floating-point rounding of
    private data. Rounding moves the centre by at most one unit, so ``S`` bounds its local
    sensitivity in units, and ``S`` stays ``b``-smooth (adding a constant keeps
    ``S(x) <= e^b S(y)``). Integer shifts slide a discrete Laplace exactly as they slide
    a continuous one. Under dilation the discrete and continuous densities share the
    exponential factor, and their normalising constants (``tanh(1 / 2s)`` against
    ``1 / 2s``) differ by a relative ``1 / (12 s**2)``, below ``a**2 2**-19`` at the scales
    used (``s >= 2**8 / a`` units); their tails differ by a factor below ``1 + a 2**-9``.
    The scale stays below ``2**28 + 2**8 / a`` units (below ``2**33``, the sampler's limit, for
    the epsilons allowed, ``>= 2**-23``), so the 53-bit geometric sampler of
    :mod:`dpsql.noise` reaches every integer except in tails of mass below ``s / 2**53``.
    The NRS07 Laplace argument therefore carries over up to these factors; this is an
    approximation argument, not a separate proof. Relative float error in computing ``SS``
    (about ``1e-13``) is likewise not accounted for.

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> data = np.sort(np.minimum(np.arange(20_000) % 97, 60.0))
    >>> with dpsql.testing.seeded(3) as keys:
    ...     tau = pak_threshold(data, epsilon=1.0, delta=1e-8, upper=100.0,
    ...                         noise=keys.partition().lane(dpsql.noise.Lane.SMOOTH_SENSITIVITY))
    >>> 60.0 <= tau <= 100.0
    True
    """
    p = check_pak_threshold(epsilon=epsilon, delta=delta, upper=upper, tail_p=tail_p, lam=lam, beta_lt=beta_lt,
                            rho=rho)
    holdout = np.clip(_validate.values(holdout_sorted, "holdout"), 0.0, p.upper)
    if np.any(np.diff(holdout) < 0):
        raise InvalidData("column 'holdout' must be sorted ascending")

    b = smoothing_parameter(p.epsilon, p.delta)
    a = p.epsilon / 2.0
    offset = -math.log(2.0 * p.beta_lt)
    m = len(holdout)
    rank = min(math.floor(m * (1.0 - p.lam * p.tail_p)), m - 1)
    smooth = smooth_sensitivity_quantile(holdout, rank, b=b, upper=p.upper)

    gamma = 2.0 ** (math.ceil(math.log2(max(p.kappa / a, 1.0) * p.upper)) - _THRESHOLD_LATTICE_BITS)
    bound_units = p.kappa * smooth / gamma + _SENSITIVITY_FLOOR_UNITS
    centre_units = round((float(holdout[rank]) + p.kappa * smooth * offset / a) / gamma)
    tau = gamma * float(centre_units + int(noise.discrete_laplace(bound_units / a, 0, 1)[0]))
    return float(min(p.upper, p.rho * min(max(tau, 0.0), p.upper)))
