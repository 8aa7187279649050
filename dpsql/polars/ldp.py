"""Local-DP user streams in Polars: ``pl.col(v).dpsql.ldp(...)`` and the collector's estimators.

Over a (user, time, value) frame, :func:`ldp` runs the device encoder of a method of Du
et al. (:mod:`dpsql.streams.du`) on every user's stream (``partition_by`` = the user key), as
a trusted ingestion gateway would or to simulate collection, and returns per row the
published value, the raw report covering the slot and that report's index. The
collector's estimators (:func:`smoothed`, :func:`subsequence_means`,
:func:`crowd_distribution`) are post-processing of those columns and cost nothing.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from dpsql._frontend import LDP_METHOD, check_budget, check_parameters, check_range_sum_method
from dpsql.errors import InvalidParameter
from dpsql.ldp.collector import crowd_distribution as _crowd_distribution
from dpsql.ldp.collector import report_view
from dpsql.mechanisms.ldp.linear import check_window
from dpsql.polars._machinery import RowsInTimeOrder, private_expression
from dpsql.polars._namespace import namespace_method
from dpsql.publishing import publish
from dpsql.streams.du import MACHINES

FIELDS = {"value": pl.Float64, "report": pl.Float64, "dp_report": pl.Int64}
#: The keywords of :func:`ldp` besides the method's parameters.
KEYWORDS = ("method", "order_by", "partition_by", "budget", "note", "progress")


@namespace_method
def ldp(value: pl.Expr, *, method: str = LDP_METHOD, order_by=None, partition_by=None, budget=None,
        note: str | None = None, progress: bool = True, **params) -> pl.Expr:
    """Encode every user's stream on its (simulated) device and publish it.

    Privacy cost: ``epsilon`` under w-event LDP per user (notion ``"w-event-ldp"`` with
    the given ``w``; neighbours: one user's values in any ``w`` consecutive slots, time
    keys public), one release per evaluation, charged once to a w-event-LDP ledger
    scope; users are disjoint partitions, so the charge is the maximum over users.
    Values outside the public ``[lower, upper]`` are clipped (part of the mechanism).

    Parameters
    ----------
    value : polars.Expr
        The users' true readings (nulls, NaN and infinities are refused).
    method : str, default "capp"
        ``"sw_direct"``, ``"sampling"``, ``"ba_sw"``, ``"ipp"``, ``"app"``, ``"capp"`` or ``"pp_s"``.
    order_by, partition_by :
        The public time key and the user key.
    budget : dpsql.Budget, optional
        A scope created with ``notion="w-event-ldp"`` and the same ``w``.
    note : str, optional
        Recorded in the ledger with the release.
    progress : bool, default True
        Show a progress bar when the release is expected to take more than two seconds.
    **params
        ``epsilon``, ``w``, ``lower``, ``upper`` and the method's parameters
        (``accounting``, ``memory``, ``bounds_mode``, ``clip_delta``, ``qlen``, ``n_s``,
        ``base``, ``window``, ``align``), see :mod:`dpsql.ldp.api`.

    Returns
    -------
    polars.Expr
        A struct per row: ``value`` (the published stream), ``report`` (the raw report
        covering the slot, data units) and ``dp_report`` (its index in the user's stream).

    Examples
    --------
    >>> import polars as pl, dpsql, dpsql.polars
    >>> df = pl.DataFrame({"user": [0] * 30 + [1] * 30, "t": list(range(30)) * 2, "v": [5.0] * 60})
    >>> budget = dpsql.Budget.in_memory(epsilon=1.0, notion="w-event-ldp", w=5)
    >>> with dpsql.testing.seeded(0):
    ...     out = df.with_columns(pl.col("v").dpsql.ldp(method="ipp", order_by="t", partition_by="user",
    ...                                                 epsilon=1.0, w=5, lower=0.0, upper=10.0,
    ...                                                 budget=budget).alias("dp")).unnest("dp")
    >>> out.columns, budget.spent
    (['user', 't', 'v', 'value', 'report', 'dp_report'], (1.0, 0.0))
    """
    check_range_sum_method(method)
    if method not in MACHINES:
        raise InvalidParameter(f"method must be one of {', '.join(map(repr, MACHINES))} for an LDP user "
                               f"stream, got {method!r}")
    check_parameters(".dpsql.ldp()", params, own=KEYWORDS, method=method)
    check_budget(budget)
    if order_by is None:
        raise InvalidParameter(".dpsql.ldp() needs order_by: each user's stream is encoded in its time order")

    def release(values: np.ndarray, rows: RowsInTimeOrder, column: str, source: str):
        return publish(method, values, budget=budget, column=column, note=note, source=source, progress=progress,
                       partition_offsets=rows.offsets if rows.partitioned else None,
                       partition_keys=rows.partition_keys, **params)

    def output(result, rows: RowsInTimeOrder) -> pl.Series:
        reports, index = report_view(result)
        return pl.DataFrame({"value": rows.scatter(result.values), "report": rows.scatter(reports),
                             "dp_report": rows.scatter(index)}, schema=FIELDS).to_struct()

    return private_expression(value, release, order_by=order_by, partition_by=partition_by, output=output,
                              return_dtype=pl.Struct(FIELDS), function=".dpsql.ldp()")


def smoothed(report: pl.Expr | str = "report", *, partition_by, order_by, window: int = 3,
             align: str = "trailing") -> pl.Expr:
    """The simple moving average of the raw reports within each user (post-processing, free):
    ``"trailing"`` windows of ``window`` slots or ``"center"`` ones (odd ``window``), shrinking
    at the ends of each user's stream, like :func:`dpsql.ldp.published_stream`.

    Examples
    --------
    >>> import polars as pl
    >>> df = pl.DataFrame({"u": [0, 0, 0, 0], "t": [3, 0, 1, 2], "report": [0.0, 3.0, 6.0, 9.0]})
    >>> df.with_columns(smoothed(partition_by="u", order_by="t", window=3).alias("s")).sort("t")["s"].to_list()
    [3.0, 4.5, 6.0, 5.0]
    """
    window, align = check_window(window, align)
    report = pl.col(report) if isinstance(report, str) else report
    return report.rolling_mean(window, min_samples=1, center=align == "center").over(partition_by, order_by=order_by)


def subsequence_means(frame: pl.DataFrame, *, partition_by, order_by, start: int, stop: int,
                      report: str = "report") -> pl.DataFrame:
    """Per user: the mean of the raw reports over the slots ``start .. stop - 1`` of the
    user's stream in ``order_by`` order (DU's subsequence-mean estimator; free).

    Examples
    --------
    >>> import polars as pl
    >>> df = pl.DataFrame({"u": [1, 1, 1, 2, 2, 2], "t": [0, 1, 2, 0, 1, 2], "report": [1.0, 2.0, 3.0, 0, 0, 6]})
    >>> subsequence_means(df, partition_by="u", order_by="t", start=1, stop=3).sort("u")["mean"].to_list()
    [2.5, 3.0]
    """
    if not 0 <= start < stop:
        raise InvalidParameter(f"subsequence must satisfy 0 <= start < stop, got start={start}, stop={stop}")
    return (frame.sort(order_by).group_by(partition_by, maintain_order=True)
            .agg(pl.col(report).slice(start, stop - start).mean().alias("mean")))


def crowd_distribution(means) -> pl.DataFrame:
    """The crowd-level distribution of per-user means: ``mean`` (sorted, distinct) and ``cdf``.

    Examples
    --------
    >>> crowd_distribution(pl.Series([0.3, 0.1, 0.3]))["cdf"].round(3).to_list()
    [0.333, 1.0]
    """
    support, cdf = _crowd_distribution(np.asarray(means, dtype=np.float64))
    return pl.DataFrame({"mean": support, "cdf": cdf})
