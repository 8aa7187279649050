"""The Python API refuses a misspelt, old, missing or surplus argument as SQL and Polars do: an
InvalidParameter (never Python's TypeError) naming the closest valid name, before anything is
read or charged; values that are text, or integers float64 cannot hold, are refused before any
charge too. The functions keep their real signatures."""

import inspect
from decimal import Decimal

import duckdb
import numpy as np
import pandas as pd
import polars as pl
import pytest

import dpsql

VALUES = np.arange(5000) % 10.0
#: Every function of the Python API with arguments enough to release ``VALUES`` (budgets aside).
CALLS = {
    dpsql.laplace: {"epsilon": 0.5, "upper": 10.0},
    dpsql.binary_tree: {"epsilon": 0.5, "upper": 10.0},
    dpsql.pak: {"epsilon": 0.5, "upper": 10.0, "delta": 1e-6},
    dpsql.tops: {"epsilon": 0.5, "upper": 10.0},
    dpsql.hierarchy: {"epsilon": 0.5, "upper": 10.0},
    dpsql.threshold: {"epsilon": 0.5, "upper": 10.0},
    dpsql.pegasus: {"epsilon": 0.5},
    dpsql.ldp.capp: {"epsilon": 0.5, "w": 10, "lower": 0.0, "upper": 10.0},
    dpsql.ldp.sw_direct: {"epsilon": 0.5, "w": 10, "lower": 0.0, "upper": 10.0},
    dpsql.ldp.topl: {"epsilon": 0.5, "upper": 10.0},
    dpsql.ldp.pm_direct: {"epsilon": 0.5, "w": 10, "upper": 10.0},
}


def name_of(function) -> str:
    return f"{'dpsql.ldp' if function.__module__.startswith('dpsql.ldp') else 'dpsql'}.{function.__name__}()"


def data_parameter(function) -> str:
    return next(iter(inspect.signature(function).parameters))  # values (counts for PeGaSus)


@pytest.fixture
def budget():
    return dpsql.Budget.in_memory(epsilon=100.0, delta=1e-3)


def refused(call, kind=dpsql.InvalidParameter) -> str:
    with pytest.raises(kind) as caught:
        call()
    assert not isinstance(caught.value, TypeError)
    return str(caught.value)


@pytest.mark.parametrize("function", list(CALLS), ids=name_of)
def test_a_misspelt_parameter_names_the_closest_valid_one(function, budget):
    misspelt = {("eppsilon" if k == "epsilon" else k): v for k, v in CALLS[function].items()}
    message = refused(lambda: function(VALUES, budget=budget, **misspelt))
    assert message.startswith(f"{name_of(function)} has no parameter 'eppsilon' (did you mean 'epsilon'?). "
                              f"Valid parameters: {data_parameter(function)}, epsilon"), message
    assert budget.spent == (0.0, 0.0) and budget.history().height == 0


@pytest.mark.parametrize("function", list(CALLS), ids=name_of)
def test_a_missing_parameter_is_named(function, budget):
    message = refused(lambda: function(VALUES, budget=budget, **{k: v for k, v in CALLS[function].items()
                                                                 if k != "epsilon"}))
    assert message.startswith(f"{name_of(function)} needs epsilon. Valid parameters: "), message
    assert f"needs {data_parameter(function)}." in refused(lambda: function(budget=budget, **CALLS[function]))
    assert budget.spent == (0.0, 0.0)


def test_the_issue_s_calls_in_the_words_sql_and_polars_use(budget):
    """``dpsql.tops(x, uper=...)`` and a missing ``upper``: the same words as SQL's and Polars' refusals."""
    python = refused(lambda: dpsql.tops(VALUES, epsilon=1.0, uper=8000.0, budget=budget))
    polars = refused(lambda: pl.col("v").dpsql.range_sum(order_by="ts", epsilon=1.0, uper=8000.0, budget=budget))
    con = duckdb.connect()
    dpsql.register(con, budget=budget)
    con.execute("CREATE TABLE t AS SELECT range AS ts, 1.0 AS v FROM range(10)")
    sql = refused(lambda: con.sql("SELECT * FROM dp_range_sum('t', 'ts', 'v', epsilon := 1, uper := 8000)"))
    for message in (python, polars, sql):
        assert "has no parameter 'uper' (did you mean 'upper'?)" in message, message
    assert python.startswith("dpsql.tops() has no parameter 'uper'")
    assert refused(lambda: dpsql.tops(VALUES, epsilon=1.0, budget=budget)).startswith("dpsql.tops() needs upper.")
    assert budget.spent == (0.0, 0.0)


