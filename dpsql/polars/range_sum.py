"""Private streams and thresholds as Polars expressions, and their error bars.

``pl.col("kwh").dpsql.range_sum(...)`` releases a column with any registered stream
method; ``.dpsql.threshold(...)`` releases one private clipping threshold. Window sums
of a released column are ordinary Polars post-processing (``rolling_sum_by``,
``group_by_dynamic``, ``cum_sum``); their 95 % intervals come from :func:`window_ci`
and :func:`bucket_ci`, which read the release's exact noise structure (tree methods
have correlated noise, so per-row variances do not add up).
"""

from __future__ import annotations

import numpy as np
import polars as pl

from dpsql import handles
from dpsql._frontend import (
    RANGE_SUM_METHOD,
    THRESHOLD_ESTIMATOR,
    check_budget,
    check_parameters,
    check_range_sum_method,
)
from dpsql.budget import default_budget
from dpsql.error_models import check_level
from dpsql.errors import InvalidParameter
from dpsql.methods import check_method
from dpsql.polars._machinery import RowsInTimeOrder, private_expression
from dpsql.polars._namespace import namespace_method
from dpsql.publishing import publish
from dpsql.release import PartitionedRelease, Release

#: Field names of the ``errors=True`` struct: the released value, its noise standard
#: deviation and its ledger row handle (``dp_row``, as in SQL).
ERROR_FIELDS = {"value": pl.Float64, "sd": pl.Float64, "dp_row": pl.Int64}
#: The keywords of :func:`range_sum` and :func:`threshold` besides the method's parameters.
RANGE_SUM_KEYWORDS = ("order_by", "method", "partition_by", "budget", "note", "errors", "fresh")
THRESHOLD_KEYWORDS = ("method", "order_by", "budget", "note", "fresh")


