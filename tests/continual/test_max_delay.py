"""A stream's ``max_delay``: no row stays provisional longer than it, whatever the appends; the final
values do not depend on how the table was cut into appends; what it forbids is refused naming it,
and a refused registration charges nothing."""

from __future__ import annotations

import datetime as dt

import duckdb
import numpy as np
import polars as pl
import pyarrow.compute as pc
import pytest

import dpsql
from dpsql.methods import GRID_METHODS, METHODS, check_method
from dpsql.release import StreamMachine

HOUR = np.timedelta64(1, "h")
START = np.datetime64("2024-01-30T05:00", "us")

# (method, params, max_delay in rows) for 24 as rows and "1d" on an hourly grid, and shorter than a day
CASES = [
    ("laplace", {"upper": 60.0}),
    ("hierarchy", {"upper": 60.0}),
    ("hierarchy", {"upper": 60.0, "calendar": "none"}),
    ("tops", {"upper": 200.0, "m": 300}),  # the hold-out outlasts max_delay: released at the bound as it comes
    ("tops", {"upper": 200.0, "m": 20}),  # the hold-out (a fleet's pool) completes within max_delay
    ("tops", {"upper": 200.0, "m": 300, "threshold_by": "partition"}),
    ("pak", {"upper": 200.0, "m": 300, "delta": 1e-6}),
]
#: Each case on one stream (0 meters) and on a fleet of 5; threshold_by is a fleet's choice only.
FLEET_CASES = [(method, params, meters) for method, params in CASES for meters in (0, 5)
               if meters or not params.get("threshold_by")]


def _hourly(meters: int, hours: int, seed: int = 0) -> pl.DataFrame:
    """Hourly readings of ``meters`` meters (partitioned) or one stream (``meters=0``), in time order;
    meter ``k`` starts ``k`` hours late, so partitions sit at different hours of their days."""
    rng = np.random.default_rng(seed)
    if not meters:
        return pl.DataFrame({"ts": START + np.arange(hours) * HOUR, "kwh": np.round(rng.gamma(2.0, 6.0, hours), 2)})
    meter = np.repeat(np.arange(meters), hours)
    ts = START + (np.tile(np.arange(hours), meters) + meter) * HOUR
    frame = pl.DataFrame({"meter": meter, "ts": ts, "kwh": np.round(rng.gamma(2.0, 6.0, meters * hours), 2)})
    return frame.sort(["ts", "meter"])


def _stream(budget, name, method, params, meters, max_delay, seed=3):
    with dpsql.testing.seeded(seed):
        return budget.stream(name, method=method, epsilon=1.0, order_by="ts", value="kwh",
                             partition_by="meter" if meters else None, max_delay=max_delay, **params)


def _append_in_random_hours(stream, frame, rng, check=None):
    """Append ``frame`` a random number of whole hours at a time (time order, as a fleet is appended),
    the first append bringing every partition's first rows (more than one: a partition's grid, and
    with it its layout, is read from its first append)."""
    times = frame["ts"].to_numpy()
    hours = np.unique(times)
    at = 0
    while at < len(hours):
        step = int(rng.integers(1, 40)) if at else 8
        first, stop = np.searchsorted(times, hours[at]), np.searchsorted(times, hours[min(at + step, len(hours)) - 1],
                                                                         side="right")
        piece = frame.slice(int(first), int(stop - first))
        out = stream.append(piece)
        assert out.num_rows >= piece.height  # every new row gets a value from the append that brings it
        at += step
        if check is not None:
            check(stream)


def _provisional_within(rows: int):
    def check(stream):
        released = pl.from_arrow(stream.released())
        keys = [c for c in ("meter",) if c in released.columns]
        if keys:
            released = released.with_columns(pl.col("ts").rank("ordinal").over(keys).alias("row"),
                                              pl.len().over(keys).alias("rows"))
        else:
            released = released.with_columns(pl.col("ts").rank("ordinal").alias("row"), pl.lit(len(released))
                                              .alias("rows"))
        waiting = released.filter(~pl.col("dp_final"))
        # a provisional row is among its partition's last rows - 1 rows: none waits for max_delay - 1 later rows
        # (on an hourly grid: a row at t is provisional only while its partition's keys stay below t + max_delay - 1h)
        assert (waiting["rows"] - waiting["row"] < rows - 1).all(), waiting.select("ts", "row", "rows")
    return check


@pytest.mark.parametrize(("method", "params", "meters"), FLEET_CASES, ids=str)
@pytest.mark.parametrize(("max_delay", "rows"), [(24, 24), ("1d", 24), ("6h", 6), (dt.timedelta(hours=30), 30)])
def test_no_row_stays_provisional_longer_than_max_delay(method, params, meters, max_delay, rows):
    frame = _hourly(meters, 300 if meters else 900)
    budget = dpsql.Budget.in_memory(epsilon=2.0, delta=1e-5)
    stream = _stream(budget, "s", method, params, meters, max_delay)
    _append_in_random_hours(stream, frame, np.random.default_rng(rows), _provisional_within(rows))
    assert stream.released().num_rows == frame.height
    assert budget.spent == (1.0, params.get("delta", 0.0))


