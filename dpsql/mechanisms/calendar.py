"""Calendar-aligned hierarchies: blocks of one day, tree levels of months and years, for rows on a
regular clock (:class:`~dpsql.timegrid.RowGrid`); docs/algorithms.md, "hierarchy".

Layout (:class:`CalendarLayout`): chunk ``k`` holds the rows of the ``k``-th calendar year (UTC)
from the first key's, the first one from the first row. A chunk's blocks are its days (a day's
rows, ``86400 s / step`` of them; the first day of a stream that starts mid-day has fewer: the
chunk's ``phase`` counts the rows it lacks; for daily rows a block is one row), its tree has
three levels: days, months (28 to 31 days, the first and last months of a stream partial) and
the year. A daily, monthly or yearly total is then one node, a weekly total seven: their
intervals are the noise alone. The layout is a function of the grid, ``epsilon`` and ``calendar``:
public.

Budget: level ``l`` gets ``epsilon * share_l`` (:data:`LEVEL_SHARES`, exact sums never above
``epsilon``). Privacy: every value lies in one day, one month and one year node of its chunk
(sensitivity ``theta`` each), so the tree is ``epsilon``-DP by sequential composition; years
are disjoint (parallel composition); consistency and spreading are post-processing.

Consistency (:meth:`Tree.consistent`): the least-squares (minimum-variance linear unbiased)
estimate of the leaves from every node, for unequal fan-outs and a noise variance per level,
by the two-pass estimator: bottom up, each node's estimate from its subtree, the inverse-variance
weighted mean of its own noisy sum and its children's estimates summed; top down, each parent's
final estimate minus its children's sum shared among the children in proportion to their
variances. With equal fan-outs and variances this is Hay et al.'s estimator; it is the exact
weighted least-squares solution (``tests/mechanisms/test_forest.py`` solves it by brute force).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from dpsql.accounting import largest_share
from dpsql.mechanisms.hierarchy import Chunk
from dpsql.mechanisms.laplace import LatticeBatch
from dpsql.noise import BatchLaneDraws
from dpsql.timegrid import DAY, RowGrid

#: The calendar units of a tree's levels, leaves first.
UNITS = ("day", "month", "year")
#: Budget shares of the day, month and year levels for each ``calendar=`` choice: what the
#: release is for (docs/algorithms.md, "hierarchy", says why). ``"none"`` keeps row-count
#: blocks even on a grid (the layout best for arbitrary long ranges).
LEVEL_SHARES = {"day": (0.7, 0.2, 0.1), "month": (0.3, 0.5, 0.2), "balanced": (0.45, 0.35, 0.2)}
CALENDARS = (*LEVEL_SHARES, "none")
#: The default: daily totals (and weekly, sums of seven days).
DEFAULT_CALENDAR = "day"


def calendar_by_default(params: dict) -> bool:
    """Do a release's parameters leave its blocks to the calendar when its rows lie on a time
    grid (no grid, layout or predictive smoother given, the calendar not turned off)? Front ends
    then give each partition the grid of its order keys."""
    return (params.get("grid") is None and params.get("calendar", DEFAULT_CALENDAR) != "none"
            and all(params.get(k) is None for k in ("r", "depth", "block"))
            and params.get("smoother", "none") == "none")


def level_epsilons(epsilon: float, shares: Sequence[float]) -> tuple[float, ...]:
    """``epsilon * share`` per level, the last one lowered (by rounding only) so that the levels
    never add up to more than ``epsilon`` in exact arithmetic.

    >>> sum(map(Fraction, level_epsilons(0.3, (0.7, 0.2, 0.1)))) <= Fraction(0.3)
    True
    """
    head = [epsilon * share for share in shares[:-1]]
    spent = sum(map(Fraction, head), Fraction(0))
    rest = float(spent)
    if Fraction(rest) < spent:  # the float of the exact sum must not be below it
        rest = float(np.nextafter(rest, np.inf))
    return (*head, largest_share(epsilon, epsilon * shares[-1], rest=rest))


@dataclass(frozen=True)
class Tree:
    """A tree of unequal fan-outs over ``n_leaves`` leaves: ``groups[l - 1][j]`` is the number of
    level ``l - 1`` nodes under node ``j`` of level ``l`` (consecutive nodes, in order), level 0
    holding the leaves. Node arrays are lists indexed by level, the nodes on the last axis."""

    groups: tuple[tuple[int, ...], ...]

    @property
    def levels(self) -> int:
        return len(self.groups) + 1

    @property
    def n_leaves(self) -> int:
        return sum(self.groups[0]) if self.groups else 1

    def level_sizes(self) -> list[int]:
        return [self.n_leaves] + [len(group) for group in self.groups]

    @property
    def n_nodes(self) -> int:
        return sum(self.level_sizes())

    def _starts(self, level: int) -> np.ndarray:
        """Where each level-``level`` node's children start among the level below's nodes."""
        return np.concatenate([[0], np.cumsum(self.groups[level - 1])[:-1]]).astype(np.intp)

    def aggregate(self, leaves: np.ndarray) -> list[np.ndarray]:
        """Every level's node sums over ``leaves`` (last axis)."""
        nodes = [np.asarray(leaves, dtype=np.float64)]
        for level in range(1, self.levels):
            nodes.append(np.add.reduceat(nodes[-1], self._starts(level), axis=-1))
        return nodes

    def consistent(self, nodes: Sequence[np.ndarray], variances: Sequence) -> list[np.ndarray]:
        """The weighted least-squares estimate of every level's nodes from the noisy ``nodes``,
        level ``l``'s noise having variance ``variances[l]`` (a number, or one per leading index
        of the node arrays: one per partition). Two passes (module docstring)."""
        lead = np.shape(nodes[0])[:-1]
        sigma = [np.reshape(np.asarray(v, dtype=np.float64), (*np.shape(v), 1)) for v in variances]
        z = [np.asarray(nodes[0], dtype=np.float64)]
        v = [np.broadcast_to(sigma[0], z[0].shape)]
        child_sums, child_variances = [None], [None]
        for level in range(1, self.levels):
            starts = self._starts(level)
            child_sums.append(np.add.reduceat(z[-1], starts, axis=-1))
            child_variances.append(np.add.reduceat(v[-1], starts, axis=-1))
            own, together = sigma[level], child_variances[level]
            z.append((np.asarray(nodes[level], dtype=np.float64) * together + child_sums[level] * own)
                     / (together + own))
            v.append(np.broadcast_to(together * own / (together + own), (*lead, len(self.groups[level - 1]))))
        out = [z[-1]]
        for level in range(self.levels - 1, 0, -1):
            sizes = self.groups[level - 1]
            share = (out[0] - child_sums[level]) / child_variances[level]
            out.insert(0, z[level - 1] + v[level - 1] * np.repeat(share, sizes, axis=-1))
        return out

    def consistent_leaf_noise(self, lattices: Sequence[LatticeBatch], noise: BatchLaneDraws,
                              start: int) -> np.ndarray:
        """Online consistency: the noise tree (node ``k``, counted level by level from the leaves,
        is the draw at ``start + k``, level ``l``'s at ``lattices[l]``'s scale), made consistent,
        its leaves rounded back to integer lattice units: ``(partitions, n_leaves)`` int64. Every
        level's lattice has the same granularity (it depends on the bound only), so the levels'
        draws are in the same units."""
        draws, offset = [], start
        for lattice, size in zip(lattices, self.level_sizes()):
            draws.append(lattice.noise_units(noise, offset, size).astype(np.float64))
            offset += size
        variances = [lattice.variance / lattice.granularity**2 for lattice in lattices]
        return np.rint(self.consistent(draws, variances)[0]).astype(np.int64)

    def leaf_covariance(self, variances: Sequence[float], consistent: bool = True) -> np.ndarray:
        """The covariance of the leaves' noise after consistency, ``(A^T W A)^-1`` with ``A`` the
        tree's design matrix and ``W`` the inverse node variances (or the leaves' own variance
        without consistency)."""
        return _leaf_covariance(self, tuple(float(v) for v in variances), consistent)

    def leaf_ancestors(self, level: int) -> np.ndarray:
        """The level-``level`` node above each leaf."""
        ancestors = np.arange(self.n_leaves)
        for up in range(1, level + 1):
            ancestors = np.repeat(np.arange(len(self.groups[up - 1])), self.groups[up - 1])[ancestors]
        return ancestors


