"""Continual release: a private stream registered once, charged once, appended to forever.

``budget.stream(name, method=..., epsilon=..., order_by=..., value=...)`` registers a stream
in the budget's ledger and charges its whole cost in the same transaction: the papers'
algorithms are online, so every row of an unbounded stream is released once, when it arrives
(or when its block or hold-out completes), and the stream as a whole costs ``epsilon``.
Reopening by name, from any process, charges nothing. :meth:`Stream.append` takes the new
rows and returns what they released.

What the ledger keeps (:mod:`dpsql.continual.fleet`): the directory of the stream's partitions
(their keys, addresses and row handles) and, as columns, each partition's watermark (largest
order key appended), rows appended and rows final, the open part of the online algorithm by
class of partitions at one position (pending hold-out rows, a block's partial sum, the smoother's
state), and the keys and value tags of rows released provisionally; and the released rows, one
chunk per append for all partitions. An append commits all of it in one transaction: a process
killed at any instant leaves it complete or absent. Noise is addressed by the stream's secret key
(stored with it, never released), partition and position, so a retried append recomputes the
same values and a row's value never depends on how the table was cut into appends: a stream
appended in any chunks releases, as final values, exactly what one release of the whole table gives.

Every appended row is released by the append that brings it: with its final value, or, where the
algorithm waits for later rows (a flat block not yet complete, a hold-out not yet full), with a
provisional value predicted from what was released before (free post-processing), and with its
final value by the append that completes its block or hold-out (``dp_final`` says which).

Rows are identified by (partition, order key). A row whose key is at or below its
partition's watermark is refused (:class:`~dpsql.LateRow`) unless it repeats, with the same
value, a row appended before (at-least-once ingestion): it is then not new, and the append
returns its recorded value if it was released. The same key with another value is a
:class:`~dpsql.ConflictingRow`. The ledger keeps a keyed tag of each appended value, not the
value, for that check; a ``laplace`` stream keeps none: a repeated row's value is released again
with the row's own draw and compared with the recorded release (values that clip and round to
the same lattice point are the same value for it). Count streams bucket events by a public time
grid (``every`` from ``start``): events of a closed bucket are late, ``until`` closes buckets,
and empty buckets are released as zeros; events carry no identity, so every event appended is
counted.

The ledger file holds the streams' keys and open state: it is as sensitive as the raw
table. Only released rows may leave it.
"""

from __future__ import annotations

import datetime as dt
import json

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from dpsql._chunks import table_buffer
from dpsql._memory import gathered
from dpsql._tables import arrow_batches
from dpsql.accounting import Kind
from dpsql.addresses import partition_address, partition_addresses
from dpsql.continual import rows as stored
from dpsql.continual.appends import RangeAppend
from dpsql.continual.counts import CountAppend
from dpsql.continual.delay import MaxDelay, StreamDelay, registered
from dpsql.continual.fleet import SHARD, Fleet, Shard, row_handles, split_state
from dpsql.continual.pool import Pool, pools
from dpsql.continual.state import (
    FINAL,
    ROW_COLUMN,
    StreamSpec,
    as_key,
    bucket_starts,
    scalar_like,
    storable,
    value_tags,
)
from dpsql.error_models import ProvisionalRows, SegmentedNoise, check_level
from dpsql.errors import BudgetExhausted, InvalidData, InvalidParameter, LedgerError, UnknownStream, scrubbed
from dpsql.ledger.streams import StreamRow, StreamStore
from dpsql.mechanisms.calendar import calendar_by_default
from dpsql.methods import COUNT_METHODS, GRID_METHODS, METHODS, check_method, machine_for, unsized_charge
from dpsql.noise import KEY_BYTES, LEGACY_SCHEME, Draws, DrawsBatch, Keystream
from dpsql.release import Release
from dpsql.timegrid import TimeGrid, duration, instant


