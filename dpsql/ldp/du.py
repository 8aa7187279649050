"""Du et al.'s perturbation parameterisation under w-event local DP (ALGORITHMS.md §6).

One user's real-valued stream, perturbed on the user's device with Square Wave (P8),
published by an untrusted collector. Methods (one shared signature
``f(values, *, epsilon, w, lower, upper, budget=None, **params)``):

================  ==============================================================
``sw_direct``     SW of every value (baseline)
``sampling``      SW of segment means, no feedback (naive sampling baseline)
``ba_sw``         Budget Absorption with SW (Kellaris et al. with SW, baseline)
``ipp``           deviation feedback, memory 1
``app``           deviation feedback, memory ``H``
``capp``          APP with CAPP's clip/shrink frame ``T(e_s, e_d)``
``pp_s``          IPP/APP/CAPP on segment means, ``n_s`` by Eq. 12/13
================  ==============================================================

Privacy (stated where the mechanisms are defined)
--------------------------------------------------
Notion: w-event LDP. Neighbours: two streams of one user that differ only in slots
inside some window of ``w`` consecutive slots (time domain public). Every release
costs ``epsilon`` under that notion. Values outside ``[lower, upper]`` are clipped to
them (part of the mechanism, not an error); ``[lower, upper]`` must be public.

``accounting="strict"`` (default) sets the per-report budget so that the claim holds:
a window of ``w`` slots changes the inputs of the ``w`` reports inside it AND, through
the deviation fed back into later inputs, of the next ``memory`` reports; adaptive
composition then needs ``epsilon_report = epsilon / (w + memory)`` (§6.8). Sampling
methods count affected segment reports: ``ceil((w-1)/L) + 1`` for segments of at least
``L`` slots. ``accounting="paper"`` reproduces the published experiments with
``epsilon / w`` (sampling: ``epsilon / ceil(w / L)``, Theorem 6); that is not
``epsilon``-w-event LDP (tests/test_du.py shows the likelihood ratio exceeding
``e^epsilon``), so it is refused unless the seeded test noise source is in force;
such releases are marked non-private and a persistent ledger refuses them.

Device and server
-----------------
:class:`DeviceEncoder` is what a user's device runs: it reads true values and emits
reports. The collector's side is post-processing of reports: :func:`published_stream`
(replication and SMA), :func:`subsequence_means`, :func:`crowd_distribution`, and the
metrics :func:`subsequence_mean_mse`, :func:`cosine_similarity`,
:func:`cosine_distance`, :func:`wasserstein_1`. A :class:`dpsql.Release` from these
methods carries ``.values`` (the published per-slot stream as the paper publishes it:
SMA-smoothed for IPP/APP/CAPP, raw for the baselines and PP-S), ``.reports`` (raw
reports in data units, one per report sent) and ``.params`` (with ``epsilon_report``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from dpsql import _validate
from dpsql.accounting import Neighbour, Notion, largest_share
from dpsql.errors import InvalidData, InvalidParameter
from dpsql.ldp._feedback import (
    BOUNDS_MODES,
    UNIT,
    FeedbackEncoder,
    Ranges,
    capp_ranges,
    report_slots,
    segment_lengths,
)
from dpsql.ldp._linear import ALIGNS, ReportNoise, moving_average
from dpsql.mechanisms.ldp import SQUARE_WAVE, report_uniforms
from dpsql.noise import Draws, DrawsBatch, Keystream, Lane
from dpsql.release import StreamMachine

NOTION = Notion.W_EVENT_LDP
W_EVENT_USER = Neighbour.LDP_W_EVENT
ACCOUNTINGS = ("strict", "paper")
BASES = ("ipp", "app", "capp")


# -- choices of the papers, as functions --------------------------------------------------------

def sample_variance_objective(n: int, epsilon: float) -> float:
    """``n * Var_s2(n, epsilon / n)`` of DU Eq. 12/13 with the sigma^4 correction:
    ``mu4 - sigma^4 (n - 3) / (n - 1)``, SW moments at the worst case ``x = 1``.

    Examples
    --------
    >>> round(sample_variance_objective(2, 1.0), 5)
    0.17252
    """
    eps = epsilon / n
    sigma2 = float(SQUARE_WAVE.variance(1.0, eps))
    return float(SQUARE_WAVE.central_moment4(1.0, eps)) - sigma2**2 * (n - 3) / (n - 1)


def choose_ns(epsilon: float, w: int, qlen: int) -> int:
    """Number of samples per query of length ``qlen``: ``argmin_{2 <= n <= min(w, qlen)}``
    of :func:`sample_variance_objective` (DU Eq. 12), 1 when ``min(w, qlen) < 2``.

    With the corrected Eq. 13 the objective decreases in ``n`` while the per-sample budget
    is small (SW tends to a uniform law on [-1/2, 3/2], whose ``mu4 - sigma^4 = 0.0889``
    is the infimum), so the rule often samples every slot up to ``min(w, qlen)``; larger
    budgets give an interior minimum (21 at ``epsilon = 2``, ``w = qlen = 30``). Pass
    ``n_s`` explicitly to sample less.

    Examples
    --------
    >>> choose_ns(1.0, 20, 10)
    10
    """
    top = min(w, qlen)
    if top < 2:
        return 1
    candidates = range(2, top + 1)
    return min(candidates, key=lambda n: sample_variance_objective(n, epsilon))


def per_report_epsilon(epsilon: float, *, w: int, memory: int | None, accounting: str,
                       segment: int = 1) -> float:
    """Budget of one report for ``epsilon`` per window of ``w`` slots.

    ``strict``: ``epsilon / (affected + memory)`` with ``affected = ceil((w-1)/segment) + 1``
    reports touched by a window (``w`` for one report per slot); unbounded memory has no
    finite strict budget. ``paper``: ``epsilon / ceil(w / segment)``.

    Examples
    --------
    >>> per_report_epsilon(1.0, w=10, memory=1, accounting="strict")
    0.0909090909090909
    >>> per_report_epsilon(1.0, w=10, memory=1, accounting="paper")
    0.1
    """
    if accounting == "paper":
        return epsilon / math.ceil(w / segment)
    if memory is None:
        raise InvalidParameter("memory=None (the paper's unbounded deviation memory) has no finite w-event "
                               "budget; use accounting='paper' for reproduction or a finite memory")
    reports = math.ceil((w - 1) / segment) + 1 + memory
    return largest_share(epsilon, epsilon / reports, count=reports)  # never more than epsilon by rounding


def budget_absorption_unit(plan) -> float:
    """BA-SW's unit budget ``epsilon / (2 w)``, rounded down so that the ``2 w`` units a
    window can spend (``w`` dissimilarity draws, at most ``w`` absorbed for publication)
    never add up to more than ``epsilon``."""
    return largest_share(plan.epsilon, plan.epsilon / (2 * plan.w), count=2 * plan.w)


# -- the plan: validated parameters shared by the machine and the device ------------------------

@dataclass(frozen=True)
class Plan:
    """Everything public about one user's encoding, validated."""

    method: str
    epsilon: float
    w: int
    lower: float
    upper: float
    accounting: str
    epsilon_report: float
    memory: int | None
    ranges: Ranges
    pattern: np.ndarray
    sma: int
    align: str
    extra: dict = field(default_factory=dict)

    @property
    def segment(self) -> int:
        return int(self.pattern.min())

    @property
    def params(self) -> dict:
        return {"epsilon": self.epsilon, "w": self.w, "lower": self.lower, "upper": self.upper,
                "accounting": self.accounting, "epsilon_report": self.epsilon_report, "memory": self.memory,
                "sma": self.sma, "align": self.align, **self.extra}

    def to_unit(self, x: np.ndarray) -> np.ndarray:
        return (np.clip(x, self.lower, self.upper) - self.lower) / (self.upper - self.lower)

    def to_data(self, x: np.ndarray) -> np.ndarray:
        return self.lower + (self.upper - self.lower) * x


