"""Block smoothers (ToPS App. D): post-processing of released block sums.

A hierarchy releases one noisy sum ``u_t`` per block of ``g`` values. A *predictive*
smoother turns them into one value per row, causally: every row of block ``t`` except
the last gets the per-value prediction ``pred_t`` computed from ``u_0 .. u_{t-1}`` only
(known when block ``t`` starts), and the block's last row gets ``u_t - (len_t - 1) * pred_t``,
so each block's outputs sum exactly to ``u_t`` and range sums agree with the hierarchy at
block boundaries. Before any block is released, ``pred_0 = initial_sum / g`` (ToPS:
``u_0 = g * theta / 2``, i.e. ``theta / 2`` per value).

Indexing here is 0-based: ``u_0`` is the first *released* block; the paper's public
constant ``u_0`` is ``initial_sum``. Predictions (per value, the paper's ``pred_t`` for
1-based ``t = j + 1``):

* ``recent``: ``u_{t-1} / g``;
* ``mean``: ``mean(u_0 .. u_{t-1}) / g`` (the paper's sum from ``j = 0`` with ``/ t`` is off by
  one; this follows the reference code);
* ``median``: ``median(u_0 .. u_{t-1}) / g`` (mean of the two middle values for even counts),
  kept with two heaps: one short Python step per block (about 6 us here, so it only
  matters when blocks are single values);
* ``moving``: mean of the last ``window`` released sums (all of them while fewer exist) ``/ g``;
* ``exponential``: ``e = u_0`` then ``e = alpha * u_j + (1 - alpha) * e``; ``pred = e / g``
  (``MIN_ALPHA <= alpha <= 1``; the error model drops the oldest weights, < 1e-9 in total);
* ``none`` (ablation, not predictive): every row of block ``t`` gets ``u_t / len_t``, so rows
  are only released when their block completes.

Everything here reads released sums only, never the data.

Partitions: block sums may come as a 2-D array, one row per partition (equal-length
partitions released together); every smoother then keeps one state per row, with the
same arithmetic per row as for a single stream, and ``initial_sum`` may be one value per
row. ``median`` loops over the rows (its heaps are per partition).
"""

from __future__ import annotations

import functools
import heapq
import math
from abc import ABC, abstractmethod

import numpy as np

#: Smoother names accepted by the hierarchy and ToPS.
SMOOTHERS = ("recent", "mean", "median", "moving", "exponential", "none")

#: Exponential weights below this fraction of the total are left out of the error model.
_EXPONENTIAL_TAIL = 1e-9
#: Smallest exponential ``alpha``: its memory in the error model stays below about 21,000
#: blocks; ``mean`` and ``moving`` serve longer memories.
MIN_ALPHA = 0.001


