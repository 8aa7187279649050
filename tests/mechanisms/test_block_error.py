"""The error model of a block release (:class:`BlockStreamNoise`): exact range-sum variances
against the covariance of the block noise pushed through the smoother's linear map, and the
bias bound of a range that cuts a block (the flattening bound), by hand."""

import json

import numpy as np
import pytest
from oracles import design_matrix, reference_outputs

from dpsql.error_models import ErrorModel, SegmentedNoise
from dpsql.mechanisms.block_error import BlockStreamNoise, CalendarBlockNoise
from dpsql.mechanisms.hierarchy import Forest, leaf_interval_variance
from dpsql.streams.hierarchy import HierarchyStream
from dpsql.testing import draws

LINEAR = ["recent", "mean", "moving", "exponential", "none"]




def leaf_covariance(forest: Forest, node_variance: float, consistent: bool = True) -> np.ndarray:
    """Covariance of a forest's (consistent) leaf noise: the least-squares estimate's."""
    if not consistent:
        return node_variance * np.eye(forest.n_leaves)
    a = design_matrix(forest)
    return node_variance * np.linalg.inv(a.T @ a)






def ranges(n, count, seed):
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, n, count)
    stops = rng.integers(0, n + 1, count)
    return np.minimum(starts, stops), np.maximum(starts, stops)


def fed(machine, n):
    machine.feed(np.zeros(n))
    machine.close()
    return machine


