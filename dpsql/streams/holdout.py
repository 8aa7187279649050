"""The two-phase skeleton shared by ToPS and PAK: a private threshold from a hold-out
prefix, then a stream phase on the remaining values clipped at that threshold.

The hold-out has a fixed length ``m`` (4096 rows by default: a stream's length is unknown,
and a hold-out that grows with the table delays every release). Its rows are released too,
once the threshold is known, by the flat block hierarchy (:mod:`dpsql.streams.hierarchy`:
one chunk of ``m`` rows, blocks from the same rule) at ``holdout_share * epsilon``, clipped
at the threshold: ranges inside the hold-out get exact noise variances, and a range that
cuts one of its blocks an honest bound for the spreading (PAK publishes only the hold-out's
noisy total, which is the case of one block).

Privacy (replace-one-value neighbours, values clipped to the public ``[lower, upper]``):

* hold-out rows: threshold at ``(1 - holdout_share) * epsilon`` (plus the threshold
  method's delta), then their hierarchy clipped at it at ``holdout_share * epsilon``:
  sequential composition gives ``epsilon`` (and delta) on the hold-out;
* remaining rows: the stream phase's own ``epsilon`` guarantee, with sensitivity the
  (now public) threshold;
* the two row sets are disjoint: parallel composition, so the release costs
  ``(epsilon, delta)``.

A continual stream's ``max_delay`` (rows) bounds how long a row waits. A hold-out that completes
within it (``m <= max_delay``; a fleet's pooled hold-out: the pool's ``m``) waits for its
threshold as above. A longer one cannot: its rows are released as they come, by the same flat
hierarchy at ``holdout_share * epsilon`` but clipped at the public bound ``upper`` (blocks of at
most ``max_delay`` rows, the last one flushed when the hold-out completes), while the threshold
is still chosen from them at ``(1 - holdout_share) * epsilon``. The privacy argument is unchanged
(the hold-out's release never reads the threshold); its noise scales with the bound instead of
the threshold, and its intervals cover the values clipped at the bound.

Values are shifted to ``[0, upper - lower]`` internally; the released values and the
threshold are in the original units. A threshold below ``(upper - lower) * 2**-30``
is raised to it (post-processing), so the stream phase always has a positive bound.
"""

from __future__ import annotations

import copy
import math
from abc import abstractmethod

import numpy as np

from dpsql import _validate
from dpsql._groups import group_codes
from dpsql.accounting import largest_share
from dpsql.error_models import IndependentNoise, SegmentedNoise
from dpsql.errors import InvalidParameter
from dpsql.mechanisms.calendar import DEFAULT_CALENDAR, CalendarLayout
from dpsql.mechanisms.hierarchy import Layout
from dpsql.mechanisms.laplace import LaplaceLattice
from dpsql.noise import Draws, DrawsBatch, Lane
from dpsql.release import StreamMachine, written_in_place
from dpsql.streams.hierarchy import HierarchyStream, calendar_layout, check_max_delay
from dpsql.timegrid import RowGrid

#: The hold-out length when none is given: fixed (a stream's length is unknown).
DEFAULT_HOLDOUT = 4096
#: Where a partitioned release's threshold comes from: one for the fleet, from the first rows of all
#: its partitions pooled (``m`` rows in all), or one per partition, from each one's first ``m`` rows.
THRESHOLD_BY = ("fleet", "partition")
_MIN_THRESHOLD = 2.0**-30
# The stream phase's segment of the error model reaches as far as any range asked for.
_ANY_LENGTH = 1 << 62


