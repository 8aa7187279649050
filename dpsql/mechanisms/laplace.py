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

Limits (refused with :class:`~dpsql.errors.InvalidParameter`, before anything is drawn or
charged): a scale above ``2**33`` units (:data:`dpsql.sampling.MAX_SCALE`, the sampler's
resolution limit), i.e. ``epsilon < s_units * 2**-33`` (about ``4.8e-7`` per unit of
sensitivity); and a release of values so large that ``|k| + b >= 2**53``, ``b`` the
largest possible draw, where ``gamma * (k + Z)`` would no longer be the exact lattice
point in float64.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

from dpsql._groups import unique
from dpsql.errors import InvalidParameter
from dpsql.noise import BatchLaneDraws, LaneDraws
from dpsql.sampling import MAX_NEG_LOG_UNIFORM, MAX_SCALE

LATTICE_BITS = 12
# Relative slack on the draw bound: covers the rounding of log, of MAX_NEG_LOG_UNIFORM and
# of the product (a few ulps, ~1e-15) many times over.
_BOUND_SLACK = 1.0 + 2.0**-40


def draw_bound(scale_units: float) -> int:
    """An integer ``b`` with ``|Z| <= b`` for every draw of
    :meth:`~dpsql.noise.LaneDraws.discrete_laplace` at ``scale_units``:
    ``scale_units * MAX_NEG_LOG_UNIFORM`` (:mod:`dpsql.noise`) rounded up with a relative slack.

    >>> draw_bound(1.0), draw_bound(0.0)
    (74, 0)
    """
    return math.ceil(scale_units * MAX_NEG_LOG_UNIFORM * _BOUND_SLACK)


def largest_magnitude(units: np.ndarray) -> float:
    """``max |units|`` (0 for no units, NaN if one is NaN): while it stays below
    ``2**53 - draw_bound(scale)``, every ``units + Z`` is an exact float64."""
    return float(max(units.max(), -units.min())) if units.size else 0.0


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
            units = sensitivity_units / self.epsilon if self.epsilon > 0 else math.inf
            if math.isfinite(units) and Fraction(units) * Fraction(self.epsilon) < sensitivity_units:
                units = math.nextafter(units, math.inf)  # the scale must never round below s_units / eps
            if not units <= MAX_SCALE:
                raise InvalidParameter(
                    f"epsilon={self.epsilon!r} is too small for sensitivity {self.sensitivity!r}: the noise scale "
                    f"would exceed 2**33 lattice units, beyond which the sampler cannot reach every value; the "
                    f"smallest epsilon allowed for this sensitivity is {sensitivity_units / MAX_SCALE!r}")
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
        """Private values rounded to the lattice, as int64 lattice units; values too large for
        that (with room for noise) are refused, never wrapped."""
        units = np.rint(np.asarray(values, dtype=np.float64) / self.granularity)
        if not largest_magnitude(units) + draw_bound(self.scale_units) < 2.0**53:
            raise InvalidParameter(f"values of magnitude {largest_magnitude(units) * self.granularity:g} are too "
                                   f"large for lattice noise at sensitivity {self.sensitivity:g} (values plus noise "
                                   "must stay below 2**53 lattice units): shift or rescale the data by a public "
                                   "amount first")
        return units.astype(np.int64)

    def noise_units(self, draws: LaneDraws, start: int, size: int) -> np.ndarray:
        """The noise draws at indices ``start .. start + size - 1`` of ``draws``, in lattice units (int64)."""
        return draws.discrete_laplace(self.scale_units, start, size)

    def from_units(self, units: np.ndarray) -> np.ndarray:
        """Lattice units back to data units; exact because ``gamma`` is a power of two."""
        return units.astype(np.float64) * self.granularity

    def release(self, values: np.ndarray, draws: LaneDraws, start: int = 0) -> np.ndarray:
        """``values`` plus independent noise (the draws at ``start ..`` of ``draws``), each on the
        lattice: ``eps``-DP per coordinate for sensitivity ``s`` in that coordinate.

        Equal to ``from_units(to_units(values) + noise_units(draws, start, size))``, computed in
        float64 in place: ``rint(values / gamma)`` is an integral float ``k``, and while
        ``|k| + b < 2**53`` for the largest possible draw ``b`` (:func:`draw_bound`) the
        sum ``k + z`` is an exact float and multiplying it by the power of two ``gamma``
        is exact. Values beyond that are refused (:class:`~dpsql.errors.InvalidParameter`,
        naming the magnitude): no float64 result could be the exact lattice point.

        Examples
        --------
        >>> import dpsql
        >>> lap = LaplaceLattice(sensitivity=1.0, epsilon=1.0)
        >>> draws = dpsql.noise.Keystream(bytes(32), private=False).partition().lane(dpsql.noise.Lane.ROWS)
        >>> lap.release(np.array([2.0**41]), draws)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        dpsql.errors.InvalidParameter: values of magnitude 2**53.0 lattice units ...
        """
        units = np.rint(np.asarray(values, dtype=np.float64) / self.granularity)
        _refuse_inexact(units, self.scale_units)  # before any noise is drawn
        noise = self.noise_units(draws, start, units.size).reshape(units.shape)
        return _add_draws(units, noise, self.granularity)


