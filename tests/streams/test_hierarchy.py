"""The ``hierarchy`` machine: the flat spread over geometric chunks (rows = noisy block sum /
block length, released when the block completes), the predictive smoothers over the paper's
fixed layout, online behaviour (chunking, partitions, snapshots), the error model against
Monte Carlo, the ledger and bad input."""

import json

import numpy as np
import pytest
from oracles import reference_outputs

import dpsql
from dpsql.accounting import largest_share
from dpsql.addresses import partition_address
from dpsql.mechanisms import LaplaceLattice
from dpsql.mechanisms.hierarchy import Layout, flat_block, predictive_depth
from dpsql.noise import Lane
from dpsql.release import run_machine
from dpsql.streams.hierarchy import MAX_BLOCK, PAPER_RANGE, HierarchyStream
from dpsql.testing import draws, seeded

PREDICTIVE = ["recent", "mean", "median", "moving", "exponential"]


def flat_oracle(values, *, epsilon, upper, lower=0.0, noise, layout, lane=Lane.FOREST, flush=True):
    """The flat spread rebuilt from public primitives: chunk k's forest of node draws from
    ``lane`` at level k, made consistent (Hay), its leaves rounded to lattice units and added
    to the clipped block sums in lattice units; every row of a block gets the noisy sum over the
    block's length (the last, partial block over its own rows when ``flush``)."""
    bound, out = upper - lower, []
    for chunk in layout.chunks_until(len(values)):
        levels = chunk.forest.levels
        lap = LaplaceLattice(bound, largest_share(epsilon, epsilon / levels, count=levels))
        leaves = chunk.forest.consistent_leaf_noise(lap, noise.lane(lane, chunk.index), 0)
        rows = values[chunk.start:chunk.stop]
        units = np.rint(np.clip(rows - lower, 0.0, bound) / lap.granularity)
        starts = np.arange(0, len(rows), chunk.block)
        lengths = np.diff(np.r_[starts, len(rows)])
        if not flush and lengths[-1] < chunk.block:
            starts, lengths = starts[:-1], lengths[:-1]
        if not len(starts):
            continue
        sums = np.add.reduceat(units, starts)[:len(starts)].astype(np.int64)
        released = lap.from_units(sums + leaves[:len(sums)])
        out.append(np.repeat(released / lengths, lengths) + lower)
    return np.concatenate(out) if out else np.empty(0)


def fed_whole(machine, values):
    return np.concatenate([machine.feed(values), machine.close()])




# --- the flat spread ---------------------------------------------------------------------------------

@pytest.mark.parametrize("epsilon, lower, upper", [(1.0, 0.0, 10.0), (0.3, 100.0, 110.0), (5.0, -3.0, 4.0)])
def test_flat_rows_are_the_noisy_block_sum_over_the_block_length(epsilon, lower, upper):
    """Every row of a completed block equals its noisy block sum / block length, over geometric
    chunks (through 4096 and 69632), the partial last block over its own rows; values clipped."""
    n = 75_000
    values = np.random.default_rng(1).uniform(lower - 2.0, upper + 2.0, n)
    noise = draws(2)
    machine = HierarchyStream(n, epsilon=epsilon, upper=upper, lower=lower, noise=noise)
    out = fed_whole(machine, values)
    layout = Layout(epsilon=epsilon, fanout=16)
    np.testing.assert_array_equal(out, flat_oracle(values, epsilon=epsilon, upper=upper, lower=lower, noise=noise,
                                                   layout=layout))
    blocks = [flat_block(epsilon, 4096 * 16**k, 16) for k in range(3)]
    assert machine.params()["blocks"] == blocks and machine.params()["chunks"] == [c.rows for c in
                                                                                   layout.chunks_until(n)]
    first = blocks[0]
    assert np.all(out[:first] == out[0]) and out[first] != out[0]  # one value per block
    assert abs(out.sum() - np.clip(values, lower, upper).sum()) < 0.02 * n * (upper - lower)


