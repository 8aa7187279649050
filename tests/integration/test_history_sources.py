"""Every release records in the ledger's history what it read (the SQL table and columns or the
query, the Polars column or expression, the array's length), beside the user's note: an auditor
can tell releases apart from the history alone, in Python, in the CLI and in the notebook view."""

import json
import sqlite3
import subprocess
import sys

import numpy as np
import polars as pl
import pytest
from connections import registered

import dpsql

N = 5000
LAPLACE = "method := 'laplace', epsilon := 0.5, upper := 10"


@pytest.fixture
def budget():
    return dpsql.Budget.in_memory(epsilon=100.0)


@pytest.fixture
def con(budget):
    with registered(budget, f"CREATE TABLE hourly AS SELECT range AS ts, (range % 7)::DOUBLE AS volume, "
                            f"(range % 3)::DOUBLE AS speed, range % 2 AS meter FROM range({N})",
                    "CREATE VIEW weekdays AS SELECT * FROM hourly WHERE ts % 7 < 5") as con:
        yield con


def sources(budget) -> list[tuple[str, str | None]]:
    history = budget.history()
    return list(zip(history["source"].to_list(), history["note"].to_list()))


def test_sql_records_the_table_or_query_and_the_columns_read(con, budget, tmp_path):
    frame = pl.DataFrame({"ts": range(100), "volume": [1.0] * 100})  # noqa: F841 (read by name)
    con.execute(f"COPY hourly TO '{tmp_path / 'hourly.parquet'}'")
    with dpsql.testing.seeded(0):
        for call in (f"dp_range_sum('hourly', 'ts', 'volume', {LAPLACE}, note := 'first look')",
                     f"dp_range_sum('weekdays', 'ts', 'speed', partition_by := 'meter', {LAPLACE})",
                     f"dp_range_sum('SELECT ts, volume FROM hourly WHERE ts < 4500', 'ts', 'volume', {LAPLACE})",
                     f"dp_range_sum('frame', 'ts', 'volume', {LAPLACE})",
                     f"dp_range_sum('{tmp_path / 'hourly.parquet'}', 'ts', 'volume', {LAPLACE})",
                     "dp_threshold('main.hourly', 'volume', epsilon := 0.5, upper := 10, note := 'clip')"):
            con.sql(f"SELECT * FROM {call}").fetchall()
    assert sources(budget) == [
        ("table hourly (ts, volume)", "first look"),
        ("view weekdays (meter, ts, speed)", None),
        ("query SELECT ts, volume FROM hourly WHERE ts < 4500 (ts, volume)", None),
        ("data frame frame (ts, volume)", None),
        (f"file '{tmp_path / 'hourly.parquet'}' (ts, volume)", None),
        ("table main.hourly (volume)", "clip"),
    ]


def test_sql_count_streams_record_their_columns(con, budget):
    con.execute("CREATE TABLE events AS SELECT TIMESTAMP '2024-05-01' + INTERVAL (range) MINUTE AS ts, "
                "range % 2 AS room FROM range(600)")
    with dpsql.testing.seeded(0):
        con.sql("SELECT * FROM dp_count_stream('events', 'ts', start := '2024-05-01', stop := '2024-05-02', "
                "epsilon := 1, partition_by := 'room', note := 'rooms')").fetchall()
    assert sources(budget) == [("table events (ts, room)", "rooms")]


def test_polars_records_the_column_or_expression_and_its_keys(budget):
    frame = pl.DataFrame({"ts": range(N), "volume": [float(i % 7) for i in range(N)],
                          "meter": [i % 2 for i in range(N)]})
    params = {"method": "laplace", "epsilon": 0.5, "upper": 10.0, "budget": budget}
    with dpsql.testing.seeded(0):
        frame.with_columns(pl.col("volume").dpsql.range_sum(order_by="ts", **params))
        frame.lazy().select((pl.col("volume") * 2).dpsql.range_sum(order_by="ts", partition_by="meter", note="x2",
                                                                   **params)).collect()
        frame.select(pl.col("volume").dpsql.threshold(epsilon=0.5, upper=10.0, budget=budget))
    assert sources(budget) == [
        ("column volume, order_by ts", None),
        (f"expression {pl.col('volume') * 2}, order_by ts, partition_by meter", "x2"),
        ("column volume", None),
    ]
    events = pl.DataFrame({"t": [0.5, 1.5, 2.5], "room": ["a", "b", "a"], "user": [1, 2, 1]})
    with dpsql.testing.seeded(1):
        dpsql.count_stream(events, "t", every=1.0, start=0, stop=3, epsilon=1.0, partition_by="room",
                           privacy_unit="user", contribution_cap=2, budget=budget, note="doors")
    assert sources(budget)[-1] == ("events, order_by t, partition_by room, privacy_unit user", "doors")


