"""Traffic walk-through in Polars: release hourly traffic volume privately, then use
ordinary Polars windows on the released column, with 95 % bands, and plot them.

Run: ``python examples/traffic_polars.py``; writes ``examples/output/traffic_polars.png``.

Privacy: the hourly volume column is released once with ToPS (epsilon = 1, replace-one
hour's value, public bound 8,000 vehicles per hour), plus one private clipping
threshold (epsilon = 0.25) for illustration; both are charged to one budget. Everything
after the release (daily sums, 24-hour windows, intervals, the picture) is free
post-processing of released values.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib
import polars as pl

import dpsql

matplotlib.use("Agg")

HERE = Path(__file__).resolve().parent
DATA = HERE / "data" / "traffic_volume_hourly.csv.gz"
OUTPUT = HERE / "output"
UPPER = 8_000.0  # public: more vehicles per hour than the road carries


def main() -> None:
    # A real deployment keeps its ledger on disk: dpsql.Budget.open("ledger.sqlite", epsilon=2.0)
    budget = dpsql.Budget.in_memory(epsilon=2.0)
    traffic = (pl.read_csv(DATA, try_parse_dates=True)
               .sample(fraction=1.0, shuffle=True, seed=0))  # any physical row order works

    released = (traffic.lazy()
                .with_columns(pl.col("volume").dpsql.range_sum(
                    epsilon=1.0, upper=UPPER, order_by="ts", errors=True, budget=budget,
                    note="I-94 hourly volume").alias("volume_dp"))
                .collect())
    theta = traffic.select(pl.col("volume").dpsql.threshold(epsilon=0.25, upper=UPPER, budget=budget)).item()
    print(f"private clipping threshold: {theta:,.0f} vehicles/hour")

    daily = dpsql.polars.bucket_ci(released, "volume_dp", order_by="ts", every="1d")
    rolling = dpsql.polars.window_ci(released, "volume_dp", order_by="ts", period="7d").sort("ts")
    truth = traffic.sort("ts").group_by_dynamic("ts", every="1d").agg(pl.col("volume").sum())
    covered = daily.join(truth, on="ts").select(
        ((pl.col("volume_dp_low") <= pl.col("volume")) & (pl.col("volume") <= pl.col("volume_dp_high"))).mean())
    print(daily.head(5))
    print(f"daily 95% bands covering the true daily total (illustration only; the truth is not private): "
          f"{covered.item():.1%}")
    print(f"typical 7-day window: {rolling['volume_dp_sum'].median():,.0f} "
          f"± {(rolling['volume_dp_high'] - rolling['volume_dp_sum']).median():,.0f} vehicles")
    print(budget.history())
    print(budget)

    # The ledger recorded the release: rebuild it from its row handles and draw it.
    ordered = released.sort("ts")
    record = budget.release(dp_row=ordered["volume_dp"].struct.field("dp_row")[0])
    release = record.with_values(ordered["volume_dp"].struct.field("value").to_numpy())
    fig = release.plot(truth=ordered["volume"].to_numpy(), time=ordered["ts"].to_numpy(), value="traffic",
                       unit="vehicles per hour", time_label="time (hourly rows)")
    OUTPUT.mkdir(exist_ok=True)
    fig.savefig(OUTPUT / "traffic_polars.png", dpi=120)
    print(f"wrote {OUTPUT / 'traffic_polars.png'}")


if __name__ == "__main__":
    main()
