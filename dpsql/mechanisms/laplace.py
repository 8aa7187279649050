"""Float-safe Laplace mechanism on a power-of-two lattice.

Privacy cost (stated where it is defined): releasing ``f(x) + LaplaceLattice(s, eps)``
noise for a query ``f`` whose L1 sensitivity is at most ``s`` is ``eps``-DP
(pure, delta = 0), exactly, for the discrete Laplace distribution drawn.

How: the lattice spacing ``gamma`` is the largest power of two with
``gamma <= s * 2**-LATTICE_BITS``; it depends on public ``s`` only. The private
value is rounded to ``k = round(f / gamma)``. Rounding moves each of two
neighbouring values by at most ``gamma / 2``, so ``|k - k'| <= ceil(s / gamma) + 1
=: s_units``. Adding discrete Laplace noise of scale ``s_units / eps`` to ``k`` is
``eps``-DP for that integer sensitivity, and ``gamma * (k + Z)`` is exact in float64.
The price of rounding is a noise scale larger by the factor ``s_units * gamma / s``,
at most ``1 + 2**(1 - LATTICE_BITS)`` (0.05 %), and a deterministic rounding error of
at most ``gamma / 2`` per value.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

from dpsql.noise import MAX_NEG_LOG_UNIFORM, NoiseSource

LATTICE_BITS = 12


@dataclass(frozen=True)
class LaplaceLattice:
    """Calibrated Laplace noise for sensitivity ``sensitivity`` at ``epsilon``.

    ``sensitivity = 0`` (a query that is constant on the clipped domain) draws no noise.

    Examples
    --------
    >>> lap = LaplaceLattice(sensitivity=1.0, epsilon=0.5)
    >>> lap.granularity == 2.0**-12
    True
    >>> round(lap.variance / (2 * (1.0 / 0.5) ** 2), 3)  # ~ 2 (s / eps)^2
    1.0
    """

    sensitivity: float
    epsilon: float
    granularity: float = field(init=False)
    scale_units: float = field(init=False)

    # Cached: partitioned releases build the same lattices many times (one per partition and level).
    @staticmethod
    @functools.lru_cache(maxsize=4096)
    def shared(sensitivity: float, epsilon: float) -> LaplaceLattice:
        """``LaplaceLattice(sensitivity, epsilon)``, one instance per distinct pair (it is immutable)."""
        return LaplaceLattice(sensitivity, epsilon)

    def __post_init__(self):
        if self.sensitivity > 0:
            gamma = 2.0 ** (math.floor(math.log2(self.sensitivity)) - LATTICE_BITS)
            sensitivity_units = math.ceil(self.sensitivity / gamma) + 1
            units = sensitivity_units / self.epsilon
            if Fraction(units) * Fraction(self.epsilon) < sensitivity_units:
                units = math.nextafter(units, math.inf)  # the scale must never round below s_units / eps
        else:
            gamma, units = 1.0, 0.0
        object.__setattr__(self, "granularity", gamma)
        object.__setattr__(self, "scale_units", units)

    @property
    def scale(self) -> float:
        """Laplace scale in data units (``~ sensitivity / epsilon``)."""
        return self.scale_units * self.granularity

    @property
    def variance(self) -> float:
        """Exact variance of one noise draw in data units: ``gamma^2 * 2a / (1-a)^2``."""
        if self.scale_units == 0:
            return 0.0
        a = math.exp(-1.0 / self.scale_units)
        return self.granularity**2 * 2.0 * a / (1.0 - a) ** 2

    def to_units(self, values: np.ndarray) -> np.ndarray:
        """Private values rounded to the lattice, as int64 lattice units."""
        return np.rint(np.asarray(values, dtype=np.float64) / self.granularity).astype(np.int64)

    def noise_units(self, noise: NoiseSource, size: int) -> np.ndarray:
        """``size`` independent noise draws in lattice units (int64)."""
        return noise.discrete_laplace(self.scale_units, size)

    def from_units(self, units: np.ndarray) -> np.ndarray:
        """Lattice units back to data units; exact because ``gamma`` is a power of two."""
        return units.astype(np.float64) * self.granularity

    def release(self, values: np.ndarray, noise: NoiseSource) -> np.ndarray:
        """``values`` plus independent noise, each on the lattice: ``eps``-DP per
        coordinate for sensitivity ``s`` in that coordinate.

        Bit-identical to ``from_units(to_units(values) + noise_units(noise, size))``, but
        computed in float64 in place when every possible draw is an exact float: then
        ``rint(values / gamma)`` is an integral float ``k``, adding the draw ``z`` rounds
        the exact integer ``k + z`` once to nearest, as the int64 path's conversion back
        to float does, and multiplying by the power of two ``gamma`` is exact in both.
        A draw of :meth:`~dpsql.noise.NoiseSource.discrete_laplace` has
        ``|z| <= scale * MAX_NEG_LOG_UNIFORM`` (``106 ln 2``, see :mod:`dpsql.noise`); the
        float path is taken while that bound stays below ``2**52`` (a factor 2 of margin
        over ``2**53`` for the rounding of the bound itself), i.e. unless epsilon is
        below about 1e-10.
        """
        units = np.rint(np.asarray(values, dtype=np.float64) / self.granularity)
        draws = self.noise_units(noise, units.size).reshape(units.shape)
        return _add_draws(units, draws, self.granularity, self.scale_units)


class LatticeBatch:
    """One :class:`LaplaceLattice` per partition, for arrays whose leading axis is the partition.

    Partition ``j`` gets ``LaplaceLattice.shared(sensitivities[j], epsilon)``: its own
    power-of-two granularity and scale, fixed by its own (public or privately released)
    sensitivity, so every partition's values and noise are exactly what that lattice
    gives on its own; only the draws of all partitions come from one sampler call.

    Examples
    --------
    >>> import dpsql
    >>> batch = LatticeBatch(np.array([1.0, 1000.0]), epsilon=0.5)
    >>> batch.granularity.tolist() == [2.0**-12, 2.0**-3], batch.noise_units(dpsql.noise.SeededNoise(0), 3).shape
    (True, (2, 3))
    """

    def __init__(self, sensitivities: np.ndarray, epsilon: float):
        distinct, which = np.unique(np.asarray(sensitivities, dtype=np.float64), return_inverse=True)
        lattices = [LaplaceLattice.shared(float(s), epsilon) for s in distinct]
        self.epsilon = epsilon
        self.partitions = len(which)
        self.granularity = np.array([lap.granularity for lap in lattices])[which]
        self.scale_units = np.array([lap.scale_units for lap in lattices])[which]
        self.variance = np.array([lap.variance for lap in lattices])[which]
        # one lattice for all partitions: the sampler's scalar path
        self._common_scale = lattices[0].scale_units if len(lattices) == 1 else None

    def _per_partition(self, attribute: np.ndarray, ndim: int) -> np.ndarray:
        return attribute.reshape((self.partitions,) + (1,) * (ndim - 1))

    def noise_units(self, noise: NoiseSource, size: int) -> np.ndarray:
        """``(partitions, size)`` independent draws in lattice units (int64), partition by partition."""
        scales = self._common_scale if self._common_scale is not None else np.repeat(self.scale_units, size)
        return noise.discrete_laplace(scales, self.partitions * size).reshape(self.partitions, size)

    def from_units(self, units: np.ndarray) -> np.ndarray:
        """Lattice units (leading axis the partition) back to data units, exactly."""
        return units.astype(np.float64) * self._per_partition(self.granularity, units.ndim)

    def release(self, values: np.ndarray, noise: NoiseSource) -> np.ndarray:
        """``values`` (leading axis the partition) plus noise on each partition's lattice, as
        :meth:`LaplaceLattice.release` would give partition by partition (same float path
        condition, now for the largest scale)."""
        values = np.asarray(values, dtype=np.float64)
        gamma = self._per_partition(self.granularity, values.ndim)
        units = np.rint(values / gamma)
        draws = self.noise_units(noise, units[0].size if len(units) else 0).reshape(units.shape)
        return _add_draws(units, draws, gamma, float(self.scale_units.max()))


def _add_draws(units: np.ndarray, draws: np.ndarray, gamma, largest_scale_units: float) -> np.ndarray:
    """``gamma * (units + draws)`` for integral float ``units`` (overwritten), in float64 when
    every possible draw keeps the sum exact (see :meth:`LaplaceLattice.release`), else via int64."""
    if largest_scale_units * MAX_NEG_LOG_UNIFORM >= 2.0**52:
        return (units.astype(np.int64) + draws).astype(np.float64) * gamma
    units += draws
    units *= gamma
    return units
