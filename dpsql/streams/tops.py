"""ToPS (method ``"tops"``): a private threshold from a hold-out prefix (Noisy Max over a
score for what the release is for, or ToPS Eq. 6), then the block hierarchy
(:mod:`dpsql.streams.hierarchy`) on the remaining rows, clipped at that threshold.

Privacy (replace-one-value neighbours; time order public; values clipped to the public
``[lower, upper]``): the hold-out pays the threshold and its own release
(:mod:`dpsql.streams.holdout`), the rows after it the hierarchy's ``epsilon`` with the
threshold as sensitivity; the row sets are disjoint, so ToPS is ``epsilon``-DP.
"""

from __future__ import annotations

import numpy as np

from dpsql import _validate
from dpsql.errors import InvalidParameter
from dpsql.mechanisms.calendar import DEFAULT_CALENDAR
from dpsql.mechanisms.noisy_max import NM_LEVELS, default_step, nm_thresholds, noisy_max_lattice
from dpsql.mechanisms.query_mix import (
    FOCUSES,
    QueryMix,
    mix_thresholds,
    ranges_span,
    refuse_paper_options,
)
from dpsql.noise import Draws, Lane
from dpsql.release import StreamMachine
from dpsql.streams.hierarchy import PAPER_RANGE, HierarchyStream, check_hierarchy_options
from dpsql.streams.holdout import ThresholdedStream


