"""Local-DP randomisers: Square Wave, Piecewise, Stochastic Rounding, Hybrid (docs/algorithms.md,
"Local differential privacy").

Each randomiser is run by the data owner on one value; its report is ``epsilon``-LDP:
for any two inputs ``x, x'`` in the input domain and any output set ``S``,
``P(report in S | x) <= e^epsilon * P(report in S | x')``. Clipping to the input domain
is part of every randomiser (values outside it are clipped, not refused).

Common interface (:class:`Randomiser`): ``perturb(x, eps, u)``, ``variance(x, eps)``,
``worst_variance(eps)``, ``output_range(eps)``, ``pdf(y, x, eps)`` and, for the ratio
tests, ``cell_probabilities(x, eps)`` (the exact distribution of the released report).

Randomness: ``perturb`` takes :attr:`Randomiser.uniforms` uniforms per report, ``u``
shaped ``(*x.shape, uniforms)``, drawn by the caller from the report's address
(:func:`report_uniforms`): a report is a function of its value and its address, so a
retried or re-run encoder sends the same report.

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
and the variance by ``O(g**2)`` (a few times 1e-12 for SW, whose ``g = 2**-20``), far
below any statistical resolution. Stochastic Rounding has two public outputs
``±C`` and needs no lattice.

Examples
--------
>>> import dpsql
>>> c = SQUARE_WAVE.constants(1.0)
>>> round(c.b, 4), round(c.p, 4), round(c.q, 4)
(0.2561, 1.1363, 0.418)
>>> round(float(SQUARE_WAVE.mean(1.0, 1.0)), 5), round(float(SQUARE_WAVE.variance(1.0, 1.0)), 5)
(0.68394, 0.18663)
>>> reports = SQUARE_WAVE.perturb(np.full(4, 0.3), 1.0, report_uniforms(dpsql.testing.draws(0), 0, 4))
>>> bool(np.all((reports >= -c.b - 1e-6) & (reports <= 1 + c.b + 1e-6)))
True
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import NamedTuple

import numpy as np

from dpsql.accounting import Neighbour
from dpsql.noise import Draws, DrawsBatch, Lane

#: Bits of resolution of the report lattice below the output interval's width.
LDP_LATTICE_BITS = 20
#: Uniforms a report takes at most: the sample's, and the Hybrid mechanism's choice of PM or SR.
REPORT_UNIFORMS = 2


def report_uniforms(draws: Draws | DrawsBatch, start: int, count: int, *, uniforms: int = REPORT_UNIFORMS,
                    lane: Lane = Lane.LDP_REPORT) -> np.ndarray:
    """The uniforms of reports ``start .. start + count - 1``: ``(count, uniforms)``, or
    ``(partitions, count, uniforms)`` for a :class:`~dpsql.noise.DrawsBatch`. Uniform ``k`` of
    report ``t`` is index ``t`` of ``lane`` at level ``k``: a report's uniforms are a function
    of the key, the partition (the user), the report's index and nothing else, so a device
    that re-sends a report sends the same one. ``uniforms`` is the randomiser's
    :attr:`Randomiser.uniforms` (fewer than :data:`REPORT_UNIFORMS` skips unused draws, the
    addresses of the others do not move).

    Examples
    --------
    >>> import dpsql
    >>> draws = dpsql.testing.draws(0)
    >>> u = report_uniforms(draws, 0, 5)
    >>> u.shape, bool((report_uniforms(draws, 2, 3, uniforms=1)[:, 0] == u[2:, 0]).all())
    ((5, 2), True)
    """
    return np.stack([draws.lane(lane, level).uniform(start, count) for level in range(uniforms)], axis=-1)


#: Neighbour relation of event-level LDP releases (one report per value).
EVENT_LDP_NEIGHBOUR = Neighbour.LDP_EVENT.value
#: Neighbour relation of w-event LDP releases (one user's stream).
W_EVENT_LDP_NEIGHBOUR = Neighbour.LDP_W_EVENT.value


def lattice_spacing(width: float) -> float:
    """Power-of-two cell width for an output interval of ``width`` (public).

    Examples
    --------
    >>> lattice_spacing(1.5) == 2.0**-20
    True
    """
    return 2.0 ** (math.floor(math.log2(width)) - LDP_LATTICE_BITS)


def _as_array(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


class Randomiser(ABC):
    """An ``eps``-LDP randomiser on a fixed input domain (see the module docstring)."""

    #: Input domain; inputs are clipped to it.
    domain: tuple[float, float]
    name: str
    #: Uniforms per report (the last axis of ``perturb``'s ``u``; :func:`report_uniforms`).
    uniforms: int = 1

    @abstractmethod
    def perturb(self, x, eps: float, u: np.ndarray) -> np.ndarray:
        """One report per input, on the input-independent report set (``u``: the reports'
        uniforms, see :func:`report_uniforms`)."""

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

    @abstractmethod
    def central_moment4(self, x, eps: float) -> np.ndarray:
        """Fourth central moment of the report for input ``x``."""

    def excess_kurtosis(self, x, eps: float) -> np.ndarray:
        """Excess kurtosis of the report for input ``x`` (unchanged by affine debiasing)."""
        return self.central_moment4(x, eps) / self.variance(x, eps) ** 2 - 3.0

    def worst_excess_kurtosis(self, eps: float) -> float:
        """Largest excess kurtosis over the input domain: a grid of 1001 inputs (both ends
        included), refined twice around its maximum (the maximum may be interior).

        Error models use it to size intervals: a sum of independent reports has at most the
        largest excess kurtosis of its terms.
        """
        lo, hi = self.domain
        grid = np.linspace(lo, hi, 1001)
        for _ in range(3):
            values = self.excess_kurtosis(grid, eps)
            best = int(np.argmax(values))
            step = grid[1] - grid[0]
            grid = np.linspace(max(lo, grid[best] - step), min(hi, grid[best] + step), 1001)
        return float(values.max())

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
    """Square Wave (Li et al., SIGMOD 2020) on inputs in ``[0, 1]``.

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

    def perturb(self, x, eps, u):
        x = self.clip(x)
        return self.density(x, eps).sample(np.asarray(u)[..., 0])

    def sampler(self, eps: float):
        """``sample(z, u)``: the report for one input ``z`` already in ``[0, 1]`` and its
        uniform ``u``, in plain Python floats, for sequential loops in which a numpy call per
        report would cost more than the report. Bit for bit :meth:`perturb` (the same
        operations in the same order: IEEE arithmetic rounds them alike).

        Examples
        --------
        >>> sample = SQUARE_WAVE.sampler(1.0)
        >>> sample(0.3, 0.25) == float(SQUARE_WAVE.perturb(np.array([0.3]), 1.0, np.array([[0.25]]))[0])
        True
        """
        b, p, q = self.constants(eps)
        lo = -b
        first, last, g = _BandDensity(lo, 1.0 + b, None, None, p, q).cells()
        floor = math.floor

        def sample(z: float, u: float) -> float:
            a, c = z - b, z + b
            left_mass, band_mass = q * (a - lo), p * (c - a)
            if u <= left_mass:
                y = lo + u / q
            elif u <= left_mass + band_mass:
                y = a + (u - left_mass) / p
            else:
                y = c + (u - left_mass - band_mass) / q
            return (min(max(floor(y / g), first), last) + 0.5) * g

        return sample

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


