"""The fan-out forest over block sums (P5) and Hay et al.'s consistency (P6): least squares,
online consistency, the closed-form inverse normal matrix and interval variances; and the
calendar tree of unequal fan-outs and per-level budgets: its two-pass estimator against a
brute-force weighted least-squares solve."""

import numpy as np
import pytest
from oracles import design_matrix

from dpsql.mechanisms import LaplaceLattice
from dpsql.mechanisms.calendar import Tree
from dpsql.mechanisms.hierarchy import Forest, leaf_interval_variance
from dpsql.mechanisms.laplace import LatticeBatch
from dpsql.noise import Lane
from dpsql.testing import keys

FORESTS = [Forest(2, 4, 1), Forest(4, 3, 1), Forest(16, 2, 1), Forest(4, 3, 3)]




def averaging(forest: Forest, level: int) -> np.ndarray:
    size = forest.fanout**level
    blocks = np.arange(forest.n_leaves) // size
    return (blocks[:, None] == blocks[None, :]) / size


# --- shape -----------------------------------------------------------------------------------------

def test_forest_covers_whole_top_nodes():
    # 4096 leaves of a 3-level fanout-16 forest: 16 roots of 256 leaves; one more leaf needs a 17th root
    assert Forest.covering(4096, 16, 3) == Forest(16, 3, 16)
    assert Forest.covering(4097, 16, 3).roots == 17
    assert Forest.covering(1, 16, 3).roots == 1 and Forest.covering(0, 16, 3).roots == 1
    forest = Forest(4, 3, 2)
    assert (forest.n_leaves, forest.level_sizes(), forest.n_nodes) == (32, [32, 8, 2], 42)
    nodes = forest.aggregate(np.arange(29.0))  # zero-padded to 32 leaves
    assert [len(level) for level in nodes] == [32, 8, 2]
    assert nodes[2].tolist() == [np.arange(16.0).sum(), np.arange(16.0, 29.0).sum()]


# --- consistency -----------------------------------------------------------------------------------

@pytest.mark.parametrize("forest", FORESTS, ids=str)
def test_consistency_equals_least_squares(forest):
    rng = np.random.default_rng(0)
    a = design_matrix(forest)
    noisy = rng.normal(size=a.shape[0]) * 10
    levels = np.split(noisy, np.cumsum(forest.level_sizes())[:-1])
    leaves = forest.consistent(levels)[0]
    np.testing.assert_allclose(leaves, np.linalg.lstsq(a, noisy, rcond=None)[0], atol=1e-10)


@pytest.mark.parametrize("forest", FORESTS, ids=str)
def test_consistent_parents_equal_sum_of_children(forest):
    rng = np.random.default_rng(1)
    out = forest.consistent([rng.laplace(size=s) for s in forest.level_sizes()])
    for level in range(1, forest.levels):
        np.testing.assert_allclose(out[level], out[level - 1].reshape(-1, forest.fanout).sum(axis=1), atol=1e-9)


@pytest.mark.parametrize("forest", FORESTS, ids=str)
def test_online_consistency_equals_offline(forest):
    """ToPS Theorem C.1: consistent(T + N) == T + consistent(N) for a true (consistent) forest T."""
    rng = np.random.default_rng(2)
    true = forest.aggregate(rng.integers(0, 100, forest.n_leaves).astype(float))
    noise = [rng.laplace(size=s) for s in forest.level_sizes()]
    offline = forest.consistent([t + n for t, n in zip(true, noise)])[0]
    np.testing.assert_allclose(true[0] + forest.consistent(noise)[0], offline, atol=1e-9)


def test_consistency_of_many_forests_at_once_is_each_forests():
    forest = Forest(4, 3, 2)
    rng = np.random.default_rng(3)
    stacked = [rng.normal(size=(5, s)) for s in forest.level_sizes()]
    together = forest.consistent(stacked)
    for j in range(5):
        alone = forest.consistent([level[j] for level in stacked])
        for a, b in zip(together, alone):
            np.testing.assert_allclose(a[j], b, rtol=0, atol=1e-12)


def test_consistency_reduces_range_error():
    """Hay et al.: consistent leaves answer every range at most as noisily as raw leaves do."""
    forest = Forest(4, 3, 2)
    starts, stops = np.triu_indices(forest.n_leaves + 1, k=1)
    consistent = leaf_interval_variance(starts, stops, fanout=4, levels=3, node_variance=1.0)
    raw = leaf_interval_variance(starts, stops, fanout=4, levels=3, node_variance=1.0, consistent=False)
    assert np.all(consistent <= raw + 1e-12)
    whole = stops - starts == forest.n_leaves
    assert consistent[whole].max() < 0.5 * raw[whole].min()


