"""DuckDB connections registered with a budget, for the tests of the SQL front end."""

import contextlib

import duckdb

import dpsql


@contextlib.contextmanager
def registered(budget, *statements: str):
    """A new connection registered with ``budget``, after running ``statements``; closed after."""
    con = duckdb.connect()
    dpsql.register(con, budget=budget)
    for statement in statements:
        con.execute(statement)
    yield con
    con.close()