class Piecewise(Randomiser):
    """Piecewise Mechanism (Wang et al., ICDE 2019) on inputs in ``[-1, 1]``.

    With ``C = (e^{eps/2} + 1) / (e^{eps/2} - 1)`` the report density on ``[-C, C]`` is
    ``p = (e^eps - e^{eps/2}) / (2 e^{eps/2} + 2)`` on ``[l(x), l(x) + C - 1]``,
    ``l(x) = (C + 1) x / 2 - (C - 1) / 2``, and ``q = p / e^eps`` elsewhere. Unbiased, variance
    ``x^2 / (e^{eps/2} - 1) + (e^{eps/2} + 3) / (3 (e^{eps/2} - 1)^2)``. Cost: ``eps``-LDP.

    The reference code (``primitive.pm``) maps its draws back with the per-sample ``l(x)``
    in place of the domain bound ``-C`` (a slip of the paper); here the density is
    parameterised directly on ``[-C, C]``, so the domain bounds are the only bounds used.

    Examples
    --------
    >>> round(PIECEWISE.output_range(1.0)[1], 4)
    4.083
    """

    domain = (-1.0, 1.0)
    name = "piecewise"

    @staticmethod
    def bound(eps: float) -> float:
        """``C``: reports lie in ``[-C, C]``."""
        half = math.exp(eps / 2.0)
        return (half + 1.0) / (half - 1.0)

    def density(self, x, eps: float) -> _BandDensity:
        x = self.clip(x)
        c = self.bound(eps)
        half = math.exp(eps / 2.0)
        p = (math.exp(eps) - half) / (2.0 * half + 2.0)
        left = (c + 1.0) / 2.0 * x - (c - 1.0) / 2.0
        return _BandDensity(-c, c, left, left + c - 1.0, p, p / math.exp(eps))

    def perturb(self, x, eps, u):
        x = self.clip(x)
        return self.density(x, eps).sample(np.asarray(u)[..., 0])

    def variance(self, x, eps):
        half_minus_one = math.expm1(eps / 2.0)
        return self.clip(x) ** 2 / half_minus_one + (half_minus_one + 4.0) / (3.0 * half_minus_one**2)

    def worst_variance(self, eps):
        return float(self.variance(1.0, eps))

    def central_moment4(self, x, eps):
        d = self.density(x, eps)
        return d.central_moment(4, d.mean())

    def output_range(self, eps):
        c = self.bound(eps)
        return -c, c

    def pdf(self, y, x, eps):
        return self.density(x, eps).pdf(y)

    def cell_probabilities(self, x, eps):
        return self.density(float(x), eps).cell_probabilities()


