"""The binary-tree continual counter (Chan, Shi, Song 2011): the horizon tree and, by default, the
unbounded hybrid counter (Chan, Shi and Song) with its epoch totals."""

import math

import numpy as np
import pytest

import dpsql
from dpsql.accounting import largest_share
from dpsql.errors import HorizonExceeded, InvalidData, InvalidParameter
from dpsql.mechanisms import LaplaceLattice
from dpsql.methods import run
from dpsql.noise import Lane
from dpsql.release import run_machine
from dpsql.streams.binary_tree import BinaryTreeStream, DyadicPrefixNoise, HybridPrefixNoise, epoch_of, tree_levels
from dpsql.testing import draws, keys, seeded


class ConstantDraws:
    """Every node's noise is +1 lattice unit (any lane): prefix noise counts the nodes summed."""

    class _Lane:
        def discrete_laplace(self, scale, start, count):
            return np.ones(count, dtype=np.int64)

    def lane(self, lane, level=0):
        assert lane in (Lane.TREE, Lane.EPOCH_TOTAL)
        return self._Lane()


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


def hybrid_nodes(i):
    """The nodes of the hybrid counter's prefix ``P(i)``: the totals of the epochs before ``i``'s
    (epoch e holds rows 2**e - 1 .. 2**(e+1) - 2) and the dyadic prefix inside its own epoch's tree
    of e levels."""
    epoch = (int(i) + 1).bit_length() - 1
    nodes = {("total", e) for e in range(epoch)}
    if epoch:
        nodes |= {("tree", epoch, *node) for node in prefix_nodes(i - (2**epoch - 1), epoch)}
    return nodes


def hybrid_node_variances(epsilon, bound, epochs):
    totals = LaplaceLattice(bound, epsilon / 2).variance
    tree_epsilon = largest_share(epsilon, epsilon - epsilon / 2, rest=epsilon / 2)
    trees = [LaplaceLattice(bound, largest_share(tree_epsilon, tree_epsilon / max(e, 1), count=max(e, 1))).variance
             for e in range(epochs)]
    return totals, trees


def test_levels():
    assert [tree_levels(n) for n in (1, 2, 3, 8, 9, 1 << 20, (1 << 20) + 1)] == [1, 1, 2, 3, 4, 20, 21]
    prefixes = np.arange(2**12)
    np.testing.assert_array_equal(epoch_of(prefixes), np.floor(np.log2(prefixes + 1)).astype(int))
    assert epoch_of(np.array([2**40 - 2, 2**40 - 1])).tolist() == [39, 40]


def test_fig1_oracle_variance_of_c7():
    upper, epsilon = 10.0, 0.5
    with seeded(0):
        rel = dpsql.binary_tree(np.ones(8), epsilon=epsilon, upper=upper, horizon=8,
                                budget=dpsql.Budget.in_memory(epsilon=1.0))
    node = LaplaceLattice(upper, epsilon / 3).variance
    assert rel.params["levels"] == 3 and rel.params["horizon"] == 8
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


def test_hybrid_range_variance_is_the_symmetric_difference_of_its_nodes():
    epsilon, bound, n = 0.7, 3.0, 70
    totals, trees = hybrid_node_variances(epsilon, bound, 8)
    machine = BinaryTreeStream(None, epsilon=epsilon, upper=bound, noise=draws(0))
    machine.feed(np.ones(n))
    model = machine.describe()["error"]
    assert isinstance(model, HybridPrefixNoise) and machine.describe()["params"]["horizon"] is None
    starts, stops = np.triu_indices(n + 1)

    def variance(node):
        return totals if node[0] == "total" else trees[node[1]]

    expected = [sum(variance(node) for node in hybrid_nodes(i) ^ hybrid_nodes(j)) for i, j in zip(starts, stops)]
    np.testing.assert_allclose(model.range_variance(starts, stops), expected, rtol=1e-12)


