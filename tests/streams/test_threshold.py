"""``dpsql.threshold``: a private clipping threshold as a release of its own."""

import numpy as np
import pytest

import dpsql
from dpsql.mechanisms.noisy_max import nm_threshold
from dpsql.mechanisms.query_mix import focus_lengths, mix_thresholds
from dpsql.mechanisms.smooth_sensitivity import pak_threshold
from dpsql.methods import run
from dpsql.noise import BatchLaneDraws, Lane
from dpsql.streams.hierarchy import HierarchyStream
from dpsql.testing import draws, keys, seeded

VALUES = np.r_[np.full(9_900, 20.0), np.full(100, 900.0)]


def test_nm_threshold_release():
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    with seeded(0):
        rel = dpsql.threshold(VALUES, epsilon=0.5, upper=1000.0, r=4096, budget=budget)
    # the 1 % at 900 is clipped: the candidate just above 20 (1000 * 2**(-45 / 8) = 20.26) or the next
    assert len(rel) == 1 and rel.values[0] == rel.threshold and 20.0 <= rel.threshold <= 22.1
    assert (rel.epsilon, rel.delta) == (0.5, 0.0) and budget.spent == (0.5, 0.0)
    assert rel.method == "threshold" and rel.params["method"] == "nm" and rel.params["epsilon_perturber"] == 0.5
    assert rel.params["r"] == 4096 and rel.params["focus"] == "mixed" and "step" not in rel.params
    mix = HierarchyStream(epsilon=0.5, upper=1.0, r=4096, noise=draws(0)).query_mix(focus_lengths("mixed", 4096))
    assert mix.lengths == (24, 168, 730, round(4096 / 6**0.5))  # long ranges: anywhere in the declared r
    with seeded(0) as release_keys:
        lane = BatchLaneDraws.of(release_keys.partition().lane(Lane.NOISY_MAX))
        direct = mix_thresholds(np.sort(VALUES)[None], epsilon=0.5, upper=1000.0, mix=mix, noise=lane)[0]
    assert rel.threshold == direct
    with pytest.raises(dpsql.InvalidParameter, match="range sums are undefined"):
        rel.range_variance(0, 1)
    with pytest.raises(dpsql.InvalidParameter, match="range sums are undefined"):
        rel.range_ci(0, 1)


@pytest.mark.parametrize("spread", [30.0, 5.0])
def test_nm_matches_the_primitives_on_clipped_shifted_values(spread):
    values = np.random.default_rng(1).normal(50, spread, 5000)  # some below lower, some above upper
    holdout = np.sort(np.clip(values, 10.0, 90.0) - 10.0)
    rel = run("threshold", values, noise=keys(2), epsilon=0.2, lower=10.0, upper=90.0, epsilon_perturber=0.1,
              r=2**16)
    mix = HierarchyStream(epsilon=0.1, upper=1.0, r=2**16, noise=draws(0)).query_mix(focus_lengths("mixed", 2**16))
    direct = mix_thresholds(holdout[None], epsilon=0.2, upper=80.0, mix=mix,
                            noise=BatchLaneDraws.of(draws(2).lane(Lane.NOISY_MAX)))[0]
    assert rel.threshold == 10.0 + direct and 10.0 < rel.threshold <= 90.0
    paper = run("threshold", values, noise=keys(2), epsilon=0.2, lower=10.0, upper=90.0, epsilon_perturber=0.1,
                r=2**16, focus="paper")
    direct = nm_threshold(holdout, epsilon=0.2, upper=80.0, epsilon_perturber=0.1, r=2**16,
                          noise=draws(2).lane(Lane.NOISY_MAX))
    assert paper.threshold == 10.0 + direct and 10.0 < paper.threshold <= 90.0


def test_paper_default_range_makes_the_threshold_conservative():
    """With the paper's r = 2**20 the noise term is tiny for a 10,000-row hold-out, so the
    bias term wins and the threshold covers the 1 % tail at 900."""
    with seeded(3):
        rel = dpsql.threshold(VALUES, epsilon=0.5, upper=1000.0, focus="paper",
                              budget=dpsql.Budget.in_memory(epsilon=1.0))
    assert rel.params["r"] == 2**20 and rel.params["step"] == 1.0 and rel.threshold >= 900.0


def test_focus_sets_what_the_threshold_is_for():
    """Windows alone clip more of a heavy tail than long ranges do (the same draws)."""
    values = np.minimum(np.random.default_rng(11).pareto(1.5, 20_000) * 5, 5000.0)
    chosen = {focus: run("threshold", values, noise=keys(12), epsilon=1.0, upper=5000.0, focus=focus).threshold
              for focus in ("windows", "mixed", "long")}
    assert chosen["windows"] < chosen["mixed"] <= chosen["long"]


