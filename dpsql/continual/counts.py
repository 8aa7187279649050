"""One append of events to a count stream (:class:`CountAppend`): the events counted into their
partitions' open buckets, and every partition's buckets closed together, inside the one
transaction that commits them (:mod:`dpsql.continual.fleet`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from dpsql import _validate
from dpsql.continual.appends import Released, units
from dpsql.continual.fleet import SHARD, Fleet, MachineClass, Shard, merge_classes, split_state
from dpsql.continual.order import group_starts
from dpsql.continual.state import StreamSpec, bucket_starts, decoded, refuse_null_keys
from dpsql.errors import InvalidParameter, LateRow
from dpsql.timegrid import instant, ticks

if TYPE_CHECKING:
    from dpsql.continual.stream import Stream


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
        released, like = Released(), None
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
        starts = group_starts(frame, self.spec, f"stream {stream.name!r}", order="__bucket", unique_keys=False)
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
            raise InvalidParameter(f"stream {self.stream.name!r}: until={self.until!r} is earlier than the buckets "
                                   f"already closed (up to {self._time_of(closed)})")
        return target

    def _close(self, fleet: Fleet, target: int, released: Released) -> None:
        """Release every partition's buckets up to ``target`` (empty ones as zeros): each class of
        partitions at one position by one (batched) machine."""
        stream = self.stream
        for index in range(-(-fleet.partitions // SHARD)):
            shard = fleet.shard(index)
            if not (shard.rows < target).any():
                continue
            counts = self._open_counts(shard, target)
            classes: list[MachineClass] = []
            for machine_class in units(shard.classes, stream._batchable):
                members = machine_class.members
                fed = shard.rows[members]
                for start in np.unique(fed).tolist():
                    chosen = np.flatnonzero(fed == start)
                    state = None if machine_class.state is None else split_state(machine_class.state, len(members),
                                                                                 chosen)
                    if start >= target:
                        classes.append(MachineClass(members[chosen], state, machine_class.params))
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
                 released: Released) -> MachineClass:
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
