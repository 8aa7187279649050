"""Spark releases on local[2]: checked, then charged once on the driver, released by partitions on
executors, equal to the local partition_by release, identical when re-executed, refused when the
source changed since the charge."""

from __future__ import annotations

import datetime as dt
import os
import sys
from decimal import Decimal

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
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

    # the executors' Python: this one, with dpsql (a session made in Python reads only the environment)
    previous = os.environ.get("PYSPARK_PYTHON")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    session = (SparkSession.builder.master("local[2]").appName("dpsql-tests")
               .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "4")
               .config("spark.sql.session.timeZone", "UTC").getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
    if previous is None:
        del os.environ["PYSPARK_PYTHON"]
    else:
        os.environ["PYSPARK_PYTHON"] = previous


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
    with pytest.raises(dpsql.InvalidData, match="key column 'meter' has collation UTF8_LCASE"):
        spark_dp.range_sum(df.selectExpr("collate(string(meter), 'UTF8_LCASE') AS meter", "ts", "kwh"),
                           order_by="ts", value="kwh", partition_by="meter", epsilon=0.5, upper=1.0, budget=budget)
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
        (dpsql.InvalidTimeKey, "'ts' has duplicate value 6 within a partition of 'meter'",
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
        (dpsql.InvalidTimeKey, "order column 'ts' contains NaN",
         df.selectExpr("meter", "IF(ts = 8, double('NaN'), double(ts)) AS ts", "kwh")),
        (dpsql.InvalidTimeKey, "partition column 'meter' contains NaN",
         df.selectExpr("IF(ts = 8, double('NaN'), double(meter)) AS meter", "ts", "kwh")),
        (dpsql.InvalidData, "column 'kwh' is empty: nothing to release", df.where("ts < 0")),
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
    with pytest.raises(dpsql.InvalidTimeKey, match="time column 't' contains 2 null"):
        spark_dp.count_stream(events.selectExpr("ap", "IF(t < 120, NULL, t) AS t"), order_by="t",
                              partition_by="ap", **counts)
    with pytest.raises(dpsql.InvalidTimeKey, match="time column 't' contains NaN"):
        spark_dp.count_stream(events.selectExpr("ap", "IF(t = 60, double('NaN'), t) AS t"), order_by="t",
                              partition_by="ap", **counts)
    with pytest.raises(dpsql.InvalidData, match=r"no event of column 't' falls in the domain \[0.0, 18000.0\)"):
        spark_dp.count_stream(events.selectExpr("ap", "t + 1e6 AS t"), order_by="t", partition_by="ap", **counts)
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


def _consistent(budget: dpsql.Budget) -> bool:
    """The ledger's totals are the sum of the charges it recorded."""
    history = budget.history()
    return budget.spent == pytest.approx((history["epsilon"].sum(), history["delta"].sum()))


@pytest.mark.parametrize(("change", "partition"), [("one value", 1), ("a filter", 2)])
def test_a_released_dataframe_read_after_its_source_changed_refuses_instead_of_releasing(spark, tmp_path, change,
                                                                                          partition):
    """The re-run attack (issue 23): the released DataFrame, collected again after its Parquet
    source was rewritten (one value changed, or a row filtered out), would release the new rows
    with the charged noise, their difference with the first collection being exactly the
    change. Its tasks refuse the changed partition instead, releasing nothing of it, and nothing
    more is charged; unchanged, it is collected again with identical values."""
    n = 300
    table = pa.table({"meter": np.arange(n) % 3, "ts": np.arange(n), "kwh": (np.arange(n) % 7) * 1.0})
    pq.write_table(table, tmp_path / "part-0.parquet")
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    out = spark_dp.range_sum(spark.read.parquet(str(tmp_path)), order_by="ts", value="kwh", partition_by="meter",
                             method="laplace", epsilon=0.5, upper=10.0, budget=budget)
    # each read is a new query on the released DataFrame (as a dashboard's): planned anew, its source read again
    first = [row.kwh for row in out.orderBy("ts").collect()]
    assert [row.kwh for row in out.orderBy("ts").collect()] == first and len(first) == n
    if change == "one value":
        kwh = table["kwh"].to_numpy().copy()
        kwh[10] += 1.0
        changed = table.set_column(2, "kwh", pa.array(kwh))
    else:
        changed = table.filter(pa.compute.not_equal(table["ts"], 20))
    pq.write_table(changed, tmp_path / "part-0.parquet")
    with pytest.raises(Exception, match=f"DataChanged: partition {partition} is not the data this release was "
                                        "charged for.*release again"):
        out.orderBy("ts").collect()
    assert budget.spent == (0.5, 0.0) and budget.history().height == 1 and _consistent(budget)


def test_a_count_stream_read_after_its_events_changed_refuses(spark, tmp_path):
    times = np.arange(0, 3600 * 6, 450.0)
    table = pa.table({"ap": (np.arange(len(times)) % 2).astype(np.int64), "t": times})
    pq.write_table(table, tmp_path / "events.parquet")
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    out = spark_dp.count_stream(spark.read.parquet(str(tmp_path)), order_by="t", every=3600.0, start=0.0,
                                stop=3600.0 * 6, partition_by="ap", method="count_laplace", epsilon=0.5,
                                budget=budget)
    first = out.orderBy("ap", "t").collect()
    assert out.orderBy("ap", "t").collect() == first and len(first) == 2 * 6
    pq.write_table(table.slice(1), tmp_path / "events.parquet")  # the first event of access point 0 removed
    with pytest.raises(Exception, match="DataChanged: partition 0 is not the data"):
        out.orderBy("ap", "t").collect()
    assert budget.spent == (0.5, 0.0) and _consistent(budget)


def test_short_partitions_take_the_fleets_threshold_and_a_hold_out_of_their_own_is_refused_before_the_charge(spark):
    """Issue 21: the default tops (one threshold for the fleet) works on a partition shorter than
    the hold-out; with ``threshold_by="partition"`` ToPS's and PAK's hold-out must fit in every
    partition, and a shorter one is refused, naming it, before anything is charged (the release
    used to be charged, then fail in its task); so is a pool as long as the fleet."""
    budget = dpsql.Budget.in_memory(epsilon=1.0, delta=1e-3)
    meters = np.repeat([0, 1, 2], [300, 300, 50])
    frame = pl.DataFrame({"meter": meters, "ts": np.arange(len(meters)), "kwh": np.arange(len(meters)) % 9 * 1.0})
    df = spark.createDataFrame(frame.to_pandas())
    release = dict(order_by="ts", value="kwh", partition_by="meter", epsilon=0.5, upper=10.0, budget=budget)
    with pytest.raises(dpsql.InvalidParameter, match=r"partition 2 has 50 row\(s\): m \(hold-out length\) must "
                                                     r"be < the number of values \(50\), got m=100"):
        spark_dp.range_sum(df, method="tops", m=100, threshold_by="partition", **release).collect()
    with pytest.raises(dpsql.InvalidParameter, match=r"partition 2 has 50 row\(s\): m \(hold-out length\)"):
        spark_dp.range_sum(df, method="pak", m=60, delta=1e-6, threshold_by="partition", **release).collect()
    with pytest.raises(dpsql.InvalidParameter, match=r"m \(the fleet's pooled hold-out\) must be < the number of "
                                                     r"values \(650\), got m=650"):
        spark_dp.range_sum(df, method="tops", m=650, **release).collect()
    assert budget.spent == (0.0, 0.0) and budget.history().height == 0
    with dpsql.testing.seeded(6):
        out = spark_dp.range_sum(df, method="tops", m=100, **release)
    assert budget.spent == (0.5, 0.0) and _consistent(budget)
    with dpsql.testing.seeded(6):
        local = frame.with_columns(pl.col("kwh").dpsql.range_sum(method="tops", m=100, order_by="ts",
                                                                 partition_by="meter", epsilon=0.5, upper=10.0))
    assert pl.from_pandas(out.toPandas()).sort("ts")["kwh"].to_list() == local["kwh"].to_list()
    assert len(spark_dp.range_sum(df, method="tops", m=40, threshold_by="partition", **release).collect()) == 650


def _fleet(shape: str, partitions: int = 200, rows: int = 30) -> pl.DataFrame:
    """``partitions`` meters of ``rows`` heavy-tailed readings, in a shuffled row order: starting
    together (integer time keys), one after another (meter ``p`` from time ``5 p``), or at random
    minutes of a day (timestamps, text meters)."""
    rng = np.random.default_rng(13)
    meter = np.repeat(np.arange(partitions), rows)
    kwh = np.round(rng.lognormal(1.0, 1.2, partitions * rows), 3)
    if shape == "minutes":
        minutes = np.concatenate([np.sort(rng.choice(24 * 60, rows, replace=False)) for _ in range(partitions)])
        ts = [dt.datetime(2024, 3, 1) + dt.timedelta(minutes=int(m)) for m in minutes]
        frame = pl.DataFrame({"meter": [f"m{p:03d}" for p in meter], "ts": ts, "kwh": kwh})
    else:
        ts = np.tile(np.arange(rows), partitions) + (5 * meter if shape == "staggered" else 0)
        frame = pl.DataFrame({"meter": meter, "ts": ts, "kwh": kwh})
    return frame.sample(fraction=1.0, shuffle=True, seed=2)


@pytest.mark.parametrize(("shape", "method", "params"), [("together", "tops", {}), ("staggered", "tops", {}),
                                                         ("together", "tops", {"m": 300}),
                                                         ("minutes", "tops", {"m": 1000}),
                                                         ("together", "pak", {"delta": 1e-6, "m": 300}),
                                                         ("together", "tops", {"focus": "windows"}),
                                                         ("staggered", "tops", {"focus": "long", "m": 300}),
                                                         ("together", "tops", {"focus": "paper", "c": 30.0})])
def test_a_fleet_threshold_release_equals_the_local_one(spark, shape, method, params):
    """Issue 21 items 3 and 4: the default partitioned tops (and PAK) chooses one threshold for the
    fleet from its pooled hold-out (its 4,096 earliest rows by time key, ties by partition
    address), on the driver after the charge, and releases 200 meters of 30 rows (shorter than
    their share of the pool) exactly as the local release does. The check gathers each meter's
    first 8 rows for the pool: enough for a pool of 300, not for 4,096 (21 rows a meter) or for
    staggered meters (the earliest give all their rows): then it gathers again. Every ``focus``
    (issue 22 item 5) chooses the fleet's threshold on the driver as the local release does."""
    frame = _fleet(shape)
    budget = dpsql.Budget.in_memory(epsilon=1.0, delta=1e-5)
    release = dict(method=method, epsilon=1.0, upper=50.0, **params)
    with dpsql.testing.seeded(9):
        local = frame.with_columns(pl.col("kwh").dpsql.range_sum(order_by="ts", partition_by="meter", **release)
                                   .alias("dp"))
    with dpsql.testing.seeded(9):
        out = spark_dp.range_sum(spark.createDataFrame(frame.to_pandas()), order_by="ts", value="kwh",
                                 partition_by="meter", budget=budget, **release)
    assert budget.spent == (1.0, params.get("delta", 0.0))  # the pool is one mechanism: charged as one stream
    got = pl.from_pandas(out.toPandas()).sort("meter", "ts")
    expected = local.sort("meter", "ts")
    assert got.height == 6000 and got["kwh"].to_list() == expected["dp"].to_list()


def test_a_fleet_threshold_serves_the_longest_partition_on_spark_as_locally(spark):
    """The default threshold serves long ranges anywhere in the release's longest partition
    (issue 22 item 5): a fleet of ten meters of 30 rows and one of 100,000 rows (longer than a
    stream's span, 2**16 rows) must get that partition's threshold on Spark's driver too, and
    release exactly what the local release does. The driver used to choose for a stream's span
    (another threshold here: other values for every row)."""
    rng = np.random.default_rng(21)
    lengths = np.array([30] * 10 + [100_000])
    meter = np.repeat(np.arange(len(lengths)), lengths)
    ts = np.concatenate([np.arange(n) for n in lengths])
    frame = pl.DataFrame({"meter": meter, "ts": ts, "kwh": np.round(rng.lognormal(1.0, 1.2, len(meter)), 3)})
    release = dict(method="tops", epsilon=1.0, upper=1000.0)
    with dpsql.testing.seeded(9):
        local = frame.with_columns(pl.col("kwh").dpsql.range_sum(order_by="ts", partition_by="meter", **release)
                                   .alias("dp"))
    with dpsql.testing.seeded(9):
        out = spark_dp.range_sum(spark.createDataFrame(frame.to_pandas()), order_by="ts", value="kwh",
                                 partition_by="meter", budget=dpsql.Budget.in_memory(epsilon=1.0), **release)
    got = pl.from_pandas(out.toPandas()).sort("meter", "ts")
    assert got.height == len(meter) and got["kwh"].to_list() == local.sort("meter", "ts")["dp"].to_list()


def test_partitions_cut_across_arrow_batches_are_released_whole(spark):
    """Tasks read Arrow batches of 7 rows: every partition spans several, and text partition keys
    and timestamp order keys are digested and released as the local release does."""
    rng = np.random.default_rng(12)
    n = 900
    frame = pl.DataFrame({"site": rng.choice(["north", "south", "east"], n), "meter": rng.integers(0, 4, n),
                          "ts": [dt.datetime(2024, 1, 1) + dt.timedelta(minutes=int(m))
                                 for m in rng.permutation(n)],
                          "kwh": np.round(rng.gamma(2.0, 5.0, n), 3)})
    params = dict(method="hierarchy", epsilon=1.0, upper=60.0, r=64)
    with dpsql.testing.seeded(5):
        local = frame.with_columns(pl.col("kwh").dpsql.range_sum(order_by="ts", partition_by=["site", "meter"],
                                                                 **params).alias("dp"))
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "7")
    try:
        with dpsql.testing.seeded(5):
            out = spark_dp.range_sum(spark.createDataFrame(frame.to_pandas()), order_by="ts", value="kwh",
                                     partition_by=["site", "meter"], **params)
        got = pl.DataFrame([row.asDict() for row in out.collect()])
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    expected = local.sort("site", "meter", "ts")
    assert got.sort("site", "meter", "ts")["kwh"].to_list() == expected["dp"].to_list() and got.height == n


