"""Local-DP randomisers (Square Wave, Piecewise, Stochastic Rounding, Hybrid; ToPS App. E): constants,
exact distributions, the lattice, the LDP ratio bound cell by cell, moments, and reports as functions of
their addresses."""

import math

import numpy as np
import pytest

import dpsql
from dpsql.mechanisms.ldp import (
    HYBRID,
    PIECEWISE,
    SQUARE_WAVE,
    STOCHASTIC_ROUNDING,
    lattice_spacing,
    report_uniforms,
)
from dpsql.noise import Lane
from dpsql.testing import draws

RANDOMISERS = [SQUARE_WAVE, PIECEWISE, STOCHASTIC_ROUNDING, HYBRID]


def perturbed(randomiser, x, eps, seed):
    """``randomiser``'s reports of ``x`` with the uniforms of reports ``0 ..`` of ``seed``'s draws."""
    return randomiser.perturb(x, eps, report_uniforms(draws(seed), 0, len(x), uniforms=randomiser.uniforms))


def exact_moments(randomiser, x, eps):
    """Mean, variance and fourth central moment of the released (lattice) report."""
    reports, mass = randomiser.cell_probabilities(x, eps)
    mean = mass @ reports
    centred = reports - mean
    return mean, mass @ centred**2, mass @ centred**4


# -- Square Wave --------------------------------------------------------------------------------


@pytest.mark.parametrize("eps, b, p, q, mean1, var1", [
    (0.05, 0.4836, 0.5213, 0.4958, 0.51229, 0.32248),
    (0.5, 0.3582, 0.7559, 0.4585, 0.60653, 0.24420),
    (1.0, 0.2561, 1.1363, 0.4180, 0.68394, 0.18663),
    (2.0, 0.1293, 2.5380, 0.3435, 0.78383, 0.12160),
])
def test_square_wave_oracles(eps, b, p, q, mean1, var1):
    c = SQUARE_WAVE.constants(eps)
    assert (round(c.b, 4), round(c.p, 4), round(c.q, 4)) == (b, p, q)
    assert c.p / c.q == pytest.approx(math.exp(eps), rel=1e-12)
    assert 2 * c.b * c.p + c.q == pytest.approx(1.0, abs=1e-14)  # total mass
    assert round(float(SQUARE_WAVE.mean(1.0, eps)), 5) == mean1
    assert round(float(SQUARE_WAVE.variance(1.0, eps)), 5) == var1
    # DU's closed form for Var(D_x), and the spec's mean formula, at x = 1.
    du = 2 * c.b**3 * c.p / 3 - c.b**2 * c.q**2 + c.b**2 * c.q - c.b * c.q**2 + c.b * c.q - c.q**2 / 4 + c.q / 3
    assert float(SQUARE_WAVE.variance(1.0, eps)) == pytest.approx(du, rel=1e-12)
    assert float(SQUARE_WAVE.mean(1.0, eps)) == pytest.approx(2 * c.b * c.p - c.b * c.q + c.q / 2, rel=1e-12)
    assert SQUARE_WAVE.output_range(eps) == (-c.b, 1 + c.b)


def test_square_wave_small_epsilon_is_continuous_and_tends_to_half():
    below, above = SQUARE_WAVE.constants(0.01 - 1e-12).b, SQUARE_WAVE.constants(0.01).b
    assert abs(below - above) < 5e-12  # the closed form loses ~1e-12 to cancellation at 0.01
    assert SQUARE_WAVE.constants(1e-9).b == pytest.approx(0.5, abs=1e-9)
    c = SQUARE_WAVE.constants(1e-6)
    assert 2 * c.b * c.p + c.q == pytest.approx(1.0, abs=1e-12)


