"""PeGaSus (Chen et al., CCS 2017; docs/algorithms.md): grouper, smoothers, error model, SVT freshness, budget."""

from __future__ import annotations

import math
from decimal import Decimal

import numpy as np
import pytest
from doubles import Noiseless

import dpsql
from dpsql import noise, testing
from dpsql.accounting import Neighbour
from dpsql.mechanisms.svt import AboveThreshold
from dpsql.methods import machine_for, run
from dpsql.release import chunks_of, release_from
from dpsql.streams.group_smoothing import GroupPrefixNoise, smooth
from dpsql.streams.pegasus import default_theta, partition
from dpsql.streams.windows import window_alarms, window_sums

EXAMPLE = np.array([5.0, 5.0, 6.0, 9.0, 10.0])
NOISY_UNITS, TENTH = np.array([56, 44, 67, 95, 102]), 0.1  # the paper's noisy counts, on a lattice of 0.1




def noise_free(method, values, *, chunk=1 << 20, **params):
    """``method`` on ``values`` with every draw 0 (one chunk size or another: the same release)."""
    machine = machine_for(method, len(values), Noiseless(), params)
    return release_from(machine, chunks_of(np.asarray(values, dtype=float), chunk), len(values), private=False)


def noise_free_svt():
    return AboveThreshold(2.0, 1.0), Noiseless()


def draws(svt, theta, m, seed):
    """Thresholds of sessions opening at steps 0 .. m - 1 and the query noise of tests at those steps."""
    source = seed if isinstance(seed, noise.Draws) else testing.draws(seed)
    return svt.thresholds(theta, source, 0, m), svt.query_noise_units(source, 0, m)


def reference_partition(true, thresholds, query_units, svt):
    """Algorithm 2 written step by step, dev computed directly on G u {t}."""
    starts, open_group, s = [], False, 0
    for t in range(len(true)):
        if not open_group:
            starts.append(t)
            s, open_group = t, True
            continue
        group = true[s:t + 1]
        dev = np.abs(group - group.mean()).sum()
        if svt.above(np.array([dev]), query_units[t:t + 1], thresholds[s])[0]:
            starts.append(t)
            open_group = False
    return np.array(starts), (s if open_group else len(true))


# -- Example 3.2 / 3.5 -----------------------------------------------------------------------------


@pytest.mark.parametrize("theta", [4 / 3 + 0.01, 2.0, 5.5])
def test_example_3_2_partitions_at_every_time(theta):
    svt, zero = noise_free_svt()
    thresholds, query_units = draws(svt, theta, 5, seed=zero)
    gamma = svt.threshold_noise.granularity  # noise-free: theta itself, on the threshold's lattice
    assert np.all(np.abs(thresholds - theta) <= gamma / 2) and not query_units.any()
    expected = {1: ([0], 0), 2: ([0], 0), 3: ([0], 0), 4: ([0, 3], 4), 5: ([0, 3, 4], 4)}
    for t, (starts, open_from) in expected.items():
        got_starts, got_open = partition(EXAMPLE[:t], thresholds[:t], query_units[:t], svt)
        assert got_starts.tolist() == starts and got_open == open_from


def test_example_3_2_boundaries_of_theta():
    svt, zero = noise_free_svt()
    # the threshold's lattice (2**-11 here) holds 4/3 rounded; dev{5,5,6} = 4/3 on the query lattice is not below it
    thresholds, query_units = draws(svt, 4 / 3, 5, seed=zero)
    assert partition(EXAMPLE, thresholds, query_units, svt)[0].tolist() == [0, 2, 3]
    thresholds, query_units = draws(svt, 5.6, 5, seed=zero)  # dev{5,5,6,9} = 5.5 stays below 5.6
    assert partition(EXAMPLE, thresholds, query_units, svt)[0].tolist() == [0, 4]


@pytest.mark.parametrize(("smoother", "expected"), [
    ("median", [5.6, 5.0, 5.6, 9.5, 10.2]),
    ("average", [5.6, 5.0, 5.566666666666666, 9.5, 10.2]),
    ("js", [5.6, 4.7, 5.944444444444445, 9.5, 10.2]),
])
def test_example_3_5_smoothers(smoother, expected):
    group_start = np.array([0, 0, 0, 3, 4])
    np.testing.assert_allclose(smooth(NOISY_UNITS, TENTH, group_start, smoother), expected, rtol=1e-12)