@pytest.mark.parametrize("chunks", [[13], [1] * 13, [5, 8], [3, 3, 4, 3], [8, 5]])
@pytest.mark.parametrize("horizon", [13, None])
def test_prefix_noise_counts_decomposition_nodes_under_any_chunking(chunks, horizon):
    values = np.arange(13.0) % 4
    machine = BinaryTreeStream(13, epsilon=1.0, upper=4.0, horizon=horizon, noise=ConstantDraws())
    gamma = LaplaceLattice(4.0, 1.0).granularity  # one sensitivity: one granularity for every lattice
    out = run_machine(machine, np.split(values, np.cumsum(chunks)[:-1]), 13)
    nodes = (lambda i: prefix_nodes(i, 4)) if horizon else hybrid_nodes
    counts = np.array([len(nodes(i)) for i in range(14)])
    np.testing.assert_array_equal(out, values + gamma * np.diff(counts))


def test_any_chunking_gives_the_same_release_with_real_draws():
    values = np.random.default_rng(1).uniform(0, 5, 3000)
    whole = run("binary_tree", values, noise=keys(2), epsilon=1.0, upper=5.0)
    for chunk in (1, 7, 1023, 1024, 1025):
        if chunk == 1:
            machine = BinaryTreeStream(None, epsilon=1.0, upper=5.0, noise=keys(2).partition())
            head = np.concatenate([machine.feed(values[i:i + 1]) for i in range(300)])
            np.testing.assert_array_equal(head, whole.values[:300])
            continue
        np.testing.assert_array_equal(run("binary_tree", values, noise=keys(2), epsilon=1.0, upper=5.0,
                                          chunk=chunk).values, whole.values)


def test_snapshot_and_restore():
    values = np.random.default_rng(3).uniform(0, 5, 2000)
    whole = run("binary_tree", values, noise=keys(4), epsilon=1.0, upper=5.0).values
    first = BinaryTreeStream(None, epsilon=1.0, upper=5.0, noise=keys(4).partition())
    head = first.feed(values[:777])
    second = BinaryTreeStream(None, epsilon=1.0, upper=5.0, noise=keys(4).partition())
    second.restore(first.snapshot())
    np.testing.assert_array_equal(np.concatenate([head, second.feed(values[777:])]), whole)


@pytest.mark.parametrize("horizon", [7, None])
def test_outputs_lie_on_the_lattice_and_values_are_clipped(horizon):
    values = np.array([-3.0, 0.3, 1.7, 9.0, 2.5, 2.0, 0.0])
    with seeded(3):
        rel = dpsql.binary_tree(values, epsilon=1.0, upper=3.0, lower=0.5, horizon=horizon,
                                budget=dpsql.Budget.in_memory(epsilon=1.0))
    gamma = LaplaceLattice(2.5, 1.0).granularity
    units = rel.values / gamma
    np.testing.assert_array_equal(units, np.rint(units))
    out = run_machine(BinaryTreeStream(7, epsilon=1.0, upper=3.0, lower=0.5, horizon=horizon, noise=ConstantDraws()),
                      [values], 7)
    nodes = (lambda i: prefix_nodes(i, 3)) if horizon else hybrid_nodes
    counts = np.array([len(nodes(i)) for i in range(8)])
    np.testing.assert_allclose(out - gamma * np.diff(counts), np.clip(values, 0.5, 3.0), atol=gamma / 2)


@pytest.mark.parametrize("horizon", [37, None])
def test_range_sums_are_unbiased_with_the_modelled_variance(horizon):
    n, runs = 37, 3000
    values = (np.arange(n) * 7 % 11).astype(float)
    ranges = [(0, 37), (0, 1), (5, 6), (3, 29), (16, 32), (31, 36)]
    errors = np.empty((runs, len(ranges)))
    for r in range(runs):
        rel = run("binary_tree", values, noise=keys(r), epsilon=1.0, upper=10.0, horizon=horizon, chunk=16)
        errors[r] = [rel.range_sum(i, j) - values[i:j].sum() for i, j in ranges]
    variance = rel.range_variance(*map(np.array, zip(*ranges)))
    # Sums of <= 12 Laplace nodes: excess kurtosis <= 3, so Var(s^2) <= 5 sigma^4 / N.
    np.testing.assert_array_less(np.abs(errors.mean(axis=0)), 4 * np.sqrt(variance / runs))
    np.testing.assert_allclose(errors.var(axis=0) / variance, 1.0, atol=4 * math.sqrt(5 / runs))


