"""PeGaSus: Perturb, Group, Smooth (Chen et al., CCS 2017; ALGORITHMS.md §2).

Releases a stream of counts ``c_1, c_2, ...`` online. At each time ``t``:

* the **Perturber** releases ``c~_t = c_t + Lap(s / eps_p)`` (lattice Laplace);
* the **Grouper** (deviation-based, Algorithm 2) reads the *true* counts and extends the
  open group while ``dev(C[G u {t}]) + Lap(8 s / eps_g) < theta~``, where
  ``dev(X) = sum |x - mean(X)|`` is the L1 deviation (sensitivity ``2 s``) and
  ``theta~ = theta + Lap(4 s / eps_g)`` is drawn *fresh* when the group opens (one
  AboveThreshold session per group, :mod:`dpsql.mechanisms.svt`). On "above" the group
  is closed and ``{t}`` becomes a closed singleton, so ``t + 1`` opens a new group;
* the **Smoother** (post-processing) reads only the noisy counts and the partition at
  time ``t``: with ``G`` the group containing ``t`` (its rows up to ``t``),
  ``average`` releases ``mean(c~[G])``, ``median`` ``median(c~[G])`` (mean of the two
  middle values for an even size) and ``js`` (James-Stein)
  ``(c~_t - mean(c~[G])) / |G| + mean(c~[G])``.

Privacy: ``epsilon = eps_p + eps_g``-DP for add/remove-one-event neighbours, where one
event changes one count by at most ``s`` (``sensitivity``, 1 for event counts; ``k`` for
counts in which one privacy unit contributes at most ``k`` events per step). The
Perturber is ``eps_p``-DP (Laplace, sensitivity ``s``); the Grouper is ``eps_g``-DP
(each group is one AboveThreshold session and a neighbour changes the query of one
session only); the Smoother is post-processing (Theorem 3.1 and 3.4).

Implementation: the grouper loop is inherently sequential, but a group that starts at
``s`` evolves independently of everything before ``s`` once its threshold and the query
noise of each step are fixed. Noise is therefore pre-drawn per *time step* (one
threshold for a group that would open at ``t``, one query noise for the test at ``t``;
each used at most once, which is exactly the sequential algorithm's distribution), the
first "above" of every possible group start is found with vectorised window
deviations for the first :data:`SHORT_GROUP` steps, and a loop over the groups that
actually occur chains them, following the rare longer groups block by block (their
earlier rows kept as sorted runs with prefix sums, so ``dev`` costs ``O(log^2 |G|)``).

Privacy of the lattice SVT: the query is rounded to the query lattice before integer
noise is added, and the noisy threshold lives on its own lattice; both are calibrated by
:class:`~dpsql.mechanisms.LaplaceLattice`, whose sensitivity units include the rounding
step, and only the comparison is used.
"""

from __future__ import annotations

import heapq
from functools import cache

import numpy as np

from dpsql import _validate
from dpsql.accounting import Neighbour, largest_share
from dpsql.error_models import ErrorModel
from dpsql.mechanisms import LaplaceLattice
from dpsql.mechanisms.svt import AboveThreshold
from dpsql.noise import Draws, Lane
from dpsql.release import Release, StreamMachine
from dpsql.streams.laplace import RowNoiseStream

SMOOTHERS = ("median", "average", "js")
#: Steps after a group's start for which the first "above" is searched for every possible
#: start at once; longer groups continue in :func:`_first_above_long`.
SHORT_GROUP = 20
#: ... unless a round resolves less than this share of the starts still open.
MIN_RESOLVED_SHARE = 0.01
#: Group prefixes up to this size get their medians by batched sorting; longer groups
#: run a two-heap running median.
SHORT_MEDIAN = 48
DEFAULT_GROUPER_SHARE = 0.2
#: theta = THETA_TIMES_SCALE * sensitivity / eps_g by default [recon, ALGORITHMS.md §2.1].
THETA_TIMES_SCALE = 5.0


def count_neighbour(sensitivity: float) -> str:
    """The neighbour relation of a count release in which one count moves by ``sensitivity``."""
    if sensitivity == 1.0:
        return Neighbour.ADD_REMOVE_EVENT.value
    return (f"add/remove one privacy unit's events within one time step (at most {sensitivity:g} counted per "
            "step; time domain and partition keys public)")


