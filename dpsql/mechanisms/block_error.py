"""The error model of a hierarchy's block release: exact noise variances of range sums and
the bound on what spreading a block's sum over its rows can be off.
"""

from __future__ import annotations

import functools

import numpy as np

from dpsql.error_models import ErrorModel
from dpsql.mechanisms.calendar import CalendarChunks, Tree
from dpsql.mechanisms.hierarchy import Chunk, Forest, leaf_interval_variance
from dpsql.mechanisms.smoothers import prefix_terms_of
from dpsql.timegrid import RowGrid


def spreading_bound(start_offset, start_length, stop_offset, stop_length, same_block, bound: float) -> np.ndarray:
    """The most a flat spread can be off on range sums, for values in ``[0, bound]``: a range
    from offset ``start_offset`` of a block of ``start_length`` rows to offset ``stop_offset``
    of a block of ``stop_length`` rows.

    A block of ``len`` rows whose sum ``S`` is spread evenly gives a run of ``k`` of its rows
    ``k S / len`` where the values had ``S_k``; with ``S = S_k + S_rest``,
    ``k S / len - S_k = (k S_rest - (len - k) S_k) / len`` and ``S_k`` in ``[0, k bound]``,
    ``S_rest`` in ``[0, (len - k) bound]``: at most ``k (len - k) bound / len`` either way
    (reached with all the block's mass inside the run, or all outside). A range that cuts two
    blocks carries one such run from each, whose errors depend on different values: their
    bounds add up. A range inside one block is one run of ``stop_offset - start_offset`` rows.
    Bounds the error exactly (every bound is reached by some values).

    >>> spreading_bound(np.array([6, 6]), 24.0, np.array([18, 12]), 24.0, np.array([True, False]), 1.0).tolist()
    [6.0, 10.5]
    """
    def run(rows, length):
        return rows * (length - rows) / length

    inside = run(np.asarray(stop_offset) - start_offset, start_length)
    return bound * np.where(same_block, inside, run(start_offset, start_length) + run(stop_offset, stop_length))