def test_flat_rows_over_a_fixed_layout_and_the_offline_consistent_forest():
    """``r`` given: chunks of r rows; the released block sums are Hay's estimate applied offline
    to the true forest plus the same node noise, rounded (ToPS Theorem C.1, end to end)."""
    n, g = 1000, 4
    values = np.random.default_rng(3).uniform(0, 2, n)
    noise = draws(21)
    machine = HierarchyStream(n, epsilon=1.0, upper=2.0, r=n, fanout=4, depth=1, noise=noise)
    out = fed_whole(machine, values)
    chunk = machine.layout.chunk(0)
    np.testing.assert_array_equal(out, flat_oracle(values, epsilon=1.0, upper=2.0, noise=noise, layout=machine.layout))
    forest, levels = chunk.forest, chunk.forest.levels
    # ceil(log4 250) = 4 levels over the 250 blocks: 4 roots, 250 real leaves and 6 padding leaves
    assert (forest.roots, forest.n_leaves, levels) == (4, 256, 4)
    lap = LaplaceLattice(2.0, 1.0 / levels)
    released = np.rint(out.reshape(-1, g).sum(axis=1) / lap.granularity)
    node_noise = lap.noise_units(noise.lane(Lane.FOREST, 0), 0, forest.n_nodes).astype(float)
    levels_noise = np.split(node_noise, np.cumsum(forest.level_sizes()[:-1]))
    true = forest.aggregate(np.rint(values / lap.granularity).reshape(-1, g).sum(axis=1))
    offline = forest.consistent([t + z for t, z in zip(true, levels_noise)])[0][:250]
    np.testing.assert_array_equal(released, np.rint(offline))


def test_rows_wait_for_their_block_and_close_releases_the_partial_last_block():
    values = np.arange(5000) % 7.0
    noise = draws(4)
    machine = HierarchyStream(None, epsilon=1.0, upper=10.0, noise=noise)  # blocks of 128, then 256
    oracle = flat_oracle(values, epsilon=1.0, upper=10.0, noise=noise, layout=machine.layout)
    sizes = []
    pieces = []
    for a, b in [(0, 100), (100, 128), (128, 130), (130, 4095), (4095, 4096), (4096, 4300), (4300, 5000)]:
        pieces.append(machine.feed(values[a:b]))
        sizes.append((len(pieces[-1]), machine.released_rows))
    assert sizes == [(0, 0), (128, 128), (0, 128), (3840, 3968), (128, 4096), (0, 4096), (768, 4864)]
    np.testing.assert_array_equal(np.concatenate(pieces), oracle[:4864])
    assert machine.describe()["params"]["blocks"] == [128, 256]
    held = machine.close()
    assert len(held) == 136 and machine.released_rows == 5000
    np.testing.assert_array_equal(held, oracle[4864:])
    assert np.all(held == held[0])
    # a continual stream that is never closed releases only whole blocks: the oracle without the flush
    assert len(flat_oracle(values, epsilon=1.0, upper=10.0, noise=noise, layout=machine.layout, flush=False)) == 4864


def test_geometric_chunks_draw_independent_forests():
    """Chunk k's forest is the FOREST lane at level k: shifting the levels changes every block."""
    n = 4096 + 65536 + 1000
    values = np.full(n, 5.0)
    noise = draws(5)
    out = fed_whole(HierarchyStream(n, epsilon=1.0, upper=10.0, noise=noise), values)
    layout = Layout(epsilon=1.0, fanout=16)

    class Shifted:
        def lane(self, lane, level=0):
            return noise.lane(lane, level + 1)

    shifted = flat_oracle(values, epsilon=1.0, upper=10.0, noise=Shifted(), layout=layout)
    for chunk in layout.chunks_until(n):
        rows = slice(chunk.start, min(chunk.stop, n), chunk.block)
        assert not np.any(out[rows] == shifted[rows])


@pytest.mark.parametrize("smoother, r", [("none", None), ("none", 3000), ("recent", 30_000), ("median", 30_000),
                                         ("exponential", None)])
def test_any_chunking_gives_the_same_release(smoother, r):
    n = 75_000
    values = np.random.default_rng(7).exponential(3, n)
    cuts = [1, 127, 128, 129, 4095, 4096, 4097, 29_999, 30_000, 30_001, 69_631, 69_632, 69_633]
    whole = fed_whole(HierarchyStream(n, epsilon=0.3, upper=20.0, smoother=smoother, r=r, noise=draws(8)), values)
    machine = HierarchyStream(n, epsilon=0.3, upper=20.0, smoother=smoother, r=r, noise=draws(8))
    pieces = [machine.feed(piece) for piece in np.split(values, cuts)]
    np.testing.assert_array_equal(np.concatenate([*pieces, machine.close()]), whole)
    row_by_row = HierarchyStream(n, epsilon=0.3, upper=20.0, smoother=smoother, r=r, noise=draws(8))
    head = np.concatenate([row_by_row.feed(values[i:i + 1]) for i in range(700)])
    np.testing.assert_array_equal(head, whole[:len(head)])


