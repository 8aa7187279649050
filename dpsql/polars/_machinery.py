"""Shared machinery of the ``.dpsql`` Polars namespace: one private release per evaluation.

Every dpsql expression is a single ``map_batches`` call over a struct of the value,
order and partition columns. The UDF sorts rows to time order within their partition,
calls :func:`dpsql.publishing.publish` exactly once (the only charge), and scatters the result
back to the rows' physical order. What that guarantees, and why:

* ``return_dtype`` is always given, so Polars never calls the UDF on dummy data to
  infer a type (that call would be a release).
* ``is_elementwise`` is False, so no engine (streaming included) splits the input into
  chunks: the UDF sees the whole column once per evaluation.
* The struct holds a shuffled constant, which makes Polars treat the expression as
  non-deterministic: common-subexpression elimination never merges two occurrences,
  even of one expression object, so every occurrence is its own draw and charge.
* The struct is aliased to a name carrying a fresh nonce, so the UDF can recognise
  group-wise evaluation: inside ``.over()``,
  ``group_by().agg()`` and ``group_by_dynamic().agg()`` Polars hands a UDF nameless
  per-group slices, which would be one charge per group. Those calls are refused
  before anything is charged, with a message pointing to ``partition_by``.
* Evaluating the expression twice (collecting a lazy query twice, or using one
  expression object twice in a query) is two releases: fresh noise, two charges.
* A dpsql error raised while the expression is evaluated reaches the caller as that
  error, naming the user's column (:func:`surfaced`), not as Polars' wrapping of it with
  the internal struct expression; keys are refused with the words every front end uses
  (:mod:`dpsql._frontend`).

Known gap: ``DataFrame.rolling(...).agg(...)`` and ``Expr.rolling(...)`` hand the UDF
one window at a time *with* the struct name, so they are not detected. Each window
is then a separate release, charged separately: the accounting stays honest (one
charge per draw) but the budget is spent once per row. Release first, then use
Polars' rolling functions on the released column: that is free post-processing.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Callable, Sequence

import numpy as np
import polars as pl
import pyarrow as pa

from dpsql import _validate
from dpsql.errors import DPError, InvalidData, InvalidParameter
from dpsql.ordering import order_integer_keys, refuse_duplicate_time, refuse_rows_without_keys

_NAME_PREFIX = "__dpsql_release_"
_VALUE, _ORDER = "__dpsql_value", "__dpsql_order"

__all__ = ["RowsInTimeOrder", "column_name", "key_expressions", "numeric_values",
           "private_expression", "surfaced", "time_order"]


class RowsInTimeOrder:
    """The rows of one evaluation, grouped by partition and in time order within each.

    ``permutation[i]`` is the physical row released at time-order position ``i``;
    ``offsets`` are the partition boundaries in that order (``[0, n]`` unpartitioned).
    """

    def __init__(self, permutation: np.ndarray, offsets: np.ndarray, partitioned: bool):
        self.permutation = permutation
        self.offsets = offsets
        self.partitioned = partitioned
        #: each partition's key (one row per partition, a column per partition column), set by :func:`time_order`
        self.partition_keys: pa.Table | list | None = None
        #: the order key column in time order (what identifies the data for the answer cache)
        self.order_keys: list = []
        #: the order keys in time order, typed (datetimes as ``datetime64``): a time grid's calendar
        self.order_values: np.ndarray | None = None

    def gather(self, values: np.ndarray) -> np.ndarray:
        return values[self.permutation]

    def scatter(self, in_time_order: np.ndarray) -> np.ndarray:
        out = np.empty(len(self.permutation), dtype=in_time_order.dtype)
        out[self.permutation] = in_time_order
        return out

    def positions(self) -> np.ndarray:
        """Each physical row's position in time order (inverse permutation)."""
        return self.scatter(np.arange(len(self.permutation), dtype=np.int64))


def column_name(expr: pl.Expr, fallback: str = "values") -> str:
    """The output name of ``expr`` for error messages (``fallback`` when Polars cannot tell)."""
    try:
        return expr.meta.output_name()
    except pl.exceptions.ComputeError:
        return fallback


