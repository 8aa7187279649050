"""A fleet of a million partitions: appends killed at any instant lose nothing (issue 21)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import numpy as np
import polars as pl
import pyarrow.compute as pc

import dpsql

METERS = 1_000_000


def _worker(ledger, folder, days: list[int]) -> subprocess.Popen:
    """A process appending the given days of the fleet, saying which before each."""
    code = f"""
        import dpsql, polars as pl
        stream = dpsql.Budget.open({str(ledger)!r}).stream(
            "fleet", method="laplace", epsilon=1.0, order_by="day", value="kwh", partition_by="meter", upper=10.0)
        for day in {days!r}:
            frame = pl.read_parquet({str(folder)!r} + f"/day{{day}}.parquet")
            print("appending", day, flush=True)
            stream.append(frame)
            print("appended", day, flush=True)
    """
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True)


def _kill_during(worker: subprocess.Popen, day: int, after: float) -> list[str]:
    """Kill ``worker`` ``after`` seconds into its append of ``day`` (or when it ends); its output."""
    lines = []
    for line in worker.stdout:
        lines.append(line.strip())
        if line.strip() == f"appending {day}":
            break
    try:
        worker.wait(timeout=after)
    except subprocess.TimeoutExpired:
        worker.send_signal(signal.SIGKILL)
    worker.wait()
    return lines + [line.strip() for line in worker.stdout]


def _released(ledger) -> dict[int, np.ndarray]:
    """Each day's released values, by meter, read by another process (the test's)."""
    table = dpsql.Budget.open(ledger).stream("fleet").released()
    return {day: table.filter(pc.equal(table["day"], day)).sort_by("meter")["kwh"].to_numpy()
            for day in set(table["day"].to_pylist())}


def test_killed_appends_of_a_million_partitions_lose_nothing_and_the_fleet_continues(tmp_path):
    rng = np.random.default_rng(0)
    for day in range(2):
        pl.DataFrame({"meter": np.arange(METERS), "day": np.full(METERS, day),
                      "kwh": rng.uniform(0, 10, METERS)}).write_parquet(tmp_path / f"day{day}.parquet")
    ledger = tmp_path / "ledger.sqlite"
    budget = dpsql.Budget.open(ledger, epsilon=2.0)
    budget.stream("fleet", method="laplace", epsilon=1.0, order_by="day", value="kwh", partition_by="meter",
                  upper=10.0)

    # killed while its first append registers the million partitions
    lines = _kill_during(_worker(ledger, tmp_path, [0, 1]), day=0, after=0.5)
    assert "appended 0" not in lines  # killed inside the append
    first = _released(ledger)
    assert set(first) <= {0, 1} and all(len(values) == METERS for values in first.values())  # whole or absent

    # the next process continues; killed inside its append of day 1 (day 0 committed before it)
    lines = _kill_during(_worker(ledger, tmp_path, [0, 1]), day=1, after=0.3)
    assert "appended 0" in lines and "appended 1" not in lines
    second = _released(ledger)
    assert 0 in second and set(second) <= {0, 1} and all(len(values) == METERS for values in second.values())
    for day, values in first.items():  # nothing released before changed or vanished
        assert np.array_equal(second[day], values)

    # and another completes the fleet: every row once, the earlier ones as they were
    worker = _worker(ledger, tmp_path, [0, 1])
    assert worker.wait(timeout=600) == 0
    final = _released(ledger)
    assert sorted(final) == [0, 1] and all(len(values) == METERS for values in final.values())
    for day, values in second.items():
        assert np.array_equal(final[day], values)
    reopened = dpsql.Budget.open(ledger)
    assert reopened.spent == (1.0, 0.0) and reopened.history()["epsilon"].sum() == 1.0  # charged once, at registration
    assert reopened.streams()["rows"].to_list() == [2 * METERS]
    assert reopened.streams()["partitions"].to_list() == [METERS]