@namespace_method
def range_sum(value: pl.Expr, *, order_by=None, method: str = RANGE_SUM_METHOD, partition_by=None, budget=None,
              note: str | None = None, errors: bool = False, fresh: bool = False, **params) -> pl.Expr:
    """Release the column ``value`` as a private stream, one value per row.

    Rows are put in time order (``order_by``, within each ``partition_by`` group),
    released by :func:`dpsql.publishing.publish` and returned in the frame's own row order,
    whatever it is. Sums of the released values over any rows estimate the true sums;
    their noise follows the method's error model.

    Privacy cost: that of ``method`` with ``params`` (e.g. ``epsilon``-DP for
    ``"laplace"`` and ``"tops"``, ``(epsilon, delta)`` for ``"pak"``), under the
    method's neighbour relation (replace one value; time keys and partition keys are
    public). Partitions are disjoint, so a partitioned release costs the maximum over
    partitions. Each evaluation of the expression is one release, charged once to
    ``budget``; evaluating it again on the same data (collecting a lazy query twice,
    re-running a notebook cell) returns the recorded answer, free, unless ``fresh=True``.
    Values outside the public ``[lower, upper]`` are clipped; that is part of the
    mechanism, not an error.

    Errors. Parameter names are checked when the expression is built: an unknown one is an
    :class:`dpsql.InvalidParameter` naming it, with the valid names. What only the data can
    tell (NaN or null values, duplicate time keys, an exhausted budget, a parameter the
    method refuses for this many rows) is raised when the query runs, as the same typed
    dpsql error in eager and lazy mode, naming the column (never Polars' internal
    expression); nothing is charged then.

    Parameters
    ----------
    value : polars.Expr
        The private numeric column. Nulls, NaN, infinities and non-numeric types are
        refused (:class:`dpsql.InvalidData`, naming the column).
    method : str, default "tops"
        A registered stream method (``dpsql.methods.METHODS``): ``"tops"``, ``"laplace"``,
        ``"pak"``, ``"binary_tree"``, ...
    order_by : str or polars.Expr
        The public time key (required). Nulls or duplicates within a partition are refused
        (:class:`dpsql.InvalidTimeKey`).
    partition_by : str, polars.Expr or list of them, optional
        Public keys of disjoint streams (e.g. one per meter); null or NaN keys are refused
        (:class:`dpsql.InvalidTimeKey`), as in every front end. Use this, not ``.over()``: a
        dpsql expression evaluated group by group is refused.
    budget : dpsql.Budget, optional
        Charged once per evaluation; default: the budget set by :func:`dpsql.use_budget`.
    note : str, optional
        Recorded in the ledger.
    errors : bool, default False
        Return a struct instead of the Float64 values: ``value`` (the release),
        ``sd`` (that row's noise standard deviation) and ``dp_row`` (the row's ledger
        handle, as in SQL; :func:`window_ci` and :func:`bucket_ci` read error models by it).
    fresh : bool, default False
        Release anew, and charge, even when an identical release's answer is recorded.
    **params
        The method's parameters: ``epsilon``, ``upper``, ``lower``, ``delta``, ``m``,
        ``r``, ``fanout``, ``smoother``, ``holdout_share``, ... passed through unchanged.

    Returns
    -------
    polars.Expr
        Float64 aligned with the input rows, or the struct described above.

    Examples
    --------
    >>> import polars as pl, dpsql, dpsql.polars
    >>> df = pl.DataFrame({"ts": [3, 1, 2, 4], "kwh": [2.0, 1.0, 5.0, 3.0]})
    >>> budget = dpsql.Budget.in_memory(epsilon=1.0)
    >>> with dpsql.testing.seeded(0):
    ...     out = df.with_columns(pl.col("kwh").dpsql.range_sum(
    ...         method="laplace", epsilon=0.5, upper=10.0, order_by="ts", budget=budget).alias("kwh_dp"))
    >>> out.columns, out["kwh_dp"].dtype, budget.spent
    (['ts', 'kwh', 'kwh_dp'], Float64, (0.5, 0.0))
    """
    check_range_sum_method(method)
    check_parameters(".dpsql.range_sum()", params, own=RANGE_SUM_KEYWORDS, method=method)
    check_budget(budget)
    if order_by is None:
        raise InvalidParameter(".dpsql.range_sum() needs order_by: a stream release needs its public time key")

    def release(values: np.ndarray, rows: RowsInTimeOrder, column: str, source: str):
        return publish(method, values, budget=budget, column=column, note=note, source=source,
                       partition_offsets=rows.offsets if rows.partitioned else None,
                       partition_keys=rows.partition_keys, order_keys=rows.order_keys,
                       order_values=rows.order_values, fresh=fresh, **params)

    def output(result, rows: RowsInTimeOrder) -> pl.Series:
        values = pl.Series(rows.scatter(result.values), dtype=pl.Float64)
        if not errors:
            return values
        if result.first_handle is None:
            raise InvalidParameter("errors=True needs a release recorded in a ledger: pass budget= (or set one "
                                   "with dpsql.use_budget)")
        handles.remember(result.first_handle, len(result), budget or default_budget())
        positions = np.arange(len(result), dtype=np.int64)
        sd = np.sqrt(range_variance(result, positions, positions + 1))
        return pl.DataFrame({"value": values, "sd": rows.scatter(sd),
                             "dp_row": rows.scatter(result.first_handle + positions)}).to_struct()

    dtype = pl.Struct(ERROR_FIELDS) if errors else pl.Float64
    return private_expression(value, release, order_by=order_by, partition_by=partition_by, output=output,
                              return_dtype=dtype, function=".dpsql.range_sum()")