def perturb_units(counts: np.ndarray, lattice: LaplaceLattice, noise: Draws, start: int) -> np.ndarray:
    """Noisy counts in lattice units: negative counts are clipped to 0 (a count's public
    lower bound), then lattice Laplace noise (step ``t``'s draw: index ``t`` of the ``ROWS``
    lane) is added."""
    units = lattice.to_units(np.maximum(counts, 0.0))
    units += lattice.noise_units(noise.lane(Lane.ROWS), start, units.size)
    return units


class CountLaplaceStream(RowNoiseStream):
    """Per-step Laplace on counts (the PeGaSus Perturber alone, ``eps_p = epsilon``):
    ``c_t + Lap(sensitivity / epsilon)``, negatives clipped to 0 first.

    Privacy: ``epsilon``-DP for add/remove-one-event neighbours (one count moves by at
    most ``sensitivity``). The baseline PeGaSus is compared against.

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> with dpsql.testing.seeded(0) as keys:
    ...     rel = dpsql.methods.run("count_laplace", np.array([3.0, 0.0, 7.0]), noise=keys, epsilon=1.0)
    >>> len(rel), rel.range_variance(0, 3) > 0
    (3, True)
    """

    method = "count_laplace"
    component = "perturber"

    def __init__(self, n: int | None = None, *, epsilon: float, sensitivity: float = 1.0, noise: Draws):
        self.epsilon = _validate.epsilon(epsilon)
        self.sensitivity = _validate.real(sensitivity, "sensitivity", minimum=0.0, strict=True)
        self.cost = (self.epsilon, 0.0)
        self.neighbour = count_neighbour(self.sensitivity)
        self._start(self.sensitivity, self.epsilon, noise)

    def _values_to_release(self, rows: np.ndarray) -> np.ndarray:
        return np.maximum(rows, 0.0)

    def params(self) -> dict:
        return {"epsilon": self.epsilon, "sensitivity": self.sensitivity}


