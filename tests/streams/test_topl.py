"""ToPL (Wang et al., CCS 2021) and the pm_direct baseline: threshold, estimates, error model, accounting."""

import math

import numpy as np
import pytest

import dpsql
from dpsql.ldp import ToplDevice, estimate_holdout, estimate_stream, estimate_threshold
from dpsql.mechanisms.ldp import (
    EVENT_LDP_NEIGHBOUR,
    HYBRID,
    PIECEWISE,
    SQUARE_WAVE,
    W_EVENT_LDP_NEIGHBOUR,
    report_uniforms,
)
from dpsql.methods import run
from dpsql.streams.topl import PAPER_RANGE, threshold_objective
from dpsql.testing import draws, keys, seeded


def skewed(n, seed):
    """Geometric-like values on 0..100 (a light-tailed transaction-size stream): test data, not noise."""
    return np.minimum(np.floor(-8.0 * np.log(np.random.default_rng(seed).uniform(size=n))), 100.0)


def perturbed(randomiser, x, eps, seed):
    return randomiser.perturb(x, eps, report_uniforms(draws(seed), 0, len(x), uniforms=randomiser.uniforms))


# -- Eq. 8 --------------------------------------------------------------------------------------------


def test_threshold_objective_matches_a_direct_evaluation():
    density = np.array([0.1, 0.4, 0.0, 0.3, 0.2])
    bound, eps, r = 10.0, 1.0, 1000
    grid, err = threshold_objective(density, bound=bound, epsilon=eps, r=r)
    np.testing.assert_allclose(grid, [2.0, 4.0, 6.0, 8.0, 10.0])
    centres = np.array([1.0, 3.0, 5.0, 7.0, 9.0])
    for theta, e in zip(grid, err):
        bias = sum(f * (t - theta) for f, t in zip(density, centres) if t > theta)
        expected = r / 3 * theta**2 / 4 * HYBRID.worst_variance(eps) + r**2 / 6 * bias**2
        assert e == pytest.approx(expected, rel=1e-12)
    _, code = threshold_objective(density, bound=bound, epsilon=eps, r=r, variance_units="code",
                                  bias_coefficient="code")
    for theta, e in zip(grid, code):
        bias = sum(f * (t - theta) for f, t in zip(density, centres) if t > theta)
        assert e == pytest.approx(r / 3 * theta**2 * HYBRID.worst_variance(eps) + r**2 / 24 * bias**2, rel=1e-12)


def test_threshold_objective_point_mass_picks_its_bin():
    density = np.zeros(100)
    density[37] = 1.0
    grid, err = threshold_objective(density, bound=100.0, epsilon=1.0, r=1 << 20)
    assert grid[np.argmin(err)] == 38.0  # the first candidate without truncation bias


def test_code_objective_never_picks_a_larger_threshold():
    # Code flags weigh variance 4x more and bias 4x less: the argmin cannot move up.
    for seed in range(5):
        density = np.random.default_rng(seed).uniform(size=64) ** 4
        density /= density.sum()
        grid, paper = threshold_objective(density, bound=1.0, epsilon=1.0, r=5000)
        _, code = threshold_objective(density, bound=1.0, epsilon=1.0, r=5000, variance_units="code",
                                      bias_coefficient="code")
        assert grid[np.argmin(code)] <= grid[np.argmin(paper)]


# -- server estimates ---------------------------------------------------------------------------------


def test_estimate_threshold_from_reports_of_constant_values():
    reports = perturbed(SQUARE_WAVE, np.full(40_000, 0.25), 2.0, 7)
    theta = estimate_threshold(reports, bound=100.0, threshold_epsilon=2.0, epsilon=1.0, r=1 << 16, n_bins=256)
    assert 20.0 <= theta <= 30.0


def test_pruning_lowers_the_threshold_on_a_skewed_stream():
    values = skewed(30_000, 1)
    reports = perturbed(SQUARE_WAVE, values / 400.0, 1.0, 8)
    kwargs = dict(bound=400.0, threshold_epsilon=1.0, epsilon=1.0, r=1 << 16, n_bins=256)
    pruned = estimate_threshold(reports, pruning="paper", **kwargs)
    plain = estimate_threshold(reports, pruning="none", **kwargs)
    assert pruned < plain
    assert estimate_threshold(reports, pruning="code", **kwargs) <= plain


