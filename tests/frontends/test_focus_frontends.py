"""``focus=`` (what ToPS's threshold is for) in every front end: SQL, Polars and continual streams
take it and release what the Python API releases for it; a misspelt focus is refused naming the
closest valid one, before anything is charged."""

from __future__ import annotations

import duckdb
import numpy as np
import polars as pl
import pytest

import dpsql
import dpsql.duckdb
import dpsql.polars
from dpsql.testing import seeded

N = 30_000
RANGE_SUM = ("SELECT v FROM dp_range_sum('t', 'ts', 'v', method := 'tops', epsilon := 0.5, upper := 1000, "
             "focus := '{}')")
STREAM = ("SELECT * FROM dp_stream_create('s', 'ts', 'v', method := 'tops', epsilon := 0.5, upper := 1000, "
          "focus := '{}')")


def _frame() -> pl.DataFrame:
    rng = np.random.default_rng(3)
    return pl.DataFrame({"ts": np.arange(N), "v": np.minimum(rng.lognormal(1.0, 1.3, N), 1000.0)})


def _connection(budget):
    con = duckdb.connect()
    dpsql.duckdb.register(con, budget=budget)
    con.from_arrow(_frame().to_arrow()).create("t")
    return con


def _polars(focus, budget):
    return _frame().lazy().select(dpsql.polars.range_sum(pl.col("v"), order_by="ts", method="tops", epsilon=0.5,
                                                         upper=1000.0, focus=focus, budget=budget)).collect()["v"]


def test_one_shot_releases_in_sql_and_polars_are_the_python_release_for_the_focus():
    values = _frame()["v"].to_numpy()
    budget = dpsql.Budget.in_memory(epsilon=10.0)
    con = _connection(budget)
    thresholds = {}
    for focus in ("windows", "long"):
        with seeded(4):
            expected = dpsql.publish("tops", values, epsilon=0.5, upper=1000.0, focus=focus)
        thresholds[focus] = expected.threshold
        with seeded(4):
            sql = con.sql(RANGE_SUM.format(focus)).fetchnumpy()["v"]
        np.testing.assert_array_equal(sql, expected.values)
        with seeded(4):
            np.testing.assert_array_equal(_polars(focus, budget).to_numpy(), expected.values)
    assert thresholds["windows"] < thresholds["long"]  # the focus decides: long ranges clip less


def test_a_stream_created_in_sql_keeps_its_focus_and_is_the_python_stream():
    budget, other = dpsql.Budget.in_memory(epsilon=10.0), dpsql.Budget.in_memory(epsilon=10.0)
    con = _connection(budget)
    with seeded(5):
        con.sql(STREAM.format("windows")).fetchall()
    released = con.sql("SELECT * FROM dp_stream_append('s', 't')").pl()
    with seeded(5):
        python = other.stream("s", method="tops", epsilon=0.5, order_by="ts", value="v", upper=1000.0,
                              focus="windows")
    python.append(_frame())
    assert budget.stream("s").params["focus"] == python.params["focus"] == "windows"
    np.testing.assert_array_equal(released["v"].to_numpy(), python.released()["v"].to_numpy())


CALLS = {
    "python tops": lambda budget: dpsql.tops(_frame()["v"].to_numpy(), epsilon=0.5, upper=1000.0, focus="windos",
                                             budget=budget),
    "python threshold": lambda budget: dpsql.threshold(_frame()["v"].to_numpy(), epsilon=0.5, upper=1000.0,
                                                       focus="windos", budget=budget),
    "python stream": lambda budget: budget.stream("s", method="tops", epsilon=0.5, order_by="ts", value="v",
                                                  upper=1000.0, focus="windos"),
    "sql range sum": lambda budget: _connection(budget).sql(RANGE_SUM.format("windos")).fetchall(),
    "sql stream": lambda budget: _connection(budget).sql(STREAM.format("windos")).fetchall(),
    "polars": lambda budget: _polars("windos", budget),
}


@pytest.mark.parametrize("front_end", CALLS)
def test_a_misspelt_focus_is_refused_naming_the_closest_and_charges_nothing(front_end):
    budget = dpsql.Budget.in_memory(epsilon=10.0)
    with pytest.raises(dpsql.InvalidParameter, match=r"unknown focus 'windos' \(did you mean 'windows'\?\); "
                                                     r"expected one of 'mixed', 'windows', 'long', 'paper'"), \
            dpsql.duckdb.typed_errors():
        CALLS[front_end](budget)
    assert budget.spent == (0.0, 0.0) and budget.history().is_empty()