@pytest.mark.parametrize(("method", "params", "meters"), FLEET_CASES, ids=str)
def test_final_values_do_not_depend_on_the_appends(method, params, meters):
    frame = _hourly(meters, 200 if meters else 700, seed=1)
    budget = dpsql.Budget.in_memory(epsilon=4.0, delta=1e-4)
    chunked = _stream(budget, "chunked", method, params, meters, "1d")
    _append_in_random_hours(chunked, frame, np.random.default_rng(5))
    whole = _stream(budget, "whole", method, params, meters, "1d")
    whole.append(frame)
    one, other = (pl.from_arrow(s.released()) for s in (chunked, whole))
    assert one["dp_final"].to_list() == other["dp_final"].to_list()
    final = one.filter(pl.col("dp_final"))
    assert final.height > frame.height * 0.9
    assert final["kwh"].to_list() == other.filter(pl.col("dp_final"))["kwh"].to_list()
    if method in GRID_METHODS or method == "laplace":  # grids found by default: max_delay in rows is the same
        rows = _stream(budget, "rows", method, params, meters, 24)
        rows.append(frame)
        assert pl.from_arrow(rows.released())["kwh"].to_list() == other["kwh"].to_list()


def test_a_fleet_appended_daily_is_final_at_the_end_of_each_day_with_max_delay_one_day():
    """Hourly meters appended a day at a time (midnight to midnight): with max_delay='1d' every row is
    final in the append that brings it, the pooled hold-out's rows too (released at the bound)."""
    meters, days = 60, 4  # the pool of 4,096 rows fills on the third day
    ts = np.datetime64("2024-03-01T00:00", "us") + np.arange(24 * days) * HOUR
    frame = pl.DataFrame({"meter": np.repeat(np.arange(meters), len(ts)), "ts": np.tile(ts, meters),
                          "kwh": np.random.default_rng(0).gamma(2.0, 6.0, meters * len(ts))}).sort(["ts", "meter"])
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    stream = _stream(budget, "fleet", "tops", {"upper": 200.0}, meters, "1d")
    for day in range(days):
        out = stream.append(frame.filter(pl.col("ts").dt.day() == day + 1))
        assert out.num_rows == meters * 24 and pc.all(out["dp_final"]).as_py(), day
    release = stream.release(partition=0)
    assert release.params["holdout_at_bound"] and release.threshold < 200.0


def test_a_hold_out_released_at_the_bound_has_its_error_model():
    """The rows released at the bound before the threshold is known: their intervals are the noise of a
    hierarchy at the bound, exact, and cover the values clipped at the bound."""
    frame = _hourly(0, 600, seed=4)
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    stream = _stream(budget, "s", "tops", {"upper": 200.0, "m": 300}, 0, "1d")
    stream.append(frame.slice(0, 100))  # the hold-out is still filling: its first days are final
    release = stream.release()
    assert release.threshold is None and release.params["holdout_at_bound"]
    low, high = stream.range_ci(frame["ts"][0], frame["ts"][19])  # the first (short) day: 19 rows, final
    assert high - low > 0 and release.range_variance(0, 19) > 0
    assert release.error.range_bias_bound(np.array([0]), np.array([19]))[0] == 0  # a whole block: noise only


def test_a_tops_stream_on_a_time_grid_keeps_its_hold_out_length():
    """(A stream's partitions on a grid got machines without the stream's m: the default 4,096 instead.)"""
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    with dpsql.testing.seeded(1):
        stream = budget.stream("s", method="tops", epsilon=1.0, order_by="ts", value="v", upper=100.0, m=50)
    out = stream.append(pl.DataFrame({"ts": START + np.arange(200) * HOUR, "v": np.full(200, 5.0)}))
    assert stream.release().params["m"] == 50 and pc.sum(out["dp_final"]).as_py() >= 100


@pytest.mark.parametrize(("max_delay", "match"), [(0, "max_delay must be >= 1"), (-2, "max_delay must be >= 1"),
                                                  (True, "max_delay must be"), (1.5, "max_delay must be"),
                                                  ("soon", "max_delay must be a duration"),
                                                  ("0h", "max_delay must be a positive duration"),
                                                  (dt.timedelta(hours=-1), "max_delay must be a positive")])
def test_a_max_delay_that_is_no_delay_is_refused_before_anything_is_charged(max_delay, match):
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    with pytest.raises(dpsql.InvalidParameter, match=match):
        budget.stream("s", method="hierarchy", epsilon=0.5, order_by="ts", value="v", upper=1.0, max_delay=max_delay)
    assert budget.spent == (0.0, 0.0) and budget.streams().height == 0


