"""A stream object keeps the machines its last append fed (their noise forests drawn and made
consistent) for its next append, while the ledger still holds the state that append committed.

The warm machines must release exactly what machines restored from the ledger release: the same
stream appended through one object (warm), through a new object per append (restored), through two
objects taking turns (each finds the other's commit: restored), and after appends that fed machines
and then failed (rolled back: the warm machines had moved on, so they must not be used)."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

import dpsql

HOUR = np.timedelta64(1, "h")
START = np.datetime64("2026-03-01T00:00", "us")


def _day(meters: int, day: int) -> pl.DataFrame:
    rng = np.random.default_rng(100 + day)
    hours = START + (24 * day + np.arange(24)) * HOUR
    return pl.DataFrame({"meter": np.repeat(np.arange(meters), 24), "ts": np.tile(hours, meters),
                         "kwh": np.round(rng.gamma(2.0, 3.0, 24 * meters), 2)})


def _register(budget, method: str, partitioned: bool):
    params = {"m": 300} if method == "tops" else {}
    with dpsql.testing.seeded(11):
        return budget.stream("s", method=method, epsilon=1.0, order_by="ts", value="kwh",
                             partition_by="meter" if partitioned else None, upper=40.0, **params)


def _days(meters: int, days: int, partitioned: bool) -> list[pl.DataFrame]:
    frames = [_day(meters, d) for d in range(days)]
    return frames if partitioned else [f.filter(pl.col("meter") == 0).drop("meter") for f in frames]


def _values(table) -> pl.DataFrame:
    """Released rows without their row handles (each ledger numbers its own)."""
    return pl.from_arrow(table).drop("dp_row")


def _released(budget) -> pl.DataFrame:
    return _values(budget.stream("s").released())


CASES = [("hierarchy", True), ("tops", True), ("tops", False), ("hierarchy", False), ("laplace", True)]


@pytest.mark.parametrize(("method", "partitioned"), CASES)
def test_warm_machines_release_what_restored_ones_do(method, partitioned):
    days = _days(12, 20, partitioned)
    warm_budget, cold_budget, turns_budget = (dpsql.Budget.in_memory(epsilon=10.0) for _ in range(3))
    warm = _register(warm_budget, method, partitioned)
    _register(cold_budget, method, partitioned)
    first, second = _register(turns_budget, method, partitioned), turns_budget.stream("s")
    for d, frame in enumerate(days):
        out = _values(warm.append(frame))
        assert _values(cold_budget.stream("s").append(frame)).equals(out)  # a new object each time
        assert _values((first if d % 2 else second).append(frame)).equals(out)
    assert warm._warm is not None  # (the warm path was taken)
    assert _released(cold_budget).equals(_released(warm_budget))
    assert _released(turns_budget).equals(_released(warm_budget))


@pytest.mark.parametrize(("method", "partitioned"), CASES[:3])
def test_an_append_that_fed_machines_and_failed_leaves_none_warm(method, partitioned):
    days = _days(12, 8, partitioned)
    reference_budget, budget = dpsql.Budget.in_memory(epsilon=10.0), dpsql.Budget.in_memory(epsilon=10.0)
    reference, stream = _register(reference_budget, method, partitioned), _register(budget, method, partitioned)
    for frame in days[:4]:
        reference.append(frame)
        stream.append(frame)
    # a lazy frame's first batch is fed (the warm machines move on), its second is refused: rolled back
    bad = pl.concat([days[4], days[5].with_columns(pl.lit(float("nan")).alias("kwh"))])
    lazy = bad.lazy()
    with pytest.raises(dpsql.InvalidData, match="NaN"):
        stream.append(lazy)
    for frame in days[4:]:
        assert _values(stream.append(frame)).equals(_values(reference.append(frame)))
    assert _released(budget).equals(_released(reference_budget))
