"""The threshold's objective for what the release is for (``dpsql.mechanisms.query_mix``): the
scores' sensitivity under replace-one-value neighbours (exact, on the lattice), the selection's
distribution against the exact Report-Noisy-Max probabilities on a toy oracle, the penalty's
derivation, and the public parts that never see the data."""

import math

import numpy as np
import pytest

import dpsql
from dpsql.mechanisms.noisy_max import excess_units, nm_scores, noisy_max_lattice, noisy_max_thresholds, score_units
from dpsql.mechanisms.query_mix import (
    CALENDAR_TOTALS,
    OCTAVES,
    PER_OCTAVE,
    STABILITY,
    QueryMix,
    focus_lengths,
    mix_candidates,
    mix_scores,
    mix_thresholds,
    ranges_span,
)
from dpsql.noise import Lane
from dpsql.streams.hierarchy import HierarchyStream
from dpsql.testing import draws, keys


def partitions_lane(count, seed=0):
    """The Noisy-Max lanes of ``count`` partitions of one release (independent draws)."""
    return keys(seed).partitions([str(k).encode() for k in range(count)]).lane(Lane.NOISY_MAX)


def public_parts(upper, penalty):
    """The data-independent part of :func:`mix_scores` (the scores with no value above any candidate)."""
    return mix_scores(np.zeros(1), upper=upper, penalty=penalty)


# --- sensitivity -----------------------------------------------------------------------------------

def neighbours(holdout, replacements):
    """Every hold-out with one value replaced by one of ``replacements`` (rows)."""
    rows = np.repeat(holdout[None], len(holdout) * len(replacements), axis=0)
    positions = np.repeat(np.arange(len(holdout)), len(replacements))
    rows[np.arange(len(rows)), positions] = np.tile(replacements, len(holdout))
    return rows


@pytest.mark.parametrize("upper, epsilon, penalty", [(1000.0, 0.5, 9.1), (76.0, 0.05, 91.2), (1e6, 2.0, 400.0)])
def test_replacing_one_value_moves_every_score_by_at_most_one_in_one_direction(upper, epsilon, penalty):
    """Exactly, in the lattice units Report-Noisy-Max compares: a replaced value changes each
    count #{v > theta} by at most one, and all of them the same way; the public part is the same."""
    rng = np.random.default_rng(1)
    candidates = mix_candidates(upper)
    holdout = np.clip(np.r_[rng.pareto(1.2, 60) * upper / 50, candidates[[40, 120, 150]], 0.0, upper], 0.0, upper)
    # values exactly on, just above and just below candidates, the bounds, and values far apart
    replacements = np.r_[0.0, upper, candidates[::13], np.nextafter(candidates[::17], np.inf),
                         np.nextafter(candidates[5::17], 0.0), rng.uniform(0, upper, 5)]
    lap = noisy_max_lattice(epsilon)
    public = public_parts(upper, penalty)
    base = score_units(holdout[None], candidates, public, lap, is_sorted=False)
    moved = score_units(neighbours(holdout, replacements), candidates, public, lap, is_sorted=False) - base
    unit = round(1 / lap.granularity)
    assert np.abs(moved).max() == unit  # the bound is reached, never passed
    assert np.all((moved >= 0).all(axis=1) | (moved <= 0).all(axis=1))  # monotone
    assert np.all(moved % unit == 0)
    # the float scores say the same
    float_moved = np.array([mix_scores(np.sort(row), upper=upper, penalty=penalty)
                            for row in neighbours(holdout, replacements[:7])])
    assert np.abs(float_moved - mix_scores(np.sort(holdout), upper=upper, penalty=penalty)).max() == 1.0


