"""Per-value Laplace baseline (ALGORITHMS.md P1 applied to every value).

Privacy: each value is clipped to the public ``[lower, upper]`` and released once with
Laplace noise of scale ``(upper - lower) / epsilon``: ``epsilon``-DP under
replace-one-value neighbours (one row's value changes by at most ``upper - lower``).
Rows are disjoint, so the stream as a whole is ``epsilon``-DP (parallel composition).
"""

from __future__ import annotations

import numpy as np

from dpsql import _validate
from dpsql.mechanisms import LaplaceLattice
from dpsql.noise import NoiseSource
from dpsql.release import IndependentNoise, StreamMachine


class LaplaceStream(StreamMachine):
    """Online state machine: no state beyond the calibrated noise; every row is
    released as soon as it arrives. Rows are independent (``rows_independent``): a
    partitioned release runs one machine over all partitions.

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> with dpsql.testing.seeded(1) as source:
    ...     machine = LaplaceStream(3, epsilon=1.0, upper=10.0, noise=source)
    ...     out = np.concatenate([machine.feed(np.array([1.0, 2.0])), machine.feed(np.array([30.0])),
    ...                           machine.close()])
    >>> out.shape
    (3,)
    """

    rows_independent = True

    def __init__(self, n: int, *, epsilon: float, upper: float, lower: float = 0.0, noise: NoiseSource):
        self.epsilon = _validate.epsilon(epsilon)
        self.lower, self.upper = _validate.bounds(lower, upper)
        self.n = n
        self.cost = (self.epsilon, 0.0)
        self._lap = LaplaceLattice(sensitivity=self.upper - self.lower, epsilon=self.epsilon)
        self._noise = noise

    def feed(self, chunk: np.ndarray) -> np.ndarray:
        if not self.lower:
            return self._lap.release(np.clip(chunk, 0.0, self.upper), self._noise)
        # Shifted by the public lower bound, so that the lattice units stay small however far
        # the data lie from 0; adding it back is post-processing of the noisy units.
        shifted = np.clip(chunk, self.lower, self.upper)
        shifted -= self.lower
        released = self._lap.release(shifted, self._noise)
        released += self.lower
        return released

    def close(self) -> np.ndarray:
        return np.empty(0)

    def describe(self) -> dict:
        return dict(method="laplace", params={"epsilon": self.epsilon, "lower": self.lower, "upper": self.upper},
                    error=IndependentNoise(self._lap.variance, self.n), components={"laplace": self.cost})
