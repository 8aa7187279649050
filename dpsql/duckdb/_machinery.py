"""Shared machinery of the DuckDB front end: one :class:`Context` per connection.

A DuckDB table macro cannot run Python, and code running inside a query cannot use
that query's connection. A private release from SQL therefore happens in three steps,
all driven by one table macro::

    CREATE MACRO dp_x(tbl, ...) AS TABLE FROM query(dp__plan_x(tbl, ...))

1. **Plan, at bind time.** DuckDB folds the arguments of a table function while it
   binds, so ``dp__plan_x`` (a Python UDF, ``side_effects=True``) runs once per
   binding. It resolves the source (catalog table or view, a file path, or a Polars /
   Arrow / pandas object named like a Python variable of the caller), checks that the
   columns exist and have usable types, and fixes the result's Arrow schema. It hands
   schema and run to the next of the connection's :class:`ResultSlot` objects and
   returns ``SELECT * FROM dp__result_<i>``: the result query. It draws no noise and
   charges nothing (binding may happen more than once).
2. **Run, at execution time.** The slots are Arrow stream sources registered on the
   connection once, by :func:`install_result_slots`. Binding the result query reads a
   slot's schema; executing it asks the slot for its stream, and only then does the
   release run: it reads the source through a second connection (``con.cursor()``) as
   Arrow, puts the rows in stream order and validates the order and partition keys
   (:func:`release_ordered`: integer-like keys in numpy, others with DuckDB's ``ORDER
   BY``), and calls :func:`dpsql.publishing.publish` (the single charging path) with the
   budget bound to the connection.
3. **Return.** The slot's stream is the key columns in stream order, the private values and
   the row handles: DuckDB scans them like any Arrow object, no copy through lists
   or UDF results. Every execution of the query asks for a new stream: an identical
   one (same call, same data) is answered from the ledger's record of the first, free
   (the answer cache of :func:`dpsql.publishing.publish`); DuckDB itself never caches a
   registered source between executions.

Row handles. Every output column costs its full length in DuckDB and in the Arrow
export, so a stream release adds a single column for error bars: ``dp_row``, the
*ledger-wide row handle* the charge allocated to the row (:mod:`dpsql.handles`), numbered
in output order (partition, then order key), so a partition owns a contiguous range and
consecutive rows of a stream have consecutive handles. The handle alone finds the release,
the partition and the row within it, through the ledger: from any connection registered
with a budget of that ledger, in any process.

Consequences, documented in the user-facing docstrings:

* Each execution of a query is one release (charged once, or free when identical to an
  earlier one); two macro calls in one query are two releases (a common table expression that DuckDB reads
  twice scans its slot once: one release). One query may hold up to
  :data:`RESULT_SLOTS` dpsql macro calls (a further call would share the first one's
  slot: not detected, because binding gives no statement boundary to count from).
  Nothing is charged when the run fails (bad argument, bad data, budget exhausted, an
  error raised while the source is read). Once a release is charged, later failures of the surrounding query are not
  refunded: their errors may depend on the private values.
* The source is read through a second connection, so it must be visible there:
  regular tables and views, files, and Python objects found by name. Temporary tables
  and views and objects registered with ``con.register`` are private to their
  connection and are refused with a message saying so; so is uncommitted data of an
  explicit transaction, which the second connection does not see.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import itertools
import json
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dpsql import _validate, methods
from dpsql._memory import count_into, pooled_array
from dpsql.budget import Budget
from dpsql.errors import DPError, InvalidData, InvalidParameter, InvalidTimeKey
from dpsql.handles import HandleResolver
from dpsql.ordering import duplicate_time_message, order_integer_keys, where_in_partition
from dpsql.publishing import publish
from dpsql.release import PartitionedRelease, Release

NUMERIC_TYPES = ("TINYINT", "SMALLINT", "INTEGER", "BIGINT", "HUGEINT", "UTINYINT", "USMALLINT", "UINTEGER",
                 "UBIGINT", "UHUGEINT", "FLOAT", "DOUBLE", "DECIMAL")
#: Rows per Arrow batch of a scan sorted by DuckDB: large enough that per-batch Python
#: work is negligible, small enough to keep the key checks in cache-friendly pieces.
BATCH_ROWS = 1 << 20
#: Rows per batch of a result stream handed to DuckDB.
SCAN_BATCH_ROWS = 1 << 16
#: Result sources registered per connection (``dp__result_0`` ...): the most dpsql macro
#: calls one query can hold. Binding a query assigns its calls consecutive slots, and the
#: connection binds nothing else before it runs, so no slot is reassigned in between.
RESULT_SLOTS = 8


def quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def quote_literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


class _Bounded(OrderedDict):
    """A dict that forgets its oldest entries beyond ``limit``."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        while len(self) > self.limit:
            self.popitem(last=False)


