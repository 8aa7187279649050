"""The fast paths of ToPS release exactly what the direct computations release: Report-Noisy-Max
pruned to its contenders, the hold-out counts by placing values among the candidates, the
forest's noise drawn in one call, and error models built on first use."""

import math

import numpy as np
import pytest
from scipy import stats

import dpsql
from dpsql import streams
from dpsql.mechanisms import LaplaceLattice, report_noisy_max
from dpsql.mechanisms.hierarchy import BlockStreamNoise, Forest, leaf_interval_variance
from dpsql.mechanisms.noisy_max import _is_power_of_two_grid, _places, candidate_grid, contenders, nm_scores
from dpsql.noise import MAX_NEG_LOG_UNIFORM, NoiseSource, SeededNoise


class ScriptedDraws(NoiseSource):
    """Hands out the given discrete Laplace draws in order and records every request's size."""

    def __init__(self, draws):
        self._draws = np.asarray(draws, dtype=np.int64)
        self._used = 0
        self.requests = []

    def discrete_laplace(self, scale, size):
        self.requests.append(size)
        out = self._draws[self._used:self._used + size]
        self._used += size
        assert len(out) == size, "the test scripted too few draws"
        return out


def largest_draw(scale_units: float) -> int:
    """The largest |Z| the sampler can return: every word zero gives the smallest uniform."""

    class ZeroWords(NoiseSource):
        def words(self, n):
            return np.zeros(n, dtype=np.uint64)

    return int(ZeroWords().discrete_laplace(scale_units, 1)[0])


# --- Report-Noisy-Max on the contenders only ------------------------------------------------------

def test_contenders_keep_every_score_that_an_extreme_draw_can_lift_to_a_tie():
    lap = LaplaceLattice(sensitivity=1.0, epsilon=0.85)
    b = largest_draw(lap.scale_units)
    assert b == math.floor(lap.scale_units * MAX_NEG_LOG_UNIFORM)
    # candidate 0 with +b and candidate 1 with -b tie at -b, and the tie goes to index 0: it can win
    assert contenders(np.array([-2.0 * b, 0.0]), lap.scale_units).tolist() == [0, 1]
    # far below 2 b under the leader, no draw can lift a candidate to the leader's lowest value
    far = contenders(np.array([-3.0 * b, 0.0, -b - 5.0, -5.0 * b]), lap.scale_units)
    assert far.tolist() == [1, 2]


def test_contenders_prune_int64_units_exactly_at_any_magnitude():
    top = 2**60 + 1  # beyond 2**53 a float could not tell it from 2**60
    assert contenders(np.array([top, 2**60, top - 148, top - 149], dtype=np.int64), 1.0).tolist() == [0, 1, 2]
    assert contenders(np.array([5.0, 5.0, -1e9]), 0.0).tolist() == [0, 1]  # no noise: the maxima


@pytest.mark.parametrize("seed", range(40))
def test_pruned_noisy_max_equals_the_full_argmax_for_the_same_draws(seed):
    """Any draws the sampler can return (extremes included): noise for the contenders only,
    handed out in their order, gives the index the full procedure gives when every candidate
    gets a draw and the others' draws are anything within the bound."""
    rng = np.random.default_rng(seed)
    epsilon = [0.85, 0.05, 3.0][seed % 3]
    lap = LaplaceLattice(sensitivity=1.0, epsilon=epsilon)
    b = largest_draw(lap.scale_units)
    spread = float(rng.choice([0.5, 3.0, 10.0])) * 2 * b * lap.granularity
    scores = np.round(rng.uniform(-spread, 0, 300) / lap.granularity) * lap.granularity
    scores[rng.integers(0, 300, 5)] = scores.max()  # ties at the top
    units = np.rint(scores / lap.granularity)
    alive = contenders(units, lap.scale_units)
    draws = rng.integers(-b, b + 1, len(scores))
    draws[rng.random(len(scores)) < 0.3] = b  # losers pushed up as far as they go
    draws[alive[rng.random(len(alive)) < 0.3]] = -b  # contenders pushed down
    if seed % 4 == 0:  # the worst case: every contender as low, every other candidate as high as it goes
        draws[:] = b
        draws[alive] = -b
    expected = int(np.argmax(units + draws))
    source = ScriptedDraws(draws[alive])
    assert report_noisy_max(scores, epsilon=epsilon, noise=source) == expected
    assert source.requests == [len(alive)]