def key_expressions(keys, what: str) -> list[pl.Expr]:
    """Column names or expressions -> expressions (``None`` -> none)."""
    if keys is None:
        return []
    if isinstance(keys, str | pl.Expr):
        keys = [keys]
    out = []
    for key in keys:
        if isinstance(key, str):
            out.append(pl.col(key))
        elif isinstance(key, pl.Expr):
            out.append(key)
        else:
            raise InvalidParameter(f"{what} must be a column name or expression (or a list of them), got {key!r}")
    return out


def time_order(frame: pl.DataFrame, values: np.ndarray, order_name: str, partition_names: Sequence[str],
               labels: Sequence[str]) -> tuple[RowsInTimeOrder, np.ndarray]:
    """Sort ``frame``'s rows by partition then order column; refuse unusable time keys.

    Returns the order and ``values`` (one per row of ``frame``) in that order.

    ``labels`` are the user's names of the order column then the partition columns,
    used in messages. Null or NaN keys are refused, as in every front end; partitions come in
    ascending key order. Integer and temporal time keys are ordered by
    :func:`dpsql.ordering.order_integer_keys` (one int64 key per row; a regular time grid
    is placed by counting, with no comparison sort). Other keys, and keys spanning about
    2**62 (beyond one int64 key), take Polars' multi-column sort.
    """
    order = frame.get_column(order_name)
    refuse_rows_without_keys([frame.get_column(name) for name in (order_name, *partition_names)], labels)
    physical = order.to_physical()
    if physical.dtype in _NUMPY_INTEGERS:
        def refuse(time: int, _partition: int | None):
            refuse_duplicate_time(labels[0], repr(pl.Series([time]).cast(physical.dtype).cast(order.dtype)[0]),
                                  labels[1:])

        partition = [_partition_ids(frame, partition_names)] if partition_names else None
        ordered = order_integer_keys([physical.to_numpy()], values, partition=partition,
                                     permutation=True, refuse_duplicate=refuse)
        if ordered is not None:
            rows = RowsInTimeOrder(ordered.permutation, ordered.offsets, bool(partition_names))
            # the times in order from the ordered keys: no gather of the column through the permutation
            rows.order_keys = [ordered.times().astype(physical.to_numpy().dtype, copy=False)]
            rows.order_values = _typed(rows.order_keys[0], order.dtype)
            _set_partition_keys(rows, frame, partition_names)
            return rows, ordered.values
    rows = _sorted_by_columns(frame, order_name, partition_names, labels)
    order = frame.get_column(order_name).to_physical()
    if order.dtype in (pl.Int128, pl.UInt128):  # numpy has no 128-bit integers: their exact decimal text
        order = order.cast(pl.String)
    rows.order_keys = [order.to_numpy()[rows.permutation]]
    rows.order_values = _typed(rows.order_keys[0], frame.get_column(order_name).dtype)
    _set_partition_keys(rows, frame, partition_names)
    return rows, rows.gather(values)


def _typed(physical: np.ndarray, dtype) -> np.ndarray:
    """Order keys as numpy holds their type: datetimes and dates as ``datetime64`` (a time grid's
    calendar needs their unit), others as they are."""
    if isinstance(dtype, pl.Datetime):  # (zoned: the physical value is the UTC instant)
        return physical.view(f"datetime64[{dtype.time_unit}]")
    if dtype == pl.Date:
        return physical.astype(np.int64).view("datetime64[D]")
    return physical


def _set_partition_keys(rows: RowsInTimeOrder, frame: pl.DataFrame, partition_names: Sequence[str]) -> None:
    """Each partition's key as Arrow columns (exact: nanoseconds stay nanoseconds; the noise
    address of a partition is its exact key, :mod:`dpsql.addresses`)."""
    if not partition_names:
        return
    first_rows = frame.select(partition_names)[rows.permutation[rows.offsets[:-1]]]
    if any(first_rows.schema[c] in (pl.Int128, pl.UInt128) for c in partition_names):
        # Arrow has no 128-bit integers: Python's exact integers (and the other columns' values)
        keys = first_rows.rows()
        rows.partition_keys = [key[0] for key in keys] if len(partition_names) == 1 else keys
        return
    rows.partition_keys = first_rows.to_arrow()


