"""Count streams from SQL (dp_count_stream) and Polars (dpsql.count_stream): same release as the core."""

from __future__ import annotations

import datetime as dt

import duckdb
import numpy as np
import polars as pl
import pytest

import dpsql
import dpsql.duckdb
import dpsql.polars  # the .dpsql namespace
from dpsql import testing
from dpsql.counts import bucket_events, release_event_counts, time_domain

START, STOP = dt.datetime(2024, 5, 1), dt.datetime(2024, 5, 1, 4)


@pytest.fixture(scope="module")
def events():
    rng = np.random.default_rng(0)
    n = 3000
    seconds = rng.integers(-600, 4 * 3600 + 600, n)  # some events fall outside the domain
    return pl.DataFrame({
        "ts": [START + dt.timedelta(seconds=int(s)) for s in seconds],
        "building": rng.choice(["B1", "B2"], n),
        "room": rng.choice(["r1", "r2", "r3"], n),
        "uid": rng.integers(0, 40, n),
    })


def core(events, **options):
    frame = events
    keys = options.pop("keys", [])
    with testing.seeded(5):
        return release_event_counts(frame["ts"].to_numpy(), start=START, stop=STOP,
                                    keys={k: frame[k].to_numpy() for k in keys}, order_by="ts",
                                    **options).columns()


# -- Polars -------------------------------------------------------------------------------------


def test_polars_equals_core_release(events):
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    with testing.seeded(5):
        out = dpsql.count_stream(events.lazy(), "ts", every="15m", start=START, stop=STOP, epsilon=1.0,
                                 partition_by="building", smoother="js", window=4, alarm_threshold=100,
                                 budget=budget)
    want = core(events, every="15m", epsilon=1.0, keys=["building"], smoother="js", window=4, alarm_threshold=100)
    assert budget.spent == (1.0, 0.0)
    assert out.columns == list(want)
    np.testing.assert_array_equal(out["dp_count"].to_numpy(), want["dp_count"])
    np.testing.assert_array_equal(out["dp_alarm"].to_numpy(), want["dp_alarm"])
    assert out.schema["ts"] == events.schema["ts"] and out.schema["building"] == pl.String
    assert out["ts"][:2].to_list() == [START, START + dt.timedelta(minutes=15)]
    assert out.height == 2 * 16


def test_polars_hierarchy_levels_and_nulls(events):
    budget = dpsql.Budget.in_memory(epsilon=0.9)
    with testing.seeded(6):
        out = dpsql.count_stream(events, "ts", every="1h", start=START, stop=STOP, epsilon=0.9,
                                 partition_by=["building", "room"], hierarchy=True, budget=budget)
    assert budget.spent == (0.9, 0.0) and len(budget.history()) == 1
    assert out.group_by("dp_level").len().sort("dp_level")["len"].to_list() == [2 * 4, 6 * 4]
    assert out.filter(pl.col("dp_level") == 1)["room"].null_count() == 8


def released_counts(counts, seed=0, **params):
    """The release of the bucket counts ``counts`` (the oracle of a front end's count stream)."""
    with testing.seeded(seed):
        return dpsql.publish("pegasus", np.asarray(counts, dtype=float), epsilon=1.0, theta=1.0, **params).values


