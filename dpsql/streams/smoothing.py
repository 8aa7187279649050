"""The adaptive smoother: online post-processing of a released noisy count stream.

Input: released values ``y_t = c_t + e_t`` whose noise ``e_t`` is independent, mean zero,
with a public variance ``sigma2`` (a lattice Laplace draw: ``2 (s / eps)^2``), and
optionally *resets*: public rows at which the smoothing restarts (the first row of each
PeGaSus group). The estimate at row ``t`` reads ``y_1 .. y_t`` and the resets up to ``t``
only, so it is post-processing: it draws no noise and costs nothing. Used by
``count_smoothed`` (:mod:`dpsql.streams.count_laplace`) and PeGaSus's default smoother
(:mod:`dpsql.streams.pegasus`); docs/algorithms.md, "The adaptive smoother", says the same in prose.

Algorithm
---------
* **Candidates** ``k = 0 .. LEVELS``: ``k = 0`` is the released value itself; ``k >= 1`` the
  exponentially weighted mean of the segment so far (rows since the last reset) with
  decay ``beta_k = 1 - 2^-k``, i.e. a horizon of about ``2^k`` rows:
  ``m_k(t) = sum_i beta_k^(t-i) y_i / D_k``, ``D_k = sum_i beta_k^(t-i)``. Its weight on ``y_t``
  is ``w_k = 1 / D_k``, its noise variance ``sigma2 * v_k`` with ``v_k = sum_i beta_k^(2(t-i)) / D_k^2``.
* **Risk** (Mallows' C_p, Stein's unbiased risk estimate for linear smoothers): for any noise
  law with variance ``sigma2``, ``E[(m_k - y_t)^2] = MSE_k + sigma2 - 2 sigma2 w_k``, so
  ``r_k(t) = (m_k - y_t)^2 + 2 sigma2 w_k - sigma2`` is an unbiased estimate of the
  candidate's mean squared error against the true count. ``R_k`` is its exponentially
  weighted average over about ``MEMORY`` rows, squared residuals clipped at ``RISK_CLIP *
  sigma2`` (a residual beyond the noise's plausible range is a change of level, which the
  guard handles; it should not dominate the average for ``MEMORY`` rows), and unknown
  (``inf``) until ``WARM_UP`` rows are averaged.
* **Guard** (Lepski's method, as intersecting confidence intervals): candidate ``k`` is
  admissible at ``t`` if the intervals ``m_j +- z_j(t) sqrt(sigma2 v_j)`` of all ``j <= k``
  share a point. After a change of level the long horizons disagree with the short ones
  and are excluded within a few rows, before the slow risk average notices.
* **Shrinkage** toward ``y_t``: ``c^_t = y_t + lam (m_k - y_t)``. Given the candidate's risk,
  the C_p risk of the combination is ``sigma2 - 2 lam B + lam^2 A`` with ``B = sigma2 (1 - w_k)``
  and ``A = R_k + sigma2 - 2 sigma2 w_k``, least at ``lam = B / A`` (clipped to ``[0, 1]``):
  on rough data (``R_k`` large) most of the weight goes back to ``y_t``.
* **Choice**: the admissible candidate of least shrunk risk, with risks known *before* row
  ``t`` (``R_k(t-1)``); only the guard reads ``y_t``.

Defaults, derived from the noise model alone (never from data)
------------------------------------------------------------------
* ``LEVELS = 12``: horizons ``2 .. 4096``. On a constant stream the longest candidate's
  noise is ``sigma2 / (2^13 - 1)``, 1.2e-4 of the released noise: more levels could not
  move any ratio to per-step Laplace that matters (the targets are 1/2 and 1/4), and each
  level costs time linearly.
* ``MEMORY = 512``: the C_p risk averages squared residuals; for Laplace noise
  ``Var(e^2) = E e^4 - sigma2^2 = 5 sigma2^2``, so over ``M`` rows its standard deviation
  is about ``sqrt(5 / M) sigma2``. ``M = 512`` (a power of two) puts it below ``sigma2 / 10``:
  candidates whose risks differ by a tenth of the released noise are told apart, and the
  average still follows a change of the stream's smoothness within a few hundred rows.
* Guard level: on a constant stream the best candidate's risk is about ``sigma2 / 2^13``;
  a false alarm at a row costs at most ``sigma2`` there (it forces a shorter horizon, at
  worst ``y_t``). Keeping the expected cost below that floor asks for a false-alarm
  probability ``2^-13`` per row, split evenly over the ``LEVELS + 1`` intervals (a union
  bound): ``TEST_LEVEL = 2^-13 / 13 = 9.4e-6`` per interval. An interval's multiplier is the
  larger of the Gaussian quantile of the whole sum (``GAUSS_Z = 4.43``) and the Laplace
  quantile of its largest single term (``LAPLACE_Z * w_k / sqrt(v_k)``, ``LAPLACE_Z =
  ln(1 / TEST_LEVEL) / sqrt 2 = 8.19``): one Laplace draw dominates a short horizon, many
  draws a long one (the same rule as :func:`dpsql.error_models.quantile_multiplier`).
* ``RISK_CLIP = LAPLACE_Z^2``: a squared residual above the square of that Laplace quantile
  is not noise at the guard's level.
* ``WARM_UP = 6``: a risk average over ``N`` rows has a standard deviation of about
  ``sqrt(5 / N) sigma2`` from the noise alone. Below 6 rows that exceeds ``sigma2``, the most
  any candidate can gain over ``y_t``: the average cannot tell a candidate that gains from one
  that loses (two equal counts at a stream's start make every level look free), so the risks
  stay unknown, and the output is ``y_t``, until 6 rows are averaged.

Exactness and speed: the weighted means are computed by pieces of ``PIECE`` rows at fixed
stream positions (scaled prefix sums within a piece, carried across pieces and calls), and
every other step is elementwise, so a stream fed in any chunks gives bit-identical
outputs; the state is a few arrays of ``LEVELS + 1`` numbers per partition. All rows are
processed at once (no Python loop over rows; one short step per piece of 256 rows).

Error model (:class:`AdaptiveNoise`): given its choices ``(k_t, lam_t)`` the output is linear
in the released values, ``c^_t = (1 - lam_t) y_t + lam_t m_k(t)``, so the noise variance of
any range sum follows exactly from them. It is a *plug-in*: the choices are functions of
the noise too (through the risk averages, slowly, and through the guard), and the
smoothing error (``lam (m_k - c_t)`` for the true counts) is not noise; its estimated size
per row, ``lam sqrt(max(R_k - sigma2 v_k, 0))``, is kept and bounds range sums in
:meth:`AdaptiveNoise.range_bias_bound`.
"""

