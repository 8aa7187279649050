"""One vocabulary: the same parameter names, method names and defaults in Python, SQL and Polars
(docs/vocabulary.md); old names are typed errors naming the new ones."""

import datetime as dt
import inspect

import duckdb
import numpy as np
import polars as pl
import pytest

import dpsql
import dpsql.polars
import dpsql.spark
from dpsql import _frontend, methods
from dpsql.duckdb.macros import method_parameters

N = 5000


@pytest.fixture
def budget():
    return dpsql.Budget.in_memory(epsilon=20.0, delta=1e-3)


@pytest.fixture
def con(budget):
    con = duckdb.connect()
    dpsql.duckdb.register(con, budget=budget)
    con.execute(f"CREATE TABLE t AS SELECT range AS ts, (range % 7)::DOUBLE AS v FROM range({N})")
    con.execute("CREATE TABLE ev AS SELECT TIMESTAMP '2024-05-01' + INTERVAL (range * 7) MINUTE AS ts, "
                "range % 2 AS room FROM range(200)")
    yield con
    con.close()


def signature(con, macro):
    return dpsql.duckdb.context.registered(con).signatures[macro]


def events():
    return pl.DataFrame({"ts": [dt.datetime(2024, 5, 1) + dt.timedelta(minutes=7 * i) for i in range(200)],
                         "room": [i % 2 for i in range(200)]})


def test_range_sums_default_to_tops_everywhere(con, budget):
    frame = pl.DataFrame({"ts": np.arange(N), "v": np.arange(N) % 7.0})
    con.sql("SELECT * FROM dp_range_sum('t', 'ts', 'v', epsilon := 1, upper := 10)").fetchall()
    frame.select(pl.col("v").dpsql.range_sum(order_by="ts", epsilon=1.0, upper=10.0, budget=budget))
    assert budget.history()["method"].to_list() == ["tops", "tops"] == [_frontend.RANGE_SUM_METHOD] * 2
    assert inspect.signature(dpsql.polars.range_sum).parameters["method"].default == "tops"
    assert inspect.signature(dpsql.spark.range_sum).parameters["method"].default == "tops"


def test_the_other_defaults_agree(con, budget):
    assert inspect.signature(dpsql.polars.ldp.ldp).parameters["method"].default == _frontend.LDP_METHOD == "capp"
    for count_stream in (dpsql.count_stream, dpsql.spark.count_stream, dpsql.counts.release_event_counts):
        assert inspect.signature(count_stream).parameters["method"].default == _frontend.COUNT_METHOD == "pegasus"
    for threshold in (dpsql.threshold, dpsql.polars.threshold):
        assert inspect.signature(threshold).parameters["method"].default == _frontend.THRESHOLD_ESTIMATOR == "nm"
    # (each release in its own seeded block: one key per block)
    with dpsql.testing.seeded(0):
        (sql,) = con.sql("SELECT threshold FROM dp_threshold('t', 'v', epsilon := 1, upper := 10)").fetchall()[0]
    with dpsql.testing.seeded(0):
        python = dpsql.threshold(np.arange(N) % 7.0, epsilon=1.0, upper=10.0, budget=budget, fresh=True)
    with dpsql.testing.seeded(0):
        polars = pl.DataFrame({"v": np.arange(N) % 7.0}).select(
            pl.col("v").dpsql.threshold(epsilon=1.0, upper=10.0, budget=budget, fresh=True)).item()
    assert sql == python.threshold == polars


def test_the_thresholds_choice_is_method_everywhere(con, budget):
    values = np.arange(N) % 7.0
    with dpsql.testing.seeded(1):
        (sql,) = con.sql("SELECT threshold FROM dp_threshold('t', 'v', method := 'pak', epsilon := 1, "
                         "upper := 10, delta := 1e-6)").fetchall()[0]
    with dpsql.testing.seeded(1):
        python = dpsql.threshold(values, method="pak", epsilon=1.0, upper=10.0, delta=1e-6, budget=budget,
                                 fresh=True)
    with dpsql.testing.seeded(1):
        polars = pl.DataFrame({"v": values}).select(pl.col("v").dpsql.threshold(
            method="pak", epsilon=1.0, upper=10.0, delta=1e-6, budget=budget, fresh=True)).item()
    assert sql == python.threshold == polars
    with dpsql.testing.seeded(1):
        nm = dpsql.threshold(values, method="nm", epsilon=1.0, upper=10.0, budget=budget, fresh=True)
    assert nm.delta == 0 < python.delta  # the choice reached the release
    assert "method" in signature(con, "dp_threshold").valid and "estimator" not in signature(con, "dp_threshold").valid