@dataclass
class Source:
    """Where a macro reads from: SQL text usable after ``FROM`` on a cursor, plus the
    Python object to register there first when the source is a variable."""

    name: str
    sql: str
    python_object: object | None = None

    def cursor(self, con: duckdb.DuckDBPyConnection) -> duckdb.DuckDBPyConnection:
        cur = con.cursor()
        if self.python_object is not None:
            cur.register(self.sql.strip('"'), self.python_object)
        return cur


@dataclass
class Plan:
    """Everything a run needs, fixed at bind time."""

    source: Source
    value_col: str
    order_col: str | None
    partition_by: str | None
    method: str
    params: dict
    note: str
    #: Are the keys integer-like, so that they are read unsorted and ordered in numpy?
    #: (:func:`orders_in_numpy`, decided at bind time from the key columns' DuckDB types.)
    numpy_order: bool = False


class Context:
    """What one connection's dpsql functions share: the bound budget, the result slots,
    the row-handle resolver (through the budget's ledger) and recent typed errors."""

    def __init__(self, con: duckdb.DuckDBPyConnection, budget: Budget):
        self.con = con
        self.slots = [ResultSlot(f"dp__result_{i}") for i in range(RESULT_SLOTS)]
        self._next_slot = itertools.cycle(self.slots)
        self.recent_errors: _Bounded = _Bounded(32)
        self._source_ids = itertools.count(1)
        self.bind(budget)

    def next_id(self) -> int:
        """A number used once on this connection (the name a data-frame source is registered under)."""
        return next(self._source_ids)  # atomic: itertools.count holds the GIL while it counts

    def bind(self, budget: Budget) -> None:
        """Charge ``budget`` from now on, and resolve row handles through its ledger."""
        self.budget = budget
        self.handles = HandleResolver(budget)

    # -- registering functions ---------------------------------------------------------

    def udf(self, name: str, function: Callable, parameters: list[str], return_type: str, *,
            arrow: bool = False) -> None:
        """Register a Python UDF (replacing an older one of that name) with
        ``side_effects=True`` (never folded, never shared between rows or calls), NULLs
        passed through to Python, and dpsql errors remembered for :func:`typed_error`."""
        with contextlib.suppress(duckdb.Error):
            self.con.remove_function(name)
        self.con.create_function(name, self._remembering(function), parameters, return_type,
                                 type="arrow" if arrow else "native", null_handling="special",
                                 side_effects=True)

    def macro(self, sql: str) -> None:
        """``CREATE OR REPLACE`` a (table) macro; ``sql`` starts after ``MACRO``."""
        self.con.execute("CREATE OR REPLACE MACRO " + sql)

    def _remembering(self, function: Callable) -> Callable:
        @functools.wraps(function)
        def call(*args):
            try:
                return function(*args)
            except DPError as error:
                self.recent_errors[f"{type(error).__name__}: {error}"] = error
                raise
        return call

    # -- results handed back to SQL ----------------------------------------------------

    def result_query(self, schema: pa.Schema, run: Callable[[], pa.Table]) -> str:
        """The SQL of a result query whose execution calls ``run`` (a release returning a
        table of ``schema``); to be returned by a plan UDF."""
        slot = next(self._next_slot)
        slot.assign(schema, self._remembering(run))
        return f"SELECT * FROM {quote_ident(slot.name)}"


