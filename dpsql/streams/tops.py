"""ToPS (ALGORITHMS.md §4): Noisy-Max threshold, online consistent fanout-16 hierarchy, smoother.

Two machines:

* :class:`HierarchyStream` (method ``"hierarchy"``) releases a stream whose values are
  clipped to a *known* public ``[lower, upper]``: the paper's ``H^c_16`` with a smoother.
* :class:`ToPS` (method ``"tops"``) first chooses the threshold privately on a hold-out prefix
  (Noisy-Max, §4.2 Phase 1), publishes the hold-out's noisy total, then runs
  :class:`HierarchyStream` on the remaining rows with ``upper = threshold``.

Hierarchy, per chunk of ``r`` values (ALGORITHMS.md 4.2 Phase 2): ``h = ceil(log_f r)`` levels,
the smoother replaces the lowest ``s`` of them (Eq. 7), so leaves are blocks of ``g = f^s``
values and the forest has ``L = h - s`` levels. A chunk holds ``g * ceil(r / g)`` rows (so
every block but the stream's last is whole) and its forest covers
``ceil(rows / (g f^(L-1)))`` complete top nodes (padding leaves are never released). The
noise forest is drawn and made consistent when the chunk's first row arrives; block sums
are released as blocks complete; rows are emitted as they arrive (the smoother's prediction
for a block is known when it starts), except with ``smoother="none"``, whose rows wait for
their block. State is one chunk's leaf noise plus the smoother's.

Privacy (replace-one-value neighbours; time order public): every value lies in one node per
level, each level gets ``epsilon / L`` with sensitivity ``upper - lower`` (the threshold for
ToPS), so each chunk is ``epsilon``-DP; chunks are disjoint (parallel composition);
consistency and smoothing are post-processing. ``HierarchyStream`` is ``epsilon``-DP. ToPS
adds the threshold and hold-out total on the disjoint hold-out (see
:mod:`dpsql.streams.holdout`) and is ``epsilon``-DP overall. Values outside
``[lower, upper]`` (or above the threshold) are clipped: that is part of the mechanism.
"""

from __future__ import annotations

import copy

import numpy as np

from dpsql import _validate
from dpsql.accounting import largest_share
from dpsql.errors import InvalidParameter
from dpsql.mechanisms.hierarchy import BlockStreamNoise, Forest, smoothing_depth, tree_height
from dpsql.mechanisms.laplace import LatticeBatch
from dpsql.mechanisms.noisy_max import NM_LEVELS, default_step, nm_thresholds
from dpsql.mechanisms.smoothers import MIN_ALPHA, SMOOTHERS, make_smoother
from dpsql.noise import Draws, DrawsBatch, Lane
from dpsql.release import StreamMachine, leading_columns
from dpsql.streams.holdout import ThresholdedStream

#: The paper's largest query range and chunk length.
PAPER_RANGE = 1 << 20


def _check_hierarchy_options(*, fanout, consistency, smoother, window, alpha):
    fanout = _validate.integer(fanout, "fanout", minimum=2)
    if not isinstance(consistency, bool):
        raise InvalidParameter(f"consistency must be True or False, got {consistency!r}")
    smoother = _validate.choice(smoother, "smoother", SMOOTHERS)
    window = _validate.integer(window, "window", minimum=1)
    alpha = _validate.real(alpha, "alpha")
    if not MIN_ALPHA <= alpha <= 1:
        raise InvalidParameter(f"alpha must satisfy {MIN_ALPHA} <= alpha <= 1, got {alpha!r}")
    return fanout, consistency, smoother, window, alpha


