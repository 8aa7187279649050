"""PeGaSus (ALGORITHMS.md §2): grouper, smoothers, error model, SVT freshness, budget."""

from __future__ import annotations

import math
from decimal import Decimal

import numpy as np
import pytest

import dpsql
from dpsql import testing
from dpsql.mechanisms.svt import AboveThreshold
from dpsql.streams import run
from dpsql.streams.pegasus import GroupPrefixNoise, partition, smooth, window_alarms, window_sums

EXAMPLE = np.array([5.0, 5.0, 6.0, 9.0, 10.0])
NOISY = np.array([5.6, 4.4, 6.7, 9.5, 10.2])


def noise_free_svt():
    return AboveThreshold(2.0, 1e12)


def draws(svt, theta, m, seed):
    with testing.seeded(seed) as source:
        return svt.thresholds(theta, source, m), svt.query_noise_units(source, m)


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
    svt = noise_free_svt()
    thresholds, query_units = draws(svt, theta, 5, seed=0)
    expected = {1: ([0], 0), 2: ([0], 0), 3: ([0], 0), 4: ([0, 3], 4), 5: ([0, 3, 4], 4)}
    for t, (starts, open_from) in expected.items():
        got_starts, got_open = partition(EXAMPLE[:t], thresholds[:t], query_units[:t], svt)
        assert got_starts.tolist() == starts and got_open == open_from


def test_example_3_2_boundaries_of_theta():
    svt = noise_free_svt()
    thresholds, query_units = draws(svt, 4 / 3, 5, seed=0)  # dev{5,5,6} = 4/3 is not below 4/3
    assert partition(EXAMPLE, thresholds, query_units, svt)[0].tolist() == [0, 2, 3]
    thresholds, query_units = draws(svt, 5.6, 5, seed=0)  # dev{5,5,6,9} = 5.5 stays below 5.6
    assert partition(EXAMPLE, thresholds, query_units, svt)[0].tolist() == [0, 4]


@pytest.mark.parametrize(("smoother", "expected"), [
    ("median", [5.6, 5.0, 5.6, 9.5, 10.2]),
    ("average", [5.6, 5.0, 5.566666666666666, 9.5, 10.2]),
    ("js", [5.6, 4.7, 5.944444444444445, 9.5, 10.2]),
])
def test_example_3_5_smoothers(smoother, expected):
    group_start = np.array([0, 0, 0, 3, 4])
    np.testing.assert_allclose(smooth(NOISY, group_start, smoother), expected, rtol=1e-12)


def test_smoothing_uses_the_partition_at_time_t_not_the_final_one():
    # Row 3 is estimated before row 4 joins its group: appending rows never changes earlier estimates.
    group_start = np.array([0, 0, 0, 0])
    full = smooth(np.array([1.0, 2.0, 30.0, 4.0]), group_start, "median")
    assert full[:3].tolist() == smooth(np.array([1.0, 2.0, 30.0]), group_start[:3], "median").tolist()


def test_machine_noise_free_reproduces_example():
    with testing.seeded(0) as source:
        rel = run("pegasus", EXAMPLE, noise=source, epsilon=1e12, theta=2.0, smoother="median")
    assert rel.values.tolist() == [5.0, 5.0, 5.0, 9.0, 10.0]


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


def test_chunked_feeding_equals_one_pass_when_noise_free():
    rng = np.random.default_rng(5)
    counts = np.repeat(rng.poisson(20, 40), rng.integers(1, 60, 40)).astype(float)
    with testing.seeded(0) as source:
        whole = run("pegasus", counts, noise=source, epsilon=1e12, theta=30.0, smoother="median")
        chunked = run("pegasus", counts, noise=source, epsilon=1e12, theta=30.0, smoother="median", chunk=7)
    np.testing.assert_array_equal(whole.values, chunked.values)
    assert whole.error.range_variance(np.array([0]), np.array([len(counts)])) == \
        chunked.error.range_variance(np.array([0]), np.array([len(counts)]))


def test_theta_extremes():
    svt = AboveThreshold(2.0, 1.0)
    thresholds, query_units = draws(svt, 1e9, 500, seed=6)
    assert partition(np.arange(500.0), thresholds, query_units, svt)[0].tolist() == [0]
    thresholds, query_units = draws(svt, -1e9, 500, seed=6)
    assert partition(np.zeros(500), thresholds, query_units, svt)[0].tolist() == list(range(500))


# -- the threshold is fresh per group (ALGORITHMS.md §2.9.1) -------------------------------------------


def test_thresholds_are_theta_plus_independent_draws():
    svt = AboveThreshold(2.0, 0.5)
    with testing.seeded(8) as source:
        thresholds = svt.thresholds(40.0, source, 20000)
    with testing.seeded(8) as source:
        noise = svt.threshold_noise.from_units(svt.threshold_noise.noise_units(source, 20000))
    np.testing.assert_array_equal(thresholds, 40.0 + noise)
    # independent, centred at theta, scale 2 * sensitivity / epsilon = 8
    assert abs(np.median(thresholds) - 40.0) < 0.3
    assert abs(np.corrcoef(thresholds[:-1], thresholds[1:])[0, 1]) < 0.03
    assert abs(thresholds.var() / (2 * 8.0**2) - 1) < 0.05


