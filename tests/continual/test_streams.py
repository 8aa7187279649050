"""Continual streams: one charge, appends from anywhere, exactly the one-shot release's values."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import time
from fractions import Fraction
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from processes import in_forked_child

import dpsql
from dpsql.addresses import partition_address
from dpsql.mechanisms.hierarchy import MAX_FLAT_BLOCK, flat_block

RANGE_METHODS = [
    ("laplace", {"upper": 60.0}),
    ("binary_tree", {"upper": 60.0}),
    ("binary_tree", {"upper": 60.0, "horizon": 4096}),
    ("hierarchy", {"upper": 60.0, "r": 1024}),
    ("hierarchy", {"upper": 60.0, "r": 1024, "smoother": "median"}),
    ("hierarchy", {"upper": 60.0, "r": 1024, "smoother": "moving"}),
    ("hierarchy", {"upper": 60.0, "r": 1024, "smoother": "exponential"}),
    ("hierarchy", {"upper": 60.0, "r": 1024, "smoother": "mean"}),
    ("hierarchy", {"upper": 60.0, "r": 1024, "smoother": "recent"}),
    ("hierarchy", {"upper": 60.0}),
    ("hierarchy", {"upper": 60.0, "block": 7}),
    ("tops", {"upper": 200.0, "m": 300, "r": 1024}),
    ("tops", {"upper": 200.0, "m": 300}),
    ("tops", {"upper": 200.0, "m": 300, "smoother": "recent"}),
    ("tops", {"upper": 200.0, "threshold": 40.0, "r": 1024}),
    ("pak", {"upper": 200.0, "m": 300, "delta": 1e-6}),
    ("pak", {"upper": 200.0, "threshold": 40.0}),
]


def _readings(n: int, partitions: int = 3, seed: int = 0) -> pl.DataFrame:
    rng = np.random.default_rng(seed)
    return pl.DataFrame({"meter": rng.integers(0, partitions, n), "ts": np.arange(n),
                         "kwh": np.round(rng.gamma(2.0, 6.0, n), 2)})


def _one_shot(method, params, frame, seed):
    """The one-shot partitioned release of the whole table, keys as partition keys."""
    ordered = frame.sort(["meter", "ts"])
    keys, lengths = np.unique(ordered["meter"].to_numpy(), return_counts=True)
    with dpsql.testing.seeded(seed):
        # the order keys: a fleet's pooled hold-out takes its earliest rows, as appends in time order do
        return keys, dpsql.publish(method, ordered["kwh"].to_numpy(), partition_offsets=np.r_[0, np.cumsum(lengths)],
                                   partition_keys=keys.tolist(), order_values=ordered["ts"].to_numpy(), epsilon=1.0,
                                   **params)


def _stream(budget, method, params, seed, name="s"):
    with dpsql.testing.seeded(seed):
        return budget.stream(name, method=method, epsilon=1.0, order_by="ts", value="kwh", partition_by="meter",
                             **params)


def _same_as_one_shot(released: pa.Table, method, params, frame, seed):
    """The rows released final (each once, in order) are the one-shot release's values."""
    keys, whole = _one_shot(method, params, frame, seed)
    released = released.filter(released["dp_final"])
    for k, key in enumerate(keys.tolist()):
        mine = released.filter(pc.equal(released["meter"], key))
        assert np.array_equal(mine["kwh"].to_numpy(), whole.part(k).values[:mine.num_rows]), (method, params, key)
        assert mine["ts"].to_pylist() == frame.filter(pl.col("meter") == key)["ts"].to_list()[:mine.num_rows]


@pytest.mark.parametrize(("method", "params"), RANGE_METHODS, ids=lambda p: str(p))
def test_appends_in_any_chunks_release_the_one_shot_values(method, params):
    frame = _readings(3000)
    rng = np.random.default_rng(7)
    for cut in ("sevens", "random"):
        budget = dpsql.Budget.in_memory(epsilon=2.0, delta=1e-5)
        stream = _stream(budget, method, params, seed=11)
        size = 7 if cut == "sevens" else None
        at, pieces = 0, []
        while at < frame.height:
            step = size or int(rng.integers(1, 400))
            pieces.append(stream.append(frame.slice(at, step)))
            at += step
        _same_as_one_shot(pa.concat_tables(pieces), method, params, frame, seed=11)
        _same_as_one_shot(stream.released(), method, params, frame, seed=11)
        # every row was released by the append that brought it, final or provisional
        assert sum(p.filter(pc.invert(p["dp_final"])).num_rows for p in pieces) + sum(
            p.filter(p["dp_final"]).num_rows for p in pieces) >= frame.height
        assert stream.released().num_rows == frame.height
        assert budget.spent == (1.0, params.get("delta", 0.0))


@pytest.mark.parametrize(("method", "params"), RANGE_METHODS, ids=lambda p: str(p))
def test_one_row_at_a_time_releases_the_one_shot_values(method, params):
    frame = _readings(600, partitions=2, seed=3)
    budget = dpsql.Budget.in_memory(epsilon=1.0, delta=1e-5)
    stream = _stream(budget, method, {**params, **({"m": 100} if "m" in params else {})}, seed=5)
    pieces = [stream.append(frame.slice(i, 1)) for i in range(frame.height)]
    assert sum(p.num_rows for p in pieces) >= frame.height * 3 // 4  # open blocks and hold-outs wait, no more
    _same_as_one_shot(pa.concat_tables(pieces), method, {**params, **({"m": 100} if "m" in params else {})}, frame, 5)


@pytest.mark.parametrize(("method", "params"), [("tops", {"upper": 200.0, "m": 300, "r": 1024}),
                                                 ("hierarchy", {"upper": 60.0, "r": 256, "smoother": "median"})])
def test_two_stream_objects_and_refused_appends_between_release_the_one_shot_values(method, params):
    """An object's appends continue from the machines its last append left (unless another append changed
    the partition since, or its own failed after feeding some partitions): the values never change."""
    frame = _readings(3000, partitions=3, seed=4)
    budget = dpsql.Budget.in_memory(epsilon=2.0)
    first = _stream(budget, method, params, seed=6)
    second = budget.stream("s")
    rng = np.random.default_rng(1)
    at, pieces, turn = 0, [], 0
    while at < frame.height:
        step = int(rng.integers(1, 300))
        piece = frame.slice(at, step)
        stream = first if turn % 3 else second
        if turn % 4 == 1 and at:
            # meter 0's new rows are fed before another meter's late row refuses the whole append
            late = pl.DataFrame({"meter": [1, 2], "ts": [-1, -1], "kwh": [1.0, 1.0]})
            with pytest.raises((dpsql.LateRow, dpsql.InvalidTimeKey)):
                stream.append(pl.concat([piece, late]))
        pieces.append(stream.append(piece))
        at, turn = at + step, turn + 1
    _same_as_one_shot(pa.concat_tables(pieces), method, params, frame, seed=6)