@namespace_method
def threshold(value: pl.Expr, *, method: str = THRESHOLD_ESTIMATOR, order_by=None, budget=None,
              note: str | None = None, fresh: bool = False, **params) -> pl.Expr:
    """Release one private clipping threshold of the column ``value`` (a Float64 scalar).

    Runs the registered ``"threshold"`` method through :func:`dpsql.publishing.publish`, in
    ``order_by`` order (the frame's row order when omitted). Privacy cost: that of the
    threshold method and its ``params`` (``epsilon``-DP for noisy max,
    ``(epsilon, delta)`` for the smooth-sensitivity PAK threshold), replace-one-value
    neighbours, charged once per evaluation. Values outside ``[lower, upper]`` are clipped.

    ``method`` is ``"nm"`` (Noisy Max) or ``"pak"`` (the smooth-sensitivity quantile), as in
    :func:`dpsql.threshold` and ``dp_threshold``. Other parameters are the threshold method's
    (``epsilon``, ``upper``, ``lower``, ``delta``, ...), passed through unchanged; unknown names are
    refused when the expression is built, as for :func:`range_sum`. Partitions are not
    offered: a scalar expression has one value per frame.

    Examples
    --------
    >>> import polars as pl, dpsql, dpsql.polars
    >>> df = pl.DataFrame({"kwh": [float(v % 7) for v in range(2000)]})
    >>> budget = dpsql.Budget.in_memory(epsilon=1.0)
    >>> with dpsql.testing.seeded(1):
    ...     theta = df.select(pl.col("kwh").dpsql.threshold(epsilon=1.0, upper=10.0, budget=budget)).item()
    >>> 0.0 < theta <= 10.0, budget.spent
    (True, (1.0, 0.0))
    """
    check_method("threshold")
    check_parameters(".dpsql.threshold()", params, own=THRESHOLD_KEYWORDS, method="threshold")
    check_budget(budget)

    def release(values: np.ndarray, rows: RowsInTimeOrder, column: str, source: str):
        return publish("threshold", values, budget=budget, column=column, note=note, source=source, fresh=fresh,
                       estimator=method,
                       **params)

    def output(result, rows: RowsInTimeOrder) -> pl.Series:
        return pl.Series([float(result.values[0])], dtype=pl.Float64)

    return private_expression(value, release, order_by=order_by, partition_by=None, output=output,
                              return_dtype=pl.Float64, returns_scalar=True, function=".dpsql.threshold()")


def range_variance(result: Release | PartitionedRelease, starts, stops) -> np.ndarray:
    """Noise variance of the sums of the release's rows ``starts[i]:stops[i]`` (positions in
    its output order: partition, then time); each range within one partition."""
    starts = np.asarray(starts, dtype=np.int64)
    stops = np.asarray(stops, dtype=np.int64)
    if isinstance(result, Release):
        return np.asarray(result.range_variance(starts, stops), dtype=np.float64)
    offsets = result.offsets
    part = np.searchsorted(offsets, starts, side="right") - 1
    if np.any(stops > offsets[np.minimum(part + 1, len(offsets) - 1)]):
        raise InvalidParameter("a range crosses a partition boundary; windows must stay within one partition")
    out = np.empty(len(starts))
    for k in np.unique(part).tolist():
        rows = part == k
        out[rows] = result.part(k).range_variance(starts[rows] - offsets[k], stops[rows] - offsets[k])
    return out


def _interval_columns(frame, column: str, sums: pl.Expr, starts: pl.Expr, stops: pl.Expr, level: float, budget):
    """Add ``{column}_sum``, ``_low``, ``_high``: each window's sum of released values and its
    :meth:`dpsql.Release.range_ci` interval, the window's rows given as ledger row handles
    ``starts .. stops - 1``, resolved through ``budget``'s ledger (default: the budget of the
    release in this process, else :func:`dpsql.use_budget`'s)."""
    level = check_level(level)
    names = [f"{column}_sum", f"{column}_low", f"{column}_high"]

    def intervals(batch: pl.Series) -> pl.Series:
        fields = batch.struct.unnest()
        total = fields.get_column("sum").fill_null(0.0).to_numpy()
        start = fields.get_column("start").fill_null(0).to_numpy()
        stop = np.maximum(fields.get_column("stop").fill_null(0).to_numpy(), start + 1)
        owner = budget if budget is not None else handles.budget_of(int(start[0]), default_budget()) if len(
            start) else None
        if owner is None:
            raise InvalidParameter(f"the error bars of column {column!r} are in the ledger of the budget its release "
                                   "was charged to: pass budget=")
        half = np.empty(len(start))
        for positions, model, i, j in handles.HandleResolver(owner).ranges(start, stop):
            half[positions] = model.range_margin(i, j, level)
        return pl.DataFrame(dict(zip(names, [total, total - half, total + half]))).to_struct()

    bands = pl.struct(sums.alias("sum"), starts.alias("start"), stops.alias("stop")).map_batches(
        intervals, return_dtype=pl.Struct(dict.fromkeys(names, pl.Float64)))
    return frame.with_columns(bands.alias("__dpsql_bands")).unnest("__dpsql_bands")