def open_stream(budget, name: str, *, method: str | None = None, epsilon: float | None = None,
                order_by: str | None = None, value: str | None = None, partition_by=None, delta: float = 0.0,
                every=None, start=None, max_delay=None, **params) -> Stream:
    """Register stream ``name`` in ``budget``'s scope (charging its cost once), or reopen it.

    See :meth:`dpsql.Budget.stream` (``max_delay``: :mod:`dpsql.continual.delay`)."""
    if not isinstance(name, str) or not name:
        raise InvalidParameter(f"a stream's name is a non-empty string, got {name!r}")
    store = StreamStore(budget.ledger)
    existing = store.find(budget.scope, name)
    given = {"method": method, "epsilon": epsilon, "order_by": order_by, "value": value,
             "partition_by": partition_by, "every": every, "start": start, "max_delay": max_delay, **params}
    if delta:
        given["delta"] = delta
    if existing is not None:
        stream = Stream(budget, existing)
        stream._check_reopen({k: v for k, v in given.items() if v is not None})
        return stream
    if all(v is None for v in given.values()):
        raise UnknownStream(f"no stream named {name!r} in scope {budget.scope!r} of ledger {budget.location}; "
                            "register it with method, epsilon, order_by and value")
    if method is None or epsilon is None or order_by is None:
        raise InvalidParameter(f"stream {name!r} does not exist yet: pass method, epsilon and order_by (and value, "
                               "or every and start for a count stream) to register it")
    check_method(method, per_row=True, online=True)
    spec = _spec(method, order_by=order_by, value=value, partition_by=partition_by, every=every, start=start,
                 max_delay=registered(max_delay, method, method in COUNT_METHODS),
                 params=storable({"epsilon": epsilon, **({"delta": delta} if delta else {}), **params}, name))
    keystream = Keystream.fresh()
    own = {**spec.params, **StreamDelay.of(spec).machine_params()}  # a layout its max_delay forbids: refused now
    charge = unsized_charge(method, own, keystream, public_params=spec.recorded_params(), kind=Kind.STREAM,
                            stream=name, note=f"stream {name!r}")

    def register(conn, receipt):
        store.register(conn, receipt, scope=budget.scope, name=name, method=method, spec=spec.to_json(),
                       secret=keystream.key + bytes([keystream.private, keystream.scheme]))

    try:
        budget.charge(charge, then=register)
    except (LedgerError, BudgetExhausted):
        # another process may have registered it since we looked (its insert wins, ours and our
        # charge roll back): then this call reopens it, free, like any later call
        existing = store.find(budget.scope, name)
        if existing is None:
            raise
        stream = Stream(budget, existing)
        stream._check_reopen({k: v for k, v in given.items() if v is not None})
        return stream
    return Stream(budget, store.get(budget.scope, name))


def _spec(method, *, order_by, value, partition_by, every, start, max_delay, params) -> StreamSpec:
    partition = () if partition_by is None else (partition_by,) if isinstance(partition_by, str) else tuple(
        partition_by)
    for column, label in [(order_by, "order_by"), *((p, "partition_by") for p in partition)]:
        if not isinstance(column, str) or not column:
            raise InvalidParameter(f"{label} must be a column name, got {column!r}")
    if method not in COUNT_METHODS:
        if not isinstance(value, str) or not value:
            raise InvalidParameter(f"value must be the column holding the private values, got {value!r}")
        if every is not None or start is not None:
            raise InvalidParameter("every and start define a count stream's buckets; method "
                                   f"{method!r} releases values, not counts")
        return StreamSpec(method, params, order_by, value, partition, max_delay=max_delay)
    if value is not None and value != order_by:
        raise InvalidParameter(f"a count stream counts the events of its time column (order_by={order_by!r}); "
                               f"value={value!r} would be another column")
    if every is None or start is None:
        raise InvalidParameter("a count stream needs its public time grid: every (the bucket width) and start "
                               "(the first bucket's start)")
    grid = TimeGrid.of(start=start, every=every)
    utc = isinstance(start, dt.datetime) and start.tzinfo is not None
    return StreamSpec(method, params, order_by, None, partition, grid.every, grid.start, grid.datetime, utc)


