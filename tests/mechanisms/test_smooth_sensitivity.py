"""Smooth sensitivity of the quantile (NRS07, two-sided window), PAK's kappa and threshold (see docs/algorithms.md)."""

import math

import numpy as np
import pytest
from scipy import stats

import dpsql
from dpsql.addresses import partition_address
from dpsql.errors import InvalidData, InvalidParameter
from dpsql.mechanisms.smooth_sensitivity import (
    _THRESHOLD_LATTICE_BITS,
    check_pak_threshold,
    pak_kappa,
    pak_threshold,
    quantile_miss_probability,
    smooth_sensitivity_quantile,
    smoothing_parameter,
)
from dpsql.noise import Lane


def threshold_draws(seed: int, partition=0):
    """The lane the PAK threshold draws its one value from (index 0), for one partition of a seeded key."""
    return dpsql.testing.draws(seed, partition_address(partition)).lane(Lane.SMOOTH_SENSITIVITY)


def literal_smooth_sensitivity(sorted_values, rank, b, upper, lower=0.0, reach=None):
    """The P4 formula as written: k = 0..m+1, t = 0..reach(k) on the padded order statistics
    (1-indexed ``P = rank + 1``). ``reach(k) = k + 1`` is NRS07; ``k`` is the reference code."""
    x = np.asarray(sorted_values, dtype=np.float64)
    m = len(x)
    reach = reach or (lambda k: k + 1)

    def order(i):
        return lower if i <= 0 else upper if i > m else x[i - 1]

    p = rank + 1
    return max(math.exp(-k * b) * max(order(p + t) - order(p + t - k - 1) for t in range(reach(k) + 1))
               for k in range(m + 2))


ORACLE = [(0.1, 9.9532, 9.8248), (0.5, 6.6718, 4.4146), (1.0, 4.0467, 1.6240)]


@pytest.mark.parametrize(("b", "correct", "code_variant"), ORACLE)
def test_p4_oracle_two_sided_window(b, correct, code_variant):
    data = np.arange(1.0, 11.0)
    assert smooth_sensitivity_quantile(data, 8, b=b, upper=20.0) == pytest.approx(correct, abs=5e-5)
    assert literal_smooth_sensitivity(data, 8, b, 20.0) == pytest.approx(correct, abs=5e-5)
    # The reference code's one-sided window (t = 0..k) gives smaller, invalid values.
    assert literal_smooth_sensitivity(data, 8, b, 20.0, reach=lambda k: k) == pytest.approx(code_variant, abs=5e-5)
    assert code_variant < correct


def test_matches_the_literal_formula_on_random_small_inputs():
    rng = np.random.default_rng(0)
    for _ in range(300):
        pick_m, pick_upper, kind, pick_rank, pick_b = rng.uniform(size=5)
        m = 1 + int(pick_m * 24)
        upper = [1.0, 10.0, 100.0][int(pick_upper * 3)]
        # Half the cases are integers: ties and values at the bounds.
        scaled = rng.uniform(size=m) * (upper + 1 if kind < 0.5 else upper)
        data = np.sort(np.floor(scaled) if kind < 0.5 else scaled)
        rank = int(pick_rank * m)
        b = [0.01, 0.1, 0.7, 3.0][int(pick_b * 4)]
        assert smooth_sensitivity_quantile(data, rank, b=b, upper=upper) == pytest.approx(
            literal_smooth_sensitivity(data, rank, b, upper), rel=1e-12)


def test_matches_brute_force_on_a_larger_input():
    data = np.sort(np.round(np.exp(2.0 - np.log(np.random.default_rng(1).uniform(size=1500))), 1).clip(0, 200))
    lo = np.arange(0, 1502)[:, None]
    hi = np.arange(0, 1502)[None, :]
    x = np.concatenate([[0.0], data, [200.0]])
    for rank in (0, 700, 1400, 1499):
        p = rank + 1
        window = (lo <= p) & (hi >= p) & (lo < hi)
        brute = np.where(window, (x[hi] - x[lo]) * np.exp(-0.05 * (hi - lo - 1.0)), 0.0).max()
        assert smooth_sensitivity_quantile(data, rank, b=0.05, upper=200.0) == pytest.approx(brute, rel=1e-12)


