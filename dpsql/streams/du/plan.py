"""The public parameters of Du et al.'s methods (docs/algorithms.md, "The w-event family"): the papers' choices as
functions, the per-report budget of each accounting, the sampling segments, and the
validated :class:`Plan` that the device encoders and the machines share.

Privacy: under w-event LDP (neighbours: two streams of one user that differ only in
slots inside some window of ``w`` consecutive slots; time domain public) every method
costs ``epsilon``. ``accounting="strict"`` (default) sets the per-report budget so that
the claim holds: a window of ``w`` slots changes the inputs of the ``w`` reports inside
it AND, through the deviation fed back into later inputs, of the next ``memory`` reports;
adaptive composition then needs ``epsilon_report = epsilon / (w + memory)`` (§6.8).
Sampling methods count affected segment reports: ``ceil((w-1)/L) + 1`` for segments of
at least ``L`` slots. ``accounting="paper"`` reproduces the published experiments with
``epsilon / w`` (sampling: ``epsilon / ceil(w / L)``, Theorem 6); that is not
``epsilon``-w-event LDP (the likelihood ratio exceeds ``e^epsilon``, see the tests), so
it is refused unless the seeded test keys are in force; such releases are marked
non-private and a persistent ledger refuses them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from dpsql import _validate
from dpsql.accounting import Neighbour, Notion, largest_share
from dpsql.errors import InvalidParameter
from dpsql.mechanisms.ldp.feedback import BOUNDS_MODES, UNIT, Ranges, capp_ranges
from dpsql.mechanisms.ldp.linear import check_window
from dpsql.mechanisms.ldp.randomisers import SQUARE_WAVE

NOTION = Notion.W_EVENT_LDP.value
W_EVENT_USER = Neighbour.LDP_W_EVENT.value
ACCOUNTINGS = ("strict", "paper")
BASES = ("ipp", "app", "capp")



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


def budget_absorption_unit(plan: Plan) -> float:
    """BA-SW's unit budget ``epsilon / (2 w)``, rounded down so that the ``2 w`` units a
    window can spend (``w`` dissimilarity draws, at most ``w`` absorbed for publication)
    never add up to more than ``epsilon``."""
    return largest_share(plan.epsilon, plan.epsilon / (2 * plan.w), count=2 * plan.w)



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
    window: int
    align: str
    extra: dict = field(default_factory=dict)

    @property
    def segment(self) -> int:
        return int(self.pattern.min())

    @property
    def params(self) -> dict:
        return {"epsilon": self.epsilon, "w": self.w, "lower": self.lower, "upper": self.upper,
                "accounting": self.accounting, "epsilon_report": self.epsilon_report, "memory": self.memory,
                "window": self.window, "align": self.align, **self.extra}

    def to_unit(self, x: np.ndarray) -> np.ndarray:
        return (np.clip(x, self.lower, self.upper) - self.lower) / (self.upper - self.lower)

    def to_data(self, x: np.ndarray) -> np.ndarray:
        return self.lower + (self.upper - self.lower) * x


def memory_of(memory, default) -> int | str | None:
    """``None`` -> ``default``; ``"unbounded"`` -> None (the paper's H = infinity); else an int >= 1."""
    if memory is None:
        return default
    if memory == "unbounded":
        return None
    return _validate.integer(memory, "memory", minimum=1)


def make_plan(method: str, *, epsilon, w, lower, upper, accounting, window, align, private: bool,
              memory: int | str | None = 0, bounds_mode=None, clip_delta=None, qlen=None, n_s=None,
              base=None) -> Plan:
    """The validated :class:`Plan` of ``method`` (``private``: whether the release key is a
    private one; the paper's accounting is refused with one)."""
    epsilon = _validate.epsilon(epsilon)
    w = _validate.integer(w, "w", minimum=1)
    lower, upper = _validate.bounds(lower, upper)
    accounting = _validate.choice(accounting, "accounting", ACCOUNTINGS)
    window, align = check_window(window, align)
    if accounting == "paper" and private:
        raise InvalidParameter("accounting='paper' is not w-event private (a window's values reach later reports "
                               "through the fed-back deviation) and is only available with the seeded test keys "
                               "(dpsql.testing.seeded), for reproducing the paper")
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
    return Plan(method, epsilon, w, lower, upper, accounting, eps_report, memory, ranges, pattern, window, align,
                extra)


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