@pytest.mark.parametrize("name", LINEAR)
@pytest.mark.parametrize("consistency", [True, False])
@pytest.mark.parametrize("evaluation", ["pairwise", "step"])
@pytest.mark.parametrize("n", [1000, 1002])
def test_range_variance_is_exact_for_linear_smoothers(name, consistency, evaluation, n, monkeypatch):
    """The outputs are a linear map M of the block sums: Var(range) = c^T M Sigma M^T c, exactly,
    by either evaluation of the error model, over fixed chunks of 200 rows (a predictive
    smoother's noise crosses chunk ends), with a short last block (n = 1002)."""
    monkeypatch.setattr(BlockStreamNoise, "_PAIRWISE_TERMS", 10**6 if evaluation == "pairwise" else 0)
    g = 4
    machine = fed(HierarchyStream(n, epsilon=1.0, upper=1.0, r=200, fanout=4, depth=1, smoother=name, window=3,
                                  alpha=0.6, consistency=consistency, noise=draws(9)), n)
    model = machine.describe()["error"]
    assert isinstance(model, BlockStreamNoise)
    chunk = machine.layout.chunk(0)
    assert (chunk.rows, chunk.block, chunk.forest) == (200, g, Forest(4, 3, 4))
    variance = float(machine._lattices(chunk)[0].variance[0])
    released = -(-n // g) if name == "none" else n // g
    linear = np.stack([reference_outputs(name, np.eye(released)[k], g, n) for k in range(released)], axis=1)
    sigma = np.zeros((released, released))
    chunk_cov = leaf_covariance(chunk.forest, variance, consistency)
    for start in range(0, released, chunk.blocks):
        size = min(chunk.blocks, released - start)
        sigma[start:start + size, start:start + size] = chunk_cov[:size, :size]
    starts, stops = ranges(n, 250, 10)
    starts = np.r_[0, 0, 199, 200, 3, n - 3, starts]
    stops = np.r_[n, 1, 201, 400, 3, n, stops]
    got = model.range_variance(starts, stops)
    for a, b, v in zip(starts, stops, got):
        c = linear[a:b].sum(axis=0)
        assert v == pytest.approx(c @ sigma @ c, rel=1e-9, abs=1e-9)


def test_range_variance_is_exact_over_geometric_chunks():
    """The flat spread over geometric chunks (here blocks of 64 rows): each chunk its own
    forest, with its own number of levels and so its own node variance; independent chunks."""
    n, g = 4096 + 700, 64
    machine = fed(HierarchyStream(n, epsilon=1.0, upper=1.0, block=g, noise=draws(3)), n)
    first, second = machine.layout.chunk(0), machine.layout.chunk(1)
    assert (first.blocks, first.forest.levels, second.blocks, second.forest.levels) == (64, 2, 1024, 3)
    model = machine.describe()["error"]
    assert isinstance(model, SegmentedNoise)
    released = -(-n // g)  # 75 blocks, the last one 60 rows (flushed at close)
    sigma = np.zeros((released, released))
    sigma[:64, :64] = leaf_covariance(first.forest, float(machine._lattices(first)[0].variance[0]))
    sigma[64:, 64:] = leaf_covariance(second.forest, float(machine._lattices(second)[0].variance[0]))[:11, :11]
    linear = np.stack([reference_outputs("none", np.eye(released)[k], g, n) for k in range(released)], axis=1)
    starts, stops = ranges(n, 200, 4)
    starts, stops = np.r_[0, 4000, 4095, 4096, 32, starts], np.r_[n, 4200, 4097, n, 4160, stops]
    for a, b, v in zip(starts, stops, model.range_variance(starts, stops)):
        c = linear[a:b].sum(axis=0)
        assert v == pytest.approx(c @ sigma @ c, rel=1e-9, abs=1e-12)


def test_median_error_model_uses_released_positions():
    """Given the positions of the medians, the median smoother is linear in the block sums."""
    n, g = 640, 16
    machine = HierarchyStream(n, epsilon=1.0, upper=1.0, r=n, fanout=4, depth=2, smoother="median", noise=draws(12))
    out = np.concatenate([machine.feed(np.zeros(n)), machine.close()])
    sums = out.reshape(-1, g).sum(axis=1)
    positions = np.asarray(machine._smoother._positions[0])
    np.testing.assert_allclose((sums[positions[:, 0]] + sums[positions[:, 1]]) / 2,
                               [np.median(sums[:t]) for t in range(1, len(sums) + 1)])
    model = machine.describe()["error"]
    chunk = machine.layout.chunk(0)
    sigma = leaf_covariance(chunk.forest, float(machine._lattices(chunk)[0].variance[0]))[:40, :40]
    # rows 0..39: blocks 0 and 1, and 8 rows of block 2, whose prediction is median(u_0, u_1) / g
    c = np.zeros(len(sums))
    c[:2] = 1.0 + 8 / g * 0.5
    assert model.range_variance(np.array([0]), np.array([40]))[0] == pytest.approx(c @ sigma @ c)


def model(n_rows=1000, block=100, chunk_blocks=5, smoother="none", bound=2.0, short_last_block=False):
    return BlockStreamNoise(n_rows=n_rows, block=block, chunk_blocks=chunk_blocks, fanout=4, levels=2,
                            node_variance=1.0, consistent=True, smoother={"name": smoother, "block": block},
                            bound=bound, short_last_block=short_last_block)


def test_block_stream_noise_counts_chunks_independently():
    noise = BlockStreamNoise(n_rows=64, block=1, chunk_blocks=16, fanout=4, levels=2, node_variance=1.0,
                             consistent=True, smoother={"name": "none", "block": 1}, bound=1.0)
    one_chunk = leaf_interval_variance(0, 16, fanout=4, levels=2, node_variance=1.0)
    assert noise.range_variance(np.array([0]), np.array([64]))[0] == pytest.approx(4 * one_chunk)
    assert noise.range_variance(np.array([8]), np.array([24]))[0] == pytest.approx(
        2 * leaf_interval_variance(0, 8, fanout=4, levels=2, node_variance=1.0))


def test_block_stream_error_model_is_built_on_first_query():
    noise = BlockStreamNoise(n_rows=1000, block=4, chunk_blocks=16, fanout=4, levels=2, node_variance=1.5,
                             consistent=True, smoother={"name": "none", "block": 4}, bound=1.0)
    assert "_chunks_before" not in vars(noise)
    # 100 blocks from a chunk boundary: chunks 0..5 whole and 4 blocks of the 7th
    expected = 6 * leaf_interval_variance(0, 16, fanout=4, levels=2, node_variance=1.5) + leaf_interval_variance(
        0, 4, fanout=4, levels=2, node_variance=1.5)
    assert noise._block_interval_variance(np.array([0]), np.array([100]))[0] == pytest.approx(expected, rel=1e-12)
    assert "_chunks_before" in vars(noise)


# --- the bias bound ----------------------------------------------------------------------------------

def test_flat_bias_bound_by_hand():
    """Spread evenly: a run of k rows of a block of len rows is off by at most k (len - k) / len * bound;
    a range cutting two blocks adds its two runs' bounds."""
    flat = model()
    starts, stops = np.array([30, 100, 0, 10, 250, 30, 0]), np.array([270, 300, 1000, 20, 251, 30, 50])
    expected = [70 * 30 / 100 * 2 + 70 * 30 / 100 * 2, 0.0, 0.0, 10 * 90 / 100 * 2, 1 * 99 / 100 * 2, 0.0,
                50 * 50 / 100 * 2]
    np.testing.assert_allclose(flat.range_bias_bound(starts, stops), expected)
    assert flat.range_bias_bound(np.array([10]), np.array([20]))[0] == 18.0  # not 10 rows * 2, nor two cuts
    # chunk boundaries (every 500 rows here) are block boundaries
    assert flat.range_bias_bound(np.array([500]), np.array([1000]))[0] == 0.0


def test_flat_spreading_bound_covers_and_is_reached():
    """Noise aside, a flat spread's range sums are off by at most the bound, and values with every cut
    block's mass outside the range reach it (the bound is exact, not loose)."""
    rng = np.random.default_rng(5)
    g, bound, n = 10, 2.0, 60
    flat = model(n_rows=n, block=g, chunk_blocks=6, bound=bound)
    starts = rng.integers(0, n, 400)
    stops = np.minimum(starts + rng.integers(0, 25, 400), n)
    limits = flat.range_bias_bound(starts, stops)

    def error(values):
        spread = np.repeat(values.reshape(-1, g).mean(axis=1), g)
        truth, released = np.r_[0, np.cumsum(values)], np.r_[0, np.cumsum(spread)]
        return np.abs((released[stops] - released[starts]) - (truth[stops] - truth[starts]))

    for trial in range(200):
        values = rng.choice([0.0, bound], n) if trial % 2 else rng.uniform(0, bound, n)
        assert np.all(error(values) <= limits + 1e-9)
    for k, (a, b) in enumerate(zip(starts, stops)):
        outside = np.where((np.arange(n) >= a) & (np.arange(n) < b), 0.0, bound)
        assert error(outside)[k] == pytest.approx(limits[k], abs=1e-9)


def test_flat_bias_bound_of_a_short_last_block():
    flat = model(n_rows=1050, short_last_block=True)  # the last block has 50 rows
    assert flat.range_bias_bound(np.array([0]), np.array([1030]))[0] == pytest.approx(30 * 20 / 50 * 2)
    assert flat.range_bias_bound(np.array([1000]), np.array([1050]))[0] == 0.0
    # a range ending inside the last block of a continual stream (not flushed: the block is not released)
    assert model(n_rows=1000).range_bias_bound(np.array([0]), np.array([980]))[0] == pytest.approx(80 * 20 / 100 * 2)


@pytest.mark.parametrize("smoother", ["recent", "mean", "median", "moving", "exponential"])
def test_predictive_bias_bound_by_hand(smoother):
    """Predicted: the a rows before a cut get a times a prediction in [0, bound]: at most a * bound."""
    noise = model(smoother=smoother)
    starts, stops = np.array([30, 100, 10, 0, 199]), np.array([270, 300, 20, 1000, 201])
    np.testing.assert_allclose(noise.range_bias_bound(starts, stops),
                               [(30 + 70) * 2.0, 0.0, (10 + 20) * 2.0, 0.0, (99 + 1) * 2.0])


def test_segmented_noise_adds_the_pieces():
    holdout, stream = model(n_rows=400, chunk_blocks=4), model(smoother="recent")
    segmented = SegmentedNoise([0, 400, 1 << 62], [holdout, stream])
    starts, stops = np.array([350, 0, 420, 10]), np.array([450, 400, 430, 20])
    pieces = [(holdout, [350, 0, None, 10], [400, 400, None, 20]), (stream, [0, 0, 20, None], [50, 0, 30, None])]
    for measure in ("range_variance", "range_bias_bound"):
        expected = np.zeros(4)
        for piece, lo, hi in pieces:
            for q in range(4):
                if lo[q] is not None and hi[q] > lo[q]:
                    expected[q] += getattr(piece, measure)(np.array([lo[q]]), np.array([hi[q]]))[0]
        np.testing.assert_allclose(getattr(segmented, measure)(starts, stops), expected)
    assert segmented.range_bias_bound(np.array([350]), np.array([450]))[0] == pytest.approx(
        50 * 50 / 100 * 2 + 50 * 2.0)


# --- calendar blocks ---------------------------------------------------------------------------------

def calendar_model(n_rows=24 * 10 + 15, short_last_block=False):
    return CalendarBlockNoise(n_rows=n_rows, grid={"first": "2024-03-01T09:00", "step": "1h"},
                              level_variances=[2.0, 8.0, 50.0], consistent=True, bound=3.0,
                              short_last_block=short_last_block)


def test_calendar_spreading_bound_by_hand():
    """Days are blocks (the first one 15 rows, from 9 am): whole days carry no spreading; cuts
    carry their runs' bounds; a flushed last day of 7 rows is a block of 7."""
    model = calendar_model()
    starts, stops = np.array([0, 15, 15, 20, 20, 39]), np.array([15, 39, 255, 30, 50, 46])
    # rows 15..38 are the second day: 20..30 is a run of 10 of its 24 rows; 20..50 cuts it (19 rows
    # after the cut) and the third day (11 rows before the cut)
    expected = [0.0, 0.0, 0.0, 10 * 14 / 24 * 3.0, 19 * 5 / 24 * 3.0 + 11 * 13 / 24 * 3.0, 7 * 17 / 24 * 3.0]
    np.testing.assert_allclose(model.range_bias_bound(starts, stops), expected)
    flushed = calendar_model(n_rows=24 * 10 + 15 + 7, short_last_block=True)
    assert flushed.range_bias_bound(np.array([255]), np.array([262]))[0] == 0.0
    assert flushed.range_bias_bound(np.array([258]), np.array([262]))[0] == pytest.approx(3 * 4 / 7 * 3.0)


def test_calendar_error_model_survives_a_ledger_record():
    model = calendar_model(n_rows=24 * 400)
    again = ErrorModel.from_state(json.loads(json.dumps(model.to_state())))
    starts, stops = np.array([0, 15, 100, 3000]), np.array([24 * 400, 39, 2000, 9000])
    np.testing.assert_array_equal(again.range_variance(starts, stops), model.range_variance(starts, stops))
    np.testing.assert_array_equal(again.range_bias_bound(starts, stops), model.range_bias_bound(starts, stops))