def test_polars_time_zones_dates_and_numbers():
    utc = pl.DataFrame({"ts": [dt.datetime(2024, 5, 1, 1, 30)]}).with_columns(
        pl.col("ts").dt.replace_time_zone("UTC").dt.convert_time_zone("Europe/Paris"))
    with testing.seeded(0):
        out = dpsql.count_stream(utc, "ts", every="1h", start=START, stop=STOP, epsilon=1.0, theta=1.0)
    # 03:30 Paris = 01:30 UTC: the counts released are [0, 1, 0, 0]
    np.testing.assert_array_equal(out["dp_count"].to_numpy(), released_counts([0, 1, 0, 0]))
    assert not np.array_equal(out["dp_count"].to_numpy(), released_counts([0, 0, 0, 1]))  # 03:30 read as UTC
    assert out.schema["ts"] == pl.Datetime("us", "Europe/Paris")
    days = pl.DataFrame({"d": [dt.date(2024, 5, 2), dt.date(2024, 5, 2), dt.date(2024, 5, 3)]})
    with testing.seeded(0):
        out = dpsql.count_stream(days, "d", every="1d", start="2024-05-01", stop="2024-05-04", epsilon=1.0,
                                 theta=1.0)
    np.testing.assert_array_equal(out["dp_count"].to_numpy(), released_counts([0, 2, 1]))
    numbers = pl.DataFrame({"t": [0.5, 3.2, 3.9, 11.0]})
    with testing.seeded(0):
        out = dpsql.count_stream(numbers, "t", every=2, start=0, stop=6, epsilon=1.0, theta=1.0)
    np.testing.assert_array_equal(out["dp_count"].to_numpy(), released_counts([1, 2, 0]))
    assert out["t"].to_list() == [0.0, 2.0, 4.0]
    assert bucket_events(numbers["t"].to_numpy(), domain=time_domain(start=0, stop=6, every=2)).counts.tolist() == \
        [[1, 2, 0]]


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"order_by": "when"}, dpsql.InvalidParameter, "order_by 'when' is not a column"),
    ({"partition_by": ["building", "floor"]}, dpsql.InvalidParameter, "partition_by 'floor'"),
    ({"privacy_unit": "uid"}, dpsql.InvalidParameter, "cap"),
    ({"every": "1mo"}, dpsql.InvalidParameter, "every"),
    ({"stop": None}, dpsql.InvalidParameter, "stop is required"),
    ({"smoother": "max"}, dpsql.InvalidParameter, "smoother"),
])
def test_polars_refusals_charge_nothing(events, kwargs, error, match):
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    options = {"order_by": "ts", "every": "1h", "start": START, "stop": STOP, "epsilon": 1.0, **kwargs}
    with pytest.raises(error, match=match):
        dpsql.count_stream(events, budget=budget, **options)
    assert budget.spent == (0.0, 0.0)


def test_polars_null_time_refused():
    frame = pl.DataFrame({"ts": [START, None]})
    with pytest.raises(dpsql.InvalidTimeKey, match="'ts' contains 1 null"):
        dpsql.count_stream(frame, "ts", every="1h", start=START, stop=STOP, epsilon=1.0)
    with pytest.raises(dpsql.InvalidData, match="Datetime, Date or number"):
        dpsql.count_stream(pl.DataFrame({"ts": ["x"]}), "ts", every="1h", start=START, stop=STOP, epsilon=1.0)


# -- DuckDB --------------------------------------------------------------------------------------


@pytest.fixture()
def budget():
    return dpsql.Budget.in_memory(epsilon=10.0)


@pytest.fixture()
def con(events, budget):
    connection = duckdb.connect()
    dpsql.duckdb.register(connection, budget=budget)
    connection.execute("CREATE TABLE ev AS SELECT * FROM events")
    return connection


def test_sql_equals_core_release(con, budget, events):
    with testing.seeded(5), dpsql.duckdb.typed_errors():
        out = con.sql("SELECT * FROM dp_count_stream('ev', 'ts', every := INTERVAL '15 minutes', "
                      "start := TIMESTAMP '2024-05-01', stop := '2024-05-01 04:00', epsilon := 1.0, "
                      "partition_by := 'building', smoother := 'js', \"window\" := 4, alarm_threshold := 100)").pl()
    want = core(events, every="15m", epsilon=1.0, keys=["building"], smoother="js", window=4, alarm_threshold=100)
    assert out.columns == [c for c in want if c != "dp_part"]
    np.testing.assert_array_equal(out["dp_count"].to_numpy(), want["dp_count"])
    # Row handles: one block for the release, buckets of a stream consecutive.
    first = out["dp_row"][0]
    np.testing.assert_array_equal(out["dp_row"].to_numpy(), first + np.arange(out.height))
    release_ids = con.execute(f"SELECT dp_release_id({first}), "
                              f"dp_release_id({first + out.height - 1})").fetchall()
    assert release_ids == [tuple(budget.history(full=True)["release_id"]) * 2]
    np.testing.assert_allclose(out["dp_window_std_error"].to_numpy(), want["dp_window_std_error"], rtol=1e-12)
    assert out["ts"][:2].to_list() == [START, START + dt.timedelta(minutes=15)]
    assert budget.spent == (1.0, 0.0)


