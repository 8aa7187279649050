"""One append to a continual stream: the rows of a stream of values (:class:`RangeAppend`) or the
events of a count stream (:class:`CountAppend`), validated, ordered and released, all partitions
together (:mod:`dpsql.continual.fleet`), inside the one transaction that commits them.

A stream of values releases every new row at once: with its final value when its machine outputs
it (a per-row method, a block that completes), else with a *provisional* value, a prediction from
values released before (:meth:`~dpsql.release.StreamMachine.provisional`: post-processing, free),
and later, in the append that completes its block or hold-out, with its final value. Both are
recorded (``dp_final`` says which); a row's values never change once recorded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from dpsql import _validate
from dpsql.continual.fleet import SHARD, Fleet, MachineClass, Shard, merge_classes, split_state
from dpsql.continual.state import (
    FINAL,
    TAG,
    StreamSpec,
    bucket_starts,
    decoded,
    numeric,
    refuse_null_keys,
    same_type,
    short_tags,
)
from dpsql.errors import InvalidTimeKey, LateRow
from dpsql.noise import DrawsBatch
from dpsql.release import feed_into
from dpsql.timegrid import instant, ticks

if TYPE_CHECKING:
    from dpsql.continual.stream import Stream


class _Released:
    """The rows an append releases, piece by piece: for the ledger's chunk (partition ordinal, row
    index, order key, value, final, tag) and for the caller."""

    def __init__(self):
        self.pieces: list[dict] = []
        self.recorded: list[pa.Table] = []  # repeated rows, as recorded (returned, not stored again)
        self.new_rows = 0  # rows appended for the first time
        self.output: pa.Table | None = None  # what the append returns (made before its transaction ends)

    def add(self, ordinals, indices, keys: pa.Array, values, final, tags, public: dict | None = None) -> None:
        if len(keys):
            self.pieces.append({"dp_partition": ordinals, "dp_index": indices, "key": keys, "value": values,
                                FINAL: final, TAG: tags, **(public or {})})

    def chunk(self) -> pa.Table | None:
        if not self.pieces:
            return None
        names = list(self.pieces[0])
        columns = {}
        for name in names:
            parts = [p[name] for p in self.pieces]
            if isinstance(parts[0], (pa.Array, pa.ChunkedArray)):
                columns[name] = pa.chunked_array([p for part in parts for p in (
                    part.chunks if isinstance(part, pa.ChunkedArray) else [part])])
            else:
                columns[name] = np.concatenate(parts)
        table = pa.table(columns)
        order = np.lexsort((table["dp_index"].to_numpy(), table["dp_partition"].to_numpy()))
        return table if (np.diff(order) == 1).all() else table.take(pa.array(order))


class RangeAppend:
    """One append to a stream of values (see :meth:`Stream.append`)."""

    def __init__(self, stream: Stream, batches):
        self.stream = stream
        self.spec: StreamSpec = stream.spec
        self.batches = batches

    def run(self) -> pa.Table:
        stream = self.stream
        released, like = _Released(), None
        with stream._store.appending(stream.budget.scope, stream.name) as (conn, row):
            fleet = stream._fleet(conn, row)
            self.fleet = fleet
            self.since: dict[int, pa.Scalar | None] = {}  # each partition's watermark before this append
            for table in self.batches:  # one batch, or a lazy frame's sorted batches: one transaction
                like = like or table
                if table.num_rows:  # nothing new (a quiet day, a filter that kept nothing): nothing
                    self._batch(table, released)
            stream._commit(conn, row, fleet, released)
        return stream._appended(released, like)

    def _batch(self, table: pa.Table, released: _Released) -> None:
        frame, value = self._ordered(table)
        label = f"stream {self.stream.name!r}"
        starts = _group_starts(frame, self.spec, label)
        stops = np.append(starts[1:], frame.height)
        keys = frame.get_column(self.spec.order_by).to_arrow()
        values = self._values = frame.get_column(value).to_numpy()
        ordinals = self.stream._ordinals(self.fleet, frame, starts)
        shards = ordinals // SHARD
        for index in np.unique(shards).tolist():
            groups = np.flatnonzero(shards == index)
            self._advance(self.fleet.shard(index), ordinals[groups], starts[groups], stops[groups], keys, values,
                          released)

    def _ordered(self, table: pa.Table) -> tuple[pl.DataFrame, str]:
        """The batch validated, in (partition, order key) order, and the name of its column of
        values as float64 (the value column itself when it is float64: shared, not copied)."""
        spec, label = self.spec, f"stream {self.stream.name!r}"
        frame = decoded(pl.from_arrow(table), spec.partition_by)
        refuse_null_keys(frame, spec, label)
        column = numeric(frame.get_column(spec.value), spec.value, label)
        values = _validate.values(column, spec.value)
        value = spec.value
        if column.dtype != pl.Float64:
            value = "__value"
            frame = frame.with_columns(pl.Series(value, values))
        if not spec.partition_by and frame.get_column(spec.order_by).is_sorted():
            return frame, value  # rows usually arrive in time order: no sort needed
        return frame.sort([*spec.partition_by, spec.order_by], maintain_order=True), value

    def _advance(self, shard: Shard, ordinals: np.ndarray, starts: np.ndarray, stops: np.ndarray,
                 keys: pa.Array, values: np.ndarray, released: _Released) -> None:
        """Release the rows ``starts[g]:stops[g]`` of the partitions ``ordinals`` (all in
        ``shard``): repeats and late rows first, then every machine class's new rows at once."""
        stream = self.stream
        positions = ordinals - shard.index * SHARD
        keys = same_type(keys, shard.watermark, stream)
        starts = self._past_watermark(shard, ordinals, positions, starts, stops, keys, released)
        counts = stops - starts
        if not counts.any():
            return
        live = counts > 0
        ordinals, positions, starts, counts = ordinals[live], positions[live], starts[live], counts[live]
        draws = stream._draws(self.fleet, ordinals)
        rows_of_new = _ranges(starts, counts)
        tags = short_tags(draws.tags(np.repeat(np.arange(len(ordinals)), counts), values[rows_of_new]))
        where = np.full(shard.size, -1, dtype=np.int64)  # each touched position's place among the groups
        where[positions] = np.arange(len(positions))
        classes: list[MachineClass] = []
        for machine_class in _units(shard.classes, stream._batchable):
            members = machine_class.members
            touched = where[members] >= 0
            if not touched.any():
                classes.append(machine_class)
                continue
            rest = np.flatnonzero(~touched)
            if len(rest):
                classes.append(MachineClass(members[rest], None if machine_class.state is None else split_state(
                    machine_class.state, len(members), rest)))
            chosen = np.flatnonzero(touched)
            for n in np.unique(counts[where[members[chosen]]]).tolist():
                subset = chosen[counts[where[members[chosen]]] == n]
                groups = where[members[subset]]
                state = None if machine_class.state is None else split_state(machine_class.state, len(members),
                                                                             subset)
                classes.append(self._feed(shard, members[subset], state, groups, n, ordinals, starts, keys, values,
                                          tags, rows_of_new, counts, draws, released))
        shard.classes = merge_classes(classes, stream._batchable)
        shard.rows[positions] += counts
        released.new_rows += int(counts.sum())
        last = pa.array(starts + counts - 1)
        shard.watermark = _set(shard.watermark, positions, keys.take(last), keys.type)

    def _feed(self, shard: Shard, members: np.ndarray, state: dict | None, groups: np.ndarray, n: int,
              ordinals, starts, keys: pa.Array, values: np.ndarray, tags: np.ndarray, rows_of_new, counts,
              draws: DrawsBatch, released: _Released) -> MachineClass:
        """Feed ``n`` new rows to each of the partitions ``members`` (one class, one position):
        their batched machine, restored, gives the final values it outputs and provisional ones
        for the rest; returns the class they form after."""
        stream = self.stream
        k = len(members)
        fed, final = int(shard.rows[members[0]]), int(shard.final[members[0]])
        machine = stream._batch_machine(draws.take(groups), state)
        rows = starts[groups][:, None] + np.arange(n)
        chunk = values[rows] if stream._batchable else values[rows[0]]
        room = np.empty((k, fed - final + n)) if stream._batchable else np.empty(fed - final + n)
        out = feed_into(machine, chunk, room).reshape(k, -1)
        waiting = machine.provisional()
        waiting = np.empty((k, 0)) if waiting is None else np.asarray(waiting).reshape(k, -1)
        emitted, provisional = out.shape[1], waiting.shape[1]
        if emitted + provisional != fed - final + n:
            raise AssertionError(f"{type(machine).__name__} accounted for {emitted + provisional} rows, "
                                 f"expected {fed - final + n}")
        # the rows released now: the partition's earlier provisional rows, then the new ones
        old_keys, old_tags = _pending(shard, members, final, fed)
        new_positions = _ranges(starts[groups], np.full(k, n))
        count = fed - final + n
        keys_now = _interleaved(old_keys, keys.take(pa.array(new_positions)), fed - final, n, k)
        group_tags = tags[_ranges(np.searchsorted(rows_of_new, starts[groups]), np.full(k, n))]
        tags_now = np.concatenate([old_tags.reshape(k, -1), group_tags.reshape(k, n)], axis=1).reshape(-1)
        value_now = np.concatenate([out, waiting], axis=1).reshape(-1)
        final_now = np.tile(np.arange(count) < emitted, k)
        ordinal_now = np.repeat(ordinals[groups], count)
        index_now = np.tile(np.arange(final, final + count, dtype=np.int64), k)
        public = {f"dp_{c}": pa.array(v) for c, v in machine.take_public().items()} if getattr(
            machine, "public_columns", ()) else None
        released.add(ordinal_now, index_now, keys_now, value_now, final_now, tags_now, public)
        shard.final[members] = final + emitted
        _set_pending(shard, members, keys_now, tags_now, final_now, index_now)
        return MachineClass(members, machine.snapshot())

    def _past_watermark(self, shard: Shard, ordinals, positions, starts, stops, keys: pa.Array,
                        released: _Released) -> np.ndarray:
        """Where each group's new rows start: rows at or below the partition's watermark must
        repeat rows appended before (returned as recorded), else the append is refused."""
        if shard.watermark is None or not len(positions):
            return starts
        marks = shard.watermark.take(pa.array(positions))
        firsts = keys.take(pa.array(starts))
        old = pc.fill_null(pc.less_equal(firsts, marks), False).to_numpy(zero_copy_only=False)
        for g in np.flatnonzero(old).tolist():
            ordinal = int(ordinals[g])
            mark = marks[g]
            group = keys.slice(starts[g], stops[g] - starts[g])
            repeated = int(pc.sum(pc.less_equal(group, mark)).as_py() or 0)
            since = self.since.setdefault(ordinal, mark)
            if since is None or not since.is_valid:
                again = group[:repeated]
            else:
                again = group[:repeated].filter(pc.greater(group[:repeated], since))
            if len(again):
                raise InvalidTimeKey(f"stream {self.stream.name!r}: order key {again[0].as_py()!r} appears twice in "
                                     "one partition of this append; time keys must be unique within a partition")
            tags = short_tags(self.stream._draws(self.fleet, np.array([ordinal])).tags(
                np.zeros(repeated, np.int64), self._values[starts[g]:starts[g] + repeated]))
            recorded = self.stream._repeated(self.fleet, ordinal, group[:repeated], tags, mark)
            if recorded is not None:
                released.recorded.append(recorded)
            starts[g] += repeated
        for g in np.flatnonzero(~old).tolist():
            self.since.setdefault(int(ordinals[g]), marks[g])
        return starts


