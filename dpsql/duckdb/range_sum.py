"""``dp_range_sum``, ``dp_threshold`` and the error-bar functions.

SQL surface (installed by :func:`dpsql.duckdb.register`):

``dp_range_sum(tbl, order_col, value_col, method := 'tops', partition_by := NULL, epsilon := ..., upper := ..., ...)``
    Table macro. Releases ``value_col`` of table, view, file or data-frame variable
    ``tbl`` as a private stream in ``order_col`` order, with any registered method
    (``tops``, ``pak``, ``binary_tree``, ``laplace``, ...) and every core parameter
    (``epsilon``, ``delta``, ``upper``, ``lower``, ``m``, ``r``, ``fanout``, ``smoother``,
    ``holdout_share`` and method-specific ones) as named parameters; NULL means the
    core default. Values outside ``[lower, upper]`` are clipped (part of the mechanism).
    Cost: the method's ``(epsilon, delta)``, under replace-one-value neighbours with the
    time order and partition keys public; with ``partition_by`` one stream per
    partition, charged once at the maximum (parallel composition). Returns, sorted by
    partition then order key: the partition key, the order key, the private value
    (named like ``value_col``), ``dp_row`` (0-based position in the partition's stream),
    ``dp_part`` (0-based partition index) and ``dp_release`` (the connection's release
    number: an integer, because a 32-character ledger id on every row would cost more
    than the sort).

``dp_release_id(dp_release)``
    The ledger's ``release_id`` of a release number (``budget.history()`` lists it).

``dp_range_variance(release, dp_part, start_row, stop_row)``
    Exact noise variance of the sum of rows ``start_row .. stop_row - 1`` of one
    partition's stream (``release``: a ``dp_release`` number or a ledger ``release_id``):
    the release's :class:`~dpsql.release.ErrorModel`, so it is right for correlated
    (tree) noise too, where per-row variances do not add up. For a window ``w``:
    ``dp_range_variance(dp_release, dp_part, min(dp_row) OVER w, max(dp_row) OVER w + 1)``;
    a window must stay within one partition (``PARTITION BY`` the partition key).

``dp_range_margin(release, dp_part, start_row, stop_row, level := 0.95)``
    Half-width of the interval :meth:`dpsql.Release.range_ci` gives for that sum: the
    window's ``sum(value) ± margin``. Noise only: clipping and smoothing bias excluded.

``dp_threshold(tbl, value_col, method := 'nm', epsilon := ..., upper := ..., ...)``
    Table macro returning one row: the private clipping threshold of ``value_col``
    (core method ``threshold``; ``method`` picks its estimator, ``'nm'`` or ``'pak'``),
    with its ``epsilon``, ``delta`` and ``release_id``.

Error bars come from the connection's last few releases (see
:data:`dpsql.duckdb._machinery.KEEP_ERROR_MODELS`); older releases are refused.
"""

from __future__ import annotations

import inspect

import numpy as np
import pyarrow as pa

from dpsql import api, streams  # noqa: F401  (registers the methods)
from dpsql.duckdb._machinery import (
    RELEASE_COLUMN,
    Context,
    Plan,
    column_name,
    describe,
    error_models,
    install_stream_release,
    ledger_id,
    params_struct,
    parse_params,
    planned,
    publish_ordered,
    quote_ident,
    quote_literal,
    read_ordered,
    require_columns,
    require_numeric,
    resolve_source,
    unnest_sql,
)
from dpsql.errors import InvalidParameter
from dpsql.release import _quantile_multiplier

THRESHOLD_METHOD = "threshold"
#: The core threshold method's parameter that SQL calls ``method``.
ESTIMATOR = "estimator"


def install(con, context: Context) -> None:
    install_stream_release(context, "dp_range_sum", default_method="tops")
    _install_error_bars(context)
    _install_threshold(context)


def _variances(context: Context, release_ids, parts, starts, stops) -> np.ndarray:
    """Vectorised range variances; rows are grouped by (release, partition)."""
    release_ids = np.asarray(release_ids.to_pylist(), dtype=object)
    parts = parts.to_numpy(zero_copy_only=False)
    starts = starts.to_numpy(zero_copy_only=False)
    stops = stops.to_numpy(zero_copy_only=False)
    out = np.empty(len(starts), dtype=np.float64)
    for release_id in dict.fromkeys(release_ids):
        models = error_models(context, release_id)
        in_release = release_ids == release_id
        for part in np.unique(parts[in_release]):
            if not 0 <= part < len(models):
                raise InvalidParameter(f"dp_part must be in [0, {len(models)}) for release {release_id!r}, "
                                       f"got {part}")
            rows = np.flatnonzero(in_release & (parts == part))
            model, n = models[part]
            i, j = starts[rows].astype(np.int64), stops[rows].astype(np.int64)
            if np.any(i < 0) or np.any(j > n) or np.any(i > j):
                raise InvalidParameter(f"row range [start_row, stop_row) must satisfy 0 <= start_row <= "
                                       f"stop_row <= {n}")
            out[rows] = model.range_variance(i, j)
    return out


