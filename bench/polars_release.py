"""Polars front end: a private release expression end to end against ``df.sort("ts")``.

A 10^7-row frame in random physical order; the release (time ordering, the stream
method, scatter back to the physical order, one ledger charge) is timed against
sorting the same frame by its time key, in the same process. Every timed release is
``fresh=True``: a real, charged release whose data are fingerprinted and whose answer is
stored in the (in-memory) ledger; without it a repeat is answered free from the ledger. Then 1,000 partitions
of 10^4 rows each, released with ``partition_by``. Best of ``--repeat`` runs each.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import polars as pl

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _report import interleaved, markdown_table, write_section

import dpsql
import dpsql.polars


def best_of(repeat: int, *works) -> list[float]:
    """Fastest time of each work, the works taking turns in every round."""
    times = interleaved(dict(enumerate(works)), repeat)
    return [min(times[k]) for k in range(len(works))]


def frame(rows: int, partitions: int, seed: int, regular: bool = True) -> pl.DataFrame:
    """``partitions`` meters with ``rows / partitions`` readings each, rows shuffled.

    Readings are hourly (a regular grid) or, with ``regular=False``, at irregular
    times (random gaps of 1 s to 2 h). The generator is the benchmark's own data
    fixture, not the release's noise.
    """
    data = np.random.default_rng(seed)
    per = rows // partitions
    times = np.arange(per, dtype=np.int64) * 3600 if regular else np.cumsum(data.integers(1, 7200, per))
    return pl.DataFrame({
        "meter": np.repeat(np.arange(partitions, dtype=np.int32), per),
        "ts": np.tile(times, partitions),
        "kwh": data.gamma(2.0, 1.5, rows),
    }).sample(fraction=1.0, shuffle=True, seed=seed)


def measure(data: pl.DataFrame, partition_by: str | None, repeat: int, budget, params: dict) -> list[float]:
    """Seconds of the sort, the eager release and ratios of release, streaming collect and
    ``publish`` alone (on values already in time order) to the sort."""
    keys = ["ts"] if partition_by is None else [partition_by, "ts"]
    expr = pl.col("kwh").dpsql.range_sum(order_by="ts", partition_by=partition_by, budget=budget, fresh=True,
                                         **params)
    ordered = data.sort(keys)
    offsets = None
    if partition_by is not None:
        sizes = ordered.group_by(partition_by, maintain_order=True).len()["len"].to_numpy()
        offsets = np.concatenate([[0], np.cumsum(sizes)])
    values = ordered["kwh"].to_numpy()
    sort, release, streaming, core = best_of(
        repeat, lambda: data.sort(keys), lambda: data.with_columns(dp=expr),
        lambda: data.lazy().with_columns(dp=expr).collect(engine="streaming"),
        lambda: dpsql.publish(params["method"], values, budget=budget, partition_offsets=offsets, fresh=True,
                              **{k: v for k, v in params.items() if k != "method"}))
    return [sort, release, release / sort, streaming / sort, core / sort]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--partitions", type=int, default=1_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--method", default="laplace")
    args = parser.parse_args()
    params = dict(method=args.method, epsilon=1.0, upper=20.0)
    budget = dpsql.Budget.in_memory(epsilon=1e9)
    load_before = os.getloadavg()[0]
    per = args.rows // args.partitions
    cases = [
        (f"{args.rows:,} rows, 1 stream, hourly grid", frame(args.rows, 1, seed=1).drop("meter"), None),
        (f"{args.rows:,} rows, 1 stream, irregular times", frame(args.rows, 1, seed=1, regular=False).drop("meter"),
         None),
        (f"{args.partitions:,} partitions x {per:,} rows, hourly grid", frame(args.rows, args.partitions, seed=2),
         "meter"),
    ]
    rows = [[label, *measure(data, partition_by, args.repeat, budget, params)] for label, data, partition_by in cases]
    load = os.getloadavg()[0]
    body = (f"Method `{args.method}`, rows in random physical order, best of {args.repeat} rounds (the four "
            "timings take turns in each round); the reference is "
            "sorting the same frame by its time key (`df.sort(\"ts\")`, or by `meter, ts` for the partitioned "
            "frame). Target: release / sort <= 1.5. Rows are put in time order by `dpsql.ordering` (shared with "
            "the DuckDB front end): on a regular time grid each row is placed by counting (no comparison sort); "
            "irregular times are sorted as one packed int64 column (numpy). The last column is "
            "`dpsql.publish` alone on the already ordered values (the stream method and its noise): the front "
            "end's own share is the difference. Every release is fresh (`fresh=True`): charged, fingerprinted "
            "and its answer stored, as a first evaluation on new data is.\n\n"
            + markdown_table(["frame", "sort s", "release s (eager)", "release / sort",
                              "streaming collect / sort", "core publish alone / sort"], rows)
            + f"\n\nOne-minute load average before / after the run: {load_before:.2f} / {load:.2f} (the 2 "
              "cores are shared, so absolute times vary; the ratios are measured back to back).")
    print(body)
    write_section("polars_release", "Polars release expression vs sort", body)


if __name__ == "__main__":
    main()
