"""Square Wave density estimation on the collector's side (Li et al., SIGMOD 2020; used by ToPL).

Post-processing of Square Wave reports: it costs nothing beyond the reports. The exact
transition matrix of binned reports given binned inputs (:func:`sw_transition_matrix`),
the same operator applied in ``O(n log n)`` without a dense matrix (:class:`SWKernel`),
EM / EMS over report histograms (:func:`sw_em`) and ToPL's SW-W pruning of the estimated
density's upper tail (:func:`sw_w_prune`).
"""

from __future__ import annotations

import numpy as np

from dpsql.mechanisms.ldp.randomisers import SQUARE_WAVE, lattice_spacing


def sw_transition_matrix(eps: float, n_out: int = 1024, n_in: int = 1024) -> np.ndarray:
    """``K[j, i] = P(report in output bin j | input uniform in input bin i)``, exactly.

    Output bins split ``[-b, 1 + b]`` into ``n_out`` equal bins whose inner edges are
    rounded to the report lattice, so a lattice report falls in bin ``j`` exactly when the
    continuous draw does (see :func:`sw_histogram`); input bins split ``[0, 1]``. For a
    fixed input ``v``, ``P(y <= a) = q (a + b) + (p - q) |[-b, a] ∩ [v - b, v + b]|``; the
    overlap term averaged over ``v`` in ``[c1, c2]`` integrates in closed form to
    ``(R(a+b-c1) - R(a+b-c2) - R(a-b-c1) + R(a-b-c2)) / (c2 - c1)``, ``R(t) = max(t, 0)^2 / 2``.
    Columns sum to 1 (up to rounding).

    Examples
    --------
    >>> kernel = sw_transition_matrix(1.0, n_out=8, n_in=4)
    >>> kernel.shape, bool(np.allclose(kernel.sum(axis=0), 1.0))
    ((8, 4), True)
    """
    b, p, q = SQUARE_WAVE.constants(eps)
    edges = sw_output_edges(eps, n_out)[:, None]
    inputs = np.linspace(0.0, 1.0, n_in + 1)
    c1, c2 = inputs[:-1][None, :], inputs[1:][None, :]

    def ramp_square(t):
        return np.maximum(t, 0.0) ** 2 / 2.0

    overlap = (ramp_square(edges + b - c1) - ramp_square(edges + b - c2)
               - ramp_square(edges - b - c1) + ramp_square(edges - b - c2)) / (c2 - c1)
    cdf = q * (edges + b) + (p - q) * overlap
    return np.maximum(np.diff(cdf, axis=0), 0.0)


class SWKernel:
    """The operator of :func:`sw_transition_matrix` applied in ``O((n_in + n_out) log)`` time.

    ``K theta`` is the difference, at the output edges, of
    ``Phi(a) = q (a + b) sum(theta) + (p - q) / h [Psi(a + b) - Psi(a - b)]`` where
    ``Psi(s) = sum_k u_k R(s - c_k)`` runs over the input edges ``c_k`` with weights
    ``u_k = theta_k - theta_{k-1}`` (``R(t) = max(t, 0)^2 / 2``, ``h`` the input bin width):
    the closed form of the matrix entries summed by parts. A sum of ``R`` over the nodes
    below ``s`` is a quadratic in ``s`` with prefix-summed coefficients. ``K^T y`` is the
    same construction with the roles of input and output edges swapped. Exact (to
    rounding) and independent of any BLAS threading, which matters on a busy machine.

    Examples
    --------
    >>> theta = np.linspace(1.0, 2.0, 16)
    >>> bool(np.allclose(SWKernel(1.0, 32, 16).forward(theta), sw_transition_matrix(1.0, 32, 16) @ theta))
    True
    """

    def __init__(self, eps: float, n_out: int = 1024, n_in: int = 1024):
        b, p, q = SQUARE_WAVE.constants(eps)
        out_edges = sw_output_edges(eps, n_out)
        in_edges = np.linspace(0.0, 1.0, n_in + 1)
        self._q = q
        self._out_shifted = out_edges + b
        self._slope = (p - q) * n_in  # (p - q) / h, h = 1 / n_in the input bin width
        # Psi at a + b and a - b for the output edges a; Lambda at the input edges for the adjoint
        self._psi = _RampSums(np.concatenate([out_edges + b, out_edges - b]), in_edges, below=True)
        self._lambda = (_RampSums(in_edges, out_edges + b, below=False),
                        _RampSums(in_edges, out_edges - b, below=False))

    def forward(self, theta: np.ndarray) -> np.ndarray:
        """``K @ theta``: expected output-bin probabilities for input-bin masses ``theta``."""
        psi = self._psi(np.diff(theta, prepend=0.0, append=0.0))
        above, below = np.split(psi, 2)
        phi = self._q * self._out_shifted * theta.sum() + self._slope * (above - below)
        return np.diff(phi)

    def adjoint(self, y: np.ndarray) -> np.ndarray:
        """``K.T @ y``."""
        # Summation by parts: sum_j y_j (F(e_{j+1}) - F(e_j)) = sum_j z_j F(e_j), z_j = y_{j-1} - y_j.
        z = -np.diff(y, prepend=0.0, append=0.0)
        above, below = self._lambda
        lam = above(z) - below(z)
        return self._q * float(z @ self._out_shifted) + self._slope * (lam[:-1] - lam[1:])


