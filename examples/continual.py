"""Continual release: 60 days of hourly traffic arriving a day at a time, one charge.

Run: ``python examples/continual.py`` (after ``pip install -e '.[examples]'``); writes
``examples/output/continual.png``.

A stream is registered once in a persistent ledger and charged then (epsilon = 1 for its
whole, unbounded future). Every day 24 hourly readings are appended; each append releases a
value for every one of them and stores the algorithm's open state in the ledger, so the next
day's append may come from another process. On hourly readings the hierarchy's blocks are
calendar days: an hour's value is final when its day's last hour arrives, and provisional (a
prediction from the days released before) until then; ``max_delay="1d"`` says no hour may wait
longer than a day. Re-releasing the whole table every day instead would have cost epsilon 1 per
day: 60 after 60 days, with 60 different, inconsistent histories.

Privacy: replace-one-hour's-value neighbours, public bound 8,000 vehicles per hour, the hourly
time axis public. The ledger file holds the stream's secret state: keep it as carefully as
the raw table.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib
import numpy as np
import polars as pl

import dpsql

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = Path(__file__).resolve().parent
DATA = HERE / "data" / "traffic_volume_hourly.csv.gz"
OUTPUT = HERE / "output"
LEDGER = OUTPUT / "continual-ledger.sqlite"
DAYS = 60
EPSILON = 1.0


def main() -> None:
    OUTPUT.mkdir(exist_ok=True)
    LEDGER.unlink(missing_ok=True)  # the example starts a fresh ledger each run
    traffic = pl.read_csv(DATA, try_parse_dates=True).head(24 * DAYS)
    budget = dpsql.Budget.open(LEDGER, scope="traffic", epsilon=2.0)
    budget.stream("i94", method="hierarchy", epsilon=EPSILON, order_by="ts", value="volume", upper=8000.0,
                  max_delay="1d")
    released_by_day = []
    for day in range(DAYS):
        # each day a scheduled job reopens the stream by name (no charge) and appends the day
        stream = dpsql.Budget.open(LEDGER, scope="traffic").stream("i94")
        stream.append(traffic.slice(24 * day, 24))
        released_by_day.append(stream.released().num_rows)
    print(stream)
    print(budget.history())
    final = int(np.sum(stream.released()["dp_final"].to_numpy()))
    print(f"released {released_by_day[-1]} of {24 * DAYS} hours, {final} final; the last "
          f"{released_by_day[-1] - final} are provisional until their day's last hour")

    fig, (history, cost) = plt.subplots(1, 2, figsize=(12, 3.6), width_ratios=[2.2, 1], constrained_layout=True)
    truth = traffic.head(released_by_day[-1])
    stream.release().plot(ax=history, truth=truth["volume"].to_numpy(), time=truth["ts"].to_numpy(),
                          value="traffic", unit="vehicles per hour", time_label="time (hourly rows)")
    history.set_title(f"the stream after {DAYS} daily appends: {released_by_day[-1]:,} hours released", fontsize=10)
    days = np.arange(1, DAYS + 1)
    cost.step(days, np.full(DAYS, EPSILON), where="post", color="tab:blue", label="one stream, appended daily")
    cost.step(days, EPSILON * days, where="post", color="tab:red", label="a one-shot release every day")
    cost.set_xlabel("day")
    cost.set_ylabel("epsilon spent")
    cost.set_title("privacy cost", fontsize=10)
    cost.legend(fontsize=8, frameon=False)
    path = OUTPUT / "continual.png"
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
