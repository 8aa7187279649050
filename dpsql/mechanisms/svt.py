"""Sparse vector technique: AboveThreshold sessions with group resets (Dwork and Roth, Algorithm 1; Lyu et al. 2017).

Privacy cost (stated where it is defined): one *session* draws its noisy threshold
``theta + Lap(2 * sensitivity / epsilon)`` once, then answers "above / below" for a
sequence of queries ``q + Lap(4 * sensitivity / epsilon) >= threshold`` and stops at the
first "above". A session is ``epsilon``-DP for queries of L1 sensitivity
``sensitivity`` (Dwork & Roth, AboveThreshold with ``c = 1``: half the budget to the
threshold, half to the queries). Only the booleans are released, never the noisy
threshold nor the noisy queries.

A new session must draw a *fresh* threshold: ``theta + new noise``. Re-using the last
noisy threshold and adding noise to it (``theta_tilde += Lap``) lets the threshold
random-walk away from ``theta``; that is the bug of a public re-implementation of PeGaSus.
Here a threshold is only ever computed by :meth:`AboveThreshold.thresholds`,
which adds independent noise to the public ``theta`` and nothing else.

Noise is lattice Laplace (:class:`dpsql.mechanisms.LaplaceLattice`): the private query
is rounded to the lattice before integer noise is added, so comparisons never see a
float sum of a private value and continuous noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

from dpsql.mechanisms.laplace import LaplaceLattice
from dpsql.noise import Draws, Lane


@dataclass(frozen=True)
class AboveThreshold:
    """Calibrated noise of AboveThreshold sessions for queries of sensitivity ``sensitivity``.

    Draws are addressed by time step (:class:`~dpsql.noise.Lane` ``SVT_THRESHOLD`` for the
    threshold of a session opening at step ``t``, ``SVT_QUERY`` for the test at step ``t``),
    so callers can compute one threshold per *possible* session start and one query noise
    per *possible* query; each session uses its own threshold draw and each query its own
    query draw, which has exactly the distribution of the sequential algorithm.

    Examples
    --------
    >>> import dpsql
    >>> svt = AboveThreshold(sensitivity=2.0, epsilon=10.0)
    >>> with dpsql.testing.seeded(3) as keys:
    ...     session = svt.session(theta=10.0, noise=keys.partition())
    ...     answers = [session.above(q) for q in (0.0, 1.0, 500.0)]
    >>> answers
    [False, False, True]
    """

    sensitivity: float
    epsilon: float
    threshold_noise: LaplaceLattice = field(init=False)
    query_noise: LaplaceLattice = field(init=False)

    def __post_init__(self):
        epsilon = _rounding_safe_epsilon(self.sensitivity, self.epsilon)
        object.__setattr__(self, "threshold_noise", LaplaceLattice(2.0 * self.sensitivity, epsilon))
        object.__setattr__(self, "query_noise", LaplaceLattice(4.0 * self.sensitivity, epsilon))

    def thresholds(self, theta: float, noise: Draws, start: int, size: int) -> np.ndarray:
        """The noisy thresholds ``theta + Lap(2 sensitivity / epsilon)`` of sessions opening at
        steps ``start .. start + size - 1`` (each its own draw, never accumulated across sessions)."""
        return self.threshold_noise.release(np.full(size, float(theta)), noise.lane(Lane.SVT_THRESHOLD), start)

    def query_noise_units(self, noise: Draws, start: int, size: int) -> np.ndarray:
        """The query noise ``Lap(4 sensitivity / epsilon)`` of the tests at steps ``start ..``, in
        lattice units."""
        return self.query_noise.noise_units(noise.lane(Lane.SVT_QUERY), start, size)

    def above(self, queries: np.ndarray, query_noise_units: np.ndarray, thresholds) -> np.ndarray:
        """The answers for true (private) ``queries``, each perturbed by its own pre-drawn
        noise: ``q + noise >= threshold``."""
        lattice = self.query_noise
        return lattice.from_units(lattice.to_units(queries) + query_noise_units) >= thresholds

    def session(self, theta: float, noise: Draws, step: int = 0) -> AboveThresholdSession:
        """A new session opening at ``step`` with its own noisy threshold; its queries are the
        steps after it."""
        return AboveThresholdSession(self, self.thresholds(theta, noise, step, 1)[0], noise, step + 1)


def _rounding_safe_epsilon(sensitivity: float, epsilon: float) -> float:
    """The ``epsilon`` to build both lattices with, so that each noise scale is at least
    ``4 u / epsilon`` lattice units for the rounded query's sensitivity ``u`` (units of the
    query lattice, ``gamma_q = 2 gamma_t``).

    :class:`LaplaceLattice` adds one unit of rounding slack to the sensitivity it is
    given, ``(ceil(4 s / gamma_q) + 1) / epsilon``; AboveThreshold needs the slack scaled
    like the sensitivity: the threshold shifts by the rounded change ``u gamma_q = 2 u``
    threshold units at ``epsilon / 2`` and the "above" query by ``2 u`` query units at
    ``epsilon / 2``, so both scales must be ``4 u / epsilon`` with ``u = ceil(s / gamma_q)
    + 1``, up to three units more than the lattice's own slack gives. Lowering
    ``epsilon`` by that ratio (rounded down until the float scale is large enough) keeps
    the lattices' spacing and makes the session ``epsilon``-DP as stated.
    """
    gamma = LaplaceLattice(4.0 * sensitivity, epsilon).granularity
    slack_units = math.ceil(4.0 * sensitivity / gamma) + 1  # what LaplaceLattice scales by 1 / epsilon
    needed_units = 4 * (math.ceil(sensitivity / gamma) + 1)
    needed_scale = Fraction(needed_units) / Fraction(epsilon)
    calibrated = min(epsilon, epsilon * slack_units / needed_units)
    while Fraction(slack_units / calibrated) < needed_scale:
        calibrated = float(np.nextafter(calibrated, 0.0))
    return calibrated


class AboveThresholdSession:
    """One AboveThreshold session: ``above(q)`` until the first ``True``, then halted."""

    def __init__(self, svt: AboveThreshold, threshold: float, noise: Draws, step: int):
        self._svt = svt
        self._threshold = threshold
        self._noise = noise
        self._step = step
        self.halted = False

    def above(self, query: float) -> bool:
        """Answer one query; a halted session refuses further queries (its budget is spent)."""
        if self.halted:
            raise RuntimeError("this AboveThreshold session has halted; start a new session")
        units = self._svt.query_noise_units(self._noise, self._step, 1)
        self._step += 1
        self.halted = bool(self._svt.above(np.array([float(query)]), units, self._threshold)[0])
        return self.halted