class Stream:
    """A continual private stream (see the module docstring). Made by :meth:`dpsql.Budget.stream`."""

    def __init__(self, budget, row: StreamRow):
        self.budget = budget
        self.name = row.name
        self.release_id = row.release_id
        self.spec = StreamSpec.from_json(row.spec)
        self.created = row.created
        self._secret = row.secret
        self._store = StreamStore(budget.ledger)
        self.delay = StreamDelay.of(self.spec, f"stream {self.name!r}: order column {self.spec.order_by!r}")
        # the machines this object's last append left (see RangeAppend.run), with the commit they continue
        # from: reused while the stream's state in the ledger is still that commit's
        self._warm: tuple[str, dict] | None = None

    # -- what it is -----------------------------------------------------------------------

    @property
    def method(self) -> str:
        return self.spec.method

    @property
    def params(self) -> dict:
        return dict(self.spec.params)

    def _keystream(self) -> Keystream:
        # key, private flag and (since the masked scheme) the noise scheme; a stream registered
        # before keeps its legacy scheme: its later noise must be drawn as its earlier noise was
        key, flags = self._secret[:KEY_BYTES], self._secret[KEY_BYTES:]
        return Keystream(key, private=flags[0] == 1, scheme=flags[1] if len(flags) > 1 else LEGACY_SCHEME)

    def _machine(self, draws: Draws, state: dict | None):
        machine = machine_for(self.spec.method, None, draws, self._machine_params(None))
        if state is not None:
            machine.restore(state)
        return machine

    @property
    def cost(self) -> tuple[float, float]:
        """(epsilon, delta) charged once, at registration, for the whole stream."""
        return self._machine(self._keystream().partition(b""), None).cost

    def info(self) -> dict:
        """Name, method, parameters, cost, rows released, partitions, watermark, created."""
        row = self._store.get(self.budget.scope, self.name)
        released = self.released()
        key = self.spec.order_by
        epsilon, delta = self.cost
        return {"name": self.name, "method": self.method,
                "params": json.dumps(self.spec.recorded_params(), sort_keys=True), "epsilon": epsilon,
                "delta": delta, "rows": row.rows, "partitions": row.partitions,
                "watermark": None if not released.num_rows else str(pc.max(released[key]).as_py()),
                "created": self.created}

    def _check_reopen(self, given: dict) -> None:
        stored = {**self.spec.params, "method": self.spec.method, "order_by": self.spec.order_by,
                  "value": self.spec.value, "partition_by": self.spec.partition_by}
        for name, value in given.items():
            if name in ("every", "start"):
                continue  # checked against the grid below
            expected = stored.get(name)
            if name == "partition_by":
                value = (value,) if isinstance(value, str) else tuple(value)
            if name == "max_delay":  # as registered: rows, or the duration as text
                expected, value = self.spec.max_delay, MaxDelay.of(value).plain()  # type: ignore[union-attr]
            if expected != value:
                raise InvalidParameter(f"stream {self.name!r} exists with {name}={expected!r}; reopening it with "
                                       f"{name}={value!r} is refused (a stream's parameters never change)")
        if self.spec.counts:
            spec = self.spec
            start = given.get("start", spec.start if not spec.datetime else None)
            every = given.get("every", spec.every if not spec.datetime else None)
            asked = (instant(start, "start") if spec.datetime and start is not None else start,
                     duration(every) if spec.datetime and every is not None else every)
            recorded = (spec.start if start is not None else None, spec.every if every is not None else None)
            if asked != recorded:
                raise InvalidParameter(f"stream {self.name!r} exists with another time grid (every, start); "
                                       "reopening it with a different one is refused")

    def __repr__(self) -> str:
        info = self.info()
        return (f"Stream({self.name!r}, {self.method}, epsilon={info['epsilon']:g}, rows={info['rows']}, "
                f"partitions={info['partitions']}, watermark={info['watermark']})")

    def plot(self, *, partition=None, ax=None, **options):
        """The released rows against their order keys (matplotlib), one panel per partition (the first twelve,
        or ``partition``; ``ax`` for an unpartitioned stream): final rows as :meth:`dpsql.Release.plot` draws
        them, provisional ones apart (hollow markers, dashed); returns the figure. Post-processing: free."""
        from dpsql.display import plot_stream

        return plot_stream(self, partition=partition, ax=ax, **options)

    def _repr_html_(self) -> str:
        from dpsql.display import stream_html

        return stream_html(self)

    # -- appending ------------------------------------------------------------------------

    def append(self, data, *, until=None, to_polars: bool = False):
        """Release the new rows of ``data``; returns what this append released, as a pyarrow
        Table (a Polars DataFrame with ``to_polars=True``): partition columns, the order key,
        the private value (named like the value column; ``count`` for count streams) and
        ``dp_row``, sorted by partition then order key.

        ``data``: a pyarrow Table or RecordBatchReader, a Polars DataFrame or LazyFrame (sorted
        lazily and streamed through in ordered batches, all in one transaction), a pandas
        DataFrame or a DuckDB relation. Rows repeated from an earlier append (same partition,
        key and value) are not new: their recorded values come back with the new rows.
        ``until`` (count streams): close every bucket ending at or before it, releasing them.
        Costs nothing: the stream was charged when registered. Refused appends (late,
        conflicting or duplicate rows, bad values) change nothing.
        """
        if until is not None and not self.spec.counts:
            raise InvalidParameter(f"until closes a count stream's buckets; stream {self.name!r} releases values")
        order = [*self.spec.partition_by, self.spec.order_by]
        batches = arrow_batches(data, self.spec.columns(), order, what=f"stream {self.name!r}")
        failure = None
        try:
            released = (CountAppend(self, batches, until) if self.spec.counts else RangeAppend(self, batches)).run()
        except BaseException as error:  # its frames hold the uncommitted noisy values: never let them out
            failure = scrubbed(error)
        if failure is not None:
            raise failure
        return pl.from_arrow(released) if to_polars else released

    # -- reading --------------------------------------------------------------------------

    def _latest(self, conn) -> tuple[pa.Table | None, pa.Table | None]:
        """Every released row's latest version (normalised chunks), and the directory."""
        directory = stored.directory(self._store, conn, self._store.get(self.budget.scope, self.name),
                                     self.spec.partition_by)
        chunks = [stored.normalized(ordinal, first_row, data)
                  for ordinal, first_row, _rows, data in self._store.chunks(conn, self.release_id)]
        return stored.latest(chunks), directory

    def released(self, start=None, stop=None, partition=None) -> pa.Table:
        """The rows released so far (free), each at its latest value (``dp_final`` False for a
        provisional one): optionally those with ``start <= order key < stop``, of one ``partition``
        (its key, or a tuple for several partition columns)."""
        with self.budget.ledger.reading(f"read stream {self.name!r}") as conn:
            rows, directory = self._latest(conn)
        if rows is None or directory is None:
            return self._empty_output()
        if partition is not None:
            ordinal = self._ordinal_of(directory, partition)
            rows = rows.filter(pc.equal(rows["dp_partition"], ordinal)) if ordinal is not None else rows.slice(0, 0)
        table = self._output(rows, directory)
        assert table is not None  # (rows were given)
        key = self.spec.order_by
        if start is not None:
            table = table.filter(pc.greater_equal(table[key], scalar_like(start, table[key].type)))
        if stop is not None:
            table = table.filter(pc.less(table[key], scalar_like(stop, table[key].type)))
        return table.sort_by([(c, "ascending") for c in [*self.spec.partition_by, key]])

    def released_schema(self) -> pa.Schema | None:
        """The schema of :meth:`released` (None before any row is released)."""
        released = self.released()
        return released.schema if released.num_rows else None

    def to_polars(self) -> pl.DataFrame:
        """All released rows as a Polars DataFrame."""
        return pl.DataFrame(self.released())

    def range_sum(self, start=None, stop=None, partition=None) -> float:
        """Private sum of the released values with ``start <= order key < stop`` (free)."""
        value = self._value_column()
        return float(pc.sum(self.released(start, stop, partition)[value]).as_py() or 0.0)

    def range_variance(self, start=None, stop=None, partition=None) -> float:
        """Noise variance of :meth:`range_sum`, from the stream's error model."""
        release, i, j = self._rows_between(start, stop, partition)
        return float(release.range_variance(i, j)) if j > i else 0.0

    def range_ci(self, start=None, stop=None, partition=None, level: float = 0.95) -> tuple[float, float]:
        """``(low, high)`` interval for :meth:`range_sum` at confidence ``level``, as
        :meth:`dpsql.Release.range_ci` gives it (provisional rows add their own bound)."""
        level = check_level(level)
        release, i, j = self._rows_between(start, stop, partition)
        if j <= i:
            return 0.0, 0.0
        return release.range_ci(i, j, level)

    def _value_column(self) -> str:
        return "count" if self.spec.counts or self.spec.value is None else self.spec.value

    def _rows_between(self, start, stop, partition) -> tuple[Release, int, int]:
        """The partition's release and the rows ``i:j`` whose order keys are in ``[start, stop)``."""
        release = self.release(partition)
        keys = self.released(partition=partition)[self.spec.order_by] if len(release) else None
        if keys is None:
            return release, 0, 0
        i = 0 if start is None else int(pc.sum(pc.less(keys, scalar_like(start, keys.type))).as_py() or 0)
        j = len(keys) if stop is None else int(pc.sum(pc.less(keys, scalar_like(stop, keys.type))).as_py() or 0)
        return release, i, max(i, j)

    def release(self, partition=None) -> Release:
        """The rows released so far (of ``partition``, its key, for a partitioned stream) as a
        :class:`~dpsql.Release` with the stream's error model: ``range_ci``, ``plot`` and the
        rest work on it as on any release. Free: it reads released rows and public state."""
        if partition is None and self.spec.partition_by:
            raise InvalidParameter(f"stream {self.name!r} is partitioned by {list(self.spec.partition_by)}: pass "
                                   "partition= (its key) for error bars")
        with self.budget.ledger.reading(f"read stream {self.name!r}") as conn:
            rows, directory = self._latest(conn)
            ordinal = 0 if partition is None and directory is not None else self._ordinal_of(directory, partition)
            if ordinal is None:
                raise InvalidParameter(f"stream {self.name!r} has no partition {partition!r}")
            return self.partition_release(conn, ordinal, directory, rows)

    def _ordinal_of(self, directory: pa.Table | None, partition) -> int | None:
        if directory is None:
            return None
        key = as_key(partition)
        wanted = partition_address(key) if self.spec.partition_by else b""
        found = pc.index(directory["__address"], pa.scalar(wanted, pa.large_binary())).as_py()
        return None if found < 0 else int(found)

    def partition_release(self, conn, ordinal: int, directory: pa.Table, rows: pa.Table | None) -> Release:
        """Partition ``ordinal``'s released rows with its error model: its machine restored from
        the open state (and given the released rows' public columns), described; its provisional
        rows, if any, bounded by the public bound (a provisional value and the clipped truth both
        lie within it)."""
        fleet = Fleet(self._store, conn, self._store.get(self.budget.scope, self.name), self.spec.partition_by)
        mine = None if rows is None else rows.filter(pc.equal(rows["dp_partition"], ordinal))
        state, params = None, None
        if fleet.partitions:
            shard = fleet.shard(ordinal // SHARD)
            position = ordinal - shard.index * SHARD
            for machine_class in shard.classes:
                where = np.flatnonzero(machine_class.members == position)
                if len(where):
                    params = machine_class.params
                    if machine_class.state is not None:
                        state = split_state(machine_class.state, len(machine_class.members), where)
        else:  # a stream still stored per partition (converted by its next append)
            legacy = self._store.legacy_partitions(conn, self.release_id)
            state = stored.PartitionState.unpack(legacy[ordinal].state).machine
        draws = self._draws_of(directory, np.array([ordinal]))
        machine = self._batch_machine(draws, state, params)
        if mine is not None and getattr(machine, "public_columns", None):
            finals = mine.filter(mine[FINAL])
            machine.restore_public({c: finals[f"dp_{c}"].to_numpy() for c in machine.public_columns})
        description = machine.describe_partition(0) if self._batchable else machine.describe()
        values = np.empty(0) if mine is None else mine["value"].to_numpy()
        final = 0 if mine is None else int(pc.sum(mine[FINAL]).as_py() or 0)
        if mine is not None and final < mine.num_rows:
            params = description["params"]
            bound = (description.get("threshold") or params.get("upper", 0.0)) - params.get("lower", 0.0)
            description["error"] = SegmentedNoise([0, final, 1 << 62], [
                description["error"], ProvisionalRows(float(bound), mine.num_rows - final)])
        handle = int(directory["__first_handle"][ordinal].as_py())
        return Release(values=values, private=self._keystream().private, release_id=self.release_id,
                       first_handle=handle,
                       **{**description, "epsilon": machine.cost[0], "delta": machine.cost[1],
                          "neighbour": machine.neighbour, "notion": machine.notion})

    # -- helpers shared by the appends ------------------------------------------------------

    @property
    def _calendar(self) -> bool:
        """Do the stream's partitions on a time grid get calendar blocks?"""
        return self.spec.method in GRID_METHODS and calendar_by_default(self.spec.params)

    @property
    def _batchable(self) -> bool:
        """Do the stream's partitions advance together (one batched machine per class)? Machines
        that keep public columns per released row keep them for one partition at a time."""
        factory = METHODS[self.spec.method]
        return bool(getattr(factory, "batchable", False)) and not getattr(factory, "public_columns", ())

    def _fleet(self, conn, row: StreamRow) -> Fleet:
        """The stream's open state in this append's transaction (converted first if an earlier
        version stored it per partition)."""
        fleet = Fleet(self._store, conn, row, self.spec.partition_by)
        if not fleet.partitions and row.partitions:
            stored.convert(fleet, self._store, conn, row, self.spec.partition_by, self._batchable)
        return fleet

    def _ordinals(self, fleet: Fleet, frame: pl.DataFrame, starts: np.ndarray) -> np.ndarray:
        """The ordinals of the partitions whose rows start at ``starts`` in ``frame``, new ones
        registered (their keys typed as the stream's first partitions')."""
        columns = [frame.get_column(c).gather(starts).to_arrow() for c in self.spec.partition_by]
        if columns and fleet.in_order(columns):
            return np.arange(len(starts), dtype=np.int64)
        addresses = partition_addresses(columns) if columns else pa.array([b""], pa.large_binary())
        ordinals = fleet.ordinals(addresses)
        new = np.flatnonzero(ordinals < 0)
        if len(new):
            chosen = pa.array(new)
            added = [c.take(chosen) for c in columns]
            if fleet.partitions:
                added = [self._typed_key(column, name, fleet.directory.schema.field(name).type)
                         for column, name in zip(added, self.spec.partition_by)]
            ordinals[new] = fleet.add_partitions(added, addresses.take(chosen),
                                                 key_type=frame.get_column(self.spec.order_by).to_arrow().type)
        return ordinals

    def _typed_key(self, column: pa.Array, name: str, kind: pa.DataType) -> pa.Array:
        """A new partition's key column as the stream's keys are typed: of the same kind (numbers,
        text, booleans, dates, ...) and value (2.0 is 2, 2.5 is not)."""
        try:
            if _kind_of(column.type) != _kind_of(kind):
                raise pa.ArrowInvalid("another kind of key")
            cast = column.cast(kind)
            if not pc.all(pc.equal(cast.cast(column.type), column)).as_py():
                raise pa.ArrowInvalid("the key changes")
            return cast
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
            raise InvalidData(f"stream {self.name!r}: partition column {name!r} holds {column[0].as_py()!r} "
                              f"({column.type}); the stream's partition keys are {kind} (nothing of this append "
                              "was kept)") from None

    def _draws(self, fleet: Fleet, ordinals: np.ndarray) -> DrawsBatch:
        return self._draws_of(fleet.directory, ordinals)

    def _draws_of(self, directory: pa.Table, ordinals: np.ndarray) -> DrawsBatch:
        column = "__noise_address" if "__noise_address" in directory.column_names else "__address"
        return self._keystream().partitions(directory[column].take(pa.array(ordinals)).combine_chunks())

    def _pool(self, fleet: Fleet) -> Pool | None:
        """The fleet's pooled hold-out, for a partitioned stream whose threshold is the fleet's."""
        if not pools(self.spec.method, self.spec.params, self.spec.partition_by) or \
                fleet.facts.get("threshold_by") == "partition":  # a stream of an earlier version: its own way
            return None
        return Pool(fleet, self.spec.method, self.spec.params, self._keystream().partition(b""))

    def _machine_params(self, params: dict | None) -> dict:
        """A machine's parameters: the stream's, its ``max_delay`` in rows where known without a grid, and a
        class's ``params`` (a partition's grid and ``max_delay`` in rows; a fleet's threshold, pooled rows)."""
        return {**self.spec.params, **self.delay.machine_params(), **(params or {})}

    def _batch_machine(self, draws: DrawsBatch, state: dict | None, params: dict | None = None):
        """The machine of the partitions ``draws`` (one, for methods that release one at a time),
        with the class's ``params`` (:meth:`_machine_params`), continued from ``state``."""
        machine = machine_for(self.spec.method, None, draws[0], self._machine_params(params))
        if self._batchable:
            machine = machine.batched(draws)
        if state is not None:
            machine.restore(state)
        return machine

    @property
    def _tagged(self) -> bool:
        """Does the ledger keep a keyed tag of each appended value? Not for machines that recognise
        a repeated row by releasing it again (``repeats_by_release``, given the stream's parameters:
        the release is then the tag)."""
        repeats_by_release = getattr(METHODS[self.spec.method], "repeats_by_release", None)
        return repeats_by_release is None or not repeats_by_release(self.spec.params)

    def _repeated(self, conn, shard: Shard, ordinals: np.ndarray, keys: pa.Array, draws: DrawsBatch,
                  groups: np.ndarray, values: np.ndarray, watermarks: pa.Array) -> pa.Table | None:
        """The recorded rows that the rows ``keys`` of partitions ``ordinals`` (at or below their
        watermarks, with ``values``, partition ``groups[i]`` of ``draws``; all in ``shard``) repeat;
        refuses any that is not a repeat (late) or repeats a key with another value (conflicting):
        :func:`dpsql.continual.rows.repeated`. Another value is told by its tag, or, for a stream
        that keeps none, by its release: the row's value released again with the row's own draw,
        compared bit for bit with the recorded release (dropped either way: only the recorded one
        is returned)."""
        chunks = self._store.chunks(conn, self.release_id, newest_first=True)
        label = f"stream {self.name!r}"
        if self._tagged:
            return stored.repeated(chunks, shard, ordinals, keys, watermarks, label,
                                   tags=value_tags(draws, groups, values))
        machine = self._batch_machine(draws, None)
        return stored.repeated(chunks, shard, ordinals, keys, watermarks, label,
                               release=lambda rows, indices: machine.release_at(values[rows], groups[rows], indices))

    def _commit(self, conn, row: StreamRow, fleet: Fleet, released) -> None:
        """Store an append: its chunk of released rows, the state it changed, the stream's counts."""
        chunk = released.chunk()
        new_rows = 0
        if chunk is not None:
            self._store.add_chunk(conn, row, int(fleet.facts["appends"]), chunk.num_rows, table_buffer(chunk))
            fleet.facts["appends"] = int(fleet.facts["appends"]) + 1
            new_rows = released.new_rows
        fleet.commit()
        self._store.finish(conn, row, new_rows, fleet.partitions)
        # a row repeated and released again in this append (a hold-out completed): its latest version
        rows = stored.latest([*released.recorded, *([chunk] if chunk is not None else [])]) if released.recorded \
            else chunk
        released.output = self._output(rows, fleet.directory if fleet.partitions else None)

    def _appended(self, released, like: pa.Table | None) -> pa.Table:
        table = released.output
        if table is None or not table.num_rows:
            return self._empty_output(like)
        if not self.spec.partition_by or _partitions_ascend(table, self.spec.partition_by):
            return table  # by partition ordinal, then row: by key already when the ordinals ascend with the keys
        return table.sort_by([(c, "ascending") for c in [*self.spec.partition_by, self.spec.order_by]])

    def _output(self, rows: pa.Table | None, directory: pa.Table | None) -> pa.Table | None:
        """Released rows as returned: partition columns, order key, value, dp_row, dp_final."""
        if rows is None or directory is None:
            return None
        ordinals = rows["dp_partition"].to_numpy()
        handles = row_handles(directory["__first_handle"].to_numpy(), ordinals, rows["dp_index"].to_numpy())
        # integer keys (no nulls: refused) by numpy, others by Arrow
        columns = [pa.array(gathered(directory[c].to_numpy(), ordinals)) if pa.types.is_integer(directory[c].type)
                   else directory[c].take(pa.array(ordinals)) for c in self.spec.partition_by]
        columns += [rows["key"], rows["value"], pa.array(handles, pa.int64()), rows[FINAL]]
        names = [*self.spec.partition_by, self.spec.order_by, self._value_column(), ROW_COLUMN, FINAL]
        return pa.Table.from_arrays(columns, names=names)

    def _empty_output(self, like: pa.Table | None = None) -> pa.Table:
        """No released rows, typed like the columns of ``like`` (an append's input) where known."""
        def typed(column):
            return like.schema.field(column).type if like is not None else pa.null()

        key = (bucket_starts(np.empty(0, np.int64), self.spec).type if self.spec.counts
               else typed(self.spec.order_by))
        return pa.schema([*((c, typed(c)) for c in self.spec.partition_by), (self.spec.order_by, key),
                          (self._value_column(), pa.float64()), (ROW_COLUMN, pa.int64()),
                          (FINAL, pa.bool_())]).empty_table()


def _partitions_ascend(table: pa.Table, partition_by: tuple[str, ...]) -> bool:
    """Whether rows grouped by partition come with their (one) partition key column ascending
    (a fleet's partitions registered together: their ordinals follow their keys)."""
    if len(partition_by) != 1:
        return False
    column = pl.from_arrow(table[partition_by[0]])
    return isinstance(column, pl.Series) and column.is_sorted()


def _kind_of(kind: pa.DataType) -> str:
    """Which kind of partition key an Arrow type holds (keys of one kind join in the stream's type)."""
    for name, test in (("number", lambda t: pa.types.is_integer(t) or pa.types.is_floating(t) or
                        pa.types.is_decimal(t)), ("boolean", pa.types.is_boolean),
                       ("text", lambda t: pa.types.is_string(t) or pa.types.is_large_string(t) or
                        pa.types.is_string_view(t)), ("date", pa.types.is_date), ("timestamp", pa.types.is_timestamp),
                       ("time", pa.types.is_time), ("duration", pa.types.is_duration)):
        if test(kind):
            return name
    return str(kind)