# Cached: one covariance per tree shape and level variances (partitions with one bound share it).
@functools.lru_cache(maxsize=64)
def _leaf_covariance(tree: Tree, variances: tuple[float, ...], consistent: bool) -> np.ndarray:
    if not consistent:
        return np.diag(np.full(tree.n_leaves, variances[0]))
    normal = np.diag(np.full(tree.n_leaves, 1.0 / variances[0]))
    for level in range(1, tree.levels):
        ancestors = tree.leaf_ancestors(level)
        normal += (ancestors[:, None] == ancestors[None, :]) / variances[level]
    covariance = np.linalg.inv(normal)
    covariance.setflags(write=False)
    return covariance


class CalendarChunks:
    """The chunks of the rows of ``grid``: calendar years, blocks of a day, trees of days, months
    and a year (module docstring). Geometry only: :class:`CalendarLayout` adds the budget.

    Examples
    --------
    >>> from dpsql.timegrid import DAY, RowGrid
    >>> chunks = CalendarChunks(RowGrid.of(("2023-12-30T09:00", "1h")))
    >>> [(c.start, c.rows, c.block, c.phase, c.blocks) for c in chunks.chunks_until(40)]
    [(0, 39, 24, 9, 2), (39, 8784, 24, 0, 366)]
    >>> chunks.chunk(1).forest.groups[0][:3], chunks.chunk(1).forest.groups[1]
    ((31, 29, 31), (12,))
    """

    #: Chunks differ (years of 365 or 366 days, a partial first one): listed one by one.
    geometric = True
    units = UNITS

    def __init__(self, grid: RowGrid):
        self.grid = grid
        self._first_year = _year(int(grid.day_of_row(0)))
        self._chunks: dict[int, Chunk] = {}

    def chunk(self, k: int) -> Chunk:
        if k not in self._chunks:
            self._chunks[k] = self._make(k)
        return self._chunks[k]

    def _make(self, k: int) -> Chunk:
        grid = self.grid
        next_year = _new_year(self._first_year + k + 1)
        start, stop = self._first_row_of_day(_new_year(self._first_year + k)), self._first_row_of_day(next_year)
        first_day = int(grid.day_of_row(start))
        phase = grid.rows_per_day - self._first_row_of_day(first_day + 1) + start
        months = np.arange(first_day, next_year).astype("datetime64[D]").astype("datetime64[M]")
        days_per_month = tuple(int(c) for c in np.unique(months, return_counts=True)[1])
        tree = Tree((days_per_month, (len(days_per_month),)))
        return Chunk(k, start, stop - start, grid.rows_per_day, tree, phase)

    def _first_row_of_day(self, day: int) -> int:
        """:meth:`~dpsql.timegrid.RowGrid.first_row_of_day` in Python integers (no int64 overflow
        at the end of representable time), at most one past the grid's last row."""
        offset = day * DAY - self.grid.first
        return min(max(-(-offset // self.grid.step), 0), self.grid.last_row + 1)

    def chunk_at(self, row: int) -> Chunk:
        """The chunk holding row ``row`` (:class:`~dpsql.InvalidData` for a row whose key has no time)."""
        self.grid.check_rows(row + 1)
        return self.chunk(_year(int(self.grid.day_of_row(row))) - self._first_year)

    def chunks_until(self, rows: int) -> list[Chunk]:
        """The chunks that hold rows ``0 .. rows - 1``."""
        return [self.chunk(k) for k in range(self.chunk_at(rows - 1).index + 1)] if rows else []


class CalendarLayout(CalendarChunks):
    """:class:`CalendarChunks` with ``epsilon`` split over the levels by ``calendar`` (:data:`LEVEL_SHARES`)."""

    def __init__(self, *, epsilon: float, grid: RowGrid, calendar: str):
        super().__init__(grid)
        self.epsilon, self.calendar = epsilon, calendar

    def level_epsilons(self, chunk: Chunk) -> tuple[float, ...]:
        """The budget of each level of ``chunk``'s tree (the same for every chunk)."""
        return level_epsilons(self.epsilon, LEVEL_SHARES[self.calendar])


def _year(day: int) -> int:
    return int(np.datetime64(day, "D").astype("datetime64[Y]").astype(np.int64)) + 1970


def _new_year(year: int) -> int:
    """January 1st of ``year``, in days since 1970-01-01."""
    return int(np.datetime64(year - 1970, "Y").astype("datetime64[D]").astype(np.int64))
