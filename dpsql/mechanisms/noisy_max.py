"""Report-Noisy-Max (ALGORITHMS.md P2).

Privacy cost: ``epsilon``-DP (pure) for scores whose sensitivity is ``sensitivity``.
When every score moves in the same direction on a neighbouring input
(``monotonic=True``) the noise scale is ``sensitivity / epsilon``; otherwise it is
``2 * sensitivity / epsilon`` (Dwork & Roth, Claim 3.9). Only the index is released.
"""

from __future__ import annotations

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
    factor = 1.0 if monotonic else 2.0
    lap = LaplaceLattice(sensitivity=factor * sensitivity, epsilon=epsilon)
    return int(np.argmax(lap.release(np.asarray(scores, dtype=np.float64), noise)))