#: Integer types numpy holds that fit an int64 (the physical types of Date, Datetime,
#: Duration and Time among them); UInt64 and the 128-bit types take Polars' sort.
_NUMPY_INTEGERS = (pl.Int8, pl.Int16, pl.Int32, pl.Int64, pl.UInt8, pl.UInt16, pl.UInt32)


def _partition_ids(frame: pl.DataFrame, partition_names: Sequence[str]) -> np.ndarray:
    """Integer partition ids, equal exactly when the partition keys are equal and ordered as
    the keys: a single integer key as it is when it spans fewer values than there are rows,
    else the keys' dense rank."""
    if len(partition_names) == 1:
        column = frame.get_column(partition_names[0])
        if column.dtype in _NUMPY_INTEGERS and not column.null_count():
            ids = column.to_numpy()
            if int(ids.max()) - int(ids.min()) < len(ids):
                return ids
    return frame.select(pl.struct(partition_names).rank("dense")).to_series().to_numpy()


def _sorted_by_columns(frame: pl.DataFrame, order_name: str, partition_names: Sequence[str],
                       labels: Sequence[str]) -> RowsInTimeOrder:
    """The general path of :func:`time_order`: Polars' multi-column sort, for time keys
    that are not integer-like (floats, strings) or span about 2**62."""
    keys = [*partition_names, order_name]
    permutation = frame.select(pl.arg_sort_by(keys, multithreaded=True)).to_series().to_numpy()
    in_order = frame.select(keys)[permutation]
    new_partition = np.zeros(len(permutation) - 1, dtype=bool)
    for name in partition_names:
        column = in_order.get_column(name)
        new_partition |= column.slice(1).ne_missing(column.slice(0, len(column) - 1)).to_numpy()
    time_column = in_order.get_column(order_name)
    same_time = time_column.slice(1).eq_missing(time_column.slice(0, len(time_column) - 1)).to_numpy()
    repeated = np.flatnonzero(~new_partition & same_time)
    if repeated.size:
        refuse_duplicate_time(labels[0], repr(time_column[int(repeated[0]) + 1]), labels[1:])
    offsets = np.concatenate([[0], np.flatnonzero(new_partition) + 1, [len(permutation)]])
    return RowsInTimeOrder(permutation, offsets, partitioned=bool(partition_names))


def numeric_values(series: pl.Series, name: str) -> np.ndarray:
    """The value column as float64, refused with the core's typed errors."""
    if not (series.dtype.is_numeric() or series.dtype == pl.Null):
        raise InvalidData(f"column {name!r} must be numeric, got dtype {series.dtype}")
    return _validate.values(series, name)


