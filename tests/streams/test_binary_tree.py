"""The binary-tree continual counter (ALGORITHMS.md P5)."""

import math

import numpy as np
import pytest

import dpsql
from dpsql.errors import InvalidData, InvalidParameter
from dpsql.mechanisms import LaplaceLattice
from dpsql.noise import NoiseSource
from dpsql.release import run_machine
from dpsql.streams.binary_tree import BinaryTreeStream, DyadicPrefixNoise, tree_levels


class ConstantNoise(NoiseSource):
    """Every node's noise is +1 lattice unit: prefix noise counts the decomposition's nodes."""

    def discrete_laplace(self, scale, size):
        return np.ones(size, dtype=np.int64)


def prefix_nodes(i, levels):
    """The dyadic decomposition of rows [0, i) as a set of (level, first row) nodes, greedily from the top:
    as many top nodes as fit (at most two), then the largest node that fits, level by level."""
    nodes, start = set(), 0
    for level in reversed(range(levels)):
        size = 1 << level
        while start + size <= i and (level == levels - 1 or start % (2 * size) == 0):
            nodes.add((level, start))
            start += size
    assert start == i
    return nodes


def test_levels():
    assert [tree_levels(n) for n in (1, 2, 3, 8, 9, 1 << 20, (1 << 20) + 1)] == [1, 1, 2, 3, 4, 20, 21]


def test_fig1_oracle_variance_of_c7():
    upper, epsilon = 10.0, 0.5
    with dpsql.testing.seeded(0):
        rel = dpsql.binary_tree(np.ones(8), epsilon=epsilon, upper=upper)
    node = LaplaceLattice(upper, epsilon / 3).variance
    assert rel.params["levels"] == 3
    assert rel.range_variance(0, 7) == pytest.approx(3 * node, rel=1e-15)
    assert rel.range_variance(0, 7) == pytest.approx(54 * upper**2 / epsilon**2, rel=2e-3)
    assert rel.range_variance(0, 8) == pytest.approx(2 * node, rel=1e-15)  # two top nodes


@pytest.mark.parametrize("n", [1, 2, 5, 8, 13, 16, 33])
def test_range_variance_is_the_symmetric_difference_of_decompositions(n):
    levels = tree_levels(n)
    model = DyadicPrefixNoise(1.0, levels)
    starts, stops = np.triu_indices(n + 1)
    expected = [len(prefix_nodes(i, levels) ^ prefix_nodes(j, levels)) for i, j in zip(starts, stops)]
    np.testing.assert_array_equal(model.range_variance(starts, stops), expected)


@pytest.mark.parametrize("chunks", [[13], [1] * 13, [5, 8], [3, 3, 4, 3], [8, 5]])
def test_prefix_noise_counts_decomposition_nodes_under_any_chunking(chunks):
    values = np.arange(13.0) % 4
    machine = BinaryTreeStream(13, epsilon=1.0, upper=4.0, noise=ConstantNoise())
    gamma = LaplaceLattice(4.0, 1.0 / 4).granularity
    out = run_machine(machine, np.split(values, np.cumsum(chunks)[:-1]), 13)
    counts = np.array([len(prefix_nodes(i, 4)) for i in range(14)])
    np.testing.assert_array_equal(out, values + gamma * np.diff(counts))


def test_outputs_lie_on_the_lattice_and_values_are_clipped():
    values = np.array([-3.0, 0.3, 1.7, 9.0, 2.5, 2.0, 0.0])
    with dpsql.testing.seeded(3):
        rel = dpsql.binary_tree(values, epsilon=1.0, upper=3.0, lower=0.5)
    gamma = LaplaceLattice(2.5, 1.0 / 3).granularity
    units = rel.values / gamma
    np.testing.assert_array_equal(units, np.rint(units))
    zero = BinaryTreeStream(7, epsilon=1.0, upper=3.0, lower=0.5, noise=ConstantNoise())
    out = run_machine(zero, [values], 7)
    counts = np.array([len(prefix_nodes(i, 3)) for i in range(8)])
    np.testing.assert_allclose(out - gamma * np.diff(counts), np.clip(values, 0.5, 3.0), atol=gamma / 2)


