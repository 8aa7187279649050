"""``dp_range_sum``, ``dp_threshold`` and the error-bar functions.

SQL surface (installed by :func:`dpsql.duckdb.register`):

``dp_range_sum(tbl, order_by, value_col, method := 'tops', partition_by := NULL, epsilon := ..., upper := ..., ...)``
    Table macro. Releases ``value_col`` of table, view, file or data-frame variable
    ``tbl`` as a private stream in ``order_by`` order, with any registered method
    (``tops``, ``pak``, ``binary_tree``, ``laplace``, ...) and every core parameter
    (``epsilon``, ``delta``, ``upper``, ``lower``, ``m``, ``r``, ``fanout``, ``smoother``,
    ``holdout_share`` and method-specific ones) as named parameters; NULL means the
    core default. ``note := '...'`` is recorded in the ledger with the release, beside what it
    read (``table hourly (ts, volume)``: ``budget.history()``). Values outside ``[lower, upper]``
    are clipped (part of the mechanism).
    Cost: the method's ``(epsilon, delta)``, under replace-one-value neighbours with the
    time order and partition keys public; with ``partition_by`` one stream per
    partition, charged once at the maximum (parallel composition). Returns, sorted by
    partition then order key: the partition key, the order key, the private value
    (named like ``value_col``) and ``dp_row``, a BIGINT *row handle*, unique across the
    connection's releases: each release takes the next block of handles, numbered in
    output order, so a partition's rows have consecutive handles (starting from a random
    base per connection: handles saved from another connection are refused). It is the only
    column added, because every per-row column costs its full length in the result.

``dp_release_id(dp_row)``
    The ledger's ``release_id`` of the release owning a row handle
    (``budget.history()`` lists it).

``dp_range_variance(start_row, stop_row)``
    Exact noise variance of the sum of the rows with handles ``start_row .. stop_row -
    1``, which must lie in one partition of one release: from the release's
    :class:`~dpsql.release.ErrorModel`, so it is right for correlated (tree) noise too,
    where per-row variances do not add up. For a window ``w``:
    ``dp_range_variance(min(dp_row) OVER w, max(dp_row) OVER w + 1)`` with ``w AS
    (PARTITION BY <partition key> ORDER BY <order key> RANGE BETWEEN ... PRECEDING AND
    CURRENT ROW)``. A range spanning two partitions or two releases, an empty one, or
    a handle of an unknown or forgotten release is refused (``InvalidParameter``).
    NULL arguments give NULL.

``dp_range_margin(start_row, stop_row, level := 0.95)``
    Half-width of the interval :meth:`dpsql.Release.range_ci` gives for that sum: the
    window's ``sum(value) ± margin``: the noise at ``level`` plus, for a window that cuts
    a released block, the most the block's spreading can be off (clipping excluded).

``dp_threshold(tbl, value_col, method := 'nm', epsilon := ..., upper := ..., ...)``
    Table macro returning one row: the private clipping threshold of ``value_col``
    (core method ``threshold``; ``method`` is ``'nm'``, Noisy Max, or ``'pak'``, the
    smooth-sensitivity quantile, as in :func:`dpsql.threshold` and ``.dpsql.threshold``),
    with its ``epsilon``, ``delta`` and ``release_id``.

Error bars resolve ``dp_row`` handles through the bound budget's ledger (:mod:`dpsql.handles`):
a table of released rows saved in a DuckDB file keeps them in a new process, once the
connection is registered with a budget of the same ledger.
"""

from __future__ import annotations

import functools

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dpsql import methods
from dpsql._frontend import RANGE_SUM_METHOD, THRESHOLD_ESTIMATOR
from dpsql.duckdb.context import Context
from dpsql.duckdb.macros import RELEASE_COLUMN, install_stream_release, params_struct, parse_params
from dpsql.duckdb.ordered import Plan, release_ordered
from dpsql.duckdb.sources import column_name, describe, require_columns, require_numeric, resolve_source
from dpsql.duckdb.sqltext import quote_ident, quote_literal
from dpsql.errors import InvalidParameter

THRESHOLD_METHOD = "threshold"
THRESHOLD_SCHEMA = pa.schema([("threshold", pa.float64()), ("epsilon", pa.float64()), ("delta", pa.float64()),
                              (RELEASE_COLUMN, pa.string())])
#: The registered threshold method's name for what ``dp_threshold`` calls ``method``.
ESTIMATOR = "estimator"