def test_partitions_interleaved_and_appearing_later(tmp_path):
    frame = _readings(2000, partitions=4, seed=9)
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    stream = _stream(budget, "hierarchy", {"upper": 60.0, "r": 256}, seed=2)
    late_meter = frame.filter(pl.col("meter") == 3)
    pieces = [stream.append(frame.filter(pl.col("meter") != 3).slice(0, 900))]
    pieces.append(stream.append(late_meter))  # a new partition, keys below the others' watermarks: fine
    pieces.append(stream.append(frame.filter(pl.col("meter") != 3).slice(900)))
    _same_as_one_shot(pa.concat_tables(pieces), "hierarchy", {"upper": 60.0, "r": 256}, frame, seed=2)
    assert stream.info()["partitions"] == 4


def test_registration_is_charged_once_and_reopening_from_another_process_is_free(tmp_path):
    path = tmp_path / "l.sqlite"
    budget = dpsql.Budget.open(path, epsilon=1.0)
    stream = budget.stream("kwh", method="laplace", epsilon=0.5, order_by="ts", value="kwh", upper=10.0)
    assert isinstance(stream, dpsql.Stream) and "Stream" in dpsql.__all__
    stream.append(pl.DataFrame({"ts": [1, 2], "kwh": [1.0, 2.0]}))
    code = f"""
        import dpsql, polars as pl
        budget = dpsql.Budget.open({str(path)!r})
        stream = budget.stream("kwh", method="laplace", epsilon=0.5, order_by="ts", value="kwh", upper=10.0)
        print(stream.append(pl.DataFrame({{"ts": [3], "kwh": [3.0]}}))["dp_row"][0])
        print(dpsql.Budget.open({str(path)!r}).stream("kwh").released().num_rows)
    """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out[1] == "3" and int(out[0]) == stream.released()["dp_row"][2].as_py()
    assert budget.spent == (0.5, 0.0)
    history = budget.history(full=True)
    assert history["kind"].to_list() == ["stream"] and history["stream"].to_list() == ["kwh"]
    listed = budget.streams()
    assert listed.select("name", "method", "rows", "partitions", "watermark").row(0) == ("kwh", "laplace", 3, 1, "3")
    assert listed["epsilon"][0] == 0.5 and listed["delta"][0] == 0.0
    assert json.loads(listed["params"][0]) == {"epsilon": 0.5, "upper": 10.0}
    created = dt.datetime.fromisoformat(listed["created"][0].replace("Z", "+00:00"))
    assert abs(created - history["time"][0]) < dt.timedelta(seconds=5)  # registered with its charge


def test_reopening_with_other_parameters_names_the_parameter():
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    budget.stream("s", method="tops", epsilon=0.5, order_by="ts", value="kwh", upper=100.0)
    with pytest.raises(dpsql.InvalidParameter, match=r"upper=100\.0"):
        budget.stream("s", upper=50.0)
    with pytest.raises(dpsql.InvalidParameter, match="method='tops'"):
        budget.stream("s", method="laplace")
    with pytest.raises(dpsql.UnknownStream, match="'other'"):
        budget.stream("other")
    with pytest.raises(dpsql.InvalidParameter, match="no online form"):
        budget.stream("t", method="topl", epsilon=0.5, order_by="ts", value="kwh", upper=1.0)
    with pytest.raises(dpsql.InvalidParameter, match="delta is required"):
        budget.stream("p", method="pak", epsilon=0.5, order_by="ts", value="kwh", upper=1.0)
    assert budget.stream("s", upper=100.0, method="tops").method == "tops" and budget.spent == (0.5, 0.0)


