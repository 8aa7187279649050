"""PeGaSus's group smoothers (Chen et al., CCS 2017), their error model, and the default
Smoother that decides between the groups and the whole stream.

The paper's Smoother is post-processing: the estimate of row ``t`` reads the noisy counts of
its group's rows up to ``t`` and the released partition, nothing else. ``average`` releases
their mean, ``median`` their median (mean of the two middle values for an even size) and
``js`` (James-Stein) ``(c~_t - mean) / |G| + mean``. :class:`GroupPrefixNoise` gives the noise
variance of any range sum given the partition. :class:`GroupedOrWhole` is the default
(``smoother="adaptive"``): the adaptive smoother of :mod:`dpsql.streams.smoothing` restarted at
every group, or the same smoother over the whole stream, whichever the released values say
is better. Used by :class:`dpsql.streams.pegasus.PegasusStream`.
"""

from __future__ import annotations

import heapq
from functools import cache

import numpy as np

from dpsql.error_models import ErrorModel
from dpsql.streams.smoothing import AdaptiveSmoother, Smoothed, cp_terms, ewm_state, level_share, risks_before

#: Group prefixes up to this size get their medians by batched sorting; longer groups
#: run a two-heap running median.
SHORT_MEDIAN = 48


# -- Smoother (post-processing: noisy counts and the partition at time t only) ---------------


def smooth(units: np.ndarray, granularity: float, group_start: np.ndarray, smoother: str) -> np.ndarray:
    """Estimate of every row from the noisy counts of its group's rows up to itself, the
    counts given as integer lattice ``units`` of ``granularity`` (sums of them are exact, so
    a stream fed in any chunks gets the same estimates).

    Examples
    --------
    The paper's Example 3.5 (partition ``{1,2,3}, {4}, {5}``), on a lattice of 0.1:

    >>> units = np.array([56, 44, 67, 95, 102]); starts = np.array([0, 0, 0, 3, 4])
    >>> smooth(units, 0.1, starts, "median").round(4).tolist()
    [5.6, 5.0, 5.6, 9.5, 10.2]
    >>> smooth(units, 0.1, starts, "average").round(4).tolist()
    [5.6, 5.0, 5.5667, 9.5, 10.2]
    >>> smooth(units, 0.1, starts, "js").round(4).tolist()
    [5.6, 4.7, 5.9444, 9.5, 10.2]
    """
    noisy = units.astype(np.float64) * granularity
    size = np.arange(len(noisy)) - group_start + 1
    if smoother == "median":
        return _prefix_medians(noisy, group_start, size)
    cumulative = np.concatenate([[0], np.cumsum(units, dtype=np.int64)])
    average = (cumulative[1:] - cumulative[group_start]).astype(np.float64) * granularity / size
    if smoother == "average":
        return average
    return (noisy - average) / size + average


