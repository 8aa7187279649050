"""Traffic walk-through in DuckDB SQL: release hourly traffic volume privately once,
then query it with ordinary SQL windows (hourly, daily, 7-day rolling sums) with 95 %
intervals, and show the ledger before and after.

Run: ``python examples/traffic_sql.py`` (reads ``../shared/data/traffic_volume_hourly.csv``
next to the repository, or the copy shipped in ``examples/data``).

Privacy: the hourly ``volume`` column is released once with ToPS (epsilon = 1,
replace-one-hour's-value neighbours, public bound 8,000 vehicles per hour; hours are
a public, gap-free time domain). That is the only charge. The window sums, intervals
and everything else below are free post-processing of the released column. The
coverage check at the end reads the raw data and is for this demonstration only.
"""

from __future__ import annotations

from pathlib import Path

import duckdb

import dpsql
import dpsql.duckdb

HERE = Path(__file__).resolve().parent
SHARED = HERE.parent.parent / "shared" / "data" / "traffic_volume_hourly.csv"
DATA = SHARED if SHARED.exists() else HERE / "data" / "traffic_volume_hourly.csv.gz"

WINDOWS = """
    SELECT ts,
           volume AS hourly, dp_range_margin(dp_row, dp_row + 1) AS hourly_margin,
           sum(volume) OVER day AS daily,
           dp_range_margin(min(dp_row) OVER day, max(dp_row) OVER day + 1) AS daily_margin,
           sum(volume) OVER week AS weekly,
           dp_range_margin(min(dp_row) OVER week, max(dp_row) OVER week + 1) AS weekly_margin
    FROM released
    WINDOW day AS (ORDER BY ts RANGE BETWEEN INTERVAL 23 HOURS PRECEDING AND CURRENT ROW),
           week AS (ORDER BY ts RANGE BETWEEN INTERVAL 167 HOURS PRECEDING AND CURRENT ROW)
    ORDER BY ts"""


def main() -> None:
    # A real deployment keeps its ledger on disk: dpsql.Budget.open("ledger.sqlite", epsilon=2.0)
    budget = dpsql.Budget.in_memory(epsilon=2.0)
    con = duckdb.connect()
    dpsql.duckdb.register(con, budget=budget)
    con.execute(f"CREATE TABLE traffic AS SELECT ts, volume FROM read_csv('{DATA}') ORDER BY random()")
    print("ledger before:", budget)

    # One release, materialised: every later query reads it without a new charge. (Running
    # the same dp_range_sum(...) again would be answered from the ledger, also free.)
    con.execute("""
        CREATE TABLE released AS
        SELECT * FROM dp_range_sum('traffic', 'ts', 'volume', method := 'tops', epsilon := 1, upper := 8000)""")
    print("ledger after: ", budget)
    print(budget.history().select("method", "epsilon", "delta", "rows", "note"))

    windows = con.sql(WINDOWS)
    print("\nreleased stream with 95 % intervals (value ± margin), 120 days in (inside the 4,096-hour hold-out,"
          "\nreleased in blocks: a single hour's interval says how little one block tells about its hours):")
    print(windows.limit(5, offset=24 * 120).pl())

    # Demonstration only (reads the raw data): how often the intervals cover the truth.
    coverage = con.sql(f"""
        WITH truth AS (SELECT ts, sum(volume) OVER day AS daily, sum(volume) OVER week AS weekly FROM traffic
                       WINDOW day AS (ORDER BY ts RANGE BETWEEN INTERVAL 23 HOURS PRECEDING AND CURRENT ROW),
                              week AS (ORDER BY ts RANGE BETWEEN INTERVAL 167 HOURS PRECEDING AND CURRENT ROW))
        SELECT avg((abs(w.daily - t.daily) <= w.daily_margin)::INT) AS daily_coverage,
               avg((abs(w.weekly - t.weekly) <= w.weekly_margin)::INT) AS weekly_coverage,
               avg(abs(w.weekly - t.weekly) / t.weekly) AS weekly_relative_error
        FROM ({WINDOWS}) w JOIN truth t USING (ts)
    """).pl()
    print("\nhow often the 95 % intervals cover the true sums (they include the noise and the spreading of any"
          "\nreleased block a window cuts):")
    print(coverage)


if __name__ == "__main__":
    main()