def test_pruned_noisy_max_has_the_distribution_of_the_full_procedure():
    scores = np.array([0.0, -1.0, -2.5, 0.5, -80.0, -150.0, -400.0, -1.5])
    epsilon = 1.0
    lap = LaplaceLattice(sensitivity=1.0, epsilon=epsilon)
    assert len(contenders(np.rint(scores / lap.granularity), lap.scale_units)) < len(scores)
    trials = 20_000
    pruned_source, full_source = SeededNoise(11), SeededNoise(12)
    pruned = [report_noisy_max(scores, epsilon=epsilon, noise=pruned_source) for _ in range(trials)]
    full = [int(np.argmax(lap.release(scores, full_source))) for _ in range(trials)]
    counts = np.array([np.bincount(pruned, minlength=len(scores)), np.bincount(full, minlength=len(scores))])
    assert counts[:, [4, 5, 6]].sum() == 0
    seen = counts.sum(axis=0) > 0
    assert stats.chi2_contingency(counts[:, seen]).pvalue > 1e-3


def test_a_far_away_candidate_gets_no_draw_and_never_wins():
    scores = np.r_[np.zeros(10), -1000.0, np.zeros(10)]
    source = ScriptedDraws(np.full(20, 0))
    assert report_noisy_max(scores, epsilon=1.0, noise=source) == 0
    assert source.requests == [20]
    with dpsql.testing.seeded(3) as seeded:
        picks = {report_noisy_max(scores, epsilon=0.5, noise=seeded) for _ in range(500)}
    assert 10 not in picks and len(picks) > 10


# --- Hold-out counts ------------------------------------------------------------------------------

def assert_counts_exact(holdout_sorted, candidates):
    """Eq. 6 counts (the scores at slope 0) equal one binary search per candidate."""
    expected = np.searchsorted(holdout_sorted, candidates, side="right") - len(holdout_sorted)
    np.testing.assert_array_equal(nm_scores(holdout_sorted, candidates, 0.0), expected)
    np.testing.assert_array_equal(nm_scores(holdout_sorted, candidates, 0.0, increasing=True), expected)


@pytest.mark.parametrize("upper, step", [(8000.0, 1.0), (100.5, 100.5 / 1024), (1.0, 1.0 / 1024),
                                         (1e9, 1e9 / 1024), (10.5, 1.0), (3.0, 0.1)])