@pytest.mark.parametrize("smoother", ["none", "recent", "median", "exponential"])
def test_snapshot_and_restore_mid_block_give_identical_outputs(smoother):
    n, cut = 9000, 5000  # row 5000 is inside a block of the second chunk (blocks of 256 from row 4096)
    values = np.random.default_rng(9).uniform(0, 10, n)
    whole = HierarchyStream(None, epsilon=1.0, upper=10.0, smoother=smoother, r=None if smoother == "none" else 3000,
                            noise=draws(10))
    expected = fed_whole(whole, values)
    first = HierarchyStream(None, epsilon=1.0, upper=10.0, smoother=smoother, r=None if smoother == "none" else 3000,
                            noise=draws(10))
    head = first.feed(values[:cut])
    state = first.snapshot()
    assert smoother != "none" or state["partial_units"][0] > 0  # the open block's partial sum
    second = HierarchyStream(None, epsilon=1.0, upper=10.0, smoother=smoother, r=None if smoother == "none" else 3000,
                             noise=draws(10))
    second.restore(state)
    assert second.released_rows == first.released_rows
    np.testing.assert_array_equal(np.concatenate([head, second.feed(values[cut:]), second.close()]), expected)
    starts, stops = np.array([0, 100, 4000, 5100]), np.array([n, 5000, 4200, 8999])
    np.testing.assert_array_equal(second.describe()["error"].range_variance(starts, stops),
                                  whole.describe()["error"].range_variance(starts, stops))


def test_partitions_released_together_equal_their_single_streams():
    k, n = 5, 6000
    rows = np.random.default_rng(11).gamma(2.0, 3.0, (k, n))
    params = dict(epsilon=0.7, upper=30.0, lower=-1.0)
    with seeded(12) as release_keys:
        release = dpsql.publish("hierarchy", rows.ravel(), partition_offsets=np.arange(0, k * n + 1, n), **params)
    starts, stops = np.array([0, 10, 4000, 4090, 5999]), np.array([n, 20, 4200, 4100, 6000])
    for j in range(k):
        machine = HierarchyStream(n, noise=release_keys.partition(partition_address(j)), **params)
        single = run_machine(machine, iter([rows[j]]), n)
        part = release.part(j)
        np.testing.assert_array_equal(part.values, single)
        assert dict(part.params) == machine.describe()["params"]
        np.testing.assert_array_equal(part.range_variance(starts, stops),
                                      machine.describe()["error"].range_variance(starts, stops))
        np.testing.assert_array_equal(part.error.range_bias_bound(starts, stops),
                                      machine.describe()["error"].range_bias_bound(starts, stops))


# --- predictive smoothers ------------------------------------------------------------------------------

def test_predictive_smoothers_keep_the_papers_layout():
    for epsilon in (0.01, 0.05, 0.1, 0.5, 1.0):
        machine = HierarchyStream(None, epsilon=epsilon, upper=1.0, smoother="recent", noise=draws(0))
        params = machine.params()
        depth = predictive_depth(epsilon, PAPER_RANGE, 16)
        assert params["r"] == PAPER_RANGE and params["chunks"] == [PAPER_RANGE] and params["blocks"] == [16**depth]
        assert params["levels"] == [5 - depth]
    flat = HierarchyStream(None, epsilon=0.05, upper=1.0, noise=draws(0)).params()
    assert flat["r"] is None and flat["blocks"] == [flat_block(0.05, 4096, 16)] and flat["chunks"] == [4096]


@pytest.mark.parametrize("name", PREDICTIVE)
@pytest.mark.parametrize("feed", [4096, 333])
def test_predictive_outputs_are_the_smoothed_noisy_block_sums(name, feed):
    """Block sums of the output are the released u_t (true clipped sums plus the consistent leaf
    noise of their chunk's forest), and every row is P7 applied to them; rows are released as
    they arrive."""
    n, r, g = 3001, 700, 16
    noise = draws(5)
    machine = HierarchyStream(n, epsilon=0.5, upper=10.0, r=r, fanout=4, depth=2, smoother=name, window=3,
                              alpha=0.6, noise=noise)
    values = np.random.default_rng(6).uniform(-2, 12, n)
    pieces = [machine.feed(values[i:i + feed]) for i in range(0, n, feed)]
    assert [len(p) for p in pieces] == [len(values[i:i + feed]) for i in range(0, n, feed)]
    assert len(machine.close()) == 0
    out = np.concatenate(pieces)
    layout = Layout(epsilon=0.5, fanout=4, r=r, block=g)
    complete = n // g
    sums = np.add.reduceat(out, np.arange(0, n, g))[:complete]
    oracle = flat_oracle(values[:complete * g], epsilon=0.5, upper=10.0, noise=noise, layout=layout)
    np.testing.assert_allclose(sums, oracle.reshape(-1, g).sum(axis=1), rtol=0, atol=1e-9)
    np.testing.assert_allclose(out, reference_outputs(name, sums, g, n, g * 10.0 / 2), atol=1e-9)


