"""The error model of a hierarchy's block release: exact noise variances of range sums and
the bound on what spreading a block's sum over its rows can be off.
"""

from __future__ import annotations

import functools

import numpy as np

from dpsql.error_models import ErrorModel
from dpsql.mechanisms.hierarchy import Forest, leaf_interval_variance
from dpsql.mechanisms.smoothers import prefix_terms_of


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
    at most ``a * bound`` apart. A range's bound adds those of its two ends; block
    boundaries add nothing. Spread evenly, a range of ``k`` rows also has its noise-free
    release and its clipped sum both in ``[0, k * bound]``, so its bound is at most
    ``k * bound`` (what short windows inside long blocks get: the release says nothing of
    their share of the block). Noise in the prediction is in the variance, not here.
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
        cuts = self._cut_bound(starts) + self._cut_bound(stops)
        return np.minimum(cuts, (stops - starts) * self._bound) if self._spread else cuts

    def _cut_bound(self, rows: np.ndarray) -> np.ndarray:
        """The bias bound of the prefix sum of the first ``rows`` rows (class docstring)."""
        block = self._block
        chunk_rows = self._chunk_blocks * block
        chunk, within = np.divmod(rows, chunk_rows)
        offset = (within % block).astype(np.float64)
        index = chunk * self._chunk_blocks + within // block
        last = self._n_rows - (self._n_blocks - 1) * block if self._short_last else block
        length = np.where(index == self._n_blocks - 1, last, block).astype(np.float64)
        if self._spread:
            return offset * (length - offset) / length * self._bound
        return offset * self._bound

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
