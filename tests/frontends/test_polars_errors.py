"""Polars errors: unknown keywords refused when the expression is built; data and budget
errors raised when the query runs reach the caller as the typed dpsql error, naming the
user's column and never Polars' internal expression (``__dpsql_...``)."""

import polars as pl
import pytest

import dpsql
import dpsql.polars
from dpsql.errors import BudgetExhausted, InvalidData, InvalidParameter, InvalidTimeKey

PARAMS = {"method": "laplace", "epsilon": 0.5, "upper": 10.0}


@pytest.fixture
def budget():
    return dpsql.Budget.in_memory(epsilon=1.0)


def frame(**columns):
    base = {"ts": [3, 1, 2, 4], "kwh": [2.0, 1.0, 5.0, 3.0], "meter": ["a", "a", "b", "b"]}
    return pl.DataFrame({**base, **columns})


def run(mode, data, expr):
    if mode == "eager":
        return data.with_columns(expr.alias("out"))
    if mode == "select":
        return data.select(expr)
    engine = "streaming" if mode == "streaming" else "auto"
    return data.lazy().with_columns(expr.alias("out")).collect(engine=engine)


MODES = ["eager", "select", "lazy", "streaming"]


def assert_clean(error, column, *fragments):
    message = str(error)
    assert "__dpsql" not in message and "python_udf" not in message and "as_struct" not in message, message
    assert repr(column) in message, message
    for fragment in fragments:
        assert fragment in message, message


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("data, kind, fragment", [
    (frame(kwh=[2.0, float("nan"), 5.0, 3.0]), InvalidData, "contains NaN"),
    (frame(kwh=[2.0, None, 5.0, 3.0]), InvalidData, "null value"),
    (frame(kwh=["a", "b", "c", "d"]), InvalidData, "must be numeric"),
    (frame(ts=[1, 1, 2, 3]), InvalidTimeKey, "duplicate value 1"),
    (frame(ts=[1, None, 2, 3]), InvalidTimeKey, "order column 'ts' contains 1 NULL value(s)"),
    (frame(ts=[1.0, float("nan"), 2.0, 3.0]), InvalidTimeKey, "order column 'ts' contains NaN"),
])
def test_bad_data_is_the_typed_error_naming_the_column(budget, mode, data, kind, fragment):
    with pytest.raises(kind) as caught:
        run(mode, data, pl.col("kwh").dpsql.range_sum(order_by="ts", budget=budget, **PARAMS))
    assert_clean(caught.value, "kwh" if kind is InvalidData else "ts", fragment)
    assert budget.spent == (0.0, 0.0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("params, fragment", [
    ({"method": "laplace", "epsilon": -1.0, "upper": 10.0}, "epsilon must be > 0"),
    ({"method": "laplace", "epsilon": 0.5, "upper": 10.0, "lower": 20.0}, "lower"),
    ({"method": "tops", "epsilon": 0.5, "upper": 10.0}, "m (hold-out length) must be < the number of values (4)"),
])
def test_parameters_refused_at_run_time_name_the_column(budget, mode, params, fragment):
    with pytest.raises(InvalidParameter) as caught:
        run(mode, frame(), pl.col("kwh").dpsql.range_sum(order_by="ts", budget=budget, **params))
    assert_clean(caught.value, "kwh", fragment, ".dpsql.range_sum() of column 'kwh': ")


@pytest.mark.parametrize("mode", MODES)
def test_a_budget_refusal_is_budget_exhausted_with_its_amounts(mode):
    small = dpsql.Budget.in_memory(epsilon=0.1)
    with pytest.raises(BudgetExhausted) as caught:
        run(mode, frame(), pl.col("kwh").dpsql.range_sum(order_by="ts", budget=small, **PARAMS))
    assert_clean(caught.value, "kwh")
    assert caught.value.requested == (0.5, 0.0) and caught.value.remaining == (0.1, 0.0)
    assert small.spent == (0.0, 0.0)


def test_the_column_is_the_users_name_for_an_expression(budget):
    data = frame(kwh=[2.0, float("nan"), 5.0, 3.0])
    with pytest.raises(InvalidParameter) as caught:
        data.select(pl.col("kwh").fill_nan(0.0).dpsql.range_sum(order_by="ts", budget=budget, method="laplace",
                                                                  epsilon=-1.0, upper=1.0))
    assert_clean(caught.value, "kwh", "epsilon must be > 0")


def test_the_eager_error_is_the_clean_error_itself(budget):
    """Eager Polars rebuilds the exception from its type: it is the dpsql class exactly."""
    with pytest.raises(InvalidData) as caught:
        frame(kwh=[2.0, float("nan"), 5.0, 3.0]).select(pl.col("kwh").dpsql.range_sum(order_by="ts", budget=budget,
                                                                                      **PARAMS))
    assert type(caught.value) is InvalidData


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_threshold_and_ldp_errors_are_clean_too(mode):
    with pytest.raises(InvalidData) as caught:
        run(mode, frame(kwh=[2.0, float("nan"), 5.0, 3.0]),
            pl.col("kwh").dpsql.threshold(epsilon=1.0, upper=10.0, budget=dpsql.Budget.in_memory(epsilon=1)))
    assert_clean(caught.value, "kwh", "contains NaN")
    ldp_budget = dpsql.Budget.in_memory(epsilon=1.0, notion="w-event-ldp", w=2)
    with pytest.raises(InvalidParameter) as caught:
        run(mode, frame(), pl.col("kwh").dpsql.ldp(method="ipp", order_by="ts", partition_by="meter", epsilon=1.0,
                                                   w=2, lower=5.0, upper=1.0, budget=ldp_budget))
    assert_clean(caught.value, "kwh", ".dpsql.ldp() of column 'kwh'")


@pytest.mark.parametrize("call, wrong, right", [
    (lambda: pl.col("kwh").dpsql.range_sum(order_by="ts", epsilonn=1.0, upper=1.0), "epsilonn", "epsilon"),
    (lambda: pl.col("kwh").dpsql.range_sum(order_byy="ts", epsilon=1.0, upper=1.0), "order_byy", "order_by"),
    (lambda: pl.col("kwh").dpsql.range_sum(order_by="ts", partition="meter", epsilon=1.0, upper=1.0), "partition",
     "partition_by"),
    (lambda: pl.col("kwh").dpsql.range_sum(order_by="ts", method="laplace", epsilon=1.0, uper=1.0), "uper",
     "upper"),
    (lambda: pl.col("kwh").dpsql.threshold(epsilon=1.0, upper=1.0, estimater="pak"), "estimater", "method"),
    (lambda: pl.col("kwh").dpsql.ldp(order_by="ts", partition_by="meter", epsilon=1.0, w=2, lower=0.0, upper=1.0,
                                     progres=False), "progres", "progress"),
])
def test_an_unknown_keyword_is_refused_when_the_expression_is_built(call, wrong, right):
    with pytest.raises(InvalidParameter) as caught:
        call()
    message = str(caught.value)
    assert f"has no parameter {wrong!r} (did you mean {right!r}?)" in message
    assert "Valid parameters: " in message and right in message.split("Valid parameters: ")[1].split(", ")


def test_the_valid_list_has_the_front_end_keywords_and_the_methods_parameters():
    with pytest.raises(InvalidParameter) as caught:
        pl.col("kwh").dpsql.range_sum(order_by="ts", method="laplace", bogus=1)
    valid = str(caught.value).split("Valid parameters: ")[1].split(", ")
    assert valid == ["order_by", "method", "partition_by", "budget", "note", "errors", "fresh", "delta", "epsilon",
                     "lower", "upper"]


def test_order_by_is_required(budget):
    with pytest.raises(InvalidParameter, match=r"\.dpsql\.range_sum\(\) needs order_by"):
        pl.col("kwh").dpsql.range_sum(budget=budget, **PARAMS)


def test_group_wise_evaluation_is_refused_cleanly(budget):
    with pytest.raises(InvalidParameter) as caught:
        frame().select(pl.col("kwh").dpsql.range_sum(order_by="ts", budget=budget, **PARAMS).over("meter"))
    assert_clean(caught.value, "kwh", "Pass partition_by=")
