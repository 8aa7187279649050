"""Continual counters for real values: the binary tree with a declared horizon (Dwork et al.
2010, Chan et al. 2011) and, for streams of unknown length, Chan, Shi and Song's hybrid
mechanism (ACM TISSEC 2011).

Both release the noisy prefix sums ``P(i)`` of the first ``i`` rows and output row ``i`` as
``P(i + 1) - P(i)``, so a range sum ``values[i:j].sum()`` is ``P(j) - P(i)``. Values are
clipped to the public ``[lower, upper]`` (part of the mechanism); noise is lattice Laplace
for sensitivity ``upper - lower`` (one row's value replaced), in integer lattice units, so
released values are exactly ``gamma * integer``.

**Declared horizon** (``horizon=H``): ``L = ceil(log2 H)`` levels (at least one) of dyadic
nodes of sizes ``1, 2, ..., 2**(L-1)``; every value lies in one node per level and every
node gets noise at ``epsilon / L``: ``epsilon``-DP by sequential composition over the
levels. ``P(i)`` adds the nodes of the dyadic decomposition of ``[0, i)`` (the set bits of
``i``; at the top level up to two nodes, since ``i <= 2**L``). A stream may not pass ``H``
rows (:class:`~dpsql.errors.HorizonExceeded`).

**Unbounded** (``horizon=None``, the default): rows are cut into epochs of doubling length,
epoch ``e`` holding rows ``2**e - 1 .. 2**(e+1) - 2``. Each epoch's total gets Laplace noise
at ``epsilon / 2`` once it completes (the logarithmic mechanism: every row is in one epoch),
and inside epoch ``e`` a binary tree of ``e`` levels, each at ``epsilon / (2 e)``, gives the
prefixes of the epoch not yet complete. ``P(i)`` is the noisy totals of the epochs before
``i``'s plus the tree prefix inside its epoch: ``epsilon``-DP (the two halves compose
sequentially), error ``O(log(i)**1.5 / epsilon)`` for any ``i`` without knowing the length.

Noise addresses: a horizon tree's node at level ``l`` covering rows from ``k * 2**l`` is the
draw at index ``k`` of the ``TREE`` lane at level ``l``; in epoch ``e``'s tree it is index
``2**(e - l) + k`` (disjoint ranges for distinct epochs), and epoch ``e``'s total is index
``e`` of the ``EPOCH_TOTAL`` lane. Node noise is never stored: the state is the row count.
"""

from __future__ import annotations

import numpy as np

from dpsql import _validate
from dpsql.accounting import largest_share
from dpsql.error_models import ErrorModel
from dpsql.errors import HorizonExceeded
from dpsql.mechanisms import LaplaceLattice
from dpsql.noise import Draws, Lane
from dpsql.release import StreamMachine


def tree_levels(n: int) -> int:
    """``ceil(log2 n)``, at least 1: the number of dyadic levels over ``n`` leaves."""
    return max(1, (n - 1).bit_length())


def _set_bits(values: np.ndarray, levels: int) -> np.ndarray:
    """The number of set bits of each value among its lowest ``levels`` bits."""
    count = np.zeros(values.shape, dtype=np.int64)
    for level in range(levels):
        count += (values >> level) & 1
    return count


def _symmetric_nodes(starts: np.ndarray, stops: np.ndarray, levels: int) -> np.ndarray:
    """Nodes in exactly one of the dyadic prefix decompositions of ``starts`` and ``stops``
    (trees of ``levels`` levels, the top level holding up to two nodes)."""
    top = levels - 1
    nodes = np.abs((stops >> top) - (starts >> top))
    for level in range(top):
        bit_start = (starts >> level) & 1
        bit_stop = (stops >> level) & 1
        shared = bit_start & bit_stop & ((starts >> (level + 1)) == (stops >> (level + 1)))
        nodes += bit_start + bit_stop - 2 * shared
    return nodes


class DyadicPrefixNoise(ErrorModel):
    """Noise of ``P(j) - P(i)`` for the horizon tree: the node variance times the number of
    nodes in the symmetric difference of the two prefix decompositions."""

    def __init__(self, node_variance: float, levels: int):
        self.node_variance = node_variance
        self.levels = levels

    def range_variance(self, starts, stops):
        starts = np.asarray(starts, dtype=np.int64)
        stops = np.asarray(stops, dtype=np.int64)
        return self.node_variance * _symmetric_nodes(starts, stops, self.levels)