# --- the noise forest, drawn from its addresses ----------------------------------------------------

def test_leaf_noise_is_the_consistent_forest_of_the_addressed_draws():
    """Node k (counted level by level from the leaves) is the draw at start + k; the leaves of
    the consistent forest are rounded back to integer lattice units."""
    forest = Forest(fanout=4, levels=3, roots=2)
    lap = LaplaceLattice(sensitivity=1.0, epsilon=1.0)
    lane = keys(0).partition().lane(Lane.FOREST, 3)
    for start in (0, 17):
        leaves = forest.consistent_leaf_noise(lap, lane, start)
        draws = lane.discrete_laplace(lap.scale_units, start, forest.n_nodes).astype(np.float64)
        levels = np.split(draws, np.cumsum(forest.level_sizes()[:-1]))
        assert leaves.dtype == np.int64
        np.testing.assert_array_equal(leaves, np.rint(forest.consistent(levels)[0]))


def test_a_forests_noise_is_drawn_in_one_call():
    class Recording:
        def __init__(self, lane):
            self.lane, self.calls = lane, []

        def discrete_laplace(self, scale, start, count):
            self.calls.append((start, count))
            return self.lane.discrete_laplace(scale, start, count)

    forest = Forest(fanout=4, levels=3, roots=2)
    lane = Recording(keys(1).partition().lane(Lane.FOREST))
    forest.consistent_leaf_noise(LaplaceLattice(1.0, 1.0), lane, 5)
    assert lane.calls == [(5, forest.n_nodes)]


def test_forests_of_a_batch_are_each_partitions_forest():
    forest = Forest(fanout=4, levels=3, roots=2)
    batch = LatticeBatch(np.array([10.0, 300.0]), epsilon=1.0)
    partitions = keys(8).partitions([b"a", b"b"])
    got = forest.consistent_leaf_noise(batch, partitions.lane(Lane.FOREST), 0)
    for j, sensitivity in enumerate([10.0, 300.0]):
        alone = forest.consistent_leaf_noise(LaplaceLattice(sensitivity, 1.0), partitions[j].lane(Lane.FOREST), 0)
        np.testing.assert_array_equal(got[j], alone)


# --- closed-form variance --------------------------------------------------------------------------

@pytest.mark.parametrize("forest", FORESTS, ids=str)
def test_inverse_normal_matrix_closed_form(forest):
    a = design_matrix(forest)
    kappa = forest.least_squares_weights()
    closed = sum(k * averaging(forest, level) for level, k in enumerate(kappa))
    np.testing.assert_allclose(closed, np.linalg.inv(a.T @ a), atol=1e-12)


@pytest.mark.parametrize("forest", FORESTS, ids=str)
def test_interval_variance_matches_brute_force(forest):
    inverse = np.linalg.inv(design_matrix(forest).T @ design_matrix(forest))
    starts, stops = np.triu_indices(forest.n_leaves + 1, k=0)
    got = leaf_interval_variance(starts, stops, fanout=forest.fanout, levels=forest.levels, node_variance=2.5)
    for a, b, v in zip(starts, stops, got):
        c = np.zeros(forest.n_leaves)
        c[a:b] = 1.0
        assert v == pytest.approx(2.5 * c @ inverse @ c, abs=1e-10)
    raw = leaf_interval_variance(starts, stops, fanout=forest.fanout, levels=forest.levels, node_variance=2.5,
                                 consistent=False)
    np.testing.assert_allclose(raw, 2.5 * (stops - starts))


def test_interval_variance_statistically():
    """Leaf noise drawn, made consistent and rounded as a chunk's is: the empirical variance of
    interval sums over 40,000 independent trees matches the closed form within 5 % (about 4 SE)."""
    trees = 40_000
    forest = Forest(4, 3, trees)
    lap = LaplaceLattice(sensitivity=1.0, epsilon=1.0 / 3)
    leaves = lap.from_units(forest.consistent_leaf_noise(lap, keys(11).partition().lane(Lane.FOREST), 0))
    leaves = leaves.reshape(trees, 16)
    for a, b in [(0, 1), (3, 9), (0, 16), (5, 6), (1, 15)]:
        expected = leaf_interval_variance(a, b, fanout=4, levels=3, node_variance=lap.variance)
        assert leaves[:, a:b].sum(axis=1).var() == pytest.approx(expected, rel=0.05)
    assert abs(leaves.mean()) < 0.05 * lap.variance**0.5


# --- trees of unequal fan-outs (calendar days, months, years) -----------------------------------------