def test_square_wave_moments_match_numerical_integration():
    eps = 1.0
    y = np.linspace(-0.3, 1.3, 1_600_001)
    for x in (0.0, 0.37, 1.0):
        density = SQUARE_WAVE.pdf(y, x, eps)
        dy = y[1] - y[0]
        mean = np.sum(y * density) * dy
        assert mean == pytest.approx(float(SQUARE_WAVE.mean(x, eps)), abs=1e-5)
        assert mean == pytest.approx(0.5 + 2 * 0.2561 * (1.1363 - 0.4180) * (x - 0.5), abs=1e-3)
        var = np.sum((y - mean) ** 2 * density) * dy
        assert var == pytest.approx(float(SQUARE_WAVE.variance(x, eps)), abs=1e-5)
        mu4 = np.sum((y - mean) ** 4 * density) * dy
        assert mu4 == pytest.approx(float(SQUARE_WAVE.central_moment4(x, eps)), abs=1e-5)
    assert round(float(SQUARE_WAVE.central_moment4(1.0, 1.0)), 5) == 0.07530  # DU's mu_4 oracle


def test_square_wave_worst_variance_is_at_the_domain_end():
    xs = np.linspace(0, 1, 101)
    for eps in (0.1, 1.0, 3.0):
        assert SQUARE_WAVE.worst_variance(eps) == pytest.approx(SQUARE_WAVE.variance(xs, eps).max(), rel=1e-12)


def test_square_wave_empirical_moments_and_debias():
    n, eps = 200_000, 1.0
    for x in (0.0, 0.3, 1.0):
        y = perturbed(SQUARE_WAVE, np.full(n, x), eps, 11)
        mean, var, mu4 = exact_moments(SQUARE_WAVE, x, eps)
        assert abs(y.mean() - mean) < 4 * math.sqrt(var / n)
        assert abs(y.var() - var) < 4 * math.sqrt((mu4 - var**2) / n)
        estimate = SQUARE_WAVE.debias(y, eps)
        sd = math.sqrt(float(SQUARE_WAVE.debiased_variance(x, eps)) / n)
        assert abs(estimate.mean() - x) < 4 * sd


def test_inputs_are_clipped_to_the_domain():
    y = perturbed(SQUARE_WAVE, np.full(50_000, 7.0), 2.0, 1)
    lo, hi = SQUARE_WAVE.output_range(2.0)
    assert y.min() >= lo - 1e-6 and y.max() <= hi + 1e-6
    assert abs(y.mean() - float(SQUARE_WAVE.mean(1.0, 2.0))) < 0.01
    assert float(PIECEWISE.variance(-3.0, 1.0)) == float(PIECEWISE.variance(-1.0, 1.0))


# -- exact distributions: lattice, ratio bound, moments -------------------------------------------------


@pytest.mark.parametrize("randomiser", [SQUARE_WAVE, PIECEWISE], ids=lambda r: r.name)
def test_density_ratio_bound_for_all_input_pairs(randomiser):
    for eps in (0.05, 1.0, 3.0):
        lo, hi = randomiser.output_range(eps)
        y = np.linspace(lo, hi, 2001)[:, None]
        xs = np.linspace(*randomiser.domain, 41)
        density = randomiser.pdf(y, xs[None, :], eps)  # (y, x)
        assert density.min() > 0
        ratio = density.max(axis=1) / density.min(axis=1)
        assert ratio.max() == pytest.approx(math.exp(eps), rel=1e-12)


@pytest.mark.parametrize("randomiser", RANDOMISERS, ids=lambda r: r.name)
@pytest.mark.parametrize("eps", [0.05, 0.5, 1.0, 2.0])
def test_ratio_bound_holds_cell_by_cell(randomiser, eps):
    lo, hi = randomiser.domain
    inputs = [lo, hi, lo + 0.3 * (hi - lo), lo + 0.71 * (hi - lo)]
    support = None
    distributions = []
    for x in inputs:
        reports, mass = randomiser.cell_probabilities(x, eps)
        assert mass.sum() == pytest.approx(1.0, abs=1e-9)
        assert np.all(mass >= 0)
        if support is None:
            support = reports
        np.testing.assert_array_equal(reports, support)  # the report set does not depend on the input
        distributions.append(mass)
    bound = math.exp(eps) * (1 + 1e-9)
    for a in distributions:
        for b in distributions:
            positive = b > 0
            assert np.all(a[~positive] == 0)
            assert np.max(a[positive] / b[positive]) <= bound
    # The bound is attained (the randomiser uses its whole budget) for the extreme inputs.
    worst = np.max(distributions[0][distributions[1] > 0] / distributions[1][distributions[1] > 0])
    assert worst == pytest.approx(math.exp(eps), rel=1e-6)


