"""PeGaSus: Perturb, Group, Smooth (Chen et al., CCS 2017).

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
  ``(c~_t - mean(c~[G])) / |G| + mean(c~[G])``; ``grouped`` releases the adaptive smoother of
  :mod:`dpsql.streams.smoothing` restarted at every group's first row (weighted means of the
  group so far over horizons of 2 to 4096 steps, the horizon and a shrinkage toward ``c~_t``
  chosen from the noisy counts already released); ``adaptive`` (the default) releases, row by
  row, ``grouped``'s estimate or the same smoother's over the whole stream, whichever has the
  lower C_p risk on the rows before (:class:`~dpsql.streams.group_smoothing.GroupedOrWhole`).

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

Defaults (the paper gives none in the text we follow; these are derived, not fitted)
------------------------------------------------------------------------------------
* ``grouper_share = 0.004``. On a stream whose counts change from step to step by more than
  the noise (hourly counts with daily cycles), no smoother can beat the released noisy count,
  so PeGaSus's error there is at least the Perturber's, ``2 s^2 / eps_p^2 = (1 - share)^-2``
  times per-step Laplace at the full epsilon: no post-processing wins back the Grouper's
  share. The default may lose at most 2 % to per-step Laplace (issue 24); half of that goes to
  the share, ``share <= 1 - 1.01^-1/2 = 0.00496``, rounded down to 0.004 (0.8 % over Laplace),
  the other half to the smoother's choices, which cost ``count_smoothed`` under 0.5 % on rough
  streams. (Issue 14's 0.02 cost 4.1 % everywhere nothing smooths.) A small share gives up
  little the adaptive smoother could use, roughly: after a long group, a change of level ``J``
  lifts the group's deviation by about ``2 J`` a step and reaches the threshold below
  (``58.7 s / eps_g``) after about ``29 s / (eps_g J)`` steps, while the smoother's guard, on
  noisy counts of deviation ``sqrt 2 s / eps_p``, sees it after about ``(4.43 sqrt 2 s / (eps_p
  J))^2 = 39 s^2 / (eps_p J)^2``. The Grouper is the sooner only for ``J < 1.34 s eps_g /
  eps_p^2``, changes it takes over ``22 (eps_p / eps_g)^2`` steps to see: 52,000 at share 0.02,
  over a million at 0.004. The groups stay (the paper's structure, and the ``grouped``
  estimate the default weighs), and the default takes them only where the risk says so.
* ``theta = b_q ln(3 L / 8)`` with ``b_q`` the scale of the Grouper's query noise (about
  ``8 s / eps_g``) and ``L = 2^12 = 4096``, the adaptive smoother's longest horizon. On a
  constant stream ``dev = 0`` and a group with noisy threshold ``theta + nu`` closes at each
  step with probability ``p = exp(-(theta + nu) / b_q) / 2``; its length is geometric, of mean
  ``1 / p``, and averaging over ``nu ~ Lap(b_q / 2)`` (``E exp(nu / b_q) = 4 / 3``) gives a mean
  group length ``(8 / 3) exp(theta / b_q) = L``: false restarts then leave the longest level
  its whole horizon on average. (The earlier ``theta = 5 s / eps_g`` is ``0.63 b_q``: mean
  groups of about 5 steps on a constant stream, fewer on real counts.)
* ``smoother = "adaptive"``: per row, the adaptive smoother restarted at the groups
  (``grouped``) or over the whole stream, whichever has the lower C_p risk on the rows before
  (:class:`~dpsql.streams.group_smoothing.GroupedOrWhole`; docs/algorithms.md, "How the
  default decides"). Each chooses its horizon and shrinkage from the noisy counts, so on a
  rough stream both return ``c~_t`` (error: the Perturber's alone, the bound above) and on a
  smooth one average as far back as the guard allows; the whole-stream one never loses its
  long horizons to a restart. The paper's smoothers average the whole group so far, which is
  right only where the group is constant. Measured in BENCHMARKS.md ("Count streams on
  smooth and rough data").
* These derived defaults assume an adaptive smoother, whose guard follows a change of level
  inside a group within a few steps, so the Grouper only has to cut where the level moves for
  long. The paper's smoothers (``median``, ``average``, ``js``) follow nothing inside a group:
  with them a missed change persists until the group closes, so they keep the paper-era
  defaults, ``grouper_share = 0.2`` and ``theta = 5 s / eps_g`` (a third-party
  re-implementation's; mean groups of a few steps) unless given.

Streams registered before these defaults keep the ones they were registered with, for every
parameter they did not set: snapshots without a ``format``, the paper-era ones (``0.2``,
``5 s / eps_g``, ``median``); snapshots of format 2 (issue 14), ``grouper_share = 0.02`` and the
``grouped`` smoother (which format 2 called ``adaptive``).
"""