class _RampSums:
    """``s -> sum_k w_k R(s - c_k)`` (``below``) or ``sum_k w_k R(c_k - s)`` at fixed points
    ``s`` over fixed sorted nodes ``c`` (``R(t) = max(t, 0)^2 / 2``), for any weights ``w``.

    Over the nodes on the right side of a point the sum is the quadratic
    ``(s^2 W0 - 2 s W1 + W2) / 2`` of the partial sums ``W_i = sum w_k c_k^i``; which nodes
    those are depends on the points and nodes only, so it is found once, and the three
    partial sums are one cumulative sum over a ``(3, nodes)`` array.
    """

    def __init__(self, points: np.ndarray, nodes: np.ndarray, *, below: bool):
        self._below = below
        self._k = np.searchsorted(nodes, points, side="left" if below else "right")
        self._powers = np.stack([np.ones_like(nodes), nodes, nodes**2])
        self._coefficients = 0.5 * np.stack([points**2, -2.0 * points, np.ones_like(points)])

    def __call__(self, weights: np.ndarray) -> np.ndarray:
        prefix = np.zeros((3, len(weights) + 1))
        np.cumsum(self._powers * weights, axis=1, out=prefix[:, 1:])
        partial = prefix[:, self._k] if self._below else prefix[:, -1:] - prefix[:, self._k]
        return (self._coefficients * partial).sum(axis=0)


def sw_output_edges(eps: float, n_out: int = 1024) -> np.ndarray:
    """Edges of the EM output bins: ``n_out`` equal bins on ``[-b, 1 + b]``, inner edges on the lattice.

    Examples
    --------
    >>> edges = sw_output_edges(1.0, 4)
    >>> bool(edges[0] == -SQUARE_WAVE.constants(1.0).b), bool(np.all(np.mod(edges[1:-1], 2.0**-20) == 0))
    (True, True)
    """
    lo, hi = SQUARE_WAVE.output_range(eps)
    g = lattice_spacing(hi - lo)
    edges = np.linspace(lo, hi, n_out + 1)
    edges[1:-1] = np.round(edges[1:-1] / g) * g
    return edges


def sw_histogram(reports, eps: float, n_out: int = 1024) -> np.ndarray:
    """Counts of SW reports in the EM output bins of :func:`sw_output_edges`.

    Examples
    --------
    >>> sw_histogram(np.array([-0.2, 0.5, 0.51, 1.2]), 1.0, n_out=3).tolist()
    [1.0, 2.0, 1.0]
    """
    inner = sw_output_edges(eps, n_out)[1:-1]
    bins = np.searchsorted(inner, np.asarray(reports, dtype=np.float64), side="right")
    return np.bincount(bins, minlength=n_out).astype(np.float64)


def _binomial_smooth(density: np.ndarray) -> np.ndarray:
    """``[1, 2, 1] / 4`` smoothing, renormalised at the two ends (weights ``[2, 1] / 3``)."""
    padded = np.concatenate([[0.0], density, [0.0]])
    weights = np.full(density.size, 4.0)
    weights[[0, -1]] = 3.0
    return (padded[:-2] + 2.0 * padded[1:-1] + padded[2:]) / weights