def test_counts_by_placing_values_on_the_grid_equal_the_binary_search(upper, step):
    rng = np.random.default_rng(int(upper))
    candidates = candidate_grid(upper, step)
    for m in (1, 7, len(candidates) // 3, len(candidates) - 1):
        holdout = rng.uniform(0, upper, m)
        # values exactly on, and one ulp either side of, candidates; and the ends of the range
        on_grid = rng.choice(candidates, m)
        holdout[: m // 2] = on_grid[: m // 2]
        holdout[m // 2: 3 * m // 4] = np.nextafter(on_grid[m // 2: 3 * m // 4], rng.choice([-np.inf, np.inf]))
        holdout[:2] = [0.0, upper][: len(holdout[:2])]
        holdout = np.sort(np.clip(holdout, 0.0, upper))
        assert_counts_exact(holdout, candidates)


def test_placing_values_is_exact_for_any_increasing_candidates():
    rng = np.random.default_rng(5)
    for candidates in (np.sort(rng.uniform(0, 100, 500)), np.geomspace(1e-3, 1e3, 400),
                       np.r_[1.0, 1.0, 2.0, 2.0, 7.0], np.array([3.0])):
        values = np.sort(np.r_[rng.uniform(-1, 1200, 300), candidates[::3]])
        np.testing.assert_array_equal(_places(candidates, values), np.searchsorted(candidates, values, side="left"))
        holdout = np.sort(rng.uniform(0, 100, max(1, len(candidates) // 2)))
        assert_counts_exact(holdout, candidates)


@pytest.mark.parametrize("step", [1.0, 0.25, 2.0**-20, 64.0])
def test_power_of_two_grids_place_values_by_division_alone(step):
    candidates = step * np.arange(1, 5001)
    assert _is_power_of_two_grid(candidates)
    rng = np.random.default_rng(7)
    values = np.r_[candidates, np.nextafter(candidates, -np.inf), np.nextafter(candidates, np.inf),
                   rng.uniform(-step, 5002 * step, 5000), 0.0, -0.0, 5e-324, -1.0, step / 3, 3e4 * step,
                   2.0**53 * step, 2.0**60 * step, np.nextafter(2.0**53 * step, 0)]
    np.testing.assert_array_equal(_places(candidates, values), np.searchsorted(candidates, values, side="left"))


def test_only_exact_power_of_two_grids_skip_the_check():
    assert _is_power_of_two_grid(candidate_grid(8000.0, 1.0)) and _is_power_of_two_grid(candidate_grid(1.0, 2**-10))
    assert not _is_power_of_two_grid(candidate_grid(10.5, 1.0))  # the last candidate is capped at upper
    assert not _is_power_of_two_grid(candidate_grid(3.0, 0.1)) and not _is_power_of_two_grid(np.array([3.0, 6.0]))
    assert not _is_power_of_two_grid(np.array([1.0, 2.0, 3.5]))
    with np.errstate(over="ignore"):
        overflowed = 2.0**1023 * np.arange(1, 4)
    assert not _is_power_of_two_grid(overflowed)  # its last candidate is inf: no exact division


def test_counts_for_unsorted_candidates_and_long_holdouts():
    # fewer values than candidates, but the candidates are not increasing: searched one by one
    assert nm_scores(np.array([3.0, 9.0]), np.array([9.0, 8.999, 3.0, 1.0]), 0.0).tolist() == [0.0, -1.0, -1.0, -2.0]
    long_holdout = np.sort(np.random.default_rng(1).uniform(0, 50, 2000))
    candidates = candidate_grid(50.0, 1.0)
    assert_counts_exact(long_holdout, candidates)


def test_candidate_grid_is_shared_and_read_only():
    grid = candidate_grid(10.5, 1.0)
    assert grid.tolist() == [*range(1, 11), 10.5] and candidate_grid(10.5, 1.0) is grid
    with pytest.raises(ValueError):
        grid[0] = 0.0


# --- Hierarchy: one draw call per forest, error models on first use ------------------------------

def test_forest_noise_is_drawn_in_one_call_and_made_consistent():
    forest = Forest(fanout=4, levels=3, roots=2)
    sizes = forest.level_sizes()
    draws = np.random.default_rng(0).integers(-50, 51, sum(sizes))
    source = ScriptedDraws(draws)
    lap = LaplaceLattice(sensitivity=1.0, epsilon=1.0)
    leaves = forest.consistent_leaf_noise(lap, source, 29)
    assert source.requests == [sum(sizes)]
    levels = np.split(draws.astype(np.float64), np.cumsum(sizes[:-1]))
    np.testing.assert_array_equal(leaves, np.rint(forest.consistent(levels)[0][:29]).astype(np.int64))


def test_block_stream_error_model_is_built_on_first_query():
    params = dict(n_rows=1000, block=4, chunk_blocks=16, fanout=4, levels=2, node_variance=1.5, consistent=True,
                  prefix_terms=None)
    model = BlockStreamNoise(**params)
    assert "_chunks_before" not in vars(model)
    # whole chunks: a range of 100 blocks starting at a chunk boundary covers chunks 0..5 and 4 blocks of the 7th
    expected = 6 * leaf_interval_variance(0, 16, fanout=4, levels=2, node_variance=1.5) + leaf_interval_variance(
        0, 4, fanout=4, levels=2, node_variance=1.5)
    assert model._block_interval_variance(np.array([0]), np.array([100]))[0] == pytest.approx(expected, rel=1e-12)
    assert "_chunks_before" in vars(model)


def test_tops_release_builds_its_error_model_only_when_asked():
    with dpsql.testing.seeded(0) as source:
        rel = streams.run("tops", np.arange(20_000) % 50.0, noise=source, epsilon=1.0, upper=100.0)
    stream_model = rel.error._models[1]
    assert isinstance(stream_model, BlockStreamNoise) and "_chunks_before" not in vars(stream_model)
    assert rel.range_variance(5000, 15000) > 0 and "_chunks_before" in vars(stream_model)