class ResultSlot:
    """An Arrow stream source registered on the connection (``dp__result_<i>``) whose
    rows are made when a query scans it: binding reads :meth:`__arrow_c_schema__` (the
    schema its last plan fixed), executing asks for :meth:`__arrow_c_stream__`, which
    runs the release. DuckDB checks the stream's columns against the bound schema."""

    #: What an unassigned slot offers (a registered source needs a column).
    UNASSIGNED = pa.schema([("dp__unassigned", pa.int8())])

    def __init__(self, name: str):
        self.name = name
        self._schema = self.UNASSIGNED
        self._run: Callable[[], pa.Table] | None = None

    def assign(self, schema: pa.Schema, run: Callable[[], pa.Table]) -> None:
        self._schema, self._run = schema, run

    def __arrow_c_schema__(self):
        return self._schema.__arrow_c_schema__()

    def __arrow_c_stream__(self, requested_schema=None):
        if self._run is None:
            raise InvalidParameter(f"{self.name} holds the results of dpsql's table macros; call a dp_ macro")
        table = self._run()
        # DuckDB scans a stream on one thread; batches of 2^16 rows (zero-copy slices) scan
        # about 10 % faster than the 2^20-row batches of the ordered read.
        return pa.RecordBatchReader.from_batches(table.schema, table.to_batches(max_chunksize=SCAN_BATCH_ROWS)
                                                 ).__arrow_c_stream__(requested_schema)


def install_result_slots(context: Context) -> None:
    """Register the connection's result slots (again: a second ``register`` replaces them)."""
    for slot in context.slots:
        context.con.register(slot.name, slot)


# -- bind time ---------------------------------------------------------------------------

def parse_params(params_json: str | None) -> dict:
    """Macro parameters (``to_json`` of a struct) -> publish keyword arguments, NULLs dropped."""
    params = json.loads(params_json) if params_json else {}
    return {k: v for k, v in params.items() if v is not None}


def column_name(value, parameter: str, *, required: bool = True) -> str | None:
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value:
        raise InvalidParameter(f"{parameter} must be a column name (a non-empty string), got {value!r}")
    return value


def resolve_source(context: Context, table) -> Source:
    """A catalog table or view, a file path DuckDB can scan, or a Polars / Arrow / pandas
    object named like a variable of the calling Python code (DuckDB's own lookup rule)."""
    if not isinstance(table, str) or not table:
        raise InvalidParameter(f"tbl must be a table name (a non-empty string), got {table!r}")
    sql = f"query_table({quote_literal(table)})"
    cur = context.con.cursor()
    try:
        cur.sql(f"SELECT * FROM {sql} LIMIT 0")
        return Source(table, sql)
    except duckdb.CatalogException:
        pass
    except duckdb.Error as error:
        raise InvalidParameter(f"tbl {table!r} cannot be read: {error}") from None
    finally:
        cur.close()
    python_object = _caller_variable(table)
    if python_object is None:
        raise InvalidParameter(
            f"tbl {table!r} not found: expected a table or view, a file path, or a Polars/Arrow/pandas "
            "variable of that name. dpsql reads its input through a second connection, so TEMP tables "
            "and views and objects registered with con.register() are not visible to it; use a regular "
            "table or view, or pass the data frame's variable name")
    return Source(table, quote_ident(f"dp__source_{context.next_id()}"), python_object)


def _caller_variable(name: str):
    """Variable ``name`` of the first calling Python frame outside dpsql and duckdb (the
    frame DuckDB's own replacement scan would search), if it is a scannable data frame."""
    frame = inspect.currentframe()
    while frame is not None and _inside_engine(frame):
        frame = frame.f_back
    if frame is None:
        return None
    for scope in (frame.f_locals, frame.f_globals):
        candidate = scope.get(name)
        if candidate is not None and _scannable(candidate):
            return candidate
    return None


def _inside_engine(frame) -> bool:
    module = frame.f_globals.get("__name__", "")
    return module.split(".")[0] in ("duckdb", "_duckdb") or module.startswith("dpsql.duckdb")


def _scannable(obj) -> bool:
    module = type(obj).__module__.split(".")[0]
    return module in ("polars", "pyarrow", "pandas")


