"""SQL calls with a misspelt, missing or unquoted parameter: the error names it and lists the valid ones.

DuckDB refuses such a call while binding, before dpsql runs; the connection methods wrapped
by ``register`` (dpsql.duckdb.sql_errors) re-raise its error as one that is both a
``dpsql.InvalidParameter`` and the DuckDB error class."""

import re

import duckdb
import polars as pl
import pytest
from connections import registered

import dpsql
from dpsql.duckdb.sqltext import calls, signature

SOURCE = "'t', 'ts', 'v'"


@pytest.fixture
def budget():
    return dpsql.Budget.in_memory(epsilon=5.0)


@pytest.fixture
def con(budget):
    with registered(budget, "CREATE TABLE t AS SELECT range AS ts, (range % 7)::DOUBLE AS v, range % 3 AS g "
                            "FROM range(200)",
                    "CREATE TABLE ev AS SELECT TIMESTAMP '2024-05-01' + INTERVAL (range) MINUTE AS ts "
                    "FROM range(100)") as con:
        yield con


@pytest.mark.parametrize("call, wrong, right", [
    (f"dp_range_sum({SOURCE}, epsilonn := 1, upper := 5)", "epsilonn", "epsilon"),
    (f"dp_range_sum({SOURCE}, epsilon := 1, uper := 5)", "uper", "upper"),
    (f"dp_range_sum({SOURCE}, epsilon := 1, upper := 5, metod := 'laplace')", "metod", "method"),
    (f"dp_range_sum({SOURCE}, epsilon := 1, upper := 5, partition := 'g')", "partition", "partition_by"),
    ("dp_threshold('t', 'v', epsilon := 1, upper := 5, estimater := 'pak')", "estimater", "method"),
    ("dp_ldp('t', 'ts', 'v', epsilon := 1, w := 4, upper := 5, partition_bye := 'g')", "partition_bye",
     "partition_by"),
    ("dp_count_stream('ev', 'ts', start := '2024-05-01', stop := '2024-05-02', epsilon := 1, contribution := 2)",
     "contribution", "contribution_cap"),
    ("dp_stream_create('s', 'ts', 'v', method := 'laplace', epsilon := 1, upper := 5, lowr := 0)", "lowr", "lower"),
    ("dp_stream_append('s', 't', untill := 3)", "untill", "until"),
    ("dp_preview('laplace', 100, epsilon := 1, upper := 5, lenghts := [1])", "lenghts", "lengths"),
])
def test_a_misspelt_named_parameter_is_named_with_the_valid_ones(con, budget, call, wrong, right):
    macro = call.split("(")[0]
    with pytest.raises(dpsql.InvalidParameter) as caught:
        con.sql(f"SELECT * FROM {call}")
    message = str(caught.value)
    assert f"{macro}() has no parameter {wrong!r} (did you mean {right!r}?)" in message
    assert "It takes " in message and f" {right}" in message
    # every valid name is listed
    assert set(dpsql.duckdb.context.registered(con).signatures[macro].valid) <= set(re.findall(r"[\w]+", message))
    # still a DuckDB error, with DuckDB's own as the cause
    assert isinstance(caught.value, duckdb.BinderException)
    assert isinstance(caught.value.__cause__, duckdb.BinderException)
    assert budget.spent == (0.0, 0.0)


def test_the_scalar_macro_and_every_query_method(con):
    with pytest.raises(dpsql.InvalidParameter, match=r"dp_range_margin\(\) has no parameter 'levl' "
                                                      r"\(did you mean 'level'\?\)"):
        con.execute("SELECT dp_range_margin(1, 2, levl := 0.9)")
    for method in (con.sql, con.query, con.from_query, con.execute):
        with pytest.raises(dpsql.InvalidParameter, match="'epsilonn'"):
            method(f"SELECT * FROM dp_range_sum({SOURCE}, epsilonn := 1)")
    with pytest.raises(dpsql.InvalidParameter, match="'epsilonn'"):
        con.executemany(f"SELECT * FROM dp_range_sum({SOURCE}, epsilonn := ?)", [[1]])


def test_several_misspelt_parameters_are_all_named(con):
    with pytest.raises(dpsql.InvalidParameter, match=r"has no parameters 'epsilonn' \(did you mean 'epsilon'\?\); "
                                                      r"'uper' \(did you mean 'upper'\?\)"):
        con.sql(f"SELECT * FROM dp_range_sum({SOURCE}, epsilonn := 1, uper := 5)")


def test_a_name_with_no_close_match_is_named_without_a_guess(con):
    with pytest.raises(dpsql.InvalidParameter, match=r"has no parameter 'zzz'\. It takes tbl, order_by, value_col"):
        con.sql(f"SELECT * FROM dp_range_sum({SOURCE}, zzz := 1)")


def test_a_missing_positional_argument_is_named(con):
    with pytest.raises(dpsql.InvalidParameter, match=r"dp_range_sum\(\) needs 3 positional argument\(s\), tbl, "
                                                      r"order_by, value_col; missing value_col"):
        con.sql("SELECT * FROM dp_range_sum('t', 'ts', epsilon := 1, upper := 5)")