def test_estimates_are_unbiased():
    n = 200_000
    sw = perturbed(SQUARE_WAVE, np.full(n, 0.3), 1.0, 9)
    hm = perturbed(HYBRID, np.full(n, 2 * 3.0 / 8.0 - 1), 1.0, 10)
    holdout = estimate_holdout(sw, bound=10.0, threshold_epsilon=1.0)
    assert abs(holdout.mean() - 3.0) < 4 * 10.0 * math.sqrt(float(SQUARE_WAVE.debiased_variance(0.3, 1.0)) / n)
    stream = estimate_stream(hm, threshold=8.0)
    assert abs(stream.mean() - 3.0) < 4 * 4.0 * math.sqrt(HYBRID.worst_variance(1.0) / n)


# -- device -------------------------------------------------------------------------------------------


def test_device_reports_sw_then_hm():
    device = ToplDevice(upper=50.0, lower=10.0, epsilon=2.0, threshold_epsilon=0.5, noise=draws(10))
    first = device.report(np.array([10.0, 60.0, -5.0, 30.0]))
    device.set_threshold(8.0)
    later = device.report(np.linspace(0, 100, 1000))
    lo, hi = SQUARE_WAVE.output_range(0.5)
    assert np.all((first >= lo - 1e-6) & (first <= hi + 1e-6))
    assert np.all(np.abs(later) <= PIECEWISE.bound(2.0))
    with pytest.raises(dpsql.InvalidParameter, match="threshold"):
        device.set_threshold(0.0)


def test_device_clips_to_the_threshold():
    # Values above lower + threshold are reported as the threshold: x' = +1 for all of them.
    device = ToplDevice(upper=100.0, epsilon=1.0, noise=draws(12))
    device.set_threshold(5.0)
    reports = device.report(np.full(100_000, 80.0))
    assert abs(estimate_stream(reports, threshold=5.0).mean() - 5.0) < 4 * 2.5 * math.sqrt(
        HYBRID.worst_variance(1.0) / 1e5)


# -- the release --------------------------------------------------------------------------------------


def test_topl_release_values_error_model_and_reports():
    n, m = 60_000, 10_000
    values = skewed(n, 2)
    rel = run("topl", values, noise=keys(13), epsilon=1.0, threshold_epsilon=2.0, upper=400.0, m=m)
    assert rel.method == "topl" and rel.notion == "ldp" and rel.neighbour == EVENT_LDP_NEIGHBOUR
    assert (rel.epsilon, rel.delta) == (2.0, 0.0)
    assert rel.components == {"threshold": (2.0, 0.0), "stream": (1.0, 0.0)}
    assert rel.params["r"] == PAPER_RANGE and rel.params["m"] == m
    assert len(rel.values) == n and rel.reports.shape == (n,)
    theta = rel.threshold
    assert 0 < theta <= 400.0 and np.isclose(theta / 400.0 * 1024, round(theta / 400.0 * 1024))
    # Hold-out rows: debiased SW estimates of the values; stream rows: HM estimates of the clipped values.
    np.testing.assert_allclose(rel.values[:m], estimate_holdout(rel.reports[:m], bound=400.0, threshold_epsilon=2.0))
    np.testing.assert_allclose(rel.values[m:], estimate_stream(rel.reports[m:], threshold=theta))
    stream_var = (theta / 2) ** 2 * HYBRID.worst_variance(1.0)
    assert rel.range_variance(m, n) == pytest.approx((n - m) * stream_var)
    holdout_var = 400.0**2 * float(SQUARE_WAVE.debiased_variance(1.0, 2.0))
    assert rel.range_variance(0, m) == pytest.approx(m * holdout_var)
    # Empirical noise: HM's variance does not depend on the value (eps > 0.61): exact.
    residual = rel.values[m:] - np.minimum(values[m:], theta)
    assert abs(residual.mean()) < 4 * math.sqrt(stream_var / (n - m))
    assert residual.var() == pytest.approx(stream_var, rel=0.05)
    # Hold-out: unbiased, variance at most the stated worst case.
    holdout_residual = rel.values[:m] - values[:m]
    assert abs(holdout_residual.mean()) < 4 * math.sqrt(holdout_var / m)
    assert holdout_residual.var() <= holdout_var * 1.05


def test_range_interval_coverage():
    n, m = 40_000, 8_000
    values = skewed(n, 3)
    rel = run("topl", values, noise=keys(14), epsilon=1.0, upper=400.0, m=m)
    starts = np.arange(m, n - 200, 200)
    low, high = rel.range_ci(starts, starts + 200)
    truth = np.add.reduceat(np.minimum(values, rel.threshold), starts)[: len(starts)]
    covered = np.mean((truth >= low) & (truth <= high))
    assert covered >= 0.93  # nominal 95 %, 160 disjoint ranges


