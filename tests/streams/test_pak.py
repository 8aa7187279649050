"""PAK (ALGORITHMS.md §3): accounting, hold-out release, stream phase and bad input."""

import math

import numpy as np
import pytest

import dpsql
from dpsql.errors import InvalidData, InvalidParameter
from dpsql.mechanisms import LaplaceLattice
from dpsql.mechanisms.smooth_sensitivity import pak_threshold
from dpsql.streams.binary_tree import DyadicPrefixNoise, tree_levels

# A light-tailed stream long enough for a useful threshold (its 99.575 % quantile is 9).
LIGHT = (np.arange(400_000) * 7919 % 1000 // 100).astype(float)


def test_ledger_records_epsilon_and_default_delta():
    budget = dpsql.Budget.in_memory(epsilon=2.0, delta=1e-6)
    with dpsql.testing.seeded(0):
        rel = dpsql.pak(LIGHT, epsilon=0.8, upper=100.0, budget=budget, note="pak")
    n = len(LIGHT)
    assert budget.spent == (0.8, 1 / n**2)
    row = budget.history().row(0, named=True)
    assert (row["method"], row["epsilon"], row["delta"], row["note"]) == ("pak", 0.8, 1 / n**2, "pak")
    assert (rel.epsilon, rel.delta) == (0.8, 1 / n**2)
    assert rel.components == {"threshold": (0.8 * 0.85, 1 / n**2), "holdout_total": (0.8 * 0.15, 0.0),
                              "binary_tree": (0.8, 0.0)}
    assert rel.params["m"] == 65_536 and rel.params["delta"] == 1 / n**2


def test_explicit_delta_and_holdout_share():
    budget = dpsql.Budget.in_memory(epsilon=1.0, delta=1e-3)
    with dpsql.testing.seeded(1):
        rel = dpsql.pak(LIGHT, epsilon=0.5, upper=100.0, delta=2.0**-20, holdout_share=0.2, m=40_000, budget=budget)
    assert budget.spent == (0.5, 2.0**-20)
    assert rel.components["threshold"] == (pytest.approx(0.4), 2.0**-20)
    assert rel.components["holdout_total"] == (pytest.approx(0.1), 0.0)


def test_threshold_is_pak_threshold_of_the_holdout_and_the_stream_is_the_binary_tree():
    m = 65_536
    with dpsql.testing.seeded(5):
        rel = dpsql.pak(LIGHT, epsilon=1.0, upper=100.0)
    with dpsql.testing.seeded(5) as source:
        tau = pak_threshold(np.sort(LIGHT[:m]), epsilon=0.85, delta=1 / len(LIGHT) ** 2, upper=100.0, noise=source)
    assert rel.threshold == tau
    assert 9.0 <= tau < 30.0
    # Hold-out rows share the clipped noisy total equally.
    assert np.all(rel.values[:m] == rel.values[0])
    holdout_var = LaplaceLattice(tau, 0.15).variance
    assert rel.range_variance(0, m) == pytest.approx(holdout_var)
    assert rel.range_variance(0, m // 2) == pytest.approx(holdout_var / 4)
    # Ranges inside the stream phase: the binary tree at bound tau and the full epsilon.
    rest = len(LIGHT) - m
    tree = DyadicPrefixNoise(LaplaceLattice(tau, 1.0 / tree_levels(rest)).variance, tree_levels(rest))
    starts, stops = np.array([m, m + 5, m + 1000]), np.array([m + 7, len(LIGHT), m + 77_777])
    np.testing.assert_allclose(rel.range_variance(starts, stops), tree.range_variance(starts - m, stops - m))
    # ALGORITHMS.md §3.6: Var(c(i) - c_hat(i)) = popcount(i - m) node variances + the hold-out total's.
    for k in (1, 2, 7, 1000, 65_535, rest):
        assert rel.range_variance(0, m + k) == pytest.approx(holdout_var + bin(k).count("1") * tree.range_variance(
            np.array([0]), np.array([1]))[0])
    # A range straddling the boundary adds both parts.
    assert rel.range_variance(m - 10, m + 7) == pytest.approx(holdout_var * (10 / m) ** 2 + tree.range_variance(
        np.array([0]), np.array([7]))[0])


def test_stream_values_are_clipped_at_the_threshold():
    values = LIGHT.copy()
    values[200_000:200_010] = 1e6  # far above upper: clipped to the threshold, not an error
    with dpsql.testing.seeded(5):
        spiky = dpsql.pak(values, epsilon=1.0, upper=100.0)
    with dpsql.testing.seeded(5):
        plain = dpsql.pak(LIGHT, epsilon=1.0, upper=100.0)
    assert spiky.threshold == plain.threshold
    difference = spiky.range_sum(0, len(values)) - plain.range_sum(0, len(values))
    gamma = LaplaceLattice(spiky.threshold, 1.0).granularity  # clipped values are rounded to the tree's lattice
    assert difference == pytest.approx(10 * (spiky.threshold - LIGHT[200_000:200_010].mean()), abs=10 * gamma / 2)


def test_total_error_matches_the_model_and_ci_covers():
    # Short hold-out: the threshold clips at the bound (SS ~ B), so the release is a binary tree at B.
    n, m, upper, runs = 600, 60, 12.0, 1500
    values = (np.arange(n) % 13).astype(float)
    sq_error, predicted, covered = 0.0, 0.0, 0
    with dpsql.testing.seeded(9) as source:
        for _ in range(runs):
            rel = dpsql.streams.run("pak", values, noise=source, epsilon=1.0, upper=upper, m=m)
            truth = np.minimum(values, rel.threshold)[m:].sum() + np.minimum(values[:m], rel.threshold).sum()
            sq_error += (rel.range_sum(0, n) - truth) ** 2
            predicted += rel.range_variance(0, n)
            low, high = rel.range_ci(0, n, level=0.95)
            covered += low <= truth <= high
    assert sq_error / predicted == pytest.approx(1.0, abs=4 * math.sqrt(5 / runs))
    assert covered / runs >= 0.95 - 3 * math.sqrt(0.95 * 0.05 / runs)


@pytest.mark.parametrize(("kwargs", "error", "name"), [
    ({"delta": 0.0}, InvalidParameter, "delta"),
    ({"delta": 1.0}, InvalidParameter, "delta"),
    ({"delta": -1e-9}, InvalidParameter, "delta"),
    ({"delta": float("inf")}, InvalidParameter, "delta"),
    ({"delta": 0.05}, InvalidParameter, "kappa"),
    ({"epsilon": 0.0}, InvalidParameter, "epsilon"),
    ({"epsilon": -0.5}, InvalidParameter, "epsilon"),
    ({"m": 200}, InvalidParameter, "m"),
    ({"m": 0}, InvalidParameter, "m"),
    ({"lam": 2.0}, InvalidParameter, "lam"),
    ({"tail_p": 1.0}, InvalidParameter, "tail_p"),
    ({"beta_lt": 0.0}, InvalidParameter, "beta_lt"),
    ({"rho": 0.5}, InvalidParameter, "rho"),
    ({"holdout_share": 1.0}, InvalidParameter, "holdout_share"),
    ({"upper": 0.0}, InvalidParameter, "upper"),
    ({"values": [1.0, np.nan] * 100}, InvalidData, "NaN"),
    ({"values": []}, InvalidData, "empty"),
])
def test_bad_input_is_refused_and_not_charged(kwargs, error, name):
    budget = dpsql.Budget.in_memory(epsilon=10.0, delta=0.5)
    args = {"values": np.arange(200.0), "epsilon": 1.0, "upper": 300.0, "budget": budget, **kwargs}
    with pytest.raises(error, match=name):
        dpsql.pak(np.asarray(args.pop("values"), dtype=float), **args)
    assert budget.spent == (0.0, 0.0)
    assert budget.history().height == 0


def test_budget_without_delta_refuses_pak():
    budget = dpsql.Budget.in_memory(epsilon=10.0)
    with pytest.raises(dpsql.BudgetExhausted):
        dpsql.pak(np.arange(200.0), epsilon=1.0, upper=300.0, budget=budget)
    assert budget.spent == (0.0, 0.0)