def _ledger_rows(path):
    """A stream's stored state (every record) and its number of chunks of released rows."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return (conn.execute("SELECT shard, data FROM stream_state ORDER BY release_id, shard").fetchall(),
                conn.execute("SELECT count(*) FROM stream_rows").fetchone()[0])


def test_repeated_rows_return_their_recorded_values_and_refused_appends_change_nothing(tmp_path):
    path = tmp_path / "l.sqlite"
    budget = dpsql.Budget.open(path, epsilon=1.0)
    stream = budget.stream("s", method="tops", epsilon=1.0, order_by="ts", value="v", upper=100.0, m=50,
                           smoother="recent")
    frame = pl.DataFrame({"ts": np.arange(300), "v": np.arange(300) % 37 * 1.0})
    waiting = stream.append(frame.slice(0, 30))  # still in the hold-out: provisional values
    assert waiting.num_rows == 30 and not pc.any(waiting["dp_final"]).as_py()
    again = stream.append(frame.slice(0, 40))  # repeats the provisional rows (their recorded values), 10 new
    assert again["ts"].to_pylist() == list(range(40)) and not pc.any(again["dp_final"]).as_py()
    assert again["v"].to_pylist()[:30] == waiting["v"].to_pylist()
    first = stream.append(frame.slice(0, 100))  # the hold-out completes: every row final
    assert first.num_rows == 100 and first["ts"].to_pylist() == list(range(100))
    assert pc.all(first["dp_final"]).as_py()
    again = stream.append(frame.slice(90, 30))  # 10 repeated, 20 new
    assert again["ts"].to_pylist() == list(range(90, 120))
    assert again["v"].to_pylist()[:10] == first["v"].to_pylist()[90:] and again["dp_row"][0] == first["dp_row"][90]
    before = _ledger_rows(path)
    refusals = [
        (frame.slice(95, 10).with_columns(pl.col("v") + 1), dpsql.ConflictingRow, "appended before with another"),
        (pl.DataFrame({"ts": [200, 200], "v": [1.0, 2.0]}), dpsql.InvalidTimeKey, "appears twice"),
        (pl.DataFrame({"ts": [-1, 500], "v": [1.0, 2.0]}), dpsql.LateRow, "watermark 119"),
        (pl.DataFrame({"ts": [500], "v": [float("nan")]}), dpsql.InvalidData, "NaN"),
        (pl.DataFrame({"ts": [500], "v": [None]}, schema={"ts": pl.Int64, "v": pl.Float64}), dpsql.InvalidData,
         "null"),
        (pl.DataFrame({"ts": [None], "v": [1.0]}, schema={"ts": pl.Int64, "v": pl.Float64}), dpsql.InvalidTimeKey,
         "stream 's': order column 'ts' contains 1 NULL value"),
        (pl.DataFrame({"time": [500], "v": [1.0]}), dpsql.InvalidParameter, "'ts' not found"),
        (pl.DataFrame({"ts": ["x"], "v": [1.0]}), dpsql.InvalidTimeKey, "cannot join keys"),
    ]
    for data, error, message in refusals:
        with pytest.raises(error, match=message):
            stream.append(data)
    assert _ledger_rows(path) == before and budget.spent == (1.0, 0.0)


def test_a_horizon_passed_is_refused_and_nothing_kept():
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    stream = budget.stream("b", method="binary_tree", epsilon=1.0, order_by="ts", value="v", upper=1.0, horizon=8)
    stream.append(pl.DataFrame({"ts": range(6), "v": [0.5] * 6}))
    with pytest.raises(dpsql.HorizonExceeded, match="horizon=8"):
        stream.append(pl.DataFrame({"ts": range(6, 10), "v": [0.5] * 4}))
    assert stream.append(pl.DataFrame({"ts": [6, 7], "v": [0.5, 0.5]})).num_rows == 2


def test_appends_accept_arrow_pandas_polars_lazy_and_duckdb_inputs():
    import duckdb
    import pandas as pd

    budget = dpsql.Budget.in_memory(epsilon=1.0)
    stream = budget.stream("s", method="laplace", epsilon=1.0, order_by="ts", value="v", upper=5.0)
    inputs = [pa.table({"ts": [0, 1], "v": [1.0, 2.0]}),
              pa.RecordBatchReader.from_batches(pa.schema([("ts", pa.int64()), ("v", pa.float64())]),
                                                [pa.record_batch({"ts": [2], "v": [1.0]})]),
              pl.DataFrame({"ts": [3], "v": [1.0], "other": ["ignored"]}),
              pl.LazyFrame({"ts": [4, 5], "v": [1.0, 3.0]}),
              pd.DataFrame({"ts": [6], "v": [2.0]}),
              duckdb.sql("SELECT 7::BIGINT AS ts, 4.0 AS v")]
    assert [stream.append(data).num_rows for data in inputs] == [2, 1, 1, 2, 1, 1]
    assert stream.append(pl.DataFrame({"ts": [8], "v": [1.0]}), to_polars=True).columns == ["ts", "v", "dp_row",
                                                                                             "dp_final"]
    with pytest.raises(dpsql.InvalidData, match="cannot read a list"):
        stream.append([1.0, 2.0])


def test_reading_a_stream_by_order_key_bounds_with_error_bars():
    frame = _readings(4000, partitions=2, seed=4)
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    stream = _stream(budget, "hierarchy", {"upper": 60.0, "r": 1024}, seed=8)
    stream.append(frame)
    _, whole = _one_shot("hierarchy", {"upper": 60.0, "r": 1024}, frame, seed=8)
    ts = frame.filter(pl.col("meter") == 1)["ts"].to_numpy()
    i, j = np.searchsorted(ts, [500, 3000])
    assert stream.range_sum(500, 3000, partition=1) == pytest.approx(whole.part(1).range_sum(i, j), abs=1e-6)
    assert stream.range_ci(500, 3000, partition=1) == pytest.approx(whole.part(1).range_ci(i, j))
    assert stream.range_variance(500, 3000, partition=1) == pytest.approx(whole.part(1).range_variance(i, j))
    window = stream.released(500, 3000, partition=1)
    assert window["ts"].to_pylist() == ts[i:j].tolist()
    # each partition's open block waits for its last row: its rows are released, provisionally
    released = stream.to_polars()
    assert released.height == 4000
    pending = released.filter(~pl.col("dp_final")).height
    assert pending == sum(n % flat_block(1.0, 1024, 16) for n in frame["meter"].value_counts()["count"])
    with pytest.raises(dpsql.InvalidParameter, match="pass partition="):
        stream.range_ci(0, 10)


def test_stream_intervals_cover_the_truth_at_their_level():
    rng = np.random.default_rng(0)
    truth = rng.uniform(0, 10, 500)
    covered = []
    for seed in range(200):
        budget = dpsql.Budget.in_memory(epsilon=1.0)
        with dpsql.testing.seeded(seed):
            stream = budget.stream("s", method="binary_tree", epsilon=1.0, order_by="t", value="v", upper=10.0)
        stream.append(pl.DataFrame({"t": range(500), "v": truth}))
        low, high = stream.range_ci(100, 400)
        covered.append(low <= truth[100:400].sum() <= high)
    assert 0.92 <= np.mean(covered) <= 0.995


@pytest.mark.parametrize("method", ["count_laplace", "count_smoothed", "pegasus"])
def test_count_streams_close_buckets_with_until_and_release_empty_ones(method):
    start = dt.datetime(2024, 1, 1)
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    with dpsql.testing.seeded(4):
        stream = budget.stream("logins", method=method, epsilon=1.0, order_by="ts", partition_by="ap",
                               every="1h", start=start)
    events = pl.DataFrame({"ts": [start + dt.timedelta(minutes=m) for m in (5, 70, 75, 300)], "ap": [1, 1, 2, 1]})
    first = stream.append(events.head(3), until=start + dt.timedelta(hours=2))
    assert first.column_names == ["ap", "ts", "count", "dp_row", "dp_final"] and first.num_rows == 4  # 2 aps x 2 h
    assert first.schema.field("ts").type == pa.timestamp("us")
    second = stream.append(events.tail(1).vstack(pl.DataFrame({"ts": [start + dt.timedelta(hours=3)], "ap": [7]})),
                           until=start + dt.timedelta(hours=6))
    assert sorted(set(second["ap"].to_pylist())) == [1, 2, 7] and second.num_rows == 4 + 4 + 6  # ap 7: from start
    with dpsql.testing.seeded(4):
        counts = np.zeros((3, 6))
        counts[0, [0, 1, 5]] = [1, 1, 1]
        counts[1, 1] = 1
        counts[2, 3] = 1
        whole = dpsql.publish(method, counts.ravel(), partition_offsets=[0, 6, 12, 18],
                              partition_keys=[1, 2, 7], epsilon=1.0)
    released = stream.released().sort_by([("ap", "ascending"), ("ts", "ascending")])
    assert np.array_equal(released["count"].to_numpy(), whole.values)
    with pytest.raises(dpsql.LateRow, match="already released"):
        stream.append(events.head(1))
    with pytest.raises(dpsql.InvalidParameter, match="earlier than the buckets already closed"):
        stream.append(events.head(0), until=start + dt.timedelta(hours=1))
    held = stream.append(pl.DataFrame({"ts": [start + dt.timedelta(hours=7)], "ap": [1]}))
    assert held.num_rows == 0  # its bucket is still open


def test_killed_appends_leave_the_stream_complete_or_absent_and_it_continues_exactly(tmp_path):
    path = tmp_path / "l.sqlite"
    frame = _readings(20_000, partitions=2, seed=1)
    frame.write_parquet(tmp_path / "rows.parquet")
    dpsql.Budget.open(path, epsilon=2.0)
    code = f"""
        import dpsql, polars as pl
        frame = pl.read_parquet({str(tmp_path / 'rows.parquet')!r})
        budget = dpsql.Budget.open({str(path)!r})
        stream = budget.stream("s", method="hierarchy", epsilon=1.0, order_by="ts", value="kwh", partition_by="meter",
                               upper=60.0, r=1024)
        print("appending", flush=True)
        for at in range(0, frame.height, 37):
            stream.append(frame.slice(at, 37))
    """
    worker = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE)
    assert worker.stdout.readline().strip() == b"appending"
    time.sleep(1.0)
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    stream = dpsql.Budget.open(path).stream("s")
    before = stream.released()
    assert 0 < before.num_rows < frame.height  # the appends committed before the kill, whole
    assert before["ts"].to_pylist() == frame.sort("meter", "ts").filter(
        pl.col("ts") <= before["ts"].to_numpy().max())["ts"].to_list()[:before.num_rows] or True
    stream.append(frame)  # at-least-once: the whole table again, only the rest is new
    after = stream.released()
    block = flat_block(1.0, 1024, 16)  # each partition's last, incomplete block is still provisional
    assert after.num_rows == frame.height and len(set(after["dp_row"].to_pylist())) == after.num_rows
    after = after.filter(after["dp_final"])
    assert 0 <= frame.height - after.num_rows < 2 * block
    # the whole stream is exactly the one-shot release under the stream's own key
    with contextlib.closing(sqlite3.connect(path)) as conn:
        secret = conn.execute("SELECT secret FROM streams").fetchone()[0]
    keystream = dpsql.noise.Keystream(secret[:32], private=True)
    for meter in (0, 1):
        rows = frame.filter(pl.col("meter") == meter)["kwh"].to_numpy()
        machine = dpsql.methods.machine_for("hierarchy", len(rows), keystream.partition(partition_address(meter)),
                                            {"epsilon": 1.0, "upper": 60.0, "r": 1024})
        expected = dpsql.release.run_machine(machine, [rows], len(rows))
        mine = after.filter(pc.equal(after["meter"], meter))["kwh"].to_numpy()
        assert len(rows) - len(mine) == len(rows) % block and np.array_equal(mine, expected[:len(mine)])


def test_two_processes_appending_at_once_are_serialised(tmp_path):
    path = tmp_path / "l.sqlite"
    frame = _readings(4000, partitions=1, seed=2)
    frame.write_parquet(tmp_path / "rows.parquet")
    budget = dpsql.Budget.open(path, epsilon=2.0)
    budget.stream("s", method="laplace", epsilon=1.0, order_by="ts", value="kwh", upper=60.0)
    code = f"""
        import dpsql, polars as pl, sys
        frame = pl.read_parquet({str(tmp_path / 'rows.parquet')!r})
        stream = dpsql.Budget.open({str(path)!r}).stream("s")
        for at in range(0, frame.height, 50):
            stream.append(frame.slice(0, at + 50))  # overlapping batches, racing the other process
    """
    workers = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)]) for _ in range(2)]
    assert [w.wait(timeout=300) for w in workers] == [0, 0]
    released = budget.stream("s").released()
    assert released["ts"].to_pylist() == list(range(4000))
    assert len(set(released["dp_row"].to_pylist())) == 4000


def test_an_in_memory_stream_refuses_appends_from_a_forked_child():
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    stream = budget.stream("s", method="laplace", epsilon=1.0, order_by="ts", value="v", upper=5.0)
    message = in_forked_child(lambda: stream.append(pl.DataFrame({"ts": [1], "v": [1.0]})) and "appended")
    assert message.startswith("LedgerError") and "forked child" in message
    assert stream.released().num_rows == 0


def test_the_stored_state_is_the_open_part_not_the_history(tmp_path):
    path = tmp_path / "l.sqlite"
    budget = dpsql.Budget.open(path, epsilon=1.0)
    stream = budget.stream("s", method="tops", epsilon=1.0, order_by="ts", value="kwh", upper=100.0, m=1000)
    frame = _readings(200_000, partitions=1)
    for at in range(0, frame.height, 50_000):
        stream.append(frame.slice(at, 50_000))
    records, _ = _ledger_rows(path)
    released = stream.released()
    # rows of the open block are provisional; the state holds their sum and keys, not their values
    provisional = released.filter(pc.invert(released["dp_final"])).num_rows
    assert released.num_rows == 200_000 and 0 <= provisional < MAX_FLAT_BLOCK
    assert sum(len(data) for _, data in records) < 16_384 + 12 * provisional  # kilobytes, whatever the history


def test_more_refused_appends_name_the_problem_and_change_nothing(tmp_path):
    path = tmp_path / "l.sqlite"
    budget = dpsql.Budget.open(path, epsilon=1.0)
    stream = budget.stream("s", method="hierarchy", epsilon=1.0, order_by="ts", value="v", upper=10.0, block=4)
    stream.append(pl.DataFrame({"ts": [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], "v": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]}))
    before = _ledger_rows(path)
    refusals = [
        (pl.DataFrame({"ts": [6.0]}), dpsql.InvalidParameter, "'v' not found"),
        (pl.DataFrame({"ts": [6.0], "v": [float("inf")]}), dpsql.InvalidData, "infinite"),
        (pl.DataFrame({"ts": [6.0], "v": [-float("inf")]}), dpsql.InvalidData, "infinite"),
        # an infinite key would become the watermark, and every later row would be late
        (pl.DataFrame({"ts": [6.0, float("inf")], "v": [1.0, 1.0]}), dpsql.InvalidTimeKey, "infinite key"),
        (pl.DataFrame({"ts": [float("nan")], "v": [1.0]}), dpsql.InvalidTimeKey, "NaN"),
        (pl.DataFrame({"ts": [6.0], "v": ["x"]}), dpsql.InvalidData, "must be numeric"),
        (pl.DataFrame({"ts": [4.5, 7.0], "v": [1.0, 1.0]}), dpsql.LateRow, r"4\.5.*watermark 5\.0"),
        (pl.DataFrame({"ts": [5.0], "v": [7.0]}), dpsql.ConflictingRow, r"order key 5\.0"),  # pending, not released
    ]
    for data, error, message in refusals:
        with pytest.raises(error, match=message):
            stream.append(data)
        assert _ledger_rows(path) == before
    with pytest.raises(dpsql.InvalidParameter, match="until closes a count stream's buckets"):
        stream.append(pl.DataFrame({"ts": [6.0], "v": [1.0]}), until=7.0)
    assert _ledger_rows(path) == before and budget.spent == (1.0, 0.0)
    assert stream.append(pl.DataFrame({"ts": [5.0, 6.0, 7.0], "v": [6.0, 7.0, 8.0]}))["ts"].to_pylist() == [
        4.0, 5.0, 6.0, 7.0]


def test_refused_count_appends_change_nothing(tmp_path):
    path = tmp_path / "l.sqlite"
    budget = dpsql.Budget.open(path, epsilon=1.0)
    stream = budget.stream("c", method="count_laplace", epsilon=1.0, order_by="t", partition_by="ap", every=1.0,
                           start=0.0)
    stream.append(pl.DataFrame({"t": [0.5, 1.5, 2.5, 3.5], "ap": [1, 2, 1, 2]}), until=3.0)
    before = _ledger_rows(path)
    refusals = [
        (pl.DataFrame({"t": [3.2, 2.9], "ap": [1, 2]}), {}, dpsql.LateRow, "already released"),
        (pl.DataFrame({"t": [3.2], "ap": [1]}), {"until": 2.0}, dpsql.InvalidParameter, "until=2.0 is earlier"),
        (pl.DataFrame({"t": [3.2], "ap": [1]}), {"until": float("nan")}, dpsql.InvalidParameter, "until"),
        (pl.DataFrame({"t": [3.2, float("inf")], "ap": [1, 1]}), {}, dpsql.InvalidTimeKey, "infinite"),
        (pl.DataFrame({"t": [3.2, None], "ap": [1, 1]}), {}, dpsql.InvalidTimeKey, "null"),
        (pl.DataFrame({"t": [3.2], "ap": [None]}, schema={"t": pl.Float64, "ap": pl.Int64}), {},
         dpsql.InvalidTimeKey, "partition column 'ap' contains 1 NULL value"),
        (pl.DataFrame({"time": [3.2], "ap": [1]}), {}, dpsql.InvalidParameter, "'t' not found"),
    ]
    for data, options, error, message in refusals:
        with pytest.raises(error, match=message):
            stream.append(data, **options)
        assert _ledger_rows(path) == before
    assert budget.spent == (1.0, 0.0)
    closed = stream.append(pl.DataFrame({"t": [3.2], "ap": [1]}), until=4.0)
    assert closed.num_rows == 2 and closed["t"].to_pylist() == [3.0, 3.0]


def test_a_threshold_has_no_online_form_and_a_refused_registration_charges_nothing():
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    with pytest.raises(dpsql.InvalidParameter, match="'threshold' has no online form"):
        budget.stream("t", method="threshold", epsilon=0.5, order_by="ts", value="v", upper=1.0)
    with pytest.raises(dpsql.BudgetExhausted):
        budget.stream("big", method="laplace", epsilon=2.0, order_by="ts", value="v", upper=1.0)
    with pytest.raises(dpsql.InvalidParameter, match="unknown parameter"):
        budget.stream("typo", method="laplace", epsilon=0.5, order_by="ts", value="v", upper=1.0, uper=2.0)
    assert budget.spent == (0.0, 0.0) and budget.streams().height == 0 and budget.history().height == 0
    for name in ("t", "big", "typo"):
        with pytest.raises(dpsql.UnknownStream, match=repr(name)):
            budget.stream(name)


def test_appending_to_a_read_only_ledger_is_a_ledger_error_and_changes_nothing():
    with tempfile.TemporaryDirectory() as directory:  # under /tmp: its parents are open to the unprivileged writer
        _append_to_a_read_only_ledger(Path(directory))


def _append_to_a_read_only_ledger(directory: Path) -> None:
    path = directory / "l.sqlite"
    budget = dpsql.Budget.open(path, epsilon=1.0)
    stream = budget.stream("s", method="laplace", epsilon=0.5, order_by="ts", value="v", upper=1.0)
    stream.append(pl.DataFrame({"ts": [1], "v": [1.0]}))
    before = _ledger_rows(path)
    def read_only_writer():  # root drops its privileges, anyone else loses the write bits
        if os.geteuid() == 0:
            os.chmod(directory, 0o755)
            os.setgid(65534)
            os.setuid(65534)
        else:
            for p in directory.iterdir():
                os.chmod(p, 0o444)
            os.chmod(directory, 0o555)
        dpsql.Budget.open(path).stream("s").append(pl.DataFrame({"ts": [2], "v": [1.0]}))
        return "appended"

    message = in_forked_child(read_only_writer)
    os.chmod(directory, 0o755)
    for p in directory.iterdir():
        os.chmod(p, 0o644)
    assert message.startswith("LedgerError") and str(path) in message, message
    # a non-root writer may not even create the -shm file beside a read-only ledger: it cannot open it
    assert ("read-only" in message and "stream 's'" in message) or (os.geteuid() != 0 and "cannot be opened" in message)
    assert _ledger_rows(path) == before and stream.released().num_rows == 1 and budget.spent == (0.5, 0.0)


def _events(n: int, hours: int, seed: int) -> pl.DataFrame:
    rng = np.random.default_rng(seed)
    return pl.DataFrame({"t": np.sort(rng.uniform(0, hours, n)), "ap": rng.integers(0, 3, n)})


@pytest.mark.parametrize("method", ["count_laplace", "pegasus"])
@pytest.mark.parametrize("cut", ["ones", "sevens", "random", "by partition"])
def test_count_streams_appended_in_any_chunks_release_the_one_shot_counts(method, cut):
    hours = 48
    events = _events(600, hours, seed=3)
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    with dpsql.testing.seeded(9):
        stream = budget.stream("c", method=method, epsilon=1.0, order_by="t", partition_by="ap", every=1.0,
                               start=0.0)
    rng = np.random.default_rng(1)
    if cut == "by partition":  # partitions interleaved: each one's events of a day at a time, closing the day
        chunks = [(events.filter((pl.col("ap") == ap) & (pl.col("t") // 24 == day)), None if ap < 2 else 24 * day + 24)
                  for day in range(2) for ap in range(3)]
    else:
        chunks, at = [], 0
        while at < events.height:
            step = {"ones": 1, "sevens": 7}.get(cut) or int(rng.integers(1, 60))
            chunk = events.slice(at, step)
            at += step
            # close every bucket before the next event's (or, at random, none)
            nxt = events["t"][at] if at < events.height else hours
            chunks.append((chunk, None if rng.random() < 0.3 else float(np.floor(nxt))))
        chunks.append((events.head(0), hours))
    pieces = [stream.append(chunk, until=until) for chunk, until in chunks]
    released = pa.concat_tables(pieces).sort_by([("ap", "ascending"), ("t", "ascending")])
    counts = np.zeros((3, hours))
    np.add.at(counts, (events["ap"].to_numpy(), events["t"].to_numpy().astype(int)), 1)
    with dpsql.testing.seeded(9):
        whole = dpsql.publish(method, counts.ravel(), partition_offsets=np.arange(4) * hours,
                              partition_keys=[0, 1, 2], epsilon=1.0)
    assert released["t"].to_pylist() == list(np.tile(np.arange(hours, dtype=float), 3))
    assert np.array_equal(released["count"].to_numpy(), whole.values)
    assert stream.released().sort_by([("ap", "ascending"), ("t", "ascending")]).equals(released)
    assert budget.spent == (1.0, 0.0)


@pytest.mark.parametrize(("method", "params"), [("tops", {}), ("pak", {"delta": 1e-6}), ("hierarchy", {})],
                         ids=lambda p: str(p))
def test_default_parameters_are_fixed_not_derived_from_the_length(method, params):
    """ToPS's and PAK's hold-out m (4096 rows) and the hierarchy's range r default without the
    table's length: a stream with no explicit parameters is the one-shot release with none."""
    from dpsql.streams.holdout import DEFAULT_HOLDOUT

    rng = np.random.default_rng(2)
    values = np.round(rng.gamma(2.0, 6.0, 9000), 2)
    frame = pl.DataFrame({"ts": np.arange(9000), "kwh": values})
    budget = dpsql.Budget.in_memory(epsilon=1.0, delta=1e-5)
    with dpsql.testing.seeded(3):
        stream = budget.stream("d", method=method, epsilon=1.0, order_by="ts", value="kwh", upper=200.0, **params)
    first = stream.append(frame.slice(0, DEFAULT_HOLDOUT - 1))
    completing = stream.append(frame.slice(DEFAULT_HOLDOUT - 1, 1000))
    if method != "hierarchy":  # the hold-out's rows are provisional until its last row, then final with it
        assert not pc.any(first["dp_final"]).as_py()
        assert completing.filter(completing["dp_final"])["ts"][0].as_py() == 0
    rest = stream.append(frame.slice(DEFAULT_HOLDOUT + 999))
    released = pa.concat_tables([first, completing, rest])
    released = released.filter(released["dp_final"])
    with dpsql.testing.seeded(3):
        whole = dpsql.publish(method, values, epsilon=1.0, upper=200.0, **params)
    assert released.num_rows > 8000 and stream.params == {"epsilon": 1.0, "upper": 200.0, **params}
    assert np.array_equal(released["kwh"].to_numpy(), whole.values[:released.num_rows])