@pytest.mark.parametrize("randomiser, continuous", [(SQUARE_WAVE, SQUARE_WAVE), (PIECEWISE, PIECEWISE),
                                                    (HYBRID, PIECEWISE)], ids=["square_wave", "piecewise", "hybrid"])
def test_reports_lie_on_the_public_lattice(randomiser, continuous):
    eps = 1.0
    lo, hi = randomiser.domain
    support = randomiser.cell_probabilities(lo, eps)[0]
    y = perturbed(randomiser, np.linspace(lo, hi, 20_000), eps, 5)
    assert np.all(np.isin(y, support))
    # Continuous reports are midpoints of power-of-two cells; HM's SR reports are the two public points ±C.
    out_lo, out_hi = continuous.output_range(eps)
    g = lattice_spacing(out_hi - out_lo)
    midpoint = np.mod(y / g - 0.5, 1.0) == 0
    rounding = np.isin(y, [-STOCHASTIC_ROUNDING.bound(eps), STOCHASTIC_ROUNDING.bound(eps)])
    assert np.all(midpoint | (rounding & (randomiser is HYBRID)))
    assert midpoint.mean() > 0.3


@pytest.mark.parametrize("randomiser, inputs", [(SQUARE_WAVE, (0.0, 0.3, 1.0)), (PIECEWISE, (-1.0, 0.2, 1.0))],
                         ids=["square_wave", "piecewise"])
def test_lattice_moves_moments_by_order_g_squared(randomiser, inputs):
    for eps in (0.05, 1.0, 4.0):
        lo, hi = randomiser.output_range(eps)
        g = lattice_spacing(hi - lo)
        for x in inputs:
            mean, var, _ = exact_moments(randomiser, x, eps)
            continuous_mean = float(SQUARE_WAVE.mean(x, eps)) if randomiser is SQUARE_WAVE else x
            assert abs(mean - continuous_mean) <= 2 * g**2 + 1e-13
            assert abs(var - float(randomiser.variance(x, eps))) <= 2 * g**2 + 1e-12


@pytest.mark.parametrize("randomiser", [PIECEWISE, STOCHASTIC_ROUNDING, HYBRID], ids=lambda r: r.name)
@pytest.mark.parametrize("eps", [0.5, 1.0, 2.0])
def test_unbiased_with_the_stated_variance(randomiser, eps):
    n = 100_000
    for x in (-1.0, -0.2, 0.6, 1.0):
        mean, var, mu4 = exact_moments(randomiser, x, eps)
        assert mean == pytest.approx(x, abs=1e-9)  # unbiased, exactly (up to the lattice)
        assert var == pytest.approx(float(randomiser.variance(x, eps)), rel=1e-9)
        y = perturbed(randomiser, np.full(n, x), eps, int(100 * (x + 2) + 10 * eps))
        assert abs(y.mean() - x) < 4 * math.sqrt(var / n)
        assert abs(y.var() - var) < 4 * math.sqrt((mu4 - var**2) / n)
        assert mu4 == pytest.approx(float(randomiser.central_moment4(x, eps)), rel=1e-9)
        assert mu4 / var**2 - 3 <= randomiser.worst_excess_kurtosis(eps) + 1e-9