class LatticeBatch:
    """One :class:`LaplaceLattice` per partition, for arrays whose leading axis is the partition.

    Partition ``j`` gets ``LaplaceLattice.shared(sensitivities[j], epsilon)``: its own
    power-of-two granularity and scale, fixed by its own (public or privately released)
    sensitivity, so every partition's values and noise are exactly what that lattice
    gives on its own (from that partition's own addressed draws).

    Examples
    --------
    >>> import dpsql
    >>> batch = LatticeBatch(np.array([1.0, 1000.0]), epsilon=0.5)
    >>> draws = dpsql.noise.Keystream(bytes(32), private=False).partitions([b"a", b"b"]).lane(dpsql.noise.Lane.ROWS)
    >>> batch.granularity.tolist() == [2.0**-12, 2.0**-3], batch.noise_units(draws, 0, 3).shape
    (True, (2, 3))
    """

    def __init__(self, sensitivities: np.ndarray, epsilon: float):
        distinct, which = unique(np.asarray(sensitivities, dtype=np.float64), return_inverse=True)
        lattices = [LaplaceLattice.shared(float(s), epsilon) for s in distinct]
        self.epsilon = epsilon
        self.partitions = len(which)
        self.granularity = np.array([lap.granularity for lap in lattices])[which]
        self.scale_units = np.array([lap.scale_units for lap in lattices])[which]
        self.variance = np.array([lap.variance for lap in lattices])[which]
        # one lattice for all (one sensitivity, the usual case): array code with a scalar, not a
        # column broadcast over the rows
        self._granularity = lattices[0].granularity if len(lattices) == 1 else None

    def _per_partition(self, attribute: np.ndarray, ndim: int) -> np.ndarray:
        return attribute.reshape((self.partitions,) + (1,) * (ndim - 1))

    def _gammas(self, ndim: int):
        """Each partition's granularity against arrays of ``ndim`` dimensions (leading axis the partition)."""
        return self._granularity if self._granularity is not None else self._per_partition(self.granularity, ndim)

    def noise_units(self, draws: BatchLaneDraws, start: int, size: int) -> np.ndarray:
        """``(partitions, size)`` draws in lattice units (int64): partition ``j``'s are the draws at
        ``start ..`` of its own lane, at its own scale."""
        return draws.discrete_laplace(self.scale_units, start, size)

    def from_units(self, units: np.ndarray) -> np.ndarray:
        """Lattice units (leading axis the partition) back to data units, exactly."""
        return units.astype(np.float64) * self._gammas(units.ndim)

    def release(self, values: np.ndarray, draws: BatchLaneDraws, start: int = 0) -> np.ndarray:
        """``values`` (leading axis the partition) plus noise on each partition's lattice, as
        :meth:`LaplaceLattice.release` would give partition by partition (same float path
        condition, now for the largest scale)."""
        values = np.asarray(values, dtype=np.float64)
        gamma = self._gammas(values.ndim)
        units = self._units(values, gamma)
        noise = self.noise_units(draws, start, units[0].size if len(units) else 0).reshape(units.shape)
        return _add_draws(units, noise, gamma)

    def _units(self, values: np.ndarray, gamma) -> np.ndarray:
        """``values`` rounded to the lattice of granularity ``gamma`` (exact: a power of two), as
        integral floats; values too large for any draw to be added exactly are refused first."""
        units = values / gamma
        np.rint(units, out=units)
        _refuse_inexact(units, float(self.scale_units.max()))  # before any noise is drawn
        return units

    def release_at(self, values: np.ndarray, draws: BatchLaneDraws, partitions: np.ndarray,
                   indices: np.ndarray) -> np.ndarray:
        """``values[i]`` released in partition ``partitions[i]`` with its draw at ``indices[i]``:
        bit for bit what :meth:`release` gives that value at that index (the same draw, lattice
        and float path), for scattered rows."""
        values = np.asarray(values, dtype=np.float64)
        partitions, indices = np.asarray(partitions, dtype=np.intp), np.asarray(indices, dtype=np.int64)
        gamma = self.granularity[partitions]
        units = self._units(values, gamma)
        noise = np.empty(len(units), dtype=np.int64)
        scales = self.scale_units[partitions]
        for scale in np.unique(scales).tolist():  # one scale per distinct sensitivity
            rows = np.flatnonzero(scales == scale)
            noise[rows] = draws.discrete_laplace_at(scale, partitions[rows], indices[rows])
        return _add_draws(units, noise, gamma)


def _add_draws(units: np.ndarray, draws: np.ndarray, gamma) -> np.ndarray:
    """``gamma * (units + draws)`` for integral float ``units`` (overwritten), exact in float64;
    the caller has refused, before drawing, ``units`` where it could not be (:func:`_refuse_inexact`)."""
    units += draws
    units *= gamma
    return units


def _refuse_inexact(units: np.ndarray, largest_scale_units: float) -> None:
    """Refuse lattice ``units`` too large for any draw at ``largest_scale_units`` to be added exactly."""
    largest = largest_magnitude(units)
    if not largest + draw_bound(largest_scale_units) < 2.0**53:
        raise InvalidParameter(
            f"values of magnitude 2**{math.log2(largest):.1f} lattice units cannot carry lattice noise exactly in "
            f"float64 (values plus noise must stay below 2**53 units): shift the data closer to 0 (subtract a "
            f"public offset, then pass lower and upper for the shifted values)")