def test_smoothing_uses_the_partition_at_time_t_not_the_final_one():
    # Row 3 is estimated before row 4 joins its group: appending rows never changes earlier estimates.
    group_start = np.array([0, 0, 0, 0])
    for smoother in ("median", "average", "js"):
        full = smooth(np.array([1, 2, 30, 4]), 1.0, group_start, smoother)
        assert full[:3].tolist() == smooth(np.array([1, 2, 30]), 1.0, group_start[:3], smoother).tolist()


def test_machine_noise_free_reproduces_example():
    rel = noise_free("pegasus", EXAMPLE, epsilon=1.0, theta=2.0, smoother="median")
    assert rel.values.tolist() == [5.0, 5.0, 5.0, 9.0, 10.0]
    assert rel.error.range_variance(np.array([0]), np.array([5]))[0] > 0  # the model describes the real noise


# -- grouper implementation = Algorithm 2 -----------------------------------------------------------


@pytest.mark.parametrize(("seed", "theta", "level"), [(1, 25.0, 10), (2, 200.0, 10), (3, 60.0, 3), (4, 1e4, 50)])
def test_vectorised_grouper_equals_step_by_step_algorithm(seed, theta, level):
    rng = np.random.default_rng(seed)
    true = rng.poisson(level, 3000).astype(float)
    svt = AboveThreshold(2.0, 0.2)
    thresholds, query_units = draws(svt, theta, len(true), seed)
    got = partition(true, thresholds, query_units, svt)
    want = reference_partition(true, thresholds, query_units, svt)
    assert got[0].tolist() == want[0].tolist() and got[1] == want[1]


@pytest.mark.parametrize("smoother", ["median", "average", "js"])
def test_chunked_feeding_equals_one_pass(smoother):
    rng = np.random.default_rng(5)
    counts = np.repeat(rng.poisson(20, 40), rng.integers(1, 60, 40)).astype(float)
    whole = noise_free("pegasus", counts, epsilon=1.0, theta=30.0, smoother=smoother)
    chunked = noise_free("pegasus", counts, epsilon=1.0, theta=30.0, smoother=smoother, chunk=7)
    np.testing.assert_array_equal(whole.values, chunked.values)
    # with real noise too: every draw is addressed by its step, so the chunks never matter
    noisy = run("pegasus", counts, noise=testing.keys(0), epsilon=0.5, theta=30.0, smoother=smoother)
    noisy_chunked = run("pegasus", counts, noise=testing.keys(0), epsilon=0.5, theta=30.0, smoother=smoother, chunk=7)
    np.testing.assert_array_equal(noisy.values, noisy_chunked.values)
    whole_range, chunked_range = (np.array([0]), np.array([len(counts)])), (np.array([0]), np.array([len(counts)]))
    assert noisy.error.range_variance(*whole_range) == noisy_chunked.error.range_variance(*chunked_range)


def test_theta_extremes():
    svt = AboveThreshold(2.0, 1.0)
    thresholds, query_units = draws(svt, 1e9, 500, seed=6)
    assert partition(np.arange(500.0), thresholds, query_units, svt)[0].tolist() == [0]
    thresholds, query_units = draws(svt, -1e9, 500, seed=6)
    assert partition(np.zeros(500), thresholds, query_units, svt)[0].tolist() == list(range(500))


# -- the threshold is fresh per group ---------------------------------------------------------------------


def test_thresholds_are_theta_plus_independent_draws():
    svt = AboveThreshold(2.0, 0.5)
    thresholds = svt.thresholds(40.0, testing.draws(8), 0, 20000)
    lane = testing.draws(8).lane(noise.Lane.SVT_THRESHOLD)
    drawn = svt.threshold_noise.from_units(svt.threshold_noise.noise_units(lane, 0, 20000))
    np.testing.assert_array_equal(thresholds, 40.0 + drawn)
    # independent, centred at theta, scale 2 * sensitivity / epsilon = 8
    assert abs(np.median(thresholds) - 40.0) < 0.3
    assert abs(np.corrcoef(thresholds[:-1], thresholds[1:])[0, 1]) < 0.03
    assert abs(thresholds.var() / (2 * 8.0**2) - 1) < 0.05


