"""The ledger (issue 13): time per charge on a ledger that has recorded many releases, and the
share of a large DuckDB release spent fingerprinting its data for the answer cache.

    python bench/ledger.py [--releases 200000] [--charges 200] [--rows 10000000] [--repeat 5]

Charges: three SQLite ledgers on local disk (WAL, synchronous=FULL) are filled with 0,
``--releases / 10`` and ``--releases`` recorded releases (a charge row, a release record with a
real release's description and its row handles, and a stored answer each, written directly in
large transactions as the history of a busy team). Then, taking turns between the ledgers,
``--charges`` charges are timed one by one through :meth:`dpsql.Budget.charge` (the charge
alone) and as many fresh releases of 1,000 values through ``dpsql.laplace(..., fresh=True)``
(charge, release record, row handles and stored answer in one transaction), each durable
before it returns. A charge reads the scope's running total, not its history, so neither
should grow with the history.

Fingerprint: a ``--rows``-row table in random physical order in DuckDB; ``dp_range_sum(...,
fresh := true)`` is timed on a connection whose budget caches answers (the release's data are
fingerprinted and its answer stored) and on one registered with ``Budget.in_memory(...,
cache=False)`` (neither), interleaved; and inside the cached runs the fingerprint call itself
(:func:`dpsql._fingerprint.fingerprint`, wrapped with a timer) and the answer's compression.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

sys.path.insert(0, str(Path(__file__).parent))
from _report import interleaved, markdown_table, write_section

import dpsql
import dpsql.duckdb
from dpsql import _state, publishing
from dpsql.accounting import Charge, Neighbour, exact, fraction_text
from dpsql.records import describe

CHARGE = Charge(method="laplace", epsilon=1e-9, delta=0.0, neighbour=Neighbour.REPLACE_ONE, rows=1000)
DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "traffic_volume_hourly.csv"
UPPER = 8000.0


def _fill(budget: dpsql.Budget, releases: int) -> None:
    """``releases`` recorded releases of 1,000 rows (charge, record, handles, stored answer),
    and the running total they add up to."""
    if not releases:
        return
    sample = dpsql.laplace(np.ones(1000), epsilon=1.0, upper=2.0, budget=dpsql.Budget.in_memory(epsilon=1.0))
    description = _state.pack(describe(sample))
    answer = publishing._packed_values(sample.values)
    ledger = budget.ledger
    with ledger.transaction("fill the benchmark ledger") as conn:
        first = int(ledger.execute(conn, "SELECT value FROM ledger_meta WHERE key = 'next_handle'").fetchone()[0])
        ids = [str(uuid.uuid4()) for _ in range(releases)]
        conn.executemany("INSERT INTO charges (release_id, scope, time, method, params, epsilon, delta, rows, "
                         "partitions, neighbour, private, note, kind, stream, answers) "
                         "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                         [(i, budget.scope, "2026-01-01T00:00:00Z", "laplace", "{}", "1e-09", "0.0", 1000, 1,
                           CHARGE.neighbour.value, 1, None, "release", None, None) for i in ids])
        conn.executemany("INSERT INTO releases (release_id, scope, first_handle, handles, description) "
                         "VALUES (?, ?, ?, ?, ?)",
                         [(i, budget.scope, first + 1000 * k, 1000, description) for k, i in enumerate(ids)])
        conn.executemany("INSERT INTO answers (fingerprint, scope, release_id, created, answer) VALUES (?, ?, ?, ?, ?)",
                         [(uuid.uuid4().hex * 2, budget.scope, i, "2026-01-01T00:00:00Z", answer) for i in ids])
        ledger.execute(conn, "UPDATE ledger_meta SET value = ? WHERE key = 'next_handle'",
                       (str(first + 1000 * releases),))
        ledger.execute(conn, "UPDATE scopes SET spent_epsilon = ?, charges = ? WHERE scope = ?",
                       (fraction_text(releases * exact(1e-9)), releases, budget.scope))


def charges(args) -> tuple[str, dict]:
    sizes = [0, args.releases // 10, args.releases]
    values = np.random.default_rng(0).uniform(0, 2, 1000)
    seconds: dict[tuple[int, str], list[float]] = {(s, k): [] for s in sizes for k in ("charge", "release")}
    files = {}
    with tempfile.TemporaryDirectory(dir=Path(__file__).resolve().parent.parent) as directory:
        budgets = {}
        for size in sizes:
            path = Path(directory) / f"{size}.sqlite"
            budgets[size] = dpsql.Budget.open(path, epsilon=1.0)
            _fill(budgets[size], size)
            budgets[size].charge(CHARGE)  # open the connection, warm the file's pages
        for _ in range(args.charges):
            for size, budget in budgets.items():
                start = time.perf_counter()
                budget.charge(CHARGE)
                middle = time.perf_counter()
                dpsql.laplace(values, epsilon=1e-6, upper=2.0, budget=budget, fresh=True)  # >= the smallest for upper=2
                end = time.perf_counter()
                seconds[size, "charge"].append(middle - start)
                seconds[size, "release"].append(end - middle)
        for size, budget in budgets.items():
            assert budget.ledger.scope(budget.scope).charges == size + 1 + 2 * args.charges
            files[size] = sum(p.stat().st_size for p in Path(directory).glob(f"{size}.sqlite*"))
    rows = []
    for size in sizes:
        c, r = seconds[size, "charge"], seconds[size, "release"]
        rows.append([f"{size:,}", files[size] / 2**20, statistics.median(c) * 1e3, np.percentile(c, 95) * 1e3,
                     statistics.median(r) * 1e3, np.percentile(r, 95) * 1e3])
    worst = max(statistics.median(seconds[s, "charge"]) for s in sizes) * 1e3
    body = (markdown_table(["releases recorded", "ledger MiB", "charge alone: median ms", "p95 ms",
                            "fresh 1,000-value release: median ms", "p95 ms"], rows)
            + f"\n\n{args.charges} charges and {args.charges} releases per ledger, the ledgers taking turns. Each "
              "charge is one `BEGIN IMMEDIATE` transaction that reads the scope's running total (an exact "
              "fraction), checks it, records the charge and updates the total, committed durably (SQLite WAL, "
              "synchronous=FULL) before it returns; a release adds its record, row handles and stored answer to "
              "the same transaction. Target: under 5 ms per charge on the ledger with "
              f"{args.releases:,} releases, flat in its size: **{'met' if worst < 5 else 'NOT met'}** (worst "
              f"median {worst:.2f} ms).")
    return body, {"worst": worst}


def _table(rows: int) -> pa.Table:
    volume = pacsv.read_csv(DATA).column("volume").to_numpy().astype(np.float64)
    shuffle = np.random.default_rng(0).permutation(rows)  # the benchmark's data, not noise
    return pa.table({"ts": np.arange(rows, dtype=np.int64)[shuffle], "volume": np.resize(volume, rows)[shuffle]})


def fingerprint_share(args) -> str:
    table = _table(args.rows)
    connections = {}
    for name, cache in (("cached", True), ("uncached", False)):
        con = duckdb.connect()
        con.from_arrow(table).create("t")
        dpsql.duckdb.register(con, budget=dpsql.Budget.in_memory(epsilon=1e9, cache=cache))
        connections[name] = con
    steps: dict[str, list[float]] = {"fingerprint": [], "answer": []}
    original = {"fingerprint": publishing.fingerprint, "answer": publishing._packed_values}

    def timed(step):
        def run(*a, **k):
            start = time.perf_counter()
            try:
                return original[step](*a, **k)
            finally:
                steps[step].append(time.perf_counter() - start)
        return run

    publishing.fingerprint, publishing._packed_values = timed("fingerprint"), timed("answer")
    query = ("SELECT * FROM dp_range_sum('t', 'ts', 'volume', method := '{}', epsilon := 1, upper := 8000, "
             "fresh := true)")
    rows = []
    load_before = os.getloadavg()[0]
    try:
        for method in ("tops", "laplace"):
            sql = query.format(method)
            runs = {name: (lambda con=con, sql=sql: con.sql(sql).to_arrow_table()) for name, con in connections.items()}
            for s in steps.values():
                s.clear()
            times = interleaved(runs, args.repeat, warm_up=True)
            fp, answer = steps["fingerprint"][1:], steps["answer"][1:]  # without the warm-up
            cached, uncached = min(times["cached"]), min(times["uncached"])
            rows.append([f"`{method}`", cached, uncached, (cached - uncached) / cached, min(fp), min(fp) / cached,
                         min(answer), min(answer) / cached])
    finally:
        publishing.fingerprint, publishing._packed_values = original["fingerprint"], original["answer"]
    load_after = os.getloadavg()[0]
    worst = max(r[5] for r in rows)
    return (f"`SELECT * FROM dp_range_sum('t', 'ts', 'volume', method := ..., epsilon := 1, upper := 8000, fresh := "
            f"true)` on {args.rows:,} rows in random physical order (integer time keys), fetched with "
            f"`to_arrow_table()`; best of {args.repeat} interleaved runs after a warm-up. Method 1: the release on a "
            "connection whose budget caches answers against the same release on one registered with "
            "`Budget.in_memory(..., cache=False)` (no fingerprint, no stored answer). Method 2: the fingerprint "
            "call itself (`dpsql._fingerprint.fingerprint` over the values in stream order, partition bounds and "
            "the order keys, wrapped with a timer inside the cached runs) and the answer's compression "
            "(`_packed_values`, zstd level 1) likewise.\n\n"
            + markdown_table(["method", "release with cache s", "release with cache=False s",
                              "(with - without) / with", "fingerprint s", "fingerprint / release",
                              "answer compression s", "compression / release"], rows)
            + f"\n\nTarget: fingerprint <= 20 % of the release time: **{'met' if worst <= 0.2 else 'NOT met'}** "
              f"(method 2, worst {worst:.0%}). Method 1 is noisier (two separate releases' difference, and the "
              f"stored answer's compression and insertion count with it). Load average (1 min) before / after: "
              f"{load_before:.2f} / {load_after:.2f} on {os.cpu_count()} cores.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--releases", type=int, default=200_000)
    parser.add_argument("--charges", type=int, default=200)
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    charge_body, _ = charges(args)
    load_after = os.getloadavg()[0]
    charge_body += (f" Load average (1 min) before / after: {load_before:.2f} / {load_after:.2f} on "
                    f"{os.cpu_count()} cores.")
    body = "### Time per charge\n\n" + charge_body + "\n\n### Fingerprint share of a large release\n\n" + \
        fingerprint_share(args)
    write_section("ledger", "Ledger: time per charge, fingerprint share", body)
    print(body)


if __name__ == "__main__":
    main()