class BlockSmoother(ABC):
    """State of a smoother over the released block sums of one stream."""

    #: False for ``none``: a row's value needs its own block's sum.
    predictive = True

    def __init__(self, block: int, initial_sum: float | np.ndarray):
        self.block = block
        self.first_prediction = initial_sum / block

    @abstractmethod
    def predict(self, sums: np.ndarray) -> np.ndarray:
        """Consume newly released block sums (in order, along the last axis); return, for
        each, the per-value prediction for the block that follows it."""

    @abstractmethod
    def _prediction_terms(self, blocks: np.ndarray, partition: int) -> tuple[np.ndarray, np.ndarray]:
        """``g * pred_t`` for blocks ``t >= 1`` as ``sum_k coefs[:, k] * U(points[:, k])``,
        ``U(p)`` the sum of the first ``p`` released block sums (of row ``partition``)."""

    def partition_terms(self, partition: int) -> dict:
        """What :meth:`prefix_terms` needs for one partition's stream (the row ``partition`` of
        the sums), as plain public data for a release record (see :func:`prefix_terms_of`)."""
        return {"name": self.name, "block": self.block, **self.params()}

    def prefix_terms(self, blocks, offsets, lengths, partition: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """The random part of ``values[:x].sum()`` for a row ``x`` at ``offset`` in block
        ``blocks``: ``U(t) + offset * pred_t`` as points and coefficients (see
        :class:`dpsql.mechanisms.hierarchy.BlockStreamNoise`)."""
        points, coefs = self._prediction_terms(np.maximum(blocks, 1), partition)
        coefs = coefs * np.where(blocks >= 1, offsets / self.block, 0.0)[:, None]
        return (np.concatenate([blocks[:, None], points], axis=1),
                np.concatenate([np.ones((len(blocks), 1)), coefs], axis=1))

    def params(self) -> dict:
        """The smoother's own public parameters, for the release record."""
        return {}

    def snapshot(self) -> dict:
        """The smoother's state (released sums only: public), for a continual stream."""
        return {}

    def restore(self, state: dict) -> None:  # noqa: B027  (a smoother without state has nothing to restore)
        """Continue from :meth:`snapshot`'s ``state``."""


class Recent(BlockSmoother):
    name = "recent"
    def predict(self, sums):
        return sums / self.block

    def _prediction_terms(self, blocks, partition):
        return np.stack([blocks, blocks - 1], axis=1), np.tile([1.0, -1.0], (len(blocks), 1))


class Mean(BlockSmoother):
    name = "mean"
    def __init__(self, block, initial_sum):
        super().__init__(block, initial_sum)
        self._total = 0.0
        self._count = 0

    def predict(self, sums):
        # accumulated left to right from the carried total: bit-identical whatever the chunks
        carried = np.broadcast_to(self._total, (*sums.shape[:-1], 1))
        totals = np.add.accumulate(np.concatenate([carried, sums], axis=-1), axis=-1)[..., 1:]
        counts = self._count + np.arange(1, sums.shape[-1] + 1)
        if sums.shape[-1]:
            self._total, self._count = totals[..., -1:], int(counts[-1])
        return totals / (counts * self.block)

    def _prediction_terms(self, blocks, partition):
        return blocks[:, None], (1.0 / blocks)[:, None]

    def snapshot(self):
        return {"total": self._total, "count": self._count}

    def restore(self, state):
        self._total, self._count = state["total"], int(state["count"])


class Moving(BlockSmoother):
    name = "moving"
    def __init__(self, block, initial_sum, window: int):
        super().__init__(block, initial_sum)
        self.window = window
        self._recent = None
        self._count = 0

    def predict(self, sums):
        history = sums if self._recent is None else np.concatenate([self._recent, sums], axis=-1)
        new = sums.shape[-1]
        ends = history.shape[-1] - new + np.arange(new)  # position of each new sum in history
        widths = np.minimum(self.window, self._count + np.arange(1, new + 1))
        # each window summed newest first, one term per pass: the same additions whatever the chunks
        totals = history[..., ends].copy()
        for back in range(1, self.window):
            inside = back < widths
            totals[..., inside] += history[..., ends[inside] - back]
        self._recent = history[..., -self.window:]
        self._count += new
        return totals / (widths * self.block)

    def _prediction_terms(self, blocks, partition):
        widths = np.minimum(self.window, blocks)
        return (np.stack([blocks, blocks - widths], axis=1),
                np.stack([1.0 / widths, -1.0 / widths], axis=1))

    def params(self):
        return {"window": self.window}

    def snapshot(self):
        return {"recent": self._recent, "count": self._count}

    def restore(self, state):
        self._recent, self._count = state["recent"], int(state["count"])


class Exponential(BlockSmoother):
    name = "exponential"
    def __init__(self, block, initial_sum, alpha: float):
        super().__init__(block, initial_sum)
        self.alpha = alpha
        self._filter: dict | None = None
        decay = 1.0 - alpha
        self._memory = 1 if decay == 0 else max(1, math.ceil(math.log(_EXPONENTIAL_TAIL) / math.log(decay)))

    def predict(self, sums):
        if not sums.shape[-1]:
            return np.empty(sums.shape)
        if self._filter is None:  # the filter starts at the first released sum: e_0 = u_0
            self._filter = {"count": 0, "piece_start": np.array(sums[..., 0], dtype=np.float64),
                            "partial": np.zeros(sums.shape[:-1])}
        return _exponential_filter(sums, self.alpha, self._filter) / self.block

    def _prediction_terms(self, blocks, partition):
        """``e_{t-1} = sum_j w_j u_j`` with ``w_0 = (1-alpha)^(t-1)``, ``w_j = alpha (1-alpha)^(t-1-j)``,
        kept for the last ``memory`` blocks (the rest weigh < 1e-9 together) and written as
        ``sum_j w_j (U(j+1) - U(j)) = sum_p (w_{p-1} - w_p) U(p)``."""
        decay = 1.0 - self.alpha
        back = np.arange(self._memory + 1)
        points = blocks[:, None] - back[None, :]
        kept = points >= np.maximum(blocks - self._memory, 0)[:, None]

        def weight(j):
            inside = (j >= np.maximum(blocks - self._memory, 0)[:, None]) & (j < blocks[:, None]) & (j >= 0)
            age = np.maximum(blocks[:, None] - 1 - j, 0)
            w = np.where(j >= 1, self.alpha * decay**age, decay**age)
            return np.where(inside, w, 0.0)

        coefs = np.where(kept, weight(points - 1) - weight(points), 0.0)
        return np.maximum(points, 0), coefs

    def params(self):
        return {"alpha": self.alpha}

    def snapshot(self):
        return {"filter": self._filter}

    def restore(self, state):
        self._filter = state["filter"]


class Median(BlockSmoother):
    """Loops over the partitions: the heaps are per partition and the step per block is Python."""

    name = "median"

    def __init__(self, block, initial_sum):
        super().__init__(block, initial_sum)
        # per partition: max-heap of the smaller half (stored negated), min-heap of the larger
        # half, the released middle position(s) after each block
        self._low: list[list[tuple[float, int]]] = []
        self._high: list[list[tuple[float, int]]] = []
        self._positions: list[list[tuple[int, int]]] = []

    def snapshot(self):
        # every released sum so far: a running median needs them all (O(blocks), not kilobytes)
        return {"low": [np.array(heap, dtype=np.float64).reshape(-1, 2) for heap in self._low],
                "high": [np.array(heap, dtype=np.float64).reshape(-1, 2) for heap in self._high],
                "positions": [np.array(p, dtype=np.int64).reshape(-1, 2) for p in self._positions]}

    def partition_terms(self, partition):
        positions = self._positions[partition] if partition < len(self._positions) else []
        return {**super().partition_terms(partition), "positions": np.asarray(positions, dtype=np.int64).reshape(-1, 2)}

    def restore(self, state):
        self._low = [[(float(v), int(i)) for v, i in heap] for heap in state["low"]]
        self._high = [[(float(v), int(i)) for v, i in heap] for heap in state["high"]]
        self._positions = [[(int(a), int(b)) for a, b in p] for p in state["positions"]]

    def predict(self, sums):
        # A piece that completes no block still has its partitions: reshape by them, not by -1.
        rows = sums.reshape(math.prod(sums.shape[:-1]), sums.shape[-1])
        while len(self._positions) < len(rows):
            self._low.append([]), self._high.append([]), self._positions.append([])
        out = np.empty(rows.shape)
        for row, low, high, positions, row_out in zip(rows, self._low, self._high, self._positions, out):
            for i, value in enumerate(row.tolist()):
                index = len(positions)
                neg, pos = heapq.heappushpop(low, (-value, index))
                heapq.heappush(high, (-neg, pos))
                if len(high) > len(low):
                    value_up, pos_up = heapq.heappop(high)
                    heapq.heappush(low, (-value_up, pos_up))
                if len(low) > len(high):
                    row_out[i] = -low[0][0]
                    positions.append((low[0][1], low[0][1]))
                else:
                    row_out[i] = (high[0][0] - low[0][0]) / 2
                    positions.append((low[0][1], high[0][1]))
        return (out / self.block).reshape(sums.shape)

    def _prediction_terms(self, blocks, partition):
        """Plug-in: the median is ``u`` at the (released) middle position(s), so the terms use
        those positions as if they were fixed. Exact given the positions; the choice of
        positions itself depends on the noise, which this does not account for."""
        released = self._positions[partition] if self._positions else []
        positions = np.asarray(released, dtype=np.int64).reshape(-1, 2)[blocks - 1]
        low, high = positions[:, 0], positions[:, 1]
        return (np.stack([low + 1, low, high + 1, high], axis=1),
                np.tile([0.5, -0.5, 0.5, -0.5], (len(blocks), 1)))


class Unsmoothed(BlockSmoother):
    name = "none"
    predictive = False

    def predict(self, sums):
        return np.empty((*sums.shape[:-1], 0))

    def _prediction_terms(self, blocks, partition):
        raise NotImplementedError("'none' has no prediction")

    def prefix_terms(self, blocks, offsets, lengths, partition=0):
        share = offsets / lengths
        return np.stack([blocks + 1, blocks], axis=1), np.stack([share, 1.0 - share], axis=1)


def make_smoother(name: str, *, block: int, initial_sum: float | np.ndarray, window: int,
                  alpha: float) -> BlockSmoother:
    """The smoother ``name`` (one of :data:`SMOOTHERS`; validated by the caller).

    Examples
    --------
    >>> smoother = make_smoother("mean", block=4, initial_sum=8.0, window=1, alpha=1.0)
    >>> smoother.first_prediction, smoother.predict(np.array([4.0, 12.0])).tolist()
    (2.0, [1.0, 2.0])
    """
    if name == "moving":
        return Moving(block, initial_sum, window)
    if name == "exponential":
        return Exponential(block, initial_sum, alpha)
    return {"recent": Recent, "mean": Mean, "median": Median, "none": Unsmoothed}[name](block, initial_sum)


def prefix_terms_of(terms: dict):
    """The ``prefix_terms(blocks, offsets, lengths)`` function :meth:`BlockSmoother.partition_terms`
    described (for error models read back from a release record)."""
    smoother = make_smoother(terms["name"], block=terms["block"], initial_sum=0.0, window=terms.get("window", 1),
                             alpha=terms.get("alpha", 1.0))
    if "positions" in terms:
        smoother._positions = [[(int(a), int(b)) for a, b in np.asarray(terms["positions"]).reshape(-1, 2)]]
    return functools.partial(smoother.prefix_terms, partition=0)


def _exponential_filter(values: np.ndarray, alpha: float, state: dict) -> np.ndarray:
    """``y_j = alpha * x_j + (1 - alpha) * y_{j-1}``, vectorised along the last axis, continuing
    from ``state`` (updated in place): ``count`` values filtered so far, ``piece_start`` the output
    before the current piece, ``partial`` the piece's running sum.

    Closed form ``y_j = d^(j+1) (y_start + alpha * sum_{i<=j} x_i d^-(i+1))`` (``d = 1 - alpha``)
    within pieces short enough that ``d^-len`` stays below 1e100; the absolute rounding error
    stays about 1e-16 of the inputs. Pieces sit at fixed stream positions and their running sums
    are carried between calls and accumulated left to right, so a stream fed in any chunks
    gives bit-identical outputs.
    """
    decay = 1.0 - alpha
    if decay == 0.0:
        state["count"] += values.shape[-1]
        return np.array(values, dtype=np.float64)
    piece = max(1, int(100 / -math.log10(decay)))
    out = np.empty(values.shape, dtype=np.float64)
    at = 0
    while at < values.shape[-1]:
        offset = state["count"] % piece
        take = min(piece - offset, values.shape[-1] - at)
        powers = decay ** np.arange(offset + 1, offset + take + 1, dtype=np.float64)
        x = values[..., at:at + take] / powers
        running = np.add.accumulate(np.concatenate([state["partial"][..., None], x], axis=-1), axis=-1)[..., 1:]
        out[..., at:at + take] = powers * (state["piece_start"][..., None] + alpha * running)
        state["count"] += take
        if offset + take == piece:
            state["piece_start"], state["partial"] = out[..., at + take - 1].copy(), np.zeros(running.shape[:-1])
        else:
            state["partial"] = running[..., -1].copy()
        at += take
    return out
