"""Can a tree whose leaves are days hold random ranges at row-count blocks' noise while daily
totals keep the noise their margin target needs? (issue 22.3: random ranges on calendar layouts)

Part 1, the noise (exact, no data): five years of hourly rows (2020 to 2024, 1,827 days), trees
whose leaves are UTC days, every value in one node per level (level ``l`` at ``share_l`` of
epsilon: node variance ``2 / share_l**2`` in units of ``(bound / epsilon)**2``), made consistent
by weighted least squares. The variance of a range sum is ``c' (A' W A)^-1 c`` exactly, ``c`` the
share of each day's rows the range holds (a day's sum is spread evenly over its rows). For each
tree, the smallest mean variance of the 1,000 random ranges of ``bench/calendar_blocks.py``
(both ends uniform over the rows) subject to a daily total's mean variance at most a cap, over
the budget split (the day share the least that meets the cap; the upper levels' proportions in
steps of 0.05 for two upper levels, even for more). The reference is the hierarchy's row-count
layout (no grid) on the same rows and ranges, from its error model.

Part 2, the threshold (the held-out tables of ``bench/calendar_blocks.py``): for clipping
thresholds at quantiles of each table, the median daily margin over the total with today's
daily noise (``2.12 sqrt(3.99) theta``), the random ranges' squared clipping bias (exact, from the
values) and their noise at calendar and at row-count level; against the random-range MSE of the
round-2 release (``rows, before`` in BENCHMARKS.md).

Run: PYTHONPATH=. python bench/calendar_trees.py
"""

from __future__ import annotations

import importlib.util
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _families import prefix, reference_queries
from _report import markdown_table, write_section

import dpsql

FIRST_DAY = np.datetime64("2020-01-01")
DAYS = 366 + 4 * 365
ROWS_PER_DAY = 24
#: Caps on a daily total's mean noise variance, in units of (bound / epsilon)^2: today's (0.7 of
#: epsilon to days), what the air-quality table's margin target allows at the threshold chosen now
#: (margin 0.773 at 3.99: 3.99 / 0.773^2), and larger ones.
DAY_CAPS = (3.99, 6.68, 10.0, 20.0)
#: The random-range MSE of the round-2 release on each held-out table (BENCHMARKS.md, calendar
#: section, ``rows, before``: the code before the calendar layout).
ROUND_TWO_RANGES = {"traffic": 4.44e9, "household": 4.28e3, "household_15min": 217.0, "air_quality": 3.74e6}
MARGIN = math.log(20.0) / math.sqrt(2.0)  # the 95 % multiplier of one Laplace variable


def _groups() -> dict[str, np.ndarray]:
    """Each day's group at the candidate upper levels (ids consecutive, groups contiguous)."""
    days = FIRST_DAY + np.arange(DAYS)
    index = np.arange(DAYS)
    out = {unit: days.astype(f"datetime64[{code}]").astype(np.int64) for unit, code in (("month", "M"), ("year", "Y"))}
    for size in (4, 16, 64, 256, 1024):
        out[f"{size} days"] = index // size
    return out


#: Trees by their upper levels (the leaves are days). Calendar years are chunks (a stream of
#: unknown length has no level above them); 256 days are chunks of the 16-ary tree (its span,
#: like today's row-count layout's 16 * 16 blocks); the 4-ary tree spans 1024 days. (A level
#: above those never helped: at a share near 0 it is the tree without it, and any share it gets
#: is taken from the levels a random range uses more.)
TREES = {
    "days, months, years (today)": ("month", "year"),
    "days, 16, 256 days": ("16 days", "256 days"),
    "days, 4, 16, 64, 256, 1024 days": ("4 days", "16 days", "64 days", "256 days", "1024 days"),
}


def _indicator(ids: np.ndarray) -> np.ndarray:
    _, inverse = np.unique(ids, return_inverse=True)
    return np.eye(inverse.max() + 1)[inverse]


class TreeNoise:
    """Exact range variances of one tree with day leaves, for any budget split.

    The normal matrix is ``a I + U D U'`` (``a`` the leaves' weight ``share_0**2 / 2``, ``U`` the
    upper nodes' membership, ``D`` their weights), so by Woodbury ``c' N^-1 c = (c'c - u' M^-1 u) / a``
    with ``u = U'c`` and ``M = a D^-1 + U'U``: a solve in the upper nodes only."""

    def __init__(self, upper: tuple[str, ...], weights: np.ndarray):
        """``weights``: (ranges, days), the share of each day's rows in each range."""
        groups = _groups()
        blocks = [_indicator(groups[name]) for name in upper]
        self.level_of_node = np.concatenate([np.full(b.shape[1], level) for level, b in enumerate(blocks, 1)])
        members = np.hstack(blocks)  # days x upper nodes
        self.gram = members.T @ members
        self.nodes_of_day = np.stack([np.nonzero(row)[0] for row in members])  # one node per upper level
        self.range_nodes = weights @ members
        self.range_squares = np.sum(weights**2, axis=1)

    def variances(self, shares) -> tuple[float, float]:
        """(mean daily total variance, mean random-range variance) at ``shares`` (leaves first)."""
        leaf = shares[0] ** 2 / 2.0
        node = np.asarray(shares, dtype=np.float64)[self.level_of_node] ** 2 / 2.0
        inner = np.linalg.inv(np.diag(leaf / node) + self.gram)
        at = self.nodes_of_day
        day = float(np.mean(1.0 - inner[at[:, :, None], at[:, None, :]].sum(axis=(1, 2)))) / leaf
        ranges = np.sum((self.range_nodes @ inner) * self.range_nodes, axis=1)
        return day, float(np.mean(self.range_squares - ranges)) / leaf

    def best(self, cap: float, proportions) -> tuple[float, tuple[float, ...], float]:
        """The least mean random-range variance with the daily one at most ``cap``, over the upper
        levels' ``proportions`` (each a tuple summing to 1; the day share the least that meets the
        cap, by bisection): (variance, shares, daily variance)."""
        best = (math.inf, (), math.nan)
        for split in proportions:
            low, high = 0.0, 1.0
            for _ in range(12):
                day_share = 0.5 * (low + high)
                shares = (day_share, *((1.0 - day_share) * p for p in split))
                if self.variances(shares)[0] <= cap:
                    high = day_share
                else:
                    low = day_share
            shares = (high, *((1.0 - high) * p for p in split))
            day, ranges = self.variances(shares) if high < 1.0 else (math.nan, math.inf)
            if ranges < best[0]:
                best = (ranges, shares, day)
        return best


