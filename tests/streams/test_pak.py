"""PAK (Perrier, Asghar, Kaafar, NDSS 2019): accounting, the threshold, the hold-out released through the flat
hierarchy at ``holdout_share * epsilon``, the binary-tree stream phase, and bad input."""

import math

import numpy as np
import pytest

import dpsql
from dpsql.accounting import largest_share
from dpsql.errors import InvalidData, InvalidParameter
from dpsql.mechanisms import LaplaceLattice
from dpsql.mechanisms.hierarchy import Layout, leaf_interval_variance
from dpsql.mechanisms.smooth_sensitivity import pak_threshold
from dpsql.methods import run
from dpsql.noise import Lane
from dpsql.streams.binary_tree import BinaryTreeStream, DyadicPrefixNoise, tree_levels
from dpsql.testing import keys, seeded

# A light-tailed stream long enough for a useful threshold (its 99.575 % quantile is 9).
LIGHT = (np.arange(400_000) * 7919 % 1000 // 100).astype(float)


def test_ledger_records_epsilon_and_default_delta():
    budget = dpsql.Budget.in_memory(epsilon=2.0, delta=1e-6)
    with seeded(0):
        rel = dpsql.pak(LIGHT, epsilon=0.8, upper=100.0, budget=budget, note="pak")
    n = len(LIGHT)
    assert budget.spent == (0.8, 1 / n**2)
    row = budget.history().row(0, named=True)
    assert (row["method"], row["epsilon"], row["delta"], row["note"]) == ("pak", 0.8, 1 / n**2, "pak")
    assert (rel.epsilon, rel.delta) == (0.8, 1 / n**2)
    assert rel.components == {"threshold": (0.8 * 0.85, 1 / n**2), "holdout": (0.8 * 0.15, 0.0),
                              "binary_tree": (0.8, 0.0)}
    assert rel.params["m"] == 4096 and rel.params["delta"] == 1 / n**2 and rel.params["holdout_share"] == 0.15


def test_explicit_delta_and_holdout_share():
    budget = dpsql.Budget.in_memory(epsilon=1.0, delta=1e-3)
    with seeded(1):
        rel = dpsql.pak(LIGHT, epsilon=0.5, upper=100.0, delta=2.0**-20, holdout_share=0.2, m=40_000, budget=budget)
    assert budget.spent == (0.5, 2.0**-20)
    assert rel.components["threshold"] == (pytest.approx(0.4), 2.0**-20)
    assert rel.components["holdout"] == (pytest.approx(0.1), 0.0)
    assert rel.components["threshold"][0] + rel.components["holdout"][0] <= 0.5
    assert rel.params["m"] == 40_000


def test_threshold_holdout_release_and_binary_tree_stream_phase():
    m, n = 65_536, len(LIGHT)
    with seeded(5) as release_keys:
        rel = dpsql.pak(LIGHT, epsilon=1.0, upper=100.0, m=m, horizon=2**19,
                        budget=dpsql.Budget.in_memory(epsilon=1.0, delta=1e-9))
    noise = release_keys.partition()
    tau = pak_threshold(np.sort(LIGHT[:m]), epsilon=0.85, delta=1 / n**2, upper=100.0,
                        noise=noise.lane(Lane.SMOOTH_SENSITIVITY))
    assert rel.threshold == tau and 9.0 <= tau < 30.0
    # hold-out rows: the flat hierarchy over one chunk of m rows at 0.15, clipped at tau (lane HOLDOUT)
    epsilon_holdout = largest_share(1.0, 0.15, rest=0.85)
    chunk = Layout(epsilon=epsilon_holdout, fanout=16, r=m).chunk(0)
    levels = chunk.forest.levels
    lap = LaplaceLattice(tau, largest_share(epsilon_holdout, epsilon_holdout / levels, count=levels))
    leaves = chunk.forest.consistent_leaf_noise(lap, noise.lane(Lane.HOLDOUT, 0), 0)[:chunk.blocks]
    sums = np.rint(np.minimum(LIGHT[:m], tau) / lap.granularity).reshape(-1, chunk.block).sum(axis=1)
    np.testing.assert_array_equal(rel.values[:m], np.repeat(lap.from_units(sums.astype(np.int64) + leaves)
                                                            / chunk.block, chunk.block))
    holdout_variance = leaf_interval_variance(0, chunk.blocks, fanout=16, levels=levels, node_variance=lap.variance)
    assert rel.range_variance(0, m) == pytest.approx(holdout_variance, rel=1e-12)
    # the stream phase: the binary tree at bound tau and the full epsilon, from the same draws
    tree = BinaryTreeStream(None, epsilon=1.0, upper=tau, horizon=2**19, noise=noise)
    np.testing.assert_array_equal(rel.values[m:], np.concatenate([tree.feed(np.minimum(LIGHT[m:], tau)),
                                                                  tree.close()]))
    model = DyadicPrefixNoise(LaplaceLattice(tau, 1.0 / 19).variance, 19)
    starts, stops = np.array([m, m + 5, m + 1000]), np.array([m + 7, n, m + 77_777])
    np.testing.assert_allclose(rel.range_variance(starts, stops), model.range_variance(starts - m, stops - m))
    # the binary tree's error: Var(c(i) - c_hat(i)) = popcount(i - m) node variances + the hold-out's.
    node = model.range_variance(np.array([0]), np.array([1]))[0]
    for k in (1, 2, 7, 1000, 65_535, n - m):
        assert rel.range_variance(0, m + k) == pytest.approx(holdout_variance + bin(k).count("1") * node)
    # a range straddling the boundary adds both parts
    straddle = rel.error._models[0].range_variance(np.array([m - 10]), np.array([m]))[0]
    assert rel.range_variance(m - 10, m + 7) == pytest.approx(straddle + 3 * node)
    assert tree_levels(2**19) == 19


def test_the_default_stream_phase_is_the_unbounded_counter():
    rel = run("pak", LIGHT[:50_000], noise=keys(3), epsilon=1.0, upper=100.0)
    assert rel.params["horizon"] is None and rel.params["m"] == 4096
    tree = BinaryTreeStream(None, epsilon=1.0, upper=rel.threshold, noise=keys(3).partition())
    expected = np.concatenate([tree.feed(np.minimum(LIGHT[4096:50_000], rel.threshold)), tree.close()])
    np.testing.assert_array_equal(rel.values[4096:], expected)
    starts, stops = np.array([4096, 5000, 0]), np.array([50_000, 30_000, 50_000])
    holdout = rel.error._models[0].range_variance(np.array([0]), np.array([4096]))[0]
    np.testing.assert_allclose(rel.range_variance(starts, stops),
                               tree.describe()["error"].range_variance(np.maximum(starts - 4096, 0), stops - 4096)
                               + np.array([0.0, 0.0, holdout]))


def test_stream_values_are_clipped_at_the_threshold():
    values = LIGHT.copy()
    values[200_000:200_010] = 1e6  # far above upper: clipped to the threshold, not an error
    spiky = run("pak", values, noise=keys(5), epsilon=1.0, upper=100.0)
    plain = run("pak", LIGHT, noise=keys(5), epsilon=1.0, upper=100.0)
    assert spiky.threshold == plain.threshold
    difference = spiky.range_sum(0, len(values)) - plain.range_sum(0, len(values))
    gamma = LaplaceLattice(spiky.threshold, 0.5).granularity  # clipped values are rounded to the tree's lattice
    assert difference == pytest.approx(10 * (spiky.threshold - LIGHT[200_000:200_010].mean()), abs=10 * gamma / 2)


def test_total_error_matches_the_model_and_ci_covers():
    # Short hold-out: the threshold clips at the bound (SS ~ B), so the release is a binary tree at B.
    n, m, upper, runs = 600, 60, 12.0, 1500
    values = (np.arange(n) % 13).astype(float)
    sq_error, predicted, covered = 0.0, 0.0, 0
    for seed in range(runs):
        rel = run("pak", values, noise=keys(seed), epsilon=1.0, upper=upper, m=m)
        truth = np.minimum(values, rel.threshold).sum()
        sq_error += (rel.range_sum(0, n) - truth) ** 2
        predicted += rel.range_variance(0, n)
        low, high = rel.range_ci(0, n, level=0.95)
        covered += low <= truth <= high
    assert sq_error / predicted == pytest.approx(1.0, abs=4 * math.sqrt(5 / runs))
    assert covered / runs >= 0.95 - 3 * math.sqrt(0.95 * 0.05 / runs)


def test_a_given_threshold_skips_the_holdout():
    budget = dpsql.Budget.in_memory(epsilon=1.0, delta=1e-3)
    with seeded(6) as release_keys:
        rel = dpsql.pak(LIGHT[:10_000], epsilon=0.5, upper=100.0, threshold=12.0, budget=budget)
    assert budget.spent == (0.5, 0.0) and rel.components == {"binary_tree": (0.5, 0.0)}
    assert rel.threshold == 12.0 and rel.params["m"] == 0
    tree = BinaryTreeStream(None, epsilon=0.5, upper=12.0, noise=release_keys.partition())
    np.testing.assert_array_equal(rel.values, np.concatenate([tree.feed(np.minimum(LIGHT[:10_000], 12.0)),
                                                              tree.close()]))


@pytest.mark.parametrize(("kwargs", "error", "name"), [
    ({"delta": 0.0}, InvalidParameter, "delta"),
    ({"delta": 1.0}, InvalidParameter, "delta"),
    ({"delta": -1e-9}, InvalidParameter, "delta"),
    ({"delta": float("inf")}, InvalidParameter, "delta"),
    ({"delta": 0.05}, InvalidParameter, "kappa"),
    ({"epsilon": 0.0}, InvalidParameter, "epsilon"),
    ({"epsilon": -0.5}, InvalidParameter, "epsilon"),
    ({"m": 5000}, InvalidParameter, "m"),
    ({"m": 0}, InvalidParameter, "m"),
    ({"lam": 2.0}, InvalidParameter, "lam"),
    ({"tail_p": 1.0}, InvalidParameter, "tail_p"),
    ({"beta_lt": 0.0}, InvalidParameter, "beta_lt"),
    ({"rho": 0.5}, InvalidParameter, "rho"),
    ({"holdout_share": 1.0}, InvalidParameter, "holdout_share"),
    ({"holdout_share": 0.0}, InvalidParameter, "holdout_share"),
    ({"holdout_share": -1.0}, InvalidParameter, "holdout_share"),
    ({"upper": 0.0}, InvalidParameter, "upper"),
    ({"threshold": -2.0}, InvalidParameter, "threshold"),
    ({"threshold": float("nan")}, InvalidParameter, "threshold"),
    ({"threshold": 301.0}, InvalidParameter, "threshold"),
    ({"threshold": 5.0, "delta": 1e-6}, InvalidParameter, "delta"),
    ({"values": [1.0, np.nan] * 2500}, InvalidData, "NaN"),
    ({"values": []}, InvalidData, "empty"),
])
def test_bad_input_is_refused_and_not_charged(kwargs, error, name):
    budget = dpsql.Budget.in_memory(epsilon=10.0, delta=0.5)
    args = {"values": np.arange(5000.0) % 300, "epsilon": 1.0, "upper": 300.0, "budget": budget, **kwargs}
    with pytest.raises(error, match=name):
        dpsql.pak(np.asarray(args.pop("values"), dtype=float), **args)
    assert budget.spent == (0.0, 0.0)
    assert budget.history().height == 0


def test_budget_without_delta_refuses_pak():
    budget = dpsql.Budget.in_memory(epsilon=10.0)
    with pytest.raises(dpsql.BudgetExhausted):
        dpsql.pak(np.arange(5000.0), epsilon=1.0, upper=300.0, budget=budget)
    assert budget.spent == (0.0, 0.0)