def describe(context: Context, source: Source) -> dict[str, str]:
    """Column name -> DuckDB type name of ``source``."""
    cur = source.cursor(context.con)
    try:
        rel = cur.sql(f"SELECT * FROM {source.sql} LIMIT 0")
        return {name: str(t) for name, t in zip(rel.columns, rel.types)}
    finally:
        cur.close()


def require_columns(columns: dict[str, str], source: Source, **named: str | None) -> None:
    """Every named column exists in ``source`` (messages name the parameter and column)."""
    for parameter, name in named.items():
        if name is not None and name not in columns:
            raise InvalidParameter(f"{parameter} {name!r} is not a column of {source.name!r}; "
                                   f"columns are {', '.join(map(repr, columns))}")


def require_numeric(columns: dict[str, str], value_col: str) -> None:
    sql_type = columns[value_col]
    if sql_type.split("(")[0] not in NUMERIC_TYPES:
        raise InvalidData(f"column {value_col!r} must be numeric, got {sql_type}")


def arrow_fields(context: Context, source: Source, names: Iterable[str]) -> list[pa.Field]:
    """The Arrow fields DuckDB reads columns ``names`` of ``source`` as (the result keeps
    the keys' own types)."""
    names = list(names)
    if not names:
        return []
    cur = source.cursor(context.con)
    try:
        schema = cur.sql(f"SELECT {', '.join(map(quote_ident, names))} FROM {source.sql} LIMIT 0").to_arrow_table()
    finally:
        cur.close()
    return list(schema.schema)


# -- execution time ----------------------------------------------------------------------

def release_ordered(context: Context, plan: Plan) -> tuple[dict[str, pa.ChunkedArray | pa.Array],
                                                          Release | PartitionedRelease]:
    """Read ``plan.source``, put its rows in stream order (partition, then order key) and
    release the values with :func:`dpsql.publishing.publish` (the one charge of the release);
    returns the key columns in that order and the release.

    Integer-like order keys (integers, dates, timestamps, times) with no partition key or an
    integer one (``plan.numpy_order``) are read unsorted, as DuckDB scans fastest, and put in
    order in numpy (:func:`dpsql.ordering.order_integer_keys`: a regular time grid is placed
    by counting, with no comparison sort). Other keys are read sorted by DuckDB (``ORDER
    BY``) in Arrow batches, as are integer keys spanning about 2**62 (read a second time).

    Refuses NULL, NaN or duplicate order keys within a partition and NULL or NaN partition
    keys (:class:`InvalidTimeKey`, naming the column); the core validates the values and
    names the column.
    """
    key_cols = [c for c in (plan.partition_by, plan.order_col) if c is not None]
    select = f"SELECT {', '.join(quote_ident(c) for c in [*key_cols, plan.value_col])} FROM "
    cur = plan.source.cursor(context.con)
    try:
        ordered = None
        if not key_cols:
            ordered = {}, cur.sql(select + plan.source.sql).to_arrow_table().column(plan.value_col), None
        elif plan.numpy_order:
            unsorted = cur.sql(select + plan.source.sql).to_arrow_table()
            _refuse_null_keys(unsorted, plan.order_col, plan.partition_by)
            ordered = _ordered_in_numpy(unsorted, plan) if unsorted.num_rows else None
            del unsorted  # not kept while a fallback reads the source again
        if ordered is None:  # keys numpy does not order (or no rows): read again, sorted by DuckDB
            ordered = _ordered_by_duckdb(cur, select + plan.source.sql, plan)
    finally:
        cur.close()
    keys, values, offsets = ordered
    params = dict(plan.params)
    fresh = bool(params.pop("fresh", False))
    partition_keys = None
    if offsets is not None:
        partition_keys = _python_keys(pa.chunked_array(keys[plan.partition_by]).take(pa.array(offsets[:-1])))
    return keys, publish(plan.method, values, budget=context.budget, column=plan.value_col,
                                 partition_offsets=offsets, partition_keys=partition_keys,
                                 order_keys=list(keys.values()), fresh=fresh, note=plan.note, **params)


