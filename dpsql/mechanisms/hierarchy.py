"""The fanout-f forest over block sums (ALGORITHMS.md P5) and Hay et al.'s consistency (P6).

Privacy cost (stated where it is defined): a forest of ``L`` levels over block sums of
values clipped to ``[0, theta]`` puts every value in exactly one node per level, so the
vector of all node sums has L1 sensitivity ``L * theta`` under replace-one-value
neighbours. Node noise from ``LaplaceLattice(theta, epsilon / L)`` (``epsilon / L`` per
level, sequential composition) makes the whole forest ``epsilon``-DP; consistency is
post-processing.

Online consistency (ToPS App. C): the forest's true node values are consistent by
construction, and Hay's estimator is linear, so ``consistent(T + N) = T + consistent(N)``.
The noise forest is therefore drawn and made consistent when a chunk starts, and only its
leaf noise is kept and added to the block sums as they complete. Released leaves are
``gamma * (round(true / gamma) + rint(consistent noise / gamma))``: the true block sums are
rounded to the lattice value by value (integer sums are exact), and rounding the consistent
noise back to integer lattice units is post-processing of the noisy integer forest, so
every released block sum lies on the lattice ``gamma * Z``.

Hay's weights assume complete f-ary trees with i.i.d. node noise ([!] in P6), so a forest
always covers whole top nodes: leaves past the real ones are padding with true value 0 and
are never released.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from dpsql.mechanisms.laplace import LaplaceLattice, LatticeBatch
from dpsql.mechanisms.smoothers import prefix_terms_of
from dpsql.noise import BatchLaneDraws, LaneDraws
from dpsql.release import ErrorModel


def tree_height(r: int, fanout: int) -> int:
    """``ceil(log_fanout r)`` computed in integers, at least 1: the levels a tree over ``r`` values needs.

    >>> tree_height(2**20, 16), tree_height(2**20 + 1, 16), tree_height(1, 16)
    (5, 6, 1)
    """
    height, span = 1, fanout
    while span < r:
        height, span = height + 1, span * fanout
    return height


# Cached: a partitioned release builds one hierarchy per partition with the same public parameters.
@functools.lru_cache(maxsize=256)
def smoothing_depth(epsilon: float, r: int, fanout: int) -> int:
    """ToPS Eq. 7: the number ``s`` of lowest levels the smoother replaces (discrete argmin).

    ``s = argmin_{s in 0..h-1} 2 (fanout - 1) (h - s)^3 / epsilon^2 + fanout^(2 s) / 36`` with
    ``h = ceil(log_fanout r)``; the threshold's square cancels. The reference code's continuous
    ``fmin`` picks s = 3 at epsilon = 0.05 where this picks 2 (ALGORITHMS.md 4.5.3).

    >>> [smoothing_depth(e, 2**20, 16) for e in (0.01, 0.02, 0.05, 0.1)]
    [3, 3, 2, 2]
    """
    h = tree_height(r, fanout)
    s = np.arange(h)
    cost = 2.0 * (fanout - 1) * (h - s).astype(np.float64) ** 3 / epsilon**2 + np.float64(fanout) ** (2 * s) / 36.0
    return int(np.argmin(cost))


@dataclass(frozen=True)
class Forest:
    """``roots`` complete ``fanout``-ary trees of ``levels`` levels over ``roots * fanout**(levels-1)`` leaves.

    Node values are lists indexed by level, level 0 holding the leaves; level ``l`` has
    ``roots * fanout**(levels-1-l)`` nodes, each the sum of ``fanout**l`` leaves.
    """

    fanout: int
    levels: int
    roots: int

    @classmethod
    def covering(cls, n_leaves: int, fanout: int, levels: int) -> Forest:
        """The smallest forest of whole top nodes over at least ``n_leaves`` leaves."""
        return cls(fanout, levels, max(1, -(-n_leaves // fanout ** (levels - 1))))

    @property
    def n_leaves(self) -> int:
        return self.roots * self.fanout ** (self.levels - 1)

    def level_sizes(self) -> list[int]:
        return [self.roots * self.fanout ** (self.levels - 1 - level) for level in range(self.levels)]

    def aggregate(self, leaves: np.ndarray) -> list[np.ndarray]:
        """Every level's node sums over ``leaves`` (zero-padded to the forest's leaf count)."""
        padded = np.zeros(self.n_leaves, dtype=np.float64)
        padded[: len(leaves)] = leaves
        nodes = [padded]
        for _ in range(1, self.levels):
            nodes.append(nodes[-1].reshape(-1, self.fanout).sum(axis=1))
        return nodes

    def consistent(self, nodes: list[np.ndarray]) -> list[np.ndarray]:
        """Hay et al.'s least-squares consistent estimate of every level from noisy ``nodes``.

        Bottom-up weighted averages ``z``, then top-down: each parent's correction is
        computed from its children's *bottom-up* values before any child changes
        (the [!] pitfall of P6) and shared equally among the children. Node arrays may have
        leading axes (one forest per partition), the nodes being the last axis.

        Examples
        --------
        >>> forest = Forest(fanout=2, levels=2, roots=1)
        >>> leaves, root = forest.consistent([np.array([1.0, 2.0]), np.array([6.0])])
        >>> leaves.tolist(), root.tolist()  # least squares: each leaf moves by (6 - 3) / 3
        ([2.0, 3.0], [5.0])
        """
        f = self.fanout
        z = [np.asarray(nodes[0], dtype=np.float64)]
        lead = z[0].shape[:-1]
        children = [None]  # children[l]: sums of the bottom-up z of the children of level-l nodes
        for level in range(1, self.levels):
            height = level + 1
            children.append(z[-1].reshape((*lead, -1, f)).sum(axis=-1))
            z.append(((f**height - f ** (height - 1)) * np.asarray(nodes[level], dtype=np.float64)
                      + (f ** (height - 1) - 1) * children[level]) / (f**height - 1))
        out = [z[-1]]
        for level in range(self.levels - 1, 0, -1):
            correction = (out[0] - children[level]) / f
            out.insert(0, (z[level - 1].reshape((*lead, -1, f)) + correction[..., None]).reshape((*lead, -1)))
        return out

    @property
    def n_nodes(self) -> int:
        return sum(self.level_sizes())

    def consistent_leaf_noise(self, lap: LaplaceLattice | LatticeBatch, noise: LaneDraws | BatchLaneDraws,
                              start: int) -> np.ndarray:
        """Online consistency: the noise forest (node ``k``, counted level by level from the
        leaves, is the draw at ``start + k``), made consistent, its leaves rounded back to
        integer lattice units (int64). With a :class:`LatticeBatch` every partition gets its
        own forest on its own lattice, from its own draws: ``(partitions, n_leaves)``.
        """
        sizes = self.level_sizes()
        draws = np.split(lap.noise_units(noise, start, sum(sizes)).astype(np.float64), np.cumsum(sizes[:-1]),
                         axis=-1)
        return np.rint(self.consistent(draws)[0]).astype(np.int64)

    def least_squares_weights(self) -> np.ndarray:
        """``kappa_l`` with ``(A^T A)^{-1} = sum_l kappa_l B_l`` (``B_l`` averages over level-l nodes).

        From ``A^T A = sum_l lam_l P_l``, ``lam_l = sum_{k<=l} f^k``, ``P_l = B_l - B_{l+1}``:
        ``kappa_0 = 1`` and ``kappa_l = 1/lam_l - 1/lam_{l-1}``.
        """
        lam = np.cumsum(np.float64(self.fanout) ** np.arange(self.levels))
        inverse = 1.0 / lam
        return np.diff(inverse, prepend=0.0)


def leaf_interval_variance(starts, stops, *, fanout: int, levels: int, node_variance: float,
                           consistent: bool = True) -> np.ndarray:
    """Noise variance of the sum of leaves ``starts:stops`` of one forest (vectorised).

    With consistency, for leaf weights ``c`` (here the interval's indicator)
    ``Var(c . x_hat) = s2 * sum_l kappa_l * Q_l`` with ``Q_l = sum_{level-l nodes b} (sum_{k in b} c_k)^2 / f^l``
    (see :meth:`Forest.least_squares_weights`); an interval overlaps whole nodes plus at
    most two partial ones per level. Without consistency leaves carry independent noise.
    Leaf indices count from the forest's first leaf.

    Examples
    --------
    >>> # two leaves under one root (fanout 2): each leaf 2/3, the pair 2/3 of the raw variance
    >>> leaf_interval_variance(np.array([0, 0]), np.array([1, 2]), fanout=2, levels=2, node_variance=1.0)
    array([0.66666667, 0.66666667])
    """
    starts = np.asarray(starts, dtype=np.int64)
    stops = np.asarray(stops, dtype=np.int64)
    if not consistent:
        return node_variance * (stops - starts).astype(np.float64)
    kappa = Forest(fanout, levels, 1).least_squares_weights()
    total = np.zeros(np.broadcast(starts, stops).shape, dtype=np.float64)
    for level in range(levels):
        size = fanout**level
        first_whole = -(-starts // size)
        last_whole = stops // size
        head = (first_whole * size - starts).astype(np.float64)
        tail = (stops - last_whole * size).astype(np.float64)
        spread = (head**2 + tail**2) / size + (last_whole - first_whole) * float(size)
        inside = ((stops - starts).astype(np.float64)) ** 2 / size
        total += kappa[level] * np.where(first_whole <= last_whole, spread, inside)
    return node_variance * total



class BlockStreamNoise(ErrorModel):
    """Noise of range sums of a stream released block by block from consecutive forests.

    Rows form blocks of ``block`` values; a block's noisy sum is released with its last row.
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
    """

    #: Queries are evaluated in batches of at most this many (query, term) or, pairwise,
    #: (query, term, term) entries, to bound memory.
    _BATCH_PAIRS = 1 << 22
    #: Above this many prefix terms per query (the exponential smoother) the pairwise
    #: evaluation, quadratic in the terms, gives way to a per-query step-function sum.
    _PAIRWISE_TERMS = 24

    def __init__(self, *, n_rows: int, block: int, chunk_blocks: int, fanout: int, levels: int,
                 node_variance: float, consistent: bool, smoother: dict, short_last_block: bool = False):
        self._n_rows = n_rows
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
