"""The binary-tree continual counter (Dwork et al. 2010, Chan et al. 2011) for real
values (ALGORITHMS.md P5: fanout 2, one value per leaf).

Privacy: values are clipped to the public ``[lower, upper]`` (part of the mechanism).
There are ``L = ceil(log2 n)`` levels (at least one) of dyadic nodes of sizes
``1, 2, ..., 2**(L-1)``; every value lies in one node per level, and every node gets
Laplace noise for sensitivity ``upper - lower`` at ``epsilon / L``: ``epsilon``-DP
under replace-one-value neighbours (sequential composition over the levels).

Released values: the noisy prefix sum ``P(i)`` of the first ``i`` rows adds the nodes
of the dyadic decomposition of ``[0, i)`` (the set bits of ``i``; at the top level up
to two nodes, since ``n <= 2**L``). Row ``i`` is released as ``P(i) - P(i-1)``, so a
range sum ``values[i:j].sum()`` equals ``P(j) - P(i)`` and its noise is the sum of the
nodes in exactly one of the two decompositions. Right children below the top level
never appear in a prefix decomposition, so their noise is never drawn. Everything is
computed in int64 lattice units: released values are exactly ``gamma * integer``.
"""

from __future__ import annotations

import numpy as np

from dpsql import _validate
from dpsql.accountant import largest_share
from dpsql.mechanisms import LaplaceLattice
from dpsql.noise import NoiseSource
from dpsql.release import ErrorModel, StreamMachine


def tree_levels(n: int) -> int:
    """``ceil(log2 n)``, at least 1: the number of dyadic levels over ``n`` leaves."""
    return max(1, (n - 1).bit_length())


class DyadicPrefixNoise(ErrorModel):
    """Noise of ``P(j) - P(i)`` for the binary counter: the node variance times the
    number of nodes in the symmetric difference of the two prefix decompositions."""

    def __init__(self, node_variance: float, levels: int):
        self._node_variance = node_variance
        self._levels = levels

    def range_variance(self, starts, stops):
        starts = np.asarray(starts, dtype=np.int64)
        stops = np.asarray(stops, dtype=np.int64)
        top = self._levels - 1
        nodes = np.abs((stops >> top) - (starts >> top))
        for level in range(top):
            bit_start = (starts >> level) & 1
            bit_stop = (stops >> level) & 1
            shared = bit_start & bit_stop & ((starts >> (level + 1)) == (stops >> (level + 1)))
            nodes += bit_start + bit_stop - 2 * shared
        return self._node_variance * nodes


class BinaryTreeStream(StreamMachine):
    """Online binary counter with ``O(log n)`` state: per level below the top, the most
    recent left node's noise; at the top level, its (at most two) nodes' noise; and the
    previous row's prefix noise. Each chunk is processed with one vectorised pass per
    level.

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> with dpsql.testing.seeded(5) as source:
    ...     machine = BinaryTreeStream(8, epsilon=1.0, upper=4.0, noise=source)
    ...     out = np.concatenate([machine.feed(np.full(5, 2.0)), machine.feed(np.full(3, 2.0)), machine.close()])
    >>> err = machine.describe()["error"]
    >>> float(err.range_variance(np.array([0]), np.array([7]))[0] / machine.node_variance)  # [0,4)+[4,6)+[6,7)
    3.0
    """

    def __init__(self, n: int, *, epsilon: float, upper: float, lower: float = 0.0, delta: float = 0.0,
                 noise: NoiseSource):
        self.epsilon = _validate.epsilon(epsilon)
        _validate.delta(delta, pure=True, method="binary_tree")
        self.lower, self.upper = _validate.bounds(lower, upper)
        self.n = _validate.integer(n, "n", minimum=1)
        self.cost = (self.epsilon, 0.0)
        self.levels = tree_levels(self.n)
        level_epsilon = largest_share(self.epsilon, self.epsilon / self.levels, count=self.levels)
        self._lap = LaplaceLattice(sensitivity=self.upper - self.lower, epsilon=level_epsilon)
        self._noise = noise
        self._rows = 0
        self._previous_prefix_noise = 0
        # Left node k of level l covers rows [2k * 2**l, (2k+1) * 2**l); key -1 is "none yet".
        self._last_key = [-1] * (self.levels - 1)
        self._last_node_noise = [0] * (self.levels - 1)
        self._top_noise: list[int] = []

    @property
    def node_variance(self) -> float:
        """Exact noise variance of one node, in data units."""
        return self._lap.variance

    def feed(self, chunk: np.ndarray) -> np.ndarray:
        if not len(chunk):
            return np.empty(0)
        # Units of the values shifted by the public lower bound: small however far the data lie
        # from 0 (adding the bound back below is post-processing of the noisy units).
        units = self._lap.to_units(np.clip(chunk, self.lower, self.upper) - self.lower)
        prefix = np.arange(self._rows + 1, self._rows + len(chunk) + 1, dtype=np.int64)
        prefix_noise = self._top_level_noise(prefix >> (self.levels - 1))
        shifted, bit, node = (np.empty_like(prefix) for _ in range(3))  # reused by every level
        for level in range(self.levels - 1):
            np.right_shift(prefix, level, out=shifted)
            np.bitwise_and(shifted, 1, out=bit)
            shifted >>= 1  # the key of the left node at this level
            last_key = int(shifted[-1])
            # Index 0 holds the last node seen before this chunk; new keys follow it.
            nodes = np.concatenate([[self._last_node_noise[level]],
                                    self._lap.noise_units(self._noise, last_key - self._last_key[level])])
            shifted -= self._last_key[level]
            np.take(nodes, shifted, out=node)
            node *= bit
            prefix_noise += node
            self._last_key[level] = last_key
            self._last_node_noise[level] = int(nodes[-1])
        units += np.diff(prefix_noise, prepend=self._previous_prefix_noise)
        self._previous_prefix_noise = int(prefix_noise[-1])
        self._rows += len(chunk)
        released = self._lap.from_units(units)
        released += self.lower
        return released

    def _top_level_noise(self, top_nodes: np.ndarray) -> np.ndarray:
        """Noise of the first ``top_nodes`` (0, 1 or 2) top-level nodes, per prefix."""
        missing = int(top_nodes[-1]) - len(self._top_noise)
        if missing > 0:
            self._top_noise += [int(z) for z in self._lap.noise_units(self._noise, missing)]
        cumulative = np.cumsum([0, *self._top_noise], dtype=np.int64)
        return cumulative[top_nodes]

    def close(self) -> np.ndarray:
        return np.empty(0)

    def describe(self) -> dict:
        return dict(method="binary_tree",
                    params={"epsilon": self.epsilon, "lower": self.lower, "upper": self.upper, "levels": self.levels},
                    error=DyadicPrefixNoise(self._lap.variance, self.levels), components={"binary_tree": self.cost})