def proportions(levels: int):
    """Splits of the upper levels' budget: steps of 0.05 for two levels, even for more."""
    if levels > 2:
        return [(1.0 / levels,) * levels]
    return [(1.0,)] if levels == 1 else [(p, 1.0 - p) for p in np.arange(0.05, 1.0, 0.05)]


def range_weights() -> np.ndarray:
    n = DAYS * ROWS_PER_DAY
    starts, stops = reference_queries(np.random.default_rng(2000), 0, n, k=1000)
    rows = np.arange(n)
    inside = (rows >= starts[:, None]) & (rows < stops[:, None])
    return inside.reshape(len(starts), DAYS, ROWS_PER_DAY).mean(axis=2)


def row_count_reference() -> tuple[float, float]:
    """The row-count layout's mean random-range noise variance and mean spreading bound (units of the bound)."""
    n = DAYS * ROWS_PER_DAY
    starts, stops = reference_queries(np.random.default_rng(2000), 0, n, k=1000)
    error = dpsql.methods.run("hierarchy", np.zeros(n), noise=dpsql.testing.keys(0), epsilon=1.0, upper=1.0).error
    return float(error.range_variance(starts, stops).mean()), float(error.range_bias_bound(starts, stops).mean())


def noise_section() -> str:
    weights = range_weights()
    reference, spreading = row_count_reference()
    rows = []
    for name, upper in TREES.items():
        tree = TreeNoise(upper, weights)
        for cap in DAY_CAPS:
            ranges, shares, day = tree.best(cap, proportions(len(upper)))
            rows.append([name, cap, f"{day:.3g}", ", ".join(f"{s:.2f}" for s in shares), f"{ranges:.3g}",
                         f"{ranges / reference:.2f}"])
        print(name, rows[-1], flush=True)
    header = ["tree (leaves: days)", "daily variance cap", "daily variance", "shares (days first)",
              "random-range variance", "/ row-count blocks'"]
    return (f"Row-count blocks (no grid, the same rows and ranges): random-range noise variance {reference:.3g}, "
            f"and a spreading bound of {spreading:.3g} bounds on average.\n\n" + markdown_table(header, rows))


def _calendar_tables():
    spec = importlib.util.spec_from_file_location("calendar_blocks", Path(__file__).with_name("calendar_blocks.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def threshold_section() -> str:
    blocks = _calendar_tables()
    rows = []
    for name, (values, keys, _) in blocks.tables().items():
        n = len(values)
        day_starts, day_stops = blocks.buckets(keys, "day")
        totals = prefix(values)[day_stops] - prefix(values)[day_starts]
        starts, stops = reference_queries(np.random.default_rng(2000), 0, n, k=1000)
        for q in (0.95, 0.98, 0.99, 0.995, 0.999, 1.0):
            theta = float(np.quantile(values, q))
            excess = prefix(np.maximum(values - theta, 0.0))
            bias = float(np.mean((excess[stops] - excess[starts]) ** 2))
            margin = float(np.median(MARGIN * math.sqrt(3.99) * theta / totals))
            rows.append([name, q, f"{theta:.4g}", f"{margin:.3g}", f"{bias:.3g}", f"{354 * theta**2:.3g}",
                         f"{65 * theta**2:.3g}", f"{(bias + 65 * theta**2) / ROUND_TWO_RANGES[name]:.3g}"])
    header = ["table", "quantile", "threshold", "day margin / total", "ranges: clipping bias^2",
              "ranges: calendar noise (354)", "ranges: row-count noise (65)",
              "(bias^2 + row-count noise) / round 2's ranges MSE"]
    return markdown_table(header, rows)


def main() -> None:
    started = time.perf_counter()
    body = ("Part 1: exact noise variances (units of (bound / epsilon)^2, epsilon 1) of trees whose leaves are "
            "UTC days over five years of hourly rows; for each cap on a daily total's mean variance, the budget "
            "split that gives the 1,000 random ranges of `bench/calendar_blocks.py` the least mean variance "
            "(module docstring of `bench/calendar_trees.py`).\n\n" + noise_section()
            + "\n\nPart 2: the threshold. Random ranges' squared clipping bias (exact, mean over the same ranges) "
            "at thresholds at quantiles of each held-out table, beside the median daily margin with today's daily "
            "noise, and the ranges' noise on calendar and on row-count blocks; the last column is the best any "
            "tree could do (row-count noise) over the round-2 release's random-range MSE.\n\n"
            + threshold_section() + f"\n\nRun time {time.perf_counter() - started:.0f} s.")
    write_section("calendar_trees", "Calendar trees for random ranges: what day leaves cost", body,
                  command="PYTHONPATH=. python bench/calendar_trees.py")


if __name__ == "__main__":
    main()
