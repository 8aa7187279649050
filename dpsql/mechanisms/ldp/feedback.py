"""Deviation feedback around Square Wave, run on the data owner's device (Du et al.;
docs/algorithms.md, "The w-event family").

Everything here reads true values and emits reports. One :class:`FeedbackEncoder`
advances many independent users together: the feedback makes each user's reports a
sequential recursion in time, so the loop runs over reports and every step is
vectorised across users; a few users (one user's long stream is the common case) run a
plain-float loop per user instead, which gives the same reports bit for bit and is
some twenty times faster than a numpy step per report. Without feedback (``memory=0``)
there is no recursion and all reports are drawn at once.

Units: inputs are already mapped to [0, 1] by the public bounds; reports ``x'`` are
returned in the same normalised units (``l_out + (u_out - l_out) * SW(z)``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from dpsql.errors import InvalidParameter
from dpsql.mechanisms.ldp.randomisers import SQUARE_WAVE

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
    """CAPP's clip and output frames (the paper's and its code's differ: both are offered).

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


#: Up to this many users, :meth:`FeedbackEncoder.run` loops per user in plain floats; beyond,
#: per report with numpy across users (about 1.5 us per report and user against 20-40 us per
#: numpy step, measured on the 2-core reference machine: the two cross near 20 users).
PLAIN_LOOP_USERS = 16


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
    ``eps * (w + memory)`` (docs/algorithms.md, "The w-event family"), not the paper's ``eps * w``. That needs
    ``D_t`` to be a function of the last ``memory`` deviations alone, to the last bit: a
    running float sum updated by "+ newest - oldest" would carry the rounding residue of
    every past deviation into all later inputs. Time is cut into blocks of ``memory``
    reports, and ``D_t`` is the sum of the remembered deviations of the previous block
    (its suffix sums, computed once when the block completes) plus the running sum of
    the current block's: both are sums of remembered deviations only, in a fixed order,
    and each report costs O(1) whatever the memory.

    ``randomiser`` (default :data:`dpsql.mechanisms.ldp.SQUARE_WAVE`) may be replaced by
    any object with ``perturb(z, eps, u)``; tests inject deterministic stubs.

    Examples
    --------
    >>> import dpsql
    >>> from dpsql.mechanisms.ldp import report_uniforms
    >>> u = report_uniforms(dpsql.testing.draws(0), 0, 6, uniforms=1)
    >>> x = np.array([[0.2, 0.4, 0.6, 0.8, 0.6, 0.4]])
    >>> together = FeedbackEncoder(1, eps=1.0, memory=2, ranges=UNIT).run(x, u[None])
    >>> encoder = FeedbackEncoder(1, eps=1.0, memory=2, ranges=UNIT)
    >>> one_by_one = np.stack([encoder.step(x[:, t], u[None, t]) for t in range(6)], axis=1)
    >>> bool((together == one_by_one).all())
    True
    """

    def __init__(self, users: int, *, eps: float, memory: int | None, ranges: Ranges, randomiser=SQUARE_WAVE):
        if not ranges.in_hi > ranges.in_lo or not ranges.out_hi > ranges.out_lo:
            raise InvalidParameter(f"the CAPP clip range must be non-empty, got {ranges}")
        self.eps = eps
        self.memory = memory
        self.ranges = ranges
        self._randomiser = randomiser
        block = memory or 0
        self._suffix = np.zeros((users, block))  # suffix sums of the previous block's deviations
        self._block = np.zeros((users, block))  # the current block's deviations so far
        self._prefix = np.zeros(users)  # their running sum (memory None: of every deviation)
        self._step = 0

    def _remembered(self) -> np.ndarray | float:
        """``D_t`` for every user (see the class docstring)."""
        if self.memory == 0:
            return 0.0
        if self.memory is None:
            return self._prefix
        return self._suffix[:, self._step % self.memory] + self._prefix

    def _remember(self, deviation: np.ndarray) -> None:
        if self.memory == 0:
            return
        self._prefix += deviation
        if self.memory is not None:
            position = self._step % self.memory
            self._block[:, position] = deviation
            if position == self.memory - 1:
                self._suffix = np.cumsum(self._block[:, ::-1], axis=1)[:, ::-1]
                self._prefix[:] = 0.0

    def step(self, x: np.ndarray, u: np.ndarray) -> np.ndarray:
        """Reports for the current true values ``x`` (one per user, in [0, 1]), with the
        reports' uniforms ``u`` (one row per user, see :func:`~dpsql.mechanisms.ldp.report_uniforms`)."""
        lo, hi, out_lo, out_hi = self.ranges
        z = np.clip((x + self._remembered() - lo) / (hi - lo), 0.0, 1.0)
        reports = out_lo + (out_hi - out_lo) * self._randomiser.perturb(z, self.eps, u)
        self._remember(x - reports)
        self._step += 1
        return reports

    def run(self, x: np.ndarray, u: np.ndarray) -> np.ndarray:
        """``x.shape[1]`` steps at once: ``x`` is users x reports, ``u`` users x reports x
        uniforms; the reports :meth:`step` would give, report by report."""
        if self.memory == 0:
            # no feedback: every input is known, all reports are drawn together
            lo, hi, out_lo, out_hi = self.ranges
            z = np.clip((x - lo) / (hi - lo), 0.0, 1.0)
            self._step += x.shape[1]
            return out_lo + (out_hi - out_lo) * self._randomiser.perturb(z, self.eps, u)
        if self._randomiser is SQUARE_WAVE and len(x) <= PLAIN_LOOP_USERS:
            reports = np.stack([self._run_user(j, x[j].tolist(), u[j, :, 0].tolist()) for j in range(len(x))])
            self._step += x.shape[1]
            return reports.reshape(x.shape)
        return np.stack([self.step(x[:, k], u[:, k]) for k in range(x.shape[1])], axis=1).reshape(x.shape)

    def _run_user(self, user: int, x: list[float], u: list[float]) -> np.ndarray:
        """User ``user``'s reports for the readings ``x`` with the uniforms ``u``, in plain floats:
        :meth:`step`'s arithmetic, operation for operation (inherently sequential)."""
        lo, hi, out_lo, out_hi = self.ranges
        in_width, out_width = hi - lo, out_hi - out_lo
        sample = SQUARE_WAVE.sampler(self.eps)
        memory = self.memory or 0
        unbounded = self.memory is None
        suffix, block = self._suffix[user].tolist(), self._block[user].tolist()
        prefix = float(self._prefix[user])
        position = 0 if unbounded else self._step % memory
        reports = [0.0] * len(x)
        for t, (value, uniform) in enumerate(zip(x, u)):
            remembered = prefix if unbounded else suffix[position] + prefix
            z = (value + remembered - lo) / in_width
            report = out_lo + out_width * sample(0.0 if z < 0.0 else 1.0 if z > 1.0 else z, uniform)
            reports[t] = report
            deviation = value - report
            prefix = prefix + deviation
            if unbounded:
                continue
            block[position] = deviation
            position += 1
            if position == memory:  # the block completes: its suffix sums, as np.cumsum adds them
                total = 0.0
                for i in range(memory - 1, -1, -1):
                    total = block[i] if i == memory - 1 else total + block[i]
                    suffix[i] = total
                prefix, position = 0.0, 0
        self._suffix[user], self._block[user], self._prefix[user] = suffix, block, prefix
        return np.array(reports)