def test_lower_padding_is_used():
    data = np.array([5.0, 6.0])
    # Rank 0 with no decay: the widest window is [lower, upper].
    assert smooth_sensitivity_quantile(data, 0, b=1e-12, upper=10.0, lower=2.0) == pytest.approx(8.0)


def test_non_increasing_in_b():
    data = np.sort((-3.0 * np.log(np.random.default_rng(2).uniform(size=400))).clip(0, 50))
    values = [smooth_sensitivity_quantile(data, 390, b=b, upper=50.0) for b in np.geomspace(1e-3, 5.0, 30)]
    assert np.all(np.diff(values) <= 1e-12)
    assert values[0] > values[-1]


@pytest.mark.parametrize(("kwargs", "name"), [(dict(rank=10), "rank"), (dict(rank=-1), "rank"),
                                               (dict(rank=2, b=0.0), "b"), (dict(rank=2, b=float("nan")), "b")])
def test_bad_parameters(kwargs, name):
    kwargs = {"b": 0.5, **kwargs}
    with pytest.raises(InvalidParameter, match=name):
        smooth_sensitivity_quantile(np.arange(10.0), upper=20.0, **kwargs)


OFFSET = -math.log(0.012)


@pytest.mark.parametrize(("epsilon", "delta", "b", "kappa"), [
    (1.0, 2.0**-20, 0.036067, 1.48118),
    (1.0, (2**20 + 65536) ** -2.0, None, 1.19085),
    (0.05, (2**20 + 65536) ** -2.0, 0.000898, 1.18892),
])
def test_kappa_oracles_with_the_papers_b(epsilon, delta, b, kappa):
    paper_b = epsilon / (2 * math.log(1 / delta))
    if b is not None:
        assert paper_b == pytest.approx(b, abs=5e-7)
    assert abs(OFFSET - 4.42285) < 5e-6
    assert pak_kappa(b=paper_b, a=epsilon / 2, beta_lt=0.006) == pytest.approx(kappa, abs=5e-6)


def test_default_b_is_the_nrs07_constant():
    assert smoothing_parameter(1.0, 2.0**-20) == pytest.approx(1 / (2 * math.log(2.0**21)))
    params = check_pak_threshold(epsilon=1.0, delta=2.0**-20, upper=1.0, tail_p=0.005, lam=0.85, beta_lt=0.006,
                                 rho=1.0)
    assert params.kappa == pytest.approx(1 / (1 - math.expm1(smoothing_parameter(1.0, 2.0**-20)) * OFFSET / 0.5))


def test_kappa_infeasible_is_refused():
    with pytest.raises(InvalidParameter, match="kappa is undefined"):
        pak_kappa(b=0.2, a=0.5, beta_lt=0.006)
    with pytest.raises(InvalidParameter, match="kappa is undefined"):
        check_pak_threshold(epsilon=1.0, delta=0.05, upper=1.0, tail_p=0.005, lam=0.85, beta_lt=0.006, rho=1.0)


@pytest.mark.parametrize(("m", "p", "lam"), [(20_000, 0.005, 0.5), (1000, 0.01, 0.85), (65_536, 0.005, 0.85),
                                             (50, 0.3, 0.9), (10, 0.005, 1.0)])
def test_quantile_miss_probability_is_the_binomial_cdf(m, p, lam):
    expected = stats.binom.cdf(math.floor(lam * p * m), m, p)
    assert quantile_miss_probability(m, tail_p=p, lam=lam) == pytest.approx(expected, rel=1e-9)


