"""The Polars front end: a ``dpsql`` expression namespace for private streams.

Importing :mod:`dpsql.polars` registers the namespace (it coexists with OpenDP's
``.dp``)::

    import polars as pl, dpsql, dpsql.polars

    budget = dpsql.Budget.open("ledger.sqlite", epsilon=2.0)
    out = df.with_columns(
        pl.col("kwh").dpsql.range_sum(method="tops", epsilon=1.0, upper=50.0, order_by="ts",
                                      partition_by="meter", budget=budget).alias("kwh_dp"))

Each evaluation of a dpsql expression is one release through
:func:`dpsql.publishing.publish`, charged once (partitions at the maximum), in eager or lazy
mode and on any engine; see :mod:`dpsql.polars._machinery` for how that is enforced
(no dtype-inference calls, no chunking, no CSE merging, group-wise evaluation such
as ``.over()`` refused in favour of ``partition_by``).

Error bars: ``range_sum(..., errors=True)`` returns a struct (``value``, ``sd``,
``position``, ``release``); :func:`window_ci` (trailing windows, like
``rolling_sum_by``) and :func:`bucket_ci` (``group_by_dynamic`` buckets) turn it into
window sums with exact-variance intervals, which per-row variances could not give for
the correlated noise of tree methods.

Adding a method to the namespace (other dpsql modules do this)
--------------------------------------------------------------
Write a module under ``dpsql/polars/`` with a function taking the value expression
first and keyword-only options, build the expression with
:func:`dpsql.polars._machinery.private_expression` (it does the struct input, time
ordering, partitions, refusals and scatter; your ``release`` callback calls
:func:`dpsql.publishing.publish` once), decorate the function with
:func:`dpsql.polars._namespace.namespace_method`, and add one import line for your
module below. ``pl.col(x).dpsql.<your function>(...)`` then works.
"""

from __future__ import annotations

import polars as pl

from dpsql.polars import ldp  # noqa: F401  (adds .dpsql.ldp)
from dpsql.polars._namespace import DpsqlExpr, namespace_method
from dpsql.polars.range_sum import bucket_ci, range_sum, range_variance, threshold, window_ci

pl.api.register_expr_namespace("dpsql")(DpsqlExpr)

__all__ = ["DpsqlExpr", "bucket_ci", "namespace_method", "range_sum", "range_variance", "threshold", "window_ci"]
