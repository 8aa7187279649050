"""DuckDB front end: private stream releases as SQL table macros, charged to a ledger.

>>> import duckdb, dpsql
>>> con = duckdb.connect()
>>> budget = dpsql.Budget.in_memory(epsilon=1.0)
>>> dpsql.duckdb.register(con, budget=budget)
>>> con.execute("CREATE TABLE t AS SELECT range AS ts, 5.0 AS v FROM range(100)")  # doctest: +ELLIPSIS
<...>
>>> with dpsql.testing.seeded(0):
...     rows = con.sql("SELECT * FROM dp_range_sum('t', 'ts', 'v', method := 'laplace', "
...                    "epsilon := 0.5, upper := 10)").fetchall()
>>> len(rows), budget.spent
(100, (0.5, 0.0))

See :mod:`dpsql.duckdb.range_sum` for the SQL surface and :func:`register` for the
rules (what is charged when, what a failed query costs).

Plugging in more macros
-----------------------
:func:`register` runs every function of :data:`_INSTALLERS` as ``install(con, context)``
with the connection's :class:`~dpsql.duckdb.context.Context` (bound budget, result slots,
macro signatures, row handles). To add a module's macros, define ``install(con, context)``
in it and add it to ``_INSTALLERS``.

The reusable pieces, by concern (docs/vocabulary.md, "Where the front ends live"):

* :mod:`dpsql.duckdb.macros`: ``install_stream_release(context, "dp_pegasus",
  default_method="pegasus")`` is a complete one-value-per-row table macro ``dp_pegasus(tbl,
  order_by, value_col, method := 'pegasus', partition_by := NULL, <every registered method
  parameter>)``, with the same validation, charging, outputs and error bars as
  ``dp_range_sum``; ``method_parameters()`` and ``params_struct()`` pass named parameters
  through to publish generically; ``row_handles`` makes the ``dp_row`` column.
* For other shapes, a macro is ``context.macro("name(tbl, ...) AS TABLE FROM
  query(dp__plan_name(...))")`` (its signature is kept for :mod:`dpsql.duckdb.sql_errors`)
  with a *plan* UDF registered by ``context.udf`` (which sets ``side_effects=True``). At
  bind time the plan uses :mod:`dpsql.duckdb.sources` (``resolve_source``, ``describe``,
  ``require_columns``, ``require_numeric``, ``arrow_fields``), fixes the result's Arrow
  schema and returns ``context.result_query(schema, run)``. ``run()`` is called when the
  query executes: :func:`dpsql.duckdb.ordered.release_ordered` reads the source in stream
  order, checks the keys and makes the one charge; it returns a ``pyarrow.Table`` of that
  schema.
"""

from __future__ import annotations

import contextlib

import duckdb

from dpsql._frontend import check_budget
from dpsql.budget import Budget
from dpsql.duckdb import context as _context
from dpsql.duckdb import counts, ldp, preview, range_sum, sql_errors, streams
from dpsql.errors import InvalidParameter

#: ``install(con, context)`` functions run by :func:`register`, in order.
_INSTALLERS = [range_sum.install, ldp.install, counts.install, streams.install, preview.install]


def register(con: duckdb.DuckDBPyConnection, *, budget: Budget) -> None:
    """Install dpsql's SQL functions into ``con``, charging ``budget``.

    Idempotent: calling it again re-installs the functions (picking up methods
    registered since) and binds the new ``budget``; nothing else is needed before the
    first query. See :mod:`dpsql.duckdb.range_sum` for the functions.

    Accounting rules. Every execution of a query runs each dpsql macro call in it once:
    one release, charged once to ``budget`` through :func:`dpsql.publishing.publish` before
    any value reaches the query. Two macro calls in one query (or one query executed
    twice) are two releases, charged twice; noise is never shared between rows or
    calls (the UDFs are registered with ``side_effects=True``). A call that fails
    before its release is complete (bad argument or data, budget exhausted, an error
    while the source is read) charges nothing and releases nothing. A release already
    charged is not refunded when the rest of the query fails, because such a failure
    may depend on the private values.

    Errors. A call DuckDB refuses while binding (a misspelt or missing parameter, an unquoted
    keyword, a subquery argument) or a source the release cannot see (a TEMP table, a common
    table expression) is re-raised as an error naming what is wrong and what to pass
    instead, both a :class:`dpsql.InvalidParameter` and DuckDB's own error class. A refusal
    while the statement runs (an exhausted budget, NaN values, a bad row handle) is raised as
    an error that is both the dpsql class (:class:`dpsql.BudgetExhausted`,
    :class:`dpsql.InvalidData`, ...) and DuckDB's, with dpsql's message: ``except
    dpsql.BudgetExhausted`` and ``except duckdb.Error`` both catch it. ``register`` wraps the
    query methods of DuckDB connections and relations for that (:mod:`dpsql.duckdb.sql_errors`;
    connections never registered are left as they are).

    Parameters
    ----------
    con : duckdb.DuckDBPyConnection
    budget : dpsql.Budget
        The ledger scope every release from this connection is charged to.

    Examples
    --------
    >>> import duckdb, dpsql
    >>> con = duckdb.connect()
    >>> dpsql.duckdb.register(con, budget=dpsql.Budget.in_memory(epsilon=1.0))
    >>> con.execute("SELECT count(*) FROM duckdb_functions() WHERE function_name = 'dp_range_sum'").fetchone()
    (1,)
    """
    check_budget(budget, required="SQL releases are charged to it; pass dpsql.register(con, "
                 "budget=dpsql.Budget.open(path, epsilon=...)) (or Budget.in_memory(...))")
    if not isinstance(con, duckdb.DuckDBPyConnection):
        raise InvalidParameter(f"con must be a duckdb connection, got {type(con).__name__}")
    sql_errors.install()
    context = _context.context_for(con, budget)
    _context.install_result_slots(context)
    for install in _INSTALLERS:
        install(con, context)


@contextlib.contextmanager
def typed_errors():
    """Re-raise DuckDB errors caused by dpsql as the original typed :class:`dpsql.DPError`.

    Not needed on a registered connection, whose errors are already of both classes
    (:func:`register`): kept for code written before. Inside this block an error of both
    classes, or DuckDB's report of an exception raised inside a dpsql function, is raised
    as the original dpsql error object (``type(error)`` the dpsql class itself).

    Examples
    --------
    >>> import duckdb, dpsql
    >>> con = duckdb.connect()
    >>> dpsql.duckdb.register(con, budget=dpsql.Budget.in_memory(epsilon=1.0))
    >>> with dpsql.duckdb.typed_errors():  # doctest: +ELLIPSIS
    ...     con.sql("SELECT * FROM dp_range_sum('missing', 'ts', 'v', epsilon := 1, upper := 1)")
    Traceback (most recent call last):
    ...
    dpsql.errors.InvalidParameter: tbl 'missing' not found: ...
    """
    try:
        yield
    except duckdb.Error as error:
        original = _context.typed_error(error)
        if original is error:
            raise
        raise original from None


__all__ = ["register", "typed_errors"]
