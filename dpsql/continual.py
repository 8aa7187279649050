"""Continual release: a private stream registered once, charged once, appended to forever.

``budget.stream(name, method=..., epsilon=..., order_by=..., value=...)`` registers a stream
in the budget's ledger and charges its whole cost in the same transaction: the papers'
algorithms are online, so every row of an unbounded stream is released once, when it arrives
(or when its block or hold-out completes), and the stream as a whole costs ``epsilon``.
Reopening by name, from any process, charges nothing. :meth:`Stream.append` takes the new
rows and returns what they released.

What the ledger keeps per partition (:mod:`dpsql.ledger.streams`): the watermark (largest
order key appended), the open part of the online algorithm (the machine's snapshot: pending
hold-out rows, a block's partial sum, the smoother's state; the raw pending rows among them),
the keys of rows appended but not yet released, and the released rows. An append commits the
new state, the released rows and the new watermark in one transaction: a process killed at
any instant leaves it complete or absent. Noise is addressed by the stream's secret key
(stored with it, never released), partition and position, so a retried append recomputes
the same values and a row's value never depends on how the table was cut into appends: a
stream appended in any chunks releases exactly what one release of the whole table gives.

Rows are identified by (partition, order key). A row whose key is at or below its
partition's watermark is refused (:class:`~dpsql.LateRow`) unless it repeats, with the same
value, a row appended before (at-least-once ingestion): it is then not new, and the append
returns its recorded value if it was released. The same key with another value is a
:class:`~dpsql.ConflictingRow`. The ledger keeps a keyed tag of each appended value, not the
value, for that check. Count streams bucket events by a public time grid (``every`` from
``start``): events of a closed bucket are late, ``until`` closes buckets, and empty buckets
are released as zeros; events carry no identity, so every event appended is counted.

The ledger file holds the streams' keys and open state: it is as sensitive as the raw
table. Only released rows may leave it.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import asdict, dataclass, field

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from dpsql import _state, _validate
from dpsql._tables import arrow_batches, table_bytes, table_of
from dpsql.accounting import Charge, Kind, Neighbour, Notion
from dpsql.errors import ConflictingRow, InvalidData, InvalidParameter, InvalidTimeKey, LateRow, UnknownStream
from dpsql.ledger.streams import PartitionRow, StreamRow, StreamStore
from dpsql.methods import COUNT_METHODS, check_method, machine_for
from dpsql.noise import Draws, Keystream, partition_address
from dpsql.release import Release, _quantile_multiplier
from dpsql.timegrid import TimeGrid, duration, instant, ticks

ROW_COLUMN = "dp_row"
_TAG = "dp_tag"


@dataclass(frozen=True)
class StreamSpec:
    """What a stream was registered with (public; stored with it).

    ``params`` are the method's parameters. Count streams add the public time grid
    (:class:`dpsql.timegrid.TimeGrid`): bucket ``b`` holds the events with ``start + b * every
    <= time < start + (b + 1) * every``, datetimes in UTC nanoseconds; ``utc`` says whether
    bucket starts come back as UTC timestamps (a time zone aware ``start``) or naive ones.
    """

    method: str
    params: dict
    order_by: str
    value: str | None
    partition_by: tuple[str, ...] = ()
    every: float | int | None = None
    start: float | int | None = None
    datetime: bool = False
    utc: bool = False

    @property
    def grid(self) -> TimeGrid:
        return TimeGrid(self.start, self.every, self.datetime)

    @property
    def counts(self) -> bool:
        return self.method in COUNT_METHODS

    def columns(self) -> list[str]:
        return [*self.partition_by, self.order_by] + ([] if self.counts else [self.value])

    def to_json(self) -> dict:
        return {**asdict(self), "partition_by": list(self.partition_by)}

    @classmethod
    def from_json(cls, data: dict) -> StreamSpec:
        return cls(**{**data, "partition_by": tuple(data["partition_by"])})


def open_stream(budget, name: str, *, method: str | None = None, epsilon: float | None = None,
                order_by: str | None = None, value: str | None = None, partition_by=None, delta: float = 0.0,
                every=None, start=None, **params) -> Stream:
    """Register stream ``name`` in ``budget``'s scope (charging its cost once), or reopen it.

    See :meth:`dpsql.Budget.stream`."""
    if not isinstance(name, str) or not name:
        raise InvalidParameter(f"a stream's name is a non-empty string, got {name!r}")
    store = StreamStore(budget.ledger)
    existing = store.find(budget.scope, name)
    given = {"method": method, "epsilon": epsilon, "order_by": order_by, "value": value,
             "partition_by": partition_by, "every": every, "start": start, **params}
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
                 params={"epsilon": epsilon, **({"delta": delta} if delta else {}), **params})
    keystream = Keystream.fresh()
    machine = machine_for(method, None, keystream.partition(b""), spec.params)  # validates, draws nothing
    charge = Charge(method=method, epsilon=machine.cost[0], delta=machine.cost[1],
                    neighbour=Neighbour(machine.neighbour), notion=Notion(machine.notion), w=machine.w, rows=0,
                    partitions=0, params=_plain(spec.params), private=keystream.private, kind=Kind.STREAM,
                    stream=name, note=f"stream {name!r}")

    def register(conn, receipt):
        store.register(conn, receipt, scope=budget.scope, name=name, method=method, spec=spec.to_json(),
                       secret=keystream.key + (b"\x01" if keystream.private else b"\x00"))

    budget.charge(charge, then=register)
    return Stream(budget, store.get(budget.scope, name))


def _spec(method, *, order_by, value, partition_by, every, start, params) -> StreamSpec:
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
        return StreamSpec(method, params, order_by, value, partition)
    if value is not None and value != order_by:
        raise InvalidParameter(f"a count stream counts the events of its time column (order_by={order_by!r}); "
                               f"value={value!r} would be another column")
    if every is None or start is None:
        raise InvalidParameter("a count stream needs its public time grid: every (the bucket width) and start "
                               "(the first bucket's start)")
    grid = TimeGrid.of(start=start, every=every)
    utc = isinstance(start, dt.datetime) and start.tzinfo is not None
    return StreamSpec(method, params, order_by, None, partition, grid.every, grid.start, grid.datetime, utc)


def _plain(params: dict) -> dict:
    return json.loads(json.dumps(params, default=str))


@dataclass
class _PartitionState:
    """A partition's open state between appends (packed into the ledger)."""

    machine: dict | None = None
    fed: int = 0  # rows (count streams: buckets) fed to the machine
    pending_keys: bytes | None = None  # keys of rows fed but not yet released (Arrow IPC)
    pending_tags: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.uint64))
    counts: dict = field(default_factory=dict)  # count streams: open buckets' event counts (secret)

    def pack(self) -> bytes:
        return _state.pack({"machine": self.machine, "fed": self.fed, "pending_keys": self.pending_keys,
                            "pending_tags": self.pending_tags,
                            "buckets": np.array(sorted(self.counts), dtype=np.int64),
                            "counts": np.array([self.counts[b] for b in sorted(self.counts)], dtype=np.float64)})

    @classmethod
    def unpack(cls, data: bytes) -> _PartitionState:
        d = _state.unpack(data)
        return cls(d["machine"], int(d["fed"]), d["pending_keys"], np.asarray(d["pending_tags"], dtype=np.uint64),
                   dict(zip(np.asarray(d["buckets"]).tolist(), np.asarray(d["counts"]).tolist())))


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

    # -- what it is -----------------------------------------------------------------------

    @property
    def method(self) -> str:
        return self.spec.method

    @property
    def params(self) -> dict:
        return dict(self.spec.params)

    def _keystream(self) -> Keystream:
        return Keystream(self._secret[:-1], private=self._secret[-1:] == b"\x01")

    def _machine(self, draws: Draws, state: dict | None):
        machine = machine_for(self.spec.method, None, draws, self.spec.params)
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
        with self.budget.ledger.reading("read a stream's partitions") as conn:
            partitions = self._store.partitions(conn, self.release_id)
        marks = [_key_of(p.watermark) for p in partitions.values() if p.watermark is not None]
        epsilon, delta = self.cost
        return {"name": self.name, "method": self.method,
                "params": json.dumps(_plain(self.spec.params), sort_keys=True), "epsilon": epsilon, "delta": delta,
                "rows": row.rows, "partitions": row.partitions,
                "watermark": None if not marks else str(max(marks)), "created": self.created}

    def _check_reopen(self, given: dict) -> None:
        stored = {**self.spec.params, "method": self.spec.method, "order_by": self.spec.order_by,
                  "value": self.spec.value, "partition_by": self.spec.partition_by}
        for name, value in given.items():
            if name in ("every", "start"):
                continue  # checked against the grid below
            expected = stored.get(name)
            if name == "partition_by":
                value = (value,) if isinstance(value, str) else tuple(value)
            if expected != value:
                raise InvalidParameter(f"stream {self.name!r} exists with {name}={expected!r}; reopening it with "
                                       f"{name}={value!r} is refused (a stream's parameters never change)")
        if self.spec.counts:
            spec = self.spec
            start = given.get("start", spec.start if not spec.datetime else None)
            every = given.get("every", spec.every if not spec.datetime else None)
            asked = (instant(start, "start") if spec.datetime and start is not None else start,
                     duration(every) if spec.datetime and every is not None else every)
            stored = (spec.start if start is not None else None, spec.every if every is not None else None)
            if asked != stored:
                raise InvalidParameter(f"stream {self.name!r} exists with another time grid (every, start); "
                                       "reopening it with a different one is refused")

    def __repr__(self) -> str:
        info = self.info()
        return (f"Stream({self.name!r}, {self.method}, epsilon={info['epsilon']:g}, rows={info['rows']}, "
                f"partitions={info['partitions']}, watermark={info['watermark']})")

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
        released = (_CountAppend(self, batches, until) if self.spec.counts else _RangeAppend(self, batches)).run()
        return pl.from_arrow(released) if to_polars else released

    # -- reading --------------------------------------------------------------------------

    def released(self, start=None, stop=None, partition=None) -> pa.Table:
        """The rows released so far (free): optionally those with ``start <= order key <
        stop``, of one ``partition`` (its key, or a tuple for several partition columns)."""
        pieces = []
        with self.budget.ledger.reading(f"read stream {self.name!r}") as conn:
            partitions = self._store.partitions(conn, self.release_id)
            wanted = None if partition is None else partition_address(_as_key(partition))
            for address, part in partitions.items():
                if wanted is not None and address != wanted:
                    continue
                for _, first_row, _rows, data in self._store.chunks(conn, self.release_id, part.ordinal):
                    pieces.append(self._output(table_of(data), part, first_row))
        table = pa.concat_tables(pieces) if pieces else self._empty_output()
        key = self.spec.order_by
        if start is not None:
            table = table.filter(pc.greater_equal(table[key], _scalar_like(start, table[key].type)))
        if stop is not None:
            table = table.filter(pc.less(table[key], _scalar_like(stop, table[key].type)))
        return table.sort_by([(c, "ascending") for c in [*self.spec.partition_by, key]])

    def to_polars(self) -> pl.DataFrame:
        """All released rows as a Polars DataFrame."""
        return pl.from_arrow(self.released())

    def range_sum(self, start=None, stop=None, partition=None) -> float:
        """Private sum of the released values with ``start <= order key < stop`` (free)."""
        value = self._value_column()
        return float(pc.sum(self.released(start, stop, partition)[value]).as_py() or 0.0)

    def range_variance(self, start=None, stop=None, partition=None) -> float:
        """Noise variance of :meth:`range_sum`, from the stream's error model."""
        release = self._partition_release(partition)
        i, j = self._row_bounds(release, start, stop, partition)
        return float(release.range_variance(i, j)) if j > i else 0.0

    def range_ci(self, start=None, stop=None, partition=None, level: float = 0.95) -> tuple[float, float]:
        """``(low, high)`` interval for :meth:`range_sum` at confidence ``level`` (noise only,
        as :meth:`dpsql.Release.range_ci`)."""
        if not 0 < level < 1:
            raise InvalidParameter(f"level must satisfy 0 < level < 1, got {level!r}")
        release = self._partition_release(partition)
        i, j = self._row_bounds(release, start, stop, partition)
        total = float(release.values[i:j].sum())
        half = _quantile_multiplier(level, release.error.excess_kurtosis) * (
            float(release.range_variance(i, j)) if j > i else 0.0) ** 0.5
        return total - half, total + half

    def _value_column(self) -> str:
        return "count" if self.spec.counts else self.spec.value

    def _row_bounds(self, release: Release, start, stop, partition) -> tuple[int, int]:
        keys = self.released(partition=partition)[self.spec.order_by]
        i = 0 if start is None else int(pc.sum(pc.less(keys, _scalar_like(start, keys.type))).as_py() or 0)
        j = len(keys) if stop is None else int(pc.sum(pc.less(keys, _scalar_like(stop, keys.type))).as_py() or 0)
        return i, max(i, j)

    def _partition_release(self, partition) -> Release:
        """The released rows of one partition as a :class:`Release` with the stream's error model."""
        if partition is None and self.spec.partition_by:
            raise InvalidParameter(f"stream {self.name!r} is partitioned by {list(self.spec.partition_by)}: pass "
                                   "partition= (its key) for error bars")
        address = b"" if partition is None else partition_address(_as_key(partition))
        with self.budget.ledger.reading(f"read stream {self.name!r}") as conn:
            part = self._store.partitions(conn, self.release_id, [address]).get(address)
            if part is None:
                raise InvalidParameter(f"stream {self.name!r} has no partition {partition!r}")
            chunks = [table_of(data) for *_, data in self._store.chunks(conn, self.release_id, part.ordinal)]
        return self.partition_release(part, chunks)

    def partition_release(self, part: PartitionRow, chunks: list[pa.Table]) -> Release:
        """A partition's released rows with its error model: the machine restored from the open
        state (and given the released rows' public columns), described."""
        state = _PartitionState.unpack(part.state)
        machine = self._machine(self._keystream().partition(part.address), state.machine)
        rows = pa.concat_tables(chunks) if chunks else None
        if rows is not None and getattr(machine, "public_columns", ()):
            machine.restore_public({c: rows[f"dp_{c}"].to_numpy() for c in machine.public_columns})
        description = machine.describe()
        values = np.empty(0) if rows is None else rows["value"].to_numpy()
        return Release(values=values, private=self._keystream().private, release_id=self.release_id,
                       first_handle=part.first_handle,
                       **{**description, "epsilon": machine.cost[0], "delta": machine.cost[1],
                          "neighbour": machine.neighbour, "notion": machine.notion})

    # -- helpers shared by the appends ------------------------------------------------------

    def _output(self, chunk: pa.Table, part: PartitionRow, first_row: int, rows: np.ndarray | None = None) -> pa.Table:
        """Released rows as returned: partition columns, order key, value, dp_row (the rows
        ``first_row ..`` of the partition, or ``first_row + rows``)."""
        n = chunk.num_rows
        positions = first_row + (np.arange(n) if rows is None else rows)
        columns, names = [], []
        if self.spec.partition_by:
            key = json.loads(part.key_text)
            for column, value, kind in zip(self.spec.partition_by, key["values"], key["types"]):
                columns.append(pa.array([value] * n, type=_arrow_type(kind)).cast(_arrow_type(kind)))
                names.append(column)
        columns += [chunk["key"], chunk["value"], pa.array(part.first_handle + positions, pa.int64())]
        names += [self.spec.order_by, self._value_column(), ROW_COLUMN]
        return pa.Table.from_arrays(columns, names=names)

    def _empty_output(self, like: pa.Table | None = None) -> pa.Table:
        """No released rows, typed like the columns of ``like`` (an append's input) where known."""
        def typed(column):
            return pa.array([], like.schema.field(column).type if like is not None else pa.null())

        key = (_bucket_starts(np.empty(0, np.int64), self.spec) if self.spec.counts
               else typed(self.spec.order_by))
        return pa.table({**{c: typed(c) for c in self.spec.partition_by}, self.spec.order_by: key,
                         self._value_column(): pa.array([], pa.float64()), ROW_COLUMN: pa.array([], pa.int64())})