TREES = [Tree(((31, 28, 31, 30), (4,))), Tree(((3, 1, 4, 2), (2, 2), (2,))), Tree(((1,), (1,))),
         Tree(((7, 7, 7), (1, 2)))]


def tree_design(tree: Tree) -> np.ndarray:
    """Rows: every node, level by level from the leaves (the leaves under it); columns: leaves."""
    rows, members = [np.eye(tree.n_leaves)], np.eye(tree.n_leaves)
    for sizes in tree.groups:
        members = np.stack([part.sum(axis=0) for part in np.split(members, np.cumsum(sizes)[:-1])])
        rows.append(members)
    return np.vstack(rows)


@pytest.mark.parametrize("tree", TREES, ids=str)
def test_unequal_tree_consistency_is_weighted_least_squares(tree):
    """The two-pass estimator gives the weighted least-squares leaves (weights: inverse level
    variances) and consistent parents, one tree or many at once with their own variances."""
    rng = np.random.default_rng(2)
    a = tree_design(tree)
    for variances in ([1.0] * tree.levels, list(rng.uniform(0.1, 9.0, tree.levels))):
        noisy = rng.laplace(size=(3, a.shape[0])) * 5
        weights = np.concatenate([np.full(size, 1 / v) for size, v in zip(tree.level_sizes(), variances)])
        scale = np.array([1.0, 4.0, 0.25])  # a variance per tree (partition): the weights scale alike
        levels = np.split(noisy, np.cumsum(tree.level_sizes())[:-1], axis=1)
        got = tree.consistent(levels, [v * scale for v in variances])
        for j in range(3):
            expected = np.linalg.solve(a.T @ (weights[:, None] * a), a.T @ (weights * noisy[j]))
            np.testing.assert_allclose(got[0][j], expected, atol=1e-9)
            np.testing.assert_allclose(np.concatenate([level[j] for level in got]), a @ expected, atol=1e-9)


def test_an_unequal_tree_with_equal_fanouts_and_variances_is_hays_forest():
    forest, tree = Forest(4, 3, 1), Tree(((4, 4, 4, 4), (4,)))
    rng = np.random.default_rng(3)
    nodes = [rng.normal(size=s) for s in forest.level_sizes()]
    for got, hay in zip(tree.consistent(nodes, [2.0] * 3), forest.consistent(nodes)):
        np.testing.assert_allclose(got, hay, atol=1e-12)


@pytest.mark.parametrize("tree", TREES, ids=str)
def test_unequal_tree_leaf_covariance_is_the_inverse_normal_matrix(tree):
    a = tree_design(tree)
    variances = np.linspace(1.0, 3.0, tree.levels)
    weights = np.concatenate([np.full(size, 1 / v) for size, v in zip(tree.level_sizes(), variances)])
    np.testing.assert_allclose(tree.leaf_covariance(variances), np.linalg.inv(a.T @ (weights[:, None] * a)),
                               atol=1e-12)
    np.testing.assert_allclose(tree.leaf_covariance(variances, consistent=False), np.eye(tree.n_leaves))


def test_unequal_tree_noise_statistically():
    """Node noise drawn level by level at each level's budget, made consistent and rounded to the
    lattice as a chunk's is: the empirical covariance of 20,000 trees' leaves (one partition each)
    matches the leaf covariance within 6 % (about 4 SE), and a batch draws each partition's own tree."""
    tree, partitions = Tree(((3, 5, 2), (3,))), 20_000
    draws = keys(12).partitions([i.to_bytes(4, "big") for i in range(partitions)]).lane(Lane.FOREST)
    lattices = [LatticeBatch(np.full(partitions, 1.0), epsilon) for epsilon in (0.6, 0.3, 0.1)]
    leaves = lattices[0].from_units(tree.consistent_leaf_noise(lattices, draws, 0))
    covariance = tree.leaf_covariance([lattice.variance[0] for lattice in lattices])
    for c in (np.eye(10)[0], np.eye(10)[4], np.r_[np.ones(3), np.zeros(7)], np.r_[0, 0, 1, 1, 1, 1, 0, 0, 0, 0],
              np.ones(10)):
        assert (leaves @ c).var() == pytest.approx(c @ covariance @ c, rel=0.06)
    one = keys(12).partitions([(7).to_bytes(4, "big")]).lane(Lane.FOREST)
    alone = tree.consistent_leaf_noise([LatticeBatch(np.ones(1), e) for e in (0.6, 0.3, 0.1)], one, 0)
    np.testing.assert_array_equal(alone[0], tree.consistent_leaf_noise(lattices, draws, 0)[7])