class ThresholdedStream(StreamMachine):
    """Buffer the first ``m`` rows, choose the threshold, release the hold-out's rows,
    then delegate every later row to the stream phase. With ``threshold`` given (a value
    released before, whose cost was charged then) there is no hold-out: every row goes to
    the stream phase, which gets the whole ``epsilon``.

    Subclasses implement :meth:`_choose_thresholds`, :meth:`_stream_phase` and
    :meth:`_method_params`, and set ``method`` and, for (epsilon, delta) thresholds,
    ``threshold_delta``.

    Partitions: :meth:`batched` gives this machine for ``k`` equal-length partitions at once,
    fed ``(k, rows)`` chunks (for subclasses whose threshold and stream phase work per row;
    ``batchable`` says so). A single stream is the case ``k = 1``. Each partition gets its own
    threshold, hold-out total (on its own lattice, from its own draws) and stream phase,
    exactly as alone.

    ``max_delay`` (rows): a hold-out longer than it is released as it comes, at the public bound
    (module docstring); a fleet's partition (``pooled_rows``) decides by the pool's ``m``.
    """

    method: str
    threshold_delta: float = 0.0
    writes_out = True

    #: The rows' time grid (:class:`~dpsql.timegrid.RowGrid`) and ``calendar=`` choice: with a grid,
    #: the hold-out's blocks are calendar days (:func:`~dpsql.streams.hierarchy.calendar_layout`).
    grid: RowGrid | None = None
    calendar: str = DEFAULT_CALENDAR

    def __init__(self, n: int | None = None, *, epsilon: float, upper: float, lower: float = 0.0,
                 m: int | None = None, holdout_share: float = 0.5, threshold: float | None = None,
                 threshold_by: str = "fleet", pooled_rows: int | None = None, max_delay: int | None = None,
                 noise: Draws):
        self.epsilon = _validate.epsilon(epsilon)
        self.lower, self.upper = _validate.bounds(lower, upper)
        self.bound = self.upper - self.lower
        self.n_rows = n  # None for a stream (its length unknown)
        self.threshold_by = _validate.choice(threshold_by, "threshold_by", THRESHOLD_BY)
        self.given_threshold = None
        #: True for a partition of a fleet whose threshold came from a pooled hold-out (see module docstring)
        self.pooled = pooled_rows is not None
        if self.pooled and threshold is None:
            raise InvalidParameter("pooled_rows is set by a fleet release, with the threshold of its pooled hold-out")
        if threshold is not None:
            theta = _validate.real(threshold, "threshold") - self.lower
            if not 0 < theta <= self.bound:
                raise InvalidParameter(f"threshold must satisfy lower < threshold <= upper, got {threshold!r}")
            self.given_threshold = theta
            if m is not None and not self.pooled:
                raise InvalidParameter("m (hold-out length) does not apply when a threshold is given")
            self.m = _validate.integer(pooled_rows, "pooled_rows", minimum=0) if self.pooled else 0
            # a fleet's partition: its hold-out (its pooled rows) waits for the whole pool of m rows
            self.holdout_span = (DEFAULT_HOLDOUT if m is None else _validate.integer(m, "m", minimum=1)) \
                if self.pooled else 0
        else:
            self.m = self.holdout_span = DEFAULT_HOLDOUT if m is None else _validate.integer(m, "m", minimum=1)
            if n is not None and self.m >= n:
                raise InvalidParameter(f"m (hold-out length) must be < the number of values ({n}), got m={self.m}; "
                                       f"pass a smaller m, or a threshold released before (threshold=)")
        self.max_delay = check_max_delay(max_delay)
        #: Are the hold-out's rows released as they come, clipped at the public bound (module docstring)?
        self.holdout_at_bound = self.max_delay is not None and self.m > 0 and self.holdout_span > self.max_delay
        self.holdout_share = _validate.probability(holdout_share, "holdout_share")
        self.epsilon_threshold = (1.0 - self.holdout_share) * self.epsilon
        # rounded so that the two hold-out charges never add up to more than epsilon
        self.epsilon_holdout = largest_share(self.epsilon, self.holdout_share * self.epsilon,
                                           rest=self.epsilon_threshold)
        if self.given_threshold is None or self.m:
            self._check_holdout_epsilon()
        self._start(DrawsBatch([noise]))

    def _check_holdout_epsilon(self) -> None:
        """Refuse now, before anything is charged, a split that leaves the hold-out's release too
        little epsilon for any lattice (a continual stream would be charged at registration and
        fail when its hold-out completes)."""
        try:
            layout = self._holdout_layout(_validate.epsilon(self.epsilon_holdout))
            # whatever the threshold, its lattice's scale in units is at most that of a bound just
            # below a power of two
            LaplaceLattice(math.nextafter(2.0, 0.0), min(layout.level_epsilons(layout.chunk(0))))
        except InvalidParameter:
            raise InvalidParameter(f"holdout_share={self.holdout_share!r} leaves the hold-out's release "
                                   f"epsilon={self.epsilon_holdout!r} (holdout_share * epsilon), too little for its "
                                   f"noise: raise holdout_share or epsilon") from None

    def batched(self, draws: DrawsBatch) -> ThresholdedStream:
        machine = copy.copy(self)
        machine._start(draws)
        return machine

    def _start(self, draws: DrawsBatch):
        """State for ``len(draws)`` streams, nothing fed yet."""
        self.partitions = len(draws)
        self._draws = draws
        self.thresholds: np.ndarray | None = None
        self._held: list[np.ndarray] = []
        self._held_rows = 0
        self._stream: StreamMachine | None = None
        self._holdout: HierarchyStream | None = None
        self._lead = ()
        if self.given_threshold is not None and not self.m:
            self._begin_stream(np.full(self.partitions, self.given_threshold), None)
        elif self.holdout_at_bound:
            self._holdout = self._holdout_machine(np.full(self.partitions, self.bound))

    @property
    def cost(self) -> tuple[float, float]:
        # a threshold released before was paid for then; a fleet's pooled one by this release
        return self.epsilon, (0.0 if self.given_threshold is not None and not self.pooled else self.threshold_delta)

    def pooled_threshold(self, values: np.ndarray, rows: int | None = None) -> float:
        """The threshold of a fleet's pooled hold-out ``values`` (each row of the pool once), chosen
        by this machine's rule from its own draws (the fleet's): ``(1 - holdout_share) * epsilon``
        (and the method's delta) for all of them, as a single stream's hold-out costs; in data units.
        ``rows``: the longest partition's length, when the release's length is known (a threshold
        for what the release is for serves no range longer). The fleet's partitions then release
        their pooled rows (``pooled_rows``) at ``holdout_share * epsilon`` and the rest at
        ``epsilon``, clipped at it."""
        holdout = np.ascontiguousarray(np.clip(self._shift(np.asarray(values, dtype=np.float64)), 0.0, self.bound))
        theta = np.clip(self._choose_thresholds(holdout[None, :], rows), _MIN_THRESHOLD * self.bound, self.bound)
        return float(theta[0]) + self.lower

    @abstractmethod
    def _choose_thresholds(self, holdout: np.ndarray, rows: int | None) -> np.ndarray:
        """One private threshold per row of ``holdout`` (values in ``[0, bound]``, one
        partition's hold-out per row, in time order, C-contiguous) for partitions of ``rows``
        rows (None: a stream's, of unknown length)."""

    @abstractmethod
    def _stream_phase(self, thresholds: np.ndarray, initials: np.ndarray | None) -> StreamMachine:
        """The machine releasing the remaining rows of every partition, fed values shifted
        to ``[0, bound]`` shaped like this machine's input; it clips partition ``j`` at
        ``thresholds[j]`` itself. ``initials``: each partition's hold-out mean as released
        (clipped to its threshold), or None without a hold-out."""

    @abstractmethod
    def _method_params(self) -> dict:
        """Method-specific public parameters for the release record (the same for every partition)."""

    def feed(self, chunk: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        self._lead = chunk.shape[:-1]
        rows = chunk.reshape(self.partitions, -1)
        holdout = None  # the hold-out rows this feed releases
        if self._stream is None:
            take = rows[:, : self.m - self._held_rows]
            self._held.append(take.copy())
            self._held_rows += take.shape[1]
            rows = rows[:, take.shape[1]:]
            pieces = [self._holdout.feed(self._clipped(take))] if self.holdout_at_bound else []
            if self._held_rows == self.m:
                pieces.append(self._release_holdout())
            holdout = self._shift_back(np.concatenate(pieces, axis=1)) if pieces else None
        # every hold-out row carries its share, then come the stream phase's rows: one buffer,
        # the caller's when given (all its room: a stream phase may emit rows held back before),
        # which a stream phase that writes in place fills directly
        held = 0 if holdout is None else holdout.shape[1]
        room = None if out is None else out.reshape(self.partitions, -1)
        rest = None
        if rows.shape[1]:
            stream_rows = self._shift(rows.reshape((*self._lead, -1)))
            if room is not None and self._stream.writes_out:
                rest = self._stream.feed(stream_rows, out=room[:, held:])
            else:
                rest = self._stream.feed(stream_rows)
        emitted = 0 if rest is None else rest.shape[-1]
        buffer = np.empty((self.partitions, held + emitted)) if room is None else room[:, :held + emitted]
        if holdout is not None:
            buffer[:, :held] = holdout
        if emitted:
            stream_part = buffer[:, held:]
            if not written_in_place(rest, stream_part):
                stream_part[:] = rest.reshape(self.partitions, -1)
            if self.lower:
                stream_part += self.lower
        return buffer.reshape((*self._lead, -1))

    def close(self) -> np.ndarray:
        if self._stream is None:  # a one-shot release is refused before it is this short
            return np.empty((*self._lead, 0))
        return self._shift_back(self._stream.close())

    # A zero lower bound is the common case; skipping the no-op shifts saves two passes per chunk.
    def _shift(self, values: np.ndarray) -> np.ndarray:
        return values - self.lower if self.lower else values

    def _shift_back(self, values: np.ndarray) -> np.ndarray:
        return values + self.lower if self.lower else values

    def _clipped(self, values: np.ndarray) -> np.ndarray:
        """Raw values shifted and clipped to ``[0, bound]``, as the hold-out and its threshold take them."""
        return np.clip(self._shift(values), 0.0, self.bound)

    def _release_holdout(self) -> np.ndarray:
        """Choose the thresholds, release the hold-out's rows not released yet, start the stream
        phase; return those rows' values ``(partitions, rows)``, shifted to ``[0, bound]``: all
        ``m`` of them, or, for a hold-out released at the bound as it came, those of its last
        block (flushed)."""
        held = self._held[0] if len(self._held) == 1 else np.concatenate(self._held, axis=1)
        holdout = self._clipped(held)
        self._held = []
        if self.given_threshold is not None:  # a fleet's, from the pool these rows were in
            thresholds = np.full(self.partitions, self.given_threshold)
        else:
            thresholds = np.clip(self._choose_thresholds(holdout, self.n_rows), _MIN_THRESHOLD * self.bound,
                                 self.bound)
        if self.holdout_at_bound:
            # its mean is not kept anywhere exactly (summing the pieces would depend on the appends):
            # a predictive smoother starts from half the threshold, the paper's guess
            self._begin_stream(thresholds, None)
            return self._holdout.close()
        self._holdout = self._holdout_machine(thresholds)
        released = np.concatenate([self._holdout.feed(holdout), self._holdout.close()], axis=1)
        self._begin_stream(thresholds, np.clip(released.mean(axis=1), 0.0, thresholds))
        return released

    def _holdout_layout(self, epsilon: float) -> Layout | CalendarLayout:
        """The hold-out's layout: calendar days with a grid, else one chunk of ``m`` rows; released
        at the bound as it comes, blocks of at most ``max_delay`` rows in a chunk spanning the
        whole hold-out (a fleet's partition: the pool's ``m`` rows, however many of them are its own)."""
        if self.holdout_at_bound:
            return (calendar_layout(epsilon, "none", None, None, None, self.grid, self.calendar, self.max_delay)
                    or Layout(epsilon=epsilon, fanout=16, r=self.holdout_span, max_block=self.max_delay))
        return (calendar_layout(epsilon, "none", None, None, None, self.grid, self.calendar)
                or Layout(epsilon=epsilon, fanout=16, r=self.m))

    def _holdout_machine(self, uppers: np.ndarray) -> HierarchyStream:
        """The flat hierarchy releasing the hold-out's rows, clipped at ``uppers`` (the thresholds, or
        the public bound: module docstring)."""
        layout = self._holdout_layout(self.epsilon_holdout)
        template = HierarchyStream(epsilon=self.epsilon_holdout, upper=self.bound,
                                   r=None if isinstance(layout, CalendarLayout) else layout.r, grid=self.grid,
                                   calendar=self.calendar, max_delay=self.max_delay if self.holdout_at_bound else None,
                                   noise=self._draws[0])
        return template.for_partitions(uppers, self._draws, lane=Lane.HOLDOUT)

    def _begin_stream(self, thresholds: np.ndarray, initials: np.ndarray | None) -> None:
        self.thresholds = thresholds
        self._initials = initials
        self._stream = self._stream_phase(thresholds, initials)

    def provisional(self) -> np.ndarray | None:
        """Rows waiting for the hold-out's threshold: the middle of the public bounds (nothing is
        released yet to predict from), or, for a hold-out released at the bound as it comes, its
        open block's rows at the hierarchy's provisional values; later rows: the stream phase's."""
        if self._stream is not None:
            waiting = self._stream.provisional()
            return None if waiting is None else self._shift_back(waiting)
        if self.holdout_at_bound:
            return self._shift_back(self._holdout.provisional().reshape(self.partitions, -1)).reshape(
                (*self._lead, -1))
        held = np.full((self.partitions, self._held_rows), self.lower + self.bound / 2)
        return held.reshape((*self._lead, -1))

    def snapshot(self) -> dict:
        held = self._held[0] if len(self._held) == 1 else np.concatenate(
            self._held or [np.empty((self.partitions, 0))], axis=1)
        return {"held": held, "thresholds": self.thresholds, "initials": self._initials if self._stream else None,
                "holdout": None if self._holdout is None else self._holdout.snapshot(),
                "stream": None if self._stream is None else self._stream.snapshot()}

    def restore(self, state: dict) -> None:
        held = np.asarray(state["held"], dtype=np.float64).reshape(self.partitions, -1)
        self._held, self._held_rows = [held], held.shape[1]
        if state["holdout"] is not None:  # released at the thresholds, or at the bound as it came (made already)
            if not self.holdout_at_bound:
                self._holdout = self._holdout_machine(np.asarray(state["thresholds"], dtype=np.float64))
            self._holdout.restore(state["holdout"])
        if state["stream"] is not None:
            thresholds = np.asarray(state["thresholds"], dtype=np.float64)
            initials = None if state["initials"] is None else np.asarray(state["initials"], dtype=np.float64)
            self._begin_stream(thresholds, initials)
            self._stream.restore(state["stream"])

    def partition_kinds(self) -> np.ndarray | None:
        # the threshold (the hold-out's and the stream phase's bound) and the stream phase's own kinds
        if self._stream is None:
            return np.zeros(self.partitions, dtype=np.int64)
        within = self._stream.partition_kinds()
        if within is None:
            return None
        return group_codes(self.thresholds, within)

    def describe(self) -> dict:
        return self.describe_partition(0)

    def describe_partition(self, partition: int) -> dict:
        params = {"epsilon": self.epsilon, "lower": self.lower, "upper": self.upper, "m": self.m,
                  "holdout_share": self.holdout_share, **self._method_params(), "max_delay": self.max_delay,
                  "holdout_at_bound": self.holdout_at_bound}
        if self.given_threshold is not None:
            params["threshold"] = self.given_threshold + self.lower
        if self.pooled:
            params.update(threshold_by="fleet", pooled_rows=self.m)
        if self.given_threshold is not None and not self.pooled:
            components = {}
        else:
            components = {"threshold": (self.epsilon_threshold, self.threshold_delta),
                          "holdout": (self.epsilon_holdout, 0.0)}
        if self._stream is None:  # a stream filling its hold-out: nothing released, or rows at the bound
            error = self._holdout.error_model(partition) if self.holdout_at_bound else IndependentNoise(0.0, 0)
            return dict(method=self.method, params=params, error=error, components=components)
        stream = self._stream.describe_partition(partition) if self.partitions > 1 else self._stream.describe()
        components.update(stream.get("components", {}))
        if self.m:
            error = SegmentedNoise([0, self.m, _ANY_LENGTH], [self._holdout.error_model(partition), stream["error"]])
        else:
            error = stream["error"]
        return dict(method=self.method, params=params, threshold=float(self.thresholds[partition]) + self.lower,
                    error=error, components=components)



def pooled_counts(start: np.ndarray, count: np.ndarray, order: np.ndarray, need: int) -> np.ndarray:
    """How many rows each partition gives a fleet's pooled hold-out of ``need`` more rows: partition
    ``p`` offers its rows ``start[p] .. start[p] + count[p] - 1`` (row numbers within it), and rows
    are taken by row number, then by ``order`` (each partition's rank: by address), the first rows
    of every partition first, until ``need`` are taken (all of them if fewer are offered).

    >>> pooled_counts(np.zeros(3, np.int64), np.array([5, 1, 5]), np.array([0, 1, 2]), 6)
    array([3, 1, 2])
    """
    start, count = np.asarray(start, np.int64), np.asarray(count, np.int64)
    if need <= 0 or not len(count):
        return np.zeros(len(count), np.int64)
    if count.sum() <= need:
        return count.copy()

    def taken(row: int) -> int:  # rows offered with row numbers below ``row``
        return int(np.clip(row - start, 0, count).sum())

    low, high = int(start.min()), int((start + count).max())  # taken(low) < need <= taken(high)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if taken(middle) < need else (low, middle)
    counts = np.clip(low - start, 0, count)  # every row numbered below ``low``
    at_low = np.flatnonzero((start <= low) & (low < start + count))  # partitions offering row ``low``
    chosen = at_low[np.argsort(order[at_low], kind="stable")][:need - int(counts.sum())]
    counts[chosen] += 1
    return counts


def pooled_by_key(keys, partition_of_row: np.ndarray, partition_rank: np.ndarray, need: int,
                  partitions: int) -> np.ndarray:
    """How many rows each of ``partitions`` gives a fleet's pooled hold-out of ``need`` rows taken
    by order key (``keys``, one per row: a numpy array or an Arrow array), ties by the partition's
    rank (by address): the fleet's earliest rows. Each partition's keys ascend, so its pooled rows
    are its first ones.

    >>> pooled_by_key(np.array([5, 1, 2, 1, 3]), np.array([0, 1, 1, 2, 2]), np.array([0, 2, 1]), 3, 3)
    array([0, 2, 1])
    """
    n = len(partition_of_row)
    if need <= 0:
        return np.zeros(partitions, np.int64)
    if need >= n:
        return np.bincount(partition_of_row, minlength=partitions).astype(np.int64)
    ranks = partition_rank[partition_of_row]
    numeric = _numeric_keys(keys)
    if numeric is None:  # text and other keys: Arrow sorts them
        import pyarrow as pa
        import pyarrow.compute as pc

        order = pc.sort_indices(pa.table({"key": keys, "rank": ranks}), sort_keys=[("key", "ascending"),
                                                                                   ("rank", "ascending")])
        chosen = order.to_numpy()[:need]
    else:
        kth = np.partition(numeric, need - 1)[need - 1]  # the need-th smallest key
        below = np.flatnonzero(numeric < kth)
        ties = np.flatnonzero(numeric == kth)
        chosen = np.concatenate([below, ties[np.argsort(ranks[ties], kind="stable")][:need - len(below)]])
    return np.bincount(partition_of_row[chosen], minlength=partitions).astype(np.int64)


def _numeric_keys(keys) -> np.ndarray | None:
    """Order keys as numbers numpy compares (integers, floats, dates, times: their physical
    values), or None for others (text)."""
    if isinstance(keys, np.ndarray) and keys.dtype.kind in "iufMm":
        return keys.view(np.int64) if keys.dtype.kind in "Mm" else keys
    import pyarrow as pa

    if isinstance(keys, (pa.Array, pa.ChunkedArray)):
        kind = keys.type
        if pa.types.is_integer(kind) or pa.types.is_floating(kind):
            return keys.to_numpy()
        if pa.types.is_temporal(kind):
            return keys.cast(pa.int64() if kind.bit_width == 64 else pa.int32()).to_numpy()
    return None