def epoch_of(prefix: np.ndarray) -> np.ndarray:
    """The epoch of the hybrid counter that prefix length ``prefix`` ends in: ``floor(log2(prefix + 1))``."""
    prefix = np.asarray(prefix, dtype=np.int64)
    epoch = np.floor(np.log2(prefix + 1.0)).astype(np.int64)
    # float log2 may land one off near powers of two: correct it exactly
    epoch -= (np.left_shift(1, epoch) > prefix + 1).astype(np.int64)
    epoch += (np.left_shift(1, epoch + 1) <= prefix + 1).astype(np.int64)
    return epoch


class HybridPrefixNoise(ErrorModel):
    """Noise of ``P(j) - P(i)`` for the hybrid counter: the epoch totals between the two
    epochs, plus each end's tree prefix inside its epoch (the symmetric difference when both
    ends share an epoch; independent trees otherwise)."""

    def __init__(self, total_variance: float, tree_variance: np.ndarray):
        self.total_variance = total_variance
        #: node variance of epoch ``e``'s tree, for every epoch (index ``e``)
        self.tree_variance = np.asarray(tree_variance, dtype=np.float64)

    def range_variance(self, starts, stops):
        starts = np.asarray(starts, dtype=np.int64)
        stops = np.asarray(stops, dtype=np.int64)
        e_start, e_stop = epoch_of(starts), epoch_of(stops)
        local_start = starts - (np.left_shift(1, e_start) - 1)
        local_stop = stops - (np.left_shift(1, e_stop) - 1)
        levels = max(int(e_stop.max(initial=0)), 1)
        same = e_start == e_stop
        shared = _symmetric_nodes(local_start, local_stop, levels + 1)
        apart = (_set_bits(local_start, levels) * self.tree_variance[e_start]
                 + _set_bits(local_stop, levels) * self.tree_variance[e_stop])
        trees = np.where(same, shared * self.tree_variance[e_start], apart)
        return trees + (e_stop - e_start) * self.total_variance


