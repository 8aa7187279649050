"""ToPS: the Noisy-Max threshold (§4.2, 4.5, 4.6 oracles), hold-out release, the stream
phase, accounting and bad input."""

import math

import numpy as np
import pytest

import dpsql
from dpsql import streams
from dpsql.mechanisms import LaplaceLattice, report_noisy_max
from dpsql.mechanisms.noisy_max import default_step, nm_scores, nm_slope, nm_threshold
from dpsql.noise import NoiseSource, SeededNoise
from dpsql.streams.tops import ToPS

TOY = np.array([1.0, 1, 2, 2, 3, 3, 4, 5, 9, 20])


class ZeroNoise(NoiseSource):
    """Deterministic test source: every discrete Laplace draw is 0."""

    def discrete_laplace(self, scale, size):
        return np.zeros(size, dtype=np.int64)


# --- Noisy-Max threshold -----------------------------------------------------------------------

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
    with dpsql.testing.seeded(0) as source:
        assert candidates[report_noisy_max(scores, epsilon=1e6, noise=source)] == 5.0


def test_nm_threshold_end_to_end_on_the_toy_oracle():
    # choose the perturber budget that makes Eq. 6's slope exactly 0.5 for m=10, r=256, fanout 16
    epsilon_perturber = 3 * 10 * math.sqrt(2 * 15 * 2**3) / (60 * 256 * 0.5)
    assert nm_slope(10, epsilon_perturber=epsilon_perturber, r=256) == pytest.approx(0.5)
    theta = nm_threshold(TOY, epsilon=1.0, upper=20.0, epsilon_perturber=epsilon_perturber, r=256, step=1.0,
                         noise=ZeroNoise())
    assert theta == 5.0


def test_m_theta_counts_strictly_greater_values():
    # at theta = 9 only the 20 is above: q(9) = -0 - 1
    assert nm_scores(TOY, np.array([9.0, 8.999]), 0.0).tolist() == [-1.0, -2.0]


def test_candidate_grid_and_default_step():
    assert default_step(2000.0) == 1.0 and default_step(65536.0) == 1.0
    assert default_step(63.0) == 63.0 / 1024 and default_step(100.5) == 100.5 / 1024
    assert default_step(1e6) == 1e6 / 1024
    # the last candidate is capped at upper: values at 10.4 with step 1 choose 10.5, not 10
    theta = nm_threshold(np.full(50, 10.4), epsilon=1.0, upper=10.5, epsilon_perturber=1e9, r=2**20, step=1.0,
                         noise=ZeroNoise())
    assert theta == 10.5


def test_noisy_max_noise_scale_is_one_over_epsilon():
    """Monotone scores: Laplace scale 1/eps (no factor 2). Two candidates 1 apart at eps = 1:
    P(wrong) = 1/2 e^{-1} (1 + 1/2) = 0.276 for continuous Laplace."""
    source = SeededNoise(1)
    wrong = np.mean([report_noisy_max(np.array([0.0, -1.0]), epsilon=1.0, noise=source) for _ in range(4000)])
    assert wrong == pytest.approx(0.5 * math.exp(-1) * 1.5, abs=0.03)


# --- ToPS machine ---------------------------------------------------------------------------------

def toy_stream(m=200, n=2000):
    holdout = np.r_[np.full(m - 10, 3.0), np.full(10, 50.0)]
    return np.r_[holdout, np.full(n - m, 3.0)]


def test_tops_with_zero_noise_follows_the_oracles():
    values = toy_stream()
    rel = streams.run("tops", values, noise=ZeroNoise(), epsilon=0.5, upper=100.0, m=200)
    slope = nm_slope(200, epsilon_perturber=0.5, r=1800)
    candidates = np.arange(1.0, 101.0) * default_step(100.0)
    expected = candidates[np.argmax(nm_scores(np.sort(values[:200]), candidates, slope))]
    assert rel.threshold == expected >= 3.0
    # hold-out rows: 1/m of the hold-out total clipped at the threshold
    assert np.allclose(rel.values[:200], np.minimum(values[:200], expected).sum() / 200)
    g = rel.params["block"]
    assert np.all(rel.values[200:200 + g - 1] == expected / 2)  # first block: theta / 2
    assert np.all(rel.values[200 + g:] == 3.0)  # constant stream, zero noise: exact afterwards
    assert rel.params["r"] == 1800 and rel.params["m"] == 200


def test_stream_phase_is_clipped_at_the_threshold():
    values = np.r_[np.full(1000, 4.0), np.full(1000, 80.0)]
    rel = streams.run("tops", values, noise=ZeroNoise(), epsilon=1.0, upper=100.0, m=1000)
    assert rel.threshold == 4.0
    assert np.all(rel.values[1000 + rel.params["block"]:] == 4.0)


def test_holdout_release_and_its_error_model():
    values = np.random.default_rng(2).exponential(4, 20_000)
    with dpsql.testing.seeded(3):
        rel = dpsql.tops(values, epsilon=0.2, upper=100.0, m=4000)
    assert np.all(rel.values[:4000] == rel.values[0])
    total_variance = LaplaceLattice(rel.threshold, 0.15 * 0.2).variance
    assert rel.range_variance(0, 4000) == pytest.approx(total_variance)
    assert rel.range_variance(0, 2000) == pytest.approx(total_variance / 4)
    assert rel.range_variance(3000, 5000) == pytest.approx(total_variance / 16 + rel.range_variance(4000, 5000))
    clipped = np.minimum(values[:4000], rel.threshold).sum()
    assert abs(rel.range_sum(0, 4000) - clipped) < 8 * total_variance**0.5