def test_group_lengths_match_fresh_sessions_and_are_stationary():
    """Sequential reference built from AboveThreshold sessions (one new session per group)
    against the vectorised grouper on a constant stream (dev = 0): with the same draws, the
    same groups; with other draws, the same length law; and no drift along the stream (an
    accumulating threshold would random-walk)."""
    svt = AboveThreshold(2.0, 1.0)
    n = 30000
    thresholds, query_units = draws(svt, 0.0, n, seed=9)
    starts, _ = partition(np.zeros(n), thresholds, query_units, svt)
    lengths = np.diff(starts)

    def sessions(source):
        """Group lengths of sessions run one after another: a session opening at step s draws its
        threshold at s and tests steps s + 1, ...; after its "above" at e, {e} is a group and the
        next session opens at e + 1."""
        lengths, step = [], 0
        while step < n:
            session, length = svt.session(0.0, source, step), 1
            while step + length < n and not session.above(0.0):
                length += 1
            lengths += [length, 1]
            step += length + 1
        return np.array(lengths)

    same = sessions(testing.draws(9))
    np.testing.assert_array_equal(np.cumsum(same)[:len(starts) - 1], starts[1:])
    reference = sessions(testing.draws(10))[:-2]  # other draws (the last group may be cut by the end)
    assert abs(lengths.mean() / reference.mean() - 1) < 0.1
    half = len(lengths) // 2
    assert abs(lengths[:half].mean() / lengths[half:].mean() - 1) < 0.1


def test_session_refuses_after_halting():
    svt = AboveThreshold(1.0, 1.0)
    session = svt.session(-1e6, testing.draws(0))
    assert session.above(0.0)
    with pytest.raises(RuntimeError, match="halted"):
        session.above(0.0)


# -- error model ------------------------------------------------------------------------------------


def coefficient_matrix(group_start, smoother):
    """Row t's estimate as a linear map of the perturber noises (brute force)."""
    n = len(group_start)
    w = np.zeros((n, n))
    for t in range(n):
        s = group_start[t]
        k = t - s + 1
        if smoother == "average":
            w[t, s:t + 1] = 1 / k
        else:
            w[t, s:t + 1] = (1 - 1 / k) / k
            w[t, t] += 1 / k
    return w


@pytest.mark.parametrize("smoother", ["average", "js"])
def test_error_model_exact_for_linear_smoothers(smoother):
    rng = np.random.default_rng(11)
    starts = np.concatenate([[0], np.sort(rng.choice(np.arange(1, 300), 40, replace=False))])
    group_start = np.repeat(starts, np.diff(np.append(starts, 300)))
    model = GroupPrefixNoise(starts, 300, 2.5, smoother)
    w = coefficient_matrix(group_start, smoother)
    a = rng.integers(0, 300, 500)
    b = np.minimum(a + rng.integers(0, 120, 500), 300)
    brute = np.array([2.5 * (w[i:j].sum(axis=0) ** 2).sum() for i, j in zip(a, b)])
    np.testing.assert_allclose(model.range_variance(a, b), brute, rtol=1e-9, atol=1e-12)


def test_smoother_linearity_matches_coefficients():
    rng = np.random.default_rng(12)
    group_start = np.repeat([0, 5, 6, 20], [5, 1, 14, 10])
    units, granularity = rng.integers(-5000, 5000, 30), 2.0**-10
    for smoother in ("average", "js"):
        np.testing.assert_allclose(smooth(units, granularity, group_start, smoother),
                                   coefficient_matrix(group_start, smoother) @ (units * granularity), rtol=1e-12)


def run_groups(counts_per_group, repeats, smoother, seed, eps=1.0):
    """``repeats`` independent constant streams forced into one group each."""
    values = np.tile(counts_per_group, repeats)
    offsets = np.arange(repeats + 1) * len(counts_per_group)
    with testing.seeded(seed):
        return dpsql.publish("pegasus", values, partition_offsets=offsets, epsilon=eps, theta=1e9,
                             smoother=smoother, grouper_share=0.2)


def test_theorem_3_6_average_smoother_mse_is_2_over_k_eps_p_squared():
    n, repeats = 32, 3000
    rel = run_groups(np.full(n, 7.0), repeats, "average", seed=13)
    errors = (rel.values.reshape(repeats, n) - 7.0) ** 2
    eps_p = 0.8
    k = np.arange(1, n + 1)
    mse = errors.mean(axis=0)
    expected = 2 / (k * eps_p**2)
    assert np.all(np.abs(mse / expected - 1) < 0.25)
    assert abs(mse.sum() / expected.sum() - 1) < 0.05
    # ... against 2 n / eps_p^2 for the raw noisy counts
    assert mse.sum() < 0.2 * 2 * n / eps_p**2
    part = rel.part(0)
    np.testing.assert_allclose(part.range_variance(k - 1, k), part.error._variance / k, rtol=1e-9)


