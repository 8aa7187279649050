"""Forest, Hay consistency (P6), the range-sum error model, block smoothers (P7) and the
``hierarchy`` machine."""

import numpy as np
import pytest

import dpsql
from dpsql import streams
from dpsql.mechanisms import LaplaceLattice
from dpsql.mechanisms.hierarchy import BlockStreamNoise, Forest, leaf_interval_variance, smoothing_depth, tree_height
from dpsql.mechanisms.smoothers import SMOOTHERS, make_smoother
from dpsql.noise import NoiseSource, SeededNoise
from dpsql.streams.tops import HierarchyStream

FORESTS = [Forest(2, 4, 1), Forest(4, 3, 1), Forest(16, 2, 1), Forest(4, 3, 3)]


class ZeroNoise(NoiseSource):
    """Deterministic test source: every discrete Laplace draw is 0."""

    def discrete_laplace(self, scale, size):
        return np.zeros(size, dtype=np.int64)


def design_matrix(forest: Forest) -> np.ndarray:
    """Rows: every node, level by level; columns: leaves."""
    rows = []
    for level in range(forest.levels):
        size = forest.fanout**level
        for node in range(forest.n_leaves // size):
            row = np.zeros(forest.n_leaves)
            row[node * size:(node + 1) * size] = 1.0
            rows.append(row)
    return np.array(rows)


def averaging(forest: Forest, level: int) -> np.ndarray:
    size = forest.fanout**level
    blocks = np.arange(forest.n_leaves) // size
    return (blocks[:, None] == blocks[None, :]) / size


# --- consistency ---------------------------------------------------------------------------

@pytest.mark.parametrize("forest", FORESTS, ids=str)
def test_consistency_equals_least_squares(forest):
    rng = np.random.default_rng(0)
    a = design_matrix(forest)
    noisy = rng.normal(size=a.shape[0]) * 10
    sizes = forest.level_sizes()
    levels = np.split(noisy, np.cumsum(sizes)[:-1])
    leaves = forest.consistent(levels)[0]
    least_squares = np.linalg.lstsq(a, noisy, rcond=None)[0]
    np.testing.assert_allclose(leaves, least_squares, atol=1e-10)


@pytest.mark.parametrize("forest", FORESTS, ids=str)
def test_consistent_parents_equal_sum_of_children(forest):
    rng = np.random.default_rng(1)
    levels = [rng.laplace(size=s) for s in forest.level_sizes()]
    out = forest.consistent(levels)
    for level in range(1, forest.levels):
        np.testing.assert_allclose(out[level], out[level - 1].reshape(-1, forest.fanout).sum(axis=1), atol=1e-9)


@pytest.mark.parametrize("forest", FORESTS, ids=str)
def test_online_consistency_equals_offline(forest):
    """Theorem C.1: consistent(T + N) == T + consistent(N) for a true (consistent) forest T."""
    rng = np.random.default_rng(2)
    true = forest.aggregate(rng.integers(0, 100, forest.n_leaves).astype(float))
    noise = [rng.laplace(size=s) for s in forest.level_sizes()]
    offline = forest.consistent([t + n for t, n in zip(true, noise)])[0]
    online = true[0] + forest.consistent(noise)[0]
    np.testing.assert_allclose(online, offline, atol=1e-9)


def test_machine_block_sums_equal_offline_consistency_of_the_noisy_forest():
    """The machine's released block sums (lattice units) are Hay's estimate applied offline to
    the true forest plus the same node noise, rounded: online consistency end to end."""
    n, g = 1000, 4
    values = np.random.default_rng(3).uniform(0, 2, n)
    machine = HierarchyStream(n, epsilon=1.0, upper=2.0, r=n, fanout=4, depth=1, smoother="none",
                              noise=SeededNoise(21))
    out = np.concatenate([machine.feed(values), machine.close()])
    lap = LaplaceLattice(2.0, 1.0 / machine.levels)
    released = np.rint(out.reshape(-1, g).sum(axis=1) / lap.granularity)
    forest = Forest.covering(n // g, 4, machine.levels)
    assert forest.roots == 4 and forest.n_leaves == 256  # 250 real leaves, 6 padding leaves
    source = SeededNoise(21)
    noise = [lap.noise_units(source, size).astype(float) for size in forest.level_sizes()]
    true = forest.aggregate(lap.to_units(values).reshape(-1, g).sum(axis=1))
    offline = forest.consistent([t + z for t, z in zip(true, noise)])[0][:250]
    np.testing.assert_allclose(released, np.rint(offline), atol=0)


def test_consistency_reduces_range_error():
    """Hay et al.: consistent leaves answer every range at most as noisily as raw leaves do."""
    forest = Forest(4, 3, 2)
    starts, stops = np.triu_indices(forest.n_leaves + 1, k=1)
    consistent = leaf_interval_variance(starts, stops, fanout=4, levels=3, node_variance=1.0)
    raw = leaf_interval_variance(starts, stops, fanout=4, levels=3, node_variance=1.0, consistent=False)
    assert np.all(consistent <= raw + 1e-12)
    assert consistent[stops - starts == forest.n_leaves].max() < 0.5 * raw[stops - starts == forest.n_leaves].min()


# --- closed-form variance -------------------------------------------------------------------

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


def test_interval_variance_statistically():
    """Leaf noise drawn, made consistent and rounded as a chunk is: empirical variance of
    interval sums over 40,000 independent trees matches the closed form within 5 % (about 4 SE)."""
    forest = Forest(4, 3, 40_000)
    lap = LaplaceLattice(sensitivity=1.0, epsilon=1.0 / 3)
    leaves = forest.consistent_leaf_noise(lap, SeededNoise(11), forest.n_leaves).reshape(40_000, 16)
    leaves = lap.from_units(leaves)
    for a, b in [(0, 1), (3, 9), (0, 16), (5, 6), (1, 15)]:
        expected = leaf_interval_variance(a, b, fanout=4, levels=3, node_variance=lap.variance)
        empirical = leaves[:, a:b].sum(axis=1).var()
        assert empirical == pytest.approx(expected, rel=0.05)
    assert abs(leaves.mean()) < 0.05 * lap.variance**0.5


def test_raw_node_variance():
    """Without smoothing and consistency every block carries Lap(theta L / eps): Var = 2 (theta L / eps)^2."""
    with dpsql.testing.seeded(3):
        rels = [dpsql.hierarchy(np.zeros(4096), epsilon=1.0, upper=2.0, r=4096, fanout=4, depth=1,
                                consistency=False, smoother="none") for _ in range(25)]
    blocks = np.concatenate([r.values.reshape(-1, 4).sum(axis=1) for r in rels])
    theta, levels = 2.0, rels[0].params["levels"]
    assert levels == 5
    assert blocks.var() == pytest.approx(2 * (theta * levels / 1.0) ** 2, rel=0.05)
    assert rels[0].range_variance(0, 8) == pytest.approx(2 * LaplaceLattice(2.0, 1.0 / 5).variance)


# --- depth ------------------------------------------------------------------------------------

def test_smoothing_depth_oracle():
    assert [smoothing_depth(e, 2**20, 16) for e in (0.01, 0.02, 0.05, 0.1)] == [3, 3, 2, 2]
    assert tree_height(2**20, 16) == 5 and tree_height(2**20, 2) == 20 and tree_height(1000, 16) == 3


def test_depth_and_forest_shape_of_the_machine():
    machine = HierarchyStream(2**20, epsilon=0.05, upper=1.0, noise=SeededNoise(0))
    assert (machine.depth, machine.block, machine.levels, machine.chunk_rows) == (2, 256, 3, 2**20)
    # a chunk's forest covers whole top nodes: 4096 leaves of 256 values -> 16 roots of 256 leaves
    assert Forest.covering(4096, 16, 3) == Forest(16, 3, 16)
    assert Forest.covering(4097, 16, 3).roots == 17


# --- smoothers ----------------------------------------------------------------------------------

def reference_predictions(name, sums, g, initial, window=3, alpha=0.6):
    """P7 literally: per-value prediction of every block t = 0..T from u_0..u_{t-1}."""
    preds = [initial / g]
    level = None
    for t in range(1, len(sums) + 1):
        past = sums[:t]
        if name == "recent":
            preds.append(past[-1] / g)
        elif name == "mean":
            preds.append(np.mean(past) / g)
        elif name == "median":
            preds.append(np.median(past) / g)
        elif name == "moving":
            preds.append(np.mean(past[-window:]) / g)
        else:
            level = past[-1] if level is None else alpha * past[-1] + (1 - alpha) * level
            preds.append(level / g)
    return np.array(preds)


@pytest.mark.parametrize("name", ["recent", "mean", "median", "moving", "exponential"])
def test_smoother_predictions_match_reference(name):
    rng = np.random.default_rng(4)
    sums = rng.normal(50, 20, 301)
    smoother = make_smoother(name, block=16, initial_sum=80.0, window=3, alpha=0.6)
    got = np.concatenate([[smoother.first_prediction]] + [smoother.predict(piece)
                                                          for piece in np.split(sums, [1, 2, 50, 51, 200])])
    np.testing.assert_allclose(got, reference_predictions(name, sums, 16, 80.0), rtol=1e-12, atol=1e-12)


def test_exponential_filter_is_stable_over_long_runs():
    smoother = make_smoother("exponential", block=1, initial_sum=0.0, window=1, alpha=0.001)
    sums = np.full(200_000, 7.0)
    assert np.allclose(smoother.predict(sums), 7.0, rtol=1e-12)


def reference_outputs(name, sums, g, n, initial, window=3, alpha=0.6):
    """Per-row outputs of a stream of n rows in blocks of g with released block sums ``sums``."""
    out = np.empty(n)
    preds = reference_predictions(name, sums, g, initial, window, alpha) if name != "none" else None
    for t, u in enumerate(sums):
        lo, hi = t * g, min(n, (t + 1) * g)
        if name == "none":
            out[lo:hi] = u / (hi - lo)
        else:
            out[lo:hi - 1] = preds[t]
            out[hi - 1] = u - (hi - lo - 1) * preds[t]
    return out


@pytest.mark.parametrize("name", SMOOTHERS)
@pytest.mark.parametrize("feed", [4096, 333])
def test_machine_output_is_the_smoothed_block_sums(name, feed):
    """Block sums of the output equal the released u_t, and every row is P7 applied to them."""
    n, r = 3001, 700
    machine = HierarchyStream(n, epsilon=0.5, upper=10.0, r=r, fanout=4, depth=2, smoother=name, window=3,
                              alpha=0.6, noise=SeededNoise(5))
    values = np.random.default_rng(6).uniform(-2, 12, n)
    pieces = [machine.feed(values[i:i + feed]) for i in range(0, n, feed)]
    if SMOOTHERS.index(name) < 5:  # predictive smoothers emit every row as it arrives
        assert [len(p) for p in pieces] == [len(values[i:i + feed]) for i in range(0, n, feed)]
    out = np.concatenate([*pieces, machine.close()])
    g = 16
    sums = np.add.reduceat(out, np.arange(0, n, g))
    np.testing.assert_allclose(out, reference_outputs(name, sums, g, n, g * 10.0 / 2), atol=1e-9)
    gamma = LaplaceLattice(10.0, 0.5 / machine.levels).granularity
    assert np.allclose(np.round(sums / gamma) * gamma, sums, rtol=0, atol=1e-9)  # on the lattice


def test_recent_smoother_oracles_with_zero_noise():
    g, n = 16, 4 * 16 + 5
    out = streams.run("hierarchy", np.full(n, 3.0), noise=ZeroNoise(), epsilon=1.0, upper=10.0, r=256,
                      fanout=4, depth=2).values
    assert np.all(out[:g - 1] == 5.0)  # first block: theta / 2 per value
    assert out[:g].sum() == 3.0 * g  # block sums are u_t exactly
    assert np.all(out[g:] == 3.0)  # constant stream, zero noise: exact from block 2 on


def test_feeding_in_any_chunks_gives_the_same_release():
    values = np.random.default_rng(7).exponential(3, 10_000)
    a = streams.run("hierarchy", values, noise=SeededNoise(8), epsilon=0.3, upper=20.0, r=3000, chunk=10_000)
    b = streams.run("hierarchy", values, noise=SeededNoise(8), epsilon=0.3, upper=20.0, r=3000, chunk=777)
    np.testing.assert_array_equal(a.values, b.values)


def test_lower_bound_shifts_and_clips():
    out = streams.run("hierarchy", np.array([-50.0] * 64 + [500.0] * 64), noise=ZeroNoise(), epsilon=1.0,
                      lower=100.0, upper=110.0, r=64, fanout=4, depth=1).values
    assert out[:3].tolist() == [105.0] * 3  # first block: midpoint of the public bounds
    assert out[4:64].tolist() == [100.0] * 60 and out[68:].tolist() == [110.0] * 60


# --- range error model --------------------------------------------------------------------------

def block_covariance(n_blocks, chunk_blocks, fanout, levels, node_variance):
    """Covariance of the consistent noise of all block sums, brute force per chunk."""
    cov = np.zeros((n_blocks, n_blocks))
    for start in range(0, n_blocks, chunk_blocks):
        leaves = min(chunk_blocks, n_blocks - start)
        forest = Forest.covering(leaves, fanout, levels)
        a = design_matrix(forest)
        inverse = node_variance * np.linalg.inv(a.T @ a)
        cov[start:start + leaves, start:start + leaves] = inverse[:leaves, :leaves]
    return cov


@pytest.mark.parametrize("name", ["recent", "mean", "moving", "exponential", "none"])
@pytest.mark.parametrize("consistency", [True, False])
@pytest.mark.parametrize("evaluation", ["pairwise", "step"])
def test_range_variance_is_exact_for_linear_smoothers(name, consistency, evaluation, monkeypatch):
    """The outputs are a linear map M of the block sums: Var(range) = c^T M Sigma M^T c exactly,
    by either evaluation of the error model."""
    monkeypatch.setattr(BlockStreamNoise, "_PAIRWISE_TERMS", 10**6 if evaluation == "pairwise" else 0)
    n, r, g = 1000, 200, 4
    machine = HierarchyStream(n, epsilon=1.0, upper=1.0, r=r, fanout=4, depth=1, smoother=name, window=3,
                              alpha=0.6, consistency=consistency, noise=SeededNoise(9))
    machine.feed(np.zeros(n))
    machine.close()
    model = machine.describe()["error"]
    n_blocks = -(-n // g)
    linear = np.stack([reference_outputs(name, np.eye(n_blocks)[k], g, n, 0.0) for k in range(n_blocks)], axis=1)
    if consistency:
        sigma = block_covariance(n_blocks, machine.chunk_blocks, 4, machine.levels, machine._lap.variance)
    else:
        sigma = machine._lap.variance * np.eye(n_blocks)
    rng = np.random.default_rng(10)
    starts = np.r_[0, 0, 199, 200, 3, rng.integers(0, n, 300)]
    stops = np.r_[n, 1, 201, 400, 3, rng.integers(0, n + 1, 300)]
    starts, stops = np.minimum(starts, stops), np.maximum(starts, stops)
    got = model.range_variance(starts, stops)
    for a, b, v in zip(starts, stops, got):
        c = linear[a:b].sum(axis=0)
        assert v == pytest.approx(c @ sigma @ c, rel=1e-9, abs=1e-9)


def test_median_error_model_uses_released_positions():
    """Given the positions of the medians, the median smoother is linear in the block sums."""
    n, g = 640, 16
    machine = HierarchyStream(n, epsilon=1.0, upper=1.0, r=n, fanout=4, depth=2, smoother="median",
                              noise=SeededNoise(12))
    out = np.concatenate([machine.feed(np.zeros(n)), machine.close()])
    sums = out.reshape(-1, g).sum(axis=1)
    positions = np.asarray(machine._smoother._positions[0])
    np.testing.assert_allclose((sums[positions[:, 0]] + sums[positions[:, 1]]) / 2,
                               [np.median(sums[:t]) for t in range(1, len(sums) + 1)])
    model = machine.describe()["error"]
    sigma = block_covariance(len(sums), machine.chunk_blocks, 4, machine.levels, machine._lap.variance)
    # rows 0..47: three blocks; row 40 is offset 8 of block 2, whose prediction is median(u_0, u_1)
    c = np.zeros(len(sums))
    c[:2] = 1.0 + 8 / g * 0.5
    assert model.range_variance(np.array([0]), np.array([40]))[0] == pytest.approx(c @ sigma @ c)


def test_range_variance_and_coverage_statistically():
    """End to end: 400 seeded releases; empirical variance of range sums matches the model
    and the 95 % intervals cover the truth about 95 % of the time."""
    values = np.random.default_rng(13).uniform(0, 4, 3000)
    ranges = (np.array([0, 100, 1500, 7, 2990]), np.array([3000, 1100, 1600, 9, 3000]))
    truth = np.array([values[a:b].sum() for a, b in zip(*ranges)])
    sums, covered = [], []
    for seed in range(400):
        rel = streams.run("hierarchy", values, noise=SeededNoise(100 + seed), epsilon=1.0, upper=4.0, r=1024,
                          fanout=4, smoother="recent")
        sums.append(rel.range_sum(*ranges))
        low, high = rel.range_ci(*ranges)
        covered.append((low <= truth) & (truth <= high))
    model = rel.range_variance(*ranges)
    sums = np.array(sums)
    # whole-block-aligned ranges are unbiased: check variance around the truth
    for k in (0, 1):
        assert ((sums[:, k] - truth[k]) ** 2).mean() == pytest.approx(model[k], rel=0.2)
        assert abs(sums[:, k].mean() - truth[k]) < 4 * (model[k] / 400) ** 0.5
    assert sums[:, 2].var() == pytest.approx(model[2], rel=0.2)
    assert np.mean(np.array(covered)[:, :2]) >= 0.93


def test_block_stream_noise_counts_chunks_independently():
    model = BlockStreamNoise(n_rows=64, block=1, chunk_blocks=16, fanout=4, levels=2, node_variance=1.0,
                             consistent=True, prefix_terms=make_smoother("none", block=1, initial_sum=0.0, window=1,
                                                                         alpha=0.5).prefix_terms)
    one_chunk = leaf_interval_variance(0, 16, fanout=4, levels=2, node_variance=1.0)
    assert model.range_variance(np.array([0]), np.array([64]))[0] == pytest.approx(4 * one_chunk)
    assert model.range_variance(np.array([8]), np.array([24]))[0] == pytest.approx(
        2 * leaf_interval_variance(0, 8, fanout=4, levels=2, node_variance=1.0))


# --- public wrapper and bad input ------------------------------------------------------------------

def test_hierarchy_wrapper_charges_once_and_records_parameters():
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    with dpsql.testing.seeded(14):
        rel = dpsql.hierarchy(np.ones(5000), epsilon=0.4, upper=2.0, smoother="moving", window=5, budget=budget)
    assert budget.spent == (0.4, 0.0)
    assert rel.method == "hierarchy" and rel.params["window"] == 5 and rel.params["r"] == 5000
    assert rel.components == {"hierarchy": (0.4, 0.0)}


@pytest.mark.parametrize("params, word", [
    (dict(epsilon=0.0), "epsilon"), (dict(epsilon=float("nan")), "epsilon"), (dict(epsilon=-1.0), "epsilon"),
    (dict(smoother="kalman"), "smoother"), (dict(fanout=1), "fanout"), (dict(r=0), "r"),
    (dict(alpha=0.0005), "alpha"), (dict(alpha=1.5), "alpha"), (dict(window=0), "window"),
    (dict(depth=5), "depth"), (dict(consistency="yes"), "consistency"), (dict(delta=1e-6), "delta"),
    (dict(upper=0.0), "upper"),
])
def test_bad_parameters_are_refused_before_charging(params, word):
    budget = dpsql.Budget.in_memory(epsilon=10.0)
    kwargs = {"epsilon": 1.0, "upper": 1.0, "r": 1000, **params}
    with pytest.raises(dpsql.InvalidParameter, match=word):
        dpsql.publish("hierarchy", np.ones(1000), budget=budget, **kwargs)
    assert budget.spent == (0.0, 0.0)


@pytest.mark.parametrize("data, word", [
    (np.array([1.0, np.nan]), "NaN"), (np.array([1.0, np.inf]), "infinite"), ([1.0, None], "null"),
    (np.array([]), "empty"), (np.ones((2, 2)), "1-D"),
])
def test_bad_data_is_refused_before_charging(data, word):
    budget = dpsql.Budget.in_memory(epsilon=10.0)
    with pytest.raises(dpsql.InvalidData, match=word):
        dpsql.hierarchy(data, epsilon=1.0, upper=1.0, budget=budget)
    assert budget.spent == (0.0, 0.0)