class _RangeAppend:
    """One append to a stream of values (see :meth:`Stream.append`)."""

    def __init__(self, stream: Stream, batches):
        self.stream = stream
        self.spec = stream.spec
        self.batches = batches

    def run(self) -> pa.Table:
        spec, stream = self.spec, self.stream
        keystream = stream._keystream()
        outputs, released, like = [], 0, None
        with stream._store.appending(stream.budget.scope, stream.name) as (conn, row):
            known: dict[bytes, PartitionRow] = {}
            for table in self.batches:  # one batch, or a lazy frame's sorted batches: one transaction
                like = like or table
                frame = self._ordered(table)
                groups = _groups(frame, spec, f"stream {stream.name!r}")
                known.update(stream._store.partitions(conn, row.release_id,
                                                      [g.address for g in groups if g.address not in known]))
                for group in groups:
                    part = known.get(group.address) or stream._store.new_partition(
                        conn, row, group.address, group.key_text, _PartitionState().pack())
                    known[group.address] = part
                    rows = frame.slice(group.start, group.stop - group.start)
                    output, count = self._partition(conn, row, part, keystream.partition(group.address),
                                                    rows.get_column(spec.order_by).to_arrow(),
                                                    rows.get_column("__value").to_numpy())
                    outputs.append(output)
                    released += count
            stream._store.finish(conn, row, released)
        return _sorted(outputs, stream, like)

    def _ordered(self, table: pa.Table) -> pl.DataFrame:
        """The batch validated, with its values as float64, in (partition, order key) order."""
        spec, label = self.spec, f"stream {self.stream.name!r}"
        frame = pl.from_arrow(table)
        _refuse_null_keys(frame, [spec.order_by, *spec.partition_by], label)
        values = _validate.values(_numeric(frame.get_column(spec.value), spec.value, label), spec.value)
        frame = frame.with_columns(pl.Series("__value", values))
        return frame.sort([*spec.partition_by, spec.order_by], maintain_order=True)

    def _partition(self, conn, row: StreamRow, part: PartitionRow, draws: Draws, keys: pa.Array,
                   values: np.ndarray) -> tuple[pa.Table, int]:
        stream = self.stream
        state = _PartitionState.unpack(part.state)
        watermark = None if part.watermark is None else _keys(part.watermark)
        keys = _same_type(keys, watermark, stream)
        tags = draws.tags(values)
        old = 0 if watermark is None else int(pc.sum(pc.less_equal(keys, watermark[0])).as_py() or 0)
        recorded = self._repeats(conn, row, part, state, keys[:old], tags[:old], watermark)
        if old == len(keys):
            return recorded, 0
        machine = stream._machine(draws, state.machine)
        out = machine.feed(values[old:])
        waiting = _keys(state.pending_keys).cast(keys.type) if state.pending_keys else keys.slice(0, 0)
        waiting = pa.concat_arrays([waiting, keys[old:]])
        waiting_tags = np.concatenate([state.pending_tags, tags[old:]])
        count = len(out)
        chunk = {"key": waiting[:count], "value": pa.array(out, pa.float64()),
                 _TAG: pa.array(waiting_tags[:count], pa.uint64())}
        if getattr(machine, "public_columns", ()):
            chunk.update({f"dp_{c}": pa.array(v) for c, v in machine.take_public().items()})
        state.machine, state.fed = machine.snapshot(), state.fed + len(keys) - old
        state.pending_keys = table_bytes(pa.table({"key": waiting[count:]})) if count < len(waiting) else None
        state.pending_tags = waiting_tags[count:]
        first_row = part.rows
        if count:
            stream._store.add_rows(conn, row, part.ordinal, first_row, count, table_bytes(pa.table(chunk)))
        part.rows += count
        part.watermark = table_bytes(pa.table({"key": keys[len(keys) - 1:]}))
        part.state = state.pack()
        stream._store.save_partition(conn, row, part)
        fresh = stream._output(pa.table(chunk), part, first_row)
        return pa.concat_tables([recorded, fresh]) if recorded.num_rows else fresh, count

    def _repeats(self, conn, row: StreamRow, part: PartitionRow, state: _PartitionState, keys: pa.Array,
                 tags: np.ndarray, watermark) -> pa.Table:
        """The recorded rows that ``keys`` (at or below the watermark) repeat; refuses any that
        is not a repeat (late) or repeats a key with another value (conflicting)."""
        stream = self.stream
        found = np.zeros(len(keys), dtype=bool)
        outputs = []
        if state.pending_keys and len(keys):  # appended before, not released yet: nothing to return
            pending = _keys(state.pending_keys)
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
                self._same_values(keys, tags, hit, table[_TAG].to_numpy()[at])
                outputs.append(stream._output(table.take(pa.array(at)), part, first_row, rows=at))
                found |= hit
            if not found.all() and pc.less(table["key"][0], keys[int(np.flatnonzero(~found)[0])]).as_py():
                break  # older chunks hold smaller keys only
        if not found.all():
            late = keys[int(np.flatnonzero(~found)[0])].as_py()
            raise LateRow(f"stream {stream.name!r}: a row with order key {late!r} arrives at or below its "
                          f"partition's watermark {watermark[0].as_py()!r} and repeats no row appended before; "
                          "nothing of this append was kept")
        return pa.concat_tables(outputs) if outputs else stream._output(
            pa.table({"key": keys.slice(0, 0), "value": pa.array([], pa.float64())}), part, 0)

    def _same_values(self, keys: pa.Array, tags: np.ndarray, hit: np.ndarray, recorded_tags: np.ndarray) -> None:
        differs = tags[hit] != recorded_tags
        if differs.any():
            key = keys.filter(pa.array(hit))[int(np.flatnonzero(differs)[0])].as_py()
            raise ConflictingRow(f"stream {self.stream.name!r}: order key {key!r} was appended before with another "
                                 "value; a released row never changes (nothing of this append was kept)")