class ToPS(ThresholdedStream):
    """ToPS (method ``"tops"``): Noisy-Max threshold on the hold-out, then :class:`HierarchyStream`.

    Parameters beyond :class:`~dpsql.streams.holdout.ThresholdedStream`'s: ``smoother``,
    ``window``, ``alpha``, ``r``, ``fanout``, ``depth``, ``block``, ``grid`` and ``calendar`` as for
    the hierarchy (same defaults: the flat spread over geometric chunks, or over calendar days
    with a grid, the hold-out's rows too; the rows after the hold-out are on the grid shifted by
    ``m`` rows), ``max_delay`` as for the hierarchy and for the hold-out (see
    :class:`~dpsql.streams.holdout.ThresholdedStream`), and for the threshold ``focus``, what the
    release is for.

    The threshold gets ``(1 - holdout_share) * epsilon``. ``focus="mixed"`` (the default:
    24-row windows, weeks and months of hourly rows, long ranges; with calendar blocks, the whole
    days, weeks and months they serve), ``"windows"`` or ``"long"``:
    Report-Noisy-Max over ``-#{v > theta} - beta * ln(theta)`` (for calendar totals the clipped
    excess ``sum_v min(v - theta, theta)+ / theta`` in place of the count) on the candidates
    ``upper * 2**(-j / 8)``, ``beta`` from the stream phase's noise for those range lengths, the
    choice raised by ``sqrt(beta / beta_mix)`` where the stability floor raised ``beta`` above the
    mix's own (:mod:`dpsql.mechanisms.query_mix`; the long ranges are ranges anywhere in the
    release's ``n`` rows, at least ``2**16`` (a stream's length is unknown: ``2**16``), and at most
    ``r`` when given (the paper's range), stood for by their root-mean-square length, a
    ``sqrt(6)``-th of that span). ``focus="paper"``: ToPS
    Eq. 6 as published, with its constants whatever the stream's length (the largest range ``r``,
    ``2**20`` unless given, ``log16 r`` levels, ``c`` = 60, candidates ``step, 2 step, ..., upper``;
    ``levels_for_nm="code"`` counts ``floor(log16 r) + 1`` levels as the reference code does);
    ``c``, ``step`` and ``levels_for_nm`` apply to it alone. A predictive smoother's first guess is
    the hold-out's released mean, clipped to ``[0, threshold]`` (already paid for; the paper's
    ``theta / 2`` is a worse guess for any stream whose level is not half its threshold).
    """

    method = "tops"
    batchable = True

    def __init__(self, n: int | None = None, *, epsilon: float, upper: float, lower: float = 0.0,
                 m: int | None = None, smoother: str = "none", window: int = 8, alpha: float = 0.6,
                 r: int | None = None, fanout: int = 16, depth: int | None = None, block: int | None = None,
                 holdout_share: float = 0.5, focus: str = "mixed", c: float | None = None, step: float | None = None,
                 levels_for_nm: str | None = None, threshold: float | None = None, threshold_by: str = "fleet",
                 pooled_rows: int | None = None, grid=None, calendar: str = DEFAULT_CALENDAR,
                 max_delay: int | None = None, noise: Draws):
        (self.fanout, _, self.smoother, self.window, self.alpha, self.r, self.depth, self.block, self.grid,
         self.calendar, max_delay) = check_hierarchy_options(fanout=fanout, consistency=True, smoother=smoother,
                                                             window=window, alpha=alpha, r=r, depth=depth, block=block,
                                                             grid=grid, calendar=calendar, max_delay=max_delay)
        if self.grid is not None and n is not None:
            self.grid.check_rows(n)
        self.focus = _validate.choice(focus, "focus", FOCUSES)
        refuse_paper_options(self.focus, {"c": c, "step": step, "levels_for_nm": levels_for_nm})
        self.c = 60.0 if c is None else _validate.real(c, "c", minimum=0.0, strict=True)
        bound = _validate.bounds(lower, upper)[1] - _validate.bounds(lower, upper)[0]
        self.step = default_step(bound) if step is None else _validate.real(step, "step", minimum=0.0, strict=True)
        self.levels_for_nm = _validate.choice(levels_for_nm or "paper", "levels_for_nm", NM_LEVELS)
        super().__init__(n, epsilon=epsilon, upper=upper, lower=lower, m=m, holdout_share=holdout_share,
                         threshold=threshold, threshold_by=threshold_by, pooled_rows=pooled_rows, max_delay=max_delay,
                         noise=noise)
        if threshold is None:  # refused now, not when the hold-out completes (a stream is charged before)
            try:
                noisy_max_lattice(_validate.epsilon(self.epsilon_threshold))
            except InvalidParameter:
                raise InvalidParameter(f"holdout_share={self.holdout_share!r} leaves the threshold "
                                       f"epsilon={self.epsilon_threshold!r} ((1 - holdout_share) * epsilon), too "
                                       f"little for Noisy Max: lower holdout_share or raise epsilon") from None

    def _choose_thresholds(self, holdout: np.ndarray, rows: int | None) -> np.ndarray:
        noise = self._draws.lane(Lane.NOISY_MAX)
        if self.focus == "paper":
            return nm_thresholds(holdout, epsilon=self.epsilon_threshold, upper=self.bound,
                                 epsilon_perturber=self.epsilon, r=self.r or PAPER_RANGE, fanout=self.fanout,
                                 c=self.c, step=self.step, levels_for_nm=self.levels_for_nm, is_sorted=False,
                                 noise=noise)
        return mix_thresholds(holdout, epsilon=self.epsilon_threshold, upper=self.bound, mix=self._query_mix(rows),
                              is_sorted=False, noise=noise)

    def _query_mix(self, rows: int | None) -> QueryMix:
        """The range sums the threshold is for, in the span of partitions of ``rows`` rows (None: a
        stream's) with the range ``r`` declared (:func:`~dpsql.mechanisms.query_mix.ranges_span`), with
        the stream phase's noise for them (public; computed when the threshold is chosen: a calendar
        layout's takes about a second)."""
        span = ranges_span(rows, self.r)
        return self._stream_phase(np.ones(1), None).focus_mix(self.focus, span)

    def _stream_phase(self, thresholds: np.ndarray, initials: np.ndarray | None) -> StreamMachine:
        grid = None if self.grid is None else self.grid.shifted(self.m)  # the rows after the hold-out
        return HierarchyStream(epsilon=self.epsilon, upper=float(thresholds[0]), smoother=self.smoother,
                               window=self.window, alpha=self.alpha, r=self.r, fanout=self.fanout, depth=self.depth,
                               block=self.block, grid=grid, calendar=self.calendar, max_delay=self.max_delay,
                               noise=self._draws[0]).for_partitions(thresholds, self._draws, initials)

    def _method_params(self) -> dict:
        stream = self._stream or self._stream_phase(np.array([self.bound]), None)
        layout = {k: v for k, v in stream.params().items() if k not in ("epsilon", "lower", "upper")}
        layout["grid"] = None if self.grid is None else self.grid.plain()
        if self.focus == "paper":
            return {**layout, "focus": "paper", "c": self.c, "step": self.step, "levels_for_nm": self.levels_for_nm}
        return {**layout, "focus": self.focus}
