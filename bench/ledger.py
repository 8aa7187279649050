"""The ledger (issue 13): time per charge on a ledger that has recorded many releases, the
share of a large DuckDB release spent fingerprinting its data for the answer cache, and what
the answer cache costs (issue 21): the bytes a large release adds to the ledger and the time
of an identical repeat (a cache hit) against a fresh release.

    python bench/ledger.py [--releases 200000] [--charges 200] [--rows 10000000] [--repeat 5]
                           [--only charges|cache] [--baseline CHECKOUT]

Charges: three SQLite ledgers on local disk (WAL, synchronous=FULL) are filled with 0,
``--releases / 10`` and ``--releases`` recorded releases (a charge row, a release record with a
real release's description and its row handles, and a stored answer each, written directly in
large transactions as the history of a busy team). Then, taking turns between the ledgers,
``--charges`` charges are timed one by one through :meth:`dpsql.Budget.charge` (the charge
alone) and as many fresh releases of 1,000 values through ``dpsql.laplace(..., fresh=True)``
(charge, release record, row handles and cached answer in one transaction), each durable
before it returns. A charge reads the scope's running total, not its history, so neither
should grow with the history.

Fingerprint: a ``--rows``-row table in random physical order in DuckDB; ``dp_range_sum(...,
fresh := true)`` is timed on a connection whose budget caches answers (the release's data are
fingerprinted and its answer stored) and on one registered with ``Budget.in_memory(...,
cache=False)`` (neither), interleaved; and inside the cached runs the fingerprint call itself
(:func:`dpsql._fingerprint.fingerprint`, wrapped with a timer) and the digest of the values
that the cached answer keeps.

Answer cache: ``--rows`` values released by ``dpsql.publish`` into an SQLite ledger on local
disk, the bytes the release added to the ledger (its pages, after a checkpoint), then fresh
releases (``fresh=True``) and identical repeats (cache hits, recomputed from the stored key)
timed in turns. ``--baseline CHECKOUT`` measures the same in a process importing the dpsql of
another checkout (e.g. the main branch before a change) for comparison; ``--only`` runs one part.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sqlite3
import statistics
import subprocess
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
    """``releases`` recorded releases of 1,000 rows (charge, record, handles, cached answer),
    and the running total they add up to."""
    if not releases:
        return
    sample = dpsql.laplace(np.ones(1000), epsilon=1.0, upper=2.0, budget=dpsql.Budget.in_memory(epsilon=1.0))
    description = _state.pack(describe(sample))
    digest = publishing.values_digest(sample.values)
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
        conn.executemany("INSERT INTO answers (fingerprint, scope, release_id, created, answer, principal, private, "
                         "secret) VALUES (?, ?, ?, ?, ?, ?, 1, ?)",
                         [(uuid.uuid4().hex * 2, budget.scope, i, "2026-01-01T00:00:00Z", digest, budget.principal,
                           os.urandom(32)) for i in ids])
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
              "synchronous=FULL) before it returns; a release adds its record, row handles and cached answer to "
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
    original = {"fingerprint": publishing.fingerprint, "answer": publishing.values_digest}

    def timed(step):
        def run(*a, **k):
            start = time.perf_counter()
            try:
                return original[step](*a, **k)
            finally:
                steps[step].append(time.perf_counter() - start)
        return run

    publishing.fingerprint, publishing.values_digest = timed("fingerprint"), timed("answer")
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
        publishing.fingerprint, publishing.values_digest = original["fingerprint"], original["answer"]
    load_after = os.getloadavg()[0]
    worst = max(r[5] for r in rows)
    return (f"`SELECT * FROM dp_range_sum('t', 'ts', 'volume', method := ..., epsilon := 1, upper := 8000, fresh := "
            f"true)` on {args.rows:,} rows in random physical order (integer time keys), fetched with "
            f"`to_arrow_table()`; best of {args.repeat} interleaved runs after a warm-up. Method 1: the release on a "
            "connection whose budget caches answers against the same release on one registered with "
            "`Budget.in_memory(..., cache=False)` (no fingerprint, no cached answer). Method 2: the fingerprint "
            "call itself (`dpsql._fingerprint.fingerprint` over the values in stream order, partition bounds and "
            "the order keys, wrapped with a timer inside the cached runs) and the digest of the released values "
            "that the cached answer keeps (`values_digest`, SHA-256) likewise.\n\n"
            + markdown_table(["method", "release with cache s", "release with cache=False s",
                              "(with - without) / with", "fingerprint s", "fingerprint / release",
                              "values digest s", "digest / release"], rows)
            + f"\n\nTarget: fingerprint <= 20 % of the release time: **{'met' if worst <= 0.2 else 'NOT met'}** "
              f"(method 2, worst {worst:.0%}). Method 1 is noisier (two separate releases' difference, and the "
              f"values' digest and the answer's insertion count with it). Load average (1 min) before / after: "
              f"{load_before:.2f} / {load_after:.2f} on {os.cpu_count()} cores.")


def _ledger_bytes(path: Path) -> tuple[int, int]:
    """The ledger's size with every committed page in its main file, and the bytes of what its
    releases recorded (every field of the charges, releases and answers tables, whatever the layout)."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        pages = conn.execute("PRAGMA page_count").fetchone()[0] * conn.execute("PRAGMA page_size").fetchone()[0]
        recorded = 0
        for table in ("charges", "releases", "answers"):
            columns = [row[1] for row in conn.execute(f"PRAGMA table_info({table})")]
            recorded += conn.execute("SELECT " + " + ".join(f"coalesce(sum(length({c})), 0)" for c in columns)
                                     + f" FROM {table}").fetchone()[0]
    return pages, recorded