def test_the_public_part_depends_on_no_value():
    rng = np.random.default_rng(2)
    upper, penalty = 500.0, 12.0
    for holdout in (np.zeros(100), rng.uniform(0, upper, 100), np.full(100, upper)):
        counts = nm_scores(np.sort(holdout), mix_candidates(upper), 0.0, increasing=True)
        np.testing.assert_allclose(mix_scores(np.sort(holdout), upper=upper, penalty=penalty) - counts,
                                   public_parts(upper, penalty), rtol=0, atol=1e-12)
    # -penalty * ln(theta / upper): one grid step down gains penalty * ln 2 / 8
    steps = np.diff(public_parts(upper, penalty))
    np.testing.assert_allclose(steps, -penalty * math.log(2) / PER_OCTAVE)


def test_candidates_are_a_public_geometric_grid():
    candidates = mix_candidates(300.0)
    assert len(candidates) == PER_OCTAVE * OCTAVES + 1 and candidates[-1] == 300.0
    np.testing.assert_allclose(candidates[1:] / candidates[:-1], 2 ** (1 / PER_OCTAVE))
    assert candidates[0] == pytest.approx(300.0 * 2.0**-OCTAVES)
    assert not candidates.flags.writeable and mix_candidates(300.0) is candidates
    with pytest.raises(dpsql.InvalidParameter, match="upper"):
        mix_candidates(5e-324)


# --- the clipped excess (calendar totals) ---------------------------------------------------------

def brute_excess(holdout, candidates):
    """min(v - theta, theta)+ / theta summed over the values, for every candidate (floats)."""
    return (np.minimum(np.maximum(holdout[..., :, None] - candidates, 0.0), candidates) / candidates).sum(axis=-2)


@pytest.mark.parametrize("upper", [1000.0, 2.5, 1e6])
def test_the_clipped_excess_is_each_values_excess_in_thresholds_at_most_one(upper):
    """Exactly the brute-force sum on the lattice (values on, just off and between candidates, both
    bounds, several rows, an uneven grid); and value by value never further from the clipped mass
    (v - theta)+ / theta than the count is."""
    rng = np.random.default_rng(5)
    candidates = mix_candidates(upper)
    row = np.clip(np.r_[rng.pareto(1.5, 400) * upper / 30, candidates[::3], np.nextafter(candidates[::5], 0.0),
                        np.nextafter(candidates[::7], np.inf), 0.0, upper], 0.0, upper)
    holdouts = np.stack([row, rng.permutation(row)])
    unit = 4096
    want = np.rint(np.minimum(np.maximum(holdouts[..., None] - candidates, 0), candidates) / candidates * unit)
    np.testing.assert_array_equal(excess_units(holdouts, candidates, unit), want.sum(axis=1))
    uneven = np.sort(rng.uniform(0, upper, 50))
    np.testing.assert_allclose(excess_units(holdouts, uneven, unit) / unit, brute_excess(holdouts, uneven),
                               atol=len(row) / unit)
    excess = np.minimum(np.maximum(row[:, None] - candidates, 0), candidates) / candidates
    mass = np.maximum(row[:, None] - candidates, 0) / candidates
    count = (row[:, None] > candidates).astype(float)
    assert np.all(np.abs(excess - mass) <= np.abs(count - mass))
    assert np.any(np.abs(excess - mass) < np.abs(count - mass))
    # many partitions' hold-outs (computed a few hundred thousand values at a time): each row its own
    many = np.minimum(rng.lognormal(0, 1, (100, 4096)) * upper / 20, upper)
    np.testing.assert_array_equal(excess_units(many, candidates, unit),
                                  np.stack([excess_units(row[None], candidates, unit)[0] for row in many]))


