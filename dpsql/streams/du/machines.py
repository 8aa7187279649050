"""Du et al.'s methods as online machines: each user's device (:mod:`dpsql.streams.du.encoders`)
followed by the collector's published stream, for :func:`dpsql.publishing.publish`.

================  ==============================================================
``sw_direct``     SW of every value (baseline)
``sampling``      SW of segment means, no feedback (naive sampling baseline)
``ba_sw``         Budget Absorption with SW (Kellaris et al. with SW, baseline)
``ipp``           deviation feedback, memory 1
``app``           deviation feedback, memory ``H``
``capp``          APP with CAPP's clip/shrink frame ``T(e_s, e_d)``
``pp_s``          IPP/APP/CAPP on segment means, ``n_s`` by Eq. 12/13
================  ==============================================================

Privacy: notion ``"w-event-ldp"``, every release costs ``epsilon`` (see
:mod:`dpsql.streams.du.plan` for the per-report budgets of each accounting). Values outside
the public ``[lower, upper]`` are clipped to them (part of the mechanism).

Every machine is batchable: :meth:`DUStream.batched` runs many equal-length users
together (one partition each, their own draws), fed ``(users, rows)`` chunks; each user's
release is exactly the one its own machine gives.
"""

from __future__ import annotations

import copy

import numpy as np

from dpsql import _progress, _validate
from dpsql.errors import InvalidData
from dpsql.mechanisms.ldp.feedback import PLAIN_LOOP_USERS
from dpsql.mechanisms.ldp.linear import ReportNoise, moving_average, reach
from dpsql.mechanisms.ldp.randomisers import SQUARE_WAVE
from dpsql.noise import Draws, DrawsBatch
from dpsql.release import StreamMachine
from dpsql.streams.du.encoders import AbsorptionEncoder, SegmentEncoder
from dpsql.streams.du.plan import (
    BASES,
    NOTION,
    W_EVENT_USER,
    Plan,
    budget_absorption_unit,
    make_plan,
    memory_of,
    report_slots,
)

#: Rough seconds per slot (2-core reference machine) of the device loops of a user run alone
#: (feedback or budget absorption, plain floats), of a user stepped together with many, and of
#: reports without feedback: what :mod:`dpsql._progress` uses to decide, before the work
#: starts, whether a release deserves a progress bar.
_SECONDS_PER_SLOT = {"alone": 1e-6, "together": 1e-7, "independent": 4e-7}


