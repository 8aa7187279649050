"""Calendar-aware hierarchy: daily, weekly and monthly totals, 24-row windows and random ranges of
hourly tables released by the default method (``tops``) at epsilon 1, with the rows' time grid
(calendar blocks and levels) and without (row-count blocks, today's layout).

Tables (values from seeded numpy generators: data, not privacy noise; public bounds fixed by
what the quantity can physically be, never computed from the values):

``traffic``
    The shared hourly traffic volume (48,204 rows from 2012-10-02 09:00, bound 10,000 vehicles
    per hour): the README's example, so *in sample* for anything tuned by looking at it.
``household``
    Held out: five years of one household's hourly electricity use (kWh) from 2019-03-15
    14:00: morning and evening peaks, later mornings at weekends, more in winter, a slowly
    wandering daily level, absences of days to weeks, appliance spikes; bound 10 kWh per hour.
``household_15min``
    Held out: the same generator every 15 minutes for two years from 2021-01-01 (bound 2.5 kWh
    per quarter hour): blocks of 96 rows.
``air_quality``
    Held out: four years of hourly PM2.5 (ug/m3) from 2016-07-01 06:00: a persistent
    weather-driven log level, winter highs, rush-hour peaks, pollution episodes of days;
    bound 500 (the top of the AQI scale).

Per table and configuration, over ``--reps`` seeds: the median over UTC days (ISO weeks,
months) inside the table of the 95 % margin over the true total, the share of intervals that
cover the clipped total (mean and smallest over the seeds), the MSE of daily totals against the
true ones, the share of days whose released total equals the day before's, and the MSE of every
24-row window sum (W24) and of 1,000 ranges with both ends uniform (the ranges of
``bench/utility_range.py``); medians over the seeds. The margin's noise and spreading parts of
daily totals and of 24-row windows come from ``range_ci(parts=True)``.

``--baseline CHECKOUT`` measures the no-grid release in a process importing the dpsql of
``CHECKOUT`` (its code: its threshold and spreading bound too); the column "rows, this branch" is
the same release here (this code's threshold and spreading bound). A second table gives W24
and random-range MSEs on the synthetic families of ``bench/utility_range.py`` (given an hourly
grid from 2020-01-01) against their BENCHMARKS figures' configuration.

Run: PYTHONPATH=. python bench/calendar_blocks.py [--reps N] [--baseline CHECKOUT]
"""

from __future__ import annotations

import sys
from pathlib import Path

# This script's name is the standard library's ``calendar``, which pandas and _strptime import:
# load the standard one before this directory is on the path (run as a script, it is sys.path[0]).
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
import argparse  # noqa: E402
import calendar  # noqa: E402, F401
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

sys.path.append(str(_HERE))
from _families import hourly_tables, prefix, range_mse, reference_queries, shared, window_mse  # noqa: E402
from _report import markdown_table, write_section  # noqa: E402

import dpsql  # noqa: E402

EPSILON = 1.0
HOUR = np.timedelta64(1, "h")


def _hours(first: str, n: int, minutes: int = 60) -> np.ndarray:
    return np.datetime64(first, "ns") + np.arange(n) * np.timedelta64(minutes, "m")


def _days(keys: np.ndarray) -> np.ndarray:
    return keys.astype("datetime64[D]").astype(np.int64)