def test_chunked_feeding_gives_the_same_release():
    values = skewed(20_000, 4)
    whole = run("topl", values, noise=keys(15), epsilon=1.0, upper=400.0, m=5_000)
    chunked = run("topl", values, noise=keys(15), epsilon=1.0, upper=400.0, m=5_000, chunk=777)
    assert chunked.threshold == whole.threshold
    np.testing.assert_array_equal(chunked.reports, whole.reports)
    np.testing.assert_array_equal(chunked.values, whole.values)


def test_the_device_sends_the_reports_the_release_simulates():
    """Report ``t`` of a device is a function of its key, its reading and ``t``: a device with the
    release's draws, told the released threshold, sends exactly the release's reports."""
    values = skewed(9_000, 6) + 5.0
    rel = run("topl", values, noise=keys(25), epsilon=1.5, threshold_epsilon=0.7, lower=5.0, upper=300.0, m=2_000)
    device = ToplDevice(lower=5.0, upper=300.0, epsilon=1.5, threshold_epsilon=0.7, noise=keys(25).partition())
    holdout = np.concatenate([device.report(values[:1_500]), device.report(values[1_500:2_000])])
    device.set_threshold(rel.threshold - 5.0)
    stream = device.report(values[2_000:])
    np.testing.assert_array_equal(np.concatenate([holdout, stream]), rel.reports)


def test_lower_bound_shifts_values_and_threshold():
    values = skewed(20_000, 5) + 1000.0
    rel = run("topl", values, noise=keys(16), epsilon=1.0, upper=1400.0, lower=1000.0, m=5_000)
    assert 1000.0 < rel.threshold <= 1400.0
    assert abs(rel.values[5_000:].mean() - np.minimum(values[5_000:], rel.threshold).mean()) < 4 * math.sqrt(
        rel.range_variance(5_000, 20_000)) / 15_000


# -- accounting ---------------------------------------------------------------------------------------


def test_topl_charges_an_ldp_scope_once():
    budget = dpsql.Budget.in_memory(epsilon=3.0, notion="ldp")
    with seeded(17):
        rel = dpsql.ldp.topl(skewed(5_000, 6), epsilon=1.0, threshold_epsilon=1.5, upper=400.0, m=1_000,
                             budget=budget)
    assert budget.spent == (1.5, 0.0)
    assert rel.release_id is not None
    history = budget.history(full=True)
    assert history["method"].to_list() == ["topl"] and history["neighbour"].to_list() == [EVENT_LDP_NEIGHBOUR]


@pytest.mark.parametrize("notion, w", [("central", None), ("w-event-ldp", 10)])
def test_topl_refused_by_other_notions(notion, w):
    budget = dpsql.Budget.in_memory(epsilon=5.0, notion=notion, w=w)
    with seeded(18), pytest.raises(dpsql.NotionMismatch):
        dpsql.ldp.topl(skewed(3_000, 7), epsilon=1.0, upper=400.0, m=500, budget=budget)
    assert budget.spent == (0.0, 0.0)


def test_central_release_refused_by_an_ldp_scope():
    budget = dpsql.Budget.in_memory(epsilon=5.0, notion="ldp")
    with seeded(19), pytest.raises(dpsql.NotionMismatch):
        dpsql.laplace(np.ones(10), epsilon=1.0, upper=2.0, budget=budget)
    assert budget.spent == (0.0, 0.0)


def test_persistent_ledger_refuses_seeded_topl(tmp_path):
    budget = dpsql.Budget.open(tmp_path / "ledger.db", epsilon=5.0, notion="ldp")
    with seeded(20), pytest.raises(dpsql.NonPrivateRelease):
        dpsql.ldp.topl(skewed(3_000, 8), epsilon=1.0, upper=400.0, m=500, budget=budget)
    assert budget.spent == (0.0, 0.0)


def test_budget_exhaustion_refuses_topl():
    budget = dpsql.Budget.in_memory(epsilon=1.0, notion="ldp")
    with seeded(21), pytest.raises(dpsql.BudgetExhausted):
        dpsql.ldp.topl(skewed(3_000, 9), epsilon=1.0, threshold_epsilon=1.2, upper=400.0, m=500, budget=budget)
    assert budget.spent == (0.0, 0.0)


@pytest.mark.parametrize("params, match", [
    (dict(epsilon=0.0), "epsilon"),
    (dict(epsilon=float("nan")), "epsilon"),
    (dict(threshold_epsilon=-1.0), "threshold_epsilon"),
    (dict(upper=0.0), "upper"),
    (dict(m=3_000), "m"),
    (dict(m=0), "m"),
    (dict(pruning="smooth"), "pruning"),
    (dict(variance_units="theta"), "variance_units"),
    (dict(bias_coefficient=24), "bias_coefficient"),
    (dict(r=0), "r"),
])
def test_topl_refuses_bad_parameters_without_charging(params, match):
    budget = dpsql.Budget.in_memory(epsilon=5.0, notion="ldp")
    kwargs = dict(epsilon=1.0, upper=400.0, m=500) | params
    with pytest.raises(dpsql.InvalidParameter, match=match):
        dpsql.ldp.topl(np.ones(3_000), budget=budget, **kwargs)
    assert budget.spent == (0.0, 0.0)