def test_a_driver_that_cannot_import_pandas_is_refused_before_the_charge(spark, monkeypatch):
    """A ``spark`` extra without pandas: Spark's Arrow tasks cannot be planned. The release is
    refused with a typed error saying so before anything is charged (it used to be charged, then
    fail when its tasks were planned)."""
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    df = spark.createDataFrame(_readings(200).to_pandas())
    monkeypatch.setitem(sys.modules, "pandas", None)  # what `import pandas` finds on such a driver: nothing
    with pytest.raises(dpsql.EnvironmentUnusable, match=r"the Spark driver cannot run Arrow tasks: .*Pandas >= 2\.2"):
        spark_dp.range_sum(df, order_by="ts", value="kwh", partition_by="meter", method="laplace", epsilon=0.5,
                           upper=60.0, budget=budget)
    assert budget.spent == (0.0, 0.0) and budget.history().height == 0


def test_keys_a_nanosecond_or_a_last_decimal_digit_apart_draw_independent_noise(spark, tmp_path):
    """Issue 23 item 1 on Spark: two meters with the same readings whose keys differ in the last
    digit of a DECIMAL(38,24), by one microsecond (Spark's finest timestamp) or by one nanosecond
    (Parquet nanoseconds, which Spark refuses as timestamps and reads as integers when asked to)
    get independent noise, each as the local release of the same exact key. Keys sharing an
    address would share noise: one meter's release minus the other's would be their raw
    difference (here 0, at every row)."""
    n, first = 50, 1_700_000_000_000_000_000
    readings = np.round(np.random.default_rng(3).gamma(2.0, 2.0, n), 3)
    table = pa.table({"dec": pa.array([Decimal("1.000000000000000000000001"), Decimal("1.000000000000000000000002")]
                                      * n, pa.decimal128(38, 24)),
                      "us": pa.array([first // 1000, first // 1000 + 1] * n, pa.timestamp("us")),
                      "ns": pa.array([first, first + 1] * n, pa.timestamp("ns")),
                      "ts": np.repeat(np.arange(n), 2), "kwh": np.repeat(readings, 2)})
    pq.write_table(table, tmp_path / "meters.parquet")
    with pytest.raises(Exception, match=r"Illegal Parquet type: INT64 \(TIMESTAMP\(NANOS"):
        spark.read.parquet(str(tmp_path)).collect()
    budget = dpsql.Budget.in_memory(epsilon=3.0)
    release = dict(order_by="ts", partition_by="meter", method="laplace", epsilon=1.0, upper=10.0)
    spark.conf.set("spark.sql.legacy.parquet.nanosAsLong", "true")
    try:
        df = spark.read.parquet(str(tmp_path))
        for key in ("dec", "us", "ns"):
            with dpsql.testing.seeded(4):
                out = spark_dp.range_sum(df.withColumnRenamed(key, "meter"), value="kwh", budget=budget, **release)
                got = out.toArrow().sort_by([("meter", "ascending"), ("ts", "ascending")])["kwh"].to_numpy()
            meters = pl.from_arrow(table).with_columns(pl.col(key).cast(pl.Int64) if key == "ns" else pl.col(key))
            with dpsql.testing.seeded(4):
                local = meters.rename({key: "meter"}).sort("meter", "ts").with_columns(
                    pl.col("kwh").dpsql.range_sum(**release))
            assert got.tolist() == local["kwh"].to_list(), key
            assert np.all(got[:n] != got[n:]), key  # the two meters' noise differs at every row
    finally:
        spark.conf.unset("spark.sql.legacy.parquet.nanosAsLong")
    assert budget.spent == (3.0, 0.0)