class PegasusStream(StreamMachine):
    """PeGaSus as an online state machine (see the module docstring for the algorithm
    and its privacy proof).

    Parameters
    ----------
    n : int or None
        Unused (a count stream needs no length).
    epsilon : float
        Total budget; ``eps_g = grouper_share * epsilon`` goes to the Grouper and
        ``eps_p = epsilon - eps_g`` to the Perturber.
    grouper_share : float
        In (0, 1). Default 0.2 ([recon]: ``eps_p = 0.8 eps``, ``eps_g = 0.2 eps`` come from a
        third-party re-implementation, not from the paper fragments).
    theta : float, optional
        Grouper deviation threshold ``theta_g``. Default ``5 * sensitivity / eps_g``
        ([recon], as above).
    smoother : {"median", "average", "js"}
        Default "median" (the paper's Example 3.5).
    sensitivity : float
        The most one neighbour changes one count (1 for event counts).

    Noise addresses: step ``t``'s perturbation is index ``t`` of the ``ROWS`` lane, the
    threshold of a group opening at ``t`` index ``t`` of ``SVT_THRESHOLD`` and the test at
    ``t`` index ``t`` of ``SVT_QUERY``. The state is the open group (its true counts are
    secret); every released row also carries its group's first step (``public_rows``: the
    released partition, which the error model needs).

    The Smoother's ``ErrorModel`` (:class:`GroupPrefixNoise`) is exact for ``average``
    and ``js``, which are linear in the Perturber noise given the released partition;
    for ``median`` it is a bound (see that class).
    """

    public_columns = ("group",)

    def __init__(self, n: int | None = None, *, epsilon: float, grouper_share: float = DEFAULT_GROUPER_SHARE,
                 theta: float | None = None, smoother: str = "median", sensitivity: float = 1.0,
                 noise: Draws):
        self.epsilon = _validate.epsilon(epsilon)
        self.grouper_share = _validate.probability(grouper_share, "grouper_share")
        self.smoother = _validate.choice(smoother, "smoother", SMOOTHERS)
        self.sensitivity = _validate.real(sensitivity, "sensitivity", minimum=0.0, strict=True)
        self.eps_g = self.grouper_share * self.epsilon
        self.eps_p = largest_share(self.epsilon, self.epsilon - self.eps_g, rest=self.eps_g)
        _validate.epsilon(self.eps_g, "grouper_share * epsilon")
        _validate.epsilon(self.eps_p, "(1 - grouper_share) * epsilon")
        default_theta = THETA_TIMES_SCALE * self.sensitivity / self.eps_g
        self.theta = default_theta if theta is None else _validate.real(theta, "theta")
        self.cost = (self.epsilon, 0.0)
        self.neighbour = count_neighbour(self.sensitivity)
        self._perturber = LaplaceLattice(self.sensitivity, self.eps_p)
        # dev() has sensitivity 2 s (Lemma 3.3).
        self._svt = AboveThreshold(2.0 * self.sensitivity, self.eps_g)
        self._noise = noise
        self._rows = 0  # steps fed
        self._offset = 0  # global index of the first row of the open group
        self._open = _OpenGroup.empty()
        self._group_starts: list[np.ndarray] = []
        self._public: list[np.ndarray] = []

    def feed(self, chunk: np.ndarray) -> np.ndarray:
        size = len(chunk)
        if size == 0:
            return np.empty(0)
        carried = self._open
        true = np.concatenate([carried.true, np.maximum(chunk, 0.0)])
        units = np.concatenate([carried.units, perturb_units(chunk, self._perturber, self._noise, self._rows)])
        thresholds = np.concatenate([carried.thresholds,
                                     self._svt.thresholds(self.theta, self._noise, self._rows, size)])
        query_units = np.concatenate([carried.query_units,
                                      self._svt.query_noise_units(self._noise, self._rows, size)])
        self._rows += size
        starts, open_from = partition(true, thresholds, query_units, self._svt, tested=len(carried.true))
        group_start = group_start_per_row(starts, len(true))
        estimates = smooth(units, self._perturber.granularity, group_start, self.smoother)
        new_starts = starts[1:] if len(carried.true) else starts
        self._group_starts.append(new_starts + self._offset)
        self._public.append(group_start[len(carried.true):] + self._offset)
        self._offset += open_from
        self._open = _OpenGroup(true[open_from:], units[open_from:], thresholds[open_from:],
                                query_units[open_from:])
        return estimates[len(carried.true):]

    def close(self) -> np.ndarray:
        return np.empty(0)

    def take_public(self) -> dict[str, np.ndarray]:
        """Each row output since the last call: the first step of its group (public)."""
        groups = np.concatenate(self._public) if self._public else np.empty(0, dtype=np.int64)
        self._public = []
        return {"group": groups}

    def restore_public(self, public: dict[str, np.ndarray]) -> None:
        """The released partition of every row output before (a restored stream's error model)."""
        self._group_starts = [np.unique(np.asarray(public["group"], dtype=np.int64))]

    def snapshot(self) -> dict:
        o = self._open
        return {"rows": self._rows, "offset": self._offset, "true": o.true, "units": o.units,
                "thresholds": o.thresholds, "query_units": o.query_units}

    def restore(self, state: dict) -> None:
        self._rows, self._offset = int(state["rows"]), int(state["offset"])
        self._open = _OpenGroup(state["true"], state["units"], state["thresholds"], state["query_units"])

    def describe(self) -> dict:
        starts = np.concatenate(self._group_starts) if self._group_starts else np.zeros(1, dtype=np.int64)
        if not len(starts) or starts[0] != 0:
            starts = np.concatenate([[0], starts])
        error = GroupPrefixNoise(starts, self._rows, self._perturber.variance, self.smoother)
        params = {"epsilon": self.epsilon, "grouper_share": self.grouper_share, "eps_p": self.eps_p,
                  "eps_g": self.eps_g, "theta": self.theta, "smoother": self.smoother,
                  "sensitivity": self.sensitivity}
        components = {"perturber": (self.eps_p, 0.0), "grouper": (self.eps_g, 0.0), "smoother": (0.0, 0.0)}
        return dict(method="pegasus", params=params, error=error, components=components)


