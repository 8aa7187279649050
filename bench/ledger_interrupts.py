"""The ledger's interrupt safety (issue 23): what holding signals back costs per ledger block,
and how long a writer waits for SQLite's write lock while another process charges in a loop.

    python bench/ledger_interrupts.py [--blocks 20000] [--charges 400] [--rounds 4]

Guard: :func:`dpsql.ledger.interrupts.hold` and :func:`~dpsql.ledger.interrupts.release`, the
pair every ledger block (a transaction or a read) runs on the main thread, timed ``--blocks``
times in a row; against a read block (``Ledger.scope``: one SELECT) and a charge
(``Budget.charge``: one ``BEGIN IMMEDIATE`` transaction, committed durably) on an SQLite
ledger on local disk, ``--charges`` of each, one by one.

Lock wait: another process charges the same ledger in a loop; this one times ``--charges``
charges, split into ``--rounds`` rounds that take turns between dpsql's wait (``BEGIN
IMMEDIATE`` tried again after interruptible sleeps of 0.5 to 4 ms) and SQLite's own (its busy
handler, sleeping 1 to 100 ms between tries, deaf to Ctrl-C).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _report import markdown_table, write_section

import dpsql
from dpsql.accounting import Charge, Neighbour
from dpsql.ledger import interrupts
from dpsql.ledger.sqlite import SqliteBackend

CHARGE = Charge(method="laplace", epsilon=1e-9, delta=0.0, neighbour=Neighbour.REPLACE_ONE, rows=1)


def _timed(action, count: int) -> list[float]:
    """Seconds each of ``count`` calls of ``action`` took."""
    times = []
    for _ in range(count):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return times


def _guard_pair() -> None:
    interrupts.release(interrupts.hold())


def _sqlite_wait(self, conn) -> None:
    """SQLite's own wait for the write lock: its busy handler, for the connection's timeout."""
    conn.execute("BEGIN IMMEDIATE")


def _lock_waits(path: Path, charges: int, rounds: int) -> dict[str, list[float]]:
    budget = dpsql.Budget.open(path)
    other = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import dpsql
        from dpsql.accounting import Charge, Neighbour
        charge = Charge(method="laplace", epsilon=1e-9, delta=0.0, neighbour=Neighbour.REPLACE_ONE, rows=1)
        budget = dpsql.Budget.open({str(path)!r})
        print("charging", flush=True)
        while True:
            budget.charge(charge)
    """)], stdout=subprocess.PIPE)
    waits: dict[str, list[float]] = {"dpsql": [], "SQLite": []}
    polled = SqliteBackend.begin
    try:
        assert other.stdout.readline().strip() == b"charging"
        for _ in range(rounds):
            for name, begin in (("dpsql", polled), ("SQLite", _sqlite_wait)):
                SqliteBackend.begin = begin
                waits[name] += _timed(lambda: budget.charge(CHARGE), charges // rounds)
    finally:
        SqliteBackend.begin = polled
        other.kill()
        other.wait()
    return waits


def _ms(times: list[float], q: float) -> float:
    return statistics.quantiles(times, n=100)[q - 1] * 1e3 if q < 100 else max(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=20_000)
    parser.add_argument("--charges", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=Path(__file__).resolve().parent.parent) as folder:
        path = Path(folder) / "ledger.sqlite"
        budget = dpsql.Budget.open(path, epsilon=1e6)
        guard = statistics.median(_timed(_guard_pair, args.blocks))
        read = statistics.median(_timed(lambda: budget.ledger.scope(budget.scope), args.charges))
        charge = statistics.median(_timed(lambda: budget.charge(CHARGE), args.charges))
        budget.ledger.close()
        waits = _lock_waits(path, args.charges, args.rounds)
    cost = markdown_table(["", "median us", "guard share"], [
        ["guard: hold + release", f"{guard * 1e6:.3g}", ""],
        ["read block (one SELECT)", f"{read * 1e6:.3g}", f"{guard / read:.1%}"],
        ["charge (durable transaction)", f"{charge * 1e6:.3g}", f"{guard / charge:.2%}"]])
    wait = markdown_table(["wait for the write lock", "median ms", "p95 ms", "p99 ms", "max ms"], [
        [name, f"{_ms(times, 50):.3g}", f"{_ms(times, 95):.3g}", f"{_ms(times, 99):.3g}", f"{_ms(times, 100):.3g}"]
        for name, times in waits.items()])
    body = f"""
### What holding signals back costs

{cost}

Every ledger block on the main thread replaces the Python handlers of the catchable signals
with one that holds a signal back while a critical function (opening, committing, rolling back)
is on the interrupted stack, and restores them after; a signal arriving in the body is handled
at once. {args.blocks:,} guard pairs, {args.charges} reads and {args.charges} charges, one by one.

### A charge while another process charges in a loop

{wait}

{args.charges} charges per wait, in {args.rounds} rounds taking turns. dpsql's wait tries `BEGIN IMMEDIATE`
again after sleeps of 0.5 ms doubling to 4 ms (a sleep Ctrl-C ends); SQLite's own busy handler
sleeps 1, 2, 5, ... up to 100 ms between tries and cannot be interrupted, so a process writing in a
loop can take the lock back between them. Load average (1 min) before / after: {load_before:.2f} /
{os.getloadavg()[0]:.2f} on {os.cpu_count()} cores. Whole run: {time.monotonic() - started:.0f} s.
"""
    write_section("ledger_interrupts", "Ledger: interrupt guard cost, write-lock wait", body)
    print(body)


if __name__ == "__main__":
    main()