@pytest.mark.parametrize("upper, epsilon, penalty", [(1000.0, 0.5, 142.0), (2.5, 1.0, 35.0)])
def test_replacing_one_value_moves_every_excess_score_by_at_most_one_in_one_direction(upper, epsilon, penalty):
    """The excess scores on the lattice: a replaced value moves each by at most one (1 / gamma
    units), all the same way; a value moved from 0 to the bound moves the scores of the candidates
    at half the bound or less by exactly one."""
    rng = np.random.default_rng(6)
    candidates = mix_candidates(upper)
    holdout = np.clip(np.r_[rng.lognormal(0, 0.5, 60) * upper / 20, candidates[[40, 120, 150]], 0.0], 0.0, upper)
    replacements = np.r_[0.0, upper, candidates[::13], np.nextafter(candidates[::17], np.inf),
                         np.nextafter(candidates[5::17], 0.0), rng.uniform(0, upper, 5)]
    lap = noisy_max_lattice(epsilon)
    public = public_parts(upper, penalty)
    base = score_units(holdout[None], candidates, public, lap, is_sorted=False, clipped="excess")
    moved = score_units(neighbours(holdout, replacements), candidates, public, lap, is_sorted=False,
                        clipped="excess") - base
    unit = round(1 / lap.granularity)
    assert np.abs(moved).max() == unit
    assert np.all((moved >= 0).all(axis=1) | (moved <= 0).all(axis=1))
    zero_to_upper = moved[(len(holdout) - 1) * len(replacements) + 1]  # the last value (0) replaced by upper
    assert np.all(zero_to_upper[candidates <= upper / 2] == -unit)


def test_calendar_totals_count_the_excess_and_other_mixes_the_values():
    hourly = HierarchyStream(epsilon=1.0, upper=1.0, grid=("2024-01-01", "1h"), noise=draws(0))
    calendar = hourly.query_mix(focus_lengths("mixed", 2**16, calendar=True))
    assert calendar.lengths == (24, 168, 731) and calendar.clipped == "excess"
    assert hourly.query_mix((24, 168)).clipped == "count"  # focus="windows" on a grid
    assert HierarchyStream(epsilon=1.0, upper=1.0, noise=draws(0)).query_mix((24, 168, 730, 26755)).clipped == "count"
    assert CALENDAR_TOTALS == ("day", "week", "month")
    # the selection scores the excess: with no noise to speak of, its argmax
    rng = np.random.default_rng(8)
    holdout = np.minimum(rng.lognormal(1, 0.4, 4096), 100.0)
    chosen = mix_thresholds(holdout[None], epsilon=1e6, upper=100.0, mix=calendar, is_sorted=False,
                            noise=partitions_lane(1, 9))
    scores = mix_scores(np.sort(holdout), upper=100.0, penalty=calendar.penalty(4096, epsilon=1e6), clipped="excess")
    assert chosen[0] == mix_candidates(100.0)[np.argmax(scores)] * calendar.lift(4096, epsilon=1e6)
    counted = mix_scores(np.sort(holdout), upper=100.0, penalty=calendar.penalty(4096, epsilon=1e6))
    assert chosen[0] < mix_candidates(100.0)[np.argmax(counted)]  # values just above clip cost less than a count
    with pytest.raises(dpsql.InvalidParameter, match="clipped"):
        QueryMix((24,), (4.0,), "mass")


# --- the selection's distribution --------------------------------------------------------------------

def exact_noisy_max(units, scale_units):
    """P(candidate i is the first largest of units + Z) for i.i.d. discrete Laplace Z at the
    lattice scale (P(z) proportional to exp(-|z| / scale), the sampler's law)."""
    a = math.exp(-1.0 / scale_units)
    bound = int(60 * scale_units)
    z = np.arange(-bound, bound + 1)
    pmf = (1 - a) / (1 + a) * a ** np.abs(z)

    def cdf(k):  # P(Z <= k)
        k = np.asarray(k, dtype=np.float64)
        return np.where(k >= 0, 1 - a ** (k + 1) / (1 + a), a ** (-k) / (1 + a))

    probabilities = []
    for i, u in enumerate(units):
        p = pmf.copy()
        for j, v in enumerate(units):
            if j != i:
                p *= cdf(u + z - v - (1 if j < i else 0))  # an earlier candidate wins ties
        probabilities.append(p.sum())
    return np.array(probabilities)


