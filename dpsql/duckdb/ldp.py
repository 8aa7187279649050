"""Local-DP user streams in SQL: ``dp_ldp`` and the collector's estimators.

SQL surface (installed by :func:`dpsql.duckdb.register`):

``dp_ldp(tbl, order_by, value_col, method := 'capp', partition_by := NULL, epsilon := ..., w := ..., ...)``
    Table macro over a (user, time, value) table. Runs the device encoder of a
    method of Du et al. (:mod:`dpsql.streams.du`: ``sw_direct``, ``sampling``, ``ba_sw``, ``ipp``, ``app``,
    ``capp``, ``pp_s``) on every user's stream (``partition_by`` = the user column, time
    order ``order_by``), as a trusted ingestion gateway would or to simulate
    collection, and publishes the collector's stream. Cost: ``epsilon`` under w-event
    LDP per user (notion ``"w-event-ldp"`` with the given ``w``; neighbours: one user's
    values in any ``w`` consecutive slots), one release charged once to the budget the
    connection was registered with, which must be a w-event-LDP scope with the same
    ``w`` (else ``NotionMismatch``, nothing charged): users are disjoint, so the charge
    is the maximum over users. Values
    outside ``[lower, upper]`` are clipped (part of the mechanism). Every method
    parameter (``accounting``, ``memory``, ``bounds_mode``, ``clip_delta``, ``qlen``,
    ``n_s``, ``base``, ``"window"`` (quoted: an SQL keyword), ``align``) is a named parameter; NULL means the default.
    Returns, sorted by user then time: the keys, the published value (named like
    ``value_col``), ``dp_row`` (the connection-wide row handle; ``dp_release_id(dp_row)``
    gives the ledger id), ``dp_user`` (0-based user index), ``dp_slot`` (0-based slot
    index in the user's stream), ``report`` (the raw report covering the slot, data
    units) and ``dp_report`` (that report's index in the user's stream). Error bars:
    ``dp_range_variance`` / ``dp_range_margin`` over ``dp_row`` as for ``dp_range_sum``.

The collector's side is post-processing of a saved ``dp_ldp`` result ``reports`` (a table
or view name), free of charge:

``dp_ldp_subsequence_means(reports, start_slot, stop_slot)``
    Per user (``dp_user``): the mean of the raw reports over slots ``start_slot ..
    stop_slot - 1`` (DU's subsequence-mean estimator).
``dp_ldp_smoothed(reports, "window" := 3, align := 'trailing')``
    Per user and slot (``dp_user``, ``dp_slot``): the simple moving average of the raw
    reports (``'trailing'`` windows of ``window`` slots, or ``'center'`` ones with odd
    ``window``), shrinking at the ends. ``window`` is an SQL keyword: quote it, as for
    ``dp_ldp``'s ``"window"`` (the DU methods' smoothing window).
``dp_ldp_crowd_distribution(reports, start_slot, stop_slot)``
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

import numpy as np
import pyarrow as pa

from dpsql._frontend import LDP_METHOD
from dpsql.duckdb.context import Context
from dpsql.duckdb.macros import install_stream_release, release_offsets
from dpsql.ldp.collector import report_view

USER_COLUMNS = [("dp_user", pa.int64()), ("dp_slot", pa.int64()), ("report", pa.float64()), ("dp_report", pa.int64())]


def _user_columns(release) -> dict[str, pa.Array]:
    """User index, slot index and the raw report view: what the collector macros read."""
    offsets = release_offsets(release)
    sizes = np.diff(offsets)
    reports, index = report_view(release)
    return {"dp_user": pa.array(np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)),
            "dp_slot": pa.array(np.arange(offsets[-1], dtype=np.int64) - np.repeat(offsets[:-1], sizes)),
            "report": pa.array(reports), "dp_report": pa.array(index)}


def install(con, context: Context) -> None:
    install_stream_release(context, "dp_ldp", default_method=LDP_METHOD, extra_outputs=(USER_COLUMNS, _user_columns))
    context.macro(
        "dp_ldp_subsequence_means(reports, start_slot, stop_slot) AS TABLE "
        "SELECT dp_user, avg(report) AS mean FROM query_table(reports) "
        "WHERE dp_slot >= start_slot AND dp_slot < stop_slot GROUP BY dp_user ORDER BY dp_user")
    context.macro(
        "dp_ldp_smoothed(reports, \"window\" := 3, align := 'trailing') AS TABLE "
        "SELECT dp_user, dp_slot, avg(report) OVER (PARTITION BY dp_user ORDER BY dp_slot ROWS BETWEEN "
        "(CASE WHEN align = 'center' THEN \"window\" // 2 WHEN align = 'trailing' THEN \"window\" - 1 "
        "ELSE error('align must be ''trailing'' or ''center'', got ' || align) END) PRECEDING AND "
        "(CASE WHEN align = 'center' THEN \"window\" // 2 ELSE 0 END) FOLLOWING) AS value "
        "FROM query_table(reports) ORDER BY dp_user, dp_slot")
    context.macro(
        "dp_ldp_crowd_distribution(reports, start_slot, stop_slot) AS TABLE "
        "SELECT mean, cume_dist() OVER (ORDER BY mean) AS cdf "
        "FROM dp_ldp_subsequence_means(reports, start_slot, stop_slot) ORDER BY mean")