from __future__ import annotations

import math

import numpy as np

from dpsql import _validate
from dpsql.accounting import largest_share
from dpsql.mechanisms import LaplaceLattice
from dpsql.mechanisms.svt import AboveThreshold
from dpsql.noise import Draws
from dpsql.release import StreamMachine
from dpsql.streams.count_laplace import SMOOTHED_COLUMNS, PublicRows, count_neighbour, perturb_units
from dpsql.streams.group_smoothing import GroupedOrWhole, GroupPrefixNoise, smooth
from dpsql.streams.smoothing import LEVELS, AdaptiveNoise, AdaptiveSmoother

SMOOTHERS = ("adaptive", "grouped", "median", "average", "js")
#: The smoothers the derived defaults are for (the others are the paper's).
ADAPTIVE_SMOOTHERS = ("adaptive", "grouped")
#: Steps after a group's start for which the first "above" is searched for every possible
#: start at once; longer groups continue in :func:`_first_above_long`.
SHORT_GROUP = 20
#: ... unless a round resolves less than this share of the starts still open.
MIN_RESOLVED_SHARE = 0.01
DEFAULT_GROUPER_SHARE = 0.004
#: Mean length of a constant stream's groups under the default theta: the adaptive
#: smoother's longest horizon.
GROUP_LENGTH = 2**LEVELS
#: The paper-era defaults (a third-party re-implementation's): the paper's smoothers keep them,
#: and streams registered before the derived ones.
PAPER_DEFAULTS = {"grouper_share": 0.2, "theta_times_scale": 5.0}
#: Snapshot format of PegasusStream.
SNAPSHOT_FORMAT = 3
#: Per snapshot format, the default smoother and the adaptive smoothers' default grouper share:
#: none (registered before the derived defaults: all paper-era), 2 (issue 14), 3 (now).
FORMAT_DEFAULTS = {None: ("median", PAPER_DEFAULTS["grouper_share"]), 2: ("grouped", 0.02),
                   SNAPSHOT_FORMAT: ("adaptive", DEFAULT_GROUPER_SHARE)}


def default_theta(svt: AboveThreshold, length: float = GROUP_LENGTH) -> float:
    """The threshold at which a constant stream's groups last ``length`` steps on average:
    ``b_q ln(3 length / 8)`` for the Grouper's query-noise scale ``b_q`` (module docstring).

    >>> svt = AboveThreshold(2.0, 0.02)
    >>> round(default_theta(svt) / svt.query_noise.scale, 3)  # ln(3 * 4096 / 8)
    7.337
    """
    return svt.query_noise.scale * math.log(3.0 * length / 8.0)


