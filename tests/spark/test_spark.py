"""Spark releases on local[2]: charged once on the driver, released per partition on executors,
equal to the local partition_by release, identical when re-executed."""

from __future__ import annotations

import datetime as dt

import numpy as np
import polars as pl
import pytest

import dpsql

pyspark = pytest.importorskip("pyspark", reason="pyspark is not installed (pip install 'dpsql[spark]')")
spark_dp = pytest.importorskip("dpsql.spark")


@pytest.fixture(scope="module")
def spark():
    import shutil

    if shutil.which("java") is None:
        pytest.skip("no Java runtime on PATH: Spark cannot start")
    from pyspark.sql import SparkSession

    session = (SparkSession.builder.master("local[2]").appName("dpsql-tests")
               .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "4")
               .config("spark.sql.session.timeZone", "UTC").getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


def _readings(n=6000, meters=5, seed=0) -> pl.DataFrame:
    rng = np.random.default_rng(seed)
    return pl.DataFrame({"meter": rng.integers(0, meters, n), "ts": rng.permutation(n),
                         "kwh": np.round(rng.gamma(2.0, 5.0, n), 3)})


@pytest.mark.parametrize(("method", "params"), [("tops", {"upper": 100.0, "m": 200, "r": 1024}),
                                                ("hierarchy", {"upper": 60.0, "r": 512}),
                                                ("laplace", {"upper": 60.0})])
def test_a_spark_release_equals_the_local_partitioned_release(spark, method, params):
    frame = _readings()
    with dpsql.testing.seeded(3):
        local = frame.with_columns(pl.col("kwh").dpsql.range_sum(method=method, order_by="ts", partition_by="meter",
                                                                 epsilon=1.0, **params).alias("dp"))
    with dpsql.testing.seeded(3):
        out = spark_dp.range_sum(spark.createDataFrame(frame.to_pandas()), order_by="ts", value="kwh",
                                 partition_by="meter", method=method, epsilon=1.0, **params)
    got = pl.from_pandas(out.toPandas()).sort("meter", "ts")
    expected = local.sort("meter", "ts")
    assert got["kwh"].to_list() == expected["dp"].to_list()


def test_charged_once_on_the_driver_and_identical_when_re_executed(spark):
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    df = spark.createDataFrame(_readings(seed=1).to_pandas())
    out = spark_dp.range_sum(df, order_by="ts", value="kwh", partition_by="meter", epsilon=0.5, upper=60.0,
                             m=100, budget=budget)
    assert budget.spent == (0.5, 0.0)  # before any task ran
    first = out.orderBy("meter", "ts").toPandas()["kwh"].to_numpy()
    second = out.repartition(3).orderBy("meter", "ts").toPandas()["kwh"].to_numpy()
    assert np.array_equal(first, second) and budget.spent == (0.5, 0.0)
    assert budget.history()["method"].to_list() == ["tops"]
    assert budget.history()["source"].to_list() == ["Spark columns meter, ts, kwh"]


def test_spark_count_streams_equal_the_local_ones(spark):
    rng = np.random.default_rng(4)
    times = [dt.datetime(2024, 1, 1) + dt.timedelta(minutes=int(m)) for m in rng.integers(0, 24 * 60, 3000)]
    events = pl.DataFrame({"ts": times, "ap": rng.integers(0, 3, 3000)})
    grid = dict(every="1h", start=dt.datetime(2024, 1, 1), stop=dt.datetime(2024, 1, 2))
    with dpsql.testing.seeded(8):
        local = dpsql.count_stream(events, "ts", partition_by="ap", epsilon=1.0, **grid)
    with dpsql.testing.seeded(8):
        out = spark_dp.count_stream(spark.createDataFrame(events.to_pandas()), order_by="ts", partition_by="ap",
                                    epsilon=1.0, **grid)
    got = pl.from_pandas(out.toPandas()).sort("ap", "ts")
    assert got.height == 3 * 24
    assert got["dp_count"].to_list() == local.sort("ap", "ts")["dp_count"].to_list()