def test_range_sums_are_unbiased_with_the_modelled_variance():
    n, runs = 37, 3000
    values = (np.arange(n) * 7 % 11).astype(float)
    ranges = [(0, 37), (0, 1), (5, 6), (3, 29), (16, 32), (31, 36)]
    errors = np.empty((runs, len(ranges)))
    with dpsql.testing.seeded(21) as source:
        for r in range(runs):
            rel = dpsql.streams.run("binary_tree", values, noise=source, epsilon=1.0, upper=10.0, chunk=16)
            errors[r] = [rel.range_sum(i, j) - values[i:j].sum() for i, j in ranges]
    variance = rel.range_variance(*map(np.array, zip(*ranges)))
    # Sums of <= 12 Laplace nodes: excess kurtosis <= 3, so Var(s^2) <= 5 sigma^4 / N.
    np.testing.assert_array_less(np.abs(errors.mean(axis=0)), 4 * np.sqrt(variance / runs))
    np.testing.assert_allclose(errors.var(axis=0) / variance, 1.0, atol=4 * math.sqrt(5 / runs))


def test_neighbouring_rows_are_negatively_correlated_as_modelled():
    # Var(v_i) + Var(v_{i+1}) + 2 Cov = Var(v_i + v_{i+1}): the model must hold for overlapping ranges too.
    runs = 3000
    outputs = np.empty((runs, 8))
    with dpsql.testing.seeded(8) as source:
        for r in range(runs):
            outputs[r] = dpsql.streams.run("binary_tree", np.zeros(8), noise=source, epsilon=1.0, upper=1.0).values
    model = DyadicPrefixNoise(LaplaceLattice(1.0, 1.0 / 3).variance, 3)
    covariance = np.cov(outputs[:, 2], outputs[:, 3])[0, 1]
    pair, first, second = model.range_variance(np.array([2, 2, 3]), np.array([4, 3, 4]))
    expected = (pair - first - second) / 2  # v_2 = N[2,3), v_3 = N[0,4) - N[0,2) - N[2,3)
    assert expected == pytest.approx(-model.range_variance(np.array([0]), np.array([1]))[0])
    assert covariance == pytest.approx(expected, abs=4 * math.sqrt(first * second * 2 / runs))


def test_range_ci_coverage():
    n, runs = 100, 2000
    values = np.full(n, 3.0)
    covered = 0
    with dpsql.testing.seeded(4) as source:
        for _ in range(runs):
            rel = dpsql.streams.run("binary_tree", values, noise=source, epsilon=0.5, upper=5.0)
            low, high = rel.range_ci(10, 77, level=0.9)
            covered += low <= 3.0 * 67 <= high
    sd = math.sqrt(0.9 * 0.1 / runs)
    assert 0.9 - 3 * sd <= covered / runs <= 0.9 + 5 * sd  # the kurtosis bound may over-cover slightly


def test_ledger_records_the_release():
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    with dpsql.testing.seeded(0):
        rel = dpsql.binary_tree(np.arange(50.0), epsilon=0.3, upper=60.0, budget=budget, note="bt")
    row = budget.history().row(0, named=True)
    assert (row["method"], row["epsilon"], row["delta"], row["rows"], row["note"]) == ("binary_tree", 0.3, 0.0, 50,
                                                                                       "bt")
    assert budget.spent == (0.3, 0.0)
    assert (rel.epsilon, rel.delta, rel.components) == (0.3, 0.0, {"binary_tree": (0.3, 0.0)})
    assert "replace-one-value" in rel.neighbour


@pytest.mark.parametrize(("values", "kwargs", "error", "name"), [
    ([1.0, np.nan], {}, InvalidData, "NaN"),
    ([1.0, np.inf], {}, InvalidData, "infinite"),
    ([], {}, InvalidData, "empty"),
    ([[1.0, 2.0]], {}, InvalidData, "1-D"),
    ([1.0, None], {}, InvalidData, "null"),
    ([1.0], {"epsilon": 0.0}, InvalidParameter, "epsilon"),
    ([1.0], {"epsilon": float("nan")}, InvalidParameter, "epsilon"),
    ([1.0], {"upper": -1.0}, InvalidParameter, "upper"),
])
def test_bad_input_is_refused_and_not_charged(values, kwargs, error, name):
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    with pytest.raises(error, match=name):
        dpsql.binary_tree(np.array(values, dtype=object if None in values else float),
                          **{"epsilon": 0.5, "upper": 2.0, "budget": budget, **kwargs})
    assert budget.spent == (0.0, 0.0)


def test_delta_is_refused_for_the_pure_method():
    with pytest.raises(InvalidParameter, match="delta"):
        dpsql.publish("binary_tree", np.ones(4), epsilon=1.0, upper=2.0, delta=1e-6)
