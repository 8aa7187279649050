"""Square Wave density estimation (ToPL §5): the exact transition matrix,
the fast kernel, EM / EMS and SW-W pruning."""

import numpy as np
import pytest

from dpsql.mechanisms.ldp import (
    SQUARE_WAVE,
    SWKernel,
    report_uniforms,
    sw_em,
    sw_histogram,
    sw_output_edges,
    sw_transition_matrix,
    sw_w_prune,
)
from dpsql.mechanisms.ldp.sw_estimation import _binomial_smooth
from dpsql.testing import draws


def sw_reports(values, eps, seed):
    return SQUARE_WAVE.perturb(values, eps, report_uniforms(draws(seed), 0, len(values), uniforms=1))


@pytest.mark.parametrize("eps", [0.5, 2.0])
def test_transition_matrix_is_exact(eps):
    n_out, n_in = 32, 16
    kernel = sw_transition_matrix(eps, n_out, n_in)
    np.testing.assert_allclose(kernel.sum(axis=0), 1.0, atol=1e-12)
    edges = sw_output_edges(eps, n_out)
    for i in (0, 5, 15):
        vs = (i + (np.arange(4000) + 0.5) / 4000) / n_in  # midpoint rule over the input bin
        per_v = np.diff(np.stack([SQUARE_WAVE.cdf(edges, v, eps) for v in vs]), axis=1).mean(axis=0)
        np.testing.assert_allclose(kernel[:, i], per_v, atol=1e-7)


@pytest.mark.parametrize("eps", [0.05, 1.0, 4.0])
def test_fast_kernel_equals_the_dense_matrix(eps):
    kernel, fast = sw_transition_matrix(eps, 1024, 512), SWKernel(eps, 1024, 512)
    rng = np.random.default_rng(2)  # test vectors, not privacy noise
    theta, y = rng.uniform(size=512), rng.uniform(size=1024)
    np.testing.assert_allclose(fast.forward(theta), kernel @ theta, rtol=1e-9)
    np.testing.assert_allclose(fast.adjoint(y), kernel.T @ y, rtol=1e-9)


def test_histogram_of_lattice_reports_matches_the_bin_edges_exactly():
    eps, x, n_out = 1.0, 0.37, 64
    reports, mass = SQUARE_WAVE.cell_probabilities(x, eps)
    binned = np.bincount(np.searchsorted(sw_output_edges(eps, n_out)[1:-1], reports, side="right"),
                         weights=mass, minlength=n_out)
    np.testing.assert_allclose(binned, np.diff(SQUARE_WAVE.cdf(sw_output_edges(eps, n_out), x, eps)), atol=1e-12)
    counts = sw_histogram(reports[::1000], eps, n_out)
    assert counts.sum() == reports[::1000].size


def test_em_recovers_a_point_mass():
    reports = sw_reports(np.full(100_000, 0.3), 2.0, 21)
    density = sw_em(reports, 2.0)
    assert density.sum() == pytest.approx(1.0)
    assert abs(int(np.argmax(density)) - int(0.3 * 1024)) <= 2


def test_em_recovers_a_known_distribution():
    eps, n = 2.0, 100_000
    truth = 0.2 + 0.4 * np.random.default_rng(22).uniform(size=n)
    reports = sw_reports(truth, eps, 22)
    density = sw_em(reports, eps, n_in=256, n_out=256)
    centres = (np.arange(256) + 0.5) / 256
    assert density[(centres > 0.2) & (centres < 0.6)].sum() > 0.85
    # Wasserstein-1 distance between estimated and true CDFs on [0, 1].
    true_cdf = np.clip((centres + 0.5 / 256 - 0.2) / 0.4, 0, 1)
    assert np.abs(np.cumsum(density) - true_cdf).sum() / 256 < 0.03
    smoothed = sw_em(reports, eps, n_in=256, n_out=256, smoothing=True)
    assert smoothed.sum() == pytest.approx(1.0)
    assert np.abs(np.diff(smoothed, 2)).sum() < np.abs(np.diff(density, 2)).sum()


def test_binomial_smoothing_keeps_a_uniform_density_and_mass():
    np.testing.assert_allclose(_binomial_smooth(np.full(8, 0.125)), 0.125)
    spike = np.r_[1.0, np.zeros(4)]
    np.testing.assert_allclose(_binomial_smooth(spike), [2 / 3, 1 / 4, 0, 0, 0])


def test_sw_w_prune_paper_rule():
    d = np.array([0.5, 0.3, 0.19, 0.0, 0.0, 0.0, 0.0, 0.0, 0.01])
    np.testing.assert_allclose(sw_w_prune(d), np.r_[d[:3], np.zeros(6)] / 0.99)
    # Empty bins below the support do not qualify as w: w must itself hold mass.
    shifted = np.r_[np.zeros(6), d]
    np.testing.assert_allclose(sw_w_prune(shifted), np.r_[np.zeros(6), d[:3], np.zeros(6)] / 0.99)
    # Nor do ripples below the median followed by small bins: the search starts at the median bin.
    ripple = np.r_[0.001, np.zeros(6), 0.3, 0.4, 0.299, np.zeros(6)]
    np.testing.assert_allclose(sw_w_prune(ripple), ripple)
    # A run shorter than 5 small bins does not prune.
    short = np.array([0.5, 0.3, 0.0, 0.0, 0.0, 0.0, 0.2])
    np.testing.assert_allclose(sw_w_prune(short), short)
    # Small means below fraction * total (here 1e-4).
    tiny = np.array([0.6, 0.39, 5e-5, 5e-5, 5e-5, 5e-5, 5e-5, 0.00975])
    assert sw_w_prune(tiny)[2:].sum() == 0.0


def test_sw_w_prune_code_rule():
    d = np.array([0.5, 5e-5, 0.3, 0.1, 0.0, 0.0, 0.0, 0.0, 0.0, 0.09995])
    pruned = sw_w_prune(d, rule="code")
    # Bin 1 zeroed (< 1e-4), tail from the 5-zero run removed, lost mass spread over the 3 kept bins.
    lost = 5e-5 + 0.09995
    np.testing.assert_allclose(pruned, [0.5 + lost / 3, 0, 0.3 + lost / 3, 0.1 + lost / 3, 0, 0, 0, 0, 0, 0])
    # The code's rule on a density with an empty start would remove everything: left unchanged.
    empty_start = np.r_[np.zeros(5), 1.0]
    np.testing.assert_allclose(sw_w_prune(empty_start, rule="code"), empty_start)
    with pytest.raises(ValueError, match="pruning rule"):
        sw_w_prune(d, rule="other")