from __future__ import annotations

import functools
import math
from statistics import NormalDist

import numpy as np

from dpsql.error_models import ErrorModel

LEVELS = 12
MEMORY = 512
TEST_LEVEL = 2.0 ** -(LEVELS + 1) / (LEVELS + 1)
GAUSS_Z = NormalDist().inv_cdf(1.0 - TEST_LEVEL / 2.0)
LAPLACE_Z = math.log(1.0 / TEST_LEVEL) / math.sqrt(2.0)
RISK_CLIP = LAPLACE_Z**2
WARM_UP = 6
#: Rows per piece of the weighted-mean recursion (``2^255`` is the largest scale factor).
PIECE = 256
#: Rows smoothed at once (bounds the ``(rows, LEVELS + 1)`` temporaries to a few MB).
BATCH = 8192
#: Decays of the candidates (``0`` for the released value itself).
BETAS = np.array([0.0] + [1.0 - 2.0**-k for k in range(1, LEVELS + 1)])
_RHO = 1.0 - 1.0 / MEMORY
#: Beyond ``SATURATION * 2^k`` rows a level's weights no longer change in float64.
SATURATION = 40


# -- tables (functions of public constants only) -------------------------------------------------


@functools.cache
def _piece_tables(betas: tuple[float, ...]) -> tuple[np.ndarray, np.ndarray]:
    """``up[c, j] = beta_c^-j`` and ``down[c, j] = beta_c^j`` for ``j < PIECE``."""
    beta = np.array(betas)
    down = beta[:, None] ** np.arange(PIECE, dtype=np.float64)[None, :]
    return 1.0 / down, down


@functools.cache
def _level_table(k: int) -> np.ndarray:
    """Candidate ``k``'s ``(w, v, h)`` for segment lengths ``L = 1 .. SATURATION 2^k`` (``(3,
    lengths)``; held beyond): the weight of the current row, the sum of squared weights and the
    guard's half-width in units of ``sqrt(sigma2)``."""
    if k == 0:
        return np.array([[1.0], [1.0], [max(GAUSS_Z, LAPLACE_Z)]])
    powers = BETAS[k] ** np.arange(SATURATION * 2**k, dtype=np.float64)
    d = np.cumsum(powers)
    w, v = 1.0 / d, np.cumsum(powers * powers) / (d * d)
    return np.stack([w, v, np.maximum(GAUSS_Z * np.sqrt(v), LAPLACE_Z * w)])