def private_expression(value: pl.Expr, release: Callable[[np.ndarray, RowsInTimeOrder, str, str], object], *,
                       order_by, partition_by, output: Callable[[object, RowsInTimeOrder], pl.Series],
                       return_dtype: pl.DataType, returns_scalar: bool = False, function: str = "dpsql") -> pl.Expr:
    """A Polars expression making one private release per evaluation.

    Parameters
    ----------
    value : polars.Expr
        The private value column.
    release : callable
        ``(values in time order, rows, column name, source) -> result``. It must call
        :func:`dpsql.publishing.publish` (directly or through a function that does), once, with
        ``source`` (what the expression reads: ``column volume, order_by ts``).
    order_by, partition_by :
        Column names or expressions; ``order_by=None`` keeps the frame's row order.
    output : callable
        ``(result, rows) -> Series`` in the physical row order (or one value if
        ``returns_scalar``), of ``return_dtype``.
    function : str
        The user's name of the expression (``".dpsql.range_sum()"``), in error messages.

    A dpsql error raised while the expression is evaluated (bad data, a parameter only the
    method can check, an exhausted budget) reaches the caller as that error, naming the
    column, not Polars' internal expression (:func:`surfaced`).
    """
    name = column_name(value)
    order_exprs = key_expressions(order_by, "order_by")
    if len(order_exprs) > 1:
        raise InvalidParameter("order_by must be a single column (the stream's time key)")
    partition_exprs = key_expressions(partition_by, "partition_by")
    if partition_exprs and not order_exprs:
        raise InvalidParameter("partition_by needs order_by: each partition is released in its time order")
    labels = [column_name(e, "order_by") for e in order_exprs] or ["<row order>"]
    labels += [column_name(e, "partition_by") for e in partition_exprs]
    source = ", ".join([f"column {name}" if value.meta.is_column() else f"expression {value}",
                        *(f"order_by {labels[0]}" for _ in order_exprs[:1]),
                        *(f"partition_by {', '.join(labels[1:])}" for _ in partition_exprs[:1])])
    partition_names = [f"__dpsql_partition_{k}" for k in range(len(partition_exprs))]
    fields = [value.alias(_VALUE), *(e.alias(f) for e, f in zip(partition_exprs, partition_names))]
    if order_exprs:
        fields.append(order_exprs[0].alias(_ORDER))
    # Polars never merges non-deterministic expressions (CSE); shuffling one constant
    # marks ours as such and changes nothing else
    fields.append(pl.lit(0, dtype=pl.Int8).shuffle().alias("__dpsql_fresh_draw"))
    struct_name = _NAME_PREFIX + uuid.uuid4().hex

    def evaluate(batch: pl.Series, **_engine_options) -> pl.Series:
        # (Polars first offers ``return_dtype=`` to the function; accepting it spares a retry,
        # whose TypeError would otherwise show up as the context of any error raised here.)
        try:
            return released_rows(batch)
        except DPError as error:
            raise surfaced(error, name, function, labels) from None

    def released_rows(batch: pl.Series) -> pl.Series:
        if batch.name != struct_name:
            raise InvalidParameter(
                f"a dpsql release of {name!r} cannot be evaluated group by group (inside .over(), "
                "group_by().agg() or group_by_dynamic().agg()): each group would be a separate release, "
                "charged separately. Pass partition_by=... to the dpsql expression instead: one release, "
                "charged once at the maximum over partitions.")
        frame = batch.struct.unnest().rechunk()  # the streaming engine hands ~100 chunks; sorts hate that
        values = numeric_values(frame.get_column(_VALUE), name)
        if order_exprs:
            rows, in_order = time_order(frame, values, _ORDER, partition_names, labels)
        else:
            rows, in_order = RowsInTimeOrder(np.arange(len(values)), np.array([0, len(values)]), False), values
        result = release(in_order, rows, name, source)
        return output(result, rows)

    released = pl.struct(fields).alias(struct_name).map_batches(
        evaluate, return_dtype=return_dtype, is_elementwise=False, returns_scalar=returns_scalar)
    return released.alias(name)


def surfaced(error: DPError, column: str, function: str, keys: Sequence[str] = ()) -> DPError:
    """``error`` as it should reach the caller of a Polars query: same type and attributes,
    a message naming the user's column (prefixed with ``function`` and ``column`` when it
    names neither ``column`` nor one of the ``keys``: then it is the very message SQL gives).

    Polars hands an exception raised in a UDF back in two ways. Collecting a lazy query
    re-raises the object itself. An eager ``select`` / ``with_columns`` builds a new one,
    ``type(error)(message + the internal expression)``, dropping the attributes. So the error
    raised is a *carrier*: an instance of a subclass of ``type(error)`` (same name and module)
    whose construction returns the clean error, so that Polars' rebuilt exception is the clean
    error itself, without the expression dump.
    """
    message = str(error)
    if not any(repr(name) in message for name in (column, *keys)):
        message = f"{function} of column {column!r}: {message}"
    clean = copy.copy(error)
    clean.args = (message,)
    kind = type(error)

    def new(cls, *args, **kwargs):
        return clean

    carrier_class = type(kind.__name__, (kind,), {"__new__": new, "__module__": kind.__module__,
                                                  "__qualname__": kind.__qualname__})
    carrier: DPError = BaseException.__new__(carrier_class)
    carrier.__dict__.update(clean.__dict__)
    carrier.args = clean.args
    return carrier
