"""Traffic walk-through in Polars: release hourly traffic volume privately, then use
ordinary Polars windows on the released column, with 95 % bands, and plot them.

Run: ``python examples/traffic_polars.py``; writes ``examples/output/traffic_polars.png``.

Privacy: the hourly volume column is released once with ToPS (epsilon = 1, replace-one
hour's value, public bound 8,000 vehicles per hour), plus one private clipping
threshold (epsilon = 0.25) for illustration; both are charged to one budget. Everything
after the release (daily sums, 24-hour windows, intervals, the plot) is free
post-processing of released values.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import polars as pl

import dpsql
import dpsql.polars

HERE = Path(__file__).resolve().parent
DATA = HERE / "data" / "traffic_volume_hourly.csv.gz"
OUTPUT = HERE / "output"
UPPER = 8_000.0  # public: more vehicles per hour than the road carries
HOLDOUT = 2_000  # ToPS hold-out hours: they choose the threshold and share one noisy total


def main() -> None:
    # A real deployment keeps its ledger on disk: dpsql.Budget.open("ledger.sqlite", epsilon=2.0)
    budget = dpsql.Budget.in_memory(epsilon=2.0)
    traffic = (pl.read_csv(DATA, try_parse_dates=True)
               .sample(fraction=1.0, shuffle=True, seed=0))  # any physical row order works

    released = (traffic.lazy()
                .with_columns(pl.col("volume").dpsql.range_sum(
                    method="tops", epsilon=1.0, upper=UPPER, m=HOLDOUT, order_by="ts", errors=True, budget=budget,
                    note="I-94 hourly volume").alias("volume_dp"))
                .collect())
    theta = traffic.select(pl.col("volume").dpsql.threshold(epsilon=0.25, upper=UPPER, budget=budget)).item()
    print(f"private clipping threshold: {theta:,.0f} vehicles/hour")

    hourly = dpsql.polars.window_ci(released, "volume_dp", order_by="ts", period="1h").sort("ts")
    daily = dpsql.polars.bucket_ci(released, "volume_dp", order_by="ts", every="1d")
    weekly = dpsql.polars.bucket_ci(released, "volume_dp", order_by="ts", every="1w")
    true_weekly = traffic.sort("ts").group_by_dynamic("ts", every="1w").agg(pl.col("volume").sum())
    rolling = dpsql.polars.window_ci(released, "volume_dp", order_by="ts", period="24h").sort("ts")
    truth = traffic.sort("ts").group_by_dynamic("ts", every="1d").agg(pl.col("volume").sum())
    covered = daily.join(truth, on="ts").select(
        ((pl.col("volume_dp_low") <= pl.col("volume")) & (pl.col("volume") <= pl.col("volume_dp_high"))).mean())
    print(daily.head(5))
    print(f"daily 95% bands covering the true daily total (illustration only; the truth is not private): "
          f"{covered.item():.1%}")
    print(f"typical 24-hour window: {rolling['volume_dp_sum'].median():,.0f} "
          f"± {(rolling['volume_dp_high'] - rolling['volume_dp_sum']).median():,.0f} vehicles")
    print(budget.history().select("method", "epsilon", "delta", "rows", "note"))
    print(budget)

    start = hourly["ts"][HOLDOUT + 24 * 7]  # two weeks well after the hold-out
    week = hourly.filter(pl.col("ts").is_between(start, start + pl.duration(days=14), closed="left"))
    true_week = traffic.filter(pl.col("ts").is_between(start, start + pl.duration(days=14), closed="left")).sort("ts")
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7), constrained_layout=True)
    top.fill_between(week["ts"], week["volume_dp_low"], week["volume_dp_high"], color="tab:blue", alpha=0.2,
                     label="95% band (noise only)")
    top.plot(week["ts"], week["volume_dp_sum"], color="tab:blue", lw=0.8, label="released hourly volume (ToPS)")
    top.plot(true_week["ts"], true_week["volume"], color="black", lw=0.6, alpha=0.6,
             label="true volume (not private, for comparison)")
    top.set_ylabel("vehicles / hour")
    # ToPS's smoother spreads each block evenly except at block boundaries, whose hours carry the
    # block's noisy correction: those spikes (and their wide bands) run off this scale
    top.set_ylim(-4_000, 12_000)
    top.set_title("I-94 westbound traffic, two weeks of the private hourly release (ToPS, epsilon = 1)")
    top.legend(loc="upper right", fontsize=8)
    bottom.fill_between(weekly["ts"], weekly["volume_dp_low"], weekly["volume_dp_high"], color="tab:orange",
                        alpha=0.3, label="95% band")
    bottom.plot(weekly["ts"], weekly["volume_dp_sum"], color="tab:orange", lw=0.8,
                label="weekly total of the released hours")
    bottom.plot(true_weekly["ts"], true_weekly["volume"], color="black", lw=0.6, alpha=0.6, label="true weekly total")
    bottom.set_ylabel("vehicles / week")
    bottom.legend(loc="lower right", fontsize=8)
    OUTPUT.mkdir(exist_ok=True)
    fig.savefig(OUTPUT / "traffic_polars.png", dpi=120)
    print(f"wrote {OUTPUT / 'traffic_polars.png'}")


if __name__ == "__main__":
    main()