def level_weights(k: int, length: np.ndarray) -> np.ndarray:
    """Candidate ``k``'s ``(w, v, h)`` (module docstring) for segment lengths ``length``: an
    array ``(3, *length.shape)``, or ``(3, 1, ...)`` when every length is past saturation."""
    table = _level_table(int(k))
    cap = table.shape[1]
    if length.size and length.min() >= cap:
        return table[:, -1].reshape((3,) + (1,) * length.ndim)
    return table[:, np.minimum(length, cap) - 1]


@functools.cache
def _memory_table() -> np.ndarray:
    """The risk average's denominator after ``t`` rows: ``sum_{i<t} rho^i``, held after saturation."""
    return np.cumsum(_RHO ** np.arange(SATURATION * MEMORY, dtype=np.float64))


def _memory_weight(rows: np.ndarray) -> np.ndarray:
    table = _memory_table()
    return table[np.minimum(rows, len(table)) - 1]


def cp_terms(estimate: np.ndarray, y: np.ndarray, own: np.ndarray | float, s2: np.ndarray) -> np.ndarray:
    """Per row, the C_p risk term ``(estimate - y)^2 + 2 sigma2 own - sigma2`` of a linear estimate
    putting weight ``own`` on ``y`` (unbiased for its squared error against the true count), the
    squared residual clipped at ``RISK_CLIP sigma2`` (module docstring)."""
    return np.minimum((estimate - y) ** 2, RISK_CLIP * s2) + 2.0 * s2 * own - s2


