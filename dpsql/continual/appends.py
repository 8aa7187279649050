"""One append to a continual stream: the rows of a stream of values (:class:`RangeAppend`) or the
events of a count stream (:class:`CountAppend`), validated, ordered and released partition by
partition inside the one transaction that commits them."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from dpsql import _validate
from dpsql._chunks import distinct, index_type, table_bytes, table_of
from dpsql._memory import pooled_array
from dpsql.addresses import partition_address
from dpsql.continual.state import (
    TAG,
    PartitionState,
    StreamSpec,
    arrow_type,
    bucket_starts,
    decoded,
    numeric,
    refuse_null_keys,
    same_type,
    sorted_output,
    stored_keys,
    type_name,
)
from dpsql.errors import ConflictingRow, InvalidData, InvalidParameter, InvalidTimeKey, LateRow
from dpsql.ledger.streams import PartitionRow, StreamRow
from dpsql.noise import Draws
from dpsql.release import feed_into
from dpsql.timegrid import instant, ticks

if TYPE_CHECKING:
    from dpsql.continual.stream import Stream


class RangeAppend:
    """One append to a stream of values (see :meth:`Stream.append`)."""

    def __init__(self, stream: Stream, batches):
        self.stream = stream
        self.spec = stream.spec
        self.batches = batches
        self.open: dict[bytes, _Open] = {}

    def run(self) -> pa.Table:
        spec, stream = self.spec, self.stream
        keystream = stream._keystream()
        outputs, released, like = [], 0, None
        # The partitions this object's last appends left open: their state as committed, and their
        # machines as they were when it was packed, used for a partition whose row in the ledger
        # still holds exactly that state (no other append has changed it). Taken now and kept again
        # only once this append commits, so a failed append leaves nothing half-fed behind.
        kept, stream._open = stream._open, None
        with stream._store.appending(stream.budget.scope, stream.name) as (conn, row):
            self.open = kept[1] if kept is not None and kept[0] == row.release_id else {}
            known: dict[bytes, PartitionRow] = {}
            since: dict[bytes, bytes | None] = {}  # each partition's watermark before this append
            for table in self.batches:  # one batch, or a lazy frame's sorted batches: one transaction
                like = like or table
                if not table.num_rows:
                    continue  # nothing new (a quiet day, a filter that kept nothing): releases nothing
                frame, value = self._ordered(table)
                groups = _groups(frame, spec, f"stream {stream.name!r}")
                known.update(stream._store.partitions(conn, row.release_id,
                                                      [g.address for g in groups if g.address not in known]))
                for group in groups:
                    part = known.get(group.address) or _new_partition(stream, conn, row, group)
                    known[group.address] = part
                    since.setdefault(group.address, part.watermark)
                    rows = frame.slice(group.start, group.stop - group.start)
                    output, count = self._partition(conn, row, part, keystream.partition(group.address),
                                                    rows.get_column(spec.order_by).to_arrow(),
                                                    rows.get_column(value).to_numpy(), since[group.address])
                    outputs.append(output)
                    released += count
            stream._store.finish(conn, row, released)
        if len(self.open) <= _KEEP_OPEN:  # committed: the next append of this object may start from here
            stream._open = (row.release_id, self.open)
        return sorted_output(outputs, stream, like)

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

    def _partition(self, conn, row: StreamRow, part: PartitionRow, draws: Draws, keys: pa.Array,
                   values: np.ndarray, since: bytes | None) -> tuple[pa.Table, int]:
        """Release a partition's rows of one batch; ``since`` is its watermark before this append
        (a lazy frame's later batch may repeat a key of an earlier one: a duplicate, not a repeat)."""
        stream = self.stream
        opened = self.open.get(part.address)
        if opened is None or not opened.holds(part):
            opened = self.open[part.address] = _Open(part, PartitionState.unpack(part.state))
        opened.part = part
        state = opened.state
        if opened.watermark is None and part.watermark is not None:
            opened.watermark = stored_keys(part.watermark)
        watermark = opened.watermark
        keys = same_type(keys, watermark, stream)
        tags = _Tags.of(draws, values, opened.known)
        opened.known = tags.known()
        # keys are in order: none is old when the first is above the watermark (the usual append)
        old = 0 if watermark is None or pc.greater(keys[0], watermark[0]).as_py() else int(
            pc.sum(pc.less_equal(keys, watermark[0])).as_py() or 0)
        if old and part.watermark != since:
            again = keys[:old] if since is None else keys[:old].filter(
                pc.greater(keys[:old], stored_keys(since)[0]))
            if len(again):
                raise InvalidTimeKey(f"stream {stream.name!r}: order key {again[0].as_py()!r} appears twice in one "
                                     "partition of this append; time keys must be unique within a partition")
        recorded = self._repeats(conn, row, part, state, keys[:old], tags.rows(0, old), watermark) if old else None
        if recorded is not None and old == len(keys):
            return recorded, 0
        machine, opened.machine = opened.machine or stream._machine(draws, state.machine), None
        if opened.pending is None:
            opened.pending = stored_keys(state.pending_keys) if state.pending_keys else keys.slice(0, 0)
        # chunked, not concatenated: the pending rows are few, and storing the chunk copies them once
        waiting = pa.chunked_array([opened.pending.cast(keys.type), keys[old:]], keys.type)
        # into pooled memory: a fresh array at every append would be faulted in page by page
        out = feed_into(machine, values[old:], pooled_array(len(waiting)))  # room: every row waiting
        count = len(out)
        released_tags, state.pending_tags = tags.released(state.pending_tags, old, count)
        chunk = {"key": waiting[:count], "value": pa.array(out, pa.float64()), TAG: released_tags}
        if getattr(machine, "public_columns", ()):
            chunk.update({f"dp_{c}": pa.array(v) for c, v in machine.take_public().items()})
        state.machine, state.fed = machine.snapshot(), state.fed + len(keys) - old
        pending = waiting[count:].combine_chunks()
        state.pending_keys = table_bytes(pa.table({"key": pending})) if len(pending) else None
        first_row = part.rows
        if count:
            stream._store.add_rows(conn, row, part.ordinal, first_row, count, table_bytes(pa.table(chunk)))
        part.rows += count
        opened.pending = pending  # the keys state.pending_keys stores (None: not decoded yet)
        part.watermark = table_bytes(pa.table({"key": keys[len(keys) - 1:]}))
        opened.watermark = keys[len(keys) - 1:]  # what part.watermark stores
        part.state = state.pack()
        stream._store.save_partition(conn, row, part)
        if not getattr(machine, "public_columns", ()):  # (those keep every row's public columns: restored afresh)
            opened.machine = machine
        fresh = stream._output(pa.table(chunk), part, first_row)
        return pa.concat_tables([recorded, fresh]) if recorded is not None and recorded.num_rows else fresh, count

    def _repeats(self, conn, row: StreamRow, part: PartitionRow, state: PartitionState, keys: pa.Array,
                 tags: np.ndarray, watermark) -> pa.Table:
        """The recorded rows that ``keys`` (at or below the watermark) repeat; refuses any that
        is not a repeat (late) or repeats a key with another value (conflicting)."""
        stream = self.stream
        found = np.zeros(len(keys), dtype=bool)
        outputs = []
        if state.pending_keys and len(keys):  # appended before, not released yet: nothing to return
            pending = stored_keys(state.pending_keys)
            where = pc.index_in(keys, value_set=pending.cast(keys.type)).to_numpy(zero_copy_only=False)
            hit = ~np.isnan(where.astype(float))
            self._same_values(keys, tags, hit, state.pending_tags[where[hit].astype(np.int64)])
            found |= hit
        chunks = stream._store.chunks(conn, row.release_id, part.ordinal, newest_first=True)
        while not found.all():
            chunk = next(chunks, None)
            if chunk is None:
                break
            _, first_row, _, data = chunk
            table = table_of(data)
            where = pc.index_in(keys, value_set=table["key"].cast(keys.type)).to_numpy(zero_copy_only=False)
            hit = ~np.isnan(where.astype(float)) & ~found
            if hit.any():
                at = where[hit].astype(np.int64)
                self._same_values(keys, tags, hit, table[TAG].to_numpy()[at])
                outputs.append(stream._output(table.take(pa.array(at)), part, first_row, rows=at))
                found |= hit
            if not found.all() and pc.less(table["key"][0], keys[int(np.flatnonzero(~found)[0])]).as_py():
                break  # older chunks hold smaller keys only
        if not found.all():
            late = keys[int(np.flatnonzero(~found)[0])].as_py()
            raise LateRow(f"stream {stream.name!r}: a row with order key {late!r} arrives at or below its "
                          f"partition's watermark {watermark[0].as_py()!r} and repeats no row appended before; "
                          "nothing of this append was kept")
        if len(outputs) > 1:  # read newest chunk first: back in row (so order key) order
            return pa.concat_tables(outputs[::-1])
        return outputs[0] if outputs else stream._output(
            pa.table({"key": keys.slice(0, 0), "value": pa.array([], pa.float64())}), part, 0)

    def _same_values(self, keys: pa.Array, tags: np.ndarray, hit: np.ndarray, recorded_tags: np.ndarray) -> None:
        differs = tags[hit] != recorded_tags
        if differs.any():
            key = keys.filter(pa.array(hit))[int(np.flatnonzero(differs)[0])].as_py()
            raise ConflictingRow(f"stream {self.stream.name!r}: order key {key!r} was appended before with another "
                                 "value; a released row never changes (nothing of this append was kept)")


class CountAppend:
    """One append of events to a count stream (see :meth:`Stream.append`)."""

    def __init__(self, stream: Stream, batches, until):
        self.stream = stream
        self.spec = stream.spec
        self.batches = batches
        self.until = until

    def run(self) -> pa.Table:
        stream = self.stream
        label = f"stream {stream.name!r}"
        keystream = stream._keystream()
        outputs, released, like = [], 0, None
        with stream._store.appending(stream.budget.scope, stream.name) as (conn, row):
            partitions = stream._store.partitions(conn, row.release_id)
            closed = _closed_buckets(partitions)
            target = closed if self.until is None else self._closing(closed)
            touched: dict[bytes, PartitionState] = {}
            for table in self.batches:
                like = like or table
                self._count(conn, row, self._bucketed(table), partitions, touched, label)
            for address, part in partitions.items():
                state = touched.get(address) or PartitionState.unpack(part.state)
                if state.fed < target:
                    output, count = self._close(conn, row, part, state, keystream.partition(address), target)
                    outputs.append(output)
                    released += count
                elif address in touched:
                    part.state = state.pack()
                    stream._store.save_partition(conn, row, part)
            stream._store.finish(conn, row, released)
        return sorted_output(outputs, stream, like)

    def _bucketed(self, table: pa.Table) -> pl.DataFrame:
        """The batch's events with their buckets (events before the grid's start dropped), by partition."""
        spec, label = self.spec, f"stream {self.stream.name!r}"
        frame = decoded(pl.from_arrow(table), spec.partition_by)
        refuse_null_keys(frame, spec, label)
        buckets = spec.grid.buckets(ticks(table[spec.order_by], f"{label}: {spec.order_by}", spec.datetime))
        frame = frame.with_columns(pl.Series("__bucket", buckets)).filter(pl.col("__bucket") >= 0)
        return frame.sort([*spec.partition_by, "__bucket"], maintain_order=True)

    def _count(self, conn, row: StreamRow, frame: pl.DataFrame, partitions: dict, touched: dict,
               label: str) -> None:
        """Add a batch's events to their partitions' open buckets (refusing late ones)."""
        stream = self.stream
        for group in _groups(frame, self.spec, label, order="__bucket", unique_keys=False):
            part = partitions.get(group.address) or _new_partition(stream, conn, row, group)
            partitions[group.address] = part
            state = touched.get(group.address) or PartitionState.unpack(part.state)
            counted = frame.slice(group.start, group.stop - group.start).get_column("__bucket").to_numpy()
            late = counted < state.fed
            if late.any():
                raise LateRow(f"stream {stream.name!r}: an event at {self._time_of(int(counted[late][0]))} "
                              f"falls in a bucket already released (the stream is closed up to "
                              f"{self._time_of(state.fed)}); nothing of this append was kept")
            bucket, count = np.unique(counted, return_counts=True)
            for b, c in zip(bucket.tolist(), count.tolist()):
                state.counts[b] = state.counts.get(b, 0.0) + c
            touched[group.address] = state

    def _closing(self, closed: int) -> int:
        grid = self.spec.grid
        until = instant(self.until, "until") if grid.datetime else _validate.real(self.until, "until")
        target = int(grid.buckets(np.array([until]))[0])
        if target < closed:
            raise InvalidParameter(f"stream {self.stream.name!r}: until={self.until!r} is earlier than the buckets "
                                   f"already closed (up to {self._time_of(closed)})")
        return target

    def _close(self, conn, row: StreamRow, part: PartitionRow, state: PartitionState, draws: Draws,
               target: int) -> tuple[pa.Table, int]:
        stream = self.stream
        counts = np.array([state.counts.pop(b, 0.0) for b in range(state.fed, target)], dtype=np.float64)
        machine = stream._machine(draws, state.machine)
        out = machine.feed(counts)
        chunk = {"key": bucket_starts(np.arange(state.fed, state.fed + len(out)), self.spec),
                 "value": pa.array(out, pa.float64())}
        if getattr(machine, "public_columns", ()):
            chunk.update({f"dp_{c}": pa.array(v) for c, v in machine.take_public().items()})
        state.machine, state.fed = machine.snapshot(), target
        first_row = part.rows
        if len(out):
            stream._store.add_rows(conn, row, part.ordinal, first_row, len(out), table_bytes(pa.table(chunk)))
        part.rows += len(out)
        part.watermark = table_bytes(pa.table({"key": bucket_starts(np.array([target]), self.spec)}))
        part.state = state.pack()
        stream._store.save_partition(conn, row, part)
        return stream._output(pa.table(chunk), part, first_row), len(out)

    def _time_of(self, bucket: int):
        return bucket_starts(np.array([bucket]), self.spec)[0].as_py()


def _new_partition(stream: Stream, conn, row: StreamRow, group: _Group) -> PartitionRow:
    """Add the group's partition, its keys typed as the stream's first partition's (a key of another
    kind, which could never be read back beside them, is refused)."""
    types = stream._store.key_types(conn, row)
    text = group.key_text
    if types is not None and types != group.types:
        for column, value, kind, given in zip(stream.spec.partition_by, group.values, types, group.types):
            try:
                same = pa.array([value], type=arrow_type(kind)).to_pylist() == [value]  # 2.0 is 2, 2.5 is not
            except (pa.ArrowException, TypeError, ValueError):
                same = False
            if not same:
                raise InvalidData(f"stream {stream.name!r}: partition column {column!r} holds {value!r} ({given}); "
                                  f"the stream's partition keys are {kind} (nothing of this append was kept)")
        text = json.dumps({"values": group.values, "types": types}, default=str)
    return stream._store.new_partition(conn, row, group.address, text, PartitionState().pack())


def _closed_buckets(partitions: dict[bytes, PartitionRow]) -> int:
    """Buckets released by every partition: all partitions are closed together."""
    fed = [PartitionState.unpack(p.state).fed for p in partitions.values()]
    return max(fed) if fed else 0


#: Partitions whose open machines a stream object keeps between its appends (more: none kept).
_KEEP_OPEN = 16


@dataclass
class _Open:
    """A partition as this append leaves it: its row, its unpacked state, the machine whose
    snapshot that state holds (None: restore it from the state), its watermark and pending keys
    as arrays (None: decode them from the row and the state), and the tags of its last batch's
    values (:meth:`_Tags.known`; a function of the stream's key and the values alone)."""

    part: PartitionRow
    state: PartitionState
    machine: Any = None
    watermark: pa.Array | None = None
    pending: pa.Array | None = None
    known: tuple[np.ndarray, np.ndarray] | None = None  # the last batch's distinct values and tags

    def holds(self, part: PartitionRow) -> bool:
        """Is ``part`` (as read from the ledger) the partition as this one left it?"""
        mine = self.part
        return mine is part or (mine.state == part.state and mine.watermark == part.watermark
                                and (mine.ordinal, mine.first_handle, mine.rows) == (part.ordinal, part.first_handle,
                                                                                     part.rows))


@dataclass
class _Tags:
    """The keyed tag (:meth:`Draws.tags`) of each value of a batch. When the values repeat
    (counts, readings in steps), one tag per distinct value (``values``, as bits) and each row's
    index into them (``indices``): the ledger stores the released rows' tags so, a byte or two a
    row, instead of hashing every row's tag again; else one tag per row (``indices`` None)."""

    tags: np.ndarray  # uint64
    indices: np.ndarray | None = None  # intp, one per row
    values: np.ndarray | None = None  # int64 bits, one per tag

    @classmethod
    def of(cls, draws: Draws, values: np.ndarray, known: tuple[np.ndarray, np.ndarray] | None = None) -> _Tags:
        """``known``: ``(values, tags)`` of the partition's previous batch (:meth:`known`), looked
        up first and not hashed again: a stream's values keep their distribution from batch to batch."""
        values = np.ascontiguousarray(values, dtype=np.float64) + 0.0  # -0.0 + 0.0 is 0.0: equal values, equal tags
        bits = values.view(np.int64)
        found = distinct(bits, None if known is None else known[0])
        if found is None:
            return cls(draws.tags(values))
        indices, dictionary = found
        reused = 0 if known is None or not _starts_with(dictionary, known[0]) else len(known[0])
        tags = draws.tags(dictionary[reused:].view(np.float64))
        return cls(np.concatenate([known[1], tags]) if reused else tags, indices, dictionary)

    def known(self) -> tuple[np.ndarray, np.ndarray] | None:
        """``(values, tags)`` to look up first in the partition's next batch: this batch's
        distinct values, when they are few."""
        return None if self.values is None or len(self.values) > _KNOWN else (self.values, self.tags)

    def rows(self, start: int, stop: int | None = None) -> np.ndarray:
        """The tags of rows ``start:stop``, one per row (``uint64``)."""
        return self.tags[start:stop] if self.indices is None else self.tags[self.indices[start:stop]]

    def released(self, pending: np.ndarray, start: int, count: int) -> tuple[pa.Array, np.ndarray]:
        """The tags of ``count`` released rows, those still ``pending`` from earlier appends first,
        then this batch's rows from ``start``, as the ledger stores them; and the tags then still
        pending."""
        held = min(count, len(pending))
        new = count - held
        after = np.concatenate([pending[count:], self.rows(start)]) if count < len(pending) else \
            self.rows(start + new)
        if self.indices is None:
            return pa.array(np.concatenate([pending[:held], self.tags[start:start + new]]), pa.uint64()), after
        earlier, at = _indices_in(pending[:held], self.tags)
        dictionary = np.concatenate([earlier, self.tags])  # may hold a tag twice: no matter
        indices = np.empty(count, dtype=index_type(len(dictionary)))
        indices[:held] = at
        np.add(self.indices[start:start + new], len(earlier), out=indices[held:], casting="unsafe")
        return pa.DictionaryArray.from_arrays(indices, pa.array(dictionary, pa.uint64()), safe=False), after


#: Distinct values of a batch kept for the partition's next one (more: it looks its own up).
_KNOWN = 256


def _starts_with(array: np.ndarray, prefix: np.ndarray) -> bool:
    return len(array) >= len(prefix) and np.array_equal(array[:len(prefix)], prefix)


def _indices_in(tags: np.ndarray, dictionary: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(extra, indices)``: ``tags`` as indices into ``extra`` followed by ``dictionary``,
    ``extra`` the distinct tags that ``dictionary`` lacks (pending rows' tags, mostly among the
    batch's: the dictionary stays small enough for 8-bit indices)."""
    order = np.argsort(dictionary)
    ranked = dictionary[order]
    at = np.minimum(np.searchsorted(ranked, tags), len(ranked) - 1)
    hit = ranked[at] == tags
    extra, inverse = np.unique(tags[~hit], return_inverse=True)
    indices = np.empty(len(tags), dtype=np.intp)
    indices[hit] = len(extra) + order[at[hit]]
    indices[~hit] = inverse
    return extra, indices


@dataclass
class _Group:
    address: bytes
    key_text: str
    start: int
    stop: int
    values: list = field(default_factory=list)
    types: list = field(default_factory=list)


def _groups(frame: pl.DataFrame, spec: StreamSpec, label: str, *, order: str | None = None,
            unique_keys: bool = True) -> list[_Group]:
    """The partitions of a sorted append, with their keys; refuses a key twice in one partition."""
    order = order or spec.order_by
    n = frame.height
    if n == 0:
        return []
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
    starts = np.flatnonzero(new).tolist()
    groups = []
    types = [type_name(frame.schema[c]) for c in spec.partition_by]
    for a, b in zip(starts, [*starts[1:], n]):
        values = [frame.get_column(c)[a] for c in spec.partition_by]
        key = values[0] if len(values) == 1 else tuple(values)
        text = json.dumps({"values": values, "types": types}, default=str)
        groups.append(_Group(b"" if not values else partition_address(key), text, a, b, values, types))
    return groups


