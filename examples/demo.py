"""dpsql demo: real traffic counts released privately through DuckDB SQL and through a
Polars expression, both charged to one persistent ledger.

Run: ``python examples/demo.py`` (after ``pip install -e '.[examples]'``).

Data: hourly traffic volume on Interstate 94 (48,204 hours, shipped in ``examples/data``).
Privacy unit: one hour's value (replace-one-value neighbours; the hourly time axis is
public). Public bound: 8,000 vehicles per hour. The release is ToPS at epsilon = 1: a private
clipping threshold from the first 4,096 hours, then a consistent fan-out-16 hierarchy over
blocks of hours (docs/algorithms.md). Everything computed from a release afterwards (monthly
and four-week sums, intervals, the picture) is free post-processing.

The ledger is an SQLite file, ``examples/output/demo-ledger.sqlite``, with a budget of
epsilon = 3 for the scope ``traffic-demo``. The SQL release is charged; the same release
asked through Polars is the same answer, recorded in the ledger, and costs nothing; so does
every later run of the demo. Delete the file to start over.
"""

from __future__ import annotations

from pathlib import Path

import duckdb
import matplotlib
import polars as pl

import dpsql

matplotlib.use("Agg")

HERE = Path(__file__).resolve().parent
DATA = HERE / "data" / "traffic_volume_hourly.csv.gz"
OUTPUT = HERE / "output"
LEDGER = OUTPUT / "demo-ledger.sqlite"
RELEASE = dict(epsilon=1.0, upper=8000.0)


def preview() -> None:
    print("Before spending: what a ToPS release of 48,204 hours would cost and how accurate it would be")
    print(dpsql.preview("tops", n=48_204, lengths=(24, 24 * 30), **RELEASE), "\n")


def sql_release(budget: dpsql.Budget) -> None:
    con = duckdb.connect()
    dpsql.register(con, budget=budget)
    con.execute(f"CREATE TABLE traffic AS SELECT ts, volume FROM read_csv('{DATA}')")
    # One release, materialised; every query on `released` afterwards is free.
    con.execute(f"""CREATE TABLE released AS SELECT * FROM dp_range_sum('traffic', 'ts', 'volume', method := 'tops',
                    epsilon := {RELEASE['epsilon']}, upper := {RELEASE['upper']})""")
    monthly = """
        WITH private AS (
            SELECT date_trunc('month', ts) AS month, sum(volume) AS private_total,
                   dp_range_margin(min(dp_row), max(dp_row) + 1) AS margin_95
            FROM released GROUP BY month),
        truth AS (SELECT date_trunc('month', ts) AS month, sum(volume)::BIGINT AS true_total
                  FROM traffic GROUP BY month)
        SELECT * FROM private JOIN truth USING (month) ORDER BY month LIMIT 6 OFFSET 8"""
    print("SQL: monthly totals of the private stream with their 95 % margin")
    print("(true totals read from the raw table for this demo only)")
    print(con.sql(monthly).pl())
    con.close()


def polars_release(budget: dpsql.Budget) -> pl.DataFrame:
    traffic = pl.read_csv(DATA, try_parse_dates=True)
    released = traffic.with_columns(
        pl.col("volume").dpsql.range_sum(method="tops", order_by="ts", budget=budget, errors=True, **RELEASE)
        .alias("private"))
    four_weeks = dpsql.polars.bucket_ci(released, "private", order_by="ts", every="4w")
    print("\nPolars: four-week totals of the same private stream with 95 % intervals")
    print(four_weeks.slice(8, 6))
    return released


def picture(budget: dpsql.Budget, released: pl.DataFrame) -> Path:
    """The release as the ledger recorded it, drawn against time (the truth overlay is for
    this demo only: a data consumer sees the release, never the raw table)."""
    record = budget.release(dp_row=released["private"].struct.field("dp_row")[0])
    release = record.with_values(released["private"].struct.field("value").to_numpy())
    fig = release.plot(truth=released["volume"].to_numpy(), time=released["ts"].to_numpy(), value="traffic",
                       unit="vehicles per hour", time_label="time (hourly rows)")
    path = OUTPUT / "demo.png"
    fig.savefig(path, dpi=120)
    return path


def main() -> None:
    OUTPUT.mkdir(exist_ok=True)
    preview()
    budget = dpsql.Budget.open(LEDGER, scope="traffic-demo", epsilon=3.0)
    print("ledger before:", budget, "\n")
    sql_release(budget)
    released = polars_release(budget)
    print("\npicture:", picture(budget, released))
    print("\nledger after:", budget)
    print(budget.history())


if __name__ == "__main__":
    main()