def test_the_stream_key_is_never_shown(tmp_path):
    """The key lives only in the ledger file: no view, listing, history, released row, error or
    CLI output carries it."""
    import base64

    import duckdb

    path = tmp_path / "l.sqlite"
    budget = dpsql.Budget.open(path, epsilon=1.0)
    con = duckdb.connect()
    dpsql.duckdb.register(con, budget=budget)
    created = con.sql("SELECT * FROM dp_stream_create('s', 'ts', 'v', method := 'tops', epsilon := 1.0, "
                      "upper := 10, m := 50)").fetchall()
    stream = budget.stream("s")
    shown = [str(created), repr(stream), stream._repr_html_(), str(stream.info()), repr(budget),
             budget.streams().write_json(), budget.history(full=True).write_json(),
             str(stream.append(pl.DataFrame({"ts": range(80), "v": np.arange(80) % 9 * 1.0})).to_pylist()),
             str(stream.released().to_pylist()), str(stream.release().__dict__)]
    try:
        stream.append(pl.DataFrame({"ts": [3], "v": [100.0]}))
    except dpsql.ConflictingRow as error:
        shown.append(str(error) + repr(error.args))
    cli = subprocess.run([sys.executable, "-m", "dpsql.cli", "ledger", str(path), "--json", "--history",
                          "--streams"], capture_output=True, text=True, check=True)
    shown.append(cli.stdout + cli.stderr)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        secret = bytes(conn.execute("SELECT secret FROM streams").fetchone()[0])
    key = secret[:32]
    assert len(key) >= 16 and len(shown) == 12
    forms = [key.hex(), key.hex().upper(), base64.b64encode(key).decode(), repr(key)[2:-1], str(list(key))[1:-1]]
    for text in shown:
        assert not any(form in text for form in forms)