def test_the_first_guess_is_the_midpoint_of_the_bounds_or_initial():
    noise = draws(13)
    out = fed_whole(HierarchyStream(300, epsilon=1.0, lower=100.0, upper=110.0, r=256, fanout=4, depth=2,
                                    smoother="recent", noise=noise), np.full(300, 50.0))
    assert out[:15].tolist() == [105.0] * 15  # the first block's rows: the midpoint of the public bounds
    # every value was clipped to lower: the sums are 0 plus noise, and the following predictions are
    # the previous block's noisy sum / 16
    assert np.all(out[16:31] == 100.0 + (out[:16].sum() - 16 * 100.0) / 16)
    guessed = fed_whole(HierarchyStream(300, epsilon=1.0, lower=100.0, upper=110.0, r=256, fanout=4, depth=2,
                                        smoother="mean", initial=103.0, noise=noise), np.full(300, 50.0))
    assert guessed[:15].tolist() == [103.0] * 15


# --- the error model against Monte Carlo ------------------------------------------------------------

def release_many(values, k, seed, **params):
    """``k`` independent releases of ``values`` at once: partitions of one release draw from
    their own addresses, exactly as independent streams."""
    n = len(values)
    with seeded(seed):
        release = dpsql.publish("hierarchy", np.tile(values, k), partition_offsets=np.arange(0, k * n + 1, n),
                                **params)
    return release.values.reshape(k, n), release.part(0)


RANGES = (np.array([0, 100, 4000, 4090, 5, 4096, 1000, 5990, 0]),
          np.array([6000, 5000, 4200, 4100, 17, 6000, 1128, 6000, 4096]))


@pytest.mark.parametrize("params", [{}, {"smoother": "recent", "r": 2048}, {"smoother": "mean", "r": 2048},
                                    {"smoother": "exponential", "r": 2048, "depth": 1},
                                    {"block": 100, "consistency": False}])
def test_range_variance_matches_monte_carlo(params):
    """4000 releases of a stream without within-block shape (so the spreading adds nothing): the
    mean squared error of every range sum is the modelled variance, within 4 standard errors
    (a weighted sum of Laplace variables has excess kurtosis at most 3), across chunk ends."""
    k = 4000
    values = np.full(6000, 3.0) if not params else np.full(6000, 5.0)  # 5.0: the predictors' first guess
    outs, part = release_many(values, k, 20, epsilon=1.0, upper=10.0, **params)
    cumulative = np.concatenate([np.zeros((k, 1)), np.cumsum(outs, axis=1)], axis=1)
    starts, stops = RANGES
    errors = cumulative[:, stops] - cumulative[:, starts] - values[0] * (stops - starts)
    model = part.range_variance(starts, stops)
    np.testing.assert_allclose((errors**2).mean(axis=0) / model, 1.0, atol=4 * np.sqrt(5 / k))
    assert np.all(np.abs(errors.mean(axis=0)) < 4 * np.sqrt(model / k))


def test_raw_node_variance_without_consistency():
    """Without smoothing and consistency every block carries Lap(theta L / eps): Var = 2 (theta L / eps)^2."""
    k = 25
    outs, part = release_many(np.zeros(4096), k, 3, epsilon=1.0, upper=2.0, r=4096, fanout=4, depth=1,
                              consistency=False)
    assert part.params["levels"] == [5] and part.params["blocks"] == [4]
    blocks = outs.reshape(-1, 4).sum(axis=1)
    assert blocks.var() == pytest.approx(2 * (2.0 * 5 / 1.0) ** 2, rel=0.05)
    assert part.range_variance(0, 8) == pytest.approx(2 * LaplaceLattice(2.0, 1.0 / 5).variance)


# --- public wrapper, ledger and bad input -------------------------------------------------------------