class _OpenGroup:
    """The group still open at the end of a chunk: its true counts, noisy units and the
    noise already drawn for it (its threshold stays the one drawn when it opened)."""

    def __init__(self, true, units, thresholds, query_units):
        self.true, self.units, self.thresholds, self.query_units = true, units, thresholds, query_units

    @classmethod
    def empty(cls):
        return cls(np.empty(0), np.empty(0, dtype=np.int64), np.empty(0), np.empty(0, dtype=np.int64))


# -- Grouper ---------------------------------------------------------------------------------


def partition(true: np.ndarray, thresholds: np.ndarray, query_units: np.ndarray, svt: AboveThreshold,
              tested: int = 0) -> tuple[np.ndarray, int]:
    """Deviation-based grouping of ``true`` counts (Algorithm 2).

    Row 0 starts a group. ``thresholds[s]`` is the noisy threshold of a group opening at
    ``s``; ``query_units[t]`` the query noise of the test at ``t``. ``tested`` rows of
    the first group were already tested (all "below") in an earlier chunk.

    Returns the start of every group (closed singletons included) and the start of the
    group still open at the end (``len(true)`` when the last group is closed).
    """
    m = len(true)
    ends, depth = _first_above_short(true, thresholds, query_units, svt)
    ends = ends.tolist()  # Python ints: a tight loop
    starts = []
    s = 0
    while s < m:
        starts.append(s)
        if s == 0 and tested:
            e = _first_above_long(true, thresholds[0], query_units, svt, 0, tested)
        else:
            e = ends[s]
            if e == _UNRESOLVED:
                e = _first_above_long(true, thresholds[s], query_units, svt, s, s + depth + 1)
        if e == m:
            return np.asarray(starts, dtype=np.int64), s
        starts.append(e)  # the closed singleton {e}
        s = e + 1
    return np.asarray(starts, dtype=np.int64), m


_UNRESOLVED = -1


def _first_above_short(true, thresholds, query_units, svt: AboveThreshold) -> tuple[np.ndarray, int]:
    """For every possible group start ``s``: the first ``t`` in ``s+1 .. s+depth`` whose
    test says "above", ``len(true)`` when the rows run out first, else ``_UNRESOLVED``;
    and ``depth`` (at most ``SHORT_GROUP``). Vectorised over all starts, one round per
    group length.

    Most starts are not on the chain of groups that actually occurs, so rounds stop
    early once they resolve almost nothing (a locally stable stream: groups are long,
    few, and cheaper to follow one by one in :func:`_first_above_long`)."""
    m = len(true)
    ends = np.full(m, _UNRESOLVED, dtype=np.int64)
    candidates = np.arange(m)
    depth = 0
    for d in range(1, SHORT_GROUP + 1):
        depth = d
        fits = candidates + d < m
        ends[candidates[~fits]] = m
        candidates = candidates[fits]
        if candidates.size == 0:
            break
        if d == 1:  # the L1 deviation of a pair from its mean is their distance
            dev = np.abs(true[candidates + 1] - true[candidates])
        else:
            window = true[candidates[:, None] + np.arange(d + 1)]
            dev = np.abs(window - window.sum(axis=1, keepdims=True) / (d + 1)).sum(axis=1)
        hit = svt.above(dev, query_units[candidates + d], thresholds[candidates])
        ends[candidates[hit]] = candidates[hit] + d
        resolved = np.count_nonzero(hit)
        candidates = candidates[~hit]
        if resolved < MIN_RESOLVED_SHARE * (resolved + len(candidates)):
            break
    return ends, depth


def _first_above_long(true, threshold, query_units, svt: AboveThreshold, s: int, t: int) -> int:
    """The first "above" at or after ``t`` of the group opened at ``s`` (``len(true)``
    if none). Tests blocks of steps at once: ``dev`` of ``G u {t}`` is the deviation of
    the group's earlier rows (:class:`_SortedRuns`, ``O(log^2 |G|)`` per mean) plus that
    of the block's own rows up to ``t`` (``block^2``)."""
    m = len(true)
    earlier = _SortedRuns(true[s:t])
    block = 32
    while t < m:
        stop = min(m, t + block)
        new = true[t:stop]
        mean = (earlier.total + np.cumsum(new)) / np.arange(t - s + 1, stop - s + 1)
        dev_new = np.tril(np.abs(new[None, :] - mean[:, None])).sum(axis=1)
        hit = svt.above(earlier.deviation(mean) + dev_new, query_units[t:stop], threshold)
        if hit.any():
            return t + int(np.argmax(hit))
        earlier.add(new)
        t = stop
        block = min(2 * block, 256)
    return m


