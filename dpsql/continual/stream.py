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
A :class:`Stream` object continues from the machines its own last appends committed for each
partition whose row in the ledger still holds exactly the state they left (its first append,
one after a failed append, or after another process changed the partition, restores them from
the ledger): the ledger stays the record, the object only saves redrawing the open chunk's noise.

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

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from dpsql._chunks import table_of
from dpsql._memory import count_into, pooled_array
from dpsql._tables import arrow_batches
from dpsql.accounting import Kind
from dpsql.addresses import partition_address
from dpsql.continual.appends import CountAppend, RangeAppend
from dpsql.continual.state import (
    ROW_COLUMN,
    PartitionState,
    StreamSpec,
    arrow_type,
    as_key,
    bucket_starts,
    key_of,
    plain,
    scalar_like,
)
from dpsql.error_models import check_level
from dpsql.errors import BudgetExhausted, InvalidParameter, LedgerError, UnknownStream, scrubbed
from dpsql.ledger.streams import PartitionRow, StreamRow, StreamStore
from dpsql.methods import COUNT_METHODS, check_method, machine_for, unsized_charge
from dpsql.noise import KEY_BYTES, LEGACY_SCHEME, Draws, Keystream
from dpsql.release import Release
from dpsql.timegrid import TimeGrid, duration, instant


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
    charge = unsized_charge(method, spec.params, keystream, public_params=plain(spec.params), kind=Kind.STREAM,
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
        # what this object's last appends committed (see RangeAppend): (release id, open partitions),
        # each reused while its row in the ledger still holds the state it left
        self._open: tuple[str, dict] | None = None

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
        marks = [key_of(p.watermark) for p in partitions.values() if p.watermark is not None]
        epsilon, delta = self.cost
        return {"name": self.name, "method": self.method,
                "params": json.dumps(plain(self.spec.params), sort_keys=True), "epsilon": epsilon, "delta": delta,
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
            recorded = (spec.start if start is not None else None, spec.every if every is not None else None)
            if asked != recorded:
                raise InvalidParameter(f"stream {self.name!r} exists with another time grid (every, start); "
                                       "reopening it with a different one is refused")

    def __repr__(self) -> str:
        info = self.info()
        return (f"Stream({self.name!r}, {self.method}, epsilon={info['epsilon']:g}, rows={info['rows']}, "
                f"partitions={info['partitions']}, watermark={info['watermark']})")

    def plot(self, *, partition=None, ax=None, **options):
        """The released rows against their order keys (matplotlib), one panel per partition
        (the first twelve, or ``partition``; ``ax`` for an unpartitioned stream), as
        :meth:`dpsql.Release.plot`; returns the figure."""
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

    def released(self, start=None, stop=None, partition=None) -> pa.Table:
        """The rows released so far (free): optionally those with ``start <= order key <
        stop``, of one ``partition`` (its key, or a tuple for several partition columns)."""
        pieces = []
        with self.budget.ledger.reading(f"read stream {self.name!r}") as conn:
            partitions = self._store.partitions(conn, self.release_id)
            wanted = None if partition is None else partition_address(as_key(partition))
            for address, part in partitions.items():
                if wanted is not None and address != wanted:
                    continue
                for _, first_row, _rows, data in self._store.chunks(conn, self.release_id, part.ordinal):
                    pieces.append(self._output(table_of(data), part, first_row))
        table = pa.concat_tables(pieces) if pieces else self._empty_output()
        key = self.spec.order_by
        if start is not None:
            table = table.filter(pc.greater_equal(table[key], scalar_like(start, table[key].type)))
        if stop is not None:
            table = table.filter(pc.less(table[key], scalar_like(stop, table[key].type)))
        return table.sort_by([(c, "ascending") for c in [*self.spec.partition_by, key]])

    def released_schema(self) -> pa.Schema | None:
        """The schema of :meth:`released` (None before any row is released), from the first
        released chunk alone."""
        with self.budget.ledger.reading(f"read stream {self.name!r}") as conn:
            for part in self._store.partitions(conn, self.release_id).values():
                for _, first_row, _rows, data in self._store.chunks(conn, self.release_id, part.ordinal):
                    return self._output(table_of(data), part, first_row).schema
        return None

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
        :meth:`dpsql.Release.range_ci` gives it."""
        level = check_level(level)
        release, i, j = self._rows_between(start, stop, partition)
        if j <= i:
            return 0.0, 0.0
        return release.range_ci(i, j, level)

    def _value_column(self) -> str:
        return "count" if self.spec.counts or self.spec.value is None else self.spec.value

    def _rows_between(self, start, stop, partition) -> tuple[Release, int, int]:
        """The partition's release and the rows ``i:j`` whose order keys are in ``[start, stop)``
        (its chunks read once, in row order, which is key order)."""
        part, chunks = self._partition_chunks(partition)
        release = self.partition_release(part, chunks)
        if not chunks:
            return release, 0, 0
        keys = pa.chunked_array([chunk["key"] for chunk in chunks])
        i = 0 if start is None else int(pc.sum(pc.less(keys, scalar_like(start, keys.type))).as_py() or 0)
        j = len(keys) if stop is None else int(pc.sum(pc.less(keys, scalar_like(stop, keys.type))).as_py() or 0)
        return release, i, max(i, j)

    def release(self, partition=None) -> Release:
        """The rows released so far (of ``partition``, its key, for a partitioned stream) as a
        :class:`~dpsql.Release` with the stream's error model: ``range_ci``, ``plot`` and the
        rest work on it as on any release. Free: it reads released rows and public state."""
        return self.partition_release(*self._partition_chunks(partition))

    def _partition_chunks(self, partition) -> tuple[PartitionRow, list[pa.Table]]:
        if partition is None and self.spec.partition_by:
            raise InvalidParameter(f"stream {self.name!r} is partitioned by {list(self.spec.partition_by)}: pass "
                                   "partition= (its key) for error bars")
        address = b"" if partition is None else partition_address(as_key(partition))
        with self.budget.ledger.reading(f"read stream {self.name!r}") as conn:
            part = self._store.partitions(conn, self.release_id, [address]).get(address)
            if part is None:
                raise InvalidParameter(f"stream {self.name!r} has no partition {partition!r}")
            chunks = [table_of(data) for *_, data in self._store.chunks(conn, self.release_id, part.ordinal)]
        return part, chunks

    def partition_release(self, part: PartitionRow, chunks: list[pa.Table]) -> Release:
        """A partition's released rows with its error model: the machine restored from the open
        state (and given the released rows' public columns), described."""
        state = PartitionState.unpack(part.state)
        machine = self._machine(self._keystream().partition(part.address), state.machine)
        rows = pa.concat_tables(chunks) if chunks else None
        if rows is not None and getattr(machine, "public_columns", None):
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
        start = part.first_handle + first_row
        handles = count_into(pooled_array(n, np.int64), start) if rows is None else start + rows
        columns, names = [], []
        if self.spec.partition_by:
            key = json.loads(part.key_text)
            for column, value, kind in zip(self.spec.partition_by, key["values"], key["types"]):
                # dates and times are kept as text (JSON): Arrow parses them back
                columns.append(pa.array([value] * n).cast(arrow_type(kind)))
                names.append(column)
        columns += [chunk["key"], chunk["value"], pa.array(handles, pa.int64())]
        names += [self.spec.order_by, self._value_column(), ROW_COLUMN]
        return pa.Table.from_arrays(columns, names=names)

    def _empty_output(self, like: pa.Table | None = None) -> pa.Table:
        """No released rows, typed like the columns of ``like`` (an append's input) where known."""
        def typed(column):
            return like.schema.field(column).type if like is not None else pa.null()

        key = (bucket_starts(np.empty(0, np.int64), self.spec).type if self.spec.counts
               else typed(self.spec.order_by))
        return pa.schema([*((c, typed(c)) for c in self.spec.partition_by), (self.spec.order_by, key),
                          (self._value_column(), pa.float64()), (ROW_COLUMN, pa.int64())]).empty_table()


