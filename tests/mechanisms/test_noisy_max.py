"""Report-Noisy-Max and the ToPS threshold optimizer (§4.2, 4.5, 4.6 oracles), and the fast
paths that must release exactly what the direct computations release: Noisy Max pruned to its
contenders (noise drawn for the contenders only, at their own addresses), and the hold-out
counts by placing values among the candidates."""

import math

import numpy as np
import pytest

import dpsql
from dpsql.mechanisms import LaplaceLattice, report_noisy_max
from dpsql.mechanisms.laplace import draw_bound
from dpsql.mechanisms.noisy_max import (
    _is_power_of_two_grid,
    _places,
    candidate_grid,
    contenders,
    default_step,
    nm_scores,
    nm_slope,
    nm_threshold,
    nm_thresholds,
    noisy_max_lattice,
    noisy_max_thresholds,
    report_noisy_max_rows,
)
from dpsql.noise import BatchLaneDraws, Lane
from dpsql.sampling import MAX_NEG_LOG_UNIFORM, fill_discrete_laplace
from dpsql.testing import draws, keys

TOY = np.array([1.0, 1, 2, 2, 3, 3, 4, 5, 9, 20])


class ScriptedLane:
    """A lane whose draw at index ``i`` is ``values[i]``; records the indices asked for."""

    def __init__(self, values):
        self.values = np.asarray(values, dtype=np.int64)
        self.asked = []

    def discrete_laplace_at(self, scale, indices):
        self.asked.append(np.asarray(indices).tolist())
        return self.values[np.asarray(indices, dtype=np.int64)]


def zero_lane(size=100_000):
    return ScriptedLane(np.zeros(size, dtype=np.int64))


def partitions_lane(count, seed=0):
    """The Noisy-Max lanes of ``count`` partitions of one release (independent draws)."""
    return keys(seed).partitions([str(k).encode() for k in range(count)]).lane(Lane.NOISY_MAX)


# --- Eq. 6 -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("epsilon, paper", [(0.05, 3.8273), (0.1, 1.9137), (0.01, 19.137)])
def test_nm_slope_paper_values(epsilon, paper):
    assert nm_slope(65536, epsilon_perturber=epsilon, r=2**20) == pytest.approx(paper, abs=1e-3)


def test_nm_slope_code_levels():
    assert nm_slope(65536, epsilon_perturber=0.05, r=2**20, levels_for_nm="code") == pytest.approx(5.0312, abs=1e-4)
    # code levels: int(log16 r) + 1, so a range just below 16^5 has 5 levels where the paper has ~5
    assert nm_slope(1, epsilon_perturber=1.0, r=16**5 - 1, c=3.0, levels_for_nm="code") == pytest.approx(
        1 / (16**5 - 1) * math.sqrt(30 * 125))


def test_toy_noisy_max_oracle():
    candidates = np.arange(1.0, 21.0)
    scores = nm_scores(TOY, candidates, 0.5)
    assert scores[[2, 3, 4, 5, 8]].tolist() == [-5.5, -5.0, -4.5, -5.0, -5.5]
    assert candidates[np.argmax(scores)] == 5.0
    assert candidates[report_noisy_max(scores, epsilon=1e6, noise=draws(0).lane(Lane.NOISY_MAX))] == 5.0


def test_nm_threshold_end_to_end_on_the_toy_oracle():
    # the perturber budget that makes Eq. 6's slope exactly 0.5 for m=10, r=256, fanout 16
    epsilon_perturber = 3 * 10 * math.sqrt(2 * 15 * 2**3) / (60 * 256 * 0.5)
    assert nm_slope(10, epsilon_perturber=epsilon_perturber, r=256) == pytest.approx(0.5)
    theta = nm_threshold(TOY, epsilon=1.0, upper=20.0, epsilon_perturber=epsilon_perturber, r=256, step=1.0,
                         noise=zero_lane())
    assert theta == 5.0


def test_m_theta_counts_strictly_greater_values():
    # at theta = 9 only the 20 is above: q(9) = -0 - 1
    assert nm_scores(TOY, np.array([9.0, 8.999]), 0.0).tolist() == [-1.0, -2.0]