class StochasticRounding(Randomiser):
    """Stochastic Rounding (Duchi, Jordan, Wainwright) on inputs in ``[-1, 1]``.

    Reports ``+C`` with probability ``1/2 + x (e^eps - 1) / (2 (e^eps + 1))``, else ``-C``,
    ``C = (e^eps + 1) / (e^eps - 1)``: unbiased, variance ``C^2 - x^2``. The two outputs
    are public, so no lattice is needed; the probability ratio is at most
    ``(e^eps / (e^eps + 1)) / (1 / (e^eps + 1)) = e^eps``. Cost: ``eps``-LDP.

    Examples
    --------
    >>> round(STOCHASTIC_ROUNDING.output_range(1.0)[1], 4)
    2.164
    """

    domain = (-1.0, 1.0)
    name = "stochastic_rounding"

    @staticmethod
    def bound(eps: float) -> float:
        """``C``: the two reports are ``±C``."""
        return (math.exp(eps) + 1.0) / math.expm1(eps)

    @staticmethod
    def positive_probability(x, eps: float) -> np.ndarray:
        return 0.5 + x * math.expm1(eps) / (2.0 * (math.exp(eps) + 1.0))

    def perturb(self, x, eps, u):
        x = self.clip(x)
        positive = np.asarray(u)[..., 0] < self.positive_probability(x, eps)
        c = self.bound(eps)
        return np.where(positive, c, -c)

    def variance(self, x, eps):
        return self.bound(eps) ** 2 - self.clip(x) ** 2

    def worst_variance(self, eps):
        return self.bound(eps) ** 2

    def central_moment4(self, x, eps):
        x = self.clip(x)
        c = self.bound(eps)
        up = self.positive_probability(x, eps)
        return up * (c - x) ** 4 + (1.0 - up) * (c + x) ** 4

    def output_range(self, eps):
        c = self.bound(eps)
        return -c, c

    def pdf(self, y, x, eps):
        """Point masses: ``P(report = y | x)``."""
        y = _as_array(y)
        c = self.bound(eps)
        up = self.positive_probability(self.clip(x), eps)
        return np.where(y == c, up, np.where(y == -c, 1.0 - up, 0.0))

    def cell_probabilities(self, x, eps):
        c = self.bound(eps)
        up = float(self.positive_probability(float(np.clip(x, -1.0, 1.0)), eps))
        return np.array([-c, c]), np.array([1.0 - up, up])