def _memory(memory, default) -> int | str | None:
    """``None`` -> ``default``; ``"unbounded"`` -> None (the paper's H = infinity); else an int >= 1."""
    if memory is None:
        return default
    if memory == "unbounded":
        return None
    return _validate.integer(memory, "memory", minimum=1)


def _plan(method: str, *, epsilon, w, lower, upper, accounting, sma, align, noise: Draws | None,
          memory: int | str | None = 0, bounds_mode=None, clip_delta=None, qlen=None, n_s=None, base=None) -> Plan:
    epsilon = _validate.epsilon(epsilon)
    w = _validate.integer(w, "w", minimum=1)
    lower, upper = _validate.bounds(lower, upper)
    accounting = _validate.choice(accounting, "accounting", ACCOUNTINGS)
    sma = _validate.integer(sma, "sma", minimum=1)
    align = _validate.choice(align, "align", ALIGNS)
    if align == "center" and sma % 2 == 0:
        raise InvalidParameter(f"sma must be odd (2k+1) with align='center', got {sma}")
    if accounting == "paper" and (noise is None or noise.private):
        raise InvalidParameter("accounting='paper' is not w-event private (ALGORITHMS.md §6.8) and is only "
                               "available with the seeded test noise source (dpsql.testing.seeded), for "
                               "reproducing the paper")
    extra: dict = {}
    pattern = np.ones(1, dtype=np.int64)
    if qlen is not None or n_s is not None or method in ("sampling", "pp_s"):
        qlen = w if qlen is None else _validate.integer(qlen, "qlen", minimum=1)
        n_s = choose_ns(epsilon, w, qlen) if n_s is None else _validate.integer(n_s, "n_s", minimum=1)
        if n_s > qlen:
            raise InvalidParameter(f"n_s must be <= qlen ({qlen}), got n_s={n_s}")
        pattern = segment_lengths(qlen, qlen, n_s)
        extra.update(qlen=qlen, n_s=n_s, segment_length=int(pattern.min()))
    if memory == "n_s":
        memory = n_s
    if base is not None:
        extra["base"] = base
    eps_report = per_report_epsilon(epsilon, w=w, memory=memory, accounting=accounting,
                                    segment=int(pattern.min()))
    ranges = UNIT
    if bounds_mode is not None:
        bounds_mode = _validate.choice(bounds_mode, "bounds_mode", BOUNDS_MODES)
        if bounds_mode == "fixed_delta":
            if clip_delta is None:
                raise InvalidParameter("bounds_mode='fixed_delta' needs clip_delta (l = -clip_delta, "
                                       "u = 1 + clip_delta; the paper recommends |clip_delta| <= 0.25)")
            clip_delta = _validate.real(clip_delta, "clip_delta", minimum=-0.5, strict=True)
        elif clip_delta is not None:
            raise InvalidParameter(f"clip_delta is only used with bounds_mode='fixed_delta', not {bounds_mode!r}")
        ranges = capp_ranges(eps_report, bounds_mode, clip_delta)
        if not ranges.out_hi > ranges.out_lo:
            raise InvalidParameter(f"the CAPP range is empty at epsilon_report={eps_report:g} ({ranges})")
        extra.update(bounds_mode=bounds_mode, clip_delta=clip_delta, clip_range=list(ranges))
    return Plan(method, epsilon, w, lower, upper, accounting, eps_report, memory, ranges, pattern, sma, align,
                extra)