def household(first: str, days: int, minutes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """One household's electricity use per reading (kWh), and the readings' keys."""
    rng = np.random.default_rng(seed)
    per_day = 24 * 60 // minutes
    keys = _hours(first, days * per_day, minutes)
    hour = (keys - keys.astype("datetime64[D]")) / HOUR
    day = _days(keys) - _days(keys)[0]
    weekend = ((_days(keys) + 3) % 7) >= 5  # 1970-01-01 was a Thursday
    day_of_year = (keys.astype("datetime64[D]") - keys.astype("datetime64[Y]")).astype(np.int64)
    morning = np.where(weekend, 9.5, 7.5)
    shape = (0.3 + 0.7 * np.exp(-((hour - morning) / 1.3) ** 2) + 1.1 * np.exp(-((hour - 19.5) / 2.0) ** 2)
             + np.where(weekend, 0.5 * np.exp(-((hour - 13.5) / 3.0) ** 2), 0.0))
    season = 1.0 + 0.45 * np.cos(2 * np.pi * (day_of_year - 20) / 365.25)
    level = np.zeros(days + 1)
    for d in range(1, days + 1):  # a slowly wandering daily level
        level[d] = 0.7 * level[d - 1] + rng.normal(0, 0.2)
    away = np.ones(days + 1)
    for start in np.nonzero(rng.random(days + 1) < 0.008)[0]:  # holidays: 3 to 20 days at base load
        away[start:start + rng.integers(3, 21)] = 0.25
    kwh = (shape * season * np.exp(level[day]) * away[day] * rng.lognormal(0, 0.35, len(keys))
           + (rng.random(len(keys)) < 0.04) * rng.exponential(1.2, len(keys)))
    return kwh * minutes / 60, keys


def air_quality(first: str, days: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Hourly PM2.5 (ug/m3) and the readings' keys."""
    rng = np.random.default_rng(seed)
    keys = _hours(first, days * 24)
    n = len(keys)
    hour = (keys - keys.astype("datetime64[D]")) / HOUR
    weekday = ((_days(keys) + 3) % 7) < 5
    day_of_year = (keys.astype("datetime64[D]") - keys.astype("datetime64[Y]")).astype(np.int64)
    weather = np.zeros(n)
    shocks = rng.normal(0, 0.09, n)
    for i in range(1, n):  # persistent, weather-driven
        weather[i] = 0.985 * weather[i - 1] + shocks[i]
    episodes = np.zeros(n)
    for start in np.nonzero(rng.random(n) < 5 / (365 * 24))[0]:  # about five episodes a year, 1 to 5 days
        length = int(rng.integers(24, 120))
        episodes[start:start + length] += rng.uniform(0.6, 1.6)
    log_level = (np.log(11.0) + 0.45 * np.cos(2 * np.pi * (day_of_year - 15) / 365.25) + weather + episodes
                 + 0.25 * (np.exp(-((hour - 8) / 1.5) ** 2) + np.exp(-((hour - 20) / 2.5) ** 2))
                 + 0.12 * weekday)
    return np.exp(log_level + rng.normal(0, 0.2, n)), keys


def tables() -> dict[str, tuple[np.ndarray, np.ndarray, float]]:
    """name -> (values, order keys, public bound)."""
    volume, bound = shared("traffic")
    out = {"traffic": (volume, _hours("2012-10-02T09:00", len(volume)), bound)}
    out["household"] = (*household("2019-03-15T14:00", 5 * 365, 60, seed=11), 10.0)
    out["household_15min"] = (*household("2021-01-01T00:00", 2 * 365, 15, seed=12), 2.5)
    out["air_quality"] = (*air_quality("2016-07-01T06:00", 4 * 365, seed=13), 500.0)
    return out


def buckets(keys: np.ndarray, unit: str) -> tuple[np.ndarray, np.ndarray]:
    """First and stop rows of the whole calendar ``unit`` buckets (UTC days, ISO weeks, months) inside the table."""
    if unit == "week":
        label = (_days(keys) + 3) // 7  # Monday-based weeks
    else:
        label = keys.astype("datetime64[D]" if unit == "day" else "datetime64[M]").astype(np.int64)
    edges = np.r_[0, np.nonzero(np.diff(label))[0] + 1, len(keys)]
    return edges[1:-2], edges[2:-1]  # drop the first and last buckets, which may be partial


def figures(reps: int, grid: bool, what_if: bool = False) -> dict:
    """Every figure of one configuration on every table (module docstring); ``what_if``: the
    threshold given, the 95th percentile of the first 4,096 rows (not private: for comparison)."""
    out = {}
    for name, (values, keys, bound) in tables().items():
        n = len(values)
        params = {"epsilon": EPSILON, "upper": bound}
        if grid:
            from dpsql.timegrid import row_grid  # here: a --baseline checkout may not have it

            params["grid"] = row_grid(keys)
        if what_if:
            params["threshold"] = float(np.quantile(values[:4096], 0.95))
        per_rep = []
        for rep in range(reps):
            release = dpsql.methods.run("tops", values, noise=dpsql.testing.keys(rep), **params)
            truth, clipped = prefix(values), prefix(np.clip(values, 0.0, release.threshold))
            row = {}
            for unit in ("day", "week", "month"):
                starts, stops = buckets(keys, unit)
                total = truth[stops] - truth[starts]
                low, high = release.range_ci(starts, stops)
                estimate = release.range_sum(starts, stops)
                row[f"{unit}_margin"] = float(np.median((high - low) / 2 / total))
                covered = clipped[stops] - clipped[starts]
                row[f"{unit}_coverage"] = float(np.mean((low <= covered) & (covered <= high)))
                if unit == "day":
                    row["day_mse"] = float(np.mean((estimate - total) ** 2))
                    row["day_repeats"] = float(np.mean(np.isclose(estimate[1:], estimate[:-1], rtol=1e-9, atol=0)))
                    if hasattr(release.error, "range_margin_parts"):
                        parts = release.error.range_margin_parts(starts, stops, 0.95)
                        row["day_noise"] = float(np.median(parts.noise / total))
                        row["day_spreading"] = float(np.median(parts.spreading / total))
            windows = np.arange(n - 23)
            window_truth = truth[windows + 24] - truth[windows]
            if hasattr(release.error, "range_margin_parts"):
                parts = release.error.range_margin_parts(windows, windows + 24, 0.95)
                row["w24_noise"] = float(np.median(parts.noise / window_truth))
                row["w24_spreading"] = float(np.median(parts.spreading / window_truth))
            row["w24_mse"] = window_mse(release.values, values)
            starts, stops = reference_queries(np.random.default_rng(2000 + rep), 0, n, k=1000)
            row["ranges_mse"] = range_mse(release.values, values, starts, stops)
            row["threshold"] = float(release.threshold)
            per_rep.append(row)
        out[name] = {key: [r[key] for r in per_rep] for key in per_rep[0]}
    return out


def family_figures(reps: int, grid: bool) -> dict:
    """W24 and random-range MSEs on the synthetic families of bench/utility_range.py (hourly from 2020-01-01)."""
    out = {}
    for name, (values, bound) in hourly_tables().items():
        n = len(values)
        params = {"epsilon": EPSILON, "upper": bound}
        if grid:
            params["grid"] = ("2020-01-01T00:00", "1h")
        cells = {"w24": [], "ranges": []}
        for rep in range(reps):
            release = dpsql.methods.run("tops", values, noise=dpsql.testing.keys(rep), **params)
            starts, stops = reference_queries(np.random.default_rng(2000 + rep), 0, n, k=1000)
            cells["w24"].append(window_mse(release.values, values))
            cells["ranges"].append(range_mse(release.values, values, starts, stops))
        out[name] = {k: float(np.median(v)) for k, v in cells.items()}
    return out


#: Seeds for the daily coverage alone (a 5-seed mean of about 7,000 days scatters by about 0.003).
COVERAGE_REPS = 100


def day_coverage(reps: int = COVERAGE_REPS) -> dict[str, float]:
    """The share of daily intervals (95 %) that cover the clipped daily total, over ``reps`` seeds
    of the grid release (seeds 100, 101, ...: none of the table's)."""
    from dpsql.timegrid import row_grid  # here: a --baseline checkout may not have it

    out = {}
    for name, (values, keys, bound) in tables().items():
        starts, stops = buckets(keys, "day")
        covered = []
        for rep in range(reps):
            release = dpsql.methods.run("tops", values, noise=dpsql.testing.keys(100 + rep), epsilon=EPSILON,
                                        upper=bound, grid=row_grid(keys))
            clipped = prefix(np.clip(values, 0.0, release.threshold))
            low, high = release.range_ci(starts, stops)
            total = clipped[stops] - clipped[starts]
            covered.append(np.mean((low <= total) & (total <= high)))
        out[name] = float(np.mean(covered))
    return out


def unit_errors() -> dict:
    """The exact noise variance (and mean spreading bound) of the hierarchy at epsilon 1 and bound 1
    over five years of hourly rows from 2020-01-01, per calendar choice and for row-count blocks:
    daily, weekly and monthly totals, every 24-row window, 1,000 random ranges (the values play no
    part in an error model)."""
    from dpsql.mechanisms.calendar import LEVEL_SHARES  # here: a --baseline checkout may not have it

    keys = _hours("2020-01-01T00:00", 24 * (366 + 4 * 365))  # 2020 to 2024
    n = len(keys)
    choices = {name: {"grid": ("2020-01-01T00:00", "1h"), "calendar": name} for name in LEVEL_SHARES}
    choices["none (row-count blocks)"] = {}
    windows = np.arange(n - 23)
    ranges = reference_queries(np.random.default_rng(2000), 0, n, k=1000)
    out = {}
    for name, params in choices.items():
        error = dpsql.methods.run("hierarchy", np.zeros(n), noise=dpsql.testing.keys(0), epsilon=1.0, upper=1.0,
                                  **params).error
        row = {unit: error.range_variance(*buckets(keys, unit)).mean() for unit in ("day", "week", "month")}
        row.update(w24=error.range_variance(windows, windows + 24).mean(),
                   w24_spreading=error.range_bias_bound(windows, windows + 24).mean(),
                   ranges=error.range_variance(*ranges).mean(), ranges_spreading=error.range_bias_bound(*ranges).mean())
        out[name] = row
    return out


def _median(cell) -> float:
    return float(np.median(cell))


def section(reps: int, baseline: str | None) -> str:
    on_grid = figures(reps, grid=True)
    rows_here = figures(reps, grid=False)
    before = None
    if baseline:
        out = subprocess.run([sys.executable, __file__, "--figures", "--reps", str(reps)],
                             env={**os.environ, "PYTHONPATH": baseline}, check=True, stdout=subprocess.PIPE,
                             text=True).stdout
        before = json.loads(out)
    what_if = figures(reps, grid=True, what_if=True)
    configs = {"calendar (grid)": on_grid, "rows, this branch": rows_here, "calendar, p95 threshold (what-if)": what_if}
    if before is not None:
        configs["rows, before"] = before["tables"]
    header = ["table", "layout", "day margin / total", "day coverage (mean, min)", "day MSE", "days = day before",
              "week margin / total", "week coverage (mean, min)", "month margin / total", "W24 MSE", "ranges MSE"]
    rows = []
    for name in on_grid:
        for label, config in configs.items():
            f = config[name]
            rows.append([name, label, _median(f["day_margin"]),
                         f"{np.mean(f['day_coverage']):.3f}, {np.min(f['day_coverage']):.3f}",
                         _median(f["day_mse"]), f"{np.median(f['day_repeats']):.1%}", _median(f["week_margin"]),
                         f"{np.mean(f['week_coverage']):.3f}, {np.min(f['week_coverage']):.3f}",
                         _median(f["month_margin"]), _median(f["w24_mse"]), _median(f["ranges_mse"])])
    parts_header = ["table", "layout", "day: noise / total", "day: spreading / total", "W24: noise / total",
                    "W24: spreading / total", "threshold"]
    parts_rows = [[name, label, _median(config[name]["day_noise"]), _median(config[name]["day_spreading"]),
                   _median(config[name]["w24_noise"]), _median(config[name]["w24_spreading"]),
                   _median(config[name]["threshold"])]
                  for name in on_grid for label, config in (("calendar (grid)", on_grid),
                                                             ("rows, this branch", rows_here))]
    families_grid, families_rows = family_figures(reps, grid=True), family_figures(reps, grid=False)
    family_rows = [[name, families_rows[name]["w24"], families_grid[name]["w24"],
                    families_rows[name]["w24"] / families_grid[name]["w24"], families_rows[name]["ranges"],
                    families_grid[name]["ranges"], families_rows[name]["ranges"] / families_grid[name]["ranges"]]
                   for name in families_grid]
    family_header = ["table", "W24 rows", "W24 calendar", "W24 rows / calendar", "ranges rows", "ranges calendar",
                     "ranges rows / calendar"]
    units = unit_errors()
    unit_header = ["calendar", "day", "week", "month", "24-row window", "its spreading", "random range",
                   "its spreading"]
    unit_rows = [[name, *(float(u[k]) for k in ("day", "week", "month", "w24", "w24_spreading", "ranges",
                                                "ranges_spreading"))] for name, u in units.items()]
    before_note = (f" `rows, before`: the same release in a process importing the dpsql of `{baseline}` (the code "
                   "before the calendar layout, round 2's)." if before is not None else "")
    return (f"`tops` at epsilon {EPSILON:g}, defaults (calendar `day`: 0.7 of epsilon to days, 0.2 to months, 0.1 to "
            f"years), {reps} seeds; medians over the seeds unless said. Margins are 95 % half-widths over the true "
            "total (median over the whole UTC days, ISO weeks and months inside the table); coverage is of the "
            "clipped total; `days = day before`: the share of days whose released total equals the previous "
            "day's; W24: MSE of every 24-row window sum; ranges: MSE of 1,000 ranges with both ends uniform. "
            "`traffic` is in sample (the README's example); the other tables are held out (module docstring "
            "of `bench/calendar_blocks.py`). `rows, this branch`: the release without a grid (this "
            "code's threshold and spreading bound). "
            "`calendar, p95 threshold (what-if)`: the grid, and the threshold given as the 95th percentile of the "
            "first 4,096 rows, computed without "
            "privacy (so no hold-out: every row at the full epsilon), to show what a threshold chosen for daily "
            "totals would give; not a private release." + before_note + "\n\n"
            + markdown_table(header, rows)
            + f"\n\nDaily coverage over {COVERAGE_REPS} seeds (100 to {99 + COVERAGE_REPS}): "
            + ", ".join(f"{name} {share:.4f}" for name, share in day_coverage().items())
            + ". A day's noise after consistency is nearly one Laplace variable, for which the margin "
            "(2.12 standard deviations) is the exact 95 % quantile: the coverage below 0.95 in 5 seeds is "
            "sampling noise."
            + "\n\nThe margin's two parts (medians over the days and over every 24-row window, relative to the true "
            "total): calendar days carry no spreading; 24-row windows that cut two days carry the spreading of "
            "two cuts of 24-row blocks instead of one of 256 to 512 rows.\n\n"
            + markdown_table(parts_header, parts_rows)
            + "\n\nExact noise variances of the hierarchy (no hold-out) at epsilon 1 and bound 1, in units of "
            "(bound / epsilon)^2, from its error model over five years of hourly rows: the mean over the whole "
            "days, ISO weeks and months, every 24-row window and the 1,000 ranges; and the mean spreading bound "
            "(in units of the bound) where a range cuts a block. `calendar=` choices and row-count blocks.\n\n"
            + markdown_table(unit_header, unit_rows)
            + "\n\nThe synthetic hourly families of `bench/utility_range.py` (43,800 rows, hourly from 2020-01-01 "
            "for the grid), W24 and random-range MSE without and with the grid (> 1: the calendar is better).\n\n"
            + markdown_table(family_header, family_rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--baseline", help="a dpsql checkout whose no-grid release is measured for comparison")
    parser.add_argument("--figures", action="store_true", help=argparse.SUPPRESS)  # --baseline's subprocess
    args = parser.parse_args()
    if args.figures:
        print(json.dumps({"tables": figures(args.reps, grid=False)}))
        return
    started = time.perf_counter()
    body = section(args.reps, args.baseline) + f"\n\nRun time {time.perf_counter() - started:.0f} s."
    baseline = " --baseline <checkout of the round-2 code>" if args.baseline else ""
    write_section("calendar", "Calendar-aware hierarchy: daily, weekly and monthly totals", body,
                  command=f"PYTHONPATH=. python bench/calendar_blocks.py --reps {args.reps}{baseline}")


if __name__ == "__main__":
    main()