def test_the_selection_follows_report_noisy_max_exactly_on_a_toy_oracle():
    """Counts above 1, 2, 3, 4 are 4, 3, 2, 0; the public parts -2 ln(theta); epsilon 1. The
    frequencies of 40,000 independent selections (partitions of one release) match the exact
    probabilities of the ideal mechanism on the lattice."""
    holdout = np.array([0.5, 1.5, 2.5, 3.5, 3.7])
    candidates = np.array([1.0, 2.0, 3.0, 4.0])
    public = -2.0 * np.log(candidates)
    lap = noisy_max_lattice(1.0)
    units = score_units(holdout[None], candidates, public, lap)[0]
    # the scores public - #{v > theta} on the lattice, up to a common shift
    assert np.ptp(units * lap.granularity - (public - np.array([4, 3, 2, 0]))) < 2 * lap.granularity
    expected = exact_noisy_max(units.astype(np.float64), lap.scale_units)
    assert expected.sum() == pytest.approx(1.0, abs=1e-9) and expected.min() > 0.05
    k = 40_000
    chosen = noisy_max_thresholds(np.tile(holdout, (k, 1)), candidates, public, epsilon=1.0, is_sorted=True,
                                  noise=partitions_lane(k, 3))
    observed = np.array([(chosen == c).mean() for c in candidates])
    assert np.all(np.abs(observed - expected) < 4 * np.sqrt(expected * (1 - expected) / k))


def test_mix_thresholds_is_noisy_max_over_the_mix_scores():
    rng = np.random.default_rng(4)
    holdouts = np.minimum(rng.lognormal(2, 1.2, (5, 3000)), 800.0)
    mix = QueryMix((24, 65536), (0.05, 167.0))
    penalty = mix.penalty(3000, epsilon=0.7)
    got = mix_thresholds(holdouts, epsilon=0.7, upper=800.0, mix=mix, is_sorted=False, noise=partitions_lane(5, 6))
    want = noisy_max_thresholds(np.sort(holdouts, axis=1), mix_candidates(800.0), public_parts(800.0, penalty),
                                epsilon=0.7, is_sorted=True, noise=partitions_lane(5, 6))
    lift = mix.lift(3000, epsilon=0.7)
    assert lift > 1  # the floor raised the penalty: the choice is lifted, never above the bound
    np.testing.assert_array_equal(got, np.minimum(want * lift, 800.0))
    # with no noise to speak of the choice is the argmax of the scores
    sharp = mix_thresholds(holdouts[:1], epsilon=1e6, upper=800.0, mix=mix, is_sorted=False,
                           noise=partitions_lane(1, 7))
    scores = mix_scores(np.sort(holdouts[0]), upper=800.0, penalty=mix.penalty(3000, epsilon=1e6))
    assert sharp[0] == mix_candidates(800.0)[np.argmax(scores)] * mix.lift(3000, epsilon=1e6)


# --- the penalty --------------------------------------------------------------------------------------

def test_each_lengths_penalty_is_the_smallest_tangent_of_its_log_mse():
    """beta_L = min over c of 2 (V + A(c)) / A'(c), A(c) = (L c / m)^2 + L c / m, found by brute force."""
    m = 4096
    for length, variance in [(24, 0.05), (168, 2.2), (730, 24.0), (65536, 225.0), (65536, 0.3)]:
        a = length / m
        c = np.linspace(0, m, 2_000_001)
        brute = np.min(2 * (variance + a * a * c * c + a * c) / (2 * a * a * c + a))
        (closed,) = QueryMix((length,), (variance,)).penalties(m)
        assert closed == pytest.approx(brute, rel=1e-6)


def test_the_penalty_is_the_mix_raised_to_the_stability_floor_and_capped():
    mix = QueryMix((24, 168, 730, 65536), (0.05, 2.0, 17.0, 60.0))
    per_length = mix.penalties(4096)
    harmonic = 4 / np.sum(1 / per_length)
    assert harmonic < STABILITY < STABILITY / 0.5
    assert mix.penalty(4096, epsilon=0.5) == STABILITY / 0.5  # the selection's noise decides
    assert mix.penalty(4096, epsilon=8.0) == STABILITY  # the hold-out's own noise: as at epsilon 1
    assert mix.penalty(2**20, epsilon=0.5) == pytest.approx(harmonic * 256)  # a long hold-out: the mix's own
    assert mix.penalty(4096, epsilon=1e-3) == 4096 / (2 * OCTAVES * math.log(2))