@pytest.mark.parametrize("smoother", ["average", "js", "median"])
def test_range_variance_against_empirical(smoother):
    n, repeats = 40, 3000
    rel = run_groups(np.full(n, 3.0), repeats, smoother, seed=14)
    values = rel.values.reshape(repeats, n) - 3.0
    model = rel.part(0)
    for a, b in [(0, 40), (10, 20), (39, 40), (0, 1), (5, 35)]:
        empirical = values[:, a:b].sum(axis=1).var()
        predicted = model.range_variance(a, b)
        if smoother == "median":  # an upper bound, and not a loose one
            assert empirical < 1.1 * predicted and empirical > predicted / 4
        else:
            assert abs(empirical / predicted - 1) < 0.1


def test_range_ci_coverage_average():
    rel = run_groups(np.full(50, 9.0), 2000, "average", seed=15)
    starts = np.arange(2000) * 50
    low, high = rel.part(0).range_ci(10, 40)
    half = (high - low) / 2
    sums = np.array([rel.values[s + 10:s + 40].sum() for s in starts])
    coverage = np.mean(np.abs(sums - 9.0 * 30) <= half)
    assert 0.93 < coverage < 0.985


# -- budget, parameters, errors -------------------------------------------------------------------------


def test_budget_split_recorded_and_ledger_equals_epsilon():
    for eps, share in [(1.0, 0.2), (0.1, 0.2), (0.5, 0.35), (0.3, 0.1)]:
        budget = dpsql.Budget.in_memory(epsilon=eps)
        with testing.seeded(16):
            rel = dpsql.pegasus(np.arange(100.0), epsilon=eps, grouper_share=share, budget=budget)
        assert budget.spent == (eps, 0.0)
        eps_p, eps_g = rel.components["perturber"][0], rel.components["grouper"][0]
        assert Decimal(eps_p) + Decimal(eps_g) <= Decimal(eps) and math.isclose(eps_p + eps_g, eps)
        assert rel.components["grouper"][0] == share * eps
        assert rel.components["smoother"] == (0.0, 0.0)
        assert rel.params["theta"] == default_theta(AboveThreshold(2.0, share * eps))
        assert rel.neighbour == Neighbour.ADD_REMOVE_EVENT
        assert len(budget.history()) == 1
        assert budget.history(full=True)["neighbour"].to_list() == [Neighbour.ADD_REMOVE_EVENT.value]


def test_a_count_release_of_sensitivity_above_one_is_charged_under_the_unit_neighbour():
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    with testing.seeded(17):
        rel = dpsql.pegasus(np.full(10, 5.0), epsilon=1.0, smoother="average", sensitivity=3, budget=budget)
    assert budget.spent == (1.0, 0.0) and "privacy unit" in rel.neighbour
    assert budget.history(full=True)["neighbour"].to_list() == [Neighbour.ADD_REMOVE_UNIT.value]


def test_sensitivity_scales_noise_and_names_the_unit_neighbour():
    one = run("pegasus", np.full(10, 5.0), noise=testing.keys(17), epsilon=1.0, smoother="average")
    three = run("pegasus", np.full(10, 5.0), noise=testing.keys(17), epsilon=1.0, smoother="average", sensitivity=3)
    # theta is proportional to the Grouper's query-noise scale, 3 times larger up to its lattice rounding
    assert three.params["theta"] == pytest.approx(3 * one.params["theta"], rel=1e-3)
    ratio = three.error._variance / one.error._variance
    assert abs(ratio - 9) < 0.01
    assert "privacy unit" in three.neighbour


@pytest.mark.parametrize(("params", "match"), [
    ({"epsilon": 0.0}, "epsilon"),
    ({"epsilon": float("nan")}, "epsilon"),
    ({"epsilon": 1.0, "grouper_share": 1.0}, "grouper_share"),
    ({"epsilon": 1.0, "grouper_share": 0.0}, "grouper_share"),
    ({"epsilon": 1.0, "smoother": "mean"}, "smoother"),
    ({"epsilon": 1.0, "theta": float("inf")}, "theta"),
    ({"epsilon": 1.0, "sensitivity": 0}, "sensitivity"),
    ({"epsilon": 1.0, "window": 3}, "window"),
])
def test_bad_parameters_refused_and_nothing_charged(params, match):
    budget = dpsql.Budget.in_memory(epsilon=5.0)
    with pytest.raises(dpsql.InvalidParameter, match=match), testing.seeded(0):
        dpsql.publish("pegasus", np.ones(5), budget=budget, **params)
    assert budget.spent == (0.0, 0.0)