def test_nm_threshold_concentrates_as_epsilon_grows():
    values = np.random.default_rng(4).exponential(10, 20_000)
    spread = []
    for epsilon in (0.01, 1.0):
        picks = [run("threshold", values, noise=keys(seed), epsilon=epsilon, upper=500.0, r=2**14,
                     epsilon_perturber=0.1).threshold for seed in range(60)]
        spread.append(np.std(picks))
    assert spread[1] < spread[0] / 3


def test_pak_threshold_release():
    values = np.random.default_rng(5).exponential(10, 20_000)
    budget = dpsql.Budget.in_memory(epsilon=1.0, delta=1e-6)
    with seeded(6) as release_keys:
        rel = dpsql.threshold(values, epsilon=0.8, upper=500.0, method="pak", budget=budget)
    direct = pak_threshold(np.sort(values), epsilon=0.8, delta=1 / 20_000**2, upper=500.0,
                           noise=release_keys.partition().lane(Lane.SMOOTH_SENSITIVITY))
    assert rel.threshold == direct
    assert (rel.epsilon, rel.delta) == (0.8, 1 / 20_000**2) and budget.spent == (0.8, 1 / 20_000**2)
    assert rel.params["method"] == "pak" and rel.params["tail_p"] == 0.005


def test_pak_options_pass_through():
    values = np.random.default_rng(7).exponential(10, 20_000)
    a = run("threshold", values, noise=keys(8), epsilon=0.8, upper=500.0, estimator="pak", delta=1e-6, rho=1.5)
    b = pak_threshold(np.sort(values), epsilon=0.8, delta=1e-6, upper=500.0, rho=1.5,
                      noise=draws(8).lane(Lane.SMOOTH_SENSITIVITY))
    assert a.threshold == b and a.delta == 1e-6


@pytest.mark.parametrize("params, word", [
    (dict(method="median"), "method"), (dict(delta=1e-6), "delta"), (dict(rho=2.0), "rho"),
    (dict(method="pak", r=100), "'r'"), (dict(method="pak", delta=0.0), "delta"),
    (dict(method="pak", delta=1.0), "delta"), (dict(epsilon=0.0), "epsilon"), (dict(epsilon=float("nan")), "epsilon"),
    (dict(focus="paper", levels_for_nm="x"), "levels_for_nm"), (dict(levels_for_nm="paper"), "levels_for_nm"),
    (dict(epsilon_perturber=-1.0), "epsilon_perturber"), (dict(focus="paper", step=0.0), "step"),
    (dict(step=1.0), "step"), (dict(c=60.0), "c applies to ToPS Eq. 6 alone"), (dict(focus="median"), "focus"),
    (dict(method="pak", focus="mixed"), "focus"), (dict(upper=-1.0), "upper"), (dict(r=0), "r"),
])
def test_bad_parameters_are_refused_before_charging(params, word):
    budget = dpsql.Budget.in_memory(epsilon=10.0, delta=0.5)
    kwargs = {"epsilon": 1.0, "upper": 100.0, **params}
    with pytest.raises(dpsql.InvalidParameter, match=word):
        dpsql.threshold(np.ones(1000), budget=budget, **kwargs)
    assert budget.spent == (0.0, 0.0) and budget.history().height == 0


@pytest.mark.parametrize("data, word", [
    (np.array([1.0, np.nan]), "NaN"), (np.array([np.inf, 1.0]), "infinite"), ([None, 1.0], "null"),
    (np.array([]), "empty"), (np.ones((2, 2)), "1-D"),
])
def test_bad_data_is_refused(data, word):
    budget = dpsql.Budget.in_memory(epsilon=10.0)
    with pytest.raises(dpsql.InvalidData, match=word):
        dpsql.threshold(data, epsilon=1.0, upper=10.0, budget=budget)
    assert budget.spent == (0.0, 0.0) and budget.history().height == 0


@pytest.mark.parametrize("focus", ["mixed", "paper"])
def test_the_nm_release_is_noisy_max_with_the_release_draws(focus):
    values = np.random.default_rng(9).exponential(10, 5000)
    with seeded(10) as release_keys:
        rel = dpsql.threshold(values, epsilon=0.3, upper=500.0, focus=focus,
                              budget=dpsql.Budget.in_memory(epsilon=1.0))
    lane = release_keys.partition().lane(Lane.NOISY_MAX)
    holdout = np.sort(np.clip(values, 0, 500.0))
    if focus == "paper":
        direct = nm_threshold(holdout, epsilon=0.3, upper=500.0, epsilon_perturber=0.3, r=2**20, noise=lane)
        assert rel.params["levels_for_nm"] == "paper"
    else:
        mix = HierarchyStream(epsilon=0.3, upper=1.0, noise=draws(0)).query_mix(focus_lengths("mixed", 2**16))
        direct = mix_thresholds(holdout[None], epsilon=0.3, upper=500.0, mix=mix, noise=BatchLaneDraws.of(lane))[0]
    assert rel.threshold == direct and rel.params["focus"] == focus
