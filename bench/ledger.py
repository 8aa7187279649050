"""The ledger: time per charge on a ledger that has recorded many releases.

    python bench/ledger.py [--releases 200000] [--charges 200]

A scope is filled with ``--releases`` charges (written directly in large transactions, as
the recorded history of a busy team), then ``--charges`` charges are timed one by one through
:meth:`dpsql.Budget.charge`, each one durable (SQLite WAL, synchronous=FULL) before it returns.
A charge reads the scope's running total, not its history, so its time should not grow
with the history. Also timed: the same charges on an empty ledger, in the same process.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from _report import markdown_table, write_section

import dpsql
from dpsql.accounting import Charge, Neighbour, exact, fraction_text

CHARGE = Charge(method="laplace", epsilon=1e-9, delta=0.0, neighbour=Neighbour.REPLACE_ONE, rows=1000)


def _fill(budget: dpsql.Budget, releases: int) -> None:
    """``releases`` recorded charges, and the running total they add up to."""
    ledger = budget.ledger
    with ledger.transaction("fill the benchmark ledger") as conn:
        rows = [(str(uuid.uuid4()), budget.scope, "2026-01-01T00:00:00Z", "laplace", "{}", "1e-09", "0.0", 1000, 1,
                 CHARGE.neighbour.value, 1, None, "release", None, None) for _ in range(releases)]
        conn.executemany("INSERT INTO charges (release_id, scope, time, method, params, epsilon, delta, rows, "
                         "partitions, neighbour, private, note, kind, stream, answers) "
                         "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
        ledger.execute(conn, "UPDATE scopes SET spent_epsilon = ?, charges = ? WHERE scope = ?",
                       (fraction_text(releases * exact(1e-9)), releases, budget.scope))


def _timed(budget: dpsql.Budget, charges: int) -> list[float]:
    seconds = []
    for _ in range(charges):
        start = time.perf_counter()
        budget.charge(CHARGE)
        seconds.append(time.perf_counter() - start)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--releases", type=int, default=200_000)
    parser.add_argument("--charges", type=int, default=200)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        for label, releases in (("empty ledger", 0), (f"{args.releases:,} releases recorded", args.releases)):
            budget = dpsql.Budget.open(Path(directory) / f"{releases}.sqlite", epsilon=1.0)
            _fill(budget, releases)
            seconds = _timed(budget, args.charges)
            assert budget.ledger.scope(budget.scope).charges == releases + args.charges
            rows.append([label, statistics.median(seconds) * 1000, sorted(seconds)[int(0.95 * len(seconds))] * 1000])
    body = (markdown_table(["ledger", "median ms per charge", "95th percentile ms"], rows)
            + "\n\nEach charge is one `BEGIN IMMEDIATE` transaction that reads the scope's running total (an exact "
              "fraction), checks it, records the charge and updates the total, committed durably (SQLite WAL, "
              "synchronous=FULL) before it returns. Target: under 5 ms on the ledger with 200,000 releases.")
    write_section("ledger", "Ledger: time per charge", body)
    print(body)


if __name__ == "__main__":
    main()