class _SortedRuns:
    """A multiset of numbers kept as sorted runs with prefix sums, run sizes decreasing
    (the logarithmic method): adding ``k`` numbers costs ``O(k log)`` amortised, and
    ``sum |x - mu|`` over all of them costs one binary search per run, ``O(log)`` runs.

    >>> runs = _SortedRuns(np.array([5.0, 1.0, 3.0])); runs.add(np.array([10.0]))
    >>> runs.deviation(np.array([3.0, 4.75])).tolist(), runs.total
    ([11.0, 11.0], 19.0)
    """

    def __init__(self, values: np.ndarray):
        self.runs: list[tuple[np.ndarray, np.ndarray]] = []
        self.total = 0.0
        self.add(values)

    def add(self, values: np.ndarray) -> None:
        run = np.sort(values)
        while self.runs and len(self.runs[-1][0]) <= len(run):
            run = np.sort(np.concatenate([self.runs.pop()[0], run]))
        self.runs.append((run, np.concatenate([[0.0], np.cumsum(run)])))
        self.total = float(sum(prefix[-1] for _, prefix in self.runs))

    def deviation(self, centres: np.ndarray) -> np.ndarray:
        out = np.zeros(len(centres))
        for run, prefix in self.runs:
            below = np.searchsorted(run, centres)
            out += centres * (2 * below - len(run)) + prefix[-1] - 2 * prefix[below]
        return out


def group_start_per_row(starts: np.ndarray, m: int) -> np.ndarray:
    """The start of each row's group, from the sorted group starts of ``m`` rows.

    >>> group_start_per_row(np.array([0, 3, 4]), 6).tolist()
    [0, 0, 0, 3, 4, 4]
    """
    lengths = np.diff(np.append(starts, m))
    return np.repeat(starts, lengths)


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
    """

    def __init__(self, group_starts: np.ndarray, n: int, variance: float, smoother: str):
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


# -- Derived queries (post-processing of any release) ---------------------------------------------


def window_sums(release: Release, *, window: int) -> tuple[np.ndarray, np.ndarray]:
    """Sliding-window sums ``sum(values[t-window+1 .. t])`` of a release and their noise
    variances, for every row ``t`` (windows shrink at the start of the stream).

    Post-processing of released values: free, no budget.

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> with dpsql.testing.seeded(2) as keys:
    ...     rel = dpsql.methods.run("pegasus", np.full(100, 10.0), noise=keys, epsilon=1.0, smoother="average")
    >>> sums, variances = window_sums(rel, window=24)
    >>> sums.shape, bool(abs(sums[-1] - 240.0) < 4 * variances[-1] ** 0.5)
    ((100,), True)
    """
    window = _validate.integer(window, "window", minimum=1)
    stop = np.arange(1, len(release) + 1)
    start = np.maximum(stop - window, 0)
    return release.range_sum(start, stop), release.range_variance(start, stop)


def window_alarms(release: Release, *, window: int, threshold: float) -> np.ndarray:
    """Event monitoring: ``True`` at row ``t`` when the private window sum ending at ``t``
    is at least ``threshold`` (ALGORITHMS.md §2.5, post-processing, free).

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> counts = np.r_[np.zeros(50), np.full(50, 40.0)]
    >>> with dpsql.testing.seeded(4) as keys:
    ...     rel = dpsql.methods.run("pegasus", counts, noise=keys, epsilon=1.0)
    >>> alarms = window_alarms(rel, window=5, threshold=100.0)
    >>> bool(alarms[:45].any()), bool(alarms[60:].all())
    (False, True)
    """
    threshold = _validate.real(threshold, "threshold")
    return window_sums(release, window=window)[0] >= threshold