def test_group_lengths_match_fresh_sessions_and_are_stationary():
    """Sequential reference built from AboveThreshold sessions (one new session per group)
    against the vectorised grouper on a constant stream (dev = 0): same length law, and no
    drift along the stream (an accumulating threshold would random-walk)."""
    svt = AboveThreshold(2.0, 1.0)
    n = 60000
    with testing.seeded(9) as source:
        thresholds, query_units = svt.thresholds(0.0, source, n), svt.query_noise_units(source, n)
    starts, _ = partition(np.zeros(n), thresholds, query_units, svt)
    lengths = np.diff(starts)
    reference = []
    with testing.seeded(10) as source:
        while sum(reference) < n:
            session, length = svt.session(0.0, source), 1
            while not session.above(0.0):
                length += 1
            reference += [length, 1]
    reference = np.array(reference[:-1])
    assert abs(lengths.mean() / reference.mean() - 1) < 0.1
    half = len(lengths) // 2
    assert abs(lengths[:half].mean() / lengths[half:].mean() - 1) < 0.1


def test_session_refuses_after_halting():
    svt = AboveThreshold(1.0, 1.0)
    with testing.seeded(0) as source:
        session = svt.session(-1e6, source)
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
    noisy = rng.normal(size=30)
    for smoother in ("average", "js"):
        np.testing.assert_allclose(smooth(noisy, group_start, smoother),
                                   coefficient_matrix(group_start, smoother) @ noisy, rtol=1e-12)


def run_groups(counts_per_group, repeats, smoother, seed, eps=1.0):
    """``repeats`` independent constant streams forced into one group each."""
    values = np.tile(counts_per_group, repeats)
    offsets = np.arange(repeats + 1) * len(counts_per_group)
    with testing.seeded(seed):
        return dpsql.publish("pegasus", values, partition_offsets=offsets, epsilon=eps, theta=1e9,
                             smoother=smoother)


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
        assert rel.params["theta"] == 5 / (share * eps)
        assert rel.neighbour == dpsql.release.ADD_REMOVE_EVENT
        assert len(budget.history()) == 1


def test_sensitivity_scales_noise_and_names_the_unit_neighbour():
    with testing.seeded(17) as source:
        one = run("pegasus", np.full(10, 5.0), noise=source, epsilon=1.0, smoother="average")
        three = run("pegasus", np.full(10, 5.0), noise=source, epsilon=1.0, smoother="average", sensitivity=3)
    assert three.params["theta"] == 3 * one.params["theta"]
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
    with testing.seeded(18) as source:
        rel = run("pegasus", np.array([-5.0, -5.0, 0.0]), noise=source, epsilon=1e12, theta=1.0)
    assert rel.values.tolist() == [0.0, 0.0, 0.0]


def test_count_laplace_baseline_variance():
    with testing.seeded(19) as source:
        rel = run("count_laplace", np.full(200000, 4.0), noise=source, epsilon=0.5)
    assert abs((rel.values - 4.0).var() / (2 / 0.25) - 1) < 0.03
    assert rel.range_variance(0, 10) == pytest.approx(10 * 8.0, rel=1e-3)


# -- derived queries ----------------------------------------------------------------------------------------


def test_window_sums_and_alarms_are_post_processing_of_the_release():
    counts = np.r_[np.full(100, 2.0), np.full(100, 30.0)]
    with testing.seeded(20):
        rel = dpsql.pegasus(counts, epsilon=1.0, smoother="js")
    sums, variances = window_sums(rel, window=24)
    t = 150
    assert sums[t] == pytest.approx(rel.values[t - 23:t + 1].sum())
    assert variances[t] == pytest.approx(rel.range_variance(t - 23, t + 1))
    assert sums[0] == rel.values[0] and variances[0] == rel.range_variance(0, 1)
    alarms = window_alarms(rel, window=24, threshold=24 * 16)
    np.testing.assert_array_equal(alarms, sums >= 24 * 16)
    assert not alarms[:100].any() and alarms[140:].all()
    with pytest.raises(dpsql.InvalidParameter, match="window"):
        window_sums(rel, window=0)


def test_grouper_session_likelihood_ratio_within_e_epsilon():
    """Empirical privacy smoke test (ALGORITHMS.md §8.3). A neighbour moves every later
    query of its group's session by up to the sensitivity 2; the probability that a
    session answers "below" 20 times in a row must change by at most e^epsilon. (With
    noise calibrated for sensitivity 1 the ratio reaches 2.76 > e at base 0.)"""
    svt = AboveThreshold(2.0, 1.0)
    n, k = 200000, 20
    with testing.seeded(22) as source:
        thresholds = svt.thresholds(0.0, source, n)[:, None]
        query_units = svt.query_noise_units(source, n * k).reshape(n, k)
    for base in (-10.0, 0.0):
        below = np.all(~svt.above(np.full((n, k), base), query_units, thresholds), axis=1).mean()
        shifted = np.all(~svt.above(np.full((n, k), base + 2.0), query_units, thresholds), axis=1).mean()
        assert shifted < below < math.exp(1.0) * shifted


@pytest.mark.parametrize("smoother", ["median", "average", "js"])
def test_release_is_online_future_counts_never_change_past_estimates(smoother):
    rng = np.random.default_rng(23)
    counts = rng.poisson(8, 400).astype(float)
    future = counts.copy()
    future[250:] = rng.poisson(30, 150)
    with testing.seeded(24) as source:
        base = run("pegasus", counts, noise=source, epsilon=0.5, smoother=smoother)
    with testing.seeded(24) as source:  # same draws: the noise does not depend on the data
        changed = run("pegasus", future, noise=source, epsilon=0.5, smoother=smoother)
    np.testing.assert_array_equal(base.values[:250], changed.values[:250])
    assert not np.array_equal(base.values[250:], changed.values[250:])