def test_candidate_grid_and_default_step():
    assert default_step(2000.0) == 1.0 and default_step(65536.0) == 1.0 and default_step(64.0) == 1.0
    assert default_step(63.0) == 63.0 / 1024 and default_step(100.5) == 100.5 / 1024
    assert default_step(1e6) == 1e6 / 1024
    # the last candidate is capped at upper: values at 10.4 with step 1 choose 10.5, not 10
    theta = nm_threshold(np.full(50, 10.4), epsilon=1.0, upper=10.5, epsilon_perturber=1e9, r=2**20, step=1.0,
                         noise=zero_lane())
    assert theta == 10.5


def test_noisy_max_noise_scale_is_one_over_epsilon():
    """Monotone scores: Laplace scale 1/eps (no factor 2). Two candidates 1 apart at eps = 1:
    P(wrong) = 1/2 e^{-1} (1 + 1/2) = 0.276 for continuous Laplace; 4000 independent partitions."""
    picks = report_noisy_max_rows(np.tile([0.0, -1.0], (4000, 1)), epsilon=1.0, noise=partitions_lane(4000, 1))
    assert picks.mean() == pytest.approx(0.5 * math.exp(-1) * 1.5, abs=0.03)
    assert noisy_max_lattice(1.0).scale == pytest.approx(1.0, rel=1e-3)
    assert noisy_max_lattice(1.0, monotonic=False).scale == pytest.approx(2.0, rel=1e-3)


# --- Report-Noisy-Max on the contenders only --------------------------------------------------------

def test_draw_bound_bounds_the_largest_draw_the_sampler_can_return():
    """Every word zero gives the smallest uniform (2**-106): the largest |Z| of all."""
    for scale in (1.0, 7.3, 4096.0 / 0.85, 2.0**20):
        out = np.empty(1, dtype=np.int64)
        fill_discrete_laplace(np.zeros((1, 2), dtype=np.uint64), scale, out)
        assert int(out[0]) == math.floor(scale * MAX_NEG_LOG_UNIFORM)
        assert int(out[0]) <= draw_bound(scale) <= int(out[0]) + 1


def test_contenders_keep_every_score_that_an_extreme_draw_can_lift_to_a_tie():
    lap = LaplaceLattice(sensitivity=1.0, epsilon=0.85)
    b = draw_bound(lap.scale_units)
    # candidate 0 with +b and candidate 1 with -b tie at -b, and the tie goes to index 0: it can win
    assert contenders(np.array([-2.0 * b, 0.0]), lap.scale_units).tolist() == [0, 1]
    # far below 2 b under the leader, no draw can lift a candidate to the leader's lowest value
    assert contenders(np.array([-3.0 * b, 0.0, -b - 5.0, -5.0 * b]), lap.scale_units).tolist() == [1, 2]


def test_contenders_prune_int64_units_exactly_at_any_magnitude():
    top = 2**60 + 1  # beyond 2**53 a float could not tell it from 2**60
    assert contenders(np.array([top, 2**60, top - 148, top - 149], dtype=np.int64), 1.0).tolist() == [0, 1, 2]
    assert contenders(np.array([5.0, 5.0, -1e9]), 0.0).tolist() == [0, 1]  # no noise: the maxima


@pytest.mark.parametrize("seed", range(40))
def test_pruned_noisy_max_equals_the_full_argmax_for_the_same_draws(seed):
    """Any draws the sampler can return (extremes included): noise for the contenders only, at
    their own indices, gives the index the full procedure gives when every candidate gets a
    draw and the others' draws are anything within the bound."""
    rng = np.random.default_rng(seed)
    epsilon = [0.85, 0.05, 3.0][seed % 3]
    lap = noisy_max_lattice(epsilon)
    b = draw_bound(lap.scale_units)
    spread = float(rng.choice([0.5, 3.0, 10.0])) * 2 * b * lap.granularity
    scores = np.round(rng.uniform(-spread, 0, 300) / lap.granularity) * lap.granularity
    scores[rng.integers(0, 300, 5)] = scores.max()  # ties at the top
    units = np.rint(scores / lap.granularity)
    alive = contenders(units, lap.scale_units)
    values = rng.integers(-b, b + 1, len(scores))
    values[rng.random(len(scores)) < 0.3] = b  # losers pushed up as far as they go
    values[alive[rng.random(len(alive)) < 0.3]] = -b  # contenders pushed down
    if seed % 4 == 0:  # the worst case: every contender as low, every other candidate as high as it goes
        values[:] = b
        values[alive] = -b
    lane = ScriptedLane(values)
    assert report_noisy_max(scores, epsilon=epsilon, noise=lane) == int(np.argmax(units + values))
    assert lane.asked == [alive.tolist()]