class DUStream(StreamMachine):
    """Users' devices followed by the collector's published stream, online.

    ``feed`` encodes readings, replicates each report over its slots and releases the
    moving average for every slot whose window is complete (a centred average holds back
    ``window // 2`` slots; the slots of a sampling segment wait for its report); ``close``
    repeats the last report over an unsampled tail and releases what was held back.
    """

    notion = NOTION
    neighbour = W_EVENT_USER
    encoder_class = SegmentEncoder
    batchable = True

    def _setup(self, n: int | None, noise: Draws, plan: Plan) -> None:
        if n is not None and n < plan.pattern[0]:
            raise InvalidData(f"column 'values' has {n} values, fewer than one sampling segment "
                              f"({int(plan.pattern[0])} slots)")
        self.plan = plan
        self.n = n
        self.w = plan.w
        self.cost = (plan.epsilon, 0.0)
        self._start(DrawsBatch([noise]))

    def batched(self, draws: DrawsBatch) -> DUStream:
        machine = copy.copy(self)
        machine._start(draws)
        return machine

    def _start(self, draws: DrawsBatch) -> None:
        """State for the users of ``draws``, nothing fed yet."""
        self.encoder = self.encoder_class(self.plan, draws)
        self._users = len(draws)
        self._back, self._ahead = reach(self.plan.window, self.plan.align)
        self._raw = np.empty((self._users, 0))  # replicated reports of slots [self._raw_first, self._filled)
        self._raw_first = 0
        self._filled = 0  # slots covered by a report
        self._emitted = 0
        self._rows = 0
        self._reports: list[np.ndarray] = []
        self._marks: list[np.ndarray] = []
        self._lead: tuple = ()
        self._bar = None
        self._described: dict = {}

    def _work(self) -> _progress.Bar:
        """The progress bar of a one-shot release's device loops (shown when they are expected to be long)."""
        if self._bar is None:
            sequential = self.plan.memory != 0 or self.encoder_class is AbsorptionEncoder
            pace = ("independent" if not sequential else "alone" if self._users <= PLAIN_LOOP_USERS else "together")
            slots = (self.n or 0) * self._users
            self._bar = _progress.bar(slots, seconds=slots * _SECONDS_PER_SLOT[pace], desc=self.plan.method,
                                      unit="slot")
        return self._bar

    def feed(self, chunk: np.ndarray) -> np.ndarray:
        self._lead = chunk.shape[:-1]
        rows = chunk.reshape(self._users, -1)
        self._rows += rows.shape[1]
        bar = self._work()
        pieces = []
        columns = max(1, bar.step // self._users)
        for start in range(0, rows.shape[1], columns):  # pieces between updates of the bar
            piece = rows[:, start:start + columns]
            reports, marks = self.encoder.push(self.plan.to_unit(piece))
            self._record(self.plan.to_data(reports), marks)
            pieces.append(self._emit(max(self._filled - self._ahead, self._emitted)))
            bar.update(piece.size)
        out = np.concatenate(pieces, axis=1) if len(pieces) != 1 else pieces[0]
        return out.reshape((*self._lead, -1))

    def _record(self, reports: np.ndarray, lengths: np.ndarray) -> None:
        """Keep ``reports`` (users x r, data units) and their marks; append the slots they cover."""
        self._reports.append(reports)
        self._marks.append(lengths)
        if reports.shape[1]:
            self._last_report = reports[:, -1:]
        slots = reports if (lengths == 1).all() else np.repeat(reports, lengths, axis=1)
        self._raw = np.concatenate([self._raw, slots], axis=1)
        self._filled += slots.shape[1]

    def _emit(self, stop: int, length: int | None = None) -> np.ndarray:
        """Release slots ``self._emitted .. stop - 1`` (``length``: the stream has ended there)."""
        out = moving_average(self._raw, self.plan.window, self.plan.align, self._emitted, stop,
                             first=self._raw_first, length=length)
        self._emitted = stop
        keep = max(stop - self._back, 0)  # the next windows reach back this far
        self._raw = self._raw[:, keep - self._raw_first:]
        self._raw_first = keep
        return out

    def close(self) -> np.ndarray:
        if self._filled < self._rows:  # an unsampled tail repeats the last report
            tail = np.repeat(self._last_report, self._rows - self._filled, axis=1)
            self._raw = np.concatenate([self._raw, tail], axis=1)
            self._filled = self._rows
        out = self._emit(self._rows, length=self._rows)
        # The machine may be kept to describe its users (StreamMachine.batchable): the encoder
        # holds readings of an incomplete segment and sums of deviations, both secret.
        self.encoder = None
        if self._bar is not None:
            self._bar.close()
        return out.reshape((*self._lead, -1))

    def _history(self) -> tuple[np.ndarray, np.ndarray]:
        """All reports (users x r) and marks sent so far, concatenated once."""
        if len(self._reports) != 1:
            self._reports = [np.concatenate(self._reports, axis=1) if self._reports else np.empty((self._users, 0))]
            self._marks = [np.concatenate(self._marks, axis=-1) if self._marks else np.empty(0, dtype=np.int64)]
        return self._reports[0], self._marks[0]

    def describe(self) -> dict:
        return self.describe_partition(0)

    def describe_partition(self, partition: int) -> dict:
        reports, lengths = self._history()
        if "error" not in self._described:  # one model for all users: their reports and budgets agree
            plan = self.plan
            out_width = plan.ranges.out_hi - plan.ranges.out_lo
            self._described["error"] = ReportNoise(
                report_index=report_slots(self._rows, lengths),
                report_variance=((plan.upper - plan.lower) * out_width) ** 2
                * SQUARE_WAVE.worst_variance(plan.epsilon_report),
                gain=plan.ranges.gain(plan.epsilon_report) if plan.memory != 0 else 0.0,
                memory=plan.memory, window=plan.window, align=plan.align)
        return dict(method=self.plan.method, params=self.plan.params, error=self._described["error"],
                    reports=reports[partition], components={"reports": self.cost})


class SWDirectStream(DUStream):
    """``sw_direct``: SW of every value at ``epsilon / w``, raw reports published."""

    def __init__(self, n, *, epsilon, w, lower, upper, accounting="strict", window=1, align="trailing", noise):
        self._setup(n, noise, make_plan("sw_direct", epsilon=epsilon, w=w, lower=lower, upper=upper,
                                        accounting=accounting, window=window, align=align, private=noise.private))


class SamplingStream(DUStream):
    """``sampling``: SW of segment means, no feedback, each report replicated."""

    def __init__(self, n, *, epsilon, w, lower, upper, qlen=None, n_s=None, accounting="strict", window=1,
                 align="trailing", noise):
        self._setup(n, noise, make_plan("sampling", epsilon=epsilon, w=w, lower=lower, upper=upper,
                                        accounting=accounting, window=window, align=align, private=noise.private,
                                        qlen=qlen, n_s=n_s))


class IPPStream(DUStream):
    """``ipp``: deviation feedback with memory 1 (DU §III)."""

    def __init__(self, n, *, epsilon, w, lower, upper, accounting="strict", window=3, align="trailing", noise):
        self._setup(n, noise, make_plan("ipp", epsilon=epsilon, w=w, lower=lower, upper=upper, accounting=accounting,
                                        window=window, align=align, private=noise.private, memory=1))


class APPStream(DUStream):
    """``app``: deviation feedback with memory ``H`` (default ``w``; ``"unbounded"`` = the
    paper's H = infinity, paper accounting only), DU Alg. 1."""

    def __init__(self, n, *, epsilon, w, lower, upper, memory=None, accounting="strict", window=3, align="trailing",
                 noise):
        self._setup(n, noise, make_plan("app", epsilon=epsilon, w=w, lower=lower, upper=upper, accounting=accounting,
                                        window=window, align=align, private=noise.private,
                                        memory=memory_of(memory, w)))


class CAPPStream(DUStream):
    """``capp``: APP in CAPP's frame ``T(e_s, e_d)`` (DU Alg. 2, ``bounds_mode`` §6.5)."""

    def __init__(self, n, *, epsilon, w, lower, upper, memory=None, bounds_mode="reference_code", clip_delta=None,
                 accounting="strict", window=3, align="trailing", noise):
        self._setup(n, noise, make_plan("capp", epsilon=epsilon, w=w, lower=lower, upper=upper, accounting=accounting,
                                        window=window, align=align, private=noise.private,
                                        memory=memory_of(memory, w), bounds_mode=bounds_mode, clip_delta=clip_delta))


class PPSStream(DUStream):
    """``pp_s``: IPP/APP/CAPP (``base``) on segment means (DU Alg. 3). ``memory`` counts
    segment reports (default: ``n_s``, one query period; IPP: 1)."""

    def __init__(self, n, *, epsilon, w, lower, upper, base="capp", qlen=None, n_s=None, memory=None,
                 bounds_mode="reference_code", clip_delta=None, accounting="strict", window=1, align="trailing",
                 noise):
        base = _validate.choice(base, "base", BASES)
        clipped = base == "capp"
        self._setup(n, noise, make_plan("pp_s", epsilon=epsilon, w=w, lower=lower, upper=upper, accounting=accounting,
                                        window=window, align=align, private=noise.private,
                                        memory=1 if base == "ipp" else memory_of(memory, "n_s"), qlen=qlen, n_s=n_s,
                                        base=base, bounds_mode=bounds_mode if clipped else None,
                                        clip_delta=clip_delta if clipped else None))


class BASWStream(DUStream):
    """``ba_sw``: Budget Absorption with SW; the published stream repeats the last
    publication between publications."""

    encoder_class = AbsorptionEncoder

    def __init__(self, n, *, epsilon, w, lower, upper, accounting="strict", window=1, align="trailing", noise):
        self._setup(n, noise, make_plan("ba_sw", epsilon=epsilon, w=w, lower=lower, upper=upper, accounting=accounting,
                                        window=window, align=align, private=noise.private))

    def _record(self, values: np.ndarray, units: np.ndarray) -> None:
        super()._record(values, np.ones(values.shape[1], dtype=np.int64))
        self._marks[-1] = units

    def describe_partition(self, partition: int) -> dict:
        plan = self.plan
        values, units = self._history()
        units = units[partition]
        published = units > 0
        unit = budget_absorption_unit(plan)
        variance = np.array([SQUARE_WAVE.worst_variance(unit * u) for u in range(1, plan.w + 1)])[units[published] - 1]
        error = ReportNoise(report_index=np.cumsum(published) - 1,
                            report_variance=(plan.upper - plan.lower) ** 2 * variance,
                            window=plan.window, align=plan.align)
        params = {**plan.params, "epsilon_report": None, "epsilon_unit": unit, "publications": int(published.sum())}
        return dict(method=plan.method, params=params, error=error, reports=values[partition],
                    components={"dissimilarity": (plan.epsilon / 2, 0.0), "publication": (plan.epsilon / 2, 0.0)})


MACHINES = {"sw_direct": SWDirectStream, "sampling": SamplingStream, "ba_sw": BASWStream, "ipp": IPPStream,
            "app": APPStream, "capp": CAPPStream, "pp_s": PPSStream}