@pytest.mark.parametrize("values, match", [([1.0, float("nan"), 2.0], "NaN"), ([], "empty"),
                                           ([1.0, float("inf")], "infinite"), ([1.0, None], "null")])
def test_topl_refuses_bad_data(values, match):
    with pytest.raises(dpsql.InvalidData, match=match):
        dpsql.ldp.topl(values, epsilon=1.0, upper=10.0, m=1)


# -- pm_direct ----------------------------------------------------------------------------------------


def test_pm_direct_release_and_ledger():
    budget = dpsql.Budget.in_memory(epsilon=2.0, notion="w-event-ldp", w=20)
    n = 50_000
    values = 3.0 + 4.0 * np.random.default_rng(22).uniform(size=n)
    with seeded(23):
        rel = dpsql.ldp.pm_direct(values, epsilon=2.0, w=20, lower=3.0, upper=7.0, budget=budget)
    assert budget.spent == (2.0, 0.0)
    assert rel.notion == "w-event-ldp" and rel.neighbour == W_EVENT_LDP_NEIGHBOUR
    # the largest float whose w multiples stay within epsilon exactly
    assert rel.params["epsilon_report"] == pytest.approx(0.1, rel=1e-15)
    np.testing.assert_allclose(rel.values, 3.0 + 4.0 * (rel.reports + 1) / 2)
    worst = 4.0 * PIECEWISE.worst_variance(0.1)
    assert rel.range_variance(0, n) == pytest.approx(n * worst)
    residual = rel.values - values
    assert abs(residual.mean()) < 4 * math.sqrt(worst / n)
    # Variance depends on the value: the stated worst case bounds the empirical one.
    expected = 4.0 * np.mean(PIECEWISE.variance(2 * (values - 3.0) / 4.0 - 1, 0.1))
    assert residual.var() == pytest.approx(expected, rel=0.05)
    assert expected <= worst


def test_pm_direct_reports_are_piecewise_at_each_rows_address():
    values = np.linspace(-1.0, 6.0, 1_000)  # beyond [0, 5] on both sides: clipped
    rel = run("pm_direct", values, noise=keys(26), epsilon=2.0, w=4, lower=0.0, upper=5.0, chunk=333)
    u = keys(26).partition().lane(dpsql.noise.Lane.LDP_REPORT, 0).uniform(0, 1_000)[:, None]
    expected = PIECEWISE.perturb(2.0 * np.clip(values, 0.0, 5.0) / 5.0 - 1.0, rel.params["epsilon_report"], u)
    np.testing.assert_array_equal(rel.reports, expected)
    np.testing.assert_array_equal(rel.values, 5.0 * (expected + 1.0) / 2.0)


def test_pm_direct_users_released_together_are_each_users_own_release():
    values = np.random.default_rng(27).uniform(0.0, 1.0, 3_000)  # test data, not noise
    with seeded(27):
        together = dpsql.publish("pm_direct", values, partition_offsets=[0, 1_000, 2_000, 3_000],
                                 partition_keys=["a", "b", "c"], epsilon=1.0, w=5)
    for j, user in enumerate("abc"):
        with seeded(27):
            alone = dpsql.publish("pm_direct", values[1_000 * j:1_000 * (j + 1)], partition_offsets=[0, 1_000],
                                  partition_keys=[user], epsilon=1.0, w=5)
        np.testing.assert_array_equal(together.parts[j].reports, alone.parts[0].reports)
        np.testing.assert_array_equal(together.parts[j].values, alone.parts[0].values)


def test_pm_direct_refused_by_a_scope_with_another_window():
    budget = dpsql.Budget.in_memory(epsilon=2.0, notion="w-event-ldp", w=10)
    with seeded(24), pytest.raises(dpsql.NotionMismatch):
        dpsql.ldp.pm_direct(np.full(100, 0.5), epsilon=1.0, w=20, budget=budget)
    with seeded(24), pytest.raises(dpsql.NotionMismatch):
        dpsql.ldp.pm_direct(np.full(100, 0.5), epsilon=1.0, w=10, budget=dpsql.Budget.in_memory(epsilon=2.0))
    with pytest.raises(dpsql.InvalidParameter, match="w"):
        dpsql.ldp.pm_direct(np.full(100, 0.5), epsilon=1.0, w=0, budget=budget)
    assert budget.spent == (0.0, 0.0)