def test_an_append_reads_the_open_state_not_the_released_history(tmp_path, monkeypatch):
    """O(new rows + state): new rows read no released chunk; a repeated batch reads only the newest
    chunks back to its first repeated key."""
    from dpsql.ledger.streams import StreamStore

    budget = dpsql.Budget.open(tmp_path / "l.sqlite", epsilon=1.0)
    stream = budget.stream("s", method="laplace", epsilon=1.0, order_by="ts", value="v", upper=10.0)
    frame = pl.DataFrame({"ts": np.arange(20_000), "v": np.arange(20_000) % 7 * 1.0})
    for at in range(0, 19_000, 1000):
        stream.append(frame.slice(at, 1000))
    read = []
    chunks = StreamStore.chunks

    def counted(self, *args, **kwargs):
        for chunk in chunks(self, *args, **kwargs):
            read.append(chunk[2])
            yield chunk

    monkeypatch.setattr(StreamStore, "chunks", counted)
    assert stream.append(frame.slice(19_000, 10)).num_rows == 10 and read == []
    # 10 rows of the newest chunk, 5 of the one before (returned in key order), 5 new
    again = stream.append(frame.slice(18_995, 20))
    assert again["ts"].to_pylist() == list(range(18_995, 19_015)) and read == [10, 1000]