def test_surplus_positional_and_repeated_arguments_are_refused(budget):
    message = refused(lambda: dpsql.laplace(VALUES, 0.5, upper=10.0, budget=budget))
    assert message.startswith("dpsql.laplace() takes 1 positional argument(s) (values), got 2: pass the others by "
                              "name"), message
    message = refused(lambda: dpsql.laplace(VALUES, values=VALUES, epsilon=0.5, upper=10.0, budget=budget))
    assert message.startswith("dpsql.laplace(): 'values' given twice"), message
    assert budget.spent == (0.0, 0.0)


def test_old_names_are_renamed_parameters_naming_the_new_one(budget):
    message = refused(lambda: dpsql.threshold(VALUES, epsilon=0.5, upper=10.0, estimator="nm", budget=budget),
                      dpsql.RenamedParameter)
    assert message == "dpsql.threshold(): estimator= is now called method="
    events = pl.DataFrame({"ts": [0.5, 1.5], "user": ["a", "b"]})
    for old, new in (("units", "privacy_unit"), ("cap", "contribution_cap")):  # the names docs/algorithms.md used
        message = refused(lambda old=old: dpsql.count_stream(events, "ts", every=1.0, start=0, stop=2, epsilon=1.0,
                                                             budget=budget, **{old: "user"}), dpsql.RenamedParameter)
        assert message == f"dpsql.count_stream(): {old}= is now called {new}="
    assert budget.spent == (0.0, 0.0)


def test_the_functions_keep_their_signatures_and_still_release(budget):
    parameters = inspect.signature(dpsql.tops).parameters
    assert list(parameters)[:3] == ["values", "epsilon", "upper"]
    assert parameters["upper"].kind is inspect.Parameter.KEYWORD_ONLY
    assert parameters["upper"].default is inspect.Parameter.empty
    assert dpsql.tops.__doc__.startswith("ToPS") and dpsql.tops.__name__ == "tops"
    with dpsql.testing.seeded(0):
        release = dpsql.tops(values=VALUES, epsilon=0.5, upper=10.0, m=100)
        threshold = dpsql.threshold(VALUES, epsilon=0.5, upper=10.0, method="nm", r=4096)
    assert len(release) == len(VALUES) and len(threshold) == 1


@pytest.mark.parametrize("values, words", [
    (np.array(["1.5", "2.5", "3"], dtype=object), "column 'values' must be numeric: row 0 holds str '1.5'"),
    (pd.Series([1.0, "2"], dtype=object), "column 'values' must be numeric: row 1 holds str '2'"),
    (np.array([1.0, 2.0, b"3"], dtype=object), "column 'values' must be numeric: row 2 holds bytes"),
    ([2**64, 1, 2], "column 'values' holds integers beyond 2**53 (row 0: 18446744073709551616)"),
    ([1.5, 2**53 + 1, 2.5], "column 'values' holds integers beyond 2**53 (row 1: 9007199254740993)"),
    (np.array([1, -(2**60) - 1], dtype=object), "column 'values' holds integers beyond 2**53 (row 1: "),
    ([Decimal(2**53 + 1), Decimal("1.5")], "column 'values' holds integers beyond 2**53 (row 0: "),
])
def test_text_and_inexact_integers_are_refused_before_any_charge(budget, values, words):
    for call in (lambda: dpsql.laplace(values, epsilon=0.5, upper=10.0, budget=budget),
                 lambda: dpsql.publish("laplace", values, budget=budget, epsilon=0.5, upper=10.0)):
        message = refused(call, dpsql.InvalidData)
        assert words in message, message
    assert budget.spent == (0.0, 0.0) and budget.history().height == 0


def test_numbers_that_float64_holds_exactly_still_pass(budget):
    with dpsql.testing.seeded(0):
        for values in ([2**53, 0.5, 1], np.array([1, 2.5, Decimal("3.25")], dtype=object), [True, False, 3]):
            assert len(dpsql.laplace(values, epsilon=0.5, upper=10.0)) == 3