class PegasusStream(StreamMachine):
    """PeGaSus as an online state machine (see the module docstring for the algorithm,
    its privacy proof and the derivation of the defaults).

    Parameters
    ----------
    n : int or None
        Unused (a count stream needs no length).
    epsilon : float
        Total budget; ``eps_g = grouper_share * epsilon`` goes to the Grouper and
        ``eps_p = epsilon - eps_g`` to the Perturber.
    grouper_share : float, optional
        In (0, 1). Default 0.004 with the adaptive smoothers (0.8 % over per-step Laplace where
        no smoothing helps), 0.2 with the paper's smoothers.
    theta : float, optional
        Grouper deviation threshold ``theta_g``. Default with the adaptive smoothers
        ``b_q ln(3 * 4096 / 8)`` (about ``58.7 * sensitivity / eps_g``: a constant stream's
        groups last 4096 steps on average), with the paper's smoothers ``5 * sensitivity / eps_g``.
    smoother : {"adaptive", "grouped", "median", "average", "js"}, optional
        Default "adaptive" (grouped or whole-stream, by risk); "grouped" is the adaptive
        smoother restarted at every group (issue 14's default); "median" is the paper's
        Example 3.5.
    sensitivity : float
        The most one neighbour changes one count (1 for event counts).

    Noise addresses: step ``t``'s perturbation is index ``t`` of the ``ROWS`` lane, the
    threshold of a group opening at ``t`` index ``t`` of ``SVT_THRESHOLD`` and the test at
    ``t`` index ``t`` of ``SVT_QUERY``. The state is the open group (its true counts are
    secret) and the adaptive smoothers'. Every released row also carries public columns:
    its group's first step (``group``: the released partition), the Perturber's noisy count
    (``noisy``) and, for the adaptive smoothers, their choices (``level``, ``weight``,
    ``spread``, and for ``adaptive`` ``whole``: the whole-stream estimate was published);
    the error model needs them, re-smoothed window sums the noisy counts (``Release.reports``).

    The ``ErrorModel`` is exact for ``average`` and ``js`` (:class:`GroupPrefixNoise`, linear in
    the Perturber noise given the released partition), an upper bound for ``median``, and
    exact given the smoother's choices for ``adaptive`` and ``grouped``
    (:class:`~dpsql.streams.smoothing.AdaptiveNoise`, a plug-in).
    """

    def __init__(self, n: int | None = None, *, epsilon: float, grouper_share: float | None = None,
                 theta: float | None = None, smoother: str | None = None, sensitivity: float = 1.0,
                 noise: Draws):
        self.epsilon = _validate.epsilon(epsilon)
        self.sensitivity = _validate.real(sensitivity, "sensitivity", minimum=0.0, strict=True)
        self._given = {"grouper_share": grouper_share, "theta": theta, "smoother": smoother}
        self._public = PublicRows(())  # per row output: group, noisy count, smoother's columns (_configure names them)
        self._configure(SNAPSHOT_FORMAT)
        self.cost = (self.epsilon, 0.0)
        self.neighbour = count_neighbour(self.sensitivity)
        self._noise = noise
        self._rows = 0  # steps fed
        self._offset = 0  # global index of the first row of the open group
        self._open = _OpenGroup.empty()
        self._group_starts: list[np.ndarray] = []

    def _configure(self, snapshot_format: int | None) -> None:
        """Parameters from those given, the others defaulted (module docstring) as streams of
        ``snapshot_format`` were: the derived defaults with the adaptive smoothers, the
        paper-era ones with the Grouper-driven smoothers or for a stream registered before the
        derived ones (no format). Before format 3, ``"adaptive"`` was the grouped smoother."""
        given = self._given
        default_smoother, adaptive_share = FORMAT_DEFAULTS[snapshot_format]
        smoother = default_smoother if given["smoother"] is None else given["smoother"]
        smoother = _validate.choice(smoother, "smoother", SMOOTHERS)
        self.smoother = "grouped" if smoother == "adaptive" and snapshot_format != SNAPSHOT_FORMAT else smoother
        legacy = snapshot_format is None
        paper = legacy or self.smoother not in ADAPTIVE_SMOOTHERS
        grouper_share, theta = given["grouper_share"], given["theta"]
        if grouper_share is None:
            grouper_share = PAPER_DEFAULTS["grouper_share"] if paper else adaptive_share
        self.grouper_share = _validate.probability(grouper_share, "grouper_share")
        self.eps_g = self.grouper_share * self.epsilon
        self.eps_p = largest_share(self.epsilon, self.epsilon - self.eps_g, rest=self.eps_g)
        _validate.epsilon(self.eps_g, "grouper_share * epsilon")
        _validate.epsilon(self.eps_p, "(1 - grouper_share) * epsilon")
        self._perturber = LaplaceLattice(self.sensitivity, self.eps_p)
        # dev() has sensitivity 2 s (Lemma 3.3).
        self._svt = AboveThreshold(2.0 * self.sensitivity, self.eps_g)
        if theta is not None:
            self.theta = _validate.real(theta, "theta")
        elif paper:
            self.theta = PAPER_DEFAULTS["theta_times_scale"] * self.sensitivity / self.eps_g
        else:
            self.theta = default_theta(self._svt)
        self._smoother: GroupedOrWhole | AdaptiveSmoother | None = None
        if self.smoother == "adaptive":
            self._smoother = GroupedOrWhole(self._perturber.variance)
            self.public_columns: tuple[str, ...] = ("group", *SMOOTHED_COLUMNS, "whole")
        elif self.smoother == "grouped":
            self._smoother = AdaptiveSmoother(self._perturber.variance)
            self.public_columns = ("group", *SMOOTHED_COLUMNS)
        elif legacy:  # a continual stream's stored rows keep the columns they were registered with
            self.public_columns = ("group",)
        else:
            self.public_columns = ("group", "noisy")
        self._public.names = self.public_columns  # the rows already kept stay (a legacy restore reconfigures)

    def feed(self, chunk: np.ndarray) -> np.ndarray:
        size = len(chunk)
        if size == 0:
            return np.empty(0)
        carried = self._open
        old = len(carried.true)
        true = np.concatenate([carried.true, np.maximum(chunk, 0.0)])
        units = np.concatenate([carried.units, perturb_units(chunk, self._perturber, self._noise, self._rows)])
        thresholds = np.concatenate([carried.thresholds,
                                     self._svt.thresholds(self.theta, self._noise, self._rows, size)])
        query_units = np.concatenate([carried.query_units,
                                      self._svt.query_noise_units(self._noise, self._rows, size)])
        self._rows += size
        starts, open_from = partition(true, thresholds, query_units, self._svt, tested=old)
        group_start = group_start_per_row(starts, len(true))
        noisy = units[old:].astype(np.float64) * self._perturber.granularity
        public = {"group": group_start[old:] + self._offset, "noisy": noisy}
        if self._smoother is None:
            estimates = smooth(units, self._perturber.granularity, group_start, self.smoother)[old:]
        else:
            restarts = group_start[old:] == np.arange(old, len(true))
            out = self._smoother.feed(noisy[None], restarts[None])
            estimates = out.values[0]
            public.update({name: getattr(out, name)[0] for name in self.public_columns if hasattr(out, name)})
        new_starts = starts[1:] if old else starts
        self._group_starts.append(new_starts + self._offset)
        self._public.add(public)
        self._offset += open_from
        self._open = _OpenGroup(true[open_from:], units[open_from:], thresholds[open_from:],
                                query_units[open_from:])
        return estimates

    def close(self) -> np.ndarray:
        return np.empty(0)

    def take_public(self) -> dict[str, np.ndarray]:
        """Each row output since the last call: its group's first step (public), its noisy
        count and the adaptive smoothers' choices."""
        return self._public.take()

    def restore_public(self, public: dict[str, np.ndarray]) -> None:
        """The public columns of every row output before (a restored stream's error model)."""
        groups = np.asarray(public["group"], dtype=np.int64)
        self._group_starts = [np.unique(groups)]
        self._public.restore({name: np.asarray(public[name]) for name in self.public_columns if name in public})

    def snapshot(self) -> dict:
        o = self._open
        state = {"format": SNAPSHOT_FORMAT, "rows": self._rows, "offset": self._offset, "true": o.true,
                 "units": o.units, "thresholds": o.thresholds, "query_units": o.query_units}
        if self._smoother is not None:
            state["smoother"] = self._smoother.snapshot()
        return state

    def restore(self, state: dict) -> None:
        if state.get("format") != SNAPSHOT_FORMAT:  # registered under earlier defaults: keep those it did not set
            self._configure(state.get("format"))
        self._rows, self._offset = int(state["rows"]), int(state["offset"])
        self._open = _OpenGroup(state["true"], state["units"], state["thresholds"], state["query_units"])
        if self._smoother is not None:
            self._smoother.restore(state["smoother"])

    def describe(self) -> dict:
        starts = np.concatenate(self._group_starts) if self._group_starts else np.zeros(1, dtype=np.int64)
        if not len(starts) or starts[0] != 0:
            starts = np.concatenate([[0], starts])
        columns = self._public.columns()
        if self._smoother is None:
            error = GroupPrefixNoise(starts, self._rows, self._perturber.variance, self.smoother,
                                     columns.get("noisy"))
        else:
            error = AdaptiveNoise(self._perturber.variance, columns["level"], columns["weight"], columns["spread"],
                                  starts, columns["noisy"], columns.get("whole"))
        params = {"epsilon": self.epsilon, "grouper_share": self.grouper_share, "eps_p": self.eps_p,
                  "eps_g": self.eps_g, "theta": self.theta, "smoother": self.smoother,
                  "sensitivity": self.sensitivity}
        components = {"perturber": (self.eps_p, 0.0), "grouper": (self.eps_g, 0.0), "smoother": (0.0, 0.0)}
        return dict(method="pegasus", params=params, error=error, components=components,
                    reports=columns.get("noisy"))


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