@pytest.mark.parametrize("partition_by", ["NULL", "'building'"])
def test_sql_window_functions_with_exact_error_bars(con, partition_by):
    with testing.seeded(7):
        con.execute("CREATE TABLE rel AS SELECT * FROM dp_count_stream('ev', 'ts', every := INTERVAL '10 minutes', "
                    "start := '2024-05-01', stop := '2024-05-01 04:00', epsilon := 0.5, \"window\" := 6, "
                    f"window_smoother := 'none', alarm_threshold := 60, partition_by := {partition_by})")
    within = "PARTITION BY building" if partition_by != "NULL" else ""
    got = con.sql("SELECT dp_window_sum, dp_window_std_error, dp_alarm, "
                  "sum(dp_count) OVER w AS s, sqrt(dp_range_variance(min(dp_row) OVER w, max(dp_row) OVER w + 1)) "
                  f"AS se FROM rel WINDOW w AS ({within} ORDER BY dp_row ROWS 5 PRECEDING) ORDER BY dp_row").pl()
    np.testing.assert_allclose(got["s"].to_numpy(), got["dp_window_sum"].to_numpy(), rtol=1e-9)
    np.testing.assert_allclose(got["se"].to_numpy(), got["dp_window_std_error"].to_numpy(), rtol=1e-9)
    assert (got["dp_alarm"] == (got["dp_window_sum"] >= 60)).all()


def test_sql_hierarchy_and_time_zone(con, budget, events):
    con.execute("CREATE TABLE evz AS SELECT ts AT TIME ZONE 'UTC' AS tsz, * EXCLUDE (ts) FROM ev")
    with testing.seeded(8):
        out = con.sql("SELECT * FROM dp_count_stream('evz', 'tsz', every := INTERVAL '1 hour', "
                      "start := TIMESTAMPTZ '2024-05-01 00:00:00+00', stop := TIMESTAMPTZ '2024-05-01 04:00:00+00', "
                      "epsilon := 0.6, partition_by := ['building', 'room'], hierarchy := true)").pl()
    assert out.group_by("dp_level").len().sort("dp_level")["len"].to_list() == [2 * 4, 6 * 4]
    assert out.filter(pl.col("dp_level") == 1)["room"].null_count() == 8
    assert out.schema["tsz"].time_zone in ("UTC", "Etc/UTC")
    assert budget.spent == (0.6, 0.0)
    with testing.seeded(8):  # the same release as the core's on the naive UTC times
        want = release_event_counts(events["ts"].to_numpy(), start=START, stop=STOP, every="1h", epsilon=0.6,
                                    keys={k: events[k].to_numpy() for k in ("building", "room")}, hierarchy=True,
                                    order_by="ts").columns()
    np.testing.assert_array_equal(out["dp_count"].to_numpy(), want["dp_count"])


def test_sql_contribution_caps(con, budget):
    with testing.seeded(8):
        out = con.sql("SELECT * FROM dp_count_stream('ev', 'ts', every := INTERVAL '1 hour', "
                      "start := '2024-05-01', stop := '2024-05-01 04:00', epsilon := 0.6, "
                      "partition_by := ['building', 'room'], hierarchy := true, "
                      "privacy_unit := 'uid', contribution_cap := 2)").pl()
    assert out.group_by("dp_level").len().sort("dp_level")["len"].to_list() == [2 * 4, 6 * 4]
    assert budget.spent == (0.6, 0.0)
    assert budget.history(full=True)["neighbour"].to_list() == [dpsql.accounting.Neighbour.ADD_REMOVE_UNIT.value]