def test_hierarchy_wrapper_charges_once_and_records_parameters():
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    with seeded(14):
        rel = dpsql.hierarchy(np.ones(5000), epsilon=0.4, upper=2.0, smoother="moving", window=5, budget=budget,
                              note="h")
        again = dpsql.hierarchy(np.ones(5000), epsilon=0.4, upper=2.0, smoother="moving", window=5, budget=budget,
                                note="h")
    assert budget.spent == (0.4, 0.0)  # the identical repeat is answered from the ledger
    np.testing.assert_array_equal(again.values, rel.values)
    assert rel.method == "hierarchy" and rel.params["window"] == 5 and rel.params["r"] == PAPER_RANGE
    assert rel.components == {"hierarchy": (0.4, 0.0)} and rel.private is False
    history = budget.history(full=True)
    assert history["kind"].to_list() == ["release", "cache hit"] and history["epsilon"].to_list() == [0.4, 0.0]
    row = history.row(0, named=True)
    assert row["method"] == "hierarchy" and row["rows"] == 5000 and row["private"] is False
    assert "replace-one-value" in row["neighbour"]
    recorded = json.loads(row["params"])
    assert recorded["smoother"] == "moving" and recorded["blocks"] == rel.params["blocks"] and recorded["block"] is None
    with seeded(14):
        dpsql.hierarchy(np.ones(5000), epsilon=0.4, upper=2.0, smoother="moving", window=5, budget=budget,
                        fresh=True)
    assert budget.spent == (0.8, 0.0)


def test_a_private_release_needs_a_budget():
    with pytest.raises(dpsql.InvalidParameter, match="budget"):
        dpsql.hierarchy(np.ones(100), epsilon=1.0, upper=1.0)


@pytest.mark.parametrize("params, word", [
    (dict(epsilon=0.0), "epsilon"), (dict(epsilon=float("nan")), "epsilon"), (dict(epsilon=-1.0), "epsilon"),
    (dict(smoother="kalman"), "smoother"), (dict(fanout=1), "fanout"), (dict(r=0), "r"),
    (dict(alpha=0.0005), "alpha"), (dict(alpha=1.5), "alpha"), (dict(window=0), "window"),
    (dict(depth=5), "depth"), (dict(depth=-1), "depth"), (dict(depth=3, r=1000), "depth"), (dict(depth=1.5), "depth"),
    (dict(block=0), "block"), (dict(block=-4), "block"), (dict(block=MAX_BLOCK + 1), "block"),
    (dict(block=2.0), "block"), (dict(depth=1, block=16), "depth"), (dict(depth=1, block=16), "block"),
    (dict(consistency="yes"), "consistency"), (dict(delta=1e-6), "delta"), (dict(upper=0.0), "upper"),
    (dict(initial=float("inf")), "initial"), (dict(smoother="none", levels=3), "levels"),
])
def test_bad_parameters_are_refused_before_charging(params, word):
    budget = dpsql.Budget.in_memory(epsilon=10.0)
    kwargs = {"epsilon": 1.0, "upper": 1.0, **params}
    with pytest.raises(dpsql.InvalidParameter, match=word) as refused:
        dpsql.publish("hierarchy", np.ones(1000), budget=budget, **kwargs)
    assert isinstance(refused.value, dpsql.DPError) and type(refused.value) is not RuntimeError
    assert budget.spent == (0.0, 0.0) and budget.history().height == 0


def test_the_largest_block_is_accepted():
    assert HierarchyStream(None, epsilon=1.0, upper=1.0, block=MAX_BLOCK, noise=draws(0)).params()["blocks"] == [
        MAX_BLOCK]
    assert HierarchyStream(None, epsilon=1.0, upper=1.0, depth=4, noise=draws(0)).params()["blocks"] == [16**4]


@pytest.mark.parametrize("data, word", [
    (np.array([1.0, np.nan]), "NaN"), (np.array([1.0, np.inf]), "infinite"), ([1.0, None], "null"),
    (np.array([]), "empty"), (np.ones((2, 2)), "1-D"),
])
def test_bad_data_is_refused_before_charging(data, word):
    budget = dpsql.Budget.in_memory(epsilon=10.0)
    with pytest.raises(dpsql.InvalidData, match=word):
        dpsql.hierarchy(data, epsilon=1.0, upper=1.0, budget=budget)
    assert budget.spent == (0.0, 0.0) and budget.history().height == 0
