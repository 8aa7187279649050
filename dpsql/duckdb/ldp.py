"""Local-DP user streams in SQL: ``dp_ldp`` and the collector's estimators.

SQL surface (installed by :func:`dpsql.duckdb.register`):

``dp_ldp(tbl, order_col, value_col, method := 'capp', partition_by := NULL, epsilon := ..., w := ..., ...)``
    Table macro over a (user, time, value) table. Runs the device encoder of a
    :mod:`dpsql.ldp.du` method (``sw_direct``, ``sampling``, ``ba_sw``, ``ipp``, ``app``,
    ``capp``, ``pp_s``) on every user's stream (``partition_by`` = the user column, time
    order ``order_col``), as a trusted ingestion gateway would or to simulate
    collection, and publishes the collector's stream. Cost: ``epsilon`` under w-event
    LDP per user (notion ``"w-event-ldp"`` with the given ``w``; neighbours: one user's
    values in any ``w`` consecutive slots), one release charged once to the budget the
    connection was registered with, which must be a w-event-LDP scope with the same
    ``w`` (else ``NotionMismatch``, nothing charged): users are disjoint, so the charge
    is the maximum over users. Values
    outside ``[lower, upper]`` are clipped (part of the mechanism). Every method
    parameter (``accounting``, ``memory``, ``bounds_mode``, ``clip_delta``, ``qlen``,
    ``n_s``, ``base``, ``sma``, ``align``) is a named parameter; NULL means the default.
    Returns, sorted by user then time: the keys, the published value (named like
    ``value_col``), ``dp_row``, ``dp_part`` (0-based user index), ``report`` (the raw
    report covering the slot, data units), ``dp_report`` (that report's index in the
    user's stream) and ``dp_release`` (release number; ``dp_release_id`` gives the ledger id).
    Error bars: ``dp_range_variance`` /
    ``dp_range_margin`` as for ``dp_range_sum``.

The collector's side is post-processing of a saved ``dp_ldp`` result ``reports`` (a table
or view name), free of charge:

``dp_ldp_subsequence_means(reports, start_row, stop_row)``
    Per user (``dp_part``): the mean of the raw reports over slots ``start_row ..
    stop_row - 1`` (DU's subsequence-mean estimator).
``dp_ldp_smoothed(reports, sma := 3, align := 'trailing')``
    Per user and slot: the simple moving average of the raw reports (``'trailing'``
    window of ``sma`` slots, or ``'center'`` with odd ``sma``), shrinking at the ends.
``dp_ldp_crowd_distribution(reports, start_row, stop_row)``
    The crowd-level distribution of per-user subsequence means: ``mean`` and its
    empirical ``cdf``.

>>> import duckdb, dpsql
>>> con = duckdb.connect()
>>> budget = dpsql.Budget.in_memory(epsilon=1.0, notion="w-event-ldp", w=4)
>>> dpsql.duckdb.register(con, budget=budget)
>>> _ = con.execute("CREATE TABLE t AS SELECT u, t, 10.0 * u AS v FROM range(3) a(u), range(20) b(t)")
>>> with dpsql.testing.seeded(0):
...     _ = con.execute("CREATE TABLE r AS SELECT * FROM dp_ldp('t', 't', 'v', partition_by := 'u', "
...                     "epsilon := 1, w := 4, lower := 0, upper := 20)")
>>> budget.spent, con.execute("SELECT count(*) FROM dp_ldp_subsequence_means('r', 0, 10)").fetchall()
((1.0, 0.0), [(3,)])
"""

from __future__ import annotations

import pyarrow as pa

from dpsql.duckdb._machinery import Context, install_stream_release
from dpsql.ldp import du

REPORT_COLUMNS = [("report", "DOUBLE"), ("dp_report", "BIGINT")]


def _report_columns(release) -> dict[str, pa.Array]:
    reports, index = du.report_view(release)
    return {"report": pa.array(reports), "dp_report": pa.array(index)}


def install(con, context: Context) -> None:
    install_stream_release(context, "dp_ldp", default_method="capp", extra_outputs=(REPORT_COLUMNS, _report_columns))
    context.macro(
        "dp_ldp_subsequence_means(reports, start_row, stop_row) AS TABLE "
        "SELECT dp_part, avg(report) AS mean FROM query_table(reports) "
        "WHERE dp_row >= start_row AND dp_row < stop_row GROUP BY dp_part ORDER BY dp_part")
    context.macro(
        "dp_ldp_smoothed(reports, sma := 3, align := 'trailing') AS TABLE "
        "SELECT dp_part, dp_row, avg(report) OVER (PARTITION BY dp_part ORDER BY dp_row ROWS BETWEEN "
        "(CASE WHEN align = 'center' THEN sma // 2 WHEN align = 'trailing' THEN sma - 1 "
        "ELSE error('align must be ''trailing'' or ''center'', got ' || align) END) PRECEDING AND "
        "(CASE WHEN align = 'center' THEN sma // 2 ELSE 0 END) FOLLOWING) AS value "
        "FROM query_table(reports) ORDER BY dp_part, dp_row")
    context.macro(
        "dp_ldp_crowd_distribution(reports, start_row, stop_row) AS TABLE "
        "SELECT mean, cume_dist() OVER (ORDER BY mean) AS cdf "
        "FROM dp_ldp_subsequence_means(reports, start_row, stop_row) ORDER BY mean")