#: Hybrid mechanism threshold: at or below it, Stochastic Rounding alone has the smaller worst-case variance.
HYBRID_THRESHOLD = 0.61


class Hybrid(Randomiser):
    """Hybrid Mechanism (Wang et al., ICDE 2019) on inputs in ``[-1, 1]``.

    For ``eps > 0.61`` it runs :class:`Piecewise` with probability ``alpha = 1 - e^{-eps/2}``
    and :class:`StochasticRounding` otherwise; for ``eps <= 0.61`` (the paper's boundary;
    the reference code used ``<``) it always runs SR. The coin is input-independent, so
    the mixture of two ``eps``-LDP randomisers is ``eps``-LDP. Unbiased. For ``eps > 0.61``
    the variance ``alpha Var_PM(x) + (1 - alpha)(C_sr^2 - x^2)`` does not depend on ``x``
    (the ``x^2`` terms cancel) and equals the worst case of ToPS Eq. 22.

    This is the true HM; the ToPS experiment code (``hm.py``) instead switched between PM
    and SR at ``eps = 1.29``.

    Examples
    --------
    >>> round(HYBRID.worst_variance(1.0), 4), round(HYBRID.pm_probability(1.0), 4)
    (4.289, 0.3935)
    """

    domain = (-1.0, 1.0)
    name = "hybrid"
    uniforms = 2

    @staticmethod
    def pm_probability(eps: float) -> float:
        return -math.expm1(-eps / 2.0) if eps > HYBRID_THRESHOLD else 0.0

    def perturb(self, x, eps, u):
        x = self.clip(x)
        u = np.asarray(u)
        use_pm = u[..., 1] < self.pm_probability(eps)
        out = np.empty_like(x)
        out[use_pm] = PIECEWISE.perturb(x[use_pm], eps, u[use_pm])
        out[~use_pm] = STOCHASTIC_ROUNDING.perturb(x[~use_pm], eps, u[~use_pm])
        return out

    def variance(self, x, eps):
        alpha = self.pm_probability(eps)
        return alpha * PIECEWISE.variance(x, eps) + (1.0 - alpha) * STOCHASTIC_ROUNDING.variance(x, eps)

    def worst_variance(self, eps):
        """The variance is ``a + c x^2``, so its maximum over ``[-1, 1]`` is at ``x = 0`` or ``|x| = 1``."""
        return float(max(self.variance(0.0, eps), self.variance(1.0, eps)))

    def central_moment4(self, x, eps):
        """Both components are unbiased, so the mixture's central moments mix linearly."""
        alpha = self.pm_probability(eps)
        return alpha * PIECEWISE.central_moment4(x, eps) + (1.0 - alpha) * STOCHASTIC_ROUNDING.central_moment4(x, eps)

    def output_range(self, eps):
        return PIECEWISE.output_range(eps) if self.pm_probability(eps) > 0 else STOCHASTIC_ROUNDING.output_range(eps)

    def pdf(self, y, x, eps):
        """``alpha`` times the PM density plus ``1 - alpha`` times the SR point masses."""
        alpha = self.pm_probability(eps)
        return alpha * PIECEWISE.pdf(y, x, eps) + (1.0 - alpha) * STOCHASTIC_ROUNDING.pdf(y, x, eps)

    def cell_probabilities(self, x, eps):
        alpha = self.pm_probability(eps)
        pm_reports, pm_mass = PIECEWISE.cell_probabilities(x, eps)
        sr_reports, sr_mass = STOCHASTIC_ROUNDING.cell_probabilities(x, eps)
        reports, where = np.unique(np.concatenate([pm_reports, sr_reports]), return_inverse=True)
        mass = np.bincount(where, weights=np.concatenate([alpha * pm_mass, (1.0 - alpha) * sr_mass]))
        return reports, mass


PIECEWISE = Piecewise()
STOCHASTIC_ROUNDING = StochasticRounding()
HYBRID = Hybrid()
