"""SQL sources: tables, views, files, queries as text and data-frame variables work; what only
the calling connection sees (TEMP tables and views, CTEs, con.register) is refused with what to do instead."""

import re

import duckdb
import numpy as np
import polars as pl
import pytest
from connections import registered

import dpsql

LAPLACE = "method := 'laplace', epsilon := 0.5, upper := 10"


@pytest.fixture
def budget():
    return dpsql.Budget.in_memory(epsilon=10.0)


@pytest.fixture
def con(budget):
    with registered(budget, "CREATE TABLE t AS SELECT range AS ts, (range % 7)::DOUBLE AS v, range % 2 AS g "
                            "FROM range(100)") as con:
        yield con


def released(con, source, extra=""):
    with dpsql.testing.seeded(3):
        return con.sql(f"SELECT ts, v FROM dp_range_sum({source}, 'ts', 'v', {LAPLACE}{extra})").fetchall()


def test_a_query_as_text_is_a_source(con, budget):
    view = "CREATE VIEW even AS SELECT ts, v FROM t WHERE g = 0"
    con.execute(view)
    by_view = released(con, "'even'")
    for text in ["'SELECT ts, v FROM t WHERE g = 0'", "'  select ts, v from t where g = 0;'",
                 "'(SELECT ts, v FROM t WHERE g = 0)'", "'WITH e AS (SELECT * FROM t WHERE g = 0) SELECT ts, v FROM e'",
                 "'FROM t SELECT ts, v WHERE g = 0'"]:
        assert released(con, text) == by_view, text
    assert len(by_view) == 50
    # identical data and call: answered from the ledger, charged once
    assert budget.spent == (0.5, 0.0)


def test_a_query_over_something_invisible_says_what_to_do(con, budget):
    con.execute("CREATE TEMP TABLE scratch AS SELECT * FROM t")
    expected = ("tbl query 'SELECT ts, v FROM scratch' cannot be read: Catalog Error: Table with name scratch does not "
                "exist. dpsql reads its input through a second connection, which sees regular tables and views only")
    with pytest.raises(dpsql.InvalidParameter, match=re.escape(expected)), dpsql.duckdb.typed_errors():
        released(con, "'SELECT ts, v FROM scratch'")
    assert budget.spent == (0.0, 0.0)


def test_a_subquery_argument_is_refused_with_a_pointer_to_query_text(con):
    # DuckDB's table functions take no subquery argument: the error says to pass the query as text
    expected = ("dp_range_sum() takes no subquery as an argument: pass the query as text instead, "
                "dp_range_sum('SELECT ts, v FROM t WHERE g = 0', ...)")
    with pytest.raises(dpsql.InvalidParameter, match=re.escape(expected)) as caught:
        released(con, "(SELECT ts, v FROM t WHERE g = 0)")
    assert isinstance(caught.value, duckdb.BinderException)


@pytest.mark.parametrize("create, kind, advice", [
    ("CREATE TEMP TABLE tmp AS SELECT * FROM t", "a TEMP table of this connection",
     'create it as a regular table (CREATE TABLE "tmp" AS ...)'),
    ("CREATE TEMP VIEW tmp AS SELECT * FROM t", "a TEMP view of this connection",
     'create it as a regular view (CREATE VIEW "tmp" AS ...)'),
])
def test_temp_tables_and_views_are_refused_with_what_to_do(con, budget, create, kind, advice):
    con.execute(create)
    with pytest.raises(dpsql.InvalidParameter) as caught:
        released(con, "'tmp'")
    message = str(caught.value)
    assert message.startswith(f"tbl 'tmp' is {kind}. dpsql reads its input through a second connection, which "
                              "cannot see it;")
    assert advice in message and "pass the query that fills it as the text of tbl" in message
    assert isinstance(caught.value, duckdb.InvalidInputException) and budget.spent == (0.0, 0.0)
    # what the message says works
    con.execute("CREATE TABLE tmp_regular AS SELECT * FROM tmp")
    assert len(released(con, "'tmp_regular'")) == 100


def test_a_cte_is_refused_with_what_to_do(con, budget):
    with pytest.raises(dpsql.InvalidParameter, match=r"tbl 'recent' is a common table expression of this statement "
                                                      r"\(WITH recent AS \.\.\.\)\. .*pass its query as the text of "
                                                      r"tbl \('SELECT \.\.\. FROM \.\.\.', over regular tables\) "
                                                      r"instead"):
        con.sql("WITH recent AS (SELECT * FROM t WHERE ts >= 50) SELECT * FROM dp_range_sum('recent', 'ts', 'v', "
                f"{LAPLACE})")
    assert budget.spent == (0.0, 0.0)
    # the advice, followed
    with dpsql.testing.seeded(3):
        out = con.sql(f"SELECT * FROM dp_range_sum('SELECT * FROM t WHERE ts >= 50', 'ts', 'v', {LAPLACE})").fetchall()
    assert len(out) == 50


def test_an_object_registered_on_the_connection_is_refused_with_what_to_do(con, budget):
    frame = pl.DataFrame({"ts": np.arange(10), "v": np.ones(10)})
    con.register("registered_frame", frame)
    with pytest.raises(dpsql.InvalidParameter, match=r"tbl 'registered_frame' is registered on this connection only "
                                                      r"\(con\.register\(\)\)\. .*pass the data frame by its Python "
                                                      r"variable name instead"):
        released(con, "'registered_frame'")
    # the advice, followed: the variable's name (looked up in the calling frame, as DuckDB does)
    with dpsql.testing.seeded(3):
        out = con.sql(f"SELECT * FROM dp_range_sum('frame', 'ts', 'v', {LAPLACE})").fetchall()
    assert len(out) == 10


def test_a_missing_source_keeps_the_generic_message(con):
    with pytest.raises(dpsql.InvalidParameter, match="tbl 'nowhere' not found: expected a table or view, a file path, "
                                                      "a query"), dpsql.duckdb.typed_errors():
        released(con, "'nowhere'")


def test_files_and_views_still_work(con, tmp_path):
    path = tmp_path / "readings.parquet"
    con.execute(f"COPY t TO '{path}' (FORMAT parquet)")
    con.execute("CREATE VIEW all_rows AS SELECT * FROM t")
    assert released(con, f"'{path}'") == released(con, "'all_rows'") == released(con, "'t'")