def test_refused_calls_charge_nothing(spark):
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    frame = _readings(200)
    df = spark.createDataFrame(frame.to_pandas())
    with pytest.raises(dpsql.InvalidParameter, match="'site' not found"):
        spark_dp.range_sum(df, order_by="ts", value="kwh", partition_by="site", epsilon=0.5, upper=1.0, budget=budget)
    with pytest.raises(dpsql.InvalidData, match="array<bigint>"):
        spark_dp.range_sum(df.selectExpr("array(meter) AS meter", "ts", "kwh"), order_by="ts", value="kwh",
                           partition_by="meter", epsilon=0.5, upper=1.0, budget=budget)
    with pytest.raises(dpsql.InvalidData, match="must be numeric"):
        spark_dp.range_sum(df.selectExpr("meter", "ts", "cast(kwh AS string) AS kwh"), order_by="ts", value="kwh",
                           partition_by="meter", epsilon=0.5, upper=1.0, budget=budget)
    with pytest.raises(dpsql.InvalidTimeKey, match="partition column 'meter' contains 1 NULL value"):
        spark_dp.range_sum(df.selectExpr("CASE WHEN ts = 3 THEN NULL ELSE meter END AS meter", "ts", "kwh"),
                           order_by="ts", value="kwh", partition_by="meter", epsilon=0.5, upper=1.0, budget=budget)
    with pytest.raises(dpsql.InvalidParameter, match="needs a budget"):
        spark_dp.range_sum(df, order_by="ts", value="kwh", partition_by="meter", epsilon=0.5, upper=1.0)
    with pytest.raises(dpsql.InvalidParameter, match="delta is required"):
        spark_dp.range_sum(df, order_by="ts", value="kwh", partition_by="meter", method="pak", epsilon=0.5,
                           upper=1.0, budget=budget)
    assert budget.spent == (0.0, 0.0)
    # a budget too small is refused before any Spark job runs (no pre-charge check of the rows)
    small = dpsql.Budget.in_memory(epsilon=0.25)
    jobs = spark.sparkContext.statusTracker().getJobIdsForGroup(None)
    with pytest.raises(dpsql.BudgetExhausted):
        spark_dp.range_sum(df, order_by="ts", value="kwh", partition_by="meter", epsilon=0.5, upper=1.0,
                           budget=small)
    with pytest.raises(dpsql.BudgetExhausted):
        spark_dp.count_stream(df, order_by="ts", every=1, start=0, stop=100, partition_by="meter", epsilon=0.5,
                              budget=small)
    assert spark.sparkContext.statusTracker().getJobIdsForGroup(None) == jobs
    assert small.spent == (0.0, 0.0) and small.history().height == 0


