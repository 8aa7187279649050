"""Continual streams from SQL (dp_stream_create, dp_stream_append, dp_stream) and from Polars lazy
frames: the same ledger rows, and the same values, as the Python API."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
import textwrap

import duckdb
import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pytest

import dpsql
import dpsql.duckdb

CREATE = ("SELECT * FROM dp_stream_create('kwh', 'ts', 'kwh', method := 'hierarchy', epsilon := 0.5, "
          "partition_by := 'meter', upper := 60, r := 256)")


def _readings(n: int, seed: int = 0) -> pl.DataFrame:
    rng = np.random.default_rng(seed)
    return pl.DataFrame({"meter": rng.integers(0, 3, n).astype(np.int32), "ts": np.arange(n),
                         "kwh": np.round(rng.gamma(2.0, 6.0, n), 2)})


def _sql(budget):
    con = duckdb.connect()
    dpsql.duckdb.register(con, budget=budget)
    return con


def _python_stream(budget, frame, seed):
    """The same stream registered and appended in Python, in one append (the oracle)."""
    with dpsql.testing.seeded(seed):
        stream = budget.stream("kwh", method="hierarchy", epsilon=0.5, order_by="ts", value="kwh",
                               partition_by="meter", upper=60.0, r=256)
    stream.append(frame)
    return stream.released()


def test_a_stream_created_and_appended_in_sql_is_the_python_stream():
    frame = _readings(3000)
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    con = _sql(budget)
    con.from_arrow(frame.slice(0, 1700).to_arrow()).create("first")
    con.from_arrow(frame.slice(1700).to_arrow()).create("rest")
    with dpsql.testing.seeded(3):
        info = con.sql(CREATE).pl()
    assert info.columns == ["name", "method", "epsilon", "delta", "rows", "partitions", "watermark", "created",
                            "release_id"]
    assert info.select("name", "method", "epsilon", "rows").row(0) == ("kwh", "hierarchy", 0.5, 0)
    assert info["release_id"][0] == budget.stream("kwh").release_id
    appended = con.sql("SELECT * FROM dp_stream_append('kwh', 'first')").to_arrow_table()
    assert appended.column_names == ["meter", "ts", "kwh", "dp_row", "dp_final"] and appended.num_rows > 0
    assert appended.schema.field("meter").type == pa.int32()  # the source's partition key type
    # executing the same append again is an idempotent re-append: the recorded values, nothing new
    again = con.sql("SELECT * FROM dp_stream_append('kwh', 'first')").to_arrow_table()
    assert again.equals(appended.cast(again.schema))
    budget.stream("kwh").append(frame.slice(1700, 600))  # from Python, between two SQL appends
    con.sql("SELECT * FROM dp_stream_append('kwh', 'rest')").to_arrow_table()
    released = con.sql("SELECT * FROM dp_stream('kwh') ORDER BY meter, ts").to_arrow_table()
    assert released.equals(budget.stream("kwh").released().cast(released.schema))
    oracle = _python_stream(dpsql.Budget.in_memory(epsilon=1.0), frame, seed=3)
    assert released["kwh"].to_pylist() == oracle["kwh"].to_pylist()
    assert released["ts"].to_pylist() == oracle["ts"].to_pylist()
    # re-executing the create reopens it, free; other parameters are refused, naming the parameter
    assert con.sql(CREATE).pl()["rows"][0] == released.num_rows
    assert budget.spent == (0.5, 0.0) and budget.history()["kind"].to_list() == ["stream"]
    with pytest.raises(dpsql.InvalidParameter, match="exists with upper=60; reopening it with upper=50"), \
            dpsql.duckdb.typed_errors():
        con.sql(CREATE.replace("upper := 60", "upper := 50")).fetchall()
    for query in ("SELECT * FROM dp_stream('nope')", "SELECT * FROM dp_stream_append('nope', 'rest')"):
        with pytest.raises(dpsql.UnknownStream, match="no stream named 'nope'"), dpsql.duckdb.typed_errors():
            con.sql(query).fetchall()
    with pytest.raises(dpsql.InvalidParameter, match="'threshold' has no online form"), dpsql.duckdb.typed_errors():
        con.sql("SELECT * FROM dp_stream_create('t', 'ts', 'kwh', method := 'threshold', epsilon := 0.1, "
                "upper := 60)").fetchall()
    assert budget.spent == (0.5, 0.0)


def test_refused_sql_appends_change_nothing():
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    con = _sql(budget)
    con.sql("SELECT * FROM dp_stream_create('s', 'ts', 'v', method := 'laplace', epsilon := 0.5, upper := 10)"
            ).fetchall()
    con.execute("CREATE TABLE t AS SELECT range AS ts, (range % 7)::DOUBLE AS v FROM range(20)")
    con.sql("SELECT * FROM dp_stream_append('s', 't')").fetchall()
    before = budget.stream("s").released()
    con.execute("CREATE TABLE late AS SELECT * FROM (VALUES (30, 1.0), (-1, 2.0)) AS x(ts, v)")
    con.execute("CREATE TABLE changed AS SELECT * FROM (VALUES (19, 1.0), (30, 2.0)) AS x(ts, v)")
    con.execute("CREATE TABLE twice AS SELECT * FROM (VALUES (30, 1.0), (30, 1.0)) AS x(ts, v)")
    con.execute("CREATE TABLE novalue AS SELECT 30 AS ts")
    refusals = [("late", dpsql.LateRow, "order key -1 arrives at or below its partition's watermark 19"),
                ("changed", dpsql.ConflictingRow, "order key 19 was appended before with another value"),
                ("twice", dpsql.InvalidTimeKey, "order key 30 appears twice"),
                ("novalue", dpsql.InvalidParameter, "v")]
    for table, error, message in refusals:
        with pytest.raises(error, match=message), dpsql.duckdb.typed_errors():
            con.sql(f"SELECT * FROM dp_stream_append('s', '{table}')").fetchall()
    assert budget.stream("s").released().equals(before) and budget.spent == (0.5, 0.0)


def test_count_streams_in_sql_close_buckets_until_a_time():
    start = dt.datetime(2024, 1, 1)
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    con = _sql(budget)
    con.execute("CREATE TABLE ev AS SELECT TIMESTAMP '2024-01-01' + INTERVAL (range * 7) MINUTE AS ts, "
                "(range % 2)::INT AS ap FROM range(100)")
    with dpsql.testing.seeded(6):
        con.sql("SELECT * FROM dp_stream_create('ev', 'ts', NULL, method := 'count_laplace', epsilon := 0.5, "
                "partition_by := 'ap', every := INTERVAL '1 hour', start := TIMESTAMP '2024-01-01')").fetchall()
    out = con.sql("SELECT * FROM dp_stream_append('ev', 'ev', until := TIMESTAMP '2024-01-01 05:00')").to_arrow_table()
    assert out.column_names == ["ap", "ts", "count", "dp_row", "dp_final"] and out.num_rows == 2 * 5
    assert sorted(set(out["ts"].to_pylist())) == [start + dt.timedelta(hours=h) for h in range(5)]
    with pytest.raises(dpsql.InvalidParameter, match="earlier than the buckets already closed"), \
            dpsql.duckdb.typed_errors():
        con.sql("SELECT * FROM dp_stream_append('ev', 'ev', until := TIMESTAMP '2024-01-01 03:00')").fetchall()
    with pytest.raises(dpsql.LateRow, match="already released"), dpsql.duckdb.typed_errors():
        con.sql("SELECT * FROM dp_stream_append('ev', 'ev')").fetchall()
    # the oracle: the same buckets counted in Python, released in one call with the same seed
    events = con.sql("SELECT * FROM ev").pl()
    with dpsql.testing.seeded(6):
        oracle = dpsql.Budget.in_memory(epsilon=1.0).stream("ev", method="count_laplace", epsilon=0.5, order_by="ts",
                                                            partition_by="ap", every="1h", start=start)
    expected = oracle.append(events.filter(pl.col("ts") < start + dt.timedelta(hours=5)),
                             until=start + dt.timedelta(hours=5))
    assert con.sql("SELECT * FROM dp_stream('ev') ORDER BY ap, ts").to_arrow_table()["count"].to_pylist() == \
        expected["count"].to_pylist()


def test_a_sql_stream_on_a_ledger_file_continues_in_another_process(tmp_path):
    path = tmp_path / "l.sqlite"
    frame = _readings(2000, seed=5)
    frame.write_parquet(tmp_path / "rows.parquet")
    budget = dpsql.Budget.open(path, epsilon=1.0)
    con = _sql(budget)
    con.sql(CREATE).fetchall()
    con.execute(f"CREATE VIEW head AS SELECT * FROM '{tmp_path / 'rows.parquet'}' WHERE ts < 1000")
    first = con.sql("SELECT * FROM dp_stream_append('kwh', 'head')").to_arrow_table()
    code = f"""
        import duckdb, dpsql, dpsql.duckdb
        con = duckdb.connect()
        dpsql.duckdb.register(con, budget=dpsql.Budget.open({str(path)!r}))
        print(con.sql("SELECT count(*) FROM dp_stream_append('kwh', '{tmp_path / 'rows.parquet'}')").fetchall()[0][0])
    """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    released = budget.stream("kwh").released()
    assert int(out.stdout) == released.num_rows  # the whole file again: the old rows' values and the new
    final = first.filter(first["dp_final"])
    kept = released.filter(pc.is_in(released["dp_row"], final["dp_row"]))
    assert kept.equals(final.cast(kept.schema))  # the first append's final rows, unchanged by the other process
    # its provisional rows (open blocks) were finalised by the other process's append
    provisional = first.filter(pc.invert(first["dp_final"]))
    assert provisional.num_rows and pc.all(released.filter(pc.is_in(released["dp_row"], provisional["dp_row"]))[
        "dp_final"]).as_py()
    assert released.num_rows > first.num_rows and released["ts"].to_pylist()[-1] > 1000
    assert budget.spent == (0.5, 0.0) and len(set(released["dp_row"].to_pylist())) == released.num_rows


def test_a_lazy_frame_is_appended_in_ordered_batches_as_one_append():
    frame = _readings(300_000, seed=2)
    shuffled = frame.sample(fraction=1.0, shuffle=True, seed=1)
    lazy_budget, eager_budget = dpsql.Budget.in_memory(epsilon=1.0), dpsql.Budget.in_memory(epsilon=1.0)
    with dpsql.testing.seeded(4):
        lazy = lazy_budget.stream("s", method="laplace", epsilon=0.5, order_by="ts", value="kwh",
                                  partition_by="meter", upper=60.0)
    with dpsql.testing.seeded(4):
        eager = eager_budget.stream("s", method="laplace", epsilon=0.5, order_by="ts", value="kwh",
                                    partition_by="meter", upper=60.0)
    assert len(list(shuffled.lazy().sort("meter", "ts").collect_batches())) > 1  # several batches
    out = lazy.append(shuffled.lazy().filter(pl.col("ts") < 250_000), to_polars=True)
    assert isinstance(out, pl.DataFrame) and out.height == 250_000
    assert out.select("meter", "ts").equals(frame.filter(pl.col("ts") < 250_000).sort("meter", "ts")
                                            .select("meter", "ts"))
    expected = eager.append(frame.filter(pl.col("ts") < 250_000))
    assert out["kwh"].to_list() == expected["kwh"].to_pylist()
    # a bad row in a later batch refuses the whole lazy append: nothing of its earlier batches is kept
    before = lazy.released()
    bad = shuffled.lazy().with_columns(pl.when(pl.col("ts") == 299_999).then(float("nan")).otherwise(pl.col("kwh"))
                                       .alias("kwh"))
    with pytest.raises(dpsql.InvalidData, match="NaN"):
        lazy.append(bad)
    assert lazy.released().equals(before)
    rest = lazy.append(shuffled.lazy())
    assert rest.num_rows == 300_000  # 250,000 recorded rows and 50,000 new ones
    assert lazy.released()["kwh"].to_pylist() == eager.append(frame)["kwh"].to_pylist()


def test_a_key_twice_across_a_lazy_frames_batches_is_a_duplicate_not_a_repeat():
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    stream = budget.stream("s", method="laplace", epsilon=0.5, order_by="ts", value="v", upper=1.0)
    stream.append(pl.DataFrame({"ts": [-2, -1], "v": [0.5, 0.5]}))
    n = 300_000
    ts = np.arange(n)
    lazy = pl.LazyFrame({"ts": ts, "v": np.ones(n)})
    ends = np.cumsum([b.height for b in lazy.sort("ts").collect_batches()])
    assert len(ends) > 1
    ts[ends[0]] = ts[ends[0] - 1]  # the first key of the second batch repeats the last of the first
    before = stream.released()
    for values in (np.ones(n), np.arange(n) / n):  # same value or another: a duplicate inside one append
        with pytest.raises(dpsql.InvalidTimeKey, match=f"order key {ends[0] - 1} appears twice"):
            stream.append(pl.LazyFrame({"ts": ts, "v": values}))
        assert stream.released().equals(before)
    assert stream.append(pl.LazyFrame({"ts": np.arange(-2, n), "v": np.r_[0.5, 0.5, np.ones(n)]})).num_rows == n + 2


@pytest.mark.parametrize(("method", "params"), [("hierarchy", {"upper": 60.0, "r": 256}),
                                                ("tops", {"upper": 200.0, "m": 200, "smoother": "recent"}),
                                                ("binary_tree", {"upper": 60.0})], ids=lambda p: str(p))
def test_a_stream_appended_in_pieces_is_the_sql_and_polars_one_shot_release(method, params):
    """Issue 12 item 5: the values of dp_range_sum and .dpsql.range_sum over the whole table, with
    the same explicit parameters and test noise."""
    frame = _readings(3000, seed=7)
    budget = dpsql.Budget.in_memory(epsilon=10.0)
    con = _sql(budget)
    con.from_arrow(frame.to_arrow()).create("t")
    sql_params = ", ".join(f"{k} := {v!r}" for k, v in params.items())
    with dpsql.testing.seeded(3):
        in_sql = con.sql(f"SELECT meter, ts, kwh FROM dp_range_sum('t', 'ts', 'kwh', method := '{method}', "
                         f"epsilon := 0.5, partition_by := 'meter', {sql_params})").pl()
    with dpsql.testing.seeded(3):
        in_polars = frame.with_columns(pl.col("kwh").dpsql.range_sum(order_by="ts", partition_by="meter", method=method,
                                                                     epsilon=0.5, budget=budget, **params))
    with dpsql.testing.seeded(3):
        stream = budget.stream("s", method=method, epsilon=0.5, order_by="ts", value="kwh", partition_by="meter",
                               **params)
    for at in range(0, frame.height, 211):
        stream.append(frame.slice(at, 211))
    released = pl.from_arrow(stream.released()).filter("dp_final").select("meter", "ts", "kwh")
    assert released.height > 2000
    for one_shot in (in_sql, in_polars):
        joined = released.join(one_shot, on=["meter", "ts"], how="left", suffix="_one_shot")
        assert joined["kwh"].to_list() == joined["kwh_one_shot"].to_list()
