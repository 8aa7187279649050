"""Per-value Laplace baseline (Laplace on every value).

Privacy: each value is clipped to the public ``[lower, upper]`` and released once with
Laplace noise of scale ``(upper - lower) / epsilon``: ``epsilon``-DP under
replace-one-value neighbours (one row's value changes by at most ``upper - lower``).
Rows are disjoint, so the stream as a whole is ``epsilon``-DP (parallel composition).
Row ``i``'s noise is the draw at index ``i`` of the partition's ``ROWS`` lane.
"""

from __future__ import annotations

import copy

import numpy as np

from dpsql import _validate
from dpsql._groups import unique
from dpsql.error_models import IndependentNoise
from dpsql.mechanisms.laplace import LaplaceLattice, LatticeBatch, draw_bound
from dpsql.noise import Draws, DrawsBatch, Lane
from dpsql.release import StreamMachine


class RowNoiseStream(StreamMachine):
    """Shared by the per-row machines: every row is released when it arrives with its own
    draw (row ``i``: index ``i`` of the ``ROWS`` lane), on one lattice per partition.
    Subclasses set ``method`` and implement :meth:`_units_before_noise` and :meth:`params`."""

    method: str
    batchable = True

    def _start(self, sensitivity: float, epsilon: float, noise: Draws | DrawsBatch) -> None:
        self._sensitivity, self._epsilon = sensitivity, epsilon
        self._draws = noise if isinstance(noise, DrawsBatch) else DrawsBatch([noise])
        self._lattice = LatticeBatch(np.full(len(self._draws), sensitivity), epsilon)
        self._lane = self._draws.lane(Lane.ROWS)
        self.rows = 0
        self._lead = ()

    def batched(self, draws: DrawsBatch) -> RowNoiseStream:
        machine = copy.copy(self)
        machine._start(self._sensitivity, self._epsilon, draws)
        return machine

    def _values_to_release(self, chunk: np.ndarray) -> np.ndarray:
        """The private quantity of each row, before noise (``(partitions, rows)``)."""
        raise NotImplementedError

    def _after_release(self, released: np.ndarray) -> np.ndarray:
        return released

    def feed(self, chunk: np.ndarray) -> np.ndarray:
        self._lead = chunk.shape[:-1]
        rows = chunk.reshape(len(self._draws), -1)
        released = self._lattice.release(self._values_to_release(rows), self._lane, self.rows)
        self.rows += rows.shape[1]
        return self._after_release(released).reshape((*self._lead, -1))

    def close(self) -> np.ndarray:
        return np.empty((*self._lead, 0))

    def snapshot(self) -> dict:
        return {"rows": self.rows}

    def restore(self, state: dict) -> None:
        self.rows = int(state["rows"])

    def describe(self) -> dict:
        return self.describe_partition(0)

    def describe_partition(self, partition: int) -> dict:
        return dict(method=self.method, params=self.params(),
                    error=IndependentNoise(float(self._lattice.variance[partition]), self.rows),
                    components={self.component: self.cost})


class LaplaceStream(RowNoiseStream):
    """Online state machine: nothing but the row count; every row is released as soon as
    it arrives.

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> with dpsql.testing.seeded(1) as keys:
    ...     machine = LaplaceStream(None, epsilon=1.0, upper=10.0, noise=keys.partition())
    ...     out = np.concatenate([machine.feed(np.array([1.0, 2.0])), machine.feed(np.array([30.0])),
    ...                           machine.close()])
    >>> out.shape
    (3,)
    """

    method = "laplace"
    component = "laplace"

    def __init__(self, n: int | None = None, *, epsilon: float, upper: float, lower: float = 0.0,
                 noise: Draws):
        self.epsilon = _validate.epsilon(epsilon)
        self.lower, self.upper = _validate.bounds(lower, upper)
        self.cost = (self.epsilon, 0.0)
        self._start(self.upper - self.lower, self.epsilon, noise)

    def partition_kinds(self) -> np.ndarray:
        # a partition's description is its lattice's variance and its row count (the same for all)
        return unique(self._lattice.variance, return_inverse=True)[1]

    def _values_to_release(self, rows: np.ndarray) -> np.ndarray:
        # Shifted by the public lower bound, so that the lattice units stay small however far
        # the data lie from 0; adding it back is post-processing of the noisy units.
        shifted = np.clip(rows, self.lower, self.upper)
        if self.lower:
            shifted -= self.lower
        return shifted

    def _after_release(self, released: np.ndarray) -> np.ndarray:
        if self.lower:
            released += self.lower
        return released

    @staticmethod
    def repeats_by_release(params: dict) -> bool:
        """Can a continual stream with ``params`` recognise a row appended again by releasing it
        again (:meth:`release_at`) and comparing, keeping no value tag? A row's release is its own
        value's lattice point (clipped) plus its own addressed draw, final when it arrives, then
        ``lower`` added back: two lattice points give two releases unless that addition rounds
        them together, which it cannot while every release stays below ``2**51`` lattice steps
        (its rounding, at most ``2**-53`` of it, then moves two releases a step apart by less than
        half a step). Beyond (``lower`` some ``2**38`` times its range from 0), the stream keeps tags."""
        lower, upper = _validate.bounds(params.get("lower", 0.0), params["upper"])
        lattice = LaplaceLattice.shared(upper - lower, _validate.epsilon(params["epsilon"]))
        step = lattice.granularity
        return abs(lower) + (upper - lower) + step * (draw_bound(lattice.scale_units) + 1) <= step * 2.0**51

    def release_at(self, values: np.ndarray, partitions: np.ndarray, indices: np.ndarray) -> np.ndarray:
        """What :meth:`feed` released (or would release) for ``values[i]`` as row ``indices[i]`` of
        partition ``partitions[i]`` of this machine's batch, bit for bit; the state is not changed.
        Two values get the same release exactly when they clip and round to the same lattice point:
        the draw is the row's own."""
        shifted = self._values_to_release(np.asarray(values, dtype=np.float64))
        return self._after_release(self._lattice.release_at(shifted, self._lane, partitions, indices))

    def params(self) -> dict:
        return {"epsilon": self.epsilon, "lower": self.lower, "upper": self.upper}