def test_bad_rows_and_types_are_refused_on_the_driver_before_the_charge(spark):
    """What a task would refuse (a repeated time key within a partition, a null, NaN or infinite
    value, a null order key) and unusable count-stream columns are refused before anything is
    charged: a charged release never fails on its data."""
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    n = 300
    df = spark.createDataFrame(pl.DataFrame({"meter": np.arange(n) % 3, "ts": np.arange(n) // 3,
                                             "kwh": (np.arange(n) % 7) * 1.0}).to_pandas())
    release = dict(order_by="ts", value="kwh", partition_by="meter", method="laplace", epsilon=0.5, upper=10.0,
                   budget=budget)
    refused = [
        (dpsql.InvalidTimeKey, "'ts' has a duplicate value within a partition \\(1 repeated",
         df.selectExpr("meter", "CASE WHEN ts = 5 AND meter = 1 THEN 6 ELSE ts END AS ts", "kwh")),
        (dpsql.InvalidTimeKey, "order column 'ts' contains 1 NULL value",
         df.selectExpr("meter", "IF(ts = 7 AND meter = 0, NULL, ts) AS ts", "kwh")),
        (dpsql.InvalidData, "'kwh' contains 2 null", df.selectExpr("meter", "ts", "IF(ts = 9, NULL, kwh) AS kwh")
         .where("meter < 2 OR ts != 9")),
        (dpsql.InvalidData, "'kwh' contains 4 NaN or infinite",
         df.selectExpr("meter", "ts", "CASE WHEN ts = 1 THEN double('NaN') WHEN ts = 2 AND meter = 0 THEN "
                       "double('-Infinity') ELSE kwh END AS kwh")),
        (dpsql.InvalidData, "'kwh' contains 1 integers beyond 2\\*\\*53",
         df.selectExpr("meter", "ts", "IF(ts = 4 AND meter = 2, 9007199254740993, bigint(kwh)) AS kwh")),
    ]
    for error, message, frame in refused:
        with pytest.raises(error, match=message):
            spark_dp.range_sum(frame, **release)
    with pytest.raises(dpsql.InvalidParameter, match=r"must be a pyspark\.sql\.DataFrame, got DataFrame"):
        spark_dp.range_sum(pl.DataFrame({"meter": [1], "ts": [1], "kwh": [1.0]}), **release)
    with pytest.raises(dpsql.InvalidParameter, match="non-empty strings"):
        spark_dp.range_sum(df, **release | {"order_by": ["ts"]})
    with pytest.raises(dpsql.InvalidParameter, match="two roles"):
        spark_dp.range_sum(df, **release | {"value": "ts"})
    events = spark.createDataFrame(pl.DataFrame({"ap": np.arange(n) % 3, "t": np.arange(n) * 60.0}).to_pandas())
    counts = dict(every=600.0, start=0.0, stop=n * 60.0, epsilon=0.5, budget=budget)
    with pytest.raises(dpsql.InvalidParameter, match="'when' not found"):
        spark_dp.count_stream(events, order_by="when", partition_by="ap", **counts)
    with pytest.raises(dpsql.InvalidData, match="'t' must hold numbers"):
        spark_dp.count_stream(events.selectExpr("ap", "string(t) AS t"), order_by="t", partition_by="ap",
                              **counts)
    with pytest.raises(dpsql.InvalidData, match="'t' must hold timestamps"):
        spark_dp.count_stream(events, order_by="t", partition_by="ap", **counts | dict(
            every="1h", start=dt.datetime(2024, 1, 1), stop=dt.datetime(2024, 1, 2)))
    with pytest.raises(dpsql.InvalidTimeKey, match="partition column 'ap' contains 1 NULL value"):
        spark_dp.count_stream(events.selectExpr("IF(t = 0, NULL, ap) AS ap", "t"), order_by="t",
                              partition_by="ap", **counts)
    with pytest.raises(dpsql.InvalidData, match="map<string,bigint>"):
        spark_dp.count_stream(events.selectExpr("map('a', ap) AS ap", "t"), order_by="t", partition_by="ap",
                              **counts)
    assert budget.spent == (0.0, 0.0) and budget.history().height == 0
    # a time key repeated across partitions (not within one) is a valid release, charged once
    out = spark_dp.range_sum(df, **release).toPandas()
    assert len(out) == n and budget.spent == (0.5, 0.0)


def test_the_release_key_never_appears_in_the_plan(spark, monkeypatch):
    keys = []
    fresh = dpsql.noise.Keystream.fresh

    def recorded():
        keystream = fresh()
        keys.append(keystream.key)
        return keystream

    monkeypatch.setattr(dpsql.noise.Keystream, "fresh", staticmethod(recorded))
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    out = spark_dp.range_sum(spark.createDataFrame(_readings(300).to_pandas()), order_by="ts", value="kwh",
                             partition_by="meter", method="laplace", epsilon=0.5, upper=60.0, budget=budget)
    plan = out._jdf.queryExecution().toString() + out._jdf.queryExecution().executedPlan().toString()
    assert len(keys) == 1 and len(keys[0]) == 32 and out.count() == 300
    for shown in (keys[0].hex(), repr(keys[0]), keys[0].hex().upper()):
        assert shown not in plan


def test_a_release_over_two_key_columns_equals_the_local_one(spark):
    frame = _readings(3000, meters=4, seed=7).with_columns(
        pl.when(pl.col("ts") % 2 == 0).then(pl.lit("north")).otherwise(pl.lit("south")).alias("site"))
    params = dict(method="hierarchy", epsilon=1.0, upper=60.0, r=256)
    with dpsql.testing.seeded(11):
        local = frame.with_columns(pl.col("kwh").dpsql.range_sum(order_by="ts", partition_by=["site", "meter"],
                                                                 **params).alias("dp"))
    with dpsql.testing.seeded(11):
        out = spark_dp.range_sum(spark.createDataFrame(frame.to_pandas()), order_by="ts", value="kwh",
                                 partition_by=["site", "meter"], **params)
    got = pl.from_pandas(out.toPandas()).sort("site", "meter", "ts")
    expected = local.sort("site", "meter", "ts")
    assert got["kwh"].to_list() == expected["dp"].to_list() and got.height == 3000