class _CountAppend:
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
            touched: dict[bytes, _PartitionState] = {}
            for table in self.batches:
                like = like or table
                self._count(conn, row, self._bucketed(table), partitions, touched, label)
            for address, part in partitions.items():
                state = touched.get(address) or _PartitionState.unpack(part.state)
                if state.fed < target:
                    output, count = self._close(conn, row, part, state, keystream.partition(address), target)
                    outputs.append(output)
                    released += count
                elif address in touched:
                    part.state = state.pack()
                    stream._store.save_partition(conn, row, part)
            stream._store.finish(conn, row, released)
        return _sorted(outputs, stream, like)

    def _bucketed(self, table: pa.Table) -> pl.DataFrame:
        """The batch's events with their buckets (events before the grid's start dropped), by partition."""
        spec, label = self.spec, f"stream {self.stream.name!r}"
        frame = pl.from_arrow(table)
        _refuse_null_keys(frame, [spec.order_by, *spec.partition_by], label)
        buckets = spec.grid.buckets(ticks(table[spec.order_by], f"{label}: {spec.order_by}", spec.datetime))
        frame = frame.with_columns(pl.Series("__bucket", buckets)).filter(pl.col("__bucket") >= 0)
        return frame.sort([*spec.partition_by, "__bucket"], maintain_order=True)

    def _count(self, conn, row: StreamRow, frame: pl.DataFrame, partitions: dict, touched: dict,
               label: str) -> None:
        """Add a batch's events to their partitions' open buckets (refusing late ones)."""
        stream = self.stream
        for group in _groups(frame, self.spec, label, order="__bucket", unique_keys=False):
            part = partitions.get(group.address) or stream._store.new_partition(
                conn, row, group.address, group.key_text, _PartitionState().pack())
            partitions[group.address] = part
            state = touched.get(group.address) or _PartitionState.unpack(part.state)
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

    def _close(self, conn, row: StreamRow, part: PartitionRow, state: _PartitionState, draws: Draws,
               target: int) -> tuple[pa.Table, int]:
        stream = self.stream
        counts = np.array([state.counts.pop(b, 0.0) for b in range(state.fed, target)], dtype=np.float64)
        machine = stream._machine(draws, state.machine)
        out = machine.feed(counts)
        chunk = {"key": _bucket_starts(np.arange(state.fed, state.fed + len(out)), self.spec),
                 "value": pa.array(out, pa.float64())}
        if getattr(machine, "public_columns", ()):
            chunk.update({f"dp_{c}": pa.array(v) for c, v in machine.take_public().items()})
        state.machine, state.fed = machine.snapshot(), target
        first_row = part.rows
        if len(out):
            stream._store.add_rows(conn, row, part.ordinal, first_row, len(out), table_bytes(pa.table(chunk)))
        part.rows += len(out)
        part.watermark = table_bytes(pa.table({"key": _bucket_starts(np.array([target]), self.spec)}))
        part.state = state.pack()
        stream._store.save_partition(conn, row, part)
        return stream._output(pa.table(chunk), part, first_row), len(out)

    def _time_of(self, bucket: int):
        return _bucket_starts(np.array([bucket]), self.spec)[0].as_py()


