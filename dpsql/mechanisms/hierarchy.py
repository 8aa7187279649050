"""The fanout-f forest over block sums and Hay et al.'s consistency (VLDB 2010), with the block-length
rules and the chunk layouts of the hierarchy (docs/algorithms.md, "hierarchy").

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
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from dpsql.accounting import largest_share
from dpsql.mechanisms.laplace import LaplaceLattice, LatticeBatch
from dpsql.noise import BatchLaneDraws, LaneDraws


def tree_height(r: int, fanout: int) -> int:
    """``ceil(log_fanout r)`` computed in integers, at least 1: the levels a tree over ``r`` values needs.

    >>> tree_height(2**20, 16), tree_height(2**20 + 1, 16), tree_height(1, 16)
    (5, 6, 1)
    """
    height, span = 1, fanout
    while span < r:
        height, span = height + 1, span * fanout
    return height


#: Eq. 7's bias coefficient for predictive smoothers (the paper's): a range end inside a block
#: is predicted from the block before, ``E[err^2] ~ g^2 / 36`` in units of the squared drift
#: per block and threshold.
PREDICTIVE_BIAS = 36.0
#: The same coefficient for the flat spread. Under a linear drift of ``d`` per block, a range
#: end at offset ``u = a / g`` of a block is off by ``g d u (1 - u) / 2`` when the block's sum
#: is spread evenly, against ``g d (u + u^2) / 2`` when it is predicted from the block before
#: (``recent``); for ``u`` uniform, ``E[err^2]`` is ``g^2 d^2 / 120`` against
#: ``0.258 g^2 d^2``: 31 times smaller, hence ``36 * 31``.
FLAT_BIAS = 36.0 * 31
#: The largest block the flat rule picks: no released row waits for more than this many later rows.
MAX_FLAT_BLOCK = 1 << 13
#: Geometric chunks (the layout without a declared range): chunk ``k`` covers
#: ``FIRST_CHUNK * CHUNK_GROWTH**k`` rows, so its forest spans about the stream's length so far.
FIRST_CHUNK = 1 << 12
CHUNK_GROWTH = 16


def _convex_argmin(derivative, low: float, high: float) -> float:
    """The minimiser on ``[low, high]`` of a convex function, by bisection on its ``derivative``."""
    if derivative(low) >= 0:
        return low
    if derivative(high) <= 0:
        return high
    for _ in range(200):
        middle = 0.5 * (low + high)
        low, high = (middle, high) if derivative(middle) < 0 else (low, middle)
    return 0.5 * (low + high)


# Cached: a partitioned release builds one hierarchy per partition with the same public parameters.
@functools.lru_cache(maxsize=256)
def predictive_depth(epsilon: float, r: int, fanout: int) -> int:
    """ToPS Eq. 7 for predictive smoothers: the number ``s`` of lowest levels the smoother
    replaces (blocks of ``fanout**s`` rows).

    The continuous minimiser of ``2 (f - 1) (H - s)^3 / epsilon^2 + f^(2 s) / 36`` over real
    ``s`` in ``[0, H]``, ``H = log_f r``, rounded to the nearest integer and kept below
    ``ceil(log_f r)`` (the threshold's square multiplies both terms and cancels). This is the
    rule of the paper's reference code; minimising over integers instead picks ``s = 2``
    where the continuous minimum is 2.55 (epsilon 0.05, r = 2**20), which measured about
    twice the range-sum error (BENCHMARKS.md).

    >>> [predictive_depth(e, 2**20, 16) for e in (0.01, 0.05, 0.1, 0.5, 1.0)]
    [3, 3, 2, 2, 2]
    """
    log_f = math.log(fanout)
    height = math.log(r) / log_f
    a = 2.0 * (fanout - 1) / epsilon**2

    def derivative(s):
        return -3.0 * a * (height - s) ** 2 + 2.0 * log_f / PREDICTIVE_BIAS * math.exp(2.0 * s * log_f)

    s = round(_convex_argmin(derivative, 0.0, height))
    return int(min(max(s, 0), tree_height(r, fanout) - 1))


@functools.lru_cache(maxsize=256)
def flat_block(epsilon: float, r: int, fanout: int) -> int:
    """The block length of a flat-spread hierarchy over chunks of ``r`` rows.

    Eq. 7 with the flat spread's bias term (:data:`FLAT_BIAS`), over the block length ``x``
    itself: ``x* = argmin 2 (f - 1) log_f(r / x)^3 / epsilon^2 + x^2 / 1116`` (convex in
    ``ln x``), rounded to the nearest power of two (not of ``f``: a power of 16 makes the
    choice jump sixteenfold between neighbouring epsilons) and kept in
    ``[1, min(r, MAX_FLAT_BLOCK)]``. Depends on public parameters only.

    >>> [flat_block(e, 2**16, 16) for e in (0.01, 0.05, 0.1, 0.5, 1.0)]
    [8192, 4096, 2048, 512, 256]
    """
    log_f = math.log(fanout)
    log_r = math.log(r)
    a = 2.0 * (fanout - 1) / epsilon**2

    def derivative(y):
        return -3.0 * a * ((log_r - y) / log_f) ** 2 / log_f + 2.0 * math.exp(2.0 * y) / FLAT_BIAS

    x = math.exp(_convex_argmin(derivative, 0.0, log_r))
    return int(min(max(2 ** round(math.log2(x)), 1), r, MAX_FLAT_BLOCK))


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


@dataclass(frozen=True)
class Chunk:
    """Rows ``start .. start + rows`` of a stream: one forest (a :class:`Forest`, or a calendar
    :class:`~dpsql.mechanisms.calendar.Tree`) over blocks of ``block`` rows. The first block
    lacks its first ``phase`` rows (a stream that starts mid-day); ``phase + rows`` is a whole
    number of blocks."""

    index: int
    start: int
    rows: int
    block: int
    forest: Forest | Any
    phase: int = 0

    @property
    def blocks(self) -> int:
        return -(-(self.rows + self.phase) // self.block)

    def block_of(self, row: int) -> int:
        """The block (counted in the chunk) holding stream row ``row``."""
        return (row - self.start + self.phase) // self.block

    def block_start(self, index: int) -> int:
        """The stream row where the chunk's block ``index`` starts."""
        return max(self.start, self.start - self.phase + index * self.block)

    def block_length(self, index: int) -> int:
        """Rows of the chunk's block ``index`` (the first one short by ``phase``)."""
        return self.block - (self.phase if index == 0 else 0)

    @property
    def stop(self) -> int:
        return self.start + self.rows


class Layout:
    """How a hierarchy cuts a stream into chunks, each with its own forest and block length.

    ``r`` given: every chunk covers ``r`` rows (rounded up to whole blocks), the paper's
    layout. ``r=None``: geometric chunks of ``FIRST_CHUNK * CHUNK_GROWTH**k`` rows, so that
    a stream of unknown length gets, at any length, a forest spanning about that length
    (a fixed chunk either wastes levels on short streams or cuts long ranges into many
    chunk totals). ``block`` given: every chunk's block; ``None``: each chunk's
    :func:`flat_block` for its own length, at most ``max_block`` rows (a stream's ``max_delay``:
    a block's rows wait for its last one). Everything here is a function of public
    parameters. (Rows on a regular clock get calendar chunks instead:
    :class:`~dpsql.mechanisms.calendar.CalendarLayout`.)

    Examples
    --------
    >>> layout = Layout(epsilon=1.0, fanout=16)
    >>> [(c.start, c.rows, c.block, c.forest.levels) for c in layout.chunks_until(70_000)]
    [(0, 4096, 128, 2), (4096, 65536, 256, 2), (69632, 1048576, 512, 3)]
    >>> layout.chunk_at(4096).index, Layout(epsilon=1.0, fanout=16, r=1000, block=16).chunk(3).start
    (1, 3024)
    """

    #: Row-count layouts have no calendar units.
    units = None

    def __init__(self, *, epsilon: float, fanout: int, r: int | None = None, block: int | None = None,
                 max_block: int | None = None):
        self.epsilon, self.fanout, self.r, self.block, self.max_block = epsilon, fanout, r, block, max_block
        self._chunks: list[Chunk] = []

    @property
    def geometric(self) -> bool:
        return self.r is None

    def chunk(self, k: int) -> Chunk:
        if not self._chunks:
            self._chunks.append(self._make(0))
        if not self.geometric:  # every chunk is the first, moved
            first = self._chunks[0]
            return first if k == 0 else Chunk(k, k * first.rows, first.rows, first.block, first.forest)
        while len(self._chunks) <= k:
            self._chunks.append(self._make(len(self._chunks)))
        return self._chunks[k]

    def _make(self, k: int) -> Chunk:
        span = FIRST_CHUNK * CHUNK_GROWTH**k if self.geometric else self.r
        block = flat_block(self.epsilon, span, self.fanout) if self.block is None else self.block
        if self.max_block is not None:  # a stream's max_delay: a block's rows wait for its last one
            block = min(block, self.max_block)
        blocks = -(-span // block)
        levels = tree_height(blocks, self.fanout)
        start = self._chunks[-1].stop if k else 0
        return Chunk(k, start, blocks * block, block, Forest.covering(blocks, self.fanout, levels))

    def level_epsilons(self, chunk: Chunk) -> tuple[float, ...]:
        """The budget of each level of ``chunk``'s forest: ``epsilon / levels`` each, never adding
        up to more than ``epsilon``."""
        levels = chunk.forest.levels
        return (largest_share(self.epsilon, self.epsilon / levels, count=levels),) * levels

    def chunk_at(self, row: int) -> Chunk:
        """The chunk holding row ``row``."""
        if not self.geometric:
            return self.chunk(row // self.chunk(0).rows)
        k = 0
        while self.chunk(k).stop <= row:
            k += 1
        return self.chunk(k)

    def chunks_until(self, rows: int) -> list[Chunk]:
        """The chunks that hold rows ``0 .. rows - 1``."""
        return [self.chunk(k) for k in range(self.chunk_at(rows - 1).index + 1)] if rows else []


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
