"""Continual release: append latency on a long stream, and appending 10^7 rows in batches
against one one-shot release of the same rows.

    python bench/continual.py [--rows 10000000] [--batch 100000] [--repeat 5]

A stream (ToPS, epsilon 1, one partition, SQLite ledger on local disk) is first filled with
``--rows`` rows in ``--batch``-row appends, timed; the one-shot release of the same rows through
``dpsql.tops`` (charged to the same kind of ledger, answer stored) is timed in the same process.
Then appends of 1, 24 and 10^5 new rows are timed ``--repeat`` times each (medians), with the
ledger file's growth per append, against the size of the released rows themselves.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
from _report import markdown_table, write_section

import dpsql

UPPER = 1000.0


def _ledger_size(path: Path) -> int:
    """Bytes of the ledger and its write-ahead log."""
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--batch", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    values = rng.poisson(300.0, args.rows).astype(np.float64)
    table = pa.table({"ts": np.arange(args.rows), "v": values})
    with tempfile.TemporaryDirectory() as directory:
        one_shot_path = Path(directory) / "one-shot.sqlite"
        start = time.perf_counter()
        dpsql.tops(values, epsilon=1.0, upper=UPPER, budget=dpsql.Budget.open(one_shot_path, epsilon=10.0))
        one_shot = time.perf_counter() - start

        path = Path(directory) / "stream.sqlite"
        budget = dpsql.Budget.open(path, epsilon=10.0)
        stream = budget.stream("bench", method="tops", epsilon=1.0, order_by="ts", value="v", upper=UPPER)
        start = time.perf_counter()
        for at in range(0, args.rows, args.batch):
            stream.append(table.slice(at, args.batch))
        appended = time.perf_counter() - start

        latency = []
        next_key = args.rows
        for size in (1, 24, 100_000):
            seconds, growth = [], []
            for _ in range(args.repeat):
                rows = pa.table({"ts": np.arange(next_key, next_key + size), "v": np.full(size, 300.0)})
                next_key += size
                before = _ledger_size(path)
                begin = time.perf_counter()
                stream.append(rows)
                seconds.append(time.perf_counter() - begin)
                growth.append(_ledger_size(path) - before)
            latency.append([f"{size:,}", statistics.median(seconds) * 1000, statistics.median(growth) / size])
    body = (f"A stream that has released {args.rows:,} rows (ToPS, epsilon 1, one partition, SQLite ledger on "
            f"local disk, synchronous=FULL: every append is fsync'ed before it returns).\n\n"
            + markdown_table(["rows appended", "median ms", "ledger bytes per row"], latency)
            + f"\n\nAppending {args.rows:,} rows in {args.rows // args.batch:,} appends of {args.batch:,}: "
              f"{appended:.2f} s; one one-shot release of the same rows (`dpsql.tops`, answer stored): "
              f"{one_shot:.2f} s; ratio **{appended / one_shot:.2f}x** (target at most 1.5x). "
              "An append stores each released row's key, value and keyed value tag (24 bytes before LZ4) "
              "and rewrites only the partition's open state.")
    write_section("continual", "Continual release: append latency and throughput", body)
    print(body)


if __name__ == "__main__":
    main()
