"""Data for the utility benchmarks: the shared real streams and synthetic families.

Every public bound below is fixed and documented, never computed from the values: retail and
web1 use the domain maxima the data README documents; traffic uses 10,000 vehicles per hour,
above the capacity of one freeway direction. Synthetic families draw their data from a seeded
numpy generator (data, not privacy noise) and carry a loose bound a user could state, about
10 to 50 times the typical value.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data"
#: name -> (file, public bound)
SHARED = {"retail": ("retail_basket_sizes.csv", 76.0), "web1": ("web1_session_lengths.csv", 267.0),
          "traffic": ("traffic_volume_hourly.csv", 10_000.0)}
#: Five years of hourly rows.
HOURLY_ROWS = 43_800
HOURLY_FAMILIES = ("poisson_daily", "lognormal_daily", "pareto_daily", "piecewise", "trend_daily")
LONG_FAMILIES = ("iid_lognormal", "iid_pareto", "piecewise")


def shared(name: str) -> tuple[np.ndarray, float]:
    """A shared real stream (second CSV column) and its public bound."""
    file, bound = SHARED[name]
    return np.loadtxt(DATA / file, delimiter=",", skiprows=1, usecols=1).astype(np.float64), bound


def per_second(hourly: np.ndarray, first_hour: int, hours: int, seed: int) -> np.ndarray:
    """``hours`` hourly counts from ``first_hour`` spread as that many events at uniformly random
    seconds of their hours (a seeded generator: data, not privacy noise), counted per second."""
    rng = np.random.default_rng(seed)
    counts = hourly[first_hour:first_hour + hours].astype(np.int64)
    seconds = np.repeat(np.arange(hours), counts) * 3600 + rng.integers(0, 3600, counts.sum())
    return np.bincount(seconds, minlength=hours * 3600).astype(np.float64)


def extended(values: np.ndarray, n: int) -> np.ndarray:
    """``values`` repeated to ``n`` rows, as the ToPS paper extends short streams."""
    return np.resize(values, n)


def _daily(t: np.ndarray, weekly: bool = True) -> np.ndarray:
    shape = 1.0 + 0.8 * np.sin(2 * np.pi * (t % 24) / 24 - np.pi / 2)
    return shape * np.where((t // 24) % 7 >= 5, 0.6, 1.0) if weekly else shape


def synthetic(family: str, n: int, seed: int) -> tuple[np.ndarray, float]:
    """``n`` rows of a synthetic family and its public bound."""
    rng = np.random.default_rng(seed)
    t = np.arange(n)
    if family == "iid_lognormal":  # transaction sizes, moderate tail
        return np.minimum(np.rint(rng.lognormal(1.5, 1.0, n)), 1000), 1000.0
    if family == "iid_pareto":  # heavy tail (alpha 1.5)
        return np.minimum(np.floor(rng.pareto(1.5, n) + 1), 10_000), 10_000.0
    if family == "poisson_daily":  # hourly counts with daily and weekly cycles
        return rng.poisson(50 * _daily(t)).astype(float), 1000.0
    if family == "lognormal_daily":  # hourly concentrations, multiplicative noise
        return np.minimum(10 * _daily(t, weekly=False) * rng.lognormal(0, 0.6, n), 200), 200.0
    if family == "pareto_daily":  # hourly session volumes: Pareto marks on a daily rate
        return np.minimum(rng.poisson(5 * _daily(t)) * (rng.pareto(2.0, n) + 1), 2000), 2000.0
    if family == "piecewise":  # level shifts (mean run 2000 rows), Poisson around each level
        runs = rng.geometric(1 / 2000, size=n // 100 + 10)
        levels = np.repeat(rng.lognormal(3.0, 0.8, size=len(runs)), runs)[:n]
        return np.minimum(rng.poisson(levels), 2000).astype(float), 2000.0
    if family == "trend_daily":  # threefold growth over five years, daily cycle
        return np.minimum(rng.poisson(20 * (1 + 2 * t / HOURLY_ROWS) * _daily(t)), 2000).astype(float), 2000.0
    raise ValueError(f"unknown family {family!r}")


def hourly_tables(seed: int = 0) -> dict[str, tuple[np.ndarray, float]]:
    """The hourly tables of the window benchmark: traffic (real) and the hourly families."""
    tables = {"traffic": shared("traffic")}
    tables.update({f: synthetic(f, HOURLY_ROWS, seed) for f in HOURLY_FAMILIES})
    return tables


def reference_queries(rng: np.random.Generator, low: int, high: int, k: int = 200) -> tuple[np.ndarray, np.ndarray]:
    """The reference evaluator's ranges: two distinct points uniform in ``[low, high)``, sorted."""
    points = np.sort(np.stack([rng.choice(high - low, 2, replace=False) for _ in range(k)]), axis=1) + low
    return points[:, 0], points[:, 1]


def prefix(values: np.ndarray) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum(values, dtype=np.float64)])


def range_mse(estimate: np.ndarray, truth: np.ndarray, starts, stops) -> float:
    """MSE of the range sums ``[starts, stops)`` of ``estimate`` against ``truth``."""
    e, t = prefix(estimate), prefix(truth)
    return float(np.mean((e[stops] - e[starts] - (t[stops] - t[starts])) ** 2))


def window_mse(estimate: np.ndarray, truth: np.ndarray, w: int = 24) -> float:
    """MSE over every sliding ``w``-row window sum."""
    d = prefix(estimate - truth)
    return float(np.mean((d[w:] - d[:-w]) ** 2))