# A hold-out whose upper quantile is far from the padding, so SS is small and tau rarely clips.
GRID = np.linspace(0.0, 10.0, 2000)
SETTING = dict(epsilon=4.0, delta=1e-6, upper=100.0, tail_p=0.1, lam=0.5)


def test_threshold_is_centred_with_the_laplace_spread_of_eq_12():
    p = check_pak_threshold(beta_lt=0.006, rho=1.0, **SETTING)
    b, a = smoothing_parameter(4.0, 1e-6), 2.0
    rank = math.floor(2000 * (1 - 0.5 * 0.1))
    assert rank == 1900
    smooth = smooth_sensitivity_quantile(GRID, rank, b=b, upper=100.0)
    centre = GRID[rank] + p.kappa * smooth * OFFSET / a
    scale = p.kappa * smooth / a
    # one threshold per partition of one key: 3000 independent draws
    taus = np.array([pak_threshold(GRID, noise=threshold_draws(11, k), **SETTING) for k in range(3000)])
    assert abs(taus.mean() - centre) < 4 * math.sqrt(2 * scale**2 / 3000)
    # Laplace: the sample variance has relative standard error sqrt(5 / N).
    assert taus.var() / (2 * scale**2) == pytest.approx(1.0, abs=4 * math.sqrt(5 / 3000))
    # The offset puts tau below the released quantile only when Z < -off: probability beta_lt.
    assert np.mean(taus < GRID[rank]) < 0.006 + 4 * math.sqrt(0.006 / 3000)


def test_threshold_is_on_a_public_lattice_and_rho_is_post_processing():
    p = check_pak_threshold(beta_lt=0.006, rho=1.0, **SETTING)
    gamma = 2.0 ** (math.ceil(math.log2(max(p.kappa / 2.0, 1.0) * 100.0)) - _THRESHOLD_LATTICE_BITS)
    for seed in range(20):
        tau = pak_threshold(GRID, noise=threshold_draws(seed), **SETTING)
        scaled = pak_threshold(GRID, noise=threshold_draws(seed), rho=1.5, **SETTING)  # the same draw
        assert (tau / gamma).is_integer()
        assert scaled == min(100.0, 1.5 * tau)


def test_threshold_clips_to_upper_when_the_holdout_is_short():
    assert pak_threshold(np.arange(20.0), epsilon=1.0, delta=1e-6, upper=50.0, noise=threshold_draws(0)) == 50.0


@pytest.mark.parametrize(("kwargs", "error", "name"), [
    (dict(delta=0.0), InvalidParameter, "delta"),
    (dict(delta=1.0), InvalidParameter, "delta"),
    (dict(delta=float("nan")), InvalidParameter, "delta"),
    (dict(epsilon=0.0), InvalidParameter, "epsilon"),
    (dict(epsilon=-1.0), InvalidParameter, "epsilon"),
    (dict(epsilon=float("inf")), InvalidParameter, "epsilon"),
    (dict(tail_p=0.0), InvalidParameter, "tail_p"),
    (dict(lam=1.5), InvalidParameter, "lam"),
    (dict(beta_lt=0.5), InvalidParameter, "beta_lt"),
    (dict(rho=0.9), InvalidParameter, "rho"),
    (dict(upper=0.0), InvalidParameter, "upper"),
    (dict(holdout_sorted=np.array([3.0, 1.0, 2.0])), InvalidData, "sorted"),
    (dict(holdout_sorted=np.array([1.0, np.nan])), InvalidData, "NaN"),
    (dict(holdout_sorted=np.array([])), InvalidData, "empty"),
])
def test_pak_threshold_bad_input(kwargs, error, name):
    args = {"holdout_sorted": np.arange(10.0), "epsilon": 1.0, "delta": 1e-6, "upper": 20.0, **kwargs}
    with pytest.raises(error, match=name):
        pak_threshold(noise=threshold_draws(0), **args)