def _install_error_bars(context: Context) -> None:
    def variance(release_ids, parts, starts, stops):
        return pa.array(_variances(context, release_ids, parts, starts, stops))

    def margin(release_ids, parts, starts, stops, levels):
        sigma = np.sqrt(_variances(context, release_ids, parts, starts, stops))
        levels = levels.to_numpy(zero_copy_only=False)
        bad = levels[~((levels > 0) & (levels < 1))]
        if bad.size:
            raise InvalidParameter(f"level must satisfy 0 < level < 1, got {bad[0]!r}")
        multiplier = {(r, lv): _quantile_multiplier(lv, error_models(context, r)[0][0].excess_kurtosis)
                      for r, lv in dict.fromkeys(zip(release_ids.to_pylist(), levels.tolist()))}
        return pa.array(sigma * [multiplier[key] for key in zip(release_ids.to_pylist(), levels.tolist())])

    def release_id(numbers):
        return pa.array([ledger_id(context, str(n)) for n in numbers.to_pylist()], pa.string())

    context.udf("dp__range_variance", variance, ["VARCHAR", "BIGINT", "BIGINT", "BIGINT"], "DOUBLE", arrow=True)
    context.udf("dp__range_margin", margin, ["VARCHAR", "BIGINT", "BIGINT", "BIGINT", "DOUBLE"], "DOUBLE",
                arrow=True)
    context.udf("dp_release_id", release_id, ["BIGINT"], "VARCHAR", arrow=True)
    # The release may be a ledger id (VARCHAR) or a release number (BIGINT).
    context.macro("dp_range_variance(release, dp_part, start_row, stop_row) AS "
                  "dp__range_variance(CAST(release AS VARCHAR), dp_part, start_row, stop_row)")
    context.macro("dp_range_margin(release, dp_part, start_row, stop_row, level := 0.95) AS "
                  "dp__range_margin(CAST(release AS VARCHAR), dp_part, start_row, stop_row, level)")


def _install_threshold(context: Context) -> None:
    names = [n for n in inspect.signature(api.METHODS[THRESHOLD_METHOD]).parameters
             if n not in ("n", "noise", ESTIMATOR)]

    def plan(table, value_col, method, params_json):
        value_col = column_name(value_col, "value_col")
        source = resolve_source(context, table)
        columns = describe(context, source)
        require_columns(columns, source, value_col=value_col)
        require_numeric(columns, value_col)
        params = parse_params(params_json)
        if method is not None:
            params[ESTIMATOR] = method
        token = str(context.next_id())
        context.plans[token] = Plan(source=source, value_col=value_col, order_col=None, partition_by=None,
                                    method=THRESHOLD_METHOD, params=params,
                                    note=f"duckdb dp_threshold({table!r}, {value_col!r})")
        return unnest_sql(f"dp__run_threshold({quote_literal(token)})", [],
                          [("threshold", "DOUBLE", "threshold"), ("epsilon", "DOUBLE", "epsilon"),
                           ("delta", "DOUBLE", "delta"), (RELEASE_COLUMN, "VARCHAR", RELEASE_COLUMN)])

    def run(token):
        plan = planned(context, token)
        release = publish_ordered(context, plan, read_ordered(context, plan))
        threshold = release.threshold if release.threshold is not None else float(release.values[0])
        return context.hold({}, {"threshold": pa.array([threshold]), "epsilon": pa.array([release.epsilon]),
                                 "delta": pa.array([release.delta]),
                                 RELEASE_COLUMN: pa.array([release.release_id], pa.string())})

    context.udf("dp__plan_threshold", plan, ["VARCHAR"] * 4, "VARCHAR")
    context.udf("dp__run_threshold", run, ["VARCHAR"], "BIGINT")
    defaults = ", ".join(f"{quote_ident(n)} := NULL" for n in names)
    context.macro(f"dp_threshold(tbl, value_col, method := 'nm', {defaults}) "
                  f"AS TABLE FROM query(dp__plan_threshold(tbl, value_col, method, {params_struct(names)}))")