def _python_keys(column: pa.ChunkedArray) -> list:
    """The partition keys as Python values, as every engine gives them (so that a partition's
    noise address is the same whichever engine released it); a date or timestamp beyond
    Python's range (DuckDB's smallest timestamp, its infinities) as ``(Arrow type, raw
    integer)``, which no in-range key's address can equal."""
    try:
        return column.to_pylist()
    except (OverflowError, ValueError):
        raw = column.cast(_storage_type(column.type)).to_pylist()
        keys = []
        for k in range(len(column)):
            try:
                keys.append(column[k].as_py())
            except (OverflowError, ValueError):
                keys.append((str(column.type), raw[k]))
        return keys


def orders_in_numpy(order_type: str, partition_type: str | None) -> bool:
    """Can :func:`release_ordered` order keys of these DuckDB types in numpy: an integer-like
    order key and no partition key or an integer one? (Decided from DuckDB's types, not
    Arrow's: a TIME WITH TIME ZONE reaches Arrow as a plain time, without its offset.)"""
    return order_type in _INTEGER_LIKE and (partition_type is None or partition_type in _INTEGERS)


_INTEGERS = ("TINYINT", "SMALLINT", "INTEGER", "BIGINT", "UTINYINT", "USMALLINT", "UINTEGER")
_INTEGER_LIKE = (*_INTEGERS, "DATE", "TIME", "TIMESTAMP", "TIMESTAMP_S", "TIMESTAMP_MS", "TIMESTAMP_NS",
                 "TIMESTAMP WITH TIME ZONE")


def _storage_type(kind: pa.DataType) -> pa.DataType:
    """The integer type an integer-like Arrow key type is stored as: an integer type itself,
    int32 or int64 (by width) for dates, timestamps and times."""
    return kind if pa.types.is_integer(kind) else pa.int64() if kind.bit_width == 64 else pa.int32()


def _integer_pieces(column: pa.ChunkedArray) -> list[np.ndarray]:
    """A key column's chunks as numpy integers (their physical values), without copies."""
    storage = _storage_type(column.type)
    return [chunk.view(storage).to_numpy(zero_copy_only=True) for chunk in column.chunks if len(chunk)]


def _as_arrow(values: np.ndarray, kind: pa.DataType) -> pa.Array:
    """Integers computed in numpy as an Arrow array of the key type ``kind`` (no copy when
    the widths match)."""
    values = np.ascontiguousarray(values, dtype=_storage_type(kind).to_pandas_dtype())
    return pa.Array.from_buffers(kind, len(values), [None, pa.py_buffer(values)])


def _refuse_null_keys(rows: pa.Table | pa.RecordBatch, order_col: str | None, partition_by: str | None) -> None:
    if partition_by is not None and rows.column(partition_by).null_count:
        raise InvalidTimeKey(f"partition column {partition_by!r} contains NULL values; every row needs a "
                             "partition key")
    nulls = 0 if order_col is None else rows.column(order_col).null_count
    if nulls:
        raise InvalidTimeKey(f"order column {order_col!r} contains {nulls} NULL value(s)"
                             f"{where_in_partition(_partition_labels(partition_by))}; every row needs a time key")


def _partition_labels(partition_by: str | None) -> list[str]:
    return [] if partition_by is None else [partition_by]


def _ordered_in_numpy(table: pa.Table, plan: Plan):
    """``(keys, values, offsets)`` in stream order by :func:`dpsql.ordering.order_integer_keys`,
    or None for keys spanning too much for it."""
    time_column = table.column(plan.order_col)
    partition_column = None if plan.partition_by is None else table.column(plan.partition_by)

    def refuse(time: int, _partition: int | None):
        shown = _shown(_as_arrow(np.array([time]), time_column.type), 0)
        raise InvalidTimeKey(duplicate_time_message(plan.order_col, shown, _partition_labels(plan.partition_by)))

    # bad values are refused once the keys passed, as on DuckDB's path: nulls just below, NaN
    # and infinities by publish (naming their row in time order)
    value_column = table.column(plan.value_col)
    values = _validate.numeric(value_column.fill_null(0) if value_column.null_count else value_column,
                               plan.value_col)
    order = order_integer_keys(_integer_pieces(time_column), values, refuse_duplicate=refuse,
                               partition=None if partition_column is None else _integer_pieces(partition_column))
    if order is None:
        return None
    if value_column.null_count:
        _validate.numeric(value_column, plan.value_col)
    keys = {}
    if partition_column is not None:
        keys[plan.partition_by] = _as_arrow(order.partition_column(), partition_column.type)
    keys[plan.order_col] = _as_arrow(order.times(), time_column.type)
    return keys, order.values, (None if partition_column is None else order.offsets)


