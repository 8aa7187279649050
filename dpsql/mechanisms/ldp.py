"""Local-DP randomisers (ALGORITHMS.md P8-P11): Square Wave, Piecewise, Stochastic Rounding, Hybrid.

Each randomiser is run by the data owner on one value; its report is ``epsilon``-LDP:
for any two inputs ``x, x'`` in the input domain and any output set ``S``,
``P(report in S | x) <= e^epsilon * P(report in S | x')``. Clipping to the input domain
is part of every randomiser (values outside it are clipped, not refused).

Common interface (:class:`Randomiser`): ``perturb(x, eps, noise)``, ``variance(x, eps)``,
``worst_variance(eps)``, ``output_range(eps)``, ``pdf(y, x, eps)`` and, for the ratio
tests, ``cell_probabilities(x, eps)`` (the exact distribution of the released report).

Float safety
------------
A continuous report ``y`` computed in floating point from a private ``x`` could reveal
``x`` through which doubles are reachable (Mironov 2012). Square Wave and Piecewise
therefore release ``y`` *snapped to a lattice*: the output interval ``[lo, hi]`` (public:
it depends on ``eps`` only) is cut into cells ``[k g, (k+1) g)`` of a power-of-two width
``g = 2**(floor(log2(hi - lo)) - LDP_LATTICE_BITS)`` and the report is the cell midpoint
``(k + 1/2) g``, exact in float64. The set of possible reports is the same for every
input. The report falls in cell ``k`` with probability exactly the continuous density's
mass on that cell; since the density is between ``q`` and ``p = e^eps q`` on the whole
output interval for every input, each cell's mass satisfies ``q |cell| <= P(k | x) <=
p |cell|``, so the ratio bound ``e^eps`` holds cell by cell: the lattice version is
``eps``-LDP exactly. The inverse-CDF draw that selects the cell is computed in floating
point; its relative error (about 1e-16) moves cell probabilities, never the support.
Moments quoted below are those of the continuous randomiser; snapping changes the mean
by at most ``g**2`` and the variance by about ``-g**2 / 12`` (``g = 2**-20`` for SW),
far below any statistical resolution. Stochastic Rounding has two public outputs
``±C`` and needs no lattice.

Examples
--------
>>> import dpsql
>>> c = SQUARE_WAVE.constants(1.0)
>>> round(c.b, 4), round(c.p, 4), round(c.q, 4)
(0.2561, 1.1363, 0.418)
>>> round(float(SQUARE_WAVE.mean(1.0, 1.0)), 5), round(float(SQUARE_WAVE.variance(1.0, 1.0)), 5)
(0.68394, 0.18663)
>>> with dpsql.testing.seeded(0) as source:
...     reports = SQUARE_WAVE.perturb(np.full(4, 0.3), 1.0, source)
>>> bool(np.all((reports >= -c.b - 1e-6) & (reports <= 1 + c.b + 1e-6)))
True
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import NamedTuple

import numpy as np

from dpsql.noise import NoiseSource

#: Bits of resolution of the report lattice below the output interval's width.
LDP_LATTICE_BITS = 20


def lattice_spacing(width: float) -> float:
    """Power-of-two cell width for an output interval of ``width`` (public)."""
    return 2.0 ** (math.floor(math.log2(width)) - LDP_LATTICE_BITS)


def _as_array(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


class Randomiser(ABC):
    """An ``eps``-LDP randomiser on a fixed input domain (see the module docstring)."""

    #: Input domain; inputs are clipped to it.
    domain: tuple[float, float]
    name: str

    @abstractmethod
    def perturb(self, x, eps: float, noise: NoiseSource) -> np.ndarray:
        """One report per input, on the input-independent report set."""

    @abstractmethod
    def variance(self, x, eps: float) -> np.ndarray:
        """Variance of the (debiased) report for input ``x``."""

    @abstractmethod
    def worst_variance(self, eps: float) -> float:
        """``max_x variance(x, eps)`` over the input domain."""

    @abstractmethod
    def output_range(self, eps: float) -> tuple[float, float]:
        """Interval containing every report."""

    @abstractmethod
    def pdf(self, y, x, eps: float) -> np.ndarray:
        """Density (or point mass) of the continuous report ``y`` given input ``x``."""

    @abstractmethod
    def cell_probabilities(self, x: float, eps: float) -> tuple[np.ndarray, np.ndarray]:
        """``(reports, probabilities)``: the exact distribution of the released report for one input."""

    def clip(self, x) -> np.ndarray:
        return np.clip(_as_array(x), *self.domain)


class _BandDensity(NamedTuple):
    """Density ``q`` on ``[lo, hi]`` raised to ``p`` on the band ``[a, c]`` (per input)."""

    lo: float
    hi: float
    a: np.ndarray
    c: np.ndarray
    p: float
    q: float

    def pieces(self):
        """``(left, right, density)`` of the three constant pieces."""
        return ((self.lo, self.a, self.q), (self.a, self.c, self.p), (self.c, self.hi, self.q))

    def central_moment(self, k: int, about: np.ndarray) -> np.ndarray:
        """``E[(y - about)^k]``, exactly, piece by piece."""
        return sum(d * ((right - about) ** (k + 1) - (left - about) ** (k + 1)) / (k + 1)
                   for left, right, d in self.pieces())

    def mean(self) -> np.ndarray:
        return self.central_moment(1, np.zeros_like(self.a))

    def cdf(self, y) -> np.ndarray:
        y = np.clip(_as_array(y), self.lo, self.hi)
        return sum(d * np.clip(y - left, 0.0, right - left) for left, right, d in self.pieces())

    def pdf(self, y) -> np.ndarray:
        y = _as_array(y)
        inside = (y >= self.lo) & (y <= self.hi)
        return np.where(inside, np.where((y >= self.a) & (y <= self.c), self.p, self.q), 0.0)

    def sample(self, u: np.ndarray) -> np.ndarray:
        """Inverse CDF at ``u`` in (0, 1), snapped to the report lattice."""
        left_mass = self.q * (self.a - self.lo)
        band_mass = self.p * (self.c - self.a)
        y = np.where(u <= left_mass, self.lo + u / self.q,
                     np.where(u <= left_mass + band_mass, self.a + (u - left_mass) / self.p,
                              self.c + (u - left_mass - band_mass) / self.q))
        return self.snap(y)

    def cells(self) -> tuple[int, int, float]:
        """First and last lattice cell index overlapping ``[lo, hi]``, and the spacing."""
        g = lattice_spacing(self.hi - self.lo)
        return math.floor(self.lo / g), math.ceil(self.hi / g) - 1, g

    def snap(self, y: np.ndarray) -> np.ndarray:
        first, last, g = self.cells()
        k = np.clip(np.floor(y / g), first, last)
        return (k + 0.5) * g

    def cell_probabilities(self) -> tuple[np.ndarray, np.ndarray]:
        first, last, g = self.cells()
        k = np.arange(first, last + 2, dtype=np.float64)
        mass = np.diff(self.cdf(k * g))
        return (k[:-1] + 0.5) * g, mass


class SWConstants(NamedTuple):
    """Square Wave half-width ``b`` and densities ``p`` (in the band) and ``q`` (outside)."""

    b: float
    p: float
    q: float


class SquareWave(Randomiser):
    """Square Wave (Li et al. 2020; ALGORITHMS.md P8) on inputs in ``[0, 1]``.

    Report density on ``[-b, 1 + b]``: ``p`` within ``b`` of the input, ``q`` elsewhere,
    ``p / q = e^eps``, with ``b = (eps e^eps - e^eps + 1) / (2 e^eps (e^eps - 1 - eps))``.
    Cost: ``eps``-LDP per report (any input in ``[0, 1]`` may be replaced by any other).
    Reports are biased towards 1/2 (``E = 1/2 + 2b(p-q)(x - 1/2)``); :meth:`debias` inverts
    that affinely. ``variance``, ``mean`` and ``central_moment4`` describe the raw report.

    As ``eps -> 0`` the closed form for ``b`` cancels catastrophically; below ``eps = 1e-2``
    its Taylor series to ``eps^5`` is used (truncation error < 1e-14).
    """

    domain = (0.0, 1.0)
    name = "square_wave"

    @staticmethod
    def constants(eps: float) -> SWConstants:
        if eps < 1e-2:
            b = 0.5 + eps * (-1 / 3 + eps * (1 / 9 + eps * (-7 / 270 + eps * (2 / 405 - eps * 11 / 13608))))
        else:
            e = math.exp(eps)
            b = (eps * e - e + 1.0) / (2.0 * e * (e - 1.0 - eps))
        e = math.exp(eps)
        return SWConstants(b, e / (2.0 * b * e + 1.0), 1.0 / (2.0 * b * e + 1.0))

    def density(self, x, eps: float) -> _BandDensity:
        b, p, q = self.constants(eps)
        x = self.clip(x)
        return _BandDensity(-b, 1.0 + b, x - b, x + b, p, q)

    def perturb(self, x, eps, noise):
        x = self.clip(x)
        return self.density(x, eps).sample(noise.uniform(x.size).reshape(x.shape))

    def mean(self, x, eps) -> np.ndarray:
        """``E[SW(x)] = 1/2 + 2b(p - q)(x - 1/2)``."""
        return self.density(x, eps).mean()

    def variance(self, x, eps) -> np.ndarray:
        """Variance of the raw report ``SW(x)``."""
        d = self.density(x, eps)
        return d.central_moment(2, d.mean())

    def central_moment4(self, x, eps) -> np.ndarray:
        """``E[(SW(x) - E SW(x))^4]`` of the raw report (DU's ``mu_4`` at ``x = 1``)."""
        d = self.density(x, eps)
        return d.central_moment(4, d.mean())

    def worst_variance(self, eps):
        """The raw variance is symmetric about ``x = 1/2`` and largest at the domain ends."""
        return float(self.variance(1.0, eps))

    def output_range(self, eps):
        b = self.constants(eps).b
        return -b, 1.0 + b

    def pdf(self, y, x, eps):
        return self.density(x, eps).pdf(y)

    def cdf(self, y, x, eps) -> np.ndarray:
        return self.density(x, eps).cdf(y)

    def cell_probabilities(self, x, eps):
        return self.density(float(x), eps).cell_probabilities()

    def debias(self, reports, eps) -> np.ndarray:
        """Unbiased estimate of the input from raw reports: ``(y - q(1+2b)/2) / (2b(p-q))``."""
        b, p, q = self.constants(eps)
        return (_as_array(reports) - q * (1.0 + 2.0 * b) / 2.0) / (2.0 * b * (p - q))

    def debiased_variance(self, x, eps) -> np.ndarray:
        """Variance of :meth:`debias` of one report for input ``x``."""
        b, p, q = self.constants(eps)
        return self.variance(x, eps) / (2.0 * b * (p - q)) ** 2


#: The shared Square Wave randomiser.
SQUARE_WAVE = SquareWave()