def test_the_lift_undoes_the_floors_shift_on_the_models_own_tail():
    """On a Pareto tail of index 2 (the model's: a value above theta exceeds it by theta on average),
    Noisy Max without noise at the floor's penalty, lifted, lands where it lands at the mix's own
    penalty (within a grid step and the hold-out's granularity); the cap never lowers a choice."""
    m = 40_000
    holdout = np.sort(np.minimum(1.0 / np.sqrt(1.0 - (np.arange(m) + 0.5) / m), 5000.0))  # Pareto(2) quantiles
    mix = QueryMix((24, 65536), (0.05, 167.0))
    assert mix.penalty(m, epsilon=0.05) > 3 * mix.own_penalty(m)
    candidates = mix_candidates(5000.0)
    own = candidates[np.argmax(mix_scores(holdout, upper=5000.0, penalty=mix.own_penalty(m)))]
    floored = candidates[np.argmax(mix_scores(holdout, upper=5000.0, penalty=mix.penalty(m, epsilon=0.05)))]
    assert floored < own / 1.5  # the floor alone clips far more than the mix wants
    assert floored * mix.lift(m, epsilon=0.05) == pytest.approx(own, rel=0.2)
    assert QueryMix((24,), (500.0,)).lift(4096, epsilon=0.5) == 1.0  # the cap below the mix's own penalty


def test_the_stability_floor_keeps_large_excursions_unlikely():
    """The union bound behind STABILITY: at beta * epsilon = STABILITY, candidates at least
    sqrt(5) above a better one beat it with total probability at most 10 %."""
    per_nat = PER_OCTAVE / math.log(2)
    steps = np.arange(math.ceil(per_nat * 0.5 * math.log(5)), 10_000) / per_nat
    chance = np.sum(0.5 * np.exp(-STABILITY * steps) * (1 + STABILITY * steps / 2))
    assert chance == pytest.approx(0.1, rel=1e-6)


def test_focus_lengths_and_a_mix_from_the_hierarchy():
    assert focus_lengths("mixed", ranges_span(None, None)) == (24, 168, 730, round(2**16 / math.sqrt(6)))
    stream = HierarchyStream(epsilon=1.0, upper=1.0, noise=draws(0))
    mix = stream.query_mix(focus_lengths("mixed", 2**16))
    assert mix.lengths == (24, 168, 730, 26755)
    # noise grows with the range's length, and per squared bound it is the same whatever the bound
    assert list(mix.unit_variances) == sorted(mix.unit_variances)
    wide = HierarchyStream(epsilon=1.0, upper=500.0, noise=draws(0)).query_mix(mix.lengths)
    np.testing.assert_allclose(wide.unit_variances, mix.unit_variances, rtol=1e-3)  # the lattice's slack aside
    # a range of whole blocks inside one chunk: the forest's exact variance at bound 1
    exact = HierarchyStream(epsilon=1.0, upper=1.0, noise=draws(0), r=4096, block=16)
    (one_block,) = exact.query_mix((16,)).unit_variances
    assert 0 < one_block < 2 * (3 / 1.0) ** 2 * 1.01  # at most a leaf's raw Laplace variance (3 levels)


@pytest.mark.parametrize("lengths, variances", [((), ()), ((24,), ()), ((0,), (1.0,)), ((24,), (0.0,)),
                                                 ((24,), (float("nan"),))])
def test_a_bad_mix_is_refused(lengths, variances):
    with pytest.raises(dpsql.InvalidParameter, match="query mix"):
        QueryMix(lengths, variances)
