"""SQL ``dp_preview``: the Python preview's numbers, one row per window length, nothing charged, no table read."""

import duckdb
import pytest

import dpsql

COLUMNS = ["method", "n", "epsilon", "delta", "notion", "neighbour", "length", "sd", "margin", "noise", "spreading",
           "level", "assumption"]


@pytest.fixture
def budget():
    return dpsql.Budget.in_memory(epsilon=1.0, delta=1e-5)


@pytest.fixture
def con(budget):
    con = duckdb.connect()
    dpsql.duckdb.register(con, budget=budget)
    yield con
    con.close()


def rows(con, sql):
    relation = con.sql(sql)
    return [dict(zip(relation.columns, row)) for row in relation.fetchall()]


@pytest.mark.parametrize("method, params, sql_params", [
    ("laplace", {"epsilon": 1.0, "upper": 10.0}, "epsilon := 1, upper := 10"),
    ("tops", {"epsilon": 0.5, "upper": 50.0}, "epsilon := 0.5, upper := 50"),
    ("binary_tree", {"epsilon": 1.0, "upper": 5.0, "lower": 1.0}, "epsilon := 1, upper := 5, lower := 1"),
    ("pak", {"epsilon": 1.0, "upper": 10.0, "delta": 1e-6}, "epsilon := 1, upper := 10, delta := 1e-6"),
    ("pegasus", {"epsilon": 1.0}, "epsilon := 1"),
])
def test_sql_preview_equals_the_python_preview(con, budget, method, params, sql_params):
    expected = dpsql.preview(method, n=100_000, **params)
    got = rows(con, f"SELECT * FROM dp_preview('{method}', 100000, {sql_params})")
    assert [row["length"] for row in got] == list(expected.sd) == [1, 24, 168]
    for row in got:
        assert (row["method"], row["n"], row["epsilon"], row["delta"]) == (method, 100_000, expected.epsilon,
                                                                          expected.delta)
        assert (row["notion"], row["neighbour"], row["assumption"]) == (expected.notion, expected.neighbour,
                                                                        expected.assumption)
        assert row["sd"] == expected.sd[row["length"]] and row["margin"] == expected.margin[row["length"]]
        assert (row["noise"], row["spreading"]) == (expected.noise[row["length"]], expected.spreading[row["length"]])
        assert row["level"] == 0.95
    assert budget.spent == (0.0, 0.0) and budget.history().height == 0


def test_columns_lengths_and_level(con):
    relation = con.sql("SELECT * FROM dp_preview('laplace', 50, epsilon := 1, upper := 10, lengths := [1, 10, 100], "
                       "level := 0.9)")
    assert relation.columns == COLUMNS
    assert [str(t) for t in relation.types] == ["VARCHAR", "BIGINT", "DOUBLE", "DOUBLE", "VARCHAR", "VARCHAR",
                                                "BIGINT", "DOUBLE", "DOUBLE", "DOUBLE", "DOUBLE", "DOUBLE", "VARCHAR"]
    got = rows(con, "SELECT length, margin, level FROM dp_preview('laplace', 50, epsilon := 1, upper := 10, "
                    "lengths := [1, 10, 100], level := 0.9)")
    expected = dpsql.preview("laplace", n=50, lengths=[1, 10, 100], level=0.9, epsilon=1.0, upper=10.0)
    assert [(r["length"], r["margin"], r["level"]) for r in got] == [(k, expected.margin[k], 0.9) for k in (1, 10)]


def test_a_method_without_range_sums_gives_one_row_of_cost(con):
    (row,) = rows(con, "SELECT * FROM dp_preview('threshold', 1000, epsilon := 0.5, upper := 10)")
    assert (row["epsilon"], row["length"], row["sd"], row["margin"], row["noise"], row["spreading"]) == (
        0.5, None, None, None, None, None)


def test_preview_reads_no_table_and_charges_nothing(con, budget):
    con.execute("CREATE TABLE t AS SELECT range AS ts, 1.0 AS v FROM range(10)")
    # no table argument at all, and a preview joined with a release is still only the release's charge
    with dpsql.testing.seeded(0):
        con.sql("SELECT p.sd, r.v FROM dp_preview('laplace', 10, epsilon := 0.25, upper := 1, lengths := [1]) p, "
                "dp_range_sum('t', 'ts', 'v', method := 'laplace', epsilon := 0.25, upper := 1) r").fetchall()
    assert budget.spent == (0.25, 0.0)
    for _ in range(3):
        con.sql("SELECT * FROM dp_preview('tops', 1000000, epsilon := 1, upper := 100)").fetchall()
    assert budget.spent == (0.25, 0.0) and budget.history().height == 1


@pytest.mark.parametrize("sql, message", [
    ("dp_preview('nope', 100, epsilon := 1)", "unknown method 'nope'"),
    ("dp_preview('laplace', 0, epsilon := 1, upper := 1)", "n must be >= 1"),
    ("dp_preview('laplace', 'many', epsilon := 1, upper := 1)", "n must be an integer"),
    ("dp_preview('laplace', NULL, epsilon := 1, upper := 1)", "n (the number of rows to preview)"),
    ("dp_preview('laplace', 100, epsilon := -1, upper := 1)", "epsilon must be > 0"),
    ("dp_preview('tops', 100000, epsilon := 1)", "missing required parameter(s) 'upper'"),
    ("dp_preview('laplace', 100, epsilon := 1, upper := 1, level := 1.5)", "level"),
    ("dp_preview('laplace', 100, epsilon := 1, upper := 1, lengths := [0])", "lengths must be >= 1"),
])
def test_bad_previews_are_typed_errors_naming_the_problem(con, budget, sql, message):
    with pytest.raises(dpsql.InvalidParameter, match=message.replace("(", r"\(").replace(")", r"\)")), \
            dpsql.duckdb.typed_errors():
        con.sql(f"SELECT * FROM {sql}").fetchall()
    assert budget.spent == (0.0, 0.0)


def test_a_misspelt_preview_parameter_is_named(con):
    with pytest.raises(dpsql.InvalidParameter, match=r"dp_preview\(\) has no parameter 'uper' \(did you mean "
                                                      r"'upper'\?\)") as caught:
        con.sql("SELECT * FROM dp_preview('laplace', 100, epsilon := 1, uper := 1)")
    assert "It takes method, n (in this order)" in str(caught.value)


def test_sql_preview_on_a_grid_shows_days_without_spreading(con):
    got = rows(con, "SELECT length, margin, noise, spreading FROM dp_preview('hierarchy', 48204, epsilon := 1, "
                    "upper := 8000, grid := ['2012-10-02 09:00', '1h'], lengths := [24, 30])")
    expected = dpsql.preview("hierarchy", n=48204, epsilon=1.0, upper=8000.0, grid=("2012-10-02 09:00", "1h"),
                             lengths=[24, 30])
    assert [(r["length"], r["noise"], r["spreading"]) for r in got] == [
        (k, expected.noise[k], expected.spreading[k]) for k in (24, 30)]
    assert got[0]["spreading"] == 0.0 < got[1]["spreading"] and got[0]["margin"] == got[0]["noise"]
