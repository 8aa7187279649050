"""One append to a stream of values (:class:`RangeAppend`): its rows validated, ordered and
released, all partitions together (:mod:`dpsql.continual.fleet`), inside the one transaction that
commits them (count streams: :mod:`dpsql.continual.counts`).

A stream of values releases every new row at once: with its final value when its machine outputs
it (a per-row method, a block that completes), else with a *provisional* value, a prediction from
values released before (:meth:`~dpsql.release.StreamMachine.provisional`: post-processing, free),
and later, in the append that completes its block or hold-out, with its final value. Both are
recorded (``dp_final`` says which); a row's values never change once recorded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from dpsql import _validate
from dpsql._groups import same_groups
from dpsql._memory import gathered, pooled_array
from dpsql.continual.fleet import SHARD, MachineClass, Shard, merge_classes, split_state
from dpsql.continual.order import group_starts, in_stream_order
from dpsql.continual.state import (
    FINAL,
    TAG,
    StreamSpec,
    decoded,
    numeric,
    refuse_null_keys,
    same_type,
    value_tags,
)
from dpsql.errors import InvalidTimeKey
from dpsql.noise import DrawsBatch
from dpsql.release import feed_into
from dpsql.timegrid import RowGrid, partition_grids, ticks

if TYPE_CHECKING:
    from dpsql.continual.stream import Stream

#: Partitions whose machines an append leaves warm for the same stream object's next append, which
#: would otherwise restore them from the ledger and redraw what they derive from their noise (a
#: calendar year's consistent noise forest: about 3 kB per partition).
WARM_PARTITIONS = 1 << 14


class Released:
    """The rows an append releases, piece by piece: for the ledger's chunk (partition ordinal, row
    index, order key, value, final, tag) and for the caller."""

    def __init__(self):
        self.pieces: list[dict] = []
        self.recorded: list[pa.Table] = []  # repeated rows, as recorded (returned, not stored again)
        self.new_rows = 0  # rows appended for the first time
        self.output: pa.Table | None = None  # what the append returns (made before its transaction ends)

    def add(self, ordinals, indices, keys: pa.Array, values, final, tags, public: dict | None = None) -> None:
        """Rows released now; ``tags`` None for a stream that keeps no value tags."""
        if len(keys):
            self.pieces.append({"dp_partition": ordinals, "dp_index": indices, "key": keys, "value": values,
                                FINAL: final, **({} if tags is None else {TAG: tags}), **(public or {})})

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
            elif len(parts) > 1:  # into pooled memory: a chunk's columns are megabytes (see dpsql._memory)
                columns[name] = np.concatenate(parts, out=pooled_array(sum(len(p) for p in parts), parts[0].dtype))
            else:
                columns[name] = parts[0]
        if self._in_order():
            return pa.table(columns)
        partition, index = np.asarray(columns["dp_partition"]), np.asarray(columns["dp_index"])
        piece_starts = np.cumsum([len(p["dp_partition"]) for p in self.pieces[:-1]], dtype=np.int64)
        if (order := _runs_in_turn(partition, piece_starts)) is None:
            # a row released twice in one append (a lazy frame's later batch completed its block)
            # keeps its last version
            order = np.lexsort((index, partition))
            order = order[np.append((np.diff(partition[order]) != 0) | (np.diff(index[order]) != 0), True)]
        return pa.table({name: _rows_of(column, order) for name, column in columns.items()})

    def _in_order(self) -> bool:
        """Whether the pieces' rows are by partition, then row, each once: each piece's partitions
        ascend (a partition's rows in a piece ascend by construction), and each piece's come after
        the piece's before."""
        last = -1
        for piece in self.pieces:
            partition = np.asarray(piece["dp_partition"])
            if not len(partition):
                continue
            if partition[0] <= last or not (partition[1:] >= partition[:-1]).all():
                return False
            last = partition[-1]
        return True


@dataclass
class _New:
    """An append's new rows, partition by partition (``counts[g]`` rows of partition
    ``ordinals[g]`` from ``starts[g]``), with their value tags and the partitions' draws."""

    ordinals: np.ndarray
    starts: np.ndarray
    counts: np.ndarray
    keys: pa.Array
    values: np.ndarray
    tags: np.ndarray | None  # the new rows', group after group (None: the stream keeps no tags)
    draws: DrawsBatch
    #: where each group's tags start in ``tags``
    tag_starts: np.ndarray = field(init=False)
    #: the rows still provisional after this append, of the partitions it fed (position, index, key, tag)
    pending: list = field(default_factory=list)

    def __post_init__(self):
        self.tag_starts = np.cumsum(self.counts) - self.counts


class RangeAppend:
    """One append to a stream of values (see :meth:`Stream.append`)."""

    def __init__(self, stream: Stream, batches):
        self.stream = stream
        self.spec: StreamSpec = stream.spec
        self.batches = batches

    def run(self) -> pa.Table:
        stream = self.stream
        released, like = Released(), None
        with stream._store.appending(stream.budget.scope, stream.name) as (conn, row):
            self.conn = conn
            fleet = stream._fleet(conn, row)
            self.fleet = fleet
            self.pool = stream._pool(fleet)
            # the machines the stream object's last append left, when the ledger still holds the state it
            # committed (else none: another object or process appended since, or the ledger was replaced);
            # taken, so that an append that fails leaves none behind
            warm, stream._warm = stream._warm, None
            self.warm = warm[1] if warm is not None and warm[0] == fleet.facts.get("commit") else {}
            self.cooled: dict = {}  # the machines this append fed, with the snapshots they left
            self.before: dict[int, pa.Array | None] = {}  # each shard's watermarks before this append
            for table in self.batches:  # one batch, or a lazy frame's sorted batches: one transaction
                like = like or table
                if table.num_rows:  # nothing new (a quiet day, a filter that kept nothing): nothing
                    self._batch(table, released)
            stream._commit(conn, row, fleet, released)
        kept = self._still_warm()  # committed: its machines continue from it
        stream._warm = (fleet.facts["commit"], kept) if kept else None
        return stream._appended(released, like)

    def _batch(self, table: pa.Table, released: Released) -> None:
        frame, value, starts = self._ordered(table)
        label = f"stream {self.stream.name!r}"
        if starts is None:
            starts = group_starts(frame, self.spec, label)
        stops = np.append(starts[1:], frame.height)
        keys = frame.get_column(self.spec.order_by).to_arrow()
        values = self._values = frame.get_column(value).to_numpy()
        ordinals = self.stream._ordinals(self.fleet, frame, starts)
        shards = ordinals // SHARD
        keys_by_shard, plans = {}, []
        for index in np.unique(shards).tolist():  # repeats and late rows first, in every shard
            groups = np.flatnonzero(shards == index)
            shard = self.fleet.shard(index)
            keys_by_shard[index] = typed = same_type(keys, shard.watermark, self.stream)
            self.before.setdefault(index, shard.watermark)
            first = self._past_watermark(shard, ordinals[groups], ordinals[groups] - index * SHARD, starts[groups],
                                         stops[groups], typed, released)
            plans.append((shard, groups, first))
        if self.pool is not None:  # the fleet's pooled hold-out takes its rows first
            news = np.concatenate([first for _, _, first in plans])
            chosen = np.concatenate([groups for _, groups, _ in plans])
            self.pool.add(ordinals[chosen], stops[chosen] - news, news, values, keys)
        for shard, groups, first in plans:
            self._advance(shard, ordinals[groups], first, stops[groups], keys_by_shard[shard.index], values,
                          released)

    def _ordered(self, table: pa.Table) -> tuple[pl.DataFrame, str, np.ndarray | None]:
        """The batch validated, in (partition, order key) order, the name of its column of values
        as float64 (the value column itself when it is float64: shared, not copied), and the first
        row of each partition when found on the way (else None: :func:`group_starts`)."""
        spec, label = self.spec, f"stream {self.stream.name!r}"
        frame = decoded(pl.from_arrow(table), spec.partition_by)
        refuse_null_keys(frame, spec, label)
        column = numeric(frame.get_column(spec.value), spec.value, label)
        values = _validate.values(column, spec.value)
        value = spec.value
        if column.dtype != pl.Float64:
            value = "__value"
            frame = frame.with_columns(pl.Series(value, values))
        frame, starts = in_stream_order(frame, spec)
        return frame, value, starts

    def _advance(self, shard: Shard, ordinals: np.ndarray, starts: np.ndarray, stops: np.ndarray,
                 keys: pa.Array, values: np.ndarray, released: Released) -> None:
        """Release the new rows ``starts[g]:stops[g]`` of the partitions ``ordinals`` (all in
        ``shard``): every machine class's at once (partitions waiting for their fleet's pooled
        threshold: provisionally)."""
        stream = self.stream
        positions = ordinals - shard.index * SHARD
        counts = stops - starts
        if not counts.any():
            return
        live = counts > 0
        ordinals, positions, starts, counts = ordinals[live], positions[live], starts[live], counts[live]
        draws = stream._draws(self.fleet, ordinals)
        tags = value_tags(draws, np.repeat(np.arange(len(ordinals)), counts), values[_rows(starts, counts)]) \
            if stream._tagged else None
        where = np.full(shard.size, -1, dtype=np.int64)  # each touched position's place among the groups
        where[positions] = np.arange(len(positions))
        new = _New(ordinals, starts, counts, keys, values, tags, draws)
        classes: list[MachineClass] = []
        for machine_class in units(shard.classes, stream._batchable):
            members = machine_class.members
            touched = where[members] >= 0
            if not touched.any():
                classes.append(machine_class)
                continue
            rest = np.flatnonzero(~touched)
            if len(rest):
                classes.append(MachineClass(members[rest], None if machine_class.state is None else split_state(
                    machine_class.state, len(members), rest), machine_class.params))
            chosen = np.flatnonzero(touched)
            waiting = self.pool is not None and "threshold" not in (machine_class.params or {})
            if waiting and self.pool.threshold is None and not stream.delay.feeds_pool:  # not full: nothing to feed yet
                classes.append(self._hold(shard, members[chosen], where[members[chosen]], new, released))
                continue
            joins = waiting and self.pool.threshold is not None  # the pool is full: the fleet's threshold
            pooled, backlog = (self.pool.partition_params(ordinals[where[members[chosen]]]) if joins else
                               (np.zeros(len(chosen), np.int64), None))
            # partitions fed together: as many new rows, pooled rows and rows before
            for picked in same_groups(counts[where[members[chosen]]], pooled, shard.rows[members[chosen]]):
                subset = chosen[picked]
                state = None if machine_class.state is None else split_state(machine_class.state, len(members),
                                                                             subset)
                params = {**(machine_class.params or {}), **self.pool.machine_params(int(pooled[picked[0]]))} \
                    if joins else machine_class.params
                # (partitions fed while the pool filled hold their pooled rows already)
                earlier = None if backlog is None or stream.delay.feeds_pool else np.array(
                    [backlog[j][:int(shard.rows[members[s]])] for j, s in zip(picked, subset)])
                for on_grid, grid in self._grids(shard, members[subset], where[members[subset]], new, params,
                                                 fresh=machine_class.state is None):
                    fed_now = members[subset][on_grid]
                    classes.append(self._feed(shard, fed_now, state if state is None else split_state(
                        state, len(subset), on_grid), grid, None if earlier is None else earlier[on_grid],
                        where[fed_now], new, released, whole=len(fed_now) == len(members)))
        shard.classes = merge_classes(classes, stream._batchable)
        _replace_pending(shard, positions, new.pending)
        shard.rows[positions] += counts
        released.new_rows += int(counts.sum())
        last = pa.array(starts + counts - 1)
        shard.watermark = _set(shard.watermark, positions, keys.take(last), keys.type)

    def _grids(self, shard: Shard, members: np.ndarray, groups: np.ndarray, new: _New, params: dict | None, *,
               fresh: bool) -> list[tuple[np.ndarray, dict | None]]:
        """The partitions ``members`` (one position) by time grid, with their machines' parameters:
        a partition first fed (``fresh``) whose order keys so far lie on a grid (hourly, daily, ...:
        :func:`~dpsql.timegrid.partition_grids`) gets it, so its blocks and levels follow the
        calendar; a partition on a grid must stay on it (its layout is fixed: a gap is refused). A
        stream whose ``max_delay`` is a duration gives every partition its grid and the duration in
        rows on it (:mod:`dpsql.continual.delay`), refusing keys on no grid."""
        stream, k, n = self.stream, len(members), int(new.counts[groups[0]])
        fed, final = int(shard.rows[members[0]]), int(shard.final[members[0]])
        grid = (params or {}).get("grid", stream.spec.params.get("grid"))
        if grid is not None:
            self._check_grid(RowGrid.of(grid), fed, new, groups)
            return [(np.arange(k), params)]
        timed = stream.delay.by_grid
        if not fresh or not (stream._calendar or timed):
            return [(np.arange(k), params)]
        old_keys, _ = _pending(shard, members, final, fed)
        keys = _interleaved(old_keys, _taken_rows(new.keys, _rows(new.starts[groups], np.full(k, n))), fed - final, n,
                            k)
        grids = partition_grids(keys, np.arange(k + 1) * (fed - final + n))
        if grids is None and timed:
            stream.delay.rows(None, fed - final + n)  # refused: keys that are not times
        if grids is None:
            return [(np.arange(k), params)]
        first, step = np.where(grids[1] > 0, grids[0], 0), grids[1]
        out = []
        for on_grid in same_groups(first, step):
            j = int(on_grid[0])
            grid_params = {"grid": RowGrid(int(first[j]), int(step[j])).plain()} if step[j] else {}
            if timed:
                grid_params["max_delay"] = stream.delay.rows(int(step[j]), fed - final + n)
            out.append((on_grid, {**(params or {}), **grid_params} if grid_params or params else None))
        return out

    def _check_grid(self, grid: RowGrid, fed: int, new: _New, groups: np.ndarray) -> None:
        """Refuse new rows off a partition's time grid (a gap, a key between two slots)."""
        n = int(new.counts[groups[0]])
        rows = _ranges(new.starts[groups], np.full(len(groups), n))
        times = ticks(new.keys.take(pa.array(rows)), f"stream {self.stream.name!r}: {self.spec.order_by}", True)
        expected = grid.first + (fed + np.tile(np.arange(n), len(groups))) * grid.step
        off = np.flatnonzero(times != expected)
        if len(off):
            shown = new.keys[int(rows[off[0]])].as_py()
            raise InvalidTimeKey(f"stream {self.stream.name!r}: order key {shown!r} leaves "
                                 f"its partition's time grid (every {grid.plain()['step']} from "
                                 f"{grid.plain()['first']}, row {fed + int(off[0]) % n} expected at "
                                 f"{np.datetime64(int(expected[off[0]]), 'ns')}): a partition on a grid keeps its "
                                 "calendar blocks, so its rows come without gaps (nothing of this append was kept; "
                                 "register the stream with calendar='none' for rows off a grid)")

    def _feed(self, shard: Shard, members: np.ndarray, state: dict | None, params: dict | None,
              earlier: np.ndarray | None, groups: np.ndarray, new: _New, released: Released, *,
              whole: bool) -> MachineClass:
        """Feed the new rows (as many for each) of the partitions ``members`` (one class, one
        position, all of it when ``whole``; ``groups``: theirs among ``new``'s): their batched
        machine, restored (and first fed their ``earlier`` rows, a fleet's pooled ones, when it
        starts) or the one this stream object's last append left warm, gives the final values it
        outputs and provisional ones for the rest; returns the class they form after."""
        stream = self.stream
        k, n = len(members), int(new.counts[groups[0]])
        fed, final = int(shard.rows[members[0]]), int(shard.final[members[0]])
        key = (shard.index, members.tobytes(), json.dumps(params, sort_keys=True, default=repr))
        machine = self.warm.pop(key, None) if whole and state is not None else None
        if machine is None:
            machine = stream._batch_machine(new.draws.take(groups), state, params)
        # the rows of partitions fed together usually follow one another: copied (machines own what
        # they are fed), not gathered
        rows = _rows(new.starts[groups], np.full(k, n))
        chunk = (new.values[rows].copy() if isinstance(rows, slice) else new.values[rows]).reshape(k, n)
        if earlier is not None and earlier.shape[1]:
            chunk = np.concatenate([earlier.reshape(k, -1), chunk], axis=1)
        room = np.empty((k, fed - final + n))
        out = feed_into(machine, chunk if stream._batchable else chunk[0], room if stream._batchable else room[0])
        out = out.reshape(k, -1)
        waiting = machine.provisional()
        waiting = np.empty((k, 0)) if waiting is None else np.asarray(waiting).reshape(k, -1)
        self._record(shard, members, groups, new, out, waiting, released, machine)
        snapshot = machine.snapshot()
        if stream._batchable:
            self.cooled[key] = (machine, snapshot, k)
        return MachineClass(members, snapshot, params)

    def _still_warm(self) -> dict:
        """The machines fed by this append whose class is in the state it commits as they left it
        (not split or merged since), for the stream object's next append: none when they hold
        more than :data:`WARM_PARTITIONS` partitions."""
        kept, partitions = {}, 0
        for key, (machine, snapshot, members) in self.cooled.items():
            if any(c.state is snapshot for c in self.fleet.shard(key[0]).classes):
                kept[key] = machine
                partitions += members
        return kept if partitions <= WARM_PARTITIONS else {}

    def _hold(self, shard: Shard, members: np.ndarray, groups: np.ndarray, new: _New,
              released: Released) -> MachineClass:
        """Release the new rows of partitions waiting for their fleet's pooled threshold: each at
        the middle of the public bounds (nothing is released yet to predict from)."""
        lower = float(self.spec.params.get("lower", 0.0))
        middle = lower + (float(self.spec.params["upper"]) - lower) / 2
        fed, counts = shard.rows[members], new.counts[groups]
        for same in same_groups(fed, counts):  # one position, one count
            ahead, n = int(fed[same[0]]), int(counts[same[0]])
            waiting = np.full((len(same), ahead - int(shard.final[members[same[0]]]) + n), middle)
            self._record(shard, members[same], groups[same], new, np.empty((len(same), 0)), waiting, released)
        return MachineClass(members, None, None)

    def _record(self, shard: Shard, members: np.ndarray, groups: np.ndarray, new: _New, out: np.ndarray,
                waiting: np.ndarray, released: Released, machine=None) -> None:
        """Record what partitions ``members`` (one position) release now: ``out`` final and
        ``waiting`` provisional values of their rows ``final ..``: their earlier provisional rows
        (keys and tags kept with them), then their new ones."""
        k, n = len(members), int(new.counts[groups[0]])
        fed, final = int(shard.rows[members[0]]), int(shard.final[members[0]])
        emitted, provisional = out.shape[1], waiting.shape[1]
        count = fed - final + n
        if emitted + provisional != count:
            raise AssertionError(f"{type(machine).__name__} accounted for {emitted + provisional} rows, "
                                 f"expected {count}")
        old_keys, old_tags = _pending(shard, members, final, fed)
        keys_now = _interleaved(old_keys, _taken_rows(new.keys, _rows(new.starts[groups], np.full(k, n))), fed - final,
                                n, k)
        tags_now = None if new.tags is None else np.concatenate(
            [old_tags.reshape(k, -1), new.tags[_rows(new.tag_starts[groups], np.full(k, n))].reshape(k, n)],
            axis=1).reshape(-1)
        value_now = (np.concatenate([out, waiting], axis=1) if provisional else out).reshape(-1)
        final_now = np.tile(np.arange(count) < emitted, k)
        index_now = np.tile(np.arange(final, final + count, dtype=np.int64), k)
        public = {f"dp_{c}": pa.array(v) for c, v in machine.take_public().items()} if getattr(
            machine, "public_columns", ()) else None
        # rows still provisional from earlier appends (indices final .. fed) keep the value they were
        # released at: not again
        changed = final_now | (index_now >= fed) if final < fed else None
        if changed is not None and not changed.all():
            picked = pa.array(np.flatnonzero(changed))
            released.add(np.repeat(new.ordinals[groups], count)[changed], index_now[changed], keys_now.take(picked),
                         value_now[changed], final_now[changed], None if tags_now is None else tags_now[changed],
                         None if public is None else {c: v.take(picked) for c, v in public.items()})
        else:
            released.add(np.repeat(new.ordinals[groups], count), index_now, keys_now, value_now, final_now, tags_now,
                         public)
        shard.final[members] = final + emitted
        waiting_rows = np.flatnonzero(~final_now)
        if not len(waiting_rows):
            return
        new.pending.append(pa.table({"position": pa.array(np.repeat(members, count)[waiting_rows]),
                                     "index": pa.array(index_now[waiting_rows]),
                                     "key": keys_now.take(pa.array(waiting_rows)),
                                     TAG: pa.array(tags_now[waiting_rows])}))

    def _past_watermark(self, shard: Shard, ordinals, positions, starts, stops, keys: pa.Array,
                        released: Released) -> np.ndarray:
        """Where each group's new rows start: rows at or below the partition's watermark must
        repeat rows appended before (returned as recorded), else the append is refused."""
        if shard.watermark is None or not len(positions):
            return starts
        marks = shard.watermark.take(pa.array(positions))
        firsts = keys.take(pa.array(starts))
        old = np.flatnonzero(pc.fill_null(pc.less_equal(firsts, marks), False).to_numpy(zero_copy_only=False))
        if not len(old):
            return starts
        lengths = stops[old] - starts[old]
        rows = _ranges(starts[old], lengths)
        group_of_row = np.repeat(np.arange(len(old)), lengths)
        row_keys = keys.take(pa.array(rows))
        # each partition's keys ascend: its rows at or below its watermark are its first ones
        below = pc.less_equal(row_keys, marks.take(pa.array(old[group_of_row]))).to_numpy(zero_copy_only=False)
        repeated = np.bincount(group_of_row[below], minlength=len(old))
        rows, group_of_row, row_keys = rows[below], group_of_row[below], row_keys.filter(pa.array(below))
        # above the partition's watermark before this append: appended by an earlier batch of it
        since = _taken(self.before[shard.index], positions[old][group_of_row], keys.type)
        again = np.flatnonzero(pc.fill_null(pc.greater(row_keys, since), True).to_numpy(zero_copy_only=False))
        if len(again):
            raise InvalidTimeKey(f"stream {self.stream.name!r}: order key {row_keys[int(again[0])].as_py()!r} appears "
                                 "twice in one partition of this append; time keys must be unique within a partition")
        recorded = self.stream._repeated(self.conn, shard, ordinals[old][group_of_row], row_keys,
                                         self.stream._draws(self.fleet, ordinals[old]), group_of_row,
                                         self._values[rows], marks.take(pa.array(old[group_of_row])))
        if recorded is not None:
            released.recorded.append(recorded)
        starts[old] += repeated
        return starts


def units(classes: list[MachineClass], batchable: bool) -> list[MachineClass]:
    """The classes as machines advance them: whole for batched machines, else one partition each
    (partitions that joined together share a class until they are first fed)."""
    if batchable:
        return classes
    return [c if len(c.members) == 1 else MachineClass(c.members[j:j + 1], None, c.params) for c in classes
            for j in range(len(c.members) if c.state is None else 1)]


def _taken(column: pa.Array | None, positions: np.ndarray, kind: pa.DataType) -> pa.Array:
    """``column[positions]``, null where ``column`` has no such position (or is None)."""
    if column is None:
        return pa.nulls(len(positions), kind)
    inside = positions < len(column)
    taken = column.take(pa.array(np.where(inside, positions, 0)))
    return taken if inside.all() else pc.if_else(pa.array(inside), taken, pa.nulls(len(positions), taken.type))


def _runs_in_turn(partition: np.ndarray, piece_starts: np.ndarray) -> np.ndarray | None:
    """The rows by partition, when each partition's rows come together once, in one piece (pieces
    of classes of partitions fed one after the other: interleaved, each in order): the runs put in
    turn, not the rows sorted (a tenth of the time); else None. A run ends where its piece does: a
    partition's rows in two pieces (a lazy frame's batches) may hold a row twice, or out of order."""
    boundaries = np.empty(len(partition), bool)
    boundaries[0] = True
    np.not_equal(partition[1:], partition[:-1], out=boundaries[1:])
    boundaries[piece_starts] = True
    starts = np.flatnonzero(boundaries)
    owners = partition[starts]
    turn = np.argsort(owners, kind="stable")
    if (owners[turn][1:] == owners[turn][:-1]).any():  # a partition in two runs
        return None
    return _ranges(starts[turn], np.diff(np.append(starts, len(partition)))[turn])


def _rows_of(column: np.ndarray | pa.Array | pa.ChunkedArray, rows: np.ndarray) -> np.ndarray | pa.Array:
    """``column[rows]`` (numpy's: a chunk's columns are megabytes, gathered into pooled memory)."""
    return gathered(column, rows) if isinstance(column, np.ndarray) else column.take(pa.array(rows))


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + c) for s, c in zip(starts, counts)])``, vectorised."""
    if len(starts) == 1:
        return np.arange(starts[0], starts[0] + counts[0])
    ranges = np.repeat(starts - (np.cumsum(counts) - counts), counts)  # each row's start, less its place
    ranges += np.arange(len(ranges))
    return ranges


def _rows(starts: np.ndarray, counts: np.ndarray) -> slice | np.ndarray:
    """The rows :func:`_ranges` gives, as a slice when each range follows the one before (an
    append's rows of one class of partitions usually do): taken without copying."""
    if len(starts) and (starts[1:] == starts[:-1] + counts[:-1]).all():
        return slice(int(starts[0]), int(starts[0] + counts.sum()))
    return _ranges(starts, counts)


def _taken_rows(array: pa.Array, rows: slice | np.ndarray) -> pa.Array:
    if isinstance(rows, slice):
        return array.slice(rows.start, rows.stop - rows.start)
    return array.take(pa.array(rows))


def _interleaved(old: pa.Array, new: pa.Array, q: int, n: int, k: int) -> pa.Array:
    """Per partition, its ``q`` old keys then its ``n`` new ones (``k`` partitions, each's keys
    consecutive in ``old`` and ``new``)."""
    if not q:
        return new
    joined = pa.concat_arrays([old.cast(new.type), new.combine_chunks() if isinstance(new, pa.ChunkedArray) else new])
    if k == 1:
        return joined
    order = np.concatenate([np.arange(k * q).reshape(k, q), k * q + np.arange(k * n).reshape(k, n)], axis=1)
    return joined.take(pa.array(order.reshape(-1)))


def _pending(shard: Shard, members: np.ndarray, final: int, fed: int) -> tuple[pa.Array, np.ndarray]:
    """The keys and tags of the provisional rows ``final .. fed - 1`` of each of ``members``
    (the pending table is sorted by position, then row)."""
    if fed == final or shard.pending is None:
        return pa.array([], pa.null()), np.empty(0, np.int32)
    pending = shard.pending
    chosen = np.zeros(shard.size, bool)
    chosen[members] = True
    rows = np.flatnonzero(chosen[pending["position"].to_numpy()])
    return pending["key"].take(pa.array(rows)).combine_chunks(), pending[TAG].to_numpy()[rows]


def _replace_pending(shard: Shard, members: np.ndarray, rows: list[pa.Table]) -> None:
    """The provisional rows of ``members`` are now ``rows`` (tables of position, index, key, tag):
    the shard's pending table, still sorted by position, then row."""
    if not len(members):
        return
    touched = np.zeros(shard.size, bool)
    touched[members] = True
    pieces = [r for r in rows if r.num_rows]
    if shard.pending is not None and shard.pending.num_rows:
        kept = np.flatnonzero(~touched[shard.pending["position"].to_numpy()])
        if len(kept):
            pieces.insert(0, shard.pending.take(pa.array(kept)))
    if not pieces:
        shard.pending = None
        return
    table = pa.concat_tables(pieces, promote_options="permissive") if len(pieces) > 1 else pieces[0]
    positions = table["position"].to_numpy()
    if len(pieces) > 1 and (np.diff(positions) < 0).any():  # each piece is sorted by position, then row
        table = table.take(pa.array(np.argsort(positions, kind="stable")))
    shard.pending = table


def _set(column: pa.Array | None, positions: np.ndarray, values: pa.Array, kind: pa.DataType) -> pa.Array:
    """``column`` with ``column[positions] = values``."""
    base = column.cast(kind) if column is not None else pa.nulls(int(positions.max()) + 1, kind)
    index = np.arange(len(base))
    chooser = np.full(len(base), -1, dtype=np.int64)
    chooser[positions] = np.arange(len(positions))
    joined = pa.concat_arrays([base, values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values])
    picks = np.where(chooser >= 0, len(base) + chooser, index)
    return joined.take(pa.array(picks))
