"""End-to-end checks on the real data sets (shipped compressed in examples/data)."""

from pathlib import Path

import duckdb
import numpy as np
import polars as pl
import pytest

import dpsql
import dpsql.duckdb
import dpsql.polars
from dpsql.methods import run
from dpsql.testing import keys, seeded
from dpsql.timegrid import row_grid

DATA = Path(__file__).resolve().parents[2] / "examples" / "data"


def load(name: str) -> pl.DataFrame:
    return pl.read_csv(DATA / f"{name}.csv.gz", try_parse_dates=True)


def range_mse(released: np.ndarray, truth: np.ndarray, starts: np.ndarray, stops: np.ndarray) -> float:
    released_cum = np.concatenate([[0.0], np.cumsum(released)])
    true_cum = np.concatenate([[0.0], np.cumsum(truth)])
    errors = (released_cum[stops] - released_cum[starts]) - (true_cum[stops] - true_cum[starts])
    return float(np.mean(errors**2))


def test_range_query_error_ordering_on_retail_matches_the_papers():
    """ToPS < binary tree < per-value Laplace for long random range queries at small epsilon
    (ToPS paper §5.2); retail's public domain is [0, 76] (data README)."""
    values = load("retail_basket_sizes")["items"].to_numpy().astype(float)
    positions = np.random.default_rng(0)  # query positions only: public evaluation randomness
    starts = positions.integers(0, len(values) // 2, 200)
    stops = starts + positions.integers(1, len(values) // 2, 200)
    mse = {}
    for method, extra in [("tops", {}), ("binary_tree", {}), ("laplace", {}), ("pak", {"delta": 1e-9})]:
        runs = [run(method, values, noise=keys(seed), epsilon=0.1, upper=76.0, **extra) for seed in range(3)]
        if method in ("binary_tree", "laplace"):
            # unbiased (nothing above the bound): the MSE is the exact noise variance. Three runs' empirical
            # MSE over 200 overlapping ranges is too noisy to order these two (they differ by 2x).
            mse[method] = float(runs[0].range_variance(starts, stops).mean())
        else:
            mse[method] = np.mean([range_mse(r.values, values, starts, stops) for r in runs])
    assert 10 * mse["tops"] < mse["binary_tree"] < mse["laplace"]
    assert 10 * mse["tops"] < mse["pak"]


def test_threshold_on_web1_sits_in_the_upper_part_of_the_distribution():
    values = load("web1_session_lengths")["pages"].to_numpy().astype(float)
    with seeded(4):
        nm = dpsql.threshold(values, epsilon=1.0, upper=267.0)
    threshold = nm.values[0]
    assert np.quantile(values, 0.5) <= threshold <= 267.0
    assert nm.epsilon == 1.0


@pytest.fixture(scope="module")
def traffic() -> pl.DataFrame:
    return load("traffic_volume_hourly")


def test_sql_polars_and_core_release_the_same_stream_on_traffic(traffic):
    params = dict(epsilon=1.0, upper=8000.0, m=2000)
    with seeded(11):  # the front ends read the hourly keys: the rows' time grid, so calendar blocks
        core = dpsql.tops(traffic["volume"].to_numpy(), grid=row_grid(traffic["ts"].to_numpy()).plain(), **params)
    budget = dpsql.Budget.in_memory(epsilon=3.0)
    shuffled = traffic.sample(fraction=1.0, shuffle=True, seed=3)
    with seeded(11):
        polars_out = shuffled.with_columns(pl.col("volume").dpsql.range_sum(
            method="tops", order_by="ts", budget=budget, **params).alias("private")).sort("ts")
    con = duckdb.connect()
    dpsql.duckdb.register(con, budget=budget)
    con.execute("CREATE TABLE traffic AS SELECT * FROM shuffled")
    with seeded(11):
        sql_out = con.sql("SELECT volume FROM dp_range_sum('traffic', 'ts', 'volume', method := 'tops', "
                          "epsilon := 1, upper := 8000, m := 2000) ORDER BY ts").fetchnumpy()["volume"]
    con.close()
    np.testing.assert_array_equal(polars_out["private"].to_numpy(), core.values)
    np.testing.assert_array_equal(sql_out, core.values)
    # the same release of the same rows asked again through SQL is the cached answer: charged once
    assert budget.spent == (1.0, 0.0)
    assert budget.history()["kind"].to_list() == ["release", "cache hit"]