# -- device side ----------------------------------------------------------------------------------

class SegmentEncoder:
    """Device-side encoder for every method but BA-SW, for ``users`` users in lock step.

    Readings are averaged over the segments of :func:`segment_lengths` (one slot each
    for the per-slot methods) and each mean goes through :class:`FeedbackEncoder`.
    Reports are returned in normalised units together with the segment lengths.
    """

    def __init__(self, plan: Plan, noise: DrawsBatch, randomiser=SQUARE_WAVE):
        self.plan = plan
        self._noise = noise
        self._feedback = FeedbackEncoder(len(noise), eps=plan.epsilon_report, memory=plan.memory,
                                         ranges=plan.ranges, randomiser=randomiser)
        self._pending = np.empty((len(noise), 0))
        self._position = 0
        self._reports = 0  # reports sent so far: report t's uniforms are at index t

    def push(self, unit_values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``unit_values`` (users x slots, in [0, 1]) -> (reports users x r, lengths r)."""
        values = np.concatenate([self._pending, unit_values], axis=1)
        pattern = np.roll(self.plan.pattern, -self._position)
        lengths = np.resize(pattern, values.shape[1] // self.plan.segment + 1)
        lengths = lengths[:np.searchsorted(np.cumsum(lengths), values.shape[1], side="right")]
        used = int(lengths.sum())
        self._pending = values[:, used:]
        self._position = (self._position + len(lengths)) % len(self.plan.pattern)
        if not len(lengths):
            return np.empty((values.shape[0], 0)), lengths
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        means = np.add.reduceat(values[:, :used], starts, axis=1) / lengths
        uniforms = report_uniforms(self._noise, self._reports, means.shape[1])
        self._reports += means.shape[1]
        reports = np.empty_like(means)
        for k in range(means.shape[1]):  # inherently sequential: each input depends on past reports
            reports[:, k] = self._feedback.step(means[:, k], uniforms[:, k])
        return reports, lengths


class AbsorptionEncoder:
    """Device side of BA-SW (ALGORITHMS.md §6.9), ``users`` users in lock step.

    Unit budget ``e0 = epsilon / (2w)``. Slot 0 publishes ``SW(x; e0)``. Later slots:
    (M1) ``dis = |SW(|o - x|; e0)|`` against the last publication ``o``; (M2) after a
    publication that used ``m`` units the next ``m - 1`` slots repeat it; otherwise the
    absorbed budget is ``e0 * min(slots since the nullified run, w)`` and the value is
    published with it if ``dis`` exceeds that budget's SW half-width ``b``, else ``o``
    repeats. Privacy: M1 spends at most ``epsilon / 2`` and M2 at most ``epsilon / 2`` per
    window of ``w`` slots; decisions read only the current value and released outputs,
    so no feedback term arises (both accountings agree). M1 is skipped on nullified
    slots, which only spends less.

    ``push`` returns, per slot, the value in force (normalised) and the budget units of
    a fresh publication (0 when the slot repeats the previous one).
    """

    def __init__(self, plan: Plan, noise: DrawsBatch, randomiser=SQUARE_WAVE):
        self.plan = plan
        self._noise = noise
        self._randomiser = randomiser
        users = len(noise)
        self._unit = budget_absorption_unit(plan)
        self._half_width = np.array([np.inf] + [SQUARE_WAVE.constants(self._unit * u).b
                                                for u in range(1, plan.w + 1)])
        self._last = np.zeros(users)
        self._last_slot = np.zeros(users, dtype=np.int64)
        self._last_units = np.zeros(users, dtype=np.int64)
        self._slot = 0

    def push(self, unit_values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        out = np.empty_like(unit_values)
        units_used = np.zeros(unit_values.shape, dtype=np.int64)
        # slot t: the publication's uniforms at index t of LDP_REPORT, the distance's of LDP_CHOICE
        publication_u = report_uniforms(self._noise, self._slot, unit_values.shape[1])
        distance_u = report_uniforms(self._noise, self._slot, unit_values.shape[1], lane=Lane.LDP_CHOICE)
        for k in range(unit_values.shape[1]):  # inherently sequential
            x = unit_values[:, k]
            if self._slot == 0:
                units = np.ones(len(x), dtype=np.int64)
                publish = np.ones(len(x), dtype=bool)
            else:
                absorbed = self._slot - (self._last_slot + self._last_units - 1)
                units = np.clip(absorbed, 0, self.plan.w)
                publish = units > 0
                dis = np.abs(self._randomiser.perturb(np.abs(self._last - x), self._unit, distance_u[:, k]))
                publish &= dis > self._half_width[units]
            for level in np.unique(units[publish]):  # users absorbed the same budget: one draw each
                chosen = publish & (units == level)
                self._last[chosen] = self._randomiser.perturb(x[chosen], self._unit * int(level),
                                                              publication_u[chosen, k])
                self._last_slot[chosen] = self._slot
                self._last_units[chosen] = level
                units_used[chosen, k] = level
            out[:, k] = self._last
            self._slot += 1
        return out, units_used


class DeviceEncoder:
    """What one user's device runs: push readings, get the reports to send.

    Stateful and online; the budget per report is fixed at construction. Reports are in
    data units (``lower + (upper - lower) * x'``): for the segment methods one report
    per completed segment, for BA-SW one per slot (the value in force). Privacy and
    clipping as in the module docstring; the encoder never touches a ledger: the
    device is the data owner. A trailing partial segment is never sent (the collector
    repeats the last report over it), so the device need not know its stream's length.

    Examples
    --------
    >>> import dpsql
    >>> with dpsql.testing.seeded(3):
    ...     device = DeviceEncoder("capp", epsilon=1.0, w=10, lower=0.0, upper=100.0)
    ...     reports = np.concatenate([device.push([50.0, 60.0]), device.push([55.0])])
    >>> reports.shape, round(device.epsilon_report, 4)
    ((3,), 0.05)
    """

    def __init__(self, method: str, *, noise: Draws | None = None, **params):
        from dpsql.methods import machine_for

        source = Keystream.fresh().partition() if noise is None else noise
        self._machine = machine_for(method, None, source, params)
        self.plan: Plan = self._machine.plan
        self.epsilon_report = self.plan.epsilon_report

    def push(self, readings) -> np.ndarray:
        data = _validate.values(readings, "readings")
        reports, _ = self._machine.encoder.push(self.plan.to_unit(data)[None, :])
        return self.plan.to_data(reports[0])


# -- the machines (device + collector, for dpsql.publishing.publish) -------------------------------------

class _DUStream(StreamMachine):
    """A user's device followed by the collector's published stream, online.

    ``feed`` encodes readings, replicates each report over its slots and releases the
    moving average for every slot whose window is complete (a centred SMA holds back
    ``sma // 2`` slots); ``close`` repeats the last report over an unsampled tail.
    """

    notion = NOTION
    neighbour = W_EVENT_USER
    encoder_class = SegmentEncoder

    def _setup(self, n: int | None, noise: Draws, plan: Plan) -> None:
        if n is not None and n < plan.pattern[0]:
            raise InvalidData(f"column 'values' has {n} values, fewer than one sampling segment "
                              f"({int(plan.pattern[0])} slots)")
        self.plan = plan
        self.n = n
        self.w = plan.w
        self.cost = (plan.epsilon, 0.0)
        self.encoder = self.encoder_class(plan, DrawsBatch([noise]))
        self._raw = np.empty(n or 0)
        self._filled = 0
        self._emitted = 0
        self._reports: list[np.ndarray] = []
        self._marks: list[np.ndarray] = []

    def feed(self, chunk: np.ndarray) -> np.ndarray:
        reports, marks = self.encoder.push(self.plan.to_unit(chunk)[None, :])
        reports = self.plan.to_data(reports[0])
        self._record(reports, marks)
        ahead = 0 if self.plan.align == "trailing" else self.plan.sma // 2
        return self._emit(max(self._filled - ahead, self._emitted))

    def _record(self, reports: np.ndarray, lengths: np.ndarray) -> None:
        slots = np.repeat(reports, lengths)
        self._raw[self._filled:self._filled + len(slots)] = slots
        self._filled += len(slots)
        self._reports.append(reports)
        self._marks.append(lengths)

    def close(self) -> np.ndarray:
        self._raw[self._filled:] = self._raw[self._filled - 1]
        self._filled = self.n
        return self._emit(self.n)

    def _emit(self, stop: int) -> np.ndarray:
        out = moving_average(self._raw[:self._filled], self.plan.sma, self.plan.align, self._emitted, stop)
        self._emitted = stop
        return out

    def describe(self) -> dict:
        plan = self.plan
        reports = np.concatenate(self._reports)
        lengths = np.concatenate(self._marks)
        out_width = plan.ranges.out_hi - plan.ranges.out_lo
        error = ReportNoise(report_index=report_slots(self.n, lengths),
                            report_variance=((plan.upper - plan.lower) * out_width) ** 2
                            * SQUARE_WAVE.worst_variance(plan.epsilon_report),
                            gain=plan.ranges.gain(plan.epsilon_report) if plan.memory != 0 else 0.0,
                            memory=plan.memory, window=plan.sma, align=plan.align)
        return dict(method=plan.method, params=plan.params, error=error, reports=reports,
                    components={"reports": self.cost})


class SWDirectStream(_DUStream):
    """``sw_direct``: SW of every value at ``epsilon / w``, raw reports published."""

    def __init__(self, n, *, epsilon, w, lower, upper, accounting="strict", sma=1, align="trailing", noise):
        self._setup(n, noise, _plan("sw_direct", epsilon=epsilon, w=w, lower=lower, upper=upper,
                                    accounting=accounting, sma=sma, align=align, noise=noise))


class SamplingStream(_DUStream):
    """``sampling``: SW of segment means, no feedback, each report replicated."""

    def __init__(self, n, *, epsilon, w, lower, upper, qlen=None, n_s=None, accounting="strict", sma=1,
                 align="trailing", noise):
        self._setup(n, noise, _plan("sampling", epsilon=epsilon, w=w, lower=lower, upper=upper,
                                    accounting=accounting, sma=sma, align=align, noise=noise, qlen=qlen, n_s=n_s))


class IPPStream(_DUStream):
    """``ipp``: deviation feedback with memory 1 (DU §III)."""

    def __init__(self, n, *, epsilon, w, lower, upper, accounting="strict", sma=3, align="trailing", noise):
        self._setup(n, noise, _plan("ipp", epsilon=epsilon, w=w, lower=lower, upper=upper, accounting=accounting,
                                    sma=sma, align=align, noise=noise, memory=1))


class APPStream(_DUStream):
    """``app``: deviation feedback with memory ``H`` (default ``w``; ``"unbounded"`` = the
    paper's H = infinity, paper accounting only), DU Alg. 1."""

    def __init__(self, n, *, epsilon, w, lower, upper, memory=None, accounting="strict", sma=3, align="trailing",
                 noise):
        memory = _memory(memory, w)
        self._setup(n, noise, _plan("app", epsilon=epsilon, w=w, lower=lower, upper=upper, accounting=accounting,
                                    sma=sma, align=align, noise=noise, memory=memory))


class CAPPStream(_DUStream):
    """``capp``: APP in CAPP's frame ``T(e_s, e_d)`` (DU Alg. 2, ``bounds_mode`` §6.5)."""

    def __init__(self, n, *, epsilon, w, lower, upper, memory=None, bounds_mode="reference_code", clip_delta=None,
                 accounting="strict", sma=3, align="trailing", noise):
        memory = _memory(memory, w)
        self._setup(n, noise, _plan("capp", epsilon=epsilon, w=w, lower=lower, upper=upper, accounting=accounting,
                                    sma=sma, align=align, noise=noise, memory=memory, bounds_mode=bounds_mode,
                                    clip_delta=clip_delta))


class PPSStream(_DUStream):
    """``pp_s``: IPP/APP/CAPP (``base``) on segment means (DU Alg. 3). ``memory`` counts
    segment reports (default: ``n_s``, one query period; IPP: 1)."""

    def __init__(self, n, *, epsilon, w, lower, upper, base="capp", qlen=None, n_s=None, memory=None,
                 bounds_mode="reference_code", clip_delta=None, accounting="strict", sma=1, align="trailing",
                 noise):
        base = _validate.choice(base, "base", BASES)
        memory = 1 if base == "ipp" else _memory(memory, "n_s")
        self._setup(n, noise, _plan("pp_s", epsilon=epsilon, w=w, lower=lower, upper=upper, accounting=accounting,
                                    sma=sma, align=align, noise=noise, memory=memory, qlen=qlen, n_s=n_s,
                                    base=base, bounds_mode=bounds_mode if base == "capp" else None,
                                    clip_delta=clip_delta if base == "capp" else None))


class BASWStream(_DUStream):
    """``ba_sw``: Budget Absorption with SW; the published stream repeats the last
    publication between publications."""

    encoder_class = AbsorptionEncoder

    def __init__(self, n, *, epsilon, w, lower, upper, accounting="strict", sma=1, align="trailing", noise):
        self._setup(n, noise, _plan("ba_sw", epsilon=epsilon, w=w, lower=lower, upper=upper, accounting=accounting,
                                    sma=sma, align=align, noise=noise))

    def _record(self, values: np.ndarray, units: np.ndarray) -> None:
        super()._record(values, np.ones(len(values), dtype=np.int64))
        self._marks[-1] = units[0]

    def describe(self) -> dict:
        plan = self.plan
        values = np.concatenate(self._reports)
        units = np.concatenate(self._marks)
        published = units > 0
        unit = budget_absorption_unit(plan)
        variance = np.array([SQUARE_WAVE.worst_variance(unit * u) for u in units[published]])
        error = ReportNoise(report_index=np.cumsum(published) - 1,
                            report_variance=(plan.upper - plan.lower) ** 2 * variance,
                            window=plan.sma, align=plan.align)
        params = {**plan.params, "epsilon_report": None, "epsilon_unit": unit, "publications": int(published.sum())}
        return dict(method=plan.method, params=params, error=error, reports=values,
                    components={"dissimilarity": (plan.epsilon / 2, 0.0), "publication": (plan.epsilon / 2, 0.0)})


MACHINES = {"sw_direct": SWDirectStream, "sampling": SamplingStream, "ba_sw": BASWStream, "ipp": IPPStream,
            "app": APPStream, "capp": CAPPStream, "pp_s": PPSStream}


# -- public API: one user's stream -----------------------------------------------------------------

def _publish(method: str, values, budget, note, params):
    from dpsql.publishing import publish

    return publish(method, values, budget=budget, note=note, **params)


def sw_direct(values, *, epsilon: float, w: int, lower: float, upper: float, budget=None, note=None, **params):
    """Square Wave on every value at ``epsilon / w``; the raw reports are the published stream.

    Cost: ``epsilon`` under w-event LDP (notion ``"w-event-ldp"``, neighbours: one user's
    values in any ``w`` consecutive slots), in both accountings (no feedback). Values are
    clipped to the public ``[lower, upper]``. Parameters: ``accounting``, ``sma`` (default 1:
    raw), ``align``.

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> budget = dpsql.Budget.in_memory(epsilon=1.0, notion="w-event-ldp", w=10)
    >>> with dpsql.testing.seeded(0):
    ...     rel = dpsql.ldp.sw_direct(np.full(200, 30.0), epsilon=1.0, w=10, lower=0.0, upper=100.0, budget=budget)
    >>> budget.spent, rel.params["epsilon_report"], len(rel.reports)
    ((1.0, 0.0), 0.1, 200)
    """
    return _publish("sw_direct", values, budget, note,
                    dict(epsilon=epsilon, w=w, lower=lower, upper=upper, **params))


def sampling(values, *, epsilon: float, w: int, lower: float, upper: float, budget=None, note=None, **params):
    """Naive sampling: SW of each segment's mean (segments of ``qlen // n_s`` slots), no feedback.

    Cost: ``epsilon`` under w-event LDP; per report ``epsilon / (ceil((w-1)/L) + 1)`` (strict,
    ``L`` the segment length) or ``epsilon / ceil(w / L)`` (paper). Values are clipped to
    ``[lower, upper]``. Parameters: ``qlen`` (default ``w``), ``n_s`` (default Eq. 12),
    ``accounting``, ``sma``, ``align``.

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> with dpsql.testing.seeded(0):
    ...     rel = dpsql.ldp.sampling(np.full(100, 0.5), epsilon=1.0, w=10, lower=0.0, upper=1.0, n_s=5)
    >>> rel.params["segment_length"], len(rel.reports), rel.params["epsilon_report"]
    (2, 50, 0.16666666666666666)
    """
    return _publish("sampling", values, budget, note,
                    dict(epsilon=epsilon, w=w, lower=lower, upper=upper, **params))


def ba_sw(values, *, epsilon: float, w: int, lower: float, upper: float, budget=None, note=None, **params):
    """Budget Absorption with Square Wave (Kellaris et al.'s BA, SW instead of Laplace).

    Cost: ``epsilon`` under w-event LDP: ``epsilon / 2`` per window for the dissimilarity
    reports and at most ``epsilon / 2`` for publications (unit ``epsilon / (2w)``), in both
    accountings. Values are clipped to ``[lower, upper]``. ``.reports`` holds the value in
    force at every slot. Parameters: ``accounting``, ``sma``, ``align``.

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> with dpsql.testing.seeded(0):
    ...     rel = dpsql.ldp.ba_sw(np.full(300, 0.5), epsilon=1.0, w=5, lower=0.0, upper=1.0)
    >>> rel.components, rel.params["epsilon_unit"]
    ({'dissimilarity': (0.5, 0.0), 'publication': (0.5, 0.0)}, 0.1)
    """
    return _publish("ba_sw", values, budget, note, dict(epsilon=epsilon, w=w, lower=lower, upper=upper, **params))


def ipp(values, *, epsilon: float, w: int, lower: float, upper: float, budget=None, note=None, **params):
    """Iterative Perturbation Parameterization: the last deviation ``x_{t-1} - x'_{t-1}`` is
    added to the next input (memory 1), published with SMA (default window 3, trailing).

    Cost: ``epsilon`` under w-event LDP with ``epsilon_report = epsilon / (w + 1)``
    (strict) or ``epsilon / w`` (paper, seeded test noise only). Values are clipped to
    ``[lower, upper]``. Parameters: ``accounting``, ``sma``, ``align``.

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> with dpsql.testing.seeded(0):
    ...     rel = dpsql.ldp.ipp(np.linspace(0, 1, 50), epsilon=2.0, w=3, lower=0.0, upper=1.0)
    >>> rel.params["epsilon_report"], str(rel.notion)
    (0.5, 'w-event-ldp')
    """
    return _publish("ipp", values, budget, note, dict(epsilon=epsilon, w=w, lower=lower, upper=upper, **params))


def app(values, *, epsilon: float, w: int, lower: float, upper: float, budget=None, note=None, **params):
    """Accumulated Perturbation Parameterization (DU Alg. 1): the sum of the last ``memory``
    deviations is added to each input; published with SMA (window 3, trailing).

    Cost: ``epsilon`` under w-event LDP with ``epsilon_report = epsilon / (w + memory)``
    (strict; ``memory`` defaults to ``w``) or ``epsilon / w`` (paper, seeded test noise
    only; ``memory="unbounded"`` is the paper's H = infinity). Values are clipped to
    ``[lower, upper]``. Parameters: ``memory``, ``accounting``, ``sma``, ``align``.

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> with dpsql.testing.seeded(0):
    ...     rel = dpsql.ldp.app(np.full(40, 0.2), epsilon=1.0, w=4, lower=0.0, upper=1.0, memory=6)
    >>> rel.params["epsilon_report"], rel.params["memory"]
    (0.1, 6)
    """
    return _publish("app", values, budget, note, dict(epsilon=epsilon, w=w, lower=lower, upper=upper, **params))


def capp(values, *, epsilon: float, w: int, lower: float, upper: float, budget=None, note=None, **params):
    """Clipped APP (DU Alg. 2): APP whose SW frame is set by ``T = e_s - e_d`` (Eq. 11).

    ``bounds_mode``: ``"reference_code"`` (default; the authors' code: reports shrunk onto
    ``[T, 1 - T]``), ``"paper"`` (input clipped to ``[-T, 1 + T]``) or ``"fixed_delta"``
    (``[-clip_delta, 1 + clip_delta]``). Cost: ``epsilon`` under w-event LDP with
    ``epsilon_report = epsilon / (w + memory)`` (strict) or ``epsilon / w`` (paper, seeded
    test noise only). Values are clipped to ``[lower, upper]``. Parameters: ``memory``,
    ``bounds_mode``, ``clip_delta``, ``accounting``, ``sma``, ``align``.

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> with dpsql.testing.seeded(0):
    ...     rel = dpsql.ldp.capp(np.full(40, 0.2), epsilon=1.0, w=10, lower=0.0, upper=1.0)
    >>> [round(v, 4) for v in rel.params["clip_range"]]
    [0.0, 1.0, 0.0607, 0.9393]
    """
    return _publish("capp", values, budget, note, dict(epsilon=epsilon, w=w, lower=lower, upper=upper, **params))


def pp_s(values, *, epsilon: float, w: int, lower: float, upper: float, budget=None, note=None, **params):
    """Perturbation Parameterization with Sampling (DU Alg. 3): IPP/APP/CAPP (``base``,
    default CAPP) over segment means, each report replicated over its segment.

    ``n_s`` samples per query of ``qlen`` slots (default ``w``) by Eq. 12 with the
    sigma^4-corrected Eq. 13 (:func:`choose_ns`, evaluated at ``epsilon / n`` per sample as
    the paper does, in both accountings; the budget actually used per report is
    ``epsilon_report``). Cost: ``epsilon`` under w-event LDP with
    ``epsilon_report = epsilon / (ceil((w-1)/L) + 1 + memory)`` (strict; ``L`` the
    segment length, ``memory`` in reports, default ``n_s``) or ``epsilon / ceil(w/L)``
    (paper, seeded test noise only). Values are clipped to ``[lower, upper]``.
    Parameters: ``base``, ``qlen``, ``n_s``, ``memory``, ``bounds_mode``, ``clip_delta``,
    ``accounting``, ``sma``, ``align``.

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> with dpsql.testing.seeded(0):
    ...     rel = dpsql.ldp.pp_s(np.full(60, 0.4), epsilon=1.0, w=6, lower=0.0, upper=1.0, n_s=3)
    >>> rel.params["segment_length"], rel.params["memory"], rel.params["epsilon_report"]  # 1 / (ceil(5/2) + 1 + 3)
    (2, 3, 0.14285714285714285)
    """
    return _publish("pp_s", values, budget, note, dict(epsilon=epsilon, w=w, lower=lower, upper=upper, **params))


# -- collector side: post-processing of reports ----------------------------------------------------

def report_lengths(release) -> np.ndarray:
    """How many slots each of ``release.reports`` covers (segments for sampling methods)."""
    params = release.params
    if "n_s" in params:
        return segment_lengths(len(release.values), params["qlen"], params["n_s"])
    return np.ones(len(release.reports), dtype=np.int64)


def published_stream(reports, lengths, n: int, *, sma: int = 1, align: str = "trailing") -> np.ndarray:
    """The collector's per-slot stream from reports (post-processing, free): each report
    repeated over its ``lengths`` slots, an unsampled tail repeating the last report, then
    a simple moving average of window ``sma`` (``align`` ``"trailing"`` or ``"center"``).

    Examples
    --------
    >>> published_stream(np.array([1.0, 4.0]), np.array([2, 2]), 5, sma=3)
    array([1., 1., 2., 3., 4.])
    """
    reports = np.asarray(reports, dtype=np.float64)
    raw = reports[report_slots(n, np.asarray(lengths, dtype=np.int64))]
    return moving_average(raw, _validate.integer(sma, "sma", minimum=1), _validate.choice(align, "align", ALIGNS))


def slot_values(release) -> np.ndarray:
    """The unsmoothed per-slot stream of a release (what the reference code scores for means)."""
    return published_stream(release.reports, report_lengths(release), len(release.values))


def debiased_slot_values(release) -> np.ndarray:
    """Per-slot unbiased estimates of the true values from a release WITHOUT feedback
    (``sw_direct``, ``sampling``): each raw SW report mapped back by the inverse of its
    mean, ``(y - q(1 + 2b)/2) / (2b(p - q))`` (P8), in data units. Post-processing, free.
    Raw SW reports are pulled towards the middle of ``[lower, upper]``; this removes that
    pull at the price of a variance larger by ``1 / (2b(p - q))^2``. For the feedback
    methods no per-report inverse exists (their inputs depend on past reports).

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> with dpsql.testing.seeded(0):
    ...     rel = dpsql.ldp.sw_direct(np.full(20000, 10.0), epsilon=2.0, w=1, lower=0.0, upper=100.0)
    >>> 26 <= round(float(slot_values(rel).mean())) <= 29, round(float(debiased_slot_values(rel).mean()))
    (True, 10)
    """
    if release.method not in ("sw_direct", "sampling"):
        raise InvalidParameter(f"debiasing needs independent SW reports (sw_direct, sampling), not {release.method!r}")
    params = release.params
    return debias(slot_values(release), lower=params["lower"], upper=params["upper"],
                  epsilon_report=params["epsilon_report"])


def debias(reports, *, lower: float, upper: float, epsilon_report: float) -> np.ndarray:
    """Raw SW reports in data units -> unbiased estimates of their inputs (see
    :func:`debiased_slot_values`)."""
    unit = (np.asarray(reports, dtype=np.float64) - lower) / (upper - lower)
    return lower + (upper - lower) * SQUARE_WAVE.debias(unit, epsilon_report)


def report_view(release) -> tuple[np.ndarray, np.ndarray]:
    """Per slot of a release (or of every partition of a partitioned one, concatenated):
    the raw report covering it and that report's 0-based index in its user's stream.
    This is the row form of a report table that the table front ends return."""
    parts = getattr(release, "parts", (release,))
    reports, index = [], []
    for part in parts:
        slots = report_slots(len(part.values), report_lengths(part))
        reports.append(np.asarray(part.reports)[slots])
        index.append(slots)
    return np.concatenate(reports), np.concatenate(index)


def subsequence_means(stream, starts, stops) -> np.ndarray:
    """Means of ``stream[..., start:stop]`` per subsequence (last axis time; a 2-D array is
    users x slots and gives users x subsequences).

    Examples
    --------
    >>> subsequence_means(np.array([[1.0, 2.0, 3.0], [0.0, 0.0, 6.0]]), [0, 1], [2, 3])
    array([[1.5, 2.5],
           [0. , 3. ]])
    """
    stream = np.asarray(stream, dtype=np.float64)
    starts = np.asarray(starts, dtype=np.int64)
    stops = np.asarray(stops, dtype=np.int64)
    if np.any(stops <= starts) or np.any(starts < 0) or np.any(stops > stream.shape[-1]):
        raise InvalidParameter("subsequences must satisfy 0 <= start < stop <= number of slots")
    cumulative = np.concatenate([np.zeros((*stream.shape[:-1], 1)), np.cumsum(stream, axis=-1)], axis=-1)
    return (cumulative[..., stops] - cumulative[..., starts]) / (stops - starts)


def crowd_distribution(means) -> tuple[np.ndarray, np.ndarray]:
    """Empirical distribution of per-user means: ``(sorted support, CDF at each point)``.

    Examples
    --------
    >>> crowd_distribution([0.3, 0.1, 0.3])
    (array([0.1, 0.3]), array([0.33333333, 1.        ]))
    """
    support, counts = np.unique(np.asarray(means, dtype=np.float64), return_counts=True)
    return support, np.cumsum(counts) / counts.sum()


def subsequence_mean_mse(estimate, truth, starts, stops) -> float:
    """DU's mean MSE: ``(mean(estimate[i:j]) - mean(truth[i:j]))^2`` averaged over subsequences
    (and users for 2-D input)."""
    return float(np.mean((subsequence_means(estimate, starts, stops) - subsequence_means(truth, starts, stops)) ** 2))


def cosine_similarity(estimate, truth) -> np.ndarray:
    """``<u, v> / (|u| |v|)`` along the last axis (what the reference code saves as
    "distribution_result": higher is better)."""
    u = np.asarray(estimate, dtype=np.float64)
    v = np.asarray(truth, dtype=np.float64)
    return (u * v).sum(axis=-1) / (np.linalg.norm(u, axis=-1) * np.linalg.norm(v, axis=-1))


def cosine_distance(estimate, truth) -> np.ndarray:
    """``1 - cosine_similarity`` (the paper's metric: lower is better).

    Examples
    --------
    >>> float(cosine_distance([1.0, 0.0], [1.0, 1.0])).__round__(4)
    0.2929
    """
    return 1.0 - cosine_similarity(estimate, truth)


def wasserstein_1(a, b) -> float:
    """W1 between the empirical distributions of samples ``a`` and ``b``: the integral of
    ``|F - G|`` over the sorted union of support points, weighted by the gaps (the true
    1-D W1; DU leaves the grid unspecified).

    Examples
    --------
    >>> wasserstein_1([0.0, 1.0], [0.5, 1.5])
    0.5
    """
    a = np.sort(np.asarray(a, dtype=np.float64))
    b = np.sort(np.asarray(b, dtype=np.float64))
    grid = np.union1d(a, b)
    f = np.searchsorted(a, grid[:-1], side="right") / len(a)
    g = np.searchsorted(b, grid[:-1], side="right") / len(b)
    return float(np.sum(np.abs(f - g) * np.diff(grid)))
