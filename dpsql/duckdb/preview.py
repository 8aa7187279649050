"""``dp_preview``: what a release would cost and how accurate it would be, from SQL.

``dp_preview(method, n, lengths := [1, 24, 168], level := 0.95, epsilon := ..., upper := ..., ...)``
    Table macro calling :func:`dpsql.preview`: the cost the release of ``n`` rows with
    ``method`` and its parameters (every named parameter of ``dp_range_sum``, NULL meaning
    the method's default) would be charged, and its expected error, with **nothing charged
    and no table read** (so its result may be shown to anyone). One row per window length
    in ``lengths`` (those longer than ``n`` are left out): ``method``, ``n``, ``epsilon``,
    ``delta``, ``notion``, ``neighbour``, ``length``, ``sd`` (root mean square noise standard
    deviation of the sum of ``length`` consecutive rows, from the method's error model),
    ``margin`` (mean half-width of its interval at ``level``, as ``dp_range_margin`` would
    give), ``noise`` and ``spreading`` (the margin's two parts: the noise's half-width, and the
    bound on sharing a block's sum among its rows, 0 for windows along blocks), ``level`` and
    ``assumption`` (the least favourable case assumed for a data-dependent method: its preview
    is an upper bound). A method releasing no range sums (``threshold``) gives one row with NULL
    ``length``, ``sd``, ``margin``, ``noise`` and ``spreading``. ``lengths`` defaults to a row, a
    day and a week of hourly rows (of the ``grid``'s rows when one is given; whole days are then
    previewed from midnight to midnight, :func:`dpsql.preview`).

>>> import duckdb, dpsql
>>> con = duckdb.connect()
>>> dpsql.duckdb.register(con, budget=dpsql.Budget.in_memory(epsilon=1.0))
>>> con.sql("SELECT length, round(sd, 1) AS sd FROM dp_preview('laplace', 1000, epsilon := 1, upper := 10, "
...         "lengths := [1, 24])").fetchall()
[(1, 14.1), (24, 69.3)]
"""

from __future__ import annotations

import json
import math

from dpsql.duckdb.context import Context
from dpsql.duckdb.macros import method_parameters, params_struct
from dpsql.duckdb.sqltext import quote_ident, quote_literal
from dpsql.errors import InvalidParameter
from dpsql.preview import preview

MACRO = "dp_preview"
#: The result's columns and their SQL types, in order.
COLUMNS = (("method", "VARCHAR"), ("n", "BIGINT"), ("epsilon", "DOUBLE"), ("delta", "DOUBLE"), ("notion", "VARCHAR"),
           ("neighbour", "VARCHAR"), ("length", "BIGINT"), ("sd", "DOUBLE"), ("margin", "DOUBLE"), ("noise", "DOUBLE"),
           ("spreading", "DOUBLE"), ("level", "DOUBLE"), ("assumption", "VARCHAR"))


def install(con, context: Context) -> None:
    # ``method`` is the method previewed, so the threshold's choice keeps its registry name here,
    # ``estimator``, as in dpsql.preview
    names = [*method_parameters(exclude=("method", "fresh", "lengths", "level")), "estimator"]

    def plan(method, arguments_json):
        if not isinstance(method, str):
            raise InvalidParameter(f"method must be a method name, got {method!r}")
        arguments = json.loads(arguments_json)
        params = {k: v for k, v in arguments.items() if v is not None and k not in ("n", "lengths", "level")}
        lengths = arguments.get("lengths")
        level = arguments.get("level")
        if arguments.get("n") is None:
            raise InvalidParameter("n (the number of rows to preview) must be a positive integer, got NULL")
        result = preview(method, n=arguments["n"], lengths=lengths, level=0.95 if level is None else level, **params)
        rows = ([(length, result.sd[length], result.margin[length], result.noise[length], result.spreading[length])
                 for length in result.sd] or [(None,) * 5])
        values = ", ".join("(" + ", ".join(_literal(v, t) for v, (_, t) in zip(
            (result.method, result.n, result.epsilon, result.delta, result.notion, result.neighbour, *row,
             result.level, result.assumption), COLUMNS)) + ")" for row in rows)
        return f"SELECT * FROM (VALUES {values}) AS {MACRO}({', '.join(quote_ident(c) for c, _ in COLUMNS)})"

    context.udf(f"dp__plan_{MACRO[3:]}", plan, ["VARCHAR", "VARCHAR"], "VARCHAR")
    defaults = ", ".join(f"{quote_ident(n)} := NULL" for n in names)
    context.macro(f"{MACRO}(method, n, lengths := NULL, level := NULL, {defaults}) AS TABLE "
                  f"FROM query(dp__plan_{MACRO[3:]}(method, {params_struct(['n', 'lengths', 'level', *names])}))")


def _literal(value, sql_type: str) -> str:
    """``value`` as an SQL literal of ``sql_type`` (NULL, text, an integer or a double, infinities included)."""
    if value is None:
        return f"CAST(NULL AS {sql_type})"
    if sql_type == "VARCHAR":
        return quote_literal(str(value))
    if sql_type == "BIGINT":
        return f"CAST({int(value)} AS BIGINT)"
    number = float(value)
    shown = repr(number) if math.isfinite(number) else quote_literal(str(number))
    return f"CAST({shown} AS DOUBLE)"