def test_an_sql_keyword_must_be_quoted(con):
    with pytest.raises(dpsql.InvalidParameter, match=r'dp_count_stream\(\): window is an SQL keyword; quote it to '
                                                      r'pass it by name: "window" := \.\.\.') as caught:
        con.sql("SELECT * FROM dp_count_stream('ev', 'ts', start := '2024-05-01', stop := '2024-05-02', "
                "epsilon := 1, window := 3)")
    assert isinstance(caught.value, duckdb.ParserException)
    # quoted, it is the parameter
    out = con.sql("SELECT dp_window_sum FROM dp_count_stream('ev', 'ts', start := '2024-05-01', "
                  "stop := '2024-05-01 01:00', epsilon := 1, \"window\" := 3)").fetchall()
    assert len(out) == 12


def test_a_name_close_to_an_old_name_is_pointed_to_the_new_name(con):
    with pytest.raises(dpsql.InvalidParameter, match=r"'window_siz' \(did you mean 'window'\?\)"):
        con.sql("SELECT * FROM dp_count_stream('ev', 'ts', start := '2024-05-01', stop := '2024-05-02', "
                "epsilon := 1, window_siz := 3)")
    with pytest.raises(dpsql.InvalidParameter, match=r"'metod' \(did you mean 'method'\?\)"):
        con.sql("SELECT * FROM dp_threshold('t', 'v', metod := 'nm', epsilon := 1, upper := 5)")
    # an old name anywhere is pointed to the name now used (window is ToPS's smoother window here)
    with pytest.raises(dpsql.InvalidParameter, match=r"'window_size' \('window_size' is now called 'window'\)"):
        con.sql(f"SELECT * FROM dp_range_sum({SOURCE}, window_size := 3)")


def test_successful_statements_and_other_errors_are_untouched(con):
    assert con.execute("SELECT 42").fetchall() == [(42,)]
    with pytest.raises(duckdb.CatalogException) as caught:
        con.sql("SELECT * FROM no_such_table")
    assert not isinstance(caught.value, dpsql.DPError)
    with pytest.raises(duckdb.BinderException) as caught:
        con.sql("SELECT no_such_column FROM t")
    assert not isinstance(caught.value, dpsql.DPError)
    # a dpsql error raised inside the release is dpsql's and stays DuckDB's too
    with pytest.raises(duckdb.InvalidInputException, match=r"^epsilon must be > 0") as caught:
        con.sql(f"SELECT * FROM dp_range_sum({SOURCE}, method := 'laplace', epsilon := -1, upper := 5)").fetchall()
    assert isinstance(caught.value, dpsql.InvalidParameter)


def test_connections_that_were_not_registered_are_untouched():
    plain = duckdb.connect()
    plain.execute("CREATE MACRO dp_range_sum(a, b := 1) AS TABLE SELECT a, b")
    with pytest.raises(duckdb.BinderException) as caught:
        plain.sql("SELECT * FROM dp_range_sum(1, epsilonn := 1)")
    assert not isinstance(caught.value, dpsql.DPError)
    plain.close()


def test_python_variables_are_still_found_through_the_wrapped_methods(con):
    def inner():
        local_frame = pl.DataFrame({"ts": [3, 1, 2], "v": [1.0, 2.0, 3.0]})  # noqa: F841 (read by name)
        assert con.sql("SELECT count(*) FROM local_frame").fetchall() == [(3,)]
        assert con.execute("SELECT sum(v) FROM local_frame").fetchall() == [(6.0,)]
        with dpsql.testing.seeded(0):
            return con.sql("SELECT ts FROM dp_range_sum('local_frame', 'ts', 'v', method := 'laplace', "
                           "epsilon := 1, upper := 5)").fetchall()
    assert inner() == [(1,), (2,), (3,)]


def test_calls_are_read_from_sql_text():
    sql = ("WITH x AS (SELECT 1) SELECT * FROM main.dp_range_sum('a,b', 't', \"v\", \"window\" := f(1, 2), "
           "epsilon => 1, note := $$x := 'y'$$) -- dp_range_sum(ignored := 1)\n"
           "JOIN dp_threshold(/* dp_threshold(z := 1) */ 't', 'v')")
    found = list(calls(sql, ["dp_range_sum", "dp_threshold"]))
    assert [c.name for c in found] == ["dp_range_sum", "dp_threshold"]
    assert [a.text for a in found[0].positional] == ["'a,b'", "'t'", '"v"']
    assert [(a.name, a.bare) for a in found[0].named] == [("window", False), ("epsilon", True), ("note", True)]
    assert [a.name for a in found[1].arguments] == [None, None]
    parsed = signature("m(tbl, col, every := INTERVAL '5 minutes', lengths := [1, 24], \"window\" := NULL) AS TABLE "
                       "SELECT 1")
    assert (parsed.positional, parsed.named) == (("tbl", "col"), ("every", "lengths", "window"))