def _ordered_by_duckdb(cur: duckdb.DuckDBPyConnection, select: str, plan: Plan):
    """``(keys, values, offsets)`` of ``select`` sorted by DuckDB, validated batch by batch."""
    key_cols = [c for c in (plan.partition_by, plan.order_col) if c is not None]
    reader = cur.sql(f"{select} ORDER BY {', '.join(quote_ident(c) for c in key_cols)}").to_arrow_reader(BATCH_ROWS)
    chunks: dict[str, list] = {c: [] for c in [*key_cols, plan.value_col]}
    starts = [np.zeros(1, dtype=np.int64)]
    checker = _KeyChecker(plan.order_col, plan.partition_by)
    seen = 0
    for batch in reader:
        for c in chunks:
            chunks[c].append(batch.column(c))
        starts.append(checker.check(batch) + seen)
        seen += batch.num_rows
    schema = reader.schema
    keys = {c: pa.chunked_array(chunks[c], type=schema.field(c).type) for c in key_cols}
    values = pa.chunked_array(chunks[plan.value_col], type=schema.field(plan.value_col).type)
    offsets = np.concatenate([*starts, [seen]]) if plan.partition_by is not None and seen else None
    return keys, values, offsets


def _repeats_previous(column: pa.Array, what: str) -> np.ndarray:
    """``column[i] == column[i - 1]`` for ``i = 1 .. n - 1`` (a key column without NULLs), as
    numpy booleans: compared in place for fixed-width numbers and timestamps (a zero-copy
    view), with Arrow compute for any other type. Keys that cannot be compared are refused
    (:class:`InvalidTimeKey` naming the column ``what``): NaN, which neither orders nor equals
    itself, and types Arrow cannot compare (an interval, a list)."""
    kind = column.type
    if pa.types.is_timestamp(kind):  # as integers: the smallest one would be numpy's NaT, unequal to itself
        column, kind = column.view(pa.int64()), pa.int64()
    if pa.types.is_integer(kind) or pa.types.is_floating(kind):
        values = column.to_numpy(zero_copy_only=True)
        if pa.types.is_floating(kind) and np.isnan(values).any():
            raise InvalidTimeKey(f"{what} contains NaN; keys must be comparable values")
        return values[1:] == values[:-1]
    try:
        equal = pc.equal(column.slice(1), column.slice(0, len(column) - 1))
    except pa.ArrowNotImplementedError:
        raise InvalidTimeKey(f"{what} has type {column.type}, which cannot be compared as a key; cast it to a "
                             "number, date, timestamp or text") from None
    return equal.to_numpy(zero_copy_only=False)


def _shown(column: pa.Array, row: int) -> str:
    """``column[row]`` for a message; a date or time beyond Python's range as its raw integer."""
    try:
        return repr(column[row].as_py())
    except (OverflowError, ValueError):
        raw = column.view(_storage_type(column.type))[row].as_py()
        return f"{raw} (raw {column.type})"