class BinaryTreeStream(StreamMachine):
    """The binary counter as an online machine; the state is the row count (every node's
    noise is recomputed from its address when a prefix needs it).

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> with dpsql.testing.seeded(5) as keys:
    ...     machine = BinaryTreeStream(None, epsilon=1.0, upper=4.0, horizon=8, noise=keys.partition())
    ...     out = np.concatenate([machine.feed(np.full(5, 2.0)), machine.feed(np.full(3, 2.0)), machine.close()])
    >>> err = machine.describe()["error"]
    >>> float(err.range_variance(np.array([0]), np.array([7]))[0] / err.node_variance)  # [0,4)+[4,6)+[6,7)
    3.0
    """

    def __init__(self, n: int | None = None, *, epsilon: float, upper: float, lower: float = 0.0,
                 horizon: int | None = None, delta: float = 0.0, noise: Draws):
        self.epsilon = _validate.epsilon(epsilon)
        _validate.delta(delta, pure=True, method="binary_tree")
        self.lower, self.upper = _validate.bounds(lower, upper)
        self.cost = (self.epsilon, 0.0)
        bound = self.upper - self.lower
        if horizon is None:
            self.horizon = None
            self._total_epsilon = self.epsilon / 2
            self._tree_epsilon = largest_share(self.epsilon, self.epsilon - self._total_epsilon,
                                               rest=self._total_epsilon)
            self._totals = LaplaceLattice.shared(bound, self._total_epsilon)
            self._lattice = self._totals
        else:
            self.horizon = _validate.integer(horizon, "horizon", minimum=1)
            if n is not None and n > self.horizon:
                raise HorizonExceeded(f"{n} rows exceed the binary tree's declared horizon={self.horizon}")
            self.levels = tree_levels(self.horizon)
            level_epsilon = largest_share(self.epsilon, self.epsilon / self.levels, count=self.levels)
            self._lattice = LaplaceLattice.shared(bound, level_epsilon)
        self._noise = noise
        self.rows = 0

    def _epoch_lattice(self, epoch: int) -> LaplaceLattice:
        levels = max(epoch, 1)
        return LaplaceLattice.shared(self.upper - self.lower,
                                     largest_share(self._tree_epsilon, self._tree_epsilon / levels, count=levels))

    def feed(self, chunk: np.ndarray) -> np.ndarray:
        if not len(chunk):
            return np.empty(0)
        if self.horizon is not None and self.rows + len(chunk) > self.horizon:
            raise HorizonExceeded(f"{self.rows + len(chunk)} rows exceed the binary tree's declared "
                                  f"horizon={self.horizon}: nothing of this chunk was released")
        # Units of the values shifted by the public lower bound: small however far the data lie
        # from 0 (adding the bound back below is post-processing of the noisy units).
        units = self._lattice.to_units(np.clip(chunk, self.lower, self.upper) - self.lower)
        prefixes = np.arange(self.rows, self.rows + len(chunk) + 1, dtype=np.int64)
        noise = self._horizon_prefix_noise(prefixes) if self.horizon else self._hybrid_prefix_noise(prefixes)
        units += np.diff(noise)
        self.rows += len(chunk)
        released = self._lattice.from_units(units)
        released += self.lower
        return released

    def _tree_prefix_noise(self, prefixes: np.ndarray, levels: int, lattice: LaplaceLattice,
                           first_index) -> np.ndarray:
        """Noise units of the prefixes ``prefixes`` of a tree of ``levels`` levels (the top level
        holding up to two nodes); node ``(level, key)`` is the draw at index
        ``first_index(level) + key`` of the ``TREE`` lane at ``level``."""
        out = np.zeros(len(prefixes), dtype=np.int64)
        top = levels - 1
        below = prefixes >> top  # top-level nodes in each prefix: 0, 1 or 2
        if below.max() > 0:
            draws = self._node_draws(top, first_index(top), int(below.max()), lattice)
            out += np.concatenate([[0], np.cumsum(draws)])[below]
        for level in range(top):
            used = ((prefixes >> level) & 1).astype(bool)
            if used.any():
                keys = (prefixes[used] >> (level + 1)) << 1  # the left node of the pair at this level
                first = int(keys.min())
                draws = self._node_draws(level, first_index(level) + first, int(keys.max()) - first + 1, lattice)
                out[used] += draws[keys - first]
        return out

    def _node_draws(self, level: int, start: int, count: int, lattice: LaplaceLattice) -> np.ndarray:
        return lattice.noise_units(self._noise.lane(Lane.TREE, level), start, count)

    def _horizon_prefix_noise(self, prefixes: np.ndarray) -> np.ndarray:
        return self._tree_prefix_noise(prefixes, self.levels, self._lattice, lambda level: 0)

    def _hybrid_prefix_noise(self, prefixes: np.ndarray) -> np.ndarray:
        epochs = epoch_of(prefixes)
        totals = self._totals.noise_units(self._noise.lane(Lane.EPOCH_TOTAL), 0, int(epochs.max()))
        out = np.concatenate([[0], np.cumsum(totals)])[epochs]
        for epoch in np.unique(epochs).tolist():
            if epoch == 0:
                continue  # epoch 0 is one row: its only prefix inside it is empty
            rows = epochs == epoch
            local = prefixes[rows] - ((1 << epoch) - 1)
            # level-l nodes of epoch e are indexed from 2**(e - l): disjoint across epochs
            out[rows] += self._tree_prefix_noise(local, epoch, self._epoch_lattice(epoch),
                                                 lambda level, e=epoch: 1 << (e - level))
        return out

    def close(self) -> np.ndarray:
        return np.empty(0)

    def snapshot(self) -> dict:
        return {"rows": self.rows}

    def restore(self, state: dict) -> None:
        self.rows = int(state["rows"])

    def describe(self) -> dict:
        params = {"epsilon": self.epsilon, "lower": self.lower, "upper": self.upper, "horizon": self.horizon}
        if self.horizon is not None:
            params["levels"] = self.levels
            error: ErrorModel = DyadicPrefixNoise(self._lattice.variance, self.levels)
        else:
            epochs = int(epoch_of(np.array([self.rows]))[0]) + 1
            error = HybridPrefixNoise(self._totals.variance,
                                      [self._epoch_lattice(e).variance for e in range(epochs + 1)])
        return dict(method="binary_tree", params=params, error=error, components={"binary_tree": self.cost})