class BlockStreamNoise(ErrorModel):
    """Noise of range sums of a stream released block by block from consecutive forests.

    Rows form blocks of ``block`` values; a block's noisy sum is released with its last row.
    Values were clipped to ``[0, bound]`` (shifted by the public lower bound).
    ``smoother`` describes the block smoother (:meth:`~dpsql.mechanisms.smoothers.BlockSmoother.partition_terms`).
    Rows of an incomplete last block carry predictions only, unless ``short_last_block`` (a
    one-shot release with the unpredictive ``none`` smoother, which releases that block's
    partial sum). Chunks of ``chunk_blocks`` blocks each get their own forest with
    independent noise.
    ``prefix_terms(blocks, offsets, lengths) -> (points, coefs)`` (from the smoother) writes
    the noise of the output prefix sum ``values[:x].sum()`` of row ``x`` (in block ``t`` at
    ``offset``) as ``sum_k coefs[k] * U(points[k])`` with ``U(p)`` the noise of the first ``p``
    block sums. A range sum is a difference of two prefix sums, so its variance follows from
    the variances of block intervals: for coefficients ``a_k`` summing to zero,
    ``Var(sum_k a_k U(y_k)) = -1/2 sum_{k,k'} a_k a_k' Var(U(y_k) - U(y_k'))``.

    Bias bound (:meth:`range_bias_bound`): a range end at offset ``a`` of a block of ``len``
    rows whose values lie in ``[0, bound]``. Spread evenly (``none``), the block's first
    ``a`` rows get ``a / len`` of its sum where the values had ``S_a``; ``|a S / len - S_a|``
    is at most ``a (len - a) bound / len`` (all the block's mass on one side of the cut).
    Predicted (the other smoothers), they get ``a`` times a prediction that lies in
    ``[0, bound]`` (an average of earlier blocks' means), as ``S_a`` lies in ``[0, a bound]``:
    at most ``a * bound`` apart. A range's bound adds those of its two ends (blocks apart,
    their errors are unrelated and both can reach their bounds); block boundaries add nothing.
    Spread evenly, a range of ``k`` rows inside one block is off by ``k S / len - S_k``, at most
    ``k (len - k) bound / len`` (:func:`spreading_bound`), not the sum of its two cuts. Noise in
    the prediction is in the variance, not here.
    """

    #: Queries are evaluated in batches of at most this many (query, term) or, pairwise,
    #: (query, term, term) entries, to bound memory.
    _BATCH_PAIRS = 1 << 22
    #: Above this many prefix terms per query (the exponential smoother) the pairwise
    #: evaluation, quadratic in the terms, gives way to a per-query step-function sum.
    _PAIRWISE_TERMS = 24

    def __init__(self, *, n_rows: int, block: int, chunk_blocks: int, fanout: int, levels: int,
                 node_variance: float, consistent: bool, smoother: dict, bound: float,
                 short_last_block: bool = False):
        self._n_rows = n_rows
        self._bound = bound
        self._spread = smoother["name"] == "none"
        self._block = block
        self._chunk_blocks = chunk_blocks
        self._short_last = short_last_block
        self._n_blocks = -(-n_rows // block) if short_last_block else n_rows // block
        self._interval = dict(fanout=fanout, levels=levels, node_variance=node_variance, consistent=consistent)
        self._prefix_terms = prefix_terms_of(smoother)

    # Built on the first query, not with the release: many releases (one per partition) never
    # get one.
    @functools.cached_property
    def _chunks_before(self) -> np.ndarray:
        """Noise variance of the first ``k`` chunks' block sums, for every ``k``."""
        nb = self._chunk_blocks
        n_chunks = -(-self._n_blocks // nb)
        chunk_sizes = np.minimum(nb, self._n_blocks - nb * np.arange(n_chunks))
        whole = leaf_interval_variance(np.zeros(n_chunks, dtype=np.int64), chunk_sizes, **self._interval)
        return np.concatenate([[0.0], np.cumsum(whole)])

    def _block_interval_variance(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Variance of the noise in block sums ``lo:hi`` (global block indices, ``lo <= hi``)."""
        nb = self._chunk_blocks
        first_chunk = lo // nb
        last_chunk = np.maximum(hi - 1, lo) // nb
        same = first_chunk == last_chunk
        a = lo - first_chunk * nb
        b = hi - last_chunk * nb
        within = leaf_interval_variance(a, np.where(same, b, nb), **self._interval)
        tail = leaf_interval_variance(np.zeros_like(b), np.where(same, 0, b), **self._interval)
        middle = self._chunks_before[last_chunk] - self._chunks_before[np.minimum(first_chunk + 1, last_chunk)]
        return within + np.where(same, 0.0, tail + middle)

    def _row_terms(self, rows: np.ndarray):
        chunk_rows = self._chunk_blocks * self._block
        chunk, within = np.divmod(rows, chunk_rows)
        blocks = chunk * self._chunk_blocks + within // self._block
        offsets = within % self._block
        if self._short_last:
            at_end = rows == self._n_rows
            blocks = np.where(at_end, self._n_blocks, blocks)
            offsets = np.where(at_end, 0, offsets)
        lengths = np.where(blocks == self._n_blocks - 1, self._n_rows - (self._n_blocks - 1) * self._block,
                           self._block)
        points, coefs = self._prefix_terms(blocks, offsets, lengths)
        return np.minimum(points, self._n_blocks), coefs

    def block_boundaries(self, n: int) -> np.ndarray:
        chunk_rows = self._chunk_blocks * self._block
        rows = min(n, self._n_rows)
        chunks = np.arange(0, rows, chunk_rows)
        starts = (chunks[:, None] + np.arange(0, chunk_rows, self._block)[None, :]).ravel()
        return np.unique(np.concatenate([starts[starts < rows], [rows]]))

    def range_bias_bound(self, starts, stops):
        starts, stops = np.asarray(starts, dtype=np.int64), np.asarray(stops, dtype=np.int64)
        start_block, start_offset, start_length = self._cut(starts)
        stop_block, stop_offset, stop_length = self._cut(stops)
        if self._spread:
            return spreading_bound(start_offset, start_length, stop_offset, stop_length, start_block == stop_block,
                                   self._bound)
        return (start_offset + stop_offset) * self._bound

    def _cut(self, rows: np.ndarray):
        """Where the prefix of the first ``rows`` rows ends: its block, the rows of that block
        before the cut, and the block's length (class docstring)."""
        block = self._block
        chunk_rows = self._chunk_blocks * block
        chunk, within = np.divmod(rows, chunk_rows)
        offset = (within % block).astype(np.float64)
        index = chunk * self._chunk_blocks + within // block
        last = self._n_rows - (self._n_blocks - 1) * block if self._short_last else block
        length = np.where(index == self._n_blocks - 1, last, block).astype(np.float64)
        return index, offset, length

    def range_variance(self, starts, stops):
        starts = np.asarray(starts, dtype=np.int64)
        stops = np.asarray(stops, dtype=np.int64)
        terms = 2 * self._row_terms(stops[:1])[0].shape[1] + 1  # both ends and the origin
        batch = max(1, self._BATCH_PAIRS // (terms**2 if terms <= self._PAIRWISE_TERMS else terms))
        return np.concatenate([self._batch_variance(starts[i:i + batch], stops[i:i + batch])
                               for i in range(0, len(starts), batch)] or [np.empty(0)])

    def _batch_variance(self, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
        stop_points, stop_coefs = self._row_terms(stops)
        start_points, start_coefs = self._row_terms(starts)
        points = np.concatenate([stop_points, start_points, np.zeros((len(starts), 1), dtype=np.int64)], axis=1)
        coefs = np.concatenate([stop_coefs, -start_coefs, np.zeros((len(starts), 1))], axis=1)
        coefs[:, -1] = -coefs.sum(axis=1)
        if points.shape[1] > self._PAIRWISE_TERMS:
            out = np.array([self._step_variance(p, c) for p, c in zip(points, coefs)])
        else:
            out = self._pairwise_variance(points, coefs)
        return np.maximum(out, 0.0)

    def _pairwise_variance(self, points: np.ndarray, coefs: np.ndarray) -> np.ndarray:
        """All queries at once, from the variances of the intervals between every two points."""
        lo = np.minimum(points[:, :, None], points[:, None, :])
        hi = np.maximum(points[:, :, None], points[:, None, :])
        interval = self._block_interval_variance(lo.ravel(), hi.ravel()).reshape(lo.shape)
        return -0.5 * np.einsum("qk,ql,qkl->q", coefs, coefs, interval)

    def _step_variance(self, points: np.ndarray, coefs: np.ndarray) -> float:
        """One query with many terms, in O(K log K) per level.

        The noise is ``b . u`` with the step function ``b_j = sum_{k: p_k > j} a_k``, constant
        between consecutive points (chunk starts are added as points, so no step crosses a
        chunk). Per level, ``Q_l = sum_nodes S_n^2 / f^l``: nodes inside one step of value ``V``
        contribute ``V^2 f^l`` each (a chunk's truncated last node ``(V len)^2 / f^l``); the few
        nodes with a point strictly inside are summed explicitly from the cumulative of ``b``.
        """
        nb, n_blocks = self._chunk_blocks, self._n_blocks
        inner_chunk_starts = np.arange((points.min() // nb + 1) * nb, points.max(), nb)
        p, where = np.unique(np.concatenate([points, inner_chunk_starts]), return_inverse=True)
        a = np.bincount(where, weights=np.concatenate([coefs, np.zeros(len(inner_chunk_starts))]))
        value = np.cumsum(a[::-1])[::-1][1:]  # b on [p_k, p_{k+1})
        length = np.diff(p)
        node_variance = self._interval["node_variance"]
        if not self._interval["consistent"]:
            return node_variance * float(np.sum(value**2 * length))
        cumulative = np.concatenate([[0.0], np.cumsum(value * length)])

        def b_sum_before(x):
            k = np.clip(np.searchsorted(p, x, side="right") - 1, 0, len(p) - 1)
            slope = np.where(k < len(value), np.append(value, 0.0)[k], 0.0)
            return np.where(x <= p[0], 0.0, cumulative[k] + slope * (np.minimum(x, p[-1]) - p[k]))

        seg_start, seg_end = p[:-1], p[1:]
        chunk_start = (seg_start // nb) * nb
        chunk_end = np.minimum(chunk_start + nb, n_blocks)
        point_chunk = (p // nb) * nb
        point_chunk_end = np.minimum(point_chunk + nb, n_blocks)
        fanout, levels = self._interval["fanout"], self._interval["levels"]
        kappa = Forest(fanout, levels, 1).least_squares_weights()
        total = 0.0
        for level in range(levels):
            size = fanout**level
            first = -(-(seg_start - chunk_start) // size)
            last = (seg_end - chunk_start) // size
            clean = value**2 * size * np.maximum(last - first, 0)
            truncated_start = chunk_start + ((chunk_end - chunk_start) // size) * size
            truncated = (seg_end == chunk_end) & (truncated_start < chunk_end) & (truncated_start >= seg_start)
            clean += np.where(truncated, (value * (chunk_end - truncated_start)) ** 2 / size, 0.0)
            node_start = point_chunk + ((p - point_chunk) // size) * size
            node_end = np.minimum(node_start + size, point_chunk_end)
            dirty = np.unique(node_start[(p > node_start) & (p < node_end)])
            dirty_end = np.minimum(dirty + size, np.minimum((dirty // nb) * nb + nb, n_blocks))
            sums = b_sum_before(dirty_end) - b_sum_before(dirty)
            total += kappa[level] * (clean.sum() + np.sum(sums**2) / size)
        return node_variance * total


class CalendarBlockNoise(ErrorModel):
    """Noise and spreading of range sums of a flat hierarchy over calendar blocks
    (:class:`~dpsql.mechanisms.calendar.CalendarChunks` of ``grid``, a
    :meth:`~dpsql.timegrid.RowGrid.plain` grid): ``n_rows`` rows released, the noise of the
    day, month and year nodes of variances ``level_variances``, values in ``[0, bound]``.

    Noise: the prefix sum of the first ``x`` rows is the sum of the blocks before ``x``'s block
    and the fraction ``f`` of that block's noisy sum (its rows before ``x`` over its length), so
    a range's noise is ``c . n`` over the leaves' consistent noise ``n``, ``c`` one on the
    blocks between its ends and fractions at them; its variance ``c^T C c`` with ``C`` the
    exact covariance of a year's leaves (:meth:`~dpsql.mechanisms.calendar.Tree.leaf_covariance`;
    years are independent) comes from the 2-D prefix sums of ``C`` in constant time per range
    (the rounding of the consistent noise to the lattice, at most ``gamma / 2`` per block,
    aside). Spreading: :func:`spreading_bound` on the blocks the ends cut (a calendar day, a
    month of days or a year is cut nowhere: noise alone). ``short_last_block``: a one-shot
    release's last block, cut short, was released with its rows.
    """

    def __init__(self, *, n_rows: int, grid: dict, level_variances, consistent: bool, bound: float,
                 short_last_block: bool = False):
        self._n_rows = n_rows
        self._chunks = CalendarChunks(RowGrid.of(grid))
        self._variances = tuple(float(v) for v in level_variances)
        self._consistent = consistent
        self._bound = bound
        self._short_last = short_last_block

    # Built on the first query, not with the release: many releases (one per partition) never get one.
    @functools.cached_property
    def _years(self) -> list[Chunk]:
        """The chunks up to the one holding row ``n_rows``."""
        return self._chunks.chunks_until(self._n_rows + 1)

    @functools.cached_property
    def _starts(self) -> np.ndarray:
        return np.array([c.start for c in self._years], dtype=np.int64)

    @functools.cached_property
    def _phases(self) -> np.ndarray:
        return np.array([c.phase for c in self._years], dtype=np.int64)

    @functools.cached_property
    def _years_before(self) -> np.ndarray:
        """Noise variance of the first ``k`` chunks' sums, for every ``k``."""
        return np.concatenate([[0.0], np.cumsum([self._quadratic(c.forest).total for c in self._years])])

    def _quadratic(self, tree: Tree) -> _IntervalQuadratic:
        return _interval_quadratic(tree, self._variances, self._consistent)

    def _cut(self, rows: np.ndarray):
        """Where the prefix of the first ``rows`` rows ends: its chunk, block (in the chunk),
        the rows of that block before the cut and the block's length."""
        starts, phases = self._starts, self._phases
        block = self._chunks.grid.rows_per_day
        chunk = np.searchsorted(starts, rows, side="right") - 1
        index = (rows - starts[chunk] + phases[chunk]) // block
        block_start = np.maximum(starts[chunk], starts[chunk] - phases[chunk] + index * block)
        length = np.where(index == 0, block - phases[chunk], block)
        if self._short_last and self._n_rows:
            last = self._cut_of_last_row()
            in_last = (chunk == last[0]) & (index == last[1])
            length = np.where(in_last, self._n_rows - block_start, length)
        return chunk, index, (rows - block_start).astype(np.float64), length.astype(np.float64)

    def _cut_of_last_row(self) -> tuple[int, int]:
        chunk = self._chunks.chunk_at(self._n_rows - 1)
        return chunk.index, chunk.block_of(self._n_rows - 1)

    def range_variance(self, starts, stops):
        starts, stops = np.asarray(starts, dtype=np.int64), np.asarray(stops, dtype=np.int64)
        first, first_block, first_offset, first_length = self._cut(starts)
        last, last_block, last_offset, last_length = self._cut(stops)
        first_fraction, last_fraction = first_offset / first_length, last_offset / last_length
        same = first == last
        out = np.where(same, 0.0, self._years_before[last] - self._years_before[np.minimum(first + 1, last)])
        for k in np.unique(np.concatenate([first, last])):
            quadratic = self._quadratic(self._years[k].forest)
            inside, tail, head = same & (first == k), ~same & (first == k), ~same & (last == k)
            out[inside] += quadratic(first_block[inside], first_fraction[inside], last_block[inside],
                                     last_fraction[inside])
            out[tail] += quadratic(first_block[tail], first_fraction[tail], quadratic.leaves, 0.0)
            out[head] += quadratic(0, 0.0, last_block[head], last_fraction[head])
        return np.maximum(out, 0.0)

    def range_bias_bound(self, starts, stops):
        starts, stops = np.asarray(starts, dtype=np.int64), np.asarray(stops, dtype=np.int64)
        first, first_block, first_offset, first_length = self._cut(starts)
        last, last_block, last_offset, last_length = self._cut(stops)
        return spreading_bound(first_offset, first_length, last_offset, last_length,
                               (first == last) & (first_block == last_block), self._bound)

    def block_boundaries(self, n: int) -> np.ndarray:
        rows = min(n, self._n_rows)
        starts = np.concatenate([np.maximum(c.start, c.start - c.phase + np.arange(c.blocks) * c.block)
                                 for c in self._years])
        return np.unique(np.concatenate([starts[starts < rows], [rows]]))


class _IntervalQuadratic:
    """``c^T C c`` for ``c = 1[t1, t2) - f1 e_t1 + f2 e_t2`` over the leaves of one tree (the noise
    of a range from fraction ``f1`` of leaf ``t1`` to fraction ``f2`` of leaf ``t2``), from the 2-D
    and row prefix sums of the covariance ``C``."""

    def __init__(self, covariance: np.ndarray):
        self.leaves = len(covariance)
        self._covariance = covariance
        rows = np.zeros((self.leaves, self.leaves + 1))
        np.cumsum(covariance, axis=1, out=rows[:, 1:])
        self._rows = rows
        self._blocks = np.zeros((self.leaves + 1, self.leaves + 1))
        np.cumsum(rows[:, :], axis=0, out=self._blocks[1:, :])
        self.total = float(self._blocks[-1, -1])

    def __call__(self, t1, f1, t2, f2) -> np.ndarray:
        t1, t2 = np.asarray(t1), np.asarray(t2)
        f1, f2 = np.asarray(f1, dtype=np.float64), np.asarray(f2, dtype=np.float64)
        p = self._blocks
        whole = p[t2, t2] - p[t1, t2] - p[t2, t1] + p[t1, t1]
        i1, i2 = np.minimum(t1, self.leaves - 1), np.minimum(t2, self.leaves - 1)
        f1, f2 = np.where(t1 < self.leaves, f1, 0.0), np.where(t2 < self.leaves, f2, 0.0)
        row1 = self._rows[i1, t2] - self._rows[i1, t1]
        row2 = self._rows[i2, t2] - self._rows[i2, t1]
        c = self._covariance
        return (whole + f1**2 * c[i1, i1] + f2**2 * c[i2, i2] - 2 * f1 * row1 + 2 * f2 * row2
                - 2 * f1 * f2 * c[i1, i2])


@functools.lru_cache(maxsize=64)
def _interval_quadratic(tree: Tree, variances: tuple[float, ...], consistent: bool) -> _IntervalQuadratic:
    return _IntervalQuadratic(tree.leaf_covariance(variances, consistent))
