"""Reading a source in stream order, checking its keys, and the one charge.

:func:`release_ordered` reads the key and value columns through a second connection as
Arrow, puts the rows in stream order (partition, then order key) and calls
:func:`dpsql.publishing.publish` (the single charging path) with the connection's budget.
Integer-like keys are ordered in numpy (:func:`dpsql.ordering.order_integer_keys`); others
are sorted by DuckDB and checked batch by batch (:class:`_KeyChecker`). Keys are refused
with the messages every front end uses (:mod:`dpsql._frontend`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dpsql import _validate
from dpsql.duckdb.sources import Source
from dpsql.duckdb.sqltext import quote_ident
from dpsql.errors import InvalidTimeKey
from dpsql.ordering import order_integer_keys, refuse_duplicate_time, refuse_nan_key, refuse_null_keys
from dpsql.publishing import publish
from dpsql.release import PartitionedRelease, Release

if TYPE_CHECKING:
    from dpsql.duckdb.context import Context

#: Rows per Arrow batch of a scan sorted by DuckDB: large enough that per-batch Python
#: work is negligible, small enough to keep the key checks in cache-friendly pieces.
BATCH_ROWS = 1 << 20


@dataclass
class Plan:
    """Everything a run needs, fixed at bind time."""

    source: Source
    value_col: str
    order_by: str | None
    partition_by: str | None
    method: str
    params: dict
    #: what the release reads, for the ledger (:meth:`Source.read`)
    reads: str
    #: Are the keys integer-like, so that they are read unsorted and ordered in numpy?
    #: (:func:`orders_in_numpy`, decided at bind time from the key columns' DuckDB types.)
    numpy_order: bool = False


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
    key_cols = [c for c in (plan.partition_by, plan.order_by) if c is not None]
    select = f"SELECT {', '.join(quote_ident(c) for c in [*key_cols, plan.value_col])} FROM "
    cur = plan.source.cursor(context.con)
    try:
        ordered = None
        if not key_cols:
            ordered = {}, cur.sql(select + plan.source.sql).to_arrow_table().column(plan.value_col), None
        elif plan.numpy_order:
            unsorted = cur.sql(select + plan.source.sql).to_arrow_table()
            _refuse_null_keys(unsorted, plan.order_by, plan.partition_by)
            ordered = _ordered_in_numpy(unsorted, plan) if unsorted.num_rows else None
            del unsorted  # not kept while a fallback reads the source again
        if ordered is None:  # keys numpy does not order (or no rows): read again, sorted by DuckDB
            ordered = _ordered_by_duckdb(cur, select + plan.source.sql, plan)
    finally:
        cur.close()
    keys, values, offsets = ordered
    params = dict(plan.params)
    fresh = bool(params.pop("fresh", False))
    note = params.pop("note", None)
    partition_keys = None
    if offsets is not None:
        partition_keys = pa.chunked_array(keys[plan.partition_by]).take(pa.array(offsets[:-1]))
    return keys, publish(plan.method, values, budget=context.budget, column=plan.value_col,
                                 partition_offsets=offsets, partition_keys=partition_keys,
                                 order_keys=list(keys.values()),
                                 order_values=None if plan.order_by is None else keys[plan.order_by], fresh=fresh,
                                 note=note, source=plan.reads, **params)


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


def arrow_of(values: np.ndarray, kind: pa.DataType) -> pa.Array:
    """Integers computed in numpy as an Arrow array of the key type ``kind`` (no copy when
    the widths match)."""
    values = np.ascontiguousarray(values, dtype=_storage_type(kind).to_pandas_dtype())
    return pa.Array.from_buffers(kind, len(values), [None, pa.py_buffer(values)])


def _refuse_null_keys(rows: pa.Table | pa.RecordBatch, order_by: str | None, partition_by: str | None) -> None:
    keys = [c for c in (partition_by, order_by) if c is not None]
    refuse_null_keys({c: rows.column(c).null_count for c in keys}, order_label=order_by,
                     partition_labels=_partition_labels(partition_by))


def _partition_labels(partition_by: str | None) -> list[str]:
    return [] if partition_by is None else [partition_by]


def _ordered_in_numpy(table: pa.Table, plan: Plan):
    """``(keys, values, offsets)`` in stream order by :func:`dpsql.ordering.order_integer_keys`,
    or None for keys spanning too much for it."""
    time_column = table.column(plan.order_by)
    partition_column = None if plan.partition_by is None else table.column(plan.partition_by)

    def refuse(time: int, _partition: int | None):
        shown = _shown(arrow_of(np.array([time]), time_column.type), 0)
        refuse_duplicate_time(plan.order_by, shown, _partition_labels(plan.partition_by))

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
        keys[plan.partition_by] = arrow_of(order.partition_column(), partition_column.type)
    keys[plan.order_by] = arrow_of(order.times(), time_column.type)
    return keys, order.values, (None if partition_column is None else order.offsets)


def _ordered_by_duckdb(cur: duckdb.DuckDBPyConnection, select: str, plan: Plan):
    """``(keys, values, offsets)`` of ``select`` sorted by DuckDB, validated batch by batch."""
    key_cols = [c for c in (plan.partition_by, plan.order_by) if c is not None]
    reader = cur.sql(f"{select} ORDER BY {', '.join(quote_ident(c) for c in key_cols)}").to_arrow_reader(BATCH_ROWS)
    chunks: dict[str, list] = {c: [] for c in [*key_cols, plan.value_col]}
    starts = [np.zeros(1, dtype=np.int64)]
    checker = _KeyChecker(plan.order_by, plan.partition_by)
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


def _repeats_previous(column: pa.Array, label: str, *, partition: bool = False) -> np.ndarray:
    """``column[i] == column[i - 1]`` for ``i = 1 .. n - 1`` (a key column without NULLs), as
    numpy booleans: compared in place for fixed-width numbers and timestamps (a zero-copy
    view), with Arrow compute for any other type. Keys that cannot be compared are refused
    (:class:`InvalidTimeKey` naming the column ``label``): NaN, which neither orders nor equals
    itself, and types Arrow cannot compare (an interval, a list)."""
    what = f"{'partition' if partition else 'order'} column {label!r}"
    kind = column.type
    if pa.types.is_timestamp(kind):  # as integers: the smallest one would be numpy's NaT, unequal to itself
        column, kind = column.view(pa.int64()), pa.int64()
    if pa.types.is_integer(kind) or pa.types.is_floating(kind):
        values = column.to_numpy(zero_copy_only=True)
        if pa.types.is_floating(kind) and np.isnan(values).any():
            refuse_nan_key(label, partition=partition)
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

    def __init__(self, order_by: str | None, partition_by: str | None):
        self.order_by = order_by
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
        _refuse_null_keys(batch, self.order_by, self.partition_by)
        same_partition, first_in_partition = None, False
        if self.partition_by is not None:
            keys = batch.column(self.partition_by)
            same_partition = _repeats_previous(keys, self.partition_by, partition=True)
            starts = np.flatnonzero(~same_partition) + 1
            if self._continues(self.partition_by, keys) is False:
                starts = np.concatenate([[0], starts])
                first_in_partition = True
        if self.order_by is not None:
            times = batch.column(self.order_by)
            repeats = _repeats_previous(times, self.order_by)
            if same_partition is not None:
                repeats &= same_partition
            if self._continues(self.order_by, times) and not first_in_partition:
                self._duplicate(times, 0)
            if repeats.any():
                self._duplicate(times, int(np.flatnonzero(repeats)[0]) + 1)
        return starts

    def _duplicate(self, times: pa.Array, row: int):
        refuse_duplicate_time(self.order_by, _shown(times, row), _partition_labels(self.partition_by))

