"""Building macros: the generic one-value-per-row stream macro and the pieces other macros use.

``install_stream_release(context, "dp_pegasus", default_method="pegasus")`` is a complete
table macro ``dp_pegasus(tbl, order_by, value_col, method := 'pegasus', partition_by :=
NULL, <every registered method parameter>)``, with the same validation, charging, outputs
and error bars as ``dp_range_sum``. For other shapes, see :mod:`dpsql.duckdb` ("Plugging in
more macros"): a plan UDF registered with :meth:`~dpsql.duckdb.context.Context.udf`, a macro
with :meth:`~dpsql.duckdb.context.Context.macro`, named parameters passed through to publish
with :func:`method_parameters` and :func:`params_struct`.

Row handles. Every output column costs its full length in DuckDB and in the Arrow export,
so a stream release adds a single column for error bars: ``dp_row``, the *ledger-wide row
handle* the charge allocated to the row (:mod:`dpsql.handles`), numbered in output order
(partition, then order key), so a partition owns a contiguous range and consecutive rows of
a stream have consecutive handles. The handle alone finds the release, the partition and the
row within it, through the ledger: from any connection registered with a budget of that
ledger, in any process.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable

import numpy as np
import pyarrow as pa

from dpsql import methods
from dpsql._frontend import RENAMED, check_range_sum_method
from dpsql._memory import count_into, pooled_array
from dpsql.duckdb.context import Context
from dpsql.duckdb.ordered import Plan, arrow_of, orders_in_numpy, release_ordered
from dpsql.duckdb.sources import arrow_fields, column_name, describe, require_columns, require_numeric, resolve_source
from dpsql.duckdb.sqltext import quote_ident, quote_literal
from dpsql.errors import InvalidParameter
from dpsql.release import PartitionedRelease

#: Core parameter names every stream macro accepts, whatever is registered yet; ``fresh``
#: asks for a new, charged release even when an identical one's answer is recorded, ``note``
#: is recorded in the ledger with the release.
CORE_PARAMETERS = ("epsilon", "delta", "upper", "lower", "m", "r", "fanout", "smoother", "holdout_share", "fresh",
                   "note")
#: The one column a stream macro adds to the keys and the private value: the row handle.
ROW_COLUMN = "dp_row"
#: The ledger id column of one-row results (``dp_threshold``).
RELEASE_COLUMN = "release_id"


def method_parameters(exclude: Iterable[str] = ()) -> list[str]:
    """Parameter names of every registered method (plus :data:`CORE_PARAMETERS`), in a
    stable order: the named macro parameters passed through to publish unchanged. Old names
    (:data:`dpsql._frontend.RENAMED`: the registry's ``estimator``, which SQL calls ``method``)
    are left out."""
    names = dict.fromkeys(CORE_PARAMETERS)
    for method in methods.METHODS:
        names.update(dict.fromkeys(methods.named_parameters(method)))
    skip = {*RENAMED, *exclude}
    return [name for name in names if name not in skip]


def params_struct(names: Iterable[str]) -> str:
    """``to_json({'a': a, ...})``: the macro's named parameters as one JSON text."""
    return "to_json({" + ", ".join(f"{quote_literal(n)}: {quote_ident(n)}" for n in names) + "})"


def parse_params(params_json: str | None) -> dict:
    """Macro parameters (``to_json`` of a struct) -> publish keyword arguments, NULLs dropped."""
    params = json.loads(params_json) if params_json else {}
    return {k: v for k, v in params.items() if v is not None}


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
    return arrow_of(count_into(pooled_array(len(release), np.int64), release.first_handle), pa.int64())


def install_stream_release(context: Context, macro: str, *, default_method: str | None,
                           extra_outputs: tuple[list[tuple[str, str]], Callable] | None = None) -> None:
    """Install table macro ``macro(tbl, order_by, value_col, method := default_method,
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

    def plan(table, order_by, value_col, partition_by, method, params_json):
        order_by = column_name(order_by, "order_by")
        value_col = column_name(value_col, "value_col")
        partition_by = column_name(partition_by, "partition_by", required=False)
        if not isinstance(method, str):
            raise InvalidParameter(f"method must be a method name, got {method!r}")
        check_range_sum_method(method)
        outputs = [c for c in (partition_by, order_by, value_col) if c is not None]
        added = [ROW_COLUMN, *extra_names]
        if len(set(outputs)) < len(outputs) or set(added).intersection(outputs):
            raise InvalidParameter(f"order_by, value_col and partition_by must be distinct columns not named "
                                   f"{', '.join(map(repr, added))}; got {outputs}")
        source = resolve_source(context, table)
        columns = describe(context, source)
        require_columns(columns, source, order_by=order_by, value_col=value_col, partition_by=partition_by)
        require_numeric(columns, value_col)
        keys = [c for c in (partition_by, order_by) if c is not None]
        key_fields = {field.name: field for field in arrow_fields(context, source, keys)}
        stream = Plan(source=source, value_col=value_col, order_by=order_by, partition_by=partition_by,
                      method=method, params=parse_params(params_json),
                      reads=source.read([partition_by, order_by, value_col]),
                      numpy_order=orders_in_numpy(columns[order_by],
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
        f"{macro}(tbl, order_by, value_col, {defaults}, {', '.join(quote_ident(n) + ' := NULL' for n in names)}) "
        "AS TABLE "
        f"FROM query({plan_udf}(tbl, order_by, value_col, partition_by, method, {params_struct(names)}))")