def _closed_buckets(partitions: dict[bytes, PartitionRow]) -> int:
    """Buckets released by every partition: all partitions are closed together."""
    fed = [_PartitionState.unpack(p.state).fed for p in partitions.values()]
    return max(fed) if fed else 0


@dataclass
class _Group:
    address: bytes
    key_text: str
    start: int
    stop: int


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
        repeated = np.flatnonzero(~new[1:] & key.slice(1).eq_missing(key.slice(0, n - 1)).to_numpy())
        if repeated.size:
            raise InvalidTimeKey(f"{label}: order key {key[int(repeated[0]) + 1]!r} appears twice in one partition of "
                                 "this append; time keys must be unique within a partition")
    starts = np.flatnonzero(new).tolist()
    groups = []
    types = [str(frame.schema[c]) for c in spec.partition_by]
    for a, b in zip(starts, [*starts[1:], n]):
        values = [frame.get_column(c)[a] for c in spec.partition_by]
        key = values[0] if len(values) == 1 else tuple(values)
        text = json.dumps({"values": values, "types": [_type_name(frame.schema[c]) for c in spec.partition_by]},
                          default=str) if values else json.dumps({"values": [], "types": types})
        groups.append(_Group(b"" if not values else partition_address(key), text, a, b))
    return groups