class HierarchyStream(StreamMachine):
    """Known-bound hierarchy with online consistency and a block smoother (method ``"hierarchy"``).

    Parameters: ``epsilon``; public bounds ``lower``/``upper`` (values are clipped to them);
    ``r`` the largest query range and chunk length (default ``2**20``, the paper's; a fixed
    default, so that a stream of unknown length has one); ``fanout`` (16); ``consistency``
    (True; False releases each leaf's own noise, so upper levels are spent but unused: the
    ablation of consistency for a per-row release); ``smoother`` (one of
    :data:`dpsql.mechanisms.smoothers.SMOOTHERS`, default ``"recent"``) with ``window`` (moving,
    default 8) and ``alpha`` (exponential, default 0.6, the reference code's; at least 0.001);
    ``depth`` overrides Eq. 7's ``s`` (``0 <= depth < h``).

    Online: a block's noisy sum is released with its last row; predictive smoothers release
    every other row when it arrives (its block's prediction is known when the block starts),
    ``smoother="none"`` holds a block's rows until it completes. At the end of a one-shot
    release the rows of an incomplete last block keep their predictions (``none``: share its
    noisy partial sum), exactly what a continual stream has released of them so far. Chunk
    ``c``'s forest is the draws ``c * nodes ..`` of the ``FOREST`` lane, so the state is the
    row count, the open block's partial sum (secret) and the smoother's state.

    Error model (:class:`dpsql.mechanisms.hierarchy.BlockStreamNoise`): every smoother except
    ``median`` is linear in the block sums, so range-sum variances are exact (the rounding of
    the consistent noise to the lattice, at most ``gamma / 2`` per block, aside); for ``median``
    they are exact given the released positions of the medians (a plug-in).

    Partitions: :meth:`for_partitions` gives the machine for ``k`` equal-length streams at
    once, each with its own upper bound (ToPS: its own threshold), lattice, draws, forests and
    smoother state; it is fed ``(k, rows)`` chunks. This machine is the case ``k = 1``: the
    same code, with a leading axis of one. Every partition's release is exactly what its own
    single stream gives.

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> with dpsql.testing.seeded(0) as keys:
    ...     machine = HierarchyStream(None, epsilon=1.0, upper=10.0, r=1024, noise=keys.partition())
    ...     out = np.concatenate([machine.feed(np.full(3000, 4.0)), machine.feed(np.full(1096, 4.0)),
    ...                           machine.close()])
    >>> out.shape, machine.describe()["params"]["block"]
    ((4096,), 16)
    """

    batchable = True
    writes_out = True

    def __init__(self, n: int | None = None, *, epsilon: float, upper: float, lower: float = 0.0,
                 r: int | None = None, fanout: int = 16, consistency: bool = True, smoother: str = "recent",
                 window: int = 8, alpha: float = 0.6, depth: int | None = None,
                 initial: float | None = None, noise: Draws):
        self.epsilon = _validate.epsilon(epsilon)
        self.lower, self.upper = _validate.bounds(lower, upper)
        self.r = PAPER_RANGE if r is None else _validate.integer(r, "r", minimum=1)
        self.fanout, self.consistency, self.smoother_name, self.window, self.alpha = _check_hierarchy_options(
            fanout=fanout, consistency=consistency, smoother=smoother, window=window, alpha=alpha)
        height = tree_height(self.r, self.fanout)
        if depth is None:
            self.depth = smoothing_depth(self.epsilon, self.r, self.fanout)
        else:
            self.depth = _validate.integer(depth, "depth", minimum=0)
            if self.depth >= height:
                raise InvalidParameter(f"depth must be < {height} (the levels a tree over r={self.r} values "
                                       f"has), got {self.depth}")
        self.block = self.fanout**self.depth
        self.levels = height - self.depth
        self.chunk_blocks = -(-self.r // self.block)
        self.chunk_rows = self.chunk_blocks * self.block
        self.forest = Forest.covering(self.chunk_blocks, self.fanout, self.levels)
        self.cost = (self.epsilon, 0.0)
        self._level_epsilon = largest_share(self.epsilon, self.epsilon / self.levels, count=self.levels)
        self._start(np.array([self.upper]), DrawsBatch([noise]), initial)

    def for_partitions(self, uppers: np.ndarray, draws: DrawsBatch,
                       initials: np.ndarray | None = None) -> HierarchyStream:
        """This machine (not yet fed) for ``len(uppers)`` equal-length partitions, partition ``j``
        clipped to ``[lower, uppers[j]]`` (public or privately released bounds above ``lower``),
        drawing from ``draws[j]``, its smoother's first guess per row ``initials[j]`` (default
        ``(uppers[j] - lower) / 2``; a value already released, such as a hold-out's mean)."""
        machine = copy.copy(self)
        machine._start(np.asarray(uppers, dtype=np.float64), draws, initials)
        return machine

    def batched(self, draws: DrawsBatch) -> HierarchyStream:
        return self.for_partitions(np.full(len(draws), self.upper), draws)

    def _start(self, uppers: np.ndarray, draws: DrawsBatch, initials) -> None:
        """Per-partition state for the upper bounds ``uppers``, nothing fed yet."""
        self._uppers = uppers
        bounds = uppers - self.lower
        self._lap = LatticeBatch(bounds, self._level_epsilon)
        self._forest_lane = draws.lane(Lane.FOREST)
        self._inverse_gamma = (1.0 / self._lap.granularity)[:, None]
        self._bound_units = bounds[:, None] * self._inverse_gamma
        guess = bounds / 2 if initials is None else np.clip(np.asarray(initials, dtype=np.float64), 0.0, bounds)
        self._initial = guess
        self._smoother = make_smoother(self.smoother_name, block=self.block, initial_sum=self.block * guess,
                                       window=self.window, alpha=self.alpha)
        self._rows = 0
        self._leaf_noise: np.ndarray | None = None
        self._noise_chunk = -1
        self._partial_units = np.zeros(len(uppers))
        self._prediction = self._smoother.first_prediction * np.ones(len(uppers))
        self._flushed = False
        self._lead = ()

    def feed(self, chunk: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        rows = chunk.reshape(len(self._uppers), -1)
        count = rows.shape[1]
        # predictive smoothers emit one output per row: written straight into one buffer (the
        # caller's, given one)
        if self._smoother.predictive:
            out = np.empty(rows.shape) if out is None else leading_columns(out, rows.shape)
        else:
            out = None
        pieces = []
        start = 0
        while start < count:
            take = min(count - start, self.chunk_rows - self._rows % self.chunk_rows)
            view = None if out is None else out[:, start:start + take]
            pieces.append(self._feed_within_chunk(rows[:, start:start + take], view))
            start += take
        if out is None:
            out = np.concatenate(pieces, axis=1) if pieces else np.empty((len(rows), 0))
        if self.lower:
            out += self.lower
        self._lead = chunk.shape[:-1]
        return out.reshape((*self._lead, -1))

    def close(self) -> np.ndarray:
        held = np.empty((len(self._uppers), 0))
        offset = self._rows % self.block
        if not self._smoother.predictive and offset:
            # a one-shot release ends inside a block: its rows share the block's noisy partial sum
            noise = self._chunk_leaf_noise()[:, (self._rows % self.chunk_rows) // self.block]
            held = np.repeat(self._lap.from_units(np.rint(self._partial_units).astype(np.int64) + noise)[:, None]
                             / offset, offset, axis=1)
            if self.lower:
                held += self.lower
            self._flushed = True
        # The machine may be kept to describe its partitions (StreamMachine.batchable): the
        # leaf noise, with the released block sums, would give the exact clipped sums.
        self._leaf_noise = self._partial_units = None
        # outputs are shaped like the inputs: (partitions, rows) chunks or one stream's rows
        return held.reshape((*self._lead, -1))

    def _chunk_leaf_noise(self) -> np.ndarray:
        """The current chunk's leaf noise, ``(partitions, chunk_blocks)`` int64 lattice units."""
        chunk = self._rows // self.chunk_rows
        if self._noise_chunk != chunk:
            if self.consistency:
                leaves = self.forest.consistent_leaf_noise(self._lap, self._forest_lane, chunk * self.forest.n_nodes)
            else:
                leaves = self._lap.noise_units(self._forest_lane, chunk * self.chunk_blocks, self.chunk_blocks)
            self._leaf_noise, self._noise_chunk = leaves[:, :self.chunk_blocks], chunk
        return self._leaf_noise

    def _feed_within_chunk(self, values: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        """Rows ``self._rows ..`` of one chunk (``values`` one row per partition): clip, sum per
        block in lattice units, release the blocks that complete, and write one output per row
        into ``out`` (``none``: return the rows of the completed blocks)."""
        g = self.block
        if self.lower:
            units = np.subtract(values, self.lower)
            units *= self._inverse_gamma
        else:
            units = np.multiply(values, self._inverse_gamma)
        np.clip(units, 0.0, self._bound_units, out=units)
        np.rint(units, out=units)
        # Chunks hold whole blocks, so blocks start at multiples of g: this piece continues
        # block b0 at ``offset`` and touches ``pieces`` blocks, all but the first and last whole.
        count = values.shape[1]
        offset = self._rows % g
        head = min(g - offset, count)
        starts = np.arange(head - g, count, g)
        starts[0] = 0
        pieces = len(starts)
        sums = np.add.reduceat(units, starts, axis=1)
        sums[:, 0] += self._partial_units
        lengths = np.full(pieces, g)
        lengths[0] = head
        lengths[-1] = count - starts[-1]
        leaf_noise = self._chunk_leaf_noise()
        first_block = (self._rows % self.chunk_rows) // g
        self._rows += count
        complete = pieces if self._rows % g == 0 else pieces - 1
        self._partial_units = np.zeros(len(sums)) if complete == pieces else sums[:, -1].copy()
        released_units = sums[:, :complete].astype(np.int64) + leaf_noise[:, first_block:first_block + complete]
        released = self._lap.from_units(released_units)
        if not self._smoother.predictive:
            return np.repeat(released / g, g, axis=1)
        predictions = np.concatenate([self._prediction[:, None], self._smoother.predict(released)], axis=1)
        self._prediction = predictions[:, complete].copy()
        _spread(predictions[:, :pieces], lengths, g, out)
        last_rows = starts[:complete] + lengths[:complete] - 1
        out[:, last_rows] = released - (g - 1) * predictions[:, :complete]
        return out

    def snapshot(self) -> dict:
        return {"rows": self._rows, "partial_units": self._partial_units, "prediction": self._prediction,
                "smoother": self._smoother.snapshot()}

    def restore(self, state: dict) -> None:
        self._rows = int(state["rows"])
        self._partial_units = np.asarray(state["partial_units"], dtype=np.float64)
        self._prediction = np.asarray(state["prediction"], dtype=np.float64)
        self._smoother.restore(state["smoother"])

    def params(self, partition: int = 0) -> dict:
        """The public parameters actually used (defaults resolved), of one partition."""
        return {"epsilon": self.epsilon, "lower": self.lower, "upper": float(self._uppers[partition]), "r": self.r,
                "fanout": self.fanout, "consistency": self.consistency, "smoother": self.smoother_name,
                **self.smoother_params(), "depth": self.depth, "block": self.block, "levels": self.levels}

    def smoother_params(self) -> dict:
        """The smoother's own public parameters (``window``, ``alpha``), the same for every partition."""
        return self._smoother.params()

    def describe(self) -> dict:
        return self.describe_partition(0)

    def describe_partition(self, partition: int) -> dict:
        error = BlockStreamNoise(n_rows=self._rows, block=self.block, chunk_blocks=self.chunk_blocks,
                                 fanout=self.fanout, levels=self.levels,
                                 node_variance=float(self._lap.variance[partition]), consistent=self.consistency,
                                 smoother=self._smoother.partition_terms(partition),
                                 short_last_block=self._flushed)
        return dict(method="hierarchy", params=self.params(partition), error=error,
                    components={"hierarchy": self.cost})


class ToPS(ThresholdedStream):
    """ToPS (method ``"tops"``): Noisy-Max threshold on the hold-out, then :class:`HierarchyStream`.

    Parameters beyond :class:`~dpsql.streams.holdout.ThresholdedStream`'s: ``r`` (default
    ``2**20``, the paper's range), ``fanout``, ``smoother``, ``window``, ``alpha`` as for the
    hierarchy, and for the threshold ``c`` (Eq. 6 constant, 60), ``step`` (candidate spacing,
    see :func:`dpsql.mechanisms.noisy_max.default_step`) and ``levels_for_nm`` (``"paper"`` or
    ``"code"``, ALGORITHMS.md 4.5.2). The threshold gets ``(1 - holdout_share) * epsilon``; its
    Eq. 6 scores use the stream phase's ``epsilon``. The smoother's first guess is the hold-out's
    released mean, clipped to ``[0, threshold]`` (already paid for; the paper's ``theta / 2``
    is a worse guess for any stream whose level is not half its threshold).
    """

    method = "tops"
    batchable = True

    def __init__(self, n: int | None = None, *, epsilon: float, upper: float, lower: float = 0.0,
                 m: int | None = None, r: int | None = None, fanout: int = 16, smoother: str = "recent",
                 window: int = 8, alpha: float = 0.6, holdout_share: float = 0.15, c: float = 60.0,
                 step: float | None = None, levels_for_nm: str = "paper", threshold: float | None = None,
                 noise: Draws):
        self.r = PAPER_RANGE if r is None else _validate.integer(r, "r", minimum=1)
        self.fanout, _, self.smoother, self.window, self.alpha = _check_hierarchy_options(
            fanout=fanout, consistency=True, smoother=smoother, window=window, alpha=alpha)
        self.c = _validate.real(c, "c", minimum=0.0, strict=True)
        bound = _validate.bounds(lower, upper)[1] - _validate.bounds(lower, upper)[0]
        self.step = default_step(bound) if step is None else _validate.real(step, "step", minimum=0.0, strict=True)
        self.levels_for_nm = _validate.choice(levels_for_nm, "levels_for_nm", NM_LEVELS)
        super().__init__(n, epsilon=epsilon, upper=upper, lower=lower, m=m, holdout_share=holdout_share,
                         threshold=threshold, noise=noise)

    def _choose_thresholds(self, holdout: np.ndarray) -> np.ndarray:
        return nm_thresholds(holdout, epsilon=self.epsilon_threshold, upper=self.bound,
                             epsilon_perturber=self.epsilon, r=self.r, fanout=self.fanout, c=self.c, step=self.step,
                             levels_for_nm=self.levels_for_nm, is_sorted=False,
                             noise=self._draws.lane(Lane.NOISY_MAX))

    def _stream_phase(self, thresholds: np.ndarray, initials: np.ndarray | None) -> StreamMachine:
        return HierarchyStream(epsilon=self.epsilon, upper=float(thresholds[0]), r=self.r, fanout=self.fanout,
                               smoother=self.smoother, window=self.window, alpha=self.alpha,
                               noise=self._draws[0]).for_partitions(thresholds, self._draws, initials)

    def _method_params(self) -> dict:
        stream = self._stream or self._stream_phase(np.array([self.bound]), None)
        return {"r": self.r, "fanout": self.fanout, "smoother": self.smoother, **stream.smoother_params(),
                "depth": stream.depth, "block": stream.block, "levels": stream.levels,
                "c": self.c, "step": self.step, "levels_for_nm": self.levels_for_nm}


def _spread(per_piece: np.ndarray, lengths: np.ndarray, block: int, out: np.ndarray) -> np.ndarray:
    """``out[:] = np.repeat(per_piece, lengths, axis=1)`` for pieces that are whole blocks except
    the first and the last, written as one broadcast over a (partitions, blocks, block) view
    (faster than repeat)."""
    head = int(lengths[0])
    out[:, :head] = per_piece[:, :1]
    whole = len(lengths) - 2
    if whole > 0:
        middle = out[:, head:head + whole * block]
        middle.shape = (len(out), whole, block)  # a view: assigning the shape never copies
        middle[:] = per_piece[:, 1:-1, None]
    if len(lengths) > 1:
        out[:, head + max(whole, 0) * block:] = per_piece[:, -1:]
    return out