@pytest.mark.parametrize("randomiser", RANDOMISERS, ids=lambda r: r.name)
def test_worst_excess_kurtosis_bounds_every_input(randomiser):
    for eps in (0.05, 1.0, 4.0):
        worst = randomiser.worst_excess_kurtosis(eps)
        fine = randomiser.excess_kurtosis(np.linspace(*randomiser.domain, 100_001), eps)
        assert fine.max() <= worst + 1e-6
    for x in randomiser.domain:
        _, var, mu4 = exact_moments(randomiser, x, 1.0)
        assert mu4 / var**2 - 3 <= randomiser.worst_excess_kurtosis(1.0) + 1e-9
    # Two-point SR: the closed form (1 - 6 p (1 - p)) / (p (1 - p)) at the extreme input.
    up = STOCHASTIC_ROUNDING.positive_probability(1.0, 2.0)
    assert STOCHASTIC_ROUNDING.worst_excess_kurtosis(2.0) == pytest.approx((1 - 6 * up * (1 - up)) / (up * (1 - up)))


@pytest.mark.parametrize("eps, c_pm, c_sr", [(0.05, 80.004, 40.008), (1.0, 4.0830, 2.1640), (2.0, 2.1640, 1.3130)])
def test_piecewise_and_rounding_constants(eps, c_pm, c_sr):
    assert PIECEWISE.bound(eps) == pytest.approx(c_pm, abs=6e-4)
    assert STOCHASTIC_ROUNDING.bound(eps) == pytest.approx(c_sr, abs=6e-4)
    assert PIECEWISE.output_range(eps) == (-PIECEWISE.bound(eps), PIECEWISE.bound(eps))
    assert PIECEWISE.bound(0.01) == pytest.approx(400, rel=1e-3)
    up = STOCHASTIC_ROUNDING.positive_probability(1.0, eps)
    assert up / (1 - up) == pytest.approx(math.exp(eps), rel=1e-12)


def test_piecewise_closed_form_variance_and_density_constants():
    for eps in (0.3, 1.0, 2.5):
        d = PIECEWISE.density(np.array([-1.0, 0.0, 0.4, 1.0]), eps)
        assert d.p / d.q == pytest.approx(math.exp(eps), rel=1e-12)
        np.testing.assert_allclose(d.central_moment(2, d.mean()), PIECEWISE.variance(d.a * 0 + [-1, 0, 0.4, 1], eps),
                                   rtol=1e-10)
        np.testing.assert_allclose(d.mean(), [-1.0, 0.0, 0.4, 1.0], atol=1e-12)
        # Domain bounds, not the per-sample band, bound the reports (the reference code's P9 bug).
        assert np.all(d.a >= -PIECEWISE.bound(eps) - 1e-12) and np.all(d.c <= PIECEWISE.bound(eps) + 1e-12)


@pytest.mark.parametrize("eps, worst, alpha", [(0.05, 1600.667, 0.0), (0.5, 16.671, 0.0), (1.0, 4.2890, 0.3935),
                                               (2.0, 1.0423, 0.6321)])
def test_hybrid_oracles(eps, worst, alpha):
    assert HYBRID.worst_variance(eps) == pytest.approx(worst, abs=6e-4)
    assert HYBRID.pm_probability(eps) == pytest.approx(alpha, abs=6e-5)
    if eps > 0.61:
        half = math.exp(eps / 2)
        eq22 = (half + 3) / (3 * half * (half - 1)) + (math.exp(eps) + 1) ** 2 / (half * math.expm1(eps) ** 2)
        assert HYBRID.worst_variance(eps) == pytest.approx(eq22, rel=1e-12)
        # The variance does not depend on the input above the switch.
        np.testing.assert_allclose(HYBRID.variance(np.linspace(-1, 1, 11), eps), eq22, rtol=1e-12)
    else:
        assert HYBRID.worst_variance(eps) == pytest.approx(STOCHASTIC_ROUNDING.bound(eps) ** 2, rel=1e-12)