def test_pruned_noisy_max_is_the_full_procedure_with_the_same_addressed_draws():
    """Real draws: candidate i's noise is the draw at index i of the lane, whether or not the
    others get one; so pruning changes no outcome, partition by partition."""
    scores = np.array([0.0, -1.0, -2.5, 0.5, -80.0, -150.0, -400.0, -1.5])
    lap = noisy_max_lattice(1.0)
    assert len(contenders(np.rint(scores / lap.granularity), lap.scale_units)) < len(scores)
    lanes = partitions_lane(5000, 11)
    pruned = report_noisy_max_rows(np.tile(scores, (5000, 1)), epsilon=1.0, noise=lanes)
    full = np.argmax(np.rint(scores / lap.granularity) + lanes.discrete_laplace(lap.scale_units, 0, len(scores)),
                     axis=1)
    np.testing.assert_array_equal(pruned, full)
    counts = np.bincount(pruned, minlength=len(scores))
    assert counts[[4, 5, 6]].sum() == 0 and counts[[0, 1, 2, 3, 7]].min() > 0


def test_a_far_away_candidate_gets_no_draw_and_never_wins():
    scores = np.r_[np.zeros(10), -1000.0, np.zeros(10)]
    lane = zero_lane(21)
    assert report_noisy_max(scores, epsilon=1.0, noise=lane) == 0
    assert lane.asked == [[*range(10), *range(11, 21)]]
    picks = set(report_noisy_max_rows(np.tile(scores, (500, 1)), epsilon=0.5, noise=partitions_lane(500, 3)))
    assert 10 not in picks and len(picks) > 10


def test_noisy_max_rows_are_independent_report_noisy_max():
    scores = np.random.default_rng(2).normal(0.0, 3.0, (50, 200))
    partitions = keys(4).partitions([str(k).encode() for k in range(50)])
    together = report_noisy_max_rows(scores, epsilon=0.5, noise=partitions.lane(Lane.NOISY_MAX))
    alone = [report_noisy_max(row, epsilon=0.5, noise=partitions[k].lane(Lane.NOISY_MAX))
             for k, row in enumerate(scores)]
    np.testing.assert_array_equal(together, alone)


def test_scores_too_large_for_exact_noisy_max_are_refused():
    with pytest.raises(dpsql.InvalidParameter, match="2\\*\\*53"):
        report_noisy_max(np.array([0.0, 2.0**45]), epsilon=1.0, noise=zero_lane())


def test_nm_thresholds_unsorted_rows_equal_nm_threshold_on_sorted():
    rng = np.random.default_rng(4)
    # 100 rows: more than one group of rows scored and drawn together at upper 6000 (43 rows a group)
    holdouts = rng.gamma(2.0, 1.0, (100, 700)) * rng.uniform(50.0, 1500.0, (100, 1))
    partitions = keys(5).partitions([str(k).encode() for k in range(100)])
    for upper in (6000.0, 100.5):  # the grid placement (m < candidates) and the search (m >= candidates)
        clipped = np.clip(holdouts, 0.0, upper)
        got = nm_thresholds(clipped, epsilon=0.5, upper=upper, epsilon_perturber=1.0, r=2000, is_sorted=False,
                            noise=partitions.lane(Lane.NOISY_MAX))
        want = [nm_threshold(np.sort(row), epsilon=0.5, upper=upper, epsilon_perturber=1.0, r=2000,
                             noise=partitions[k].lane(Lane.NOISY_MAX)) for k, row in enumerate(clipped)]
        np.testing.assert_array_equal(got, want)