def sw_em(reports, eps: float, *, n_out: int = 1024, n_in: int = 1024, smoothing: bool = False,
          max_iterations: int = 10_000, tolerance: float = 1e-3) -> np.ndarray:
    """Estimate the input distribution on ``[0, 1]`` from SW reports by EM (or EMS).

    Returns the probability mass of each of ``n_in`` equal input bins (sums to 1).
    Iterates ``theta <- theta * K^T (hist / K theta)``, normalised, with the exact
    :func:`sw_transition_matrix`; ``smoothing=True`` applies the binomial kernel after each
    step (EMS). The kernel is applied by :class:`SWKernel` (exact, no dense matrix). Stops
    when the L1 change is at most ``1 / len(reports)`` or, after two
    iterations, when the log-likelihood improves by less than ``tolerance``, or after
    ``max_iterations`` (the reference code's rules). Post-processing: costs nothing.

    Examples
    --------
    >>> import dpsql
    >>> from dpsql.mechanisms.ldp import report_uniforms
    >>> reports = SQUARE_WAVE.perturb(np.full(20_000, 0.3), 2.0, report_uniforms(dpsql.testing.draws(3), 0, 20_000))
    >>> density = sw_em(reports, 2.0, n_in=64, n_out=64)
    >>> abs(int(np.argmax(density)) - int(0.3 * 64)) <= 2
    True
    """
    reports = np.asarray(reports, dtype=np.float64)
    kernel = SWKernel(eps, n_out, n_in)
    hist = sw_histogram(reports, eps, n_out)
    theta = np.full(n_in, 1.0 / n_in)
    expected = kernel.forward(theta)  # K theta, reused by the step after the likelihood
    previous_loglik = -np.inf
    for iteration in range(max_iterations):
        old = theta
        theta = old * kernel.adjoint(hist / expected)
        theta /= theta.sum()
        if smoothing:
            theta = _binomial_smooth(theta)
            theta /= theta.sum()
        if np.abs(theta - old).sum() <= 1.0 / reports.size:
            break
        expected = kernel.forward(theta)
        loglik = float(hist @ np.log(expected))
        if iteration > 1 and abs(loglik - previous_loglik) < tolerance:
            break
        previous_loglik = loglik
    return theta


def sw_w_prune(density, *, rule: str = "paper", fraction: float = 1e-4, run: int = 5) -> np.ndarray:
    """SW-W pruning of an estimated density whose upper tail should vanish (ToPS §4.1).

    ``rule="paper"``: find the first bin ``w`` at or above the median bin, holding at least
    ``fraction`` of the mass, whose next ``run`` bins all hold less; zero every bin after
    ``w``. The paper's words ("the first value w whose next 5 consecutive estimates are
    all below 0.01 %") leave open where "first" counts from. Counting from 0 lets empty
    bins below the data's support, or EM ripples there (observed for a point mass at
    ``eps = 2``), prune the whole distribution; SW-W exists to cut the *upper tail*, so
    we count from the median and require ``w`` itself to hold mass.
    ``rule="code"`` reproduces the reference code: zero every bin below ``fraction`` of the
    mass, then zero everything from the start of the first run of ``run`` zero bins, then
    spread the removed mass equally over the remaining non-zero bins.
    Either way, a rule that would remove all mass leaves the density unchanged; the result
    sums to 1. Post-processing: costs nothing.

    Examples
    --------
    >>> d = np.array([0.5, 0.3, 0.19, 0.0, 0.0, 0.0, 0.0, 0.0, 0.01])
    >>> sw_w_prune(d).round(3).tolist()
    [0.505, 0.303, 0.192, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    """
    density = np.asarray(density, dtype=np.float64)
    total = density.sum()
    small = density < fraction * total
    if rule == "paper":
        followed_by_small_run = np.lib.stride_tricks.sliding_window_view(small[1:], run).all(axis=1)
        median_bin = int(np.searchsorted(np.cumsum(density), 0.5 * total))
        candidate = ~small[:followed_by_small_run.size] & followed_by_small_run
        cut = median_bin + np.flatnonzero(candidate[median_bin:])
        pruned = density.copy()
        if cut.size:
            pruned[cut[0] + 1:] = 0.0
        return pruned / pruned.sum()
    if rule != "code":
        raise ValueError(f"unknown pruning rule {rule!r}")
    pruned = np.where(small, 0.0, density)
    zero = np.concatenate([[False], pruned == 0, [False]])
    starts = np.flatnonzero(~zero[:-1] & zero[1:])
    ends = np.flatnonzero(zero[:-1] & ~zero[1:])
    long_runs = starts[ends - starts >= run]
    if long_runs.size:
        pruned[long_runs[0]:] = 0.0
    kept = pruned > 0
    if not kept.any():
        return density / total
    pruned[kept] += (total - pruned.sum()) / kept.sum()
    return pruned / total