def test_holdout_total_is_unbiased():
    values = np.random.default_rng(4).uniform(0, 10, 3000)
    errors = []
    for seed in range(300):
        rel = streams.run("tops", values, noise=SeededNoise(seed), epsilon=0.5, upper=10.0, m=1000)
        errors.append(rel.range_sum(0, 1000) - np.minimum(values[:1000], rel.threshold).sum())
    sd = LaplaceLattice(10.0, 0.15 * 0.5).variance ** 0.5
    assert abs(np.mean(errors)) < 4 * sd / 300**0.5
    # threshold <= 10, so never noisier than at theta = 10; a Laplace sample's standard deviation
    # has a relative standard error of sqrt((excess kurtosis 3 + 2) / (4 n)): 4 of them allowed
    assert np.std(errors) <= (1 + 4 * (5 / (4 * 300)) ** 0.5) * sd


def test_tops_is_online():
    values = toy_stream()
    machine = ToPS(len(values), epsilon=0.5, upper=100.0, m=200, noise=SeededNoise(5))
    assert len(machine.feed(values[:150])) == 0  # hold-out not complete: nothing released
    assert len(machine.feed(values[150:1000])) == 1000  # the whole hold-out (200) and 800 stream rows
    assert len(machine.feed(values[1000:])) == 1000
    assert len(machine.close()) == 0


def test_chunking_does_not_change_the_release():
    values = np.random.default_rng(6).lognormal(1, 1, 30_000)
    a = streams.run("tops", values, noise=SeededNoise(7), epsilon=0.1, upper=500.0, r=4096, chunk=30_000)
    b = streams.run("tops", values, noise=SeededNoise(7), epsilon=0.1, upper=500.0, r=4096, chunk=1111)
    np.testing.assert_array_equal(a.values, b.values)
    assert a.threshold == b.threshold


def test_accounting_and_ledger():
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    values = np.random.default_rng(8).exponential(3, 50_000)
    with dpsql.testing.seeded(9):
        rel = dpsql.tops(values, epsilon=0.3, upper=200.0, budget=budget, note="tops test")
    assert budget.spent == (0.3, 0.0)
    assert rel.components["threshold"][0] + rel.components["holdout_total"][0] == pytest.approx(0.3)
    assert rel.components["hierarchy"] == (0.3, 0.0)
    history = budget.history()
    assert history.height == 1 and history["method"][0] == "tops"
    assert rel.params["m"] == 12_500 and rel.params["r"] == 37_500  # defaults: n // 4 and n - m
    assert rel.params["step"] == 1.0 and rel.params["levels_for_nm"] == "paper"


def test_lower_bound_is_respected():
    values = 1000.0 + np.random.default_rng(10).exponential(2, 8000)
    with dpsql.testing.seeded(11):
        rel = dpsql.tops(values, epsilon=1.0, lower=1000.0, upper=1100.0)
    assert 1000.0 < rel.threshold < 1030.0
    # the whole stream phase: unbiased for the values clipped to [lower, threshold]
    clipped = np.minimum(values[2000:], rel.threshold).sum()
    assert abs(rel.range_sum(2000, 8000) - clipped) < 5 * rel.range_variance(2000, 8000) ** 0.5


def test_range_ci_coverage():
    values = np.random.default_rng(12).uniform(0, 5, 6000)
    truth_range = (2048, 6000)
    covered = 0
    for seed in range(200):
        rel = streams.run("tops", values, noise=SeededNoise(50 + seed), epsilon=1.0, upper=5.0, m=2048,
                          step=0.01)
        low, high = rel.range_ci(*truth_range)
        covered += low <= np.minimum(values[2048:], rel.threshold).sum() <= high
    assert covered / 200 >= 0.92


@pytest.mark.parametrize("params, word", [
    (dict(m=5000), "m"), (dict(m=0), "m"), (dict(holdout_share=1.0), "holdout_share"),
    (dict(levels_for_nm="log"), "levels_for_nm"), (dict(c=0.0), "c"), (dict(step=-1.0), "step"),
    (dict(smoother="kalman"), "smoother"), (dict(delta=0.1), "delta"), (dict(epsilon=0.0), "epsilon"),
    (dict(epsilon=float("inf")), "epsilon"), (dict(fanout=1), "fanout"), (dict(lower=200.0), "upper"),
])
def test_bad_parameters_are_refused_before_charging(params, word):
    budget = dpsql.Budget.in_memory(epsilon=10.0)
    kwargs = {"epsilon": 1.0, "upper": 100.0, **params}
    with pytest.raises(dpsql.InvalidParameter, match=word):
        dpsql.publish("tops", np.ones(5000), budget=budget, **kwargs)
    assert budget.spent == (0.0, 0.0)


@pytest.mark.parametrize("data, word", [
    (np.array([1.0, np.nan, 2.0]), "NaN"), (np.array([1.0, -np.inf, 2.0]), "infinite"), ([1.0, None, 2.0], "null"),
    (np.array([]), "empty"), (np.ones((3, 2)), "1-D"),
])
def test_bad_data_is_refused_before_charging(data, word):
    budget = dpsql.Budget.in_memory(epsilon=10.0)
    with pytest.raises(dpsql.InvalidData, match=word):
        dpsql.tops(data, epsilon=1.0, upper=10.0, budget=budget)
    assert budget.spent == (0.0, 0.0)


def test_unknown_method_is_refused():
    with pytest.raises(dpsql.InvalidParameter, match="unknown method 'topps'"):
        dpsql.publish("topps", np.ones(10), epsilon=1.0, upper=1.0)
