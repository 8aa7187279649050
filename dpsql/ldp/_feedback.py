"""Device-side engine of the deviation-feedback family (ALGORITHMS.md §6.3-6.5, 6.7, 6.9).

Everything here runs on the data owner's device: it reads true values and emits
reports. One :class:`FeedbackEncoder` advances many independent users in lock step
(one vectorised Square Wave draw per time step), so the sequential part of the
algorithm is one small loop over reports, never over users.

Units: inputs are already mapped to [0, 1] by the public bounds; reports ``x'`` are
returned in the same normalised units (``l_out + (u_out - l_out) * SW(z)``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from dpsql.errors import InvalidParameter
from dpsql.mechanisms.ldp import SQUARE_WAVE

BOUNDS_MODES = ("reference_code", "paper", "fixed_delta")


class Ranges(NamedTuple):
    """Affine frames of one feedback step: the input ``x + D`` is clipped to
    ``[in_lo, in_hi]`` and mapped to [0, 1]; the report is mapped back onto
    ``[out_lo, out_hi]``."""

    in_lo: float
    in_hi: float
    out_lo: float
    out_hi: float

    def gain(self, eps: float) -> float:
        """``d E[x'] / d D`` when nothing is clipped: the slope of the SW mean times the
        two affine maps. It drives the linear noise model of the release."""
        b, p, q = SQUARE_WAVE.constants(eps)
        return 2.0 * b * (p - q) * (self.out_hi - self.out_lo) / (self.in_hi - self.in_lo)


UNIT = Ranges(0.0, 1.0, 0.0, 1.0)


def capp_threshold(eps: float) -> tuple[float, float, float]:
    """``(e_s, e_d, T)`` of CAPP Eq. 11 at per-report budget ``eps`` (worst case ``x = 1``).

    ``e_s = exp(1 - E[SW(1)]) - 1``, ``e_d = sqrt(Var SW(1))``, ``T = e_s - e_d``;
    ``T`` changes sign at ``eps = 0.40788``.

    Examples
    --------
    >>> [round(v, 4) for v in capp_threshold(0.05)]
    [0.6286, 0.5679, 0.0607]
    """
    e_s = math.exp(1.0 - float(SQUARE_WAVE.mean(1.0, eps))) - 1.0
    e_d = math.sqrt(float(SQUARE_WAVE.variance(1.0, eps)))
    return e_s, e_d, e_s - e_d


def capp_ranges(eps: float, bounds_mode: str, clip_delta: float | None = None) -> Ranges:
    """CAPP's clip and output frames (ALGORITHMS.md §6.5, ambiguity #14).

    * ``"reference_code"`` (default, produced the published numbers): ``l = T``,
      ``u = 1 - T``; the input frame is ``[min(l, 0), max(u, 1)]`` (never narrower than
      [0, 1]) and the report is mapped onto ``[l, u]``. For ``T > 0`` this shrinks the
      *output* towards the middle instead of clipping the input.
    * ``"paper"``: ``l = -T``, ``u = 1 + T`` for both frames (Alg. 2 as printed).
    * ``"fixed_delta"``: ``l = -clip_delta``, ``u = 1 + clip_delta`` for both frames
      (the paper's Fig. 11 parametrisation).

    Privacy is the same in every mode: the frames are public, the maps deterministic.
    """
    if bounds_mode == "fixed_delta":
        lo, hi = -clip_delta, 1.0 + clip_delta
        return Ranges(lo, hi, lo, hi)
    threshold = capp_threshold(eps)[2]
    if bounds_mode == "paper":
        lo, hi = -threshold, 1.0 + threshold
        return Ranges(lo, hi, lo, hi)
    lo, hi = threshold, 1.0 - threshold
    return Ranges(min(lo, 0.0), max(hi, 1.0), lo, hi)


class FeedbackEncoder:
    """Deviation feedback around Square Wave for ``users`` independent users.

    Step ``t`` perturbs ``z = clip((x_t + D_t - in_lo) / (in_hi - in_lo), 0, 1)`` with SW at
    ``eps`` and reports ``x'_t = out_lo + (out_hi - out_lo) * SW(z)``; the deviation
    ``d_t = x_t - x'_t`` is taken against the TRUE value ``x_t`` (DU Fig. 2) and
    ``D_{t+1}`` is the sum of the last ``memory`` deviations. ``memory = 0`` is plain
    SW (no feedback), ``1`` is IPP, ``H`` is APP/CAPP with finite memory, ``None`` the
    paper's unbounded accumulator.

    Privacy: each report is ``eps``-LDP in its input ``z``. A change of the true values
    in a window of ``w`` reports changes the inputs of those ``w`` reports and of the
    next ``memory`` ones, so by adaptive composition the window costs
    ``eps * (w + memory)`` (ALGORITHMS.md §6.8), not the paper's ``eps * w``.

    ``randomiser`` (default :data:`dpsql.mechanisms.ldp.SQUARE_WAVE`) may be replaced by
    any object with ``perturb(z, eps, u)``; tests inject deterministic stubs.
    """

    def __init__(self, users: int, *, eps: float, memory: int | None, ranges: Ranges, randomiser=SQUARE_WAVE):
        if not ranges.in_hi > ranges.in_lo or not ranges.out_hi > ranges.out_lo:
            raise InvalidParameter(f"the CAPP clip range must be non-empty, got {ranges}")
        self.eps = eps
        self.memory = memory
        self.ranges = ranges
        self._randomiser = randomiser
        self._window_sum = np.zeros(users)
        # The last `memory` deviations, as a ring.
        self._ring = np.zeros((users, memory or 0))
        self._step = 0

    def step(self, x: np.ndarray, u: np.ndarray) -> np.ndarray:
        """Reports for the current true values ``x`` (one per user, in [0, 1]), with the
        reports' uniforms ``u`` (one row per user, see :func:`~dpsql.mechanisms.ldp.report_uniforms`)."""
        lo, hi, out_lo, out_hi = self.ranges
        z = np.clip((x + self._window_sum - lo) / (hi - lo), 0.0, 1.0)
        reports = out_lo + (out_hi - out_lo) * self._randomiser.perturb(z, self.eps, u)
        if self.memory != 0:
            deviation = x - reports
            if self.memory is None:
                self._window_sum += deviation
            else:
                self._ring[:, self._step % self.memory] = deviation
                # summed afresh, not updated by "+ new - oldest": float residue of a running sum
                # would carry every past deviation into all later inputs, past the memory the
                # strict accounting charges for
                self._window_sum = self._ring.sum(axis=1)
        self._step += 1
        return reports


def segment_lengths(n: int, qlen: int, n_s: int) -> np.ndarray:
    """Lengths of the sampling segments of a stream of ``n`` slots (PP-S, §6.7).

    The stream is cut into periods of ``qlen`` slots, each into ``n_s`` segments of
    ``L = qlen // n_s`` slots, the period's remainder joining its LAST segment (paper,
    footnote to Alg. 3). A final partial period keeps the segments that fit whole; the
    leftover is not sampled (see :func:`report_slots`), so a device never has to know
    the stream length. Every segment
    therefore has at least ``L`` slots, which is what the strict accounting assumes.
    """
    seg = qlen // n_s
    period = np.full(n_s, seg)
    period[-1] += qlen - n_s * seg
    full, rest = divmod(n, qlen)
    tail = period[:np.searchsorted(np.cumsum(period), rest, side="right")]
    return np.concatenate([np.tile(period, full), tail]).astype(np.int64)


def report_slots(n: int, lengths: np.ndarray) -> np.ndarray:
    """``report_index[t]`` for every slot ``t``: the report that covers it. Slots after
    the last full segment repeat the last report (post-processing; their values are
    never read)."""
    index = np.repeat(np.arange(len(lengths)), lengths)
    return np.concatenate([index, np.full(n - len(index), len(lengths) - 1)])