def window_ci(frame, column: str, *, order_by: str, period, partition_by=None, closed: str = "right",
              level: float = 0.95, budget=None):
    """Trailing-window sums of a released column with their confidence intervals.

    For each row, the window holds the rows of its partition whose ``order_by`` lies
    in ``(t - period, t]`` (Polars ``rolling_sum_by`` semantics, ``closed`` as there).
    Adds ``{column}_sum``, ``{column}_low`` and ``{column}_high``: the window's sum and
    exactly the interval :meth:`dpsql.Release.range_ci` gives for it (the noise at ``level``
    from the release's error model, plus the most a released block's spreading can be off
    where the window cuts one). Pure post-processing: reads only released values, costs nothing.
    A ``period`` covering the whole time span gives running totals (``cum_sum``).

    Parameters
    ----------
    frame : polars.DataFrame or polars.LazyFrame
        Holds ``column``, the output of ``range_sum(..., errors=True)``.
    period : str, int or datetime.timedelta
        The window length, as Polars' ``window_size`` (an int means that many
        units of an integer ``order_by``).

    Examples
    --------
    >>> import polars as pl, dpsql, dpsql.polars
    >>> df = pl.DataFrame({"ts": range(100), "kwh": [1.0] * 100})
    >>> budget = dpsql.Budget.in_memory(epsilon=1.0)
    >>> with dpsql.testing.seeded(0):
    ...     rel = df.with_columns(pl.col("kwh").dpsql.range_sum(
    ...         method="laplace", epsilon=1.0, upper=2.0, order_by="ts", errors=True, budget=budget).alias("dp"))
    >>> out = dpsql.polars.window_ci(rel, "dp", order_by="ts", period=10)
    >>> bool(((out["dp_low"] <= 10.0) & (10.0 <= out["dp_high"])).tail(90).mean() > 0.8)
    True
    """
    field = pl.col(column).struct.field
    partitions = list(partition_by) if isinstance(partition_by, list | tuple) else partition_by

    def windowed(expr: pl.Expr) -> pl.Expr:
        return expr if partitions is None else expr.over(partitions)

    window = f"{period}i" if isinstance(period, int) else period
    options = dict(window_size=window, closed=closed)
    sums = windowed(field("value").rolling_sum_by(order_by, **options))
    starts = windowed(field("dp_row").rolling_min_by(order_by, **options))
    stops = windowed(field("dp_row").rolling_max_by(order_by, **options)) + 1
    return _interval_columns(frame, column, sums, starts, stops, level, budget)


def bucket_ci(frame, column: str, *, order_by: str, every, partition_by=None, level: float = 0.95, budget=None,
              **dynamic):
    """Sums of a released column per time bucket (``group_by_dynamic``) with intervals.

    One row per bucket (and partition): ``order_by`` (the bucket start),
    ``{column}_sum``, ``{column}_low``, ``{column}_high``. ``**dynamic`` goes to
    ``group_by_dynamic`` (``period``, ``offset``, ``closed``, ...). Same interval
    construction as :func:`window_ci`; pure post-processing.

    Examples
    --------
    >>> import polars as pl, dpsql, dpsql.polars
    >>> df = pl.DataFrame({"ts": range(48), "kwh": [2.0] * 48})
    >>> with dpsql.testing.seeded(0), dpsql.use_budget(dpsql.Budget.in_memory(epsilon=1.0)):
    ...     rel = df.with_columns(pl.col("kwh").dpsql.range_sum(
    ...         method="laplace", epsilon=1.0, upper=4.0, order_by="ts", errors=True).alias("dp"))
    >>> daily = dpsql.polars.bucket_ci(rel, "dp", order_by="ts", every="24i")
    >>> daily.columns, daily.height
    (['ts', 'dp_sum', 'dp_low', 'dp_high'], 2)
    """
    field = pl.col(column).struct.field
    keys = [] if partition_by is None else ([partition_by] if isinstance(partition_by, str) else list(partition_by))
    buckets = (frame.sort([*keys, order_by])
               .group_by_dynamic(order_by, every=every, group_by=keys or None, **dynamic)
               .agg(field("value").sum().alias("__sum"), field("dp_row").min().alias("__start"),
                    (field("dp_row").max() + 1).alias("__stop")))
    out = _interval_columns(buckets, column, pl.col("__sum"), pl.col("__start"), pl.col("__stop"), level, budget)
    return out.select([*keys, order_by, f"{column}_sum", f"{column}_low", f"{column}_high"])


__all__ = ["ERROR_FIELDS", "bucket_ci", "range_sum", "range_variance", "threshold", "window_ci"]