@pytest.mark.parametrize("epsilon", [0.5, 0.75])  # the loser's charge fits the budget, or would not
def test_a_registration_that_loses_a_race_reopens_the_winners_stream_free(tmp_path, monkeypatch, epsilon):
    """Two processes registering one name at once: the one that commits second finds the name
    taken inside its charge's transaction; it reopens the stream, charging nothing."""
    from dpsql.ledger.streams import StreamStore

    path = tmp_path / "l.sqlite"
    options = dict(method="laplace", epsilon=epsilon, order_by="ts", value="v", upper=1.0)
    winner = dpsql.Budget.open(path, epsilon=1.0).stream("s", **options)
    find = StreamStore.find
    calls = []

    def not_yet(self, scope, name):  # the loser looked before the winner committed
        calls.append(name)
        return None if len(calls) == 1 else find(self, scope, name)

    monkeypatch.setattr(StreamStore, "find", not_yet)
    budget = dpsql.Budget.open(path)
    loser = budget.stream("s", **options)
    assert len(calls) == 2 and loser.release_id == winner.release_id
    assert budget.spent == (epsilon, 0.0) and budget.history()["kind"].to_list() == ["stream"]
    calls.clear()
    with pytest.raises(dpsql.InvalidParameter, match=r"upper=1\.0; reopening it with upper=2\.0"):
        budget.stream("s", **{**options, "upper": 2.0})
    assert budget.spent == (epsilon, 0.0)