def test_what_max_delay_forbids_at_registration_is_refused_and_charges_nothing():
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    refusals = [
        (dict(method="hierarchy", upper=1.0, block=48, max_delay=24), "max_delay=24"),
        (dict(method="hierarchy", upper=1.0, depth=2, max_delay="1d", grid=("2024-01-01", "1h")), "max_delay=24"),
        (dict(method="hierarchy", upper=1.0, max_delay="90m", grid=("2024-01-01", "1h")), "max_delay='90m'"),
        (dict(method="count_laplace", every="1h", start="2024-01-01", max_delay=24, value=None), "max_delay"),
    ]
    for params, match in refusals:
        params = {"value": "v", **params}
        with pytest.raises(dpsql.InvalidParameter, match=match):
            budget.stream("s", epsilon=0.5, order_by="ts", **params)
    assert budget.spent == (0.0, 0.0) and budget.streams().height == 0
    budget.stream("s", method="hierarchy", epsilon=0.5, order_by="ts", value="v", upper=1.0, max_delay="1d")
    with pytest.raises(dpsql.InvalidParameter, match="max_delay='1d'"):
        budget.stream("s", max_delay=12)
    assert budget.stream("s", max_delay=dt.timedelta(days=1)).spec.max_delay == "1d"


def test_a_partition_s_first_row_alone_is_final_at_once_with_a_duration():
    """Its step (so max_delay in rows) is unknown from one key: it gets blocks of one row, which any
    duration allows."""
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    stream = _stream(budget, "s", "hierarchy", {"upper": 60.0}, 0, "1d")
    first = stream.append(pl.DataFrame({"ts": START + np.arange(1) * HOUR, "kwh": [3.0]}))
    assert pc.all(first["dp_final"]).as_py()
    later = stream.append(pl.DataFrame({"ts": START + np.arange(1, 30) * HOUR, "kwh": np.full(29, 3.0)}))
    assert pc.all(later["dp_final"]).as_py() and stream.release().params["max_delay"] == 1


@pytest.mark.parametrize(("keys", "max_delay", "match"), [
    (np.arange(48), "1d", "not readings on a regular clock"),  # numbers
    (np.delete(START + np.arange(49) * HOUR, 7), "1d", "not readings on a regular clock"),  # a gap
    (START + np.arange(48) * np.timedelta64(7, "m"), "1d", "not readings on a regular clock"),  # 7m: no grid
    (START + np.arange(48) * HOUR, "90m", "not a whole number of the keys' step"),
])
def test_a_duration_the_keys_cannot_hold_refuses_the_append_and_keeps_nothing(keys, max_delay, match):
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    stream = budget.stream("s", method="hierarchy", epsilon=0.5, order_by="ts", value="v", upper=1.0,
                           max_delay=max_delay)
    with pytest.raises(dpsql.InvalidParameter, match=f"max_delay='{max_delay}'.*{match}"):
        stream.append(pl.DataFrame({"ts": keys, "v": np.ones(len(keys))}))
    assert stream.released().num_rows == 0 and budget.spent == (0.5, 0.0)
    if max_delay == "1d":
        stream.append(pl.DataFrame({"ts": START + np.arange(48) * HOUR, "v": np.ones(48)}))  # keys on a grid: fine
        with pytest.raises(dpsql.InvalidTimeKey, match="leaves its partition's time grid"):  # and it keeps that grid
            stream.append(pl.DataFrame({"ts": START + np.arange(60, 61) * HOUR, "v": [1.0]}))


def test_every_method_that_holds_no_row_back_meets_any_max_delay():
    """Methods without a max_delay parameter release every row final when it arrives."""
    from dpsql.continual.delay import holds_rows

    for method, factory in METHODS.items():
        try:
            check_method(method, per_row=True, online=True)
        except dpsql.InvalidParameter:
            continue  # no continual stream of values
        if not holds_rows(method):
            assert getattr(factory, "provisional", StreamMachine.provisional) is StreamMachine.provisional, method


def test_sql_creates_streams_with_max_delay_in_rows_durations_and_intervals():
    budget = dpsql.Budget.in_memory(epsilon=3.0)
    con = duckdb.connect()
    dpsql.register(con, budget=budget)
    con.execute("CREATE TABLE readings AS SELECT TIMESTAMP '2024-01-01 05:00' + INTERVAL (range) HOUR AS ts, "
                "(range % 7)::DOUBLE AS v FROM range(100)")
    for name, given, stored in (("a", "24", 24), ("b", "'1d'", "1d"), ("c", "INTERVAL 6 HOUR", "6h")):
        con.sql(f"SELECT * FROM dp_stream_create('{name}', 'ts', 'v', method := 'hierarchy', epsilon := 0.5, "
                f"upper := 7, max_delay := {given})").fetchall()
        assert budget.stream(name).spec.max_delay == stored
        out = con.sql(f"SELECT ts, dp_final FROM dp_stream_append('{name}', 'readings') ORDER BY ts").pl()
        waiting = out.filter(~pl.col("dp_final"))
        assert waiting.height < (24 if stored != "6h" else 6)
    with pytest.raises(dpsql.InvalidParameter, match="max_delay"):
        con.sql("SELECT * FROM dp_stream_create('d', 'ts', 'v', method := 'hierarchy', epsilon := 0.5, upper := 7, "
                "max_delay := 0)").fetchall()
    assert budget.spent[0] == 1.5