def test_the_estimators_old_name_is_a_typed_error_naming_method(con, budget):
    values = np.arange(N) % 7.0
    with pytest.raises(dpsql.RenamedParameter, match=r"dpsql\.threshold\(\): estimator= is now called method="):
        dpsql.threshold(values, estimator="pak", epsilon=1.0, upper=10.0, budget=budget)
    with pytest.raises(dpsql.RenamedParameter, match="estimator= is now called method="):
        pl.col("v").dpsql.threshold(estimator="pak", epsilon=1.0, upper=10.0, budget=budget)
    with pytest.raises(dpsql.InvalidParameter,
                       match=r"dp_threshold\(\) has no parameter 'estimator' \('estimator' is now called 'method'\)") \
            as caught:
        con.sql("SELECT * FROM dp_threshold('t', 'v', estimator := 'pak', epsilon := 1, upper := 10)").fetchall()
    assert isinstance(caught.value, duckdb.BinderException) and budget.spent == (0.0, 0.0)


def test_count_methods_are_the_registry_names_everywhere(con, budget):
    assert methods.COUNT_METHODS == ("pegasus", "count_laplace", "count_smoothed")
    with dpsql.testing.seeded(2):
        sql = con.sql("SELECT dp_count FROM dp_count_stream('ev', 'ts', every := INTERVAL '1 hour', "
                      "start := '2024-05-01', stop := '2024-05-02', epsilon := 1, method := 'count_laplace')").pl()
    with dpsql.testing.seeded(2):
        polars = dpsql.count_stream(events(), "ts", every="1h", start="2024-05-01", stop="2024-05-02", epsilon=1.0,
                                    method="count_laplace", budget=budget)
    np.testing.assert_array_equal(sql["dp_count"].to_numpy(), polars["dp_count"].to_numpy())
    assert budget.history()["method"].to_list() == ["count_laplace", "count_laplace"]
    stream = budget.stream("hourly", method="count_laplace", epsilon=1.0, order_by="ts", every="1h",
                           start=dt.datetime(2024, 5, 1))
    assert stream.method == "count_laplace"


def test_the_old_count_method_name_is_a_typed_error_naming_the_new_one(con, budget):
    with pytest.raises(dpsql.RenamedParameter, match="count method 'smoothed' is now called 'count_smoothed'"):
        dpsql.count_stream(events(), "ts", every="1h", start="2024-05-01", stop="2024-05-02", epsilon=1.0,
                           method="smoothed", budget=budget)
    message = "count method 'laplace' is now called 'count_laplace'"
    with pytest.raises(dpsql.RenamedParameter, match=message):
        dpsql.count_stream(events(), "ts", every="1h", start="2024-05-01", stop="2024-05-02", epsilon=1.0,
                           method="laplace", budget=budget)
    with pytest.raises(dpsql.RenamedParameter, match=message), dpsql.duckdb.typed_errors():
        con.sql("SELECT * FROM dp_count_stream('ev', 'ts', start := '2024-05-01', stop := '2024-05-02', "
                "epsilon := 1, method := 'laplace')").fetchall()
    with pytest.raises(dpsql.RenamedParameter, match=message):
        dpsql.spark.count_stream(None, order_by="ts", every="1h", start="2024-05-01", stop="2024-05-02",
                                 partition_by=[], epsilon=1.0, method="laplace", budget=budget)
    assert budget.spent == (0.0, 0.0)