class _KeyChecker:
    """Validates sorted key batches (vectorised, no per-row Python), remembering the
    previous batch's last keys."""

    def __init__(self, order_col: str | None, partition_by: str | None):
        self.order_col = order_col
        self.partition_by = partition_by
        self.last: dict[str, pa.Scalar] = {}

    def _continues(self, column: str, current: pa.Array) -> bool | None:
        """Does the batch's first row repeat the previous batch's last value of ``column``?
        None at the start of the stream. Remembers this batch's last value."""
        previous = self.last.get(column)
        self.last[column] = current[len(current) - 1]
        return None if previous is None else previous == current[0]

    def check(self, batch: pa.RecordBatch) -> np.ndarray:
        """Validate one batch; return the in-batch row indices where a new partition starts."""
        n = batch.num_rows
        starts = np.zeros(0, dtype=np.int64)
        if n == 0:
            return starts
        _refuse_null_keys(batch, self.order_col, self.partition_by)
        same_partition, first_in_partition = None, False
        if self.partition_by is not None:
            keys = batch.column(self.partition_by)
            same_partition = _repeats_previous(keys, f"partition column {self.partition_by!r}")
            starts = np.flatnonzero(~same_partition) + 1
            if self._continues(self.partition_by, keys) is False:
                starts = np.concatenate([[0], starts])
                first_in_partition = True
        if self.order_col is not None:
            times = batch.column(self.order_col)
            repeats = _repeats_previous(times, f"order column {self.order_col!r}")
            if same_partition is not None:
                repeats &= same_partition
            if self._continues(self.order_col, times) and not first_in_partition:
                self._duplicate(times, 0)
            if repeats.any():
                self._duplicate(times, int(np.flatnonzero(repeats)[0]) + 1)
        return starts

    def _duplicate(self, times: pa.Array, row: int):
        raise InvalidTimeKey(duplicate_time_message(self.order_col, _shown(times, row),
                                                    _partition_labels(self.partition_by)))


def release_offsets(release) -> np.ndarray:
    """Row offsets of a release's partitions (``[0, n]`` for one stream)."""
    if isinstance(release, PartitionedRelease):
        return np.asarray(release.offsets, dtype=np.int64)
    return np.array([0, len(release)], dtype=np.int64)


def row_handles(release) -> pa.Array:
    """The ``dp_row`` column of ``release``: its block of ledger row handles, one per row in
    output order (partition, then order key), which error bars resolve through the ledger."""
    # from Arrow's memory pool, which keeps freed blocks for the next release (a fresh numpy
    # array would be faulted in again, page by page, at every release)
    return _as_arrow(count_into(pooled_array(len(release), np.int64), release.first_handle), pa.int64())


def typed_error(error: BaseException) -> BaseException:
    """The dpsql error a DuckDB error carries (same type, same message), else ``error``."""
    text = str(error)
    for context in _CONTEXTS.values():
        for message, original in reversed(context.recent_errors.items()):
            if message in text:
                return original
    return error


#: id(connection) -> its Context (checked with ``context.con is con``).
_CONTEXTS: dict[int, Context] = {}


@atexit.register
def _close_registered_connections() -> None:
    """A connection that still holds dpsql's Python UDFs when the interpreter shuts down
    makes DuckDB's bindings print pages of reference-leak warnings; close them first."""
    for context in list(_CONTEXTS.values()):
        with contextlib.suppress(duckdb.Error):
            context.con.close()


def context_for(con: duckdb.DuckDBPyConnection, budget: Budget) -> Context:
    """The connection's context, created or rebound to ``budget``."""
    existing = _CONTEXTS.get(id(con))
    if existing is not None and existing.con is con:
        existing.bind(budget)
        return existing
    context = Context(con, budget)
    _CONTEXTS[id(con)] = context
    return context


# -- the generic one-value-per-row stream macro --------------------------------------------

#: Core parameter names every stream macro accepts, whatever is registered yet; ``fresh``
#: asks for a new, charged release even when an identical one's answer is recorded.
CORE_PARAMETERS = ("epsilon", "delta", "upper", "lower", "m", "r", "fanout", "smoother", "holdout_share", "fresh")
#: The one column a stream macro adds to the keys and the private value: the row handle.
ROW_COLUMN = "dp_row"
#: The ledger id column of one-row results (``dp_threshold``).
RELEASE_COLUMN = "release_id"


def method_parameters(exclude: Iterable[str] = ()) -> list[str]:
    """Parameter names of every registered method (plus :data:`CORE_PARAMETERS`), in a
    stable order: the named macro parameters passed through to publish unchanged."""
    names = dict.fromkeys(CORE_PARAMETERS)
    for factory in methods.METHODS.values():
        for parameter in inspect.signature(factory).parameters.values():
            if parameter.kind in (parameter.KEYWORD_ONLY, parameter.POSITIONAL_OR_KEYWORD):
                names[parameter.name] = None
    skip = {"n", "noise", "self", *exclude}
    return [name for name in names if name not in skip]