def install(con, context: Context) -> None:
    install_stream_release(context, "dp_range_sum", default_method=RANGE_SUM_METHOD)
    _install_error_bars(context)
    _install_threshold(context)


def _valid_handles(*columns: pa.Array) -> tuple[np.ndarray, list[np.ndarray]]:
    """Rows where no argument is NULL, and each argument's values on those rows."""
    valid = np.ones(len(columns[0]), dtype=bool)
    for column in columns:
        valid &= pc.is_valid(column).to_numpy(zero_copy_only=False)
    # Filled, not converted with their NULLs: that would turn int64 handles into float64.
    return valid, [pc.fill_null(column, 0).to_numpy(zero_copy_only=False)[valid] for column in columns]


def _with_nulls(values: np.ndarray, valid: np.ndarray, arrow_type: pa.DataType) -> pa.Array:
    if valid.all():
        return pa.array(values, arrow_type)
    out = np.zeros(len(valid), dtype=values.dtype)
    out[valid] = values
    return pa.array(out, arrow_type, mask=~valid)


def _install_error_bars(context: Context) -> None:
    def variance(starts, stops):
        valid, (i, j) = _valid_handles(starts, stops)
        out = np.empty(len(i), dtype=np.float64)
        for positions, model, part_i, part_j in context.handles.ranges(i, j):
            out[positions] = model.range_variance(part_i, part_j)
        return _with_nulls(out, valid, pa.float64())

    def margin(starts, stops, levels):
        valid, (i, j, level) = _valid_handles(starts, stops, levels)
        bad = level[~((level > 0) & (level < 1))]
        if bad.size:
            raise InvalidParameter(f"level must satisfy 0 < level < 1, got {bad[0]!r}")
        out = np.empty(len(i), dtype=np.float64)
        for positions, model, part_i, part_j in context.handles.ranges(i, j):
            # A level is usually one constant: one margin computation per distinct level.
            levels = level[positions]
            for lv in np.unique(levels):
                at = levels == lv
                out[positions[at]] = model.range_margin(part_i[at], part_j[at], float(lv))
        return _with_nulls(out, valid, pa.float64())

    def release_id(rows):
        valid, (handles,) = _valid_handles(rows)
        ids = np.full(len(valid), None, dtype=object)
        ids[valid] = context.handles.release_ids(handles)
        return pa.array(ids, pa.string())

    context.udf("dp_range_variance", variance, ["BIGINT", "BIGINT"], "DOUBLE", arrow=True)
    context.udf("dp__range_margin", margin, ["BIGINT", "BIGINT", "DOUBLE"], "DOUBLE", arrow=True)
    context.udf("dp_release_id", release_id, ["BIGINT"], "VARCHAR", arrow=True)
    # A macro, for the default level.
    context.macro("dp_range_margin(start_row, stop_row, level := 0.95) AS "
                  "dp__range_margin(start_row, stop_row, level)")


def _install_threshold(context: Context) -> None:
    names = [*(n for n in methods.named_parameters(THRESHOLD_METHOD) if n != ESTIMATOR), "fresh", "note"]

    def plan(table, value_col, method, params_json):
        value_col = column_name(value_col, "value_col")
        source = resolve_source(context, table)
        columns = describe(context, source)
        require_columns(columns, source, value_col=value_col)
        require_numeric(columns, value_col)
        params = parse_params(params_json)
        params[ESTIMATOR] = THRESHOLD_ESTIMATOR if method is None else method
        threshold_plan = Plan(source=source, value_col=value_col, order_by=None, partition_by=None,
                              method=THRESHOLD_METHOD, params=params, reads=source.read([value_col]))
        return context.result_query(THRESHOLD_SCHEMA, functools.partial(run, threshold_plan))

    def run(plan: Plan) -> pa.Table:
        _, release = release_ordered(context, plan)
        threshold = release.threshold if release.threshold is not None else float(release.values[0])
        return pa.Table.from_pylist([{"threshold": threshold, "epsilon": release.epsilon, "delta": release.delta,
                                      RELEASE_COLUMN: release.release_id}], schema=THRESHOLD_SCHEMA)

    context.udf("dp__plan_threshold", plan, ["VARCHAR"] * 4, "VARCHAR")
    defaults = ", ".join(f"{quote_ident(n)} := NULL" for n in names)
    context.macro(f"dp_threshold(tbl, value_col, method := {quote_literal(THRESHOLD_ESTIMATOR)}, {defaults}) AS TABLE "
                  f"FROM query(dp__plan_threshold(tbl, value_col, method, {params_struct(names)}))")