def risks_before(terms: np.ndarray, state: dict, last: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The risk averages (about ``MEMORY`` rows, exponentially weighted) of the C_p ``terms``
    ``(partitions, candidates, rows)`` as known *before* each row, continuing from ``state``
    (:func:`ewm_state`, updated in place) and ``last`` (the averages after the previous row);
    and the averages after the last row (the next call's ``last``). Before :data:`WARM_UP` rows
    are averaged a risk is unknown (``inf``)."""
    seen = state["count"] + np.arange(terms.shape[-1])  # rows averaged before each row
    risks = ewm(terms, (_RHO,) * terms.shape[1], None, state) / _memory_weight(seen + 1)
    before = np.concatenate([last[:, :, None], risks[:, :, :-1]], axis=2)
    before[:, :, seen < WARM_UP] = np.inf  # too few rows to tell a gain from a loss
    return before, (risks[:, :, -1].copy() if terms.shape[-1] else last)


# -- exponentially weighted sums by pieces -----------------------------------------------------------


def ewm_state(partitions: int, columns: int) -> dict:
    zeros = np.zeros((partitions, columns))
    return {"count": 0, "start": zeros, "partial": zeros.copy(), "base": zeros.copy(),
            "reset": np.zeros(partitions, dtype=bool)}


def ewm(x: np.ndarray, betas: tuple[float, ...], resets: np.ndarray | None, state: dict) -> np.ndarray:
    """``z_t = beta z_{t-1} (1 - reset_t) + x_t`` for ``x`` of shape ``(partitions, columns,
    rows)``, one decay per column, continuing from ``state`` (updated in place).

    Rows fall into pieces of :data:`PIECE` at fixed stream positions; within a piece
    ``z_j = beta^j (beta z_start + C_j)``, with ``C_j`` the running sum of ``x_i beta^-i``
    (or ``beta^j (C_j - C_{r-1})`` after a reset at ``r`` in the piece). A piece's running sum
    is carried across calls, so the additions are the same whatever the chunks.
    """
    parts, cols, n = x.shape
    up, down = _piece_tables(betas)
    beta = np.array(betas)[None, :, None]
    offset = state["count"] % PIECE
    pieces = -(-(offset + n) // PIECE)
    scaled = np.zeros((parts, cols, pieces * PIECE))
    scaled[:, :, offset:offset + n] = x
    scaled = scaled.reshape(parts, cols, pieces, PIECE)
    scaled *= up[None, :, None, :]
    if offset:
        scaled[:, :, 0, offset - 1] = state["partial"]
    running = np.cumsum(scaled, axis=3)
    if resets is None and not state["reset"].any():
        starts = np.empty((parts, cols, pieces))
        starts[:, :, 0] = state["start"]
        for p in range(pieces - 1):
            starts[:, :, p + 1] = down[:, -1] * (beta[..., 0] * starts[:, :, p] + running[:, :, p, -1])
        z = down[None, :, None, :] * (beta[..., None] * starts[..., None] + running)
        after_reset = base = None
    else:
        flags = np.zeros((parts, pieces * PIECE), dtype=bool)
        if resets is not None:
            flags[:, offset:offset + n] = resets
        last = np.maximum.accumulate(np.where(flags.reshape(parts, pieces, PIECE), np.arange(PIECE), -1), axis=2)
        after_reset = np.broadcast_to(last[:, None] >= 0, (parts, cols, pieces, PIECE)).copy()
        at = np.broadcast_to(np.maximum(last - 1, 0)[:, None], (parts, cols, pieces, PIECE))
        base = np.where(last[:, None] > 0, np.take_along_axis(running, at, axis=3), 0.0)
        if offset and state["reset"].any():  # a reset earlier in this piece, in an earlier call
            carried = state["reset"][:, None, None] & ~after_reset[:, :, 0, :]
            base[:, :, 0] = np.where(carried, state["base"][:, :, None], base[:, :, 0])
            after_reset[:, :, 0] |= carried
        starts = np.empty((parts, cols, pieces))
        starts[:, :, 0] = state["start"]
        for p in range(pieces - 1):
            starts[:, :, p + 1] = down[:, -1] * np.where(after_reset[:, :, p, -1], running[:, :, p, -1]
                                                         - base[:, :, p, -1],
                                                         beta[..., 0] * starts[:, :, p] + running[:, :, p, -1])
        z = down[None, :, None, :] * np.where(after_reset, running - base,
                                              beta[..., None] * starts[..., None] + running)
    end = offset + n - 1
    piece, row = divmod(end, PIECE)
    zeros = np.zeros((parts, cols))
    if row == PIECE - 1:
        state.update(start=z[:, :, piece, row].copy(), partial=zeros, base=zeros.copy(),
                     reset=np.zeros(parts, dtype=bool))
    elif base is None:
        state.update(start=starts[:, :, piece].copy(), partial=running[:, :, piece, row].copy(), base=zeros,
                     reset=np.zeros(parts, dtype=bool))
    else:
        state.update(start=starts[:, :, piece].copy(), partial=running[:, :, piece, row].copy(),
                     base=base[:, :, piece, row].copy(), reset=after_reset[:, 0, piece, row].copy())
    state["count"] += n
    return z.reshape(parts, cols, pieces * PIECE)[:, :, offset:offset + n]


# -- the smoother ----------------------------------------------------------------------------------


class Smoothed:
    """What one :meth:`AdaptiveSmoother.feed` returns, each ``(partitions, rows)``: ``values``
    (the estimates), ``level`` (the chosen candidate ``k``), ``weight`` (``lam``), ``spread``
    (the estimated smoothing error, ``lam sqrt(max(R_k - sigma2 v_k, 0))``) and ``length`` (the
    segment length); with ``internals``, also every candidate's ``means``, ``v`` and
    ``admissible`` (``(partitions, rows, LEVELS + 1)``)."""

    def __init__(self, **arrays):
        self.__dict__.update(arrays)


class AdaptiveSmoother:
    """The adaptive smoother's state for ``partitions`` streams (module docstring).

    ``variance``: the noise variance of one released value, per partition (or one for all).

    Examples
    --------
    A constant count of 20 released with Laplace noise of variance 8 (epsilon 0.5):

    >>> rng = np.random.default_rng(0)
    >>> y = 20.0 + rng.laplace(0.0, 2.0, size=(1, 5000))
    >>> smoother = AdaptiveSmoother(8.0)
    >>> out = smoother.feed(y[:, :3000]).values
    >>> out = np.concatenate([out, smoother.feed(y[:, 3000:]).values], axis=1)
    >>> bool(np.mean((out[0, 1000:] - 20.0) ** 2) < 0.1)  # vs 8 for the released values
    True
    """

    def __init__(self, variance: float | np.ndarray, partitions: int = 1):
        self.variance = np.broadcast_to(np.asarray(variance, dtype=np.float64), (partitions,)).copy()
        self.partitions = partitions
        self._means = ewm_state(partitions, LEVELS)
        self._risks = ewm_state(partitions, LEVELS)
        self._length = np.zeros(partitions, dtype=np.int64)  # rows of the current segment so far
        self._risk_before = np.full((partitions, LEVELS), np.inf)  # R_k known before the next row

    def feed(self, y: np.ndarray, resets: np.ndarray | None = None, *, internals: bool = False) -> Smoothed:
        """Estimates for the next rows ``y`` (``(partitions, rows)``); ``resets[p, i]`` restarts
        partition ``p``'s smoothing at row ``i``."""
        y = np.asarray(y, dtype=np.float64).reshape(self.partitions, -1)
        pieces = [self._feed(y[:, a:a + BATCH], None if resets is None else resets[:, a:a + BATCH], internals)
                  for a in range(0, y.shape[1], BATCH)]
        if not pieces:
            pieces = [self._feed(y, None if resets is None else resets, internals)]
        return Smoothed(**{name: np.concatenate([getattr(p, name) for p in pieces], axis=1)
                           for name in vars(pieces[0])})

    def _feed(self, y: np.ndarray, resets: np.ndarray | None, internals: bool) -> Smoothed:
        parts, n = y.shape
        idx = np.arange(n)
        if resets is None:
            length = self._length[:, None] + 1 + idx
        else:
            resets = np.asarray(resets, dtype=bool).reshape(parts, n)
            last = np.maximum.accumulate(np.where(resets, idx, -1), axis=1)
            length = np.where(last >= 0, idx - last + 1, self._length[:, None] + 1 + idx)
        if n:
            self._length = length[:, -1].copy()
        s2 = self.variance[:, None]
        sd = np.sqrt(s2)
        sums = ewm(np.broadcast_to(y[:, None, :], (parts, LEVELS, n)), tuple(BETAS[1:]), resets, self._means)
        tables = [level_weights(k, length) for k in range(LEVELS + 1)]
        means = [y] + [sums[:, k - 1] * tables[k][0] for k in range(1, LEVELS + 1)]
        # risk of every level, known after each row; the choice at a row uses the one before it
        terms = np.stack([cp_terms(means[k], y, tables[k][0], s2) for k in range(1, LEVELS + 1)], axis=1)
        before, self._risk_before = risks_before(terms, self._risks, self._risk_before)
        # Walk up the levels: the guard's running intersection of intervals, and the admissible
        # candidate of least shrunk risk so far (the identity's: sigma2, no shrinkage).
        low, high = means[0] - tables[0][2] * sd, means[0] + tables[0][2] * sd
        best = np.broadcast_to(s2, (parts, n)).copy()
        level = np.zeros((parts, n), dtype=np.intp)
        weights = np.zeros((parts, LEVELS + 1, n))
        if internals:
            admissible = [np.ones((parts, n), dtype=bool)]
        for k in range(1, LEVELS + 1):
            w, _, h = tables[k]
            low = np.maximum(low, means[k] - h * sd)
            high = np.minimum(high, means[k] + h * sd)
            ok = low <= high
            risk = before[:, k - 1]
            gain = s2 * (1.0 - w)
            spread2 = risk + (s2 - 2.0 * s2 * w)
            full = gain >= spread2  # lam = 1: the shrunk risk is the level's own
            with np.errstate(invalid="ignore", divide="ignore"):
                weights[:, k] = np.where(full, 1.0, gain / spread2)
                shrunk = np.where(full, risk, s2 - gain * gain / spread2)
            better = ok & (shrunk < best)  # an unknown risk (inf) gives nan: never better
            best = np.where(better, shrunk, best)
            level[better] = k
            if internals:
                admissible.append(ok)
        at = level[:, None, :]
        lam = np.take_along_axis(weights, at, axis=1)[:, 0]
        mean = np.take_along_axis(np.stack(means, axis=1), at, axis=1)[:, 0]
        v = np.stack([np.broadcast_to(tables[k][1], (parts, n)) for k in range(LEVELS + 1)], axis=1)
        risk = np.concatenate([np.broadcast_to(s2[:, :, None], (parts, 1, n)), before], axis=1)
        excess = np.take_along_axis(risk - s2[:, :, None] * v, at, axis=1)[:, 0]
        out = Smoothed(values=y + lam * (mean - y), level=level.astype(np.int8), weight=lam,
                       spread=lam * np.sqrt(np.maximum(excess, 0.0)), length=length)
        if internals:
            out.means = np.stack(means, axis=1)
            out.v = v
            out.admissible = np.stack(admissible, axis=1)
        return out

    def snapshot(self) -> dict:
        return {"means": dict(self._means), "risks": dict(self._risks), "length": self._length.copy(),
                "risk_before": self._risk_before.copy()}

    def restore(self, state: dict) -> None:
        self._means = {**state["means"], "count": int(state["means"]["count"])}
        self._risks = {**state["risks"], "count": int(state["risks"]["count"])}
        self._length = np.asarray(state["length"], dtype=np.int64).copy()
        self._risk_before = np.asarray(state["risk_before"], dtype=np.float64).copy()


# -- error model --------------------------------------------------------------------------------------


def level_share(level: np.ndarray, weight: np.ndarray, length: np.ndarray) -> np.ndarray:
    """``lam_t w_k(t)``: the weight row ``t``'s output puts on its own value through its level's
    mean (0 at level 0), from per-row ``level`` (``k``), ``weight`` (``lam``) and segment ``length``.
    The output's whole weight on its own value is ``1 - lam_t + lam_t w_k(t)``."""
    share = np.zeros(len(level))
    for k in range(1, LEVELS + 1):
        hit = level == k
        if hit.any():
            share[hit] = weight[hit] * level_weights(k, length[hit])[0]
    return share


class _Segments:
    """One cut of the stream into segments (first rows ``starts``) and the rows (``rows``, a mask)
    whose level means run within it."""

    def __init__(self, starts: np.ndarray, rows: np.ndarray, n: int):
        self.starts, self.rows = starts, rows
        self.resets = np.zeros(n, dtype=bool)
        self.resets[starts] = True
        self.ends = np.zeros(n, dtype=bool)
        self.ends[starts[1:] - 1] = True
        self.ends[-1] = True

    def start_of(self, rows: np.ndarray) -> np.ndarray:
        return self.starts[np.searchsorted(self.starts, rows, side="right") - 1]


#: ``q_kl / (1 - q_kl)`` for ``q_kl = beta_k beta_l`` (levels ``k, l >= 1``): ``sum_{d >= 1} q^d``.
_GEOMETRIC = np.outer(BETAS[1:], BETAS[1:]) / (1.0 - np.outer(BETAS[1:], BETAS[1:]))


#: ``beta_k^j`` and ``beta_k^(4096 j)`` for ``j < 4096`` (levels ``k >= 1``): powers up to ``2^24`` by two
#: lookups; beyond, every level's power is below ``exp(-2^24 / 2^12)``, zero in float64.
_POWER_STEP = 4096
_LOW_POWERS = BETAS[1:] ** np.arange(_POWER_STEP, dtype=np.float64)[:, None]
_HIGH_POWERS = BETAS[1:] ** (_POWER_STEP * np.arange(_POWER_STEP, dtype=np.float64))[:, None]


def _powers(m: np.ndarray) -> np.ndarray:
    """``beta_k^m`` (``(len(m), LEVELS)``) for integers ``m >= 0``, to a few ulps (table lookups:
    a float power per entry costs more than the rest of a range's variance)."""
    m = np.minimum(m, _POWER_STEP**2 - 1)
    return _LOW_POWERS[m % _POWER_STEP] * _HIGH_POWERS[m // _POWER_STEP]


def _geometric_form(x: np.ndarray, y: np.ndarray, m: np.ndarray) -> np.ndarray:
    """``sum_{k,l} x_k y_l sum_{d=1}^{m} (beta_k beta_l)^d`` per row of ``x``, ``y`` (``(ranges,
    LEVELS)``), for ``m`` per range: ``x Q y - (x B) Q (y B)`` with ``B = beta^m``, since
    ``q_kl^m = beta_k^m beta_l^m`` (no per-range ``LEVELS^2`` arrays)."""
    decay = _powers(m)
    return np.sum((x @ _GEOMETRIC) * y, axis=1) - np.sum(((x * decay) @ _GEOMETRIC) * (y * decay), axis=1)


def _distinct(values: np.ndarray) -> np.ndarray:
    """The sorted distinct values of an int64 array (by one sort: ``np.unique``'s hashing is
    slower on the hundreds of thousands of rows a range query asks for)."""
    ordered = np.sort(values)
    return ordered[np.r_[True, ordered[1:] != ordered[:-1]]] if len(ordered) else ordered


class AdaptiveNoise(ErrorModel):
    """Noise of the adaptive smoother's outputs given its choices (a plug-in, module docstring).

    Row ``t`` (segment start ``s``) is ``(1 - lam_t) y_t + lam_t w_t sum_{s <= i <= t}
    beta^(t-i) y_i`` for its level ``k_t`` and weight ``lam_t``, ``w_t = 1 / D_k`` for the
    segment length so far. A range sum's noise is ``sigma2 sum_i g_i^2``, ``g_i`` the total
    weight of ``y_i`` in it. With ``a_t = lam_t w_t`` and, per level ``k``, the suffix sums
    ``h^k_i = sum_{t >= i, k_t = k} a_t beta_k^(t-i)`` (within ``i``'s segment), every row's total
    weight on all outputs is ``U_i = 1 - lam_i + sum_k h^k_i``; a range ``[a, b)`` keeps
    ``U_i`` for its rows minus what outputs from ``b`` on take (``sum_k beta_k^(b-i) h^k_b`` in
    ``b``'s segment), and adds the geometric tails of the rows before ``a`` in ``a``'s segment.
    Squared and summed, each piece is a prefix sum or a geometric series: every range costs
    ``O(LEVELS^2)`` after two passes over the rows (exact; tested against the weight matrix).

    With ``whole``, rows flagged True were smoothed over the whole stream (one segment from
    row 0, their means ignoring ``starts``) and the others within ``starts``' segments, as
    PeGaSus's default publishes (:class:`dpsql.streams.group_smoothing.GroupedOrWhole`). Each
    cut gets its own suffix sums ``h`` over its own rows; the pieces above then add up over
    the cuts, and the squared sums gain the cross terms of every pair of cuts over the rows
    both reach (still exact given the choices).

    :meth:`range_bias_bound` adds the estimated smoothing error of each row in the range
    (``spread``: ``lam sqrt(max(R_k - sigma2 v_k, 0))``, the part of the level's C_p risk that is
    not noise); an estimate from released values, not a sure bound.

    Parameters are plain data (the ledger records them): ``variance`` (``sigma2``), per row
    ``level`` (int8), ``weight`` and ``spread``, the segment ``starts`` (the resets; ``[0]``
    for a stream smoothed as one segment), ``noisy``, the released noisy counts the outputs
    were computed from (kept with the model so that a release rebuilt from its ledger record
    can still re-smooth its window sums, :func:`dpsql.streams.windows.window_sums`), and
    ``whole`` (optional, per row).
    """

    def __init__(self, variance: float, level: np.ndarray, weight: np.ndarray, spread: np.ndarray,
                 starts: np.ndarray, noisy: np.ndarray | None = None, whole: np.ndarray | None = None):
        self._variance = float(variance)
        self.noisy = None if noisy is None else np.asarray(noisy, dtype=np.float64)
        self._level = np.asarray(level, dtype=np.int8)
        self._weight = np.asarray(weight, dtype=np.float64)
        self._spread = np.concatenate([[0.0], np.cumsum(np.asarray(spread, dtype=np.float64))])
        self._n = n = len(self._level)
        starts = np.asarray(starts, dtype=np.int64)
        self._starts = np.unique(np.concatenate([[0], starts[(starts > 0) & (starts < n)]])) if n else np.zeros(1, int)
        whole = np.zeros(n, dtype=bool) if whole is None else np.asarray(whole, dtype=bool)
        self._cuts = [_Segments(self._starts, ~whole, n)] if n else []
        if whole.any():
            self._cuts.append(_Segments(np.zeros(1, dtype=np.int64), whole, n))
        self._prepared: tuple | None = None

    @property
    def starts(self) -> np.ndarray:
        """The first row of every segment (PeGaSus: of every group)."""
        return self._starts

    def _prepare(self):
        """Every cut's ``a_t`` (its rows only) and ``U`` (prefix sums of ``U^2``), once; the per-level
        passes are redone per call, keeping only the rows asked for."""
        if self._prepared is None:
            rows = np.arange(self._n)
            u = 1.0 - self._weight
            shares = []
            for cut in self._cuts:
                share = np.zeros(self._n)
                mine = rows[cut.rows]
                share[mine] = level_share(self._level[mine], self._weight[mine], mine - cut.start_of(mine) + 1)
                shares.append(share)
                for lo, hi, h in self._suffix_sums(share, cut):
                    u[lo:hi] += h.sum(axis=0)
            self._prepared = (shares, u, np.concatenate([[0.0], np.cumsum(u * u)]))
        return self._prepared

    def _suffix_sums(self, share: np.ndarray, cut: _Segments):
        """``h^k_i`` (``(LEVELS, rows)``) of the rows of ``cut`` by chunks of rows from the end:
        yields ``(lo, hi, h)``."""
        state = ewm_state(1, LEVELS)
        for hi in range(self._n, 0, -BATCH):
            lo = max(0, hi - BATCH)
            x = np.zeros((1, LEVELS, hi - lo))
            for k in range(1, LEVELS + 1):
                hit = self._level[lo:hi] == k
                x[0, k - 1, hit] = share[lo:hi][hit]
            h = ewm(x[:, :, ::-1], tuple(BETAS[1:]), cut.ends[lo:hi][None, ::-1], state)[0, :, ::-1]
            yield lo, hi, h

    def _prefix_sums_at(self, u: np.ndarray, resets: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """``P^k_j = sum_{s(j) <= i < j} U_i beta_k^(j-i)`` at ``rows`` (``(len(rows), LEVELS)``)."""
        state = ewm_state(1, LEVELS)
        out = np.zeros((len(rows), LEVELS))
        before = rows - 1  # P_j = beta z_{j-1} within j's segment
        valid = (rows > 0) & ~resets[np.minimum(rows, self._n - 1)]
        for lo in range(0, self._n, BATCH):
            hi = min(self._n, lo + BATCH)
            z = ewm(np.broadcast_to(u[lo:hi], (1, LEVELS, hi - lo)), tuple(BETAS[1:]), resets[None, lo:hi], state)
            hit = valid & (before >= lo) & (before < hi)
            out[hit] = BETAS[1:] * z[0][:, before[hit] - lo].T
        return out

    def _suffix_at(self, share: np.ndarray, cut: _Segments, rows: np.ndarray) -> np.ndarray:
        out = np.zeros((len(rows), LEVELS))
        for lo, hi, h in self._suffix_sums(share, cut):
            hit = (rows >= lo) & (rows < hi)
            out[hit] = h[:, rows[hit] - lo].T
        return out

    def _cut_terms(self, cut: _Segments, share: np.ndarray, u: np.ndarray, a_rows: np.ndarray,
                   b_rows: np.ndarray) -> tuple[np.ndarray, ...]:
        """One cut's part of the ranges ``[a, b)``: ``-2 sum_k h^k_b x^k`` (the range's rows lose
        what outputs from ``b`` on in ``b``'s segment take, ``x^k = sum_{c <= i < b} U_i beta_k^(b-i)``
        from ``c = max(a, s(b))``), ``h_b`` and ``c`` for the squares of that loss, and the tails'
        ``J = h_a - beta^(b-a) h_b`` (``h_b`` only if ``b`` is in ``a``'s segment) with ``s(a)``."""
        n = self._n
        s_b = cut.start_of(np.minimum(b_rows, n - 1))
        inside = (b_rows < n) & (s_b < b_rows)  # outputs from b on share b's segment with the range
        s_a = cut.start_of(a_rows)
        tail = a_rows > s_a
        c = np.maximum(a_rows, s_b)
        wanted = _distinct(np.concatenate([b_rows[inside], a_rows[tail]]))
        h = self._suffix_at(share, cut, wanted)
        h_b, h_a = np.zeros((len(b_rows), LEVELS)), np.zeros((len(a_rows), LEVELS))
        h_b[inside] = h[np.searchsorted(wanted, b_rows[inside])]
        h_a[tail] = h[np.searchsorted(wanted, a_rows[tail])]
        loss = np.zeros(len(b_rows))
        if inside.any():
            positions = _distinct(np.concatenate([b_rows[inside], c[inside]]))
            p = self._prefix_sums_at(u, cut.resets, positions)
            x = (p[np.searchsorted(positions, b_rows[inside])]
                 - _powers((b_rows - c)[inside]) * p[np.searchsorted(positions, c[inside])])
            loss[inside] = -2.0 * np.sum(h_b[inside] * x, axis=1)
        same = (b_rows < n) & (s_b == s_a)
        j = h_a - np.where((same & tail)[:, None], _powers(b_rows - a_rows) * h_b, 0.0)
        return loss, h_b, c, j, s_a

    def range_variance(self, starts, stops):
        starts, stops = np.asarray(starts, dtype=np.int64), np.asarray(stops, dtype=np.int64)
        out = np.zeros(np.broadcast(starts, stops).shape)
        starts, stops = np.broadcast_to(starts, out.shape).ravel(), np.broadcast_to(stops, out.shape).ravel()
        hit = stops > starts
        if not hit.any():
            return out
        a_rows, b_rows = starts[hit], stops[hit]
        shares, u, u2 = self._prepare()
        total = u2[b_rows] - u2[a_rows]
        terms = [self._cut_terms(cut, share, u, a_rows, b_rows) for cut, share in zip(self._cuts, shares)]
        for loss, *_ in terms:
            total += loss
        # the squares of each cut's pieces, and twice the products of two cuts' over the rows both reach
        for first, (_, h_b, c, j, s_a) in enumerate(terms):
            for second, (_, other_h_b, other_c, other_j, other_s_a) in enumerate(terms[first:], start=first):
                times = 1.0 if second == first else 2.0
                total += times * _geometric_form(h_b, other_h_b, b_rows - np.maximum(c, other_c))
                total += times * _geometric_form(j, other_j, a_rows - np.maximum(s_a, other_s_a))
        out.ravel()[np.flatnonzero(hit)] = self._variance * np.maximum(total, 0.0)
        return out

    def range_bias_bound(self, starts, stops):
        starts, stops = np.asarray(starts, dtype=np.int64), np.asarray(stops, dtype=np.int64)
        return self._spread[np.maximum(stops, starts)] - self._spread[starts]
