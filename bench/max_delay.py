"""Timely fleets: hourly meters appended a day at a time (midnight to midnight), ``tops`` (the default
method, the fleet's pooled threshold) at epsilon 1, without ``max_delay`` and with ``max_delay="1d"``.

Data: held-out household electricity use (``bench/calendar_blocks.py``'s generator: one household
per meter, its own seed), 30 days of hourly readings from 2024-03-01, bound 10 kWh per hour (public:
what a household's supply can draw). A fleet of 20 meters fills the 4,096-row pooled hold-out on its
ninth day; one of 200 meters on its first.

Per fleet and configuration, medians over ``--reps`` seeds (data and noise): the share of rows final
at the end of the append that brought them; the share of each day's appends that leave no row of
that day provisional; the MSE of daily totals (per meter and day, final values, against the true
totals); the median 95 % margin of a daily total over the true total; and the seconds per append.

Run: PYTHONPATH=. python bench/max_delay.py [--quick] [--reps N]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import markdown_table, report, run_options
from calendar_blocks import household

import dpsql

DAYS = 30
UPPER = 10.0
FLEETS = (20, 200)
CONFIGURATIONS = {"no max_delay": None, 'max_delay="1d"': "1d"}


def fleet(meters: int, seed: int) -> pl.DataFrame:
    """``meters`` households' hourly readings for ``DAYS`` days, in time order."""
    frames = []
    for meter in range(meters):
        kwh, keys = household("2024-03-01T00:00", DAYS, 60, seed * 10_000 + meter)
        frames.append(pl.DataFrame({"meter": np.full(len(keys), meter), "ts": keys.astype("datetime64[us]"),
                                    "kwh": kwh}))
    return pl.concat(frames).sort(["ts", "meter"])


def run(meters: int, max_delay, seed: int) -> dict:
    frame = fleet(meters, seed)
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    with dpsql.testing.seeded(seed):
        stream = budget.stream("fleet", method="tops", epsilon=1.0, order_by="ts", value="kwh", upper=UPPER,
                               partition_by="meter", max_delay=max_delay)
    days = frame["ts"].dt.date()
    final_at_once, closed_days, seconds = 0, 0, 0.0
    for day in days.unique(maintain_order=True):
        rows = frame.filter(days == day)
        started = time.perf_counter()
        out = pl.from_arrow(stream.append(rows))
        seconds += time.perf_counter() - started
        today = out.filter(pl.col("ts").dt.date() == day)
        final_at_once += int(today["dp_final"].sum())
        closed_days += bool(today["dp_final"].all())
    released = pl.from_arrow(stream.released())
    truth = frame.group_by("meter", pl.col("ts").dt.date().alias("day")).agg(pl.col("kwh").sum().alias("true"))
    errors, margins = [], []
    for meter in range(meters):
        mine = released.filter(pl.col("meter") == meter)
        release = stream.release(partition=meter)
        day = mine["ts"].dt.date().to_numpy()
        starts = np.flatnonzero(np.r_[True, day[1:] != day[:-1]])
        stops = np.r_[starts[1:], len(day)]
        whole = mine["dp_final"].to_numpy()[stops - 1]  # days whose rows are all final
        totals = release.range_sum(starts, stops)
        low, high = release.range_ci(starts, stops)
        true = truth.filter(pl.col("meter") == meter).sort("day")["true"].to_numpy()
        errors.append(((totals - true) ** 2)[whole])
        margins.append(((high - low) / 2 / true)[whole])
    return {"final at once": final_at_once / frame.height, "days closed at once": closed_days / DAYS,
            "daily MSE": float(np.mean(np.concatenate(errors))),
            "margin / total": float(np.median(np.concatenate(margins))), "s per append": seconds / DAYS}


def main() -> None:
    quick, reps = run_options(3)
    started = time.perf_counter()
    rows = []
    for meters in FLEETS:
        for label, max_delay in CONFIGURATIONS.items():
            runs = [run(meters, max_delay, seed) for seed in range(reps)]
            figures = {k: float(np.median([r[k] for r in runs])) for k in runs[0]}
            rows.append([f"{meters} meters", label, f"{figures['final at once']:.1%}",
                         f"{figures['days closed at once']:.0%}", figures["daily MSE"],
                         f"{figures['margin / total']:.2f}", f"{figures['s per append']:.3f}"])
    table = markdown_table(["fleet", "configuration", "rows final in their append", "days final in their append",
                            "daily-total MSE (kWh^2)", "median margin / total", "s per append"], rows)
    report("max_delay", "Timely fleets: max_delay on hourly meters appended daily", [
        f"tops at epsilon 1, bound {UPPER:g} kWh, {DAYS} days of hourly household readings per meter, appended a "
        f"day at a time from midnight; medians of {reps} seeds.", "", table], started=started, quick=quick,
        command="PYTHONPATH=. python bench/max_delay.py")


if __name__ == "__main__":
    main()
