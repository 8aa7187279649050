"""Fleets (issue 21): a stream per meter, appended a day at a time, against one-shot releases.

    python bench/fleet.py [--meters 1000,10000,100000] [--days 3] [--rounds 3] [--million] [--growth-days 30]

Appends: for each fleet size and method (laplace, hierarchy, tops; epsilon 1, ``partition_by="meter"``,
the SQLite ledger on local disk), a stream is registered, ``--days`` days of hourly readings are
appended a day at a time (24 rows per meter), and the next day's append is timed, ``--rounds``
times on fresh streams; against it, the one-shot partitioned release of the same rows (that day's
24 rows per meter) through Polars (``.dpsql.range_sum(partition_by="meter")``, ``fresh=True``,
charged to a ledger of the same kind), taking turns. The ratio compares best with best (medians
beside).

Size: the ledger's growth per appended row over ``--growth-days`` days of 10^4 meters (released-row
chunks and open state, read back from SQLite), and the open state per partition.

One-shot scale: 10^6 partitions x 10 rows against one partition of the same 10^7 rows
(``dpsql.laplace`` through ``dpsql.publish``, in-memory budget, fresh), taking turns ``--runs``
times: the best and the median.

Fleet threshold: 1,000 partitions x 400 heavy-tailed (lognormal) values with a loose public bound
(5,000), range MSE of the default (tops, the fleet's pooled threshold) against ``hierarchy`` at the
public bound, over ranges of 20 to 100 rows in every partition, medians over ``--runs`` runs (fresh
noise each; the data drawn once).

``--million``: one append of 10^6 meters x 24 rows (tops), its time and the state it leaves.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import polars as pl

sys.path.insert(0, str(Path(__file__).parent))
from _report import markdown_table, write_section

import dpsql
import dpsql.polars

UPPER = 50.0
METHODS = {"laplace": {}, "hierarchy": {}, "tops": {}}


def day(meters: int, number: int, seed: int = 0) -> pl.DataFrame:
    """Day ``number`` of hourly readings (kWh, gamma-distributed with a daily cycle) of ``meters`` meters."""
    rng = np.random.default_rng(seed * 1000 + number)
    hours = np.arange(24)
    start = np.datetime64("2026-01-01T00:00") + np.timedelta64(24 * number, "h")
    level = rng.gamma(2.0, 1.0, meters)[:, None] * (1.2 + np.sin(2 * np.pi * (hours - 6) / 24))[None, :]
    return pl.DataFrame({"meter": np.repeat(np.arange(meters), 24),
                         "ts": np.tile((start + hours.astype("timedelta64[h]")).astype("datetime64[us]"), meters),
                         "kwh": np.round(rng.gamma(2.0, level.ravel() / 2.0), 3)})


def stored(path: Path) -> tuple[int, int]:
    """Bytes of released-row chunks and of open state in the ledger file."""
    with sqlite3.connect(path) as conn:
        chunks = conn.execute("SELECT COALESCE(SUM(LENGTH(data)), 0) FROM stream_rows").fetchone()[0]
        state = conn.execute("SELECT COALESCE(SUM(LENGTH(data)), 0) FROM stream_state").fetchone()[0]
    return int(chunks), int(state)


def append_vs_one_shot(meters: int, method: str, days: int, rounds: int, directory: Path) -> list:
    appends, one_shots = [], []
    for r in range(rounds):
        budget = dpsql.Budget.open(directory / f"{method}-{meters}-{r}.sqlite", epsilon=100.0)
        stream = budget.stream("fleet", method=method, epsilon=1.0, order_by="ts", value="kwh",
                               partition_by="meter", upper=UPPER, **METHODS[method])
        for d in range(days):
            stream.append(day(meters, d))
        today = day(meters, days)
        start = time.perf_counter()
        out = stream.append(today)
        appends.append(time.perf_counter() - start)
        final = float(np.mean(out["dp_final"].to_numpy())) if out.num_rows else 0.0
        one_shot_budget = dpsql.Budget.open(directory / f"one-{method}-{meters}-{r}.sqlite", epsilon=100.0)
        start = time.perf_counter()
        today.with_columns(pl.col("kwh").dpsql.range_sum(order_by="ts", partition_by="meter", method=method,
                                                         epsilon=1.0, upper=UPPER, budget=one_shot_budget, fresh=True,
                                                         ))
        one_shots.append(time.perf_counter() - start)
    best, median = min(appends) / min(one_shots), statistics.median(appends) / statistics.median(one_shots)
    return [f"{meters:,}", method, min(appends), min(one_shots), best, median, final]


def growth(meters: int, days: int, directory: Path) -> list:
    path = directory / "growth.sqlite"
    budget = dpsql.Budget.open(path, epsilon=10.0)
    stream = budget.stream("fleet", method="tops", epsilon=1.0, order_by="ts", value="kwh", partition_by="meter",
                           upper=UPPER)
    stream.append(day(meters, 0))
    chunks_before, _ = stored(path)
    for d in range(1, days):
        stream.append(day(meters, d))
    chunks, state = stored(path)
    rows = meters * 24 * (days - 1)
    return [f"{meters:,}", days, (chunks - chunks_before) / rows, state / meters]


def one_shot_scale(repeat: int) -> list:
    rng = np.random.default_rng(1)
    values = rng.gamma(2.0, 2.0, 10_000_000)
    budget = dpsql.Budget.in_memory(epsilon=1e9)
    many, one = [], []
    offsets = np.arange(0, 10_000_001, 10)
    for _ in range(repeat):
        start = time.perf_counter()
        dpsql.publish("laplace", values, partition_offsets=offsets, epsilon=1.0, upper=UPPER, budget=budget,
                      fresh=True, progress=False)
        many.append(time.perf_counter() - start)
        start = time.perf_counter()
        dpsql.publish("laplace", values, epsilon=1.0, upper=UPPER, budget=budget, fresh=True, progress=False)
        one.append(time.perf_counter() - start)
    return [min(many), min(one), min(many) / min(one), statistics.median(many) / statistics.median(one)]


def fleet_threshold(runs: int) -> list:
    rng = np.random.default_rng(3)
    values = rng.lognormal(1.0, 1.2, (1000, 400))
    offsets = np.arange(0, values.size + 1, 400)
    starts = rng.integers(0, 300, 200)
    stops = starts + rng.integers(20, 100, 200)
    true = np.concatenate([np.zeros((1000, 1)), np.cumsum(values, axis=1)], axis=1)
    budget = dpsql.Budget.in_memory(epsilon=1e9)
    ratios, mse = [], {"tops": [], "hierarchy": []}
    for _ in range(runs):
        for method in mse:
            release = dpsql.publish(method, values.ravel(), partition_offsets=offsets, epsilon=1.0, upper=5000.0,
                                    budget=budget, fresh=True, progress=False)
            released = np.concatenate([np.zeros((1000, 1)), np.cumsum(release.values.reshape(1000, 400), axis=1)],
                                      axis=1)
            errors = (released[:, stops] - released[:, starts]) - (true[:, stops] - true[:, starts])
            mse[method].append(float(np.mean(np.square(errors))))
        ratios.append(mse["tops"][-1] / mse["hierarchy"][-1])
    return [statistics.median(mse["tops"]), statistics.median(mse["hierarchy"]), statistics.median(ratios),
            max(ratios)]


def million(directory: Path) -> list:
    path = directory / "million.sqlite"
    budget = dpsql.Budget.open(path, epsilon=10.0)
    stream = budget.stream("fleet", method="tops", epsilon=1.0, order_by="ts", value="kwh", partition_by="meter",
                           upper=UPPER)
    rows = day(1_000_000, 0)
    start = time.perf_counter()
    out = stream.append(rows)
    seconds = time.perf_counter() - start
    chunks, state = stored(path)
    return [f"{rows.height:,}", seconds, out.num_rows, chunks / rows.height, state / 1_000_000]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--meters", default="1000,10000,100000")
    parser.add_argument("--days", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--growth-days", type=int, default=30)
    parser.add_argument("--million", action="store_true")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(dir=Path.home()) as folder:
        directory = Path(folder)
        appends = [append_vs_one_shot(int(m), method, args.days, args.rounds, directory)
                   for m in args.meters.split(",") for method in METHODS]
        sizes = [growth(10_000, args.growth_days, directory)]
        scale = [one_shot_scale(args.runs)]
        threshold = [fleet_threshold(args.runs)]
        big = [million(directory)] if args.million else []
    worst = max(row[4] for row in appends)
    body = ("**Appending a day** (24 hourly rows per meter) to a stream with a few days behind it, against the "
            "one-shot partitioned release of the same rows (Polars, `fresh=True`), best of "
            f"{args.rounds} rounds taking turns:\n\n"
            + markdown_table(["meters", "method", "append s (best)", "one-shot s (best)", "append / one-shot (best)",
                              "(median)", "share of the day's rows final"], appends)
            + f"\n\nTarget: at most 1.5x: **{'met' if worst <= 1.5 else 'NOT met'}** (worst {worst:.2f}x).\n\n"
            "**Size**: the ledger's growth per appended row (released-row chunks) over the days after the first, "
            "and the open state per partition at the end (all shards, the directory of keys, the facts):\n\n"
            + markdown_table(["meters", "days", "ledger bytes per appended row", "open state bytes per partition"],
                             sizes)
            + f"\n\nTarget: at most 8 bytes per appended row: **{'met' if sizes[0][2] <= 8 else 'NOT met'}**.\n\n"
            "**One-shot scale**: 10^6 partitions x 10 rows against one partition of the same 10^7 rows "
            f"(`dpsql.publish`, laplace, in-memory budget), {args.runs} runs taking turns:\n\n"
            + markdown_table(["10^6 x 10 s", "1 x 10^7 s", "ratio (best)", "ratio (median)"], scale)
            + f"\n\nTarget: within 2x: **{'met' if scale[0][2] <= 2 else 'NOT met'}**.\n\n"
            "**Fleet threshold**: 1,000 partitions x 400 lognormal values, public bound 5,000, epsilon 1: range "
            "MSE (200 ranges of 20-100 rows in every partition) of the default `tops` (one threshold for the "
            f"fleet from its pooled first rows) against `hierarchy` at the public bound, medians of {args.runs} "
            "runs:\n\n"
            + markdown_table(["tops (fleet threshold) MSE", "hierarchy MSE", "ratio (median)", "ratio (worst run)"],
                             threshold)
            + f"\n\nTarget: at most 0.5: **{'met' if threshold[0][3] <= 0.5 else 'NOT met'}** (worst run).\n\n")
    if big:
        body += ("**10^6 meters** x 24 rows in one append (tops):\n\n"
                 + markdown_table(["rows", "s", "rows returned", "chunk bytes per row", "state bytes per partition"],
                                  big) + "\n\n")
    body += (f"Load average (1 min) before / after: {load_before:.2f} / {os.getloadavg()[0]:.2f} on "
             f"{os.cpu_count()} cores.")
    write_section("fleet", "Fleets: a day appended to thousands of meters", body)
    print(body)


if __name__ == "__main__":
    main()