def _prefix_medians(noisy: np.ndarray, group_start: np.ndarray, size: np.ndarray) -> np.ndarray:
    out = np.empty(len(noisy))
    short = np.flatnonzero(size <= SHORT_MEDIAN)
    by_size = short[np.argsort(size[short], kind="stable")]
    bounds = np.searchsorted(size[by_size], np.arange(1, SHORT_MEDIAN + 2))
    for k in range(1, SHORT_MEDIAN + 1):
        rows = by_size[bounds[k - 1]:bounds[k]]
        if rows.size:
            window = np.sort(noisy[rows[:, None] - np.arange(k)], axis=1)
            out[rows] = (window[:, (k - 1) // 2] + window[:, k // 2]) / 2
    for start in np.unique(group_start[size > SHORT_MEDIAN]):
        stop = start + int(np.searchsorted(group_start[start:], start, side="right"))
        out[start + SHORT_MEDIAN:stop] = _running_median(noisy[start:stop].tolist())[SHORT_MEDIAN:]
    return out


def _running_median(values: list[float]) -> list[float]:
    """Median of every prefix (two heaps: lower half as a max-heap, upper as a min-heap)."""
    lower: list[float] = []
    upper: list[float] = []
    out = []
    for x in values:
        if lower and x > -lower[0]:
            heapq.heappush(upper, x)
        else:
            heapq.heappush(lower, -x)
        if len(lower) > len(upper) + 1:
            heapq.heappush(upper, -heapq.heappop(lower))
        elif len(upper) > len(lower):
            heapq.heappush(lower, -heapq.heappop(upper))
        out.append(-lower[0] if len(lower) > len(upper) else (upper[0] - lower[0]) / 2)
    return out


class GroupedOrWhole:
    """PeGaSus's default Smoother: per row, the grouped or the whole-stream adaptive estimate,
    whichever has the lower C_p risk over the rows before it.

    Both are :class:`~dpsql.streams.smoothing.AdaptiveSmoother` runs over the Perturber's noisy
    counts ``y`` (variance ``sigma2``): *grouped* restarts at the first row of every group of the
    released partition (the paper's Smoother, which averages within groups), *whole* never
    restarts (the per-bucket estimate of ``count_smoothed``, on these noisy counts). Given its
    choices at row ``t``, each output is linear in ``y``, ``(1 - lam) y_t + lam m_k(t)``, with
    weight ``o_t = 1 - lam + lam w_k(t)`` on ``y_t``, so ``(out_t - y_t)^2 + 2 sigma2 o_t - sigma2``
    estimates its squared error without bias (C_p, clipped as the smoother's own). Both risks
    are averaged over about ``MEMORY`` rows (:func:`~dpsql.streams.smoothing.risks_before`), and
    row ``t`` publishes *whole* when its average before ``t`` is strictly lower, *grouped*
    otherwise (ties, and the first row, keep PeGaSus's grouped estimate).

    Post-processing: ``y`` and the partition are released (the Perturber's and the Grouper's
    outputs, which ``epsilon`` pays for); both runs, their risks and the choice are functions of
    them alone, so the choice costs nothing. The state (two smoothers' and two risk averages)
    is public and a few kilobytes, and every step is the smoother's own piecewise arithmetic,
    so a stream fed in any chunks, or snapshotted and restored between them, publishes the
    same values bit for bit.
    """

    def __init__(self, variance: float):
        self.variance = variance
        self._grouped = AdaptiveSmoother(variance)
        self._whole = AdaptiveSmoother(variance)
        self._risks = ewm_state(1, 2)
        self._risk_before = np.full((1, 2), np.inf)

    def feed(self, y: np.ndarray, restarts: np.ndarray) -> Smoothed:
        """Estimates for the next rows ``y`` (``(1, rows)``, as :meth:`AdaptiveSmoother.feed`);
        ``restarts[0, i]``: row ``i`` opens a group. The result has the chosen smoother's
        ``values``, ``level``, ``weight``, ``spread`` and ``length``, and ``whole`` (True where
        the whole-stream estimate was published), each ``(1, rows)``."""
        y = np.asarray(y, dtype=np.float64).reshape(1, -1)
        runs = (self._grouped.feed(y, restarts), self._whole.feed(y))
        s2 = np.asarray(self.variance, dtype=np.float64)
        terms = np.stack([cp_terms(out.values, y, 1.0 - out.weight
                                   + level_share(out.level[0], out.weight[0], out.length[0])[None], s2)
                          for out in runs], axis=1)
        before, self._risk_before = risks_before(terms, self._risks, self._risk_before)
        whole = before[:, 1] < before[:, 0]
        return Smoothed(whole=whole, **{name: np.where(whole, getattr(runs[1], name), getattr(runs[0], name))
                                        for name in ("values", "level", "weight", "spread", "length")})

    def snapshot(self) -> dict:
        return {"grouped": self._grouped.snapshot(), "whole": self._whole.snapshot(), "risks": dict(self._risks),
                "risk_before": self._risk_before.copy()}

    def restore(self, state: dict) -> None:
        self._grouped.restore(state["grouped"])
        self._whole.restore(state["whole"])
        self._risks = {**state["risks"], "count": int(state["risks"]["count"])}
        self._risk_before = np.asarray(state["risk_before"], dtype=np.float64).copy()


# -- Error model -------------------------------------------------------------------------------


class GroupPrefixNoise(ErrorModel):
    """Noise of a group-prefix smoother given the (public, released) partition.

    Row ``t`` of a group starting at ``s`` is estimated from the perturber noises
    ``e_s..e_t`` (i.i.d., variance ``variance``); groups share no noise, so range
    variances add over groups.

    * ``average`` / ``js`` are linear: row ``t`` (prefix size ``j``) carries ``alpha(j)``
      of every ``e_i`` plus ``beta(j)`` of its own (average ``1/j, 0``; JS
      ``1/j - 1/j^2, 1/j``). The variance of a range is
      ``variance * sum_i (coefficient of e_i)^2``, computed in O(1) per group piece
      from prefix sums over prefix sizes: exact.
    * ``median`` is not linear. Choice: the model assumes the counts are constant within
      a group (the case the Grouper aims for), so row ``t``'s noise is the median of ``j``
      i.i.d. Laplace draws; its variance (order statistic ``ceil(j/2)``, an upper bound
      for even ``j``) is computed numerically for the continuous Laplace of the same
      variance, and correlated rows of one group are bounded by Cauchy-Schwarz,
      ``Var(sum) <= (sum of standard deviations)^2``. The result is an upper bound on
      the noise variance, not the exact value; the bias of a median on a non-constant
      group is not included.

    ``noisy`` (optional): the released noisy counts, kept with the model so that a release
    rebuilt from its ledger record can still re-smooth its window sums
    (:func:`dpsql.streams.windows.window_sums`).
    """

    def __init__(self, group_starts: np.ndarray, n: int, variance: float, smoother: str,
                 noisy: np.ndarray | None = None):
        self.noisy = None if noisy is None else np.asarray(noisy, dtype=np.float64)
        self._starts = np.asarray(group_starts, dtype=np.int64)
        self._lengths = np.diff(np.append(self._starts, n))
        self._variance = variance
        self._median = smoother == "median"
        longest = int(self._lengths.max())
        size = np.arange(1, longest + 1, dtype=np.float64)
        if self._median:
            self._sd = np.concatenate([[0.0], np.cumsum(np.sqrt(_median_variance_ratio(longest)))])
        else:
            alpha, beta = (1 / size, 0.0) if smoother == "average" else (1 / size - 1 / size**2, 1 / size)
            self._alpha = np.concatenate([[0.0], np.cumsum(alpha)])
            own = beta - self._alpha[:-1]
            self._own = np.concatenate([[0.0], np.cumsum(own)])
            self._own_sq = np.concatenate([[0.0], np.cumsum(own**2)])
        full = self._piece(np.zeros_like(self._lengths), self._lengths)
        self._full = np.concatenate([[0.0], np.cumsum(full)])

    @property
    def starts(self) -> np.ndarray:
        """The first row of every group (the released partition)."""
        return self._starts

    def _piece(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Variance of the sum of rows ``a..b-1`` of one group (group-local indices)."""
        if self._median:
            return self._variance * (self._sd[b] - self._sd[a]) ** 2
        total = self._alpha[b]
        return self._variance * (a * (total - self._alpha[a]) ** 2 + (b - a) * total**2
                                 + 2 * total * (self._own[b] - self._own[a]) + self._own_sq[b] - self._own_sq[a])

    def range_variance(self, starts, stops):
        starts = np.asarray(starts, dtype=np.int64)
        stops = np.asarray(stops, dtype=np.int64)
        out = np.zeros(starts.shape)
        hit = stops > starts
        a, b = starts[hit], stops[hit]
        first = np.searchsorted(self._starts, a, side="right") - 1
        last = np.searchsorted(self._starts, b - 1, side="right") - 1
        s1, s2 = self._starts[first], self._starts[last]
        same = first == last
        inner = self._full[last] - self._full[np.minimum(first + 1, last)]
        split = (self._piece(a - s1, np.where(same, b - s1, self._lengths[first]))
                 + np.where(same, 0.0, inner + self._piece(np.zeros_like(b), b - s2)))
        out[hit] = split
        return out


_EXACT_MEDIAN_SIZES = 2048


@cache
def _median_ratio(j: int) -> float:
    """``Var(order statistic ceil(j/2) of j Laplace(1)) / Var(Laplace(1))``, by quadrature
    on a grid scaled to the statistic's spread."""
    rank = (j + 1) // 2
    x = np.linspace(-40.0, 40.0, 8001) * min(1.0, np.sqrt(2.0 / j))
    log_cdf = np.where(x < 0, x - np.log(2.0), np.log1p(-0.5 * np.exp(-np.abs(x))))
    log_sf = log_cdf[::-1]  # the grid is symmetric
    log_density = (rank - 1) * log_cdf + (j - rank) * log_sf - np.abs(x)
    weight = np.exp(log_density - log_density.max())
    weight /= weight.sum()
    mean = weight @ x
    return float(weight @ x**2 - mean**2) / 2.0


def _median_variance_ratio(longest: int) -> np.ndarray:
    """Per prefix size ``1..longest``. Beyond 2048, ``j * Var`` is held at its value at
    2048 (it decreases from 2 at ``j = 1`` toward the asymptote 1), an upper bound."""
    exact = np.array([_median_ratio(j) for j in range(1, min(longest, _EXACT_MEDIAN_SIZES) + 1)])
    if longest <= _EXACT_MEDIAN_SIZES:
        return exact
    size = np.arange(_EXACT_MEDIAN_SIZES + 1, longest + 1)
    return np.concatenate([exact, exact[-1] * _EXACT_MEDIAN_SIZES / size])