@pytest.mark.parametrize(("arguments", "error", "match"), [
    ("'ev', 'ts', start := '2024-05-01', epsilon := 1", dpsql.InvalidParameter, "stop is required"),
    ("'ev', 'ts', every := INTERVAL '1 month', start := '2024-05-01', stop := '2024-06-01', epsilon := 1",
     dpsql.InvalidParameter, "fixed length"),
    ("'ev', 'when', start := '2024-05-01', stop := '2024-05-02', epsilon := 1", dpsql.InvalidParameter,
     "order_by 'when' is not a column"),
    ("'ev', 'room', start := '2024-05-01', stop := '2024-05-02', epsilon := 1", dpsql.InvalidData,
     "TIMESTAMP, DATE or number"),
    ("'ev', 'ts', start := '2024-05-01', stop := '2024-05-02', epsilon := 1, method := 'tree'",
     dpsql.InvalidParameter, "method"),
    ("'ev', 'ts', start := '2024-05-01', stop := '2024-05-02'", dpsql.InvalidParameter, "epsilon"),
    ("'ev', 'ts', start := '2024-05-01', stop := '2024-05-02', epsilon := 1, alarm_threshold := 3",
     dpsql.InvalidParameter, "needs window"),
])
def test_sql_refusals_charge_nothing(con, budget, arguments, error, match):
    with pytest.raises(error, match=match), dpsql.duckdb.typed_errors():
        con.sql(f"SELECT * FROM dp_count_stream({arguments})").fetchall()
    assert budget.spent == (0.0, 0.0)


def test_sql_every_as_short_duration_text(con, events):
    with testing.seeded(5):
        out = con.sql("SELECT * FROM dp_count_stream('ev', 'ts', every := '15m', start := TIMESTAMP '2024-05-01', "
                      "stop := '2024-05-01 04:00', epsilon := 1.0, partition_by := 'building')").pl()
    want = core(events, every="15m", epsilon=1.0, keys=["building"])
    np.testing.assert_array_equal(out["dp_count"].to_numpy(), want["dp_count"])


def test_sql_numeric_time_domain():
    con = duckdb.connect()
    dpsql.duckdb.register(con, budget=dpsql.Budget.in_memory(epsilon=10.0))
    con.execute("CREATE TABLE nums AS SELECT * FROM (VALUES (0.5), (3.2), (3.9), (11.0)) v(t)")
    with testing.seeded(0):
        out = con.sql("SELECT t, dp_count FROM dp_count_stream('nums', 't', every := 2, start := 0, stop := 6, "
                      "epsilon := 1.0, theta := 1.0)").fetchall()
    assert [t for t, _ in out] == [0.0, 2.0, 4.0]
    np.testing.assert_array_equal([c for _, c in out], released_counts([1, 2, 0]))


def test_bucketed_counts_release_through_the_generic_expression_and_macro(con, budget):
    frame = pl.DataFrame({"ts": list(range(50)), "n": [3.0] * 50, "ap": ["x", "y"] * 25})
    with testing.seeded(9):
        out = frame.with_columns(pl.col("n").dpsql.range_sum(method="pegasus", epsilon=0.5, order_by="ts",
                                                              partition_by="ap", smoother="average"))
    assert out.height == 50 and abs(out["n"].mean() - 3.0) < 2.0
    con.execute("CREATE TABLE counts AS SELECT * FROM frame")
    with testing.seeded(9):
        rows = con.sql("SELECT * FROM dp_range_sum('counts', 'ts', 'n', method := 'pegasus', epsilon := 0.5, "
                       "partition_by := 'ap')").fetchall()
    assert len(rows) == 50 and budget.spent == (0.5, 0.0)


def test_sql_null_partition_key_refused_in_the_shared_words(con, budget):
    con.execute("CREATE TABLE evn AS SELECT ts, CAST(NULL AS INTEGER) AS floor FROM ev LIMIT 3")
    with pytest.raises(dpsql.InvalidTimeKey, match="partition column 'floor' contains 3 NULL value"), \
            dpsql.duckdb.typed_errors():
        con.sql("SELECT * FROM dp_count_stream('evn', 'ts', every := INTERVAL '1 hour', start := TIMESTAMP "
                "'2024-05-01', stop := '2024-05-02', epsilon := 1.0, partition_by := 'floor')").fetchall()
    assert budget.spent == (0.0, 0.0)