@pytest.mark.parametrize(("counts", "match"), [
    ([1.0, float("nan")], "NaN"), ([1.0, float("inf")], "infinite"), ([], "empty"), ([1.0, None], "null"),
])
def test_bad_counts_refused(counts, match):
    budget = dpsql.Budget.in_memory(epsilon=5.0)
    with pytest.raises(dpsql.InvalidData, match=match):
        dpsql.pegasus(np.array(counts, dtype=object if None in counts else float), epsilon=1.0, budget=budget)
    assert budget.spent == (0.0, 0.0)


def test_negative_counts_are_clipped_to_zero():
    rel = noise_free("pegasus", np.array([-5.0, -5.0, 0.0, 2.0]), epsilon=1.0, theta=1.0)
    assert rel.values.tolist() == [0.0, 0.0, 0.0, 2.0]
    assert noise_free("count_laplace", np.array([-5.0, 3.0]), epsilon=1.0).values.tolist() == [0.0, 3.0]


def test_count_laplace_baseline_variance():
    rel = run("count_laplace", np.full(200000, 4.0), noise=testing.keys(19), epsilon=0.5)
    assert abs((rel.values - 4.0).var() / (2 / 0.25) - 1) < 0.03
    assert rel.range_variance(0, 10) == pytest.approx(10 * 8.0, rel=1e-3)


# -- derived queries ----------------------------------------------------------------------------------------


def test_window_sums_and_alarms_are_post_processing_of_the_release():
    counts = np.r_[np.full(100, 2.0), np.full(100, 30.0)]
    with testing.seeded(20):
        rel = dpsql.pegasus(counts, epsilon=1.0, smoother="js")
    sums, variances = window_sums(rel, window=24, smoother="none")
    t = 150
    assert sums[t] == pytest.approx(rel.values[t - 23:t + 1].sum())
    assert variances[t] == pytest.approx(rel.range_variance(t - 23, t + 1))
    assert sums[0] == rel.values[0] and variances[0] == rel.range_variance(0, 1)
    alarms = window_alarms(rel, window=24, threshold=24 * 16, smoother="none")
    np.testing.assert_array_equal(alarms, sums >= 24 * 16)
    assert not alarms[:100].any() and alarms[140:].all()
    with pytest.raises(dpsql.InvalidParameter, match="window"):
        window_sums(rel, window=0)


def test_grouper_session_likelihood_ratio_within_e_epsilon():
    """Empirical privacy smoke test. A neighbour moves every later
    query of its group's session by up to the sensitivity 2; the probability that a
    session answers "below" 20 times in a row must change by at most e^epsilon. (With
    noise calibrated for sensitivity 1 the ratio reaches 2.76 > e at base 0.)"""
    svt = AboveThreshold(2.0, 1.0)
    n, k = 200000, 20
    source = testing.draws(22)
    thresholds = svt.thresholds(0.0, source, 0, n)[:, None]
    query_units = svt.query_noise_units(source, 0, n * k).reshape(n, k)
    for base in (-10.0, 0.0):
        below = np.all(~svt.above(np.full((n, k), base), query_units, thresholds), axis=1).mean()
        shifted = np.all(~svt.above(np.full((n, k), base + 2.0), query_units, thresholds), axis=1).mean()
        assert shifted < below < math.exp(1.0) * shifted


@pytest.mark.parametrize("smoother", ["adaptive", "grouped", "median", "average", "js"])
def test_release_is_online_future_counts_never_change_past_estimates(smoother):
    rng = np.random.default_rng(23)
    counts = rng.poisson(8, 400).astype(float)
    future = counts.copy()
    future[250:] = rng.poisson(30, 150)
    base = run("pegasus", counts, noise=testing.keys(24), epsilon=0.5, smoother=smoother)
    # same draws: the noise does not depend on the data
    changed = run("pegasus", future, noise=testing.keys(24), epsilon=0.5, smoother=smoother)
    np.testing.assert_array_equal(base.values[:250], changed.values[:250])
    assert not np.array_equal(base.values[250:], changed.values[250:])
