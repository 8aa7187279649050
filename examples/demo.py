"""dpsql demo: real traffic counts released privately through DuckDB SQL and through a
Polars expression, both charged to one persistent ledger.

Run: ``python examples/demo.py`` (after ``pip install -e '.[examples]'``).

Data: hourly traffic volume on Interstate 94 (48,204 hours, shipped in
``examples/data``). Privacy unit: one hour's value (replace-one-value neighbours; the
hourly time axis is public). Public bound: 8,000 vehicles per hour. Each release below
is ToPS at epsilon = 1: a private clipping threshold from a 2,000-hour hold-out, then a fan-out-16
hierarchy with online consistency and the "recent" smoother. Everything computed from a
release afterwards (monthly and four-week sums, intervals) is free post-processing.

The ledger is an SQLite file, ``examples/output/demo-ledger.sqlite``, with a budget of
epsilon = 3 for the scope ``traffic-demo``. Each run spends 2, so the second run finds
the budget nearly spent and the ledger refuses: that refusal is the point of a ledger.
Delete the file to start over.
"""

from __future__ import annotations

from pathlib import Path

import duckdb
import polars as pl

import dpsql
import dpsql.duckdb
import dpsql.polars

HERE = Path(__file__).resolve().parent
DATA = HERE / "data" / "traffic_volume_hourly.csv.gz"
LEDGER = HERE / "output" / "demo-ledger.sqlite"
# The first 2,000 hours (83 days) are the hold-out that ToPS learns its threshold from;
# those hours are released as equal shares of one noisy total, so the output below
# looks at later days.
RELEASE = dict(epsilon=1.0, upper=8000.0, m=2000)


def sql_release(budget: dpsql.Budget) -> None:
    con = duckdb.connect()
    dpsql.duckdb.register(con, budget=budget)
    con.execute(f"CREATE TABLE traffic AS SELECT ts, volume FROM read_csv('{DATA}')")
    # One release, materialised; every query on `released` afterwards is free.
    con.execute(f"""CREATE TABLE released AS SELECT * FROM dp_range_sum('traffic', 'ts', 'volume', method := 'tops',
                    epsilon := {RELEASE['epsilon']}, upper := {RELEASE['upper']},
                    m := {RELEASE['m']})""")
    monthly = """
        WITH private AS (
            SELECT date_trunc('month', ts) AS month, sum(volume) AS private_total,
                   dp_range_margin(min(dp_row), max(dp_row) + 1) AS margin_95
            FROM released GROUP BY month),
        truth AS (SELECT date_trunc('month', ts) AS month, sum(volume)::BIGINT AS true_total
                  FROM traffic GROUP BY month)
        SELECT * FROM private JOIN truth USING (month) ORDER BY month LIMIT 6 OFFSET 4"""
    print("SQL: monthly totals of the private stream with the 95 % noise margin")
    print("(true totals read from the raw table for this demo only)")
    print(con.sql(monthly).pl())
    con.close()


def polars_release(budget: dpsql.Budget) -> None:
    traffic = pl.read_csv(DATA, try_parse_dates=True)
    released = traffic.with_columns(
        pl.col("volume").dpsql.range_sum(method="tops", order_by="ts", budget=budget, errors=True, **RELEASE)
        .alias("private"))
    four_weeks = dpsql.polars.bucket_ci(released, "private", order_by="ts", every="4w")
    print("\nPolars: four-week totals of the private stream with 95 % intervals")
    print(four_weeks.slice(4, 6))


def main() -> None:
    LEDGER.parent.mkdir(exist_ok=True)
    budget = dpsql.Budget.open(LEDGER, scope="traffic-demo", epsilon=3.0)
    print("ledger before:", budget, "\n")
    try:
        sql_release(budget)
        polars_release(budget)
    except dpsql.BudgetExhausted as refused:
        print(f"\nThe ledger refused the release: {refused}\nDelete {LEDGER} to start the demo over.")
    print("\nledger after:", budget)
    print(budget.history().select("time", "method", "epsilon", "delta", "rows", "neighbour"))


if __name__ == "__main__":
    main()