def cache_figures(rows: int, repeat: int) -> dict[str, dict[str, float]]:
    """Per method: bytes the release added to an SQLite ledger (its file's growth, what it recorded),
    and the best seconds of a fresh
    release and of an identical repeat answered from the ledger. Public API only, so that it
    measures any checkout of dpsql."""
    values = np.resize(pacsv.read_csv(DATA).column("volume").to_numpy().astype(np.float64), rows)
    figures = {}
    with tempfile.TemporaryDirectory(dir=Path(__file__).resolve().parent.parent) as directory:
        for method in ("tops", "laplace"):
            path = Path(directory) / f"{method}.sqlite"
            budget = dpsql.Budget.open(path, epsilon=1e9)
            before = _ledger_bytes(path)
            release = functools.partial(dpsql.publish, method, values, budget=budget, epsilon=1.0, upper=UPPER)
            release()
            after = _ledger_bytes(path)
            times = interleaved({"fresh": functools.partial(release, fresh=True), "hit": release}, repeat)
            kinds = budget.history()["kind"].to_list()
            assert kinds.count("cache hit") == repeat, kinds
            figures[method] = {"file": after[0] - before[0], "bytes": after[1] - before[1],
                               "fresh": min(times["fresh"]), "hit": min(times["hit"])}
            budget.ledger.close()
    return figures


def answer_cache(args) -> str:
    load_before = os.getloadavg()[0]
    figures = cache_figures(args.rows, args.repeat)
    load_after = os.getloadavg()[0]
    before = None
    if args.baseline:
        out = subprocess.run([sys.executable, __file__, "--figures", "--rows", str(args.rows), "--repeat",
                              str(args.repeat)], env={**os.environ, "PYTHONPATH": args.baseline}, check=True,
                             stdout=subprocess.PIPE, text=True).stdout
        before = json.loads(out)
    rows = []
    for method, f in figures.items():
        was = [] if before is None else [before[method]["bytes"] / 1024, before[method]["file"] / 1024,
                                         before[method]["fresh"], before[method]["hit"]]
        rows.append([f"`{method}`", f["bytes"] / 1024, f["file"] / 1024, *was[:2], f["fresh"], f["hit"], *was[2:],
                     f["hit"] / f["fresh"]])
    header = ["method", "KiB recorded by the release", "ledger file growth KiB",
              *(["before: KiB recorded", "before: file growth KiB"] if before else []), "fresh release s",
              "cache hit s", *(["before: fresh s", "before: cache hit s"] if before else []), "hit / fresh"]
    worst_bytes = max(max(f["bytes"], f["file"]) for f in figures.values()) / 1024
    worst_ratio = max(f["hit"] / f["fresh"] for f in figures.values())
    baseline = (f" The `before` columns: the same measurement in a process importing the dpsql of "
                f"`{args.baseline}` (answers holding the values)." if before else "")
    return (f"`dpsql.publish(method, values, epsilon=1, upper={UPPER:g})` on {args.rows:,} values (traffic volumes "
            "tiled) into an SQLite ledger on local disk. Bytes: what the first release recorded (every field of its "
            "charge, its release record with error models, and its cached answer) and how much the ledger file "
            "grew (its pages after a checkpoint; a few KiB fit in the pages the tables already have). Times: best "
            "of "
            f"{args.repeat} fresh releases (`fresh=True`: fingerprint, release, charge) and {args.repeat} identical "
            "repeats (fingerprint, lookup, the release recomputed from its stored key, the values' digest checked, "
            "the hit recorded), taking turns." + baseline + "\n\n" + markdown_table(header, rows)
            + f"\n\nTargets: kilobytes, not megabytes, per release: **{'met' if worst_bytes < 1024 else 'NOT met'}** "
              f"(worst {worst_bytes:.0f} KiB); a hit costs at most one release: "
              f"**{'met' if worst_ratio <= 1 else 'NOT met'}** (worst {worst_ratio:.2f}x). Load average (1 min) "
              f"before / after: {load_before:.2f} / {load_after:.2f} on {os.cpu_count()} cores.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--releases", type=int, default=200_000)
    parser.add_argument("--charges", type=int, default=200)
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--only", choices=["charges", "cache"], help="run one part (and write only its section)")
    parser.add_argument("--baseline", help="a dpsql checkout whose answer cache is measured for comparison")
    parser.add_argument("--figures", action="store_true", help=argparse.SUPPRESS)  # --baseline's subprocess
    args = parser.parse_args()
    if args.figures:
        print(json.dumps(cache_figures(args.rows, args.repeat)))
        return
    if args.only != "cache":
        load_before = os.getloadavg()[0]
        charge_body, _ = charges(args)
        load_after = os.getloadavg()[0]
        charge_body += (f" Load average (1 min) before / after: {load_before:.2f} / {load_after:.2f} on "
                        f"{os.cpu_count()} cores.")
        body = "### Time per charge\n\n" + charge_body + "\n\n### Fingerprint share of a large release\n\n" + \
            fingerprint_share(args)
        write_section("ledger", "Ledger: time per charge, fingerprint share", body)
        print(body)
    if args.only != "charges":
        body = answer_cache(args)
        write_section("answer_cache", "Answer cache: bytes per release, time of a hit", body)
        print(body)


if __name__ == "__main__":
    main()