def _type_name(dtype) -> str:
    return pa.field("x", pl.Series([], dtype=dtype).to_arrow().type).type.__str__()


def _arrow_type(name: str) -> pa.DataType:
    return pa.type_for_alias(name) if not name.startswith("timestamp") else _timestamp_type(name)


def _timestamp_type(name: str) -> pa.DataType:
    inside = name[len("timestamp["):-1].split(", tz=")
    return pa.timestamp(inside[0], tz=inside[1] if len(inside) > 1 else None)


def _refuse_null_keys(frame: pl.DataFrame, columns, label: str) -> None:
    for column in columns:
        nulls = frame.get_column(column).null_count()
        if nulls:
            raise InvalidTimeKey(f"{label}: key column {column!r} contains {nulls} null value(s); every row needs "
                                 "its keys")
        series = frame.get_column(column)
        if series.dtype.is_float() and series.is_nan().any():
            raise InvalidTimeKey(f"{label}: key column {column!r} contains NaN")


def _numeric(series: pl.Series, column: str, label: str) -> pl.Series:
    if not series.dtype.is_numeric():
        raise InvalidData(f"{label}: column {column!r} must be numeric, got {series.dtype}")
    return series


def _same_type(keys: pa.Array, watermark, stream: Stream) -> pa.Array:
    if watermark is None or keys.type == watermark.type:
        return keys
    try:
        return keys.cast(watermark.type)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        raise InvalidTimeKey(f"stream {stream.name!r}: order keys of type {keys.type} cannot join keys of type "
                             f"{watermark.type} appended before") from None


