"""Refusals made while an SQL statement runs (an exhausted budget, NaN values, a repeated time
key, an unknown row handle) reach the user as the dpsql error class and DuckDB's, with dpsql's
message only, whichever way the statement is run or read; nothing is charged."""

import duckdb
import numpy as np
import polars as pl
import pytest
from connections import registered

import dpsql

LAPLACE = "method := 'laplace', epsilon := {epsilon}, upper := 10"
INTERNAL = ("dp__result", "exporting a stream", "Invalid Input Error", "registered as", "Python exception")


@pytest.fixture
def budget():
    return dpsql.Budget.in_memory(epsilon=1.0)


@pytest.fixture
def con(budget):
    with registered(budget, "CREATE TABLE hourly AS SELECT range AS ts, (range % 7)::DOUBLE AS volume FROM range(500)",
                    "CREATE TABLE broken AS SELECT range AS ts, CASE WHEN range = 30 THEN 'nan'::DOUBLE ELSE 1.0 END "
                    "AS volume FROM range(500)",
                    "CREATE TABLE repeated AS SELECT range // 2 AS ts, 1.0 AS volume FROM range(500)") as con:
        yield con


def release(table: str, epsilon: float = 0.5) -> str:
    return f"SELECT * FROM dp_range_sum('{table}', 'ts', 'volume', {LAPLACE.format(epsilon=epsilon)})"


#: Every way a user runs a statement or reads a relation.
READS = {
    "sql().fetchall()": lambda con, q: con.sql(q).fetchall(),
    "sql().pl()": lambda con, q: con.sql(q).pl(),
    "sql().df()": lambda con, q: con.sql(q).df(),
    "sql().to_arrow_table()": lambda con, q: con.sql(q).to_arrow_table(),
    "sql().to_arrow_reader()": lambda con, q: con.sql(q).to_arrow_reader().read_all(),
    "sql().show()": lambda con, q: con.sql(q).show(),
    "print(sql())": lambda con, q: print(con.sql(q)),
    "len(sql())": lambda con, q: len(con.sql(q)),
    "pl.DataFrame(sql())": lambda con, q: pl.DataFrame(con.sql(q)),
    "sql().create()": lambda con, q: con.sql(q).create("copied"),
    "sql(CREATE TABLE AS)": lambda con, q: con.sql(f"CREATE TABLE copied AS {q}"),
    "execute()": lambda con, q: con.execute(q).fetchall(),
    "execute(CREATE TABLE AS)": lambda con, q: con.execute(f"CREATE TABLE copied AS {q}"),
    "query().fetchall()": lambda con, q: con.query(q).fetchall(),
}


@pytest.mark.parametrize("read", list(READS))
def test_the_readme_promise_as_a_user_writes_it(con, budget, read):
    try:
        READS[read](con, release("hourly", epsilon=5.0))
    except dpsql.BudgetExhausted as refusal:
        caught = refusal
    else:
        pytest.fail("an overspending release ran")
    assert isinstance(caught, duckdb.Error) and isinstance(caught, duckdb.InvalidInputException)
    assert caught.requested == (5.0, 0.0) and caught.remaining == (1.0, 0.0)
    message = str(caught)
    assert message.startswith("budget exhausted in scope 'default'"), message
    assert not any(word in message for word in INTERNAL), message
    assert caught.__cause__ is None and caught.__suppress_context__
    assert budget.spent == (0.0, 0.0) and budget.history().height == 0


def test_the_message_is_the_one_every_front_end_gives(con, budget):
    with pytest.raises(dpsql.BudgetExhausted) as from_sql:
        con.sql(release("hourly", epsilon=5.0)).fetchall()
    with pytest.raises(dpsql.BudgetExhausted) as from_python:
        dpsql.laplace(np.ones(500), epsilon=5.0, upper=10.0, budget=budget)
    assert str(from_sql.value) == str(from_python.value)
    assert type(from_sql.value).__name__ == "BudgetExhausted"
    assert f"{type(from_sql.value).__module__}.{type(from_sql.value).__qualname__}" == "dpsql.errors.BudgetExhausted"


@pytest.mark.parametrize("read", ["sql().fetchall()", "sql().pl()", "execute()", "sql(CREATE TABLE AS)"])
@pytest.mark.parametrize("table, kind, words", [
    ("broken", dpsql.InvalidData, "column 'volume' contains NaN values (1 non-finite, first at row 30)"),
    ("repeated", dpsql.InvalidTimeKey, "order column 'ts' has duplicate value 0"),
])
def test_bad_data_is_the_typed_error_with_dpsql_message_only(con, budget, read, table, kind, words):
    with pytest.raises(kind) as caught:
        READS[read](con, release(table))
    assert isinstance(caught.value, duckdb.Error)
    assert words in str(caught.value) and not any(word in str(caught.value) for word in INTERNAL)
    assert budget.spent == (0.0, 0.0)


def test_a_refused_error_bar_is_typed_too(con):
    with dpsql.testing.seeded(0):
        con.execute(f"CREATE TABLE released AS {release('hourly')}")
    with pytest.raises(dpsql.UnknownRelease) as caught:
        con.sql("SELECT dp_range_variance(dp_row + 10000000, dp_row + 10000001) FROM released").fetchall()
    assert isinstance(caught.value, duckdb.Error)
    assert not any(word in str(caught.value) for word in INTERNAL)


def test_a_catch_all_for_duckdb_errors_still_catches_them(con, budget):
    try:
        con.sql(release("hourly", epsilon=5.0)).fetchall()
    except duckdb.Error as error:
        assert isinstance(error, dpsql.BudgetExhausted)
    else:
        pytest.fail("an overspending release ran")
    # the release runs once the budget allows it, on the same connection
    with dpsql.testing.seeded(0):
        assert len(con.sql(release("hourly")).fetchall()) == 500
    assert budget.spent == (0.5, 0.0)