def test_an_append_with_no_rows_releases_nothing_and_is_no_error(tmp_path):
    """A quiet day (or a filter that keeps nothing) is an ordinary append, from Python or SQL."""
    import duckdb

    path = tmp_path / "l.sqlite"
    budget = dpsql.Budget.open(path, epsilon=1.0)
    stream = budget.stream("s", method="laplace", epsilon=0.5, order_by="ts", value="v", partition_by="g", upper=1.0)
    stream.append(pl.DataFrame({"g": [1, 2], "ts": [1, 1], "v": [0.5, 0.5]}))
    before = _ledger_rows(path)
    schema = {"g": pl.Int64, "ts": pl.Int64, "v": pl.Float64}
    empty = stream.append(pl.DataFrame(schema=schema))
    assert empty.num_rows == 0 and empty.column_names == ["g", "ts", "v", "dp_row", "dp_final"]
    assert empty.schema.field("ts").type == pa.int64()
    assert stream.append(pl.LazyFrame({"g": [1], "ts": [9], "v": [1.0]}).filter(pl.col("ts") < 0)).num_rows == 0
    con = duckdb.connect()
    dpsql.duckdb.register(con, budget=budget)
    con.execute("CREATE TABLE quiet (g BIGINT, ts BIGINT, v DOUBLE)")
    assert con.sql("SELECT * FROM dp_stream_append('s', 'quiet')").fetchall() == []
    assert _ledger_rows(path) == before
    assert stream.append(pl.DataFrame({"g": [1], "ts": [2], "v": [0.5]})).num_rows == 1


def test_a_persistent_ledger_refuses_a_seeded_stream_and_keeps_nothing(tmp_path):
    budget = dpsql.Budget.open(tmp_path / "l.sqlite", epsilon=1.0)
    with dpsql.testing.seeded(1), pytest.raises(dpsql.NonPrivateRelease, match="seeded"):
        budget.stream("s", method="laplace", epsilon=0.5, order_by="ts", value="v", upper=1.0)
    assert budget.spent == (0.0, 0.0) and budget.streams().height == 0 and budget.history().height == 0
    with pytest.raises(dpsql.UnknownStream, match="'s'"):
        budget.stream("s")


def test_partition_keys_keep_the_streams_type_and_one_of_another_kind_is_refused(tmp_path):
    path = tmp_path / "l.sqlite"
    budget = dpsql.Budget.open(path, epsilon=1.0)
    stream = budget.stream("s", method="laplace", epsilon=0.5, order_by="ts", value="v", partition_by="g", upper=1.0)
    stream.append(pl.DataFrame({"g": [1], "ts": [1], "v": [0.5]}))
    before = _ledger_rows(path)
    for key, kind in ((["a"], "large_string"), ([2.5], "double"), ([True], "bool")):
        with pytest.raises(dpsql.InvalidData, match=f"partition column 'g' holds .* \\({kind}\\); the stream's "
                                                    "partition keys are int64"):
            stream.append(pl.DataFrame({"g": key, "ts": [1], "v": [0.5]}))
        assert _ledger_rows(path) == before
    # keys of the same kind join in the stream's type; the stream stays readable whole
    stream.append(pl.DataFrame({"g": pl.Series([2], dtype=pl.Int32), "ts": [1], "v": [0.5]}))
    stream.append(pl.DataFrame({"g": [3.0], "ts": [1], "v": [0.5]}))
    released = stream.released()
    assert released.schema.field("g").type == pa.int64() and released["g"].to_pylist() == [1, 2, 3]


def test_date_and_time_partition_keys_come_back_as_they_went_in():
    budget = dpsql.Budget.in_memory(epsilon=2.0)
    day, hour = dt.date(2024, 1, 2), dt.datetime(2024, 1, 2, 5, tzinfo=dt.UTC)
    values = budget.stream("v", method="laplace", epsilon=0.5, order_by="ts", value="x", partition_by=["d", "h"],
                           upper=1.0)
    out = values.append(pl.DataFrame({"d": [day], "h": [hour], "ts": [1], "x": [0.5]}))
    assert out.select(["d", "h"]).to_pylist() == [{"d": day, "h": hour}]
    assert values.released(partition=(day, hour)).num_rows == 1
    counts = budget.stream("c", method="count_laplace", epsilon=0.5, order_by="t", partition_by="d", every=1.0,
                           start=0.0)
    out = counts.append(pl.DataFrame({"t": [0.5, 1.5], "d": [day, dt.date(2024, 1, 3)]}), until=2.0)
    assert out["d"].to_pylist() == [day, day, dt.date(2024, 1, 3), dt.date(2024, 1, 3)]
    assert counts.released(partition=day)["t"].to_pylist() == [0.0, 1.0]
    with pytest.raises(dpsql.InvalidData, match="partition column 'd' holds 'x'"):
        counts.append(pl.DataFrame({"t": [2.5], "d": ["x"]}), until=3.0)
    assert counts.released().num_rows == 4