def _bucket_starts(buckets: np.ndarray, spec: StreamSpec) -> pa.Array:
    """Bucket starts as output keys: microsecond timestamps (UTC for a zone aware start) or numbers."""
    starts = spec.grid.starts(buckets)
    if spec.datetime:
        return pa.array(starts).cast(pa.timestamp("us", tz="UTC" if spec.utc else None))
    return pa.array(starts, pa.float64())


def _key_of(watermark: bytes):
    return table_of(watermark)["key"][0].as_py()


def _keys(data: bytes) -> pa.Array:
    """The ``key`` column of a stored table, as one array."""
    return table_of(data)["key"].combine_chunks()


def _as_key(partition):
    return tuple(partition) if isinstance(partition, list) else partition


def _scalar_like(value, kind: pa.DataType):
    return pa.scalar(value).cast(kind) if not isinstance(value, pa.Scalar) else value.cast(kind)


def _sorted(outputs: list[pa.Table], stream: Stream, like: pa.Table) -> pa.Table:
    outputs = [o for o in outputs if o.num_rows]
    if not outputs:
        return stream._empty_output(like)
    table = pa.concat_tables(outputs, promote_options="permissive")
    return table.sort_by([(c, "ascending") for c in [*stream.spec.partition_by, stream.spec.order_by]])
