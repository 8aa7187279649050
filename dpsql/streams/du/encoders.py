"""The device side of Du et al.'s methods (Du et al.): what a user's device
runs on its own readings, for ``users`` users at once (one per partition of a
:class:`~dpsql.noise.DrawsBatch`).

Readings arrive normalised to [0, 1] by the public bounds; reports leave in the same
units. Every report's uniforms are addressed by (release key, user, report index), so
the reports of a user depend on that user's readings and key alone: how many users run
together, and how the readings are cut into pushes, never changes them.
"""

from __future__ import annotations

import numpy as np

from dpsql.mechanisms.ldp.feedback import PLAIN_LOOP_USERS, FeedbackEncoder
from dpsql.mechanisms.ldp.randomisers import SQUARE_WAVE, report_uniforms
from dpsql.noise import DrawsBatch, Lane
from dpsql.streams.du.plan import Plan, budget_absorption_unit

#: BA-SW reports twice per slot: its publication at index ``slot`` of ``Lane.LDP_REPORT``, its
#: dissimilarity report at the same index of this lane.
DISSIMILARITY_LANE = Lane.LDP_CHOICE


class SegmentEncoder:
    """Device-side encoder for every method but BA-SW.

    Readings are averaged over the segments of :func:`~dpsql.streams.du.plan.segment_lengths`
    (one slot each for the per-slot methods) and each mean goes through
    :class:`~dpsql.mechanisms.ldp.feedback.FeedbackEncoder`. Report ``t`` of a user draws its
    uniforms at index ``t``. ``randomiser`` replaces Square Wave in tests (an object with
    ``perturb(z, eps, u)`` and ``uniforms``).
    """

    def __init__(self, plan: Plan, noise: DrawsBatch, randomiser=SQUARE_WAVE):
        self.plan = plan
        self._noise = noise
        self._uniforms = randomiser.uniforms
        self._feedback = FeedbackEncoder(len(noise), eps=plan.epsilon_report, memory=plan.memory,
                                         ranges=plan.ranges, randomiser=randomiser)
        self._pending = np.empty((len(noise), 0))
        self._position = 0  # where the next segment starts in the segment pattern
        self._reports = 0  # reports sent so far

    def push(self, unit_values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``unit_values`` (users x slots, in [0, 1]) -> (reports users x r, the r segments' lengths).
        Readings of a segment not yet complete are kept for the next push."""
        values = np.concatenate([self._pending, unit_values], axis=1) if self._pending.size else unit_values
        pattern = np.roll(self.plan.pattern, -self._position)
        lengths = np.resize(pattern, values.shape[1] // self.plan.segment + 1)
        lengths = lengths[:np.searchsorted(np.cumsum(lengths), values.shape[1], side="right")]
        used = int(lengths.sum())
        self._pending = values[:, used:]
        self._position = (self._position + len(lengths)) % len(self.plan.pattern)
        if not len(lengths):
            return np.empty((values.shape[0], 0)), lengths
        means = values if (lengths == 1).all() else segment_means(values, lengths)
        uniforms = report_uniforms(self._noise, self._reports, means.shape[1], uniforms=self._uniforms)
        self._reports += means.shape[1]
        return self._feedback.run(means, uniforms), lengths


def segment_means(values: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Means of consecutive segments of ``lengths`` slots (the rows of ``values``, users x slots),
    each segment's readings added one by one in time order: a plain function of the segment's
    readings, the same on a device and in any batch (``np.add.reduceat`` does not promise an
    order of additions).

    Examples
    --------
    >>> segment_means(np.array([[1.0, 2.0, 3.0, 4.0, 5.0]]), np.array([2, 3]))
    array([[1.5, 4. ]])
    """
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    sums = values[:, starts]
    for k in range(1, int(lengths.max())):
        longer = lengths > k
        sums[:, longer] += values[:, starts[longer] + k]
    return sums / lengths


class AbsorptionEncoder:
    """Device side of BA-SW (Kellaris et al. 2014, with Square Wave).

    Unit budget ``e0 = epsilon / (2w)``. Slot 0 publishes ``SW(x; e0)``. Later slots:
    (M1) ``dis = |SW(|o - x|; e0)|`` against the last publication ``o``; (M2) after a
    publication that used ``m`` units the next ``m - 1`` slots repeat it; otherwise the
    absorbed budget is ``e0 * min(slots since the nullified run, w)`` and the value is
    published with it if ``dis`` exceeds that budget's SW half-width ``b``, else ``o``
    repeats. Privacy: M1 spends at most ``epsilon / 2`` and M2 at most ``epsilon / 2`` per
    window of ``w`` slots; decisions read only the current value and released outputs,
    so no feedback term arises (both accountings agree). M1 is skipped on nullified
    slots, which only spends less. Slot ``t``'s publication draws at index ``t`` of
    ``Lane.LDP_REPORT``, its dissimilarity report at index ``t`` of :data:`DISSIMILARITY_LANE`.

    The decisions make each user's slots a sequential recursion: up to
    :data:`~dpsql.mechanisms.ldp.feedback.PLAIN_LOOP_USERS` users loop in plain floats (the
    same arithmetic bit for bit), more users step slot by slot with numpy across users.

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
        count = unit_values.shape[1]
        publication_u = report_uniforms(self._noise, self._slot, count, uniforms=1)[..., 0]
        dissimilarity_u = report_uniforms(self._noise, self._slot, count, uniforms=1, lane=DISSIMILARITY_LANE)[..., 0]
        if self._randomiser is SQUARE_WAVE and len(unit_values) <= PLAIN_LOOP_USERS:
            pushed = [self._run_user(j, unit_values[j].tolist(), publication_u[j].tolist(),
                                     dissimilarity_u[j].tolist()) for j in range(len(unit_values))]
            out = np.array([values for values, _ in pushed]).reshape(unit_values.shape)
            units_used = np.array([units for _, units in pushed], dtype=np.int64).reshape(unit_values.shape)
        else:
            out, units_used = self._run_together(unit_values, publication_u, dissimilarity_u)
        self._slot += count
        return out, units_used

    def _run_together(self, unit_values, publication_u, dissimilarity_u):
        out = np.empty_like(unit_values)
        units_used = np.zeros(unit_values.shape, dtype=np.int64)
        for k in range(unit_values.shape[1]):  # inherently sequential
            slot = self._slot + k
            x = unit_values[:, k]
            if slot == 0:
                units = np.ones(len(x), dtype=np.int64)
                publish = np.ones(len(x), dtype=bool)
            else:
                absorbed = slot - (self._last_slot + self._last_units - 1)
                units = np.clip(absorbed, 0, self.plan.w)
                publish = units > 0
                dis = np.abs(self._randomiser.perturb(np.abs(self._last - x), self._unit, dissimilarity_u[:, k, None]))
                publish &= dis > self._half_width[units]
            for level in np.unique(units[publish]):  # users absorbed the same budget: one draw each
                chosen = publish & (units == level)
                self._last[chosen] = self._randomiser.perturb(x[chosen], self._unit * int(level),
                                                              publication_u[chosen, k, None])
                self._last_slot[chosen] = slot
                self._last_units[chosen] = level
                units_used[chosen, k] = level
            out[:, k] = self._last
        return out, units_used

    def _run_user(self, user: int, x: list[float], publication_u: list[float],
                  dissimilarity_u: list[float]) -> tuple[list[float], list[int]]:
        """User ``user``'s values in force and units for the readings ``x``, in plain floats:
        :meth:`_run_together`'s arithmetic, operation for operation."""
        w = self.plan.w
        publish_with = [None] + [SQUARE_WAVE.sampler(self._unit * u) for u in range(1, w + 1)]
        dissimilarity = publish_with[1]
        half_width = self._half_width.tolist()
        last, last_slot, last_units = float(self._last[user]), int(self._last_slot[user]), int(self._last_units[user])
        out, units_used = [0.0] * len(x), [0] * len(x)
        for k, value in enumerate(x):
            slot = self._slot + k
            units = 1 if slot == 0 else min(max(slot - (last_slot + last_units - 1), 0), w)
            if units and (slot == 0 or abs(dissimilarity(min(abs(last - value), 1.0), dissimilarity_u[k]))
                          > half_width[units]):
                last = publish_with[units](min(max(value, 0.0), 1.0), publication_u[k])
                last_slot, last_units = slot, units
                units_used[k] = units
            out[k] = last
        self._last[user], self._last_slot[user], self._last_units[user] = last, last_slot, last_units
        return out, units_used