def params_struct(names: Iterable[str]) -> str:
    """``to_json({'a': a, ...})``: the macro's named parameters as one JSON text."""
    return "to_json({" + ", ".join(f"{quote_literal(n)}: {quote_ident(n)}" for n in names) + "})"


def install_stream_release(context: Context, macro: str, *, default_method: str | None,
                           extra_outputs: tuple[list[tuple[str, str]], Callable] | None = None) -> None:
    """Install table macro ``macro(tbl, order_col, value_col, method := default_method,
    partition_by := NULL, <every method parameter> := NULL)``.

    It releases one private value per row with ``dpsql.publishing.publish(method, ...)``
    (NULL parameters are left to the core's defaults) and returns the partition key (if
    any), the order key, the private value under the value column's name and ``dp_row``
    (the connection-wide row handle that error bars and ``dp_release_id`` take): rows
    sorted by partition then order key.
    ``extra_outputs = (columns, compute)`` adds per-row columns ``[(name, Arrow type)]``
    computed by ``compute(release) -> {name: pa.Array}`` (post-processing of the release).
    """
    names = method_parameters(exclude=("method",))
    plan_udf = f"dp__plan_{macro}"
    extra_columns = extra_outputs[0] if extra_outputs else []
    extra_names = [name for name, _ in extra_columns]

    def plan(table, order_col, value_col, partition_by, method, params_json):
        order_col = column_name(order_col, "order_col")
        value_col = column_name(value_col, "value_col")
        partition_by = column_name(partition_by, "partition_by", required=False)
        if not isinstance(method, str):
            raise InvalidParameter(f"method must be a method name, got {method!r}")
        methods.check_method(method, per_row=True)
        outputs = [c for c in (partition_by, order_col, value_col) if c is not None]
        added = [ROW_COLUMN, *extra_names]
        if len(set(outputs)) < len(outputs) or set(added).intersection(outputs):
            raise InvalidParameter(f"order_col, value_col and partition_by must be distinct columns not named "
                                   f"{', '.join(map(repr, added))}; got {outputs}")
        source = resolve_source(context, table)
        columns = describe(context, source)
        require_columns(columns, source, order_col=order_col, value_col=value_col, partition_by=partition_by)
        require_numeric(columns, value_col)
        keys = [c for c in (partition_by, order_col) if c is not None]
        key_fields = {field.name: field for field in arrow_fields(context, source, keys)}
        stream = Plan(source=source, value_col=value_col, order_col=order_col, partition_by=partition_by,
                      method=method, params=parse_params(params_json),
                      note=f"duckdb {macro}({table!r}, {order_col!r}, {value_col!r})",
                      numpy_order=orders_in_numpy(columns[order_col],
                                                  columns[partition_by] if partition_by else None))
        schema = pa.schema([*key_fields.values(), pa.field(value_col, pa.float64()),
                            pa.field(ROW_COLUMN, pa.int64()), *(pa.field(n, t) for n, t in extra_columns)])
        return context.result_query(schema, functools.partial(run, stream, schema))

    def run(stream: Plan, schema: pa.Schema) -> pa.Table:
        keys, release = release_ordered(context, stream)
        columns = [*keys.values(), pa.array(release.values), row_handles(release)]
        if extra_outputs:
            computed = extra_outputs[1](release)
            columns += [computed[name] for name in extra_names]
        return pa.Table.from_arrays(columns, schema=schema)

    context.udf(plan_udf, plan, ["VARCHAR"] * 6, "VARCHAR")
    defaults = f"method := {quote_literal(default_method) if default_method else 'NULL'}, partition_by := NULL"
    context.macro(
        f"{macro}(tbl, order_col, value_col, {defaults}, {', '.join(quote_ident(n) + ' := NULL' for n in names)}) "
        "AS TABLE "
        f"FROM query({plan_udf}(tbl, order_col, value_col, partition_by, method, {params_struct(names)}))")
