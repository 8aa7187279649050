"""The two-phase skeleton shared by ToPS and PAK: a private threshold from a hold-out
prefix, then a stream phase on the remaining values clipped at that threshold.

Hold-out rows are released too (PAK publishes their noisy total; dpsql does the same
for ToPS): every hold-out row carries ``1/m`` of the hold-out's clipped noisy total, so
any range sum covering the whole hold-out is unbiased up to clipping, and ranges
inside it are spread evenly.

Privacy (replace-one-value neighbours, values clipped to the public ``[lower, upper]``):

* hold-out rows: threshold at ``(1 - holdout_share) * epsilon`` (plus the threshold
  method's delta), then their clipped total with Laplace noise of scale
  ``threshold / (holdout_share * epsilon)``; sequential composition gives
  ``epsilon`` (and delta) on the hold-out;
* remaining rows: the stream phase's own ``epsilon`` guarantee, with sensitivity the
  (now public) threshold;
* the two row sets are disjoint: parallel composition, so the release costs
  ``(epsilon, delta)``.

Values are shifted to ``[0, upper - lower]`` internally; the released values and the
threshold are in the original units. A threshold below ``(upper - lower) * 2**-30``
is raised to it (post-processing), so the stream phase always has a positive bound.
"""

from __future__ import annotations

from abc import abstractmethod

import numpy as np

from dpsql import _validate
from dpsql.accountant import largest_share
from dpsql.mechanisms import LaplaceLattice
from dpsql.noise import NoiseSource
from dpsql.release import SegmentedNoise, SharedTotalNoise, StreamMachine

#: The ToPS paper's hold-out length; by default capped at a quarter of the stream.
PAPER_HOLDOUT = 65_536
_MIN_THRESHOLD = 2.0**-30


def default_holdout(n: int) -> int:
    """``min(65536, n // 4)``, at least 1: the paper's m for long streams, a quarter of
    short ones. Smaller hold-outs make noisier thresholds (PAK's smooth sensitivity
    barely decays below tens of thousands of rows); pass ``m`` to trade threshold
    quality for fewer flat hold-out rows."""
    return max(1, min(PAPER_HOLDOUT, n // 4))


class ThresholdedStream(StreamMachine):
    """Buffer the first ``m`` rows, choose the threshold, release the hold-out's total,
    then delegate every later row to the stream phase.

    Subclasses implement :meth:`_choose_threshold`, :meth:`_stream_phase` and
    :meth:`_method_params`, and set ``method`` and, for (epsilon, delta) thresholds,
    ``threshold_delta``.
    """

    method: str
    threshold_delta: float = 0.0

    def __init__(self, n: int, *, epsilon: float, upper: float, lower: float = 0.0, m: int | None = None,
                 holdout_share: float = 0.15, noise: NoiseSource):
        self.n = n
        self.epsilon = _validate.epsilon(epsilon)
        self.lower, self.upper = _validate.bounds(lower, upper)
        self.bound = self.upper - self.lower
        self.m = _validate.holdout(m, n, default=default_holdout(n))
        self.holdout_share = _validate.probability(holdout_share, "holdout_share")
        self.epsilon_threshold = (1.0 - self.holdout_share) * self.epsilon
        # rounded so that the two hold-out charges never add up to more than epsilon
        self.epsilon_total = largest_share(self.epsilon, self.holdout_share * self.epsilon,
                                           rest=self.epsilon_threshold)
        self.noise = noise
        self.threshold: float | None = None
        self._held: list[np.ndarray] = []
        self._held_rows = 0
        self._stream: StreamMachine | None = None
        self._holdout_error: SharedTotalNoise | None = None

    @property
    def cost(self) -> tuple[float, float]:
        return self.epsilon, self.threshold_delta

    @abstractmethod
    def _choose_threshold(self, holdout_sorted: np.ndarray) -> float:
        """The private threshold from the sorted hold-out values in ``[0, bound]``."""

    @abstractmethod
    def _stream_phase(self, n_rest: int, threshold: float) -> StreamMachine:
        """The machine releasing the remaining rows, fed values shifted to ``[0, bound]``;
        it clips them at ``threshold`` itself."""

    @abstractmethod
    def _method_params(self) -> dict:
        """Method-specific public parameters for the release record."""

    def feed(self, chunk: np.ndarray) -> np.ndarray:
        outputs = []
        if self._stream is None:
            take = chunk[: self.m - self._held_rows]
            self._held.append(take)
            self._held_rows += len(take)
            chunk = chunk[len(take):]
            if self._held_rows == self.m:
                outputs.append(self._release_holdout())
        if len(chunk):
            outputs.append(self._shift_back(self._stream.feed(self._shift(chunk))))
        return np.concatenate(outputs) if outputs else np.empty(0)

    def close(self) -> np.ndarray:
        return self._shift_back(self._stream.close())

    # A zero lower bound is the common case; skipping the no-op shifts saves two passes per chunk.
    def _shift(self, values: np.ndarray) -> np.ndarray:
        return values - self.lower if self.lower else values

    def _shift_back(self, values: np.ndarray) -> np.ndarray:
        return values + self.lower if self.lower else values

    def _release_holdout(self) -> np.ndarray:
        held = self._held[0] if len(self._held) == 1 else np.concatenate(self._held)
        holdout = np.clip(self._shift(held), 0.0, self.bound)
        self._held = []
        threshold = float(np.clip(self._choose_threshold(np.sort(holdout)), _MIN_THRESHOLD * self.bound, self.bound))
        self.threshold = threshold
        total = LaplaceLattice(sensitivity=threshold, epsilon=self.epsilon_total)
        noisy_total = float(total.release(np.array([np.minimum(holdout, threshold).sum()]), self.noise)[0])
        self._holdout_error = SharedTotalNoise(total.variance, self.m)
        self._stream = self._stream_phase(self.n - self.m, threshold)
        return np.full(self.m, noisy_total / self.m + self.lower)

    def describe(self) -> dict:
        stream = self._stream.describe()
        params = {"epsilon": self.epsilon, "lower": self.lower, "upper": self.upper, "m": self.m,
                  "holdout_share": self.holdout_share, **self._method_params()}
        components = {"threshold": (self.epsilon_threshold, self.threshold_delta),
                      "holdout_total": (self.epsilon_total, 0.0), **stream.get("components", {})}
        return dict(method=self.method, params=params, threshold=self.threshold + self.lower,
                    error=SegmentedNoise([0, self.m, self.n], [self._holdout_error, stream["error"]]),
                    components=components)