def test_neighbouring_rows_are_negatively_correlated_as_modelled():
    # Var(v_i) + Var(v_{i+1}) + 2 Cov = Var(v_i + v_{i+1}): the model must hold for overlapping ranges too.
    runs = 3000
    outputs = np.array([run("binary_tree", np.zeros(8), noise=keys(r), epsilon=1.0, upper=1.0, horizon=8).values
                        for r in range(runs)])
    model = DyadicPrefixNoise(LaplaceLattice(1.0, 1.0 / 3).variance, 3)
    covariance = np.cov(outputs[:, 2], outputs[:, 3])[0, 1]
    pair, first, second = model.range_variance(np.array([2, 2, 3]), np.array([4, 3, 4]))
    expected = (pair - first - second) / 2  # v_2 = N[2,3), v_3 = N[0,4) - N[0,2) - N[2,3)
    assert expected == pytest.approx(-model.range_variance(np.array([0]), np.array([1]))[0])
    assert covariance == pytest.approx(expected, abs=4 * math.sqrt(first * second * 2 / runs))


def test_range_ci_coverage():
    n, runs = 100, 2000
    covered = 0
    for r in range(runs):
        rel = run("binary_tree", np.full(n, 3.0), noise=keys(r), epsilon=0.5, upper=5.0)
        low, high = rel.range_ci(10, 77, level=0.9)
        covered += low <= 3.0 * 67 <= high
    sd = math.sqrt(0.9 * 0.1 / runs)
    assert 0.9 - 3 * sd <= covered / runs <= 0.9 + 5 * sd  # the kurtosis bound may over-cover slightly


def test_a_declared_horizon_is_enforced():
    machine = BinaryTreeStream(None, epsilon=1.0, upper=1.0, horizon=8, noise=draws(0))
    machine.feed(np.ones(6))
    with pytest.raises(HorizonExceeded, match="horizon=8"):
        machine.feed(np.ones(3))
    assert machine.rows == 6
    with pytest.raises(HorizonExceeded):
        dpsql.binary_tree(np.ones(9), epsilon=1.0, upper=1.0, horizon=8, budget=dpsql.Budget.in_memory(epsilon=1))


def test_ledger_records_the_release():
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    with seeded(0):
        rel = dpsql.binary_tree(np.arange(50.0), epsilon=0.3, upper=60.0, budget=budget, note="bt")
    row = budget.history().row(0, named=True)
    assert (row["method"], row["epsilon"], row["delta"], row["rows"], row["note"]) == ("binary_tree", 0.3, 0.0, 50,
                                                                                       "bt")
    assert budget.spent == (0.3, 0.0)
    assert (rel.epsilon, rel.delta, rel.components) == (0.3, 0.0, {"binary_tree": (0.3, 0.0)})
    assert "replace-one-value" in rel.neighbour and rel.params["horizon"] is None


@pytest.mark.parametrize(("values", "kwargs", "error", "name"), [
    ([1.0, np.nan], {}, InvalidData, "NaN"),
    ([1.0, np.inf], {}, InvalidData, "infinite"),
    ([], {}, InvalidData, "empty"),
    ([[1.0, 2.0]], {}, InvalidData, "1-D"),
    ([1.0, None], {}, InvalidData, "null"),
    ([1.0], {"epsilon": 0.0}, InvalidParameter, "epsilon"),
    ([1.0], {"epsilon": float("nan")}, InvalidParameter, "epsilon"),
    ([1.0], {"upper": -1.0}, InvalidParameter, "upper"),
    ([1.0], {"horizon": 0}, InvalidParameter, "horizon"),
    ([1.0], {"horizon": 2.5}, InvalidParameter, "horizon"),
])
def test_bad_input_is_refused_and_not_charged(values, kwargs, error, name):
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    with pytest.raises(error, match=name):
        dpsql.binary_tree(np.array(values, dtype=object if None in values else float),
                          **{"epsilon": 0.5, "upper": 2.0, "budget": budget, **kwargs})
    assert budget.spent == (0.0, 0.0) and budget.history().height == 0


def test_delta_is_refused_for_the_pure_method():
    with pytest.raises(InvalidParameter, match="delta"):
        dpsql.publish("binary_tree", np.ones(4), epsilon=1.0, upper=2.0, delta=1e-6)