def test_nm_threshold_is_noisy_max_over_the_eq6_scores():
    """The optimizer is exactly Report-Noisy-Max over Eq. 6 on the candidate grid (same draws)."""
    holdout = np.sort(np.random.default_rng(6).exponential(20.0, 3000).clip(0, 500))
    lane = draws(7).lane(Lane.NOISY_MAX)
    candidates = candidate_grid(500.0, 1.0)
    slope = nm_slope(3000, epsilon_perturber=0.3, r=2**20)
    scores = nm_scores(holdout, candidates, slope)
    expected = candidates[report_noisy_max(scores + slope * candidates[0], epsilon=0.2, noise=lane)]
    assert nm_threshold(holdout, epsilon=0.2, upper=500.0, epsilon_perturber=0.3, r=2**20, noise=lane) == expected


# --- Hold-out counts --------------------------------------------------------------------------------

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
        assert_counts_exact(np.sort(np.clip(holdout, 0.0, upper)), candidates)


def test_placing_values_is_exact_for_any_increasing_candidates():
    rng = np.random.default_rng(5)
    for candidates in (np.sort(rng.uniform(0, 100, 500)), np.geomspace(1e-3, 1e3, 400),
                       np.r_[1.0, 1.0, 2.0, 2.0, 7.0], np.array([3.0])):
        values = np.sort(np.r_[rng.uniform(-1, 1200, 300), candidates[::3]])
        np.testing.assert_array_equal(_places(candidates, values), np.searchsorted(candidates, values, side="left"))
        assert_counts_exact(np.sort(rng.uniform(0, 100, max(1, len(candidates) // 2))), candidates)


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
    assert_counts_exact(np.sort(np.random.default_rng(1).uniform(0, 50, 2000)), candidate_grid(50.0, 1.0))


def test_candidate_grid_is_shared_and_read_only():
    grid = candidate_grid(10.5, 1.0)
    assert grid.tolist() == [*range(1, 11), 10.5] and candidate_grid(10.5, 1.0) is grid
    with pytest.raises(ValueError):
        grid[0] = 0.0


def test_batch_lane_draws_are_each_partitions_draws():
    """What the batched Noisy Max and forests draw: partition j's row is its own lane's draws."""
    partitions = keys(9).partitions([b"x", b"y", b"z"])
    scales = np.array([0.5, 0.0, 40.0])
    batch = partitions.lane(Lane.FOREST, 2)
    assert isinstance(batch, BatchLaneDraws)
    for count in (5, 20_000):  # the vectorised path and the per-partition one
        got = batch.discrete_laplace(scales, 3, count)
        for j in range(3):
            np.testing.assert_array_equal(got[j], partitions[j].lane(Lane.FOREST, 2).discrete_laplace(scales[j], 3,
                                                                                                      count))
        assert not got[1].any()
    for scale in (0.5, 40.0):  # the discrete Laplace variance 2a / (1 - a)^2, a = exp(-1 / scale)
        piece = batch.discrete_laplace(np.full(3, scale), 0, 100_000).ravel()
        a = np.exp(-1.0 / scale)
        assert piece.var() == pytest.approx(2 * a / (1 - a) ** 2, rel=0.03)
        assert abs(piece.mean()) < 4 * np.sqrt(2 * a / (1 - a) ** 2 / len(piece))
    with pytest.raises(dpsql.InvalidParameter, match="scale"):
        batch.discrete_laplace(np.array([1.0, -1.0, 1.0]), 0, 4)
    indices = np.array([0, 5, 5, 2])
    rows = np.array([2, 0, 2, 1])
    np.testing.assert_array_equal(
        batch.discrete_laplace_at(7.0, rows, indices),
        [partitions[r].lane(Lane.FOREST, 2).discrete_laplace_at(7.0, np.array([i]))[0] for r, i in zip(rows, indices)])


def test_scores_whose_public_parts_overflow_are_refused_before_any_draw():
    lane = ScriptedLane(np.zeros(8, dtype=np.int64))
    with pytest.raises(dpsql.InvalidParameter, match="overflow"):
        noisy_max_thresholds(np.ones((1, 4)), np.array([1.0, 2.0]), np.array([0.0, -np.inf]), epsilon=1.0,
                             is_sorted=True, noise=BatchLaneDraws.of(lane))
    with pytest.raises(dpsql.InvalidParameter, match="overflow"):
        nm_thresholds(np.ones((1, 4)), epsilon=1.0, upper=1e300, epsilon_perturber=1e-300, r=2, step=1e299,
                      noise=BatchLaneDraws.of(lane))
    assert lane.asked == []