def test_python_arrays_record_their_length_and_the_note(budget):
    with dpsql.testing.seeded(0):
        dpsql.tops(np.arange(N) % 7.0, epsilon=1.0, upper=10.0, budget=budget, note="volume, i94")
        dpsql.tops(np.arange(N) % 5.0, epsilon=1.0, upper=10.0, budget=budget)
        dpsql.pegasus(np.arange(200) % 4.0, epsilon=1.0, budget=budget)
        dpsql.tops(np.arange(N) % 7.0, epsilon=1.0, upper=10.0, budget=budget, note="again")  # a cache hit
    assert sources(budget) == [(f"array of {N} values", "volume, i94"), (f"array of {N} values", None),
                               ("array of 200 values", None), (f"array of {N} values", "again")]
    assert budget.history()["kind"].to_list() == ["release", "release", "release", "cache hit"]


def test_the_issue_s_auditor_can_tell_two_polars_releases_apart(con, budget):
    """Two releases of one method, epsilon and length: the history says which column each read."""
    frame = con.sql("SELECT * FROM hourly").pl()
    params = {"method": "laplace", "epsilon": 1.0, "upper": 10.0, "budget": budget}
    with dpsql.testing.seeded(0):
        frame.with_columns(pl.col("volume").dpsql.range_sum(order_by="ts", **params))
        frame.with_columns(pl.col("speed").dpsql.range_sum(order_by="ts", **params))
    history = budget.history()
    assert history.select("kind", "method", "epsilon", "rows").unique().height == 1
    assert history["source"].to_list() == ["column volume, order_by ts", "column speed, order_by ts"]


def test_a_persistent_ledger_shows_sources_in_history_cli_and_notebook(tmp_path):
    path = tmp_path / "ledger.sqlite"
    budget = dpsql.Budget.open(path, scope="traffic", epsilon=4.0)
    frame = pl.DataFrame({"ts": range(N), "volume": [float(i % 7) for i in range(N)]})
    frame.with_columns(pl.col("volume").dpsql.range_sum(order_by="ts", method="laplace", epsilon=1.0, upper=10.0,
                                                        budget=budget, note="weekly report"))
    reopened = dpsql.Budget.open(path, scope="traffic")
    assert sources(reopened) == [("column volume, order_by ts", "weekly report")]
    assert "column volume, order_by ts" in reopened._repr_html_() and "weekly report" in reopened._repr_html_()
    shown = subprocess.run([sys.executable, "-m", "dpsql.cli", "ledger", str(path), "--history"],
                           capture_output=True, text=True, check=True).stdout
    assert "source" in shown and "column volume, order_by ts" in shown and "weekly report" in shown
    data = json.loads(subprocess.run([sys.executable, "-m", "dpsql.cli", "ledger", str(path), "--history", "--json"],
                                     capture_output=True, text=True, check=True).stdout)
    assert data["history"][0]["source"] == "column volume, order_by ts"


def test_a_ledger_written_before_sources_is_read_and_upgraded(tmp_path):
    path = tmp_path / "ledger.sqlite"
    budget = dpsql.Budget.open(path, scope="traffic", epsilon=4.0)
    dpsql.laplace(np.ones(10), epsilon=0.5, upper=1.0, budget=budget, note="old")
    del budget
    with sqlite3.connect(path) as conn:  # what a ledger of the earlier version 3 holds
        conn.execute("ALTER TABLE charges DROP COLUMN source")
    shown = subprocess.run([sys.executable, "-m", "dpsql.cli", "ledger", str(path), "--history", "--json"],
                           capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr  # the read-only CLI reads it as it is
    assert json.loads(shown.stdout)["history"][0]["source"] is None
    budget = dpsql.Budget.open(path, scope="traffic")  # opening it adds the column
    dpsql.laplace(np.zeros(20), epsilon=0.5, upper=1.0, budget=budget)
    assert sources(budget) == [(None, "old"), ("array of 20 values", None)]
    assert budget.spent == (1.0, 0.0)