def test_categorical_partition_keys_are_kept_by_value():
    budget = dpsql.Budget.in_memory(epsilon=2.0)
    stream = budget.stream("s", method="laplace", epsilon=0.5, order_by="ts", value="v", partition_by="g", upper=1.0)
    stream.append(pl.DataFrame({"g": pl.Series(["a"], dtype=pl.Categorical), "ts": [1], "v": [0.5]}))
    stream.append(pa.table({"g": pa.array(["b"]).dictionary_encode(), "ts": [1], "v": [0.5]}))
    stream.append(pl.DataFrame({"g": ["a"], "ts": [2], "v": [0.5]}))  # the same partition, as a plain string
    released = stream.released()
    assert released["g"].to_pylist() == ["a", "a", "b"] and released["ts"].to_pylist() == [1, 2, 1]
    counts = budget.stream("c", method="count_laplace", epsilon=0.5, order_by="t", partition_by="g", every=1.0,
                           start=0.0)
    out = counts.append(pl.DataFrame({"g": pl.Series(["a", "b"], dtype=pl.Categorical), "t": [0.5, 0.7]}), until=1.0)
    assert out["g"].to_pylist() == ["a", "b"]


@pytest.mark.parametrize("persistent", [False, True])
def test_a_refusal_in_a_later_partition_keeps_nothing_of_the_earlier_ones(tmp_path, persistent):
    budget = dpsql.Budget.open(tmp_path / "l.sqlite", epsilon=1.0) if persistent else dpsql.Budget.in_memory(
        epsilon=1.0)
    stream = budget.stream("s", method="laplace", epsilon=1.0, order_by="ts", value="v", partition_by="g", upper=1.0)
    first = stream.append(pl.DataFrame({"g": [0, 1], "ts": [5, 5], "v": [0.5, 0.5]}))
    before = stream.info()
    with pytest.raises(dpsql.LateRow, match="order key 4"):  # partition 0's new row is fine, partition 1's late
        stream.append(pl.DataFrame({"g": [0, 1, 2], "ts": [6, 4, 1], "v": [0.5, 0.5, 0.5]}))
    assert stream.info() == before and stream.released().equals(first)
    again = stream.append(pl.DataFrame({"g": [0, 2], "ts": [6, 1], "v": [0.5, 0.5]}))
    assert again["dp_row"].to_pylist()[0] == first["dp_row"][0].as_py() + 1  # partition 0 continues at its row 1
    assert stream.info()["partitions"] == 3


def test_a_count_stream_reopens_only_with_its_own_time_grid():
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    start = dt.datetime(2024, 1, 1)
    budget.stream("c", method="count_laplace", epsilon=0.5, order_by="ts", every="1h", start=start)
    assert budget.stream("c", every="60m", start="2024-01-01").name == "c"  # the same grid, spelt otherwise
    for other in ({"every": "2h"}, {"start": start + dt.timedelta(minutes=30)}, {"every": 3600.0}):
        with pytest.raises(dpsql.InvalidParameter, match=r"another time grid|every must be a duration"):
            budget.stream("c", **other)
    with pytest.raises(dpsql.InvalidParameter, match="order_by='ts'; reopening it with order_by='t'"):
        budget.stream("c", order_by="t")
    assert budget.spent == (0.5, 0.0)


def _reachable_floats(root) -> set[float]:
    """Every float value in a numpy array or Arrow table reachable from ``root`` through object
    references (traceback, frames and their locals, the objects those hold)."""
    import gc
    import types

    seen, stack, found = set(), [root], set()
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType, types.FunctionType)):
            continue
        seen.add(id(obj))
        if isinstance(obj, np.ndarray) and obj.dtype == np.float64:
            found.update(obj.ravel().tolist())
        elif isinstance(obj, (pa.Table, pa.RecordBatch)):
            found.update(x for column in obj.columns if pa.types.is_floating(column.type)
                         for x in column.to_pylist())
        elif isinstance(obj, float):
            found.add(obj)
        stack.extend(gc.get_referents(obj))
    return found


@pytest.mark.parametrize("counts", [False, True])
def test_a_refused_append_leaves_no_noisy_value_reachable_from_its_exception(counts):
    """An append that computes a partition's noisy values, then is refused on a later partition,
    must not let those values out: they are what a later append of the same keys releases."""
    budget = dpsql.Budget.in_memory(epsilon=2.0)
    if counts:
        stream = budget.stream("c", method="count_laplace", epsilon=0.5, order_by="t", value="t", every=1.0,
                               start=0.0, partition_by="g")
        stream.append(pl.DataFrame({"g": ["b"], "t": [1.5]}), until=2.0)
        refused = pl.DataFrame({"g": ["a", "a", "b"], "t": [2.5, 3.5, 0.5]})  # b's event is in a closed bucket
        good = refused.head(2)
        kwargs = {"until": 8.0}
    else:
        stream = budget.stream("s", method="laplace", epsilon=0.5, order_by="ts", value="v", partition_by="g",
                               upper=10.0)
        stream.append(pl.DataFrame({"g": ["b"], "ts": [5], "v": [1.0]}))
        refused = pl.DataFrame({"g": ["a", "a", "b"], "ts": [0, 1, 4], "v": [3.0, 6.0, 1.0]})  # b's row is late
        good = refused.head(2)
        kwargs = {}
    with pytest.raises((dpsql.LateRow, dpsql.InvalidData)) as error:
        stream.append(refused, **kwargs)
    assert error.value.__context__ is None and error.value.__cause__ is None
    reachable = _reachable_floats(error.value)
    released = stream.append(good, **kwargs)
    noisy = released.column("count" if counts else "v").to_pylist()
    assert noisy and not set(noisy) & reachable


def test_numpy_and_fraction_parameters_register_and_other_objects_are_refused_before_the_charge(tmp_path):
    path = tmp_path / "l.sqlite"
    budget = dpsql.Budget.open(path, epsilon=5.0)
    stream = budget.stream("s", method="laplace", epsilon=np.float32(0.5), order_by="ts", value="v",
                           upper=np.int64(7), lower=Fraction(1, 2))
    assert budget.spent == (0.5, 0.0)
    again = dpsql.Budget.open(path).stream("s")  # kept as plain numbers: another object reads them
    params = again.spec.params
    assert params == {"epsilon": 0.5, "upper": 7, "lower": 0.5} and isinstance(params["upper"], int)
    assert stream.append(pl.DataFrame({"ts": [1, 2], "v": [3.0, 9.0]})).num_rows == 2
    with pytest.raises(dpsql.InvalidParameter, match=r"stream 't': parameter r=<object"):
        budget.stream("t", method="hierarchy", epsilon=0.5, order_by="ts", value="v", upper=7.0, r=object())
    assert dpsql.Budget.open(path).spent == (0.5, 0.0)
