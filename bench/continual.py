"""Continual release (issue 12 item 8): append latency on a long stream, and appending 10^7 rows
in batches against one one-shot release of the same rows.

    python bench/continual.py [--rows 10000000] [--batch 100000] [--rounds 3] [--repeat 9]

Throughput: in each of ``--rounds`` rounds, taking turns, (a) a new stream (ToPS, epsilon 1, one
partition, SQLite ledger on local disk) is filled with ``--rows`` rows in ``--batch``-row
appends, and the same rows are released at once (b) through the Polars front end on the same
Arrow table (``range_sum(order_by="ts")``), (c) through DuckDB (``dp_range_sum`` on the table
loaded into the connection) and (d) with ``dpsql.tops`` on the bare value array, each one-shot
release fresh and charged to a ledger of the same kind (its data fingerprinted, its answer
stored). Best of the rounds.

The target compares like with like: an append reads a table, validates it and orders it by
time, and so does a one-shot release of a table, in either front end; the verdict takes the
faster of the two. The bare ``dpsql.tops`` on an array already in order is reported beside it.

Latency: on the last round's stream (``--rows`` rows released), appends of 1, 24 and 10^5 new
rows, ``--repeat`` times each (median and best), with what each append stored in the ledger:
the released rows' chunk and the partition's open state, read back from SQLite.
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

import duckdb
import numpy as np
import polars as pl
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).parent))
from _report import markdown_table, write_section

import dpsql
import dpsql.polars

UPPER = 1000.0


def _stored(path: Path) -> tuple[int, int, int]:
    """Bytes of released-row chunks, rows released, bytes of open state, in the ledger file."""
    with sqlite3.connect(path) as conn:
        chunks, rows = conn.execute("SELECT COALESCE(SUM(LENGTH(data)), 0), COALESCE(SUM(rows), 0) "
                                    "FROM stream_rows").fetchone()
        state = conn.execute("SELECT COALESCE(SUM(LENGTH(data)), 0) FROM stream_state").fetchone()[0]
    return int(chunks), int(rows), int(state)


class Phases:
    """Seconds spent in named steps while active: wraps functions in place, restores them."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._undo = []

    def wrap(self, owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - start

        setattr(owner, name, timed)
        self._undo.append((owner, name, original))

    def restore(self) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo = []


def breakdown(table: pa.Table, values: np.ndarray, batch: int, directory: Path) -> tuple[list, list]:
    """Where the time of the appends and of the one-shot release goes (one extra run of each,
    with timers around their steps)."""
    from dpsql import _state, publishing
    from dpsql.continual import appends, fleet
    from dpsql.continual import stream as streams
    from dpsql.continual.stream import Stream
    from dpsql.ledger.sqlite import SqliteBackend
    from dpsql.ledger.streams import StreamStore
    from dpsql.noise import DrawsBatch

    phases = Phases()
    phases.wrap(appends.RangeAppend, "_ordered", "read, validate and order the batch (Polars)")
    phases.wrap(appends, "group_starts", "partitions and the unique-key check (when not found while ordering)")
    phases.wrap(DrawsBatch, "tags", "keyed value tags (AES of each value)")
    phases.wrap(Stream, "_batch_machine", "ToPS machine: restore from the open state")
    phases.wrap(appends, "feed_into", "ToPS machine: feed")
    phases.wrap(streams, "table_buffer", "released rows as Arrow IPC")
    phases.wrap(fleet, "table_bytes", "open state's columns (watermark, pending rows) as Arrow IPC")
    phases.wrap(_state, "pack", "open state packed")
    phases.wrap(_state, "unpack", "open state unpacked")
    phases.wrap(StreamStore, "add_chunk", "INSERT of the released rows")
    phases.wrap(SqliteBackend, "commit", "COMMIT (WAL written and fsync'ed, checkpoints)")
    phases.wrap(Stream, "_output", "rows returned (with dp_row)")
    budget = dpsql.Budget.open(directory / "phases.sqlite", epsilon=10.0)
    stream = budget.stream("bench", method="tops", epsilon=1.0, order_by="ts", value="v", upper=UPPER)
    start = time.perf_counter()
    try:
        for at in range(0, table.num_rows, batch):
            stream.append(table.slice(at, batch))
    finally:
        phases.restore()
    total = time.perf_counter() - start
    seconds = dict(phases.seconds)
    append_rows = [[step, t, t / total] for step, t in sorted(seconds.items(), key=lambda kv: -kv[1])]
    append_rows.append(["everything else (Python and Arrow glue, other SQL)", total - sum(seconds.values()),
                        1 - sum(seconds.values()) / total])
    append_rows.append(["**all appends**", total, 1.0])

    phases = Phases()
    phases.wrap(publishing, "fingerprint", "fingerprint of the data (SHA-256)")
    phases.wrap(publishing, "_run_partitions", "ToPS mechanism")
    phases.wrap(publishing, "values_digest", "answer: digest of the values for the ledger")
    phases.wrap(dpsql.Budget, "charge", "charge: one transaction (record, answer), committed")
    one_shot = dpsql.Budget.open(directory / "phases-one-shot.sqlite", epsilon=10.0)
    start = time.perf_counter()
    try:
        dpsql.tops(values, epsilon=1.0, upper=UPPER, budget=one_shot, fresh=True)
    finally:
        phases.restore()
    total = time.perf_counter() - start
    seconds = phases.seconds
    one_rows = [[step, t, t / total] for step, t in sorted(seconds.items(), key=lambda kv: -kv[1])]
    one_rows.append(["everything else", total - sum(seconds.values()), 1 - sum(seconds.values()) / total])
    one_rows.append(["**one-shot release**", total, 1.0])
    return append_rows, one_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--batch", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=9)
    args = parser.parse_args()
    rng = np.random.default_rng(0)  # the benchmark's data, not noise
    values = rng.poisson(300.0, args.rows).astype(np.float64)
    table = pa.table({"ts": np.arange(args.rows), "v": values})
    frame = pl.from_arrow(table)
    load_before = os.getloadavg()[0]
    times: dict[str, list[float]] = {"appends": [], "tops": [], "polars": [], "duckdb": []}
    with tempfile.TemporaryDirectory(dir=Path(__file__).resolve().parent.parent) as directory:
        one_shot = dpsql.Budget.open(Path(directory) / "one-shot.sqlite", epsilon=1e6)
        one_shot_polars = dpsql.Budget.open(Path(directory) / "one-shot-polars.sqlite", epsilon=1e6)
        expr = pl.col("v").dpsql.range_sum(order_by="ts", method="tops", epsilon=1.0, upper=UPPER,
                                           budget=one_shot_polars, fresh=True)
        con = duckdb.connect()
        dpsql.register(con, budget=dpsql.Budget.open(Path(directory) / "one-shot-duckdb.sqlite", epsilon=1e6))
        con.register("rows_in_arrow", table)
        con.execute("CREATE TABLE t AS FROM rows_in_arrow")
        con.execute("CREATE TABLE warm AS FROM t LIMIT 100000")
        release = ("SELECT * FROM dp_range_sum('{}', 'ts', 'v', method := 'tops', epsilon := 1, upper := "
                   f"{UPPER:g}, fresh := true)")
        dpsql.tops(values[:100_000], epsilon=1.0, upper=UPPER, budget=one_shot)  # warm every path up
        frame.head(100_000).select(expr)
        con.sql(release.format("warm")).to_arrow_table()
        for k in range(args.rounds):
            path = Path(directory) / f"stream{k}.sqlite"
            budget = dpsql.Budget.open(path, epsilon=10.0)
            stream = budget.stream("bench", method="tops", epsilon=1.0, order_by="ts", value="v", upper=UPPER)
            start = time.perf_counter()
            for at in range(0, args.rows, args.batch):
                stream.append(table.slice(at, args.batch))
            times["appends"].append(time.perf_counter() - start)
            start = time.perf_counter()
            dpsql.tops(values, epsilon=1.0, upper=UPPER, budget=one_shot, fresh=True)
            times["tops"].append(time.perf_counter() - start)
            start = time.perf_counter()
            frame.select(expr)
            times["polars"].append(time.perf_counter() - start)
            start = time.perf_counter()
            con.sql(release.format("t")).to_arrow_table()
            times["duckdb"].append(time.perf_counter() - start)
        load_middle = os.getloadavg()[0]
        append_steps, one_shot_steps = breakdown(table, values, args.batch, Path(directory))

        latency = []
        next_key = args.rows
        for size in (1, 24, 100_000):
            seconds, chunk_bytes, released, state_bytes = [], [], [], []
            for _ in range(args.repeat):
                rows = pa.table({"ts": np.arange(next_key, next_key + size),
                                 "v": rng.poisson(300.0, size).astype(np.float64)})
                next_key += size
                before = _stored(path)
                begin = time.perf_counter()
                stream.append(rows)
                seconds.append(time.perf_counter() - begin)
                after = _stored(path)
                chunk_bytes.append(after[0] - before[0])
                released.append(after[1] - before[1])
                state_bytes.append(after[2])
            latency.append([f"{size:,}", statistics.median(seconds) * 1e3, min(seconds) * 1e3,
                            f"{sum(released) / len(released):,.0f}", statistics.median(chunk_bytes),
                            (sum(chunk_bytes) / sum(released)) if sum(released) else "",
                            statistics.median(state_bytes)])
    load_after = os.getloadavg()[0]
    best = {name: min(t) for name, t in times.items()}
    middle = {name: statistics.median(t) for name, t in times.items()}
    front_end = min(("polars", "duckdb"), key=best.__getitem__)
    ratio, ratio_bare = best["appends"] / best[front_end], best["appends"] / best["tops"]
    one_row = latency[0][1]
    runs = [("appends", f"{args.rows // args.batch:,} appends of {args.batch:,} rows (`stream.append`)"),
            ("polars", "one-shot Polars `range_sum(order_by=\"ts\", fresh=True)` on the same table"),
            ("duckdb", "one-shot DuckDB `dp_range_sum('t', 'ts', 'v', fresh := true)` on the same table"),
            ("tops", "one-shot `dpsql.tops(values, fresh=True)` on the bare value array, in order")]
    throughput = [[label, best[name], middle[name], "" if name == "appends" else best["appends"] / best[name],
                   "" if name == "appends" else middle["appends"] / middle[name]] for name, label in runs]
    cause = ""
    if ratio > 1.5:
        steps = {step: t for step, t, _ in append_steps}
        top = [row for row in append_steps if not row[0].startswith(("**", "everything"))][:2]
        mechanism = next((t for step, t, _ in one_shot_steps if step == "ToPS mechanism"), float("nan"))
        cause = (f" Likely cause, from the breakdown below: the appends' two largest steps are \"{top[0][0]}\" "
                 f"({top[0][2]:.0%}) and \"{top[1][0]}\" ({top[1][2]:.0%}), per-append durable storage that "
                 "a one-shot release does not pay (it stores one packed answer in one commit), whereas the ToPS "
                 f"machine's feed ({steps.get('ToPS machine: feed', float('nan')):.3f} s) is of the order of the "
                 f"one-shot mechanism ({mechanism:.3f} s).")
    body = (f"A stream (ToPS, epsilon 1, upper {UPPER:g}, one partition, Poisson(300) values, integer time keys) "
            "in an SQLite ledger on local disk (WAL, synchronous=FULL: every append is committed with its state "
            "and released rows, durably, before it returns).\n\n"
            f"**Throughput**: {args.rows:,} rows, best of {args.rounds} rounds (the three runs take turns in each "
            "round; the one-shot releases are fresh and charged to their own SQLite ledgers).\n\n"
            + markdown_table(["run", "best s", "median s", "appends / this (best)", "appends / this (median)"],
                             throughput)
            + "\n\nTarget: appending at most 1.5x one one-shot release of the same table: "
              f"**{'met' if ratio <= 1.5 else 'NOT met'}** ({ratio:.2f}x the faster front end, "
              f"{'Polars' if front_end == 'polars' else 'DuckDB'}; like the appends, a front end reads the table, "
              f"validates it and orders it by time). Against the bare `dpsql.tops` on a value array already in "
              f"order, which does none of that, appending costs {ratio_bare:.2f}x. The verdict compares best with "
              "best; on this machine the best of a few runs still moves by a fifth from one invocation to the "
              f"next (the medians are beside them).{cause}\n\n"
              "Where the time goes (one more run of each, with timers around the steps; shares of that run):\n\n"
            + markdown_table(["appends: step", "s", "share"], append_steps) + "\n\n"
            + markdown_table(["one-shot `dpsql.tops`: step", "s", "share"], one_shot_steps) + "\n\n"
              f"**Latency** on the stream that has released {args.rows:,} rows, {args.repeat} appends of each "
              "size; stored: the bytes this append added to the ledger's released-row chunks (Arrow IPC: key "
              "as differences, value, keyed value tag, each run-length, dictionary or 32-bit encoded where that "
              "applies) and the partition's open state after it (rewritten in "
              "place, not added).\n\n"
            + markdown_table(["rows appended", "median ms", "best ms", "rows released per append",
                              "chunk bytes added (median)", "chunk bytes per released row", "open state bytes"],
                             latency)
            + f"\n\nTarget: 1 row under 20 ms: **{'met' if one_row < 20 else 'NOT met'}** ({one_row:.1f} ms). "
              "Every appended row is released at once: final where its block completes, else provisional (a "
              "prediction from values released before) until a later append completes its block; the open "
              "block's rows wait in the open state, which is rewritten in place and does not grow with the "
              "stream. Load average (1 min) before / after throughput / after "
              f"latency: {load_before:.2f} / {load_middle:.2f} / {load_after:.2f} on {os.cpu_count()} cores.")
    write_section("continual", "Continual release: append latency and throughput", body)
    print(body)


if __name__ == "__main__":
    main()