def test_hybrid_switch_boundary_is_the_papers():
    assert HYBRID.pm_probability(0.61) == 0.0  # paper: eps <= 0.61 -> SR only (the code used <)
    assert HYBRID.pm_probability(0.6100001) > 0.0
    y = perturbed(HYBRID, np.zeros(1000), 0.61, 3)
    assert set(np.unique(np.abs(y))) == {STOCHASTIC_ROUNDING.bound(0.61)}


def test_pdf_matches_cell_probabilities():
    eps, x = 1.0, 0.3
    for randomiser in (SQUARE_WAVE, PIECEWISE):
        reports, mass = randomiser.cell_probabilities(x, eps)
        g = reports[1] - reports[0]
        inner = slice(2, -2)
        np.testing.assert_allclose(mass[inner], randomiser.pdf(reports[inner], x, eps) * g, atol=2 * g)
    assert float(STOCHASTIC_ROUNDING.pdf(STOCHASTIC_ROUNDING.bound(eps), 1.0, eps)) == pytest.approx(
        math.exp(eps) / (math.exp(eps) + 1))


# -- reports as functions of their addresses -----------------------------------------------------------


@pytest.mark.parametrize("eps", [0.005, 0.05, 0.4, 1.0, 3.0, 12.0])
def test_plain_float_sampler_is_perturb_bit_for_bit(eps):
    """The sequential loops' Square Wave is the vectorised one, to the last bit, on every branch
    of the inverse CDF (u at and around the band's edges) and at both ends of the input domain."""
    b, p, q = SQUARE_WAVE.constants(eps)
    rng = np.random.default_rng(7)  # test inputs, not privacy noise
    z = np.concatenate([[0.0, 1.0, 0.5, 1e-300, 1 - 2**-53], rng.uniform(size=3000)])
    u = rng.uniform(size=z.size)
    edges = np.concatenate([q * z, q * z + 2 * b * p])  # where the inverse CDF changes branch
    z = np.concatenate([z, z, z, z, z])
    u = np.concatenate([u, edges, np.nextafter(edges, 0), np.nextafter(edges, 1)])[:z.size]
    sample = SQUARE_WAVE.sampler(eps)
    plain = np.array([sample(a, c) for a, c in zip(z.tolist(), u.tolist())])
    np.testing.assert_array_equal(plain, SQUARE_WAVE.perturb(z, eps, u[:, None]))


def test_report_uniforms_are_addressed_by_key_partition_and_index():
    keys = dpsql.testing.keys(5)
    user = keys.partition(b"user-1")
    whole = report_uniforms(user, 0, 100)
    np.testing.assert_array_equal(whole, report_uniforms(dpsql.testing.keys(5).partition(b"user-1"), 0, 100))
    np.testing.assert_array_equal(whole[40:70], report_uniforms(user, 40, 30))  # any piece, the same uniforms
    np.testing.assert_array_equal(whole[:, 1], user.lane(Lane.LDP_REPORT, 1).uniform(0, 100))  # uniform k: level k
    assert not np.isin(report_uniforms(keys.partition(b"user-2"), 0, 100), whole).any()
    assert not np.isin(report_uniforms(dpsql.testing.keys(6).partition(b"user-1"), 0, 100), whole).any()
    assert not np.isin(report_uniforms(user, 0, 100, lane=Lane.LDP_CHOICE), whole).any()
    batch = keys.partitions([b"user-2", b"user-1"])
    np.testing.assert_array_equal(report_uniforms(batch, 0, 100)[1], whole)


def test_hybrid_takes_its_choice_from_the_second_uniform():
    u = report_uniforms(draws(4), 0, 20_000, uniforms=HYBRID.uniforms)
    y = HYBRID.perturb(np.zeros(20_000), 2.0, u)
    chose_pm = u[:, 1] < HYBRID.pm_probability(2.0)
    np.testing.assert_array_equal(y[chose_pm], PIECEWISE.perturb(np.zeros(chose_pm.sum()), 2.0, u[chose_pm]))
    np.testing.assert_array_equal(np.abs(y[~chose_pm]), STOCHASTIC_ROUNDING.bound(2.0))