def _units(classes: list[MachineClass], batchable: bool) -> list[MachineClass]:
    """The classes as machines advance them: whole for batched machines, else one partition each
    (partitions that joined together share a class until they are first fed)."""
    if batchable:
        return classes
    return [c if len(c.members) == 1 else MachineClass(c.members[j:j + 1], None) for c in classes
            for j in range(len(c.members) if c.state is None else 1)]


def _group_starts(frame: pl.DataFrame, spec: StreamSpec, label: str, *, order: str | None = None,
                  unique_keys: bool = True) -> np.ndarray:
    """The first row of each partition of a sorted batch; refuses a key twice in one partition."""
    order = order or spec.order_by
    n = frame.height
    new = np.zeros(n, dtype=bool)
    new[0] = True
    for column in spec.partition_by:
        c = frame.get_column(column)
        new[1:] |= c.slice(1).ne_missing(c.slice(0, n - 1)).to_numpy()
    if unique_keys:
        key = frame.get_column(order)
        if key.dtype.is_numeric() or key.dtype.is_temporal():  # no nulls (refused): numpy's view, no copy
            keys = key.to_numpy()
            same = keys[1:] == keys[:-1]
        else:
            same = key.slice(1).eq_missing(key.slice(0, n - 1)).to_numpy()
        repeated = np.flatnonzero(~new[1:] & same) if same.any() else np.empty(0, np.int64)
        if repeated.size:
            raise InvalidTimeKey(f"{label}: order key {key[int(repeated[0]) + 1]!r} appears twice in one partition of "
                                 "this append; time keys must be unique within a partition")
    return np.flatnonzero(new)


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + c) for s, c in zip(starts, counts)])``, vectorised."""
    total = int(counts.sum())
    return np.repeat(starts, counts) + (np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts))


def _interleaved(old: pa.Array, new: pa.Array, q: int, n: int, k: int) -> pa.Array:
    """Per partition, its ``q`` old keys then its ``n`` new ones (``k`` partitions, each's keys
    consecutive in ``old`` and ``new``)."""
    if not q:
        return new
    joined = pa.concat_arrays([old.cast(new.type), new.combine_chunks() if isinstance(new, pa.ChunkedArray) else new])
    order = np.concatenate([np.arange(k * q).reshape(k, q), k * q + np.arange(k * n).reshape(k, n)], axis=1)
    return joined.take(pa.array(order.reshape(-1)))


def _pending(shard: Shard, members: np.ndarray, final: int, fed: int) -> tuple[pa.Array, np.ndarray]:
    """The keys and tags of the provisional rows ``final .. fed - 1`` of each of ``members``."""
    if fed == final or shard.pending is None:
        return pa.array([], pa.null()), np.empty(0, np.int32)
    pending = shard.pending
    chosen = pending.filter(pc.is_in(pending["position"], value_set=pa.array(members)))
    return chosen["key"].combine_chunks(), chosen[TAG].to_numpy()


def _set_pending(shard: Shard, members: np.ndarray, keys: pa.Array, tags: np.ndarray, final: np.ndarray,
                 indices: np.ndarray) -> None:
    """Replace the provisional rows of ``members`` by those still provisional now."""
    waiting = np.flatnonzero(~final)
    rows = pa.table({"position": pa.array(np.repeat(members, len(final) // max(len(members), 1))[waiting]),
                     "index": pa.array(indices[waiting]), "key": keys.take(pa.array(waiting)),
                     TAG: pa.array(tags[waiting])})
    if shard.pending is not None and shard.pending.num_rows:
        kept = shard.pending.filter(pc.invert(pc.is_in(shard.pending["position"], value_set=pa.array(members))))
        rows = pa.concat_tables([kept, rows.cast(kept.schema)]) if kept.num_rows else rows
    shard.pending = rows.sort_by([("position", "ascending"), ("index", "ascending")]) if rows.num_rows else None


def _set(column: pa.Array | None, positions: np.ndarray, values: pa.Array, kind: pa.DataType) -> pa.Array:
    """``column`` with ``column[positions] = values``."""
    base = column.cast(kind) if column is not None else pa.nulls(int(positions.max()) + 1, kind)
    index = np.arange(len(base))
    chooser = np.full(len(base), -1, dtype=np.int64)
    chooser[positions] = np.arange(len(positions))
    joined = pa.concat_arrays([base, values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values])
    picks = np.where(chooser >= 0, len(base) + chooser, index)
    return joined.take(pa.array(picks))


class CountAppend:
    """One append of events to a count stream (see :meth:`Stream.append`). Every partition closes
    its buckets together (up to the stream's ``closed`` fact), each by its own machine."""

    def __init__(self, stream: Stream, batches, until):
        self.stream = stream
        self.spec: StreamSpec = stream.spec
        self.batches = batches
        self.until = until

    def run(self) -> pa.Table:
        stream = self.stream
        released, like = _Released(), None
        with stream._store.appending(stream.budget.scope, stream.name) as (conn, row):
            fleet = self.fleet = stream._fleet(conn, row)
            closed = int(fleet.facts.get("closed", 0))
            target = closed if self.until is None else self._closing(closed)
            for table in self.batches:
                like = like or table
                self._count(fleet, self._bucketed(table), closed)
            self._close(fleet, target, released)
            fleet.facts["closed"] = max(closed, target)
            stream._commit(conn, row, fleet, released)
        return stream._appended(released, like)

    def _bucketed(self, table: pa.Table) -> pl.DataFrame:
        """The batch's events with their buckets (events before the grid's start dropped), by partition."""
        spec, label = self.spec, f"stream {self.stream.name!r}"
        frame = decoded(pl.from_arrow(table), spec.partition_by)
        refuse_null_keys(frame, spec, label)
        buckets = spec.grid.buckets(ticks(table[spec.order_by], f"{label}: {spec.order_by}", spec.datetime))
        frame = frame.with_columns(pl.Series("__bucket", buckets)).filter(pl.col("__bucket") >= 0)
        return frame.sort([*spec.partition_by, "__bucket"], maintain_order=True)

    def _count(self, fleet: Fleet, frame: pl.DataFrame, closed: int) -> None:
        """Add a batch's events to their partitions' open buckets (refusing late ones)."""
        if not frame.height:
            return
        stream = self.stream
        buckets = frame.get_column("__bucket").to_numpy()
        late = buckets < closed
        if late.any():
            raise LateRow(f"stream {stream.name!r}: an event at {self._time_of(int(buckets[late][0]))} falls in a "
                          f"bucket already released (the stream is closed up to {self._time_of(closed)}); nothing "
                          "of this append was kept")
        starts = _group_starts(frame, self.spec, f"stream {stream.name!r}", order="__bucket", unique_keys=False)
        ordinals = stream._ordinals(fleet, frame, starts)
        which = np.repeat(ordinals, np.diff(np.append(starts, frame.height)))
        for index in np.unique(which // SHARD).tolist():
            mine = which // SHARD == index
            shard = fleet.shard(index)
            events = pa.table({"position": pa.array(which[mine] - index * SHARD), "bucket": pa.array(buckets[mine]),
                               "count": pa.array(np.ones(int(mine.sum())))})
            if shard.counts is not None and shard.counts.num_rows:
                events = pa.concat_tables([shard.counts, events])
            summed = events.group_by(["position", "bucket"]).aggregate([("count", "sum")])
            shard.counts = pa.table({"position": summed["position"], "bucket": summed["bucket"],
                                     "count": summed["count_sum"]})

    def _closing(self, closed: int) -> int:
        grid = self.spec.grid
        until = instant(self.until, "until") if grid.datetime else _validate.real(self.until, "until")
        target = int(grid.buckets(np.array([until]))[0])
        if target < closed:
            from dpsql.errors import InvalidParameter

            raise InvalidParameter(f"stream {self.stream.name!r}: until={self.until!r} is earlier than the buckets "
                                   f"already closed (up to {self._time_of(closed)})")
        return target

    def _close(self, fleet: Fleet, target: int, released: _Released) -> None:
        """Release every partition's buckets up to ``target`` (empty ones as zeros): each class of
        partitions at one position by one (batched) machine."""
        stream = self.stream
        for index in range(-(-fleet.partitions // SHARD)):
            shard = fleet.shard(index)
            if not (shard.rows < target).any():
                continue
            counts = self._open_counts(shard, target)
            classes: list[MachineClass] = []
            for machine_class in _units(shard.classes, stream._batchable):
                members = machine_class.members
                fed = shard.rows[members]
                for start in np.unique(fed).tolist():
                    chosen = np.flatnonzero(fed == start)
                    state = None if machine_class.state is None else split_state(machine_class.state, len(members),
                                                                                 chosen)
                    if start >= target:
                        classes.append(MachineClass(members[chosen], state))
                        continue
                    classes.append(self._release(shard, members[chosen], state, counts, start, target, released))
            shard.classes = merge_classes(sorted(classes, key=lambda c: int(c.members[0])), stream._batchable)
            if shard.counts is not None and shard.counts.num_rows:
                kept = shard.counts.filter(pc.greater_equal(shard.counts["bucket"], target))
                shard.counts = kept if kept.num_rows else None

    def _open_counts(self, shard: Shard, target: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Each position's counted buckets before ``target``: ``(buckets, counts)``."""
        counts = shard.counts
        if counts is None or not counts.num_rows:
            return {}
        due = counts.filter(pc.less(counts["bucket"], target)).sort_by("position")
        positions = due["position"].to_numpy()
        bounds = np.flatnonzero(np.diff(positions)) + 1
        return {int(p[0]): (b, c) for p, b, c in zip(np.split(positions, bounds), np.split(due["bucket"].to_numpy(),
                                                                                          bounds),
                                                     np.split(due["count"].to_numpy(), bounds))}

    def _release(self, shard: Shard, members: np.ndarray, state: dict | None, counts: dict, start: int, target: int,
                 released: _Released) -> MachineClass:
        """Buckets ``start .. target - 1`` of the partitions ``members`` (one position), released."""
        stream = self.stream
        k, n = len(members), target - start
        matrix = np.zeros((k, n))
        for j, position in enumerate(members.tolist()):
            if position in counts:
                buckets, values = counts[position]
                matrix[j, buckets - start] = values
        ordinals = shard.index * SHARD + members
        machine = stream._batch_machine(stream._draws(self.fleet, ordinals), state)
        out = np.asarray(machine.feed(matrix if stream._batchable else matrix[0])).reshape(k, -1)
        public = {f"dp_{c}": pa.array(v) for c, v in machine.take_public().items()} if getattr(
            machine, "public_columns", ()) else None
        emitted = out.shape[1]
        buckets = np.tile(np.arange(start, start + emitted, dtype=np.int64), k)
        released.add(np.repeat(ordinals, emitted), buckets, bucket_starts(buckets, self.spec), out.reshape(-1),
                     np.ones(k * emitted, bool), np.zeros(k * emitted, np.int32), public)
        released.new_rows += k * emitted
        shard.rows[members] = shard.final[members] = target
        return MachineClass(members, machine.snapshot())

    def _time_of(self, bucket: int):
        return bucket_starts(np.array([bucket]), self.spec)[0].as_py()