def test_count_streams_take_order_by_and_window(con, budget):
    keywords = inspect.signature(dpsql.count_stream).parameters
    assert "order_by" in keywords and "window" in keywords and "time_column" not in keywords
    assert signature(con, "dp_count_stream").positional == ("tbl", "order_by")
    assert "window" in signature(con, "dp_count_stream").valid
    assert "window_size" not in signature(con, "dp_count_stream").valid
    with dpsql.testing.seeded(3):
        by_name = dpsql.count_stream(events(), order_by="ts", every="1h", start="2024-05-01", stop="2024-05-02",
                                     epsilon=1.0, window=3, budget=budget)
    with dpsql.testing.seeded(3):
        sql = con.sql("SELECT dp_window_sum FROM dp_count_stream('ev', 'ts', every := INTERVAL '1 hour', "
                      "start := '2024-05-01', stop := '2024-05-02', epsilon := 1, \"window\" := 3)").pl()
    np.testing.assert_allclose(by_name["dp_window_sum"].to_numpy(), sql["dp_window_sum"].to_numpy())


def test_old_count_stream_names_are_typed_errors_naming_the_new_ones(con, budget):
    with pytest.raises(dpsql.RenamedParameter, match=r"dpsql\.count_stream\(\): time_column= is now called order_by="):
        dpsql.count_stream(events(), time_column="ts", every="1h", start="2024-05-01", stop="2024-05-02",
                           epsilon=1.0, budget=budget)
    with pytest.raises(dpsql.RenamedParameter, match="time_column= is now called order_by="):
        dpsql.spark.count_stream(None, time_column="ts", every="1h", start="2024-05-01", stop="2024-05-02",
                                 partition_by=[], epsilon=1.0, budget=budget)
    with pytest.raises(dpsql.InvalidParameter, match="dp_count_stream\\(\\) has no parameter 'window_size' "
                                                     "\\('window_size' is now called 'window'\\)"):
        con.sql("SELECT * FROM dp_count_stream('ev', 'ts', start := '2024-05-01', stop := '2024-05-02', "
                "epsilon := 1, window_size := 3)").fetchall()
    assert budget.spent == (0.0, 0.0)


def test_streams_need_a_method_to_be_created_in_every_front_end(con, budget):
    with pytest.raises(dpsql.InvalidParameter, match="pass method, epsilon and order_by"):
        budget.stream("kwh", epsilon=1.0, order_by="ts", value="v", upper=10.0)
    with pytest.raises(dpsql.InvalidParameter, match="pass method, epsilon and order_by"), \
            dpsql.duckdb.typed_errors():
        con.sql("SELECT * FROM dp_stream_create('kwh', 'ts', 'v', epsilon := 1, upper := 10)").fetchall()
    con.sql("SELECT * FROM dp_stream_create('kwh', 'ts', 'v', method := 'laplace', epsilon := 1, "
            "upper := 10)").fetchall()
    # reopened without repeating anything, whatever its method
    (row,) = con.sql("SELECT name, method FROM dp_stream_create('kwh', NULL, NULL)").fetchall()
    assert row == ("kwh", "laplace") and budget.stream("kwh").method == "laplace"


def test_sql_and_polars_accept_the_same_method_parameters(con):
    sql = set(signature(con, "dp_range_sum").valid) - {"tbl", "order_by", "value_col"}
    every_method = set().union(*(methods.parameter_names(m) for m in methods.METHODS)) - {"method", "estimator"}
    assert every_method <= sql
    assert sql - every_method == {"method", "partition_by", "fresh", "note"}
    assert set(method_parameters()) >= every_method
    for method in ("tops", "laplace", "pak"):
        # every parameter the method takes passes Polars' check, and it is a dp_range_sum parameter
        _frontend.check_parameters("x", methods.parameter_names(method), method=method)
        assert set(methods.parameter_names(method)) <= sql


def test_one_name_for_the_order_key(con):
    """The public time key is order_by in every front end: keywords, and SQL's positional parameters."""
    for macro in ("dp_range_sum", "dp_ldp", "dp_count_stream", "dp_stream_create"):
        assert "order_by" in signature(con, macro).positional, macro
    for function in (dpsql.polars.range_sum, dpsql.polars.threshold, dpsql.polars.ldp.ldp, dpsql.count_stream,
                     dpsql.Budget.stream, dpsql.spark.range_sum, dpsql.spark.count_stream, dpsql.polars.window_ci,
                     dpsql.polars.bucket_ci):
        parameters = inspect.signature(function).parameters
        assert "order_by" in parameters, function
        assert not set(_frontend.RENAMED) & set(parameters), function
