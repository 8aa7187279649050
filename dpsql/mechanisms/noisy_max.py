"""Report-Noisy-Max (ALGORITHMS.md P2) and the ToPS threshold optimizer built on it (4.2).

Privacy cost: ``epsilon``-DP (pure) for scores whose sensitivity is ``sensitivity``.
When every score moves in the same direction on a neighbouring input
(``monotonic=True``) the noise scale is ``sensitivity / epsilon``; otherwise it is
``2 * sensitivity / epsilon`` (Dwork & Roth, Claim 3.9). Only the index is released.
"""

from __future__ import annotations

import math

import numpy as np

from dpsql.mechanisms.laplace import LaplaceLattice
from dpsql.noise import NoiseSource


def report_noisy_max(scores: np.ndarray, *, epsilon: float, noise: NoiseSource,
                     sensitivity: float = 1.0, monotonic: bool = True) -> int:
    """Index of the largest ``score + Laplace`` (lattice noise, see :mod:`.laplace`).

    Examples
    --------
    >>> import dpsql
    >>> with dpsql.testing.seeded(0) as source:
    ...     report_noisy_max(np.array([0.0, 100.0, 3.0]), epsilon=10.0, noise=source)
    1
    """
    # Non-monotone scores need twice the scale of the *rounded* score change (lattice slack
    # included): halving epsilon doubles both, where doubling the sensitivity would not.
    lap = LaplaceLattice(sensitivity=sensitivity, epsilon=epsilon if monotonic else epsilon / 2)
    return int(np.argmax(lap.release(np.asarray(scores, dtype=np.float64), noise)))


#: ``levels_for_nm`` choices: the paper's ``log_fanout(r)`` or the reference code's ``int(log_fanout r) + 1``.
NM_LEVELS = ("paper", "code")


def nm_slope(m: int, *, epsilon_perturber: float, r: int, fanout: int = 16, c: float = 60.0,
             levels_for_nm: str = "paper") -> float:
    """Noise-error coefficient of ToPS Eq. 6: ``3 m / (c r eps) * sqrt(2 (fanout - 1) levels^3)``.

    ``levels`` is ``log_fanout(r)`` (paper) or ``int(log_fanout r) + 1`` (reference code, where
    ``r`` is the stream length ``n - m``); ALGORITHMS.md 4.5.2.

    >>> round(nm_slope(65536, epsilon_perturber=0.05, r=2**20), 4)
    3.8273
    >>> round(nm_slope(65536, epsilon_perturber=0.05, r=2**20, levels_for_nm="code"), 4)
    5.0312
    """
    if levels_for_nm == "paper":
        levels = math.log(r) / math.log(fanout)
    else:
        levels, span = 0, 1
        while span * fanout <= r:
            levels, span = levels + 1, span * fanout
        levels += 1
    return 3.0 * m / (c * r * epsilon_perturber) * math.sqrt(2.0 * (fanout - 1) * levels**3)


def default_step(upper: float) -> float:
    """Candidate spacing when none is given: the paper's integer grid ``1, 2, ..., B`` when ``B``
    is a whole number from 64 to 65,536; otherwise 1,024 evenly spaced candidates ``B/1024, ..., B``
    (a bound that small or fractional says nothing about integer data, and one that large
    would make the grid needlessly long).

    >>> default_step(2000.0), default_step(1.0), default_step(1e9)
    (1.0, 0.0009765625, 976562.5)
    """
    if float(upper).is_integer() and 64 <= upper <= 65536:
        return 1.0
    return upper / 1024


def nm_scores(holdout_sorted: np.ndarray, candidates: np.ndarray, slope: float) -> np.ndarray:
    """ToPS Eq. 6 scores ``q(theta) = -slope * theta - m_theta``, ``m_theta = #{v > theta}``.

    Replacing one value moves every ``m_theta`` by at most 1 and all in the same direction,
    so the scores have sensitivity 1 and are monotone.

    >>> nm_scores(np.array([1., 1, 2, 2, 3, 3, 4, 5, 9, 20]), np.array([3., 4, 5, 6, 9]), 0.5)
    array([-5.5, -5. , -4.5, -5. , -5.5])
    """
    above = len(holdout_sorted) - np.searchsorted(holdout_sorted, candidates, side="right")
    return -slope * candidates - above


def nm_threshold(holdout_sorted: np.ndarray, *, epsilon: float, upper: float, epsilon_perturber: float, r: int,
                 fanout: int = 16, c: float = 60.0, step: float | None = None, levels_for_nm: str = "paper",
                 noise: NoiseSource) -> float:
    """ToPS threshold optimizer (ALGORITHMS.md 4.2 Phase 1): Report-Noisy-Max over Eq. 6.

    Balances the hierarchy's noise, which grows with the threshold, against the truncation
    bias ``#{v > theta}`` on the sorted hold-out (values in ``[0, upper]``). Candidates are
    ``step, 2 step, ..., upper`` (the last one capped at ``upper``; default step: see
    :func:`default_step`).

    Privacy: ``epsilon``-DP on the hold-out (replace-one-value neighbours): Report-Noisy-Max
    with sensitivity 1 on monotone scores; only the chosen candidate is released.
    ``epsilon_perturber`` is the budget of the stream phase the threshold is for; it enters the
    scores as a public constant.

    Examples
    --------
    >>> import dpsql
    >>> holdout = np.sort(np.r_[np.full(990, 10.0), np.full(10, 1000.0)])
    >>> with dpsql.testing.seeded(3) as source:
    ...     theta = nm_threshold(holdout, epsilon=5.0, upper=1000.0, epsilon_perturber=0.1, r=4096, noise=source)
    >>> theta
    10.0
    """
    step = default_step(upper) if step is None else step
    count = max(1, math.ceil(upper / step - 1e-9))
    candidates = np.minimum(step * np.arange(1, count + 1), upper)
    slope = nm_slope(len(holdout_sorted), epsilon_perturber=epsilon_perturber, r=r, fanout=fanout, c=c,
                     levels_for_nm=levels_for_nm)
    scores = nm_scores(holdout_sorted, candidates, slope)
    return float(candidates[report_noisy_max(scores, epsilon=epsilon, noise=noise)])
