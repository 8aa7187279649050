"""The block hierarchy (method ``"hierarchy"``, and ToPS's stream phase): range sums of a
stream whose values are clipped to a public bound.

Rows are cut into chunks (:class:`~dpsql.mechanisms.hierarchy.Layout`), each chunk into
blocks of ``g`` rows; a consistent fan-out-``f`` forest of noisy sums sits over each chunk's
blocks (:mod:`dpsql.mechanisms.hierarchy`), and the rows of a block share its noisy sum:

* ``smoother="none"`` (the default, the *flat spread*): every row of a block gets the block's
  noisy sum divided by its length, released when the block's last row arrives. A range's
  noise then comes from the forest nodes it covers and, at each end, from the fraction of
  a block it cuts: a ``w``-row window inside blocks of ``g`` rows carries about
  ``(w / g)^2`` of a block's noise variance.
* the predictive smoothers (``recent``, ``mean``, ``median``, ``moving``, ``exponential``;
  ToPS App. D, :mod:`dpsql.mechanisms.smoothers`) release every row when it arrives, with a
  prediction from the blocks before, and put the rest of the block's sum on its last row,
  so a window holding a block end carries that block's whole noise: about ``w / g`` of it.

Defaults (derivation in :func:`~dpsql.mechanisms.hierarchy.flat_block` and
:class:`~dpsql.mechanisms.hierarchy.Layout`): the flat spread over geometric chunks of
``4096 * 16**k`` rows, each with the block length that minimises Eq. 7 with the flat
spread's bias term, a power of two; the predictive smoothers keep the paper's layout
(chunks of ``r = 2**20`` rows, blocks of ``16**s`` rows, ``s`` Eq. 7's continuous minimum,
rounded). ``depth`` (blocks of ``fanout**depth`` rows) or ``block`` (any length) override
the rule; ``depth=0`` is the exact, unsmoothed tree. Rows on a public time ``grid`` get calendar
blocks instead (:func:`calendar_layout`, :mod:`dpsql.mechanisms.calendar`): a UTC day per block,
trees of days, months and a year per calendar year, ``epsilon`` split over the levels by
``calendar=`` (``"day"`` by default).

Privacy (replace-one-value neighbours; time order public): every value lies in one node per
level of its chunk's forest, and a chunk of ``L`` levels gives each level ``epsilon / L`` (a
calendar tree: its levels' shares, adding up to at most ``epsilon``) with sensitivity
``upper - lower``: each chunk is ``epsilon``-DP, chunks are disjoint
(parallel composition), spreading and smoothing are post-processing. The whole release is
``epsilon``-DP. Clipping to ``[lower, upper]`` is part of the mechanism.
"""

from __future__ import annotations

import copy

import numpy as np

from dpsql import _validate
from dpsql._memory import pooled_array
from dpsql.error_models import SegmentedNoise
from dpsql.errors import InvalidParameter
from dpsql.mechanisms.block_error import BlockStreamNoise, CalendarBlockNoise
from dpsql.mechanisms.calendar import CALENDARS, DEFAULT_CALENDAR, CalendarLayout
from dpsql.mechanisms.hierarchy import Chunk, Forest, Layout, predictive_depth, tree_height
from dpsql.mechanisms.laplace import LatticeBatch
from dpsql.mechanisms.query_mix import QueryMix, clipped_measure, focus_lengths
from dpsql.mechanisms.smoothers import MIN_ALPHA, SMOOTHERS, make_smoother
from dpsql.noise import Draws, DrawsBatch, Lane
from dpsql.release import StreamMachine
from dpsql.timegrid import RowGrid

#: The paper's largest query range, the chunk length of its (fixed) layout.
PAPER_RANGE = 1 << 20
#: The largest block a user may ask for (rows wait for their block's last row).
MAX_BLOCK = 1 << 24
#: The stream a query mix's ranges are placed in (:meth:`HierarchyStream.query_mix`), at least.
_MIX_ROWS = 1 << 18
#: Query mixes computed, by public layout and lengths (at most ``_QUERY_MIXES_KEPT``).
_QUERY_MIXES: dict[tuple, QueryMix] = {}
_QUERY_MIXES_KEPT = 64


def check_hierarchy_options(*, fanout, consistency, smoother, window, alpha, r, depth, block, grid=None,
                            calendar=DEFAULT_CALENDAR, max_delay=None):
    """The hierarchy's options, validated (typed errors naming the parameter); returns
    ``(fanout, consistency, smoother, window, alpha, r, depth, block, grid, calendar, max_delay)``
    with ``r`` resolved for predictive smoothers (the paper's fixed layout), ``grid`` a
    :class:`~dpsql.timegrid.RowGrid` or None. ``max_delay`` (rows, or None): the flat spread's
    blocks are at most that long; a ``block`` or ``depth`` that asks for longer ones is refused."""
    calendar = _validate.choice(calendar, "calendar", CALENDARS)
    max_delay = check_max_delay(max_delay)
    grid = None if grid is None else RowGrid.of(grid)
    fanout = _validate.integer(fanout, "fanout", minimum=2)
    if not isinstance(consistency, bool):
        raise InvalidParameter(f"consistency must be True or False, got {consistency!r}")
    smoother = _validate.choice(smoother, "smoother", SMOOTHERS)
    window = _validate.integer(window, "window", minimum=1)
    alpha = _validate.real(alpha, "alpha")
    if not MIN_ALPHA <= alpha <= 1:
        raise InvalidParameter(f"alpha must satisfy {MIN_ALPHA} <= alpha <= 1, got {alpha!r}")
    if r is not None:
        r = _validate.integer(r, "r", minimum=1)
    elif smoother != "none":
        r = PAPER_RANGE
    if depth is not None and block is not None:
        raise InvalidParameter("give depth (blocks of fanout**depth rows) or block (rows per block), not both")
    if depth is not None:
        depth = _validate.integer(depth, "depth", minimum=0)
        height = tree_height(r or PAPER_RANGE, fanout)
        if depth >= height:
            raise InvalidParameter(f"depth must be < {height} (the levels of a tree over r={r or PAPER_RANGE} "
                                   f"rows at fanout {fanout}), got {depth}")
    if block is not None:
        block = _validate.integer(block, "block", minimum=1)
        if block > MAX_BLOCK:
            raise InvalidParameter(f"block must be at most {MAX_BLOCK} rows, got {block}")
    asked = block if block is not None else None if depth is None else fanout**depth
    if max_delay is not None and smoother == "none" and asked is not None and asked > max_delay:
        raise InvalidParameter(f"max_delay={max_delay} rows: blocks of {asked} rows (block or depth) would keep a "
                               f"block's first row provisional until {asked - 1} later rows arrive; ask for blocks of "
                               "at most max_delay rows, or a longer max_delay")
    return fanout, consistency, smoother, window, alpha, r, depth, block, grid, calendar, max_delay


def check_max_delay(max_delay) -> int | None:
    """A machine's ``max_delay``: None, or a number of rows, at least 1 (a row waits for at most
    ``max_delay - 1`` later rows; a continual stream converts a duration to rows on its grid)."""
    return None if max_delay is None else _validate.integer(max_delay, "max_delay", minimum=1)

def calendar_layout(epsilon: float, smoother: str, r, depth, block, grid: RowGrid | None,
                    calendar: str, max_delay: int | None = None) -> CalendarLayout | None:
    """The calendar layout of validated options, or None where row-count blocks apply: no grid,
    ``calendar="none"``, a predictive smoother (its blocks are powers of the fan-out), an
    explicit ``r``, ``depth`` or ``block``, or a ``max_delay`` shorter than a day's rows (no
    calendar unit fits: blocks of at most ``max_delay`` rows)."""
    if grid is None or calendar == "none" or smoother != "none" or (r, depth, block) != (None, None, None):
        return None
    if max_delay is not None and grid.rows_per_day > max_delay:
        return None
    return CalendarLayout(epsilon=epsilon, grid=grid, calendar=calendar)


class HierarchyStream(StreamMachine):
    """Known-bound block hierarchy with online consistency (method ``"hierarchy"``; module docstring).

    Parameters: ``epsilon``; public bounds ``lower``/``upper`` (values are clipped to them);
    ``smoother`` (default ``"none"``, the flat spread) with ``window`` (moving, 8) and
    ``alpha`` (exponential, 0.6, the reference code's; at least 0.001); ``r`` the chunk length
    (default: geometric chunks for the flat spread, ``2**20`` for predictive smoothers);
    ``fanout`` (16); ``consistency`` (True; False releases each block's own noise: the
    ablation); ``depth`` or ``block`` override the block rule; ``initial`` a predictive
    smoother's first per-row guess (default halfway between the bounds); ``grid`` the rows'
    public time grid (a :class:`~dpsql.timegrid.RowGrid` or what :meth:`~dpsql.timegrid.RowGrid.of`
    reads) and ``calendar`` the level split (``"day"``, ``"month"``, ``"balanced"``; ``"none"``:
    row-count blocks), which apply with the flat spread and no ``r``, ``depth`` or ``block``;
    ``max_delay`` (rows) bounds the flat spread's blocks, so that no row waits for more than
    ``max_delay - 1`` later rows: calendar days where a day's rows fit, else row-count blocks of
    at most ``max_delay`` rows (predictive smoothers release every row when it arrives).

    Online: the flat spread releases a block's rows with its last row; predictive smoothers
    release every row on arrival. At the end of a one-shot release the rows of an incomplete
    last block share its noisy partial sum (flat) or keep their predictions, exactly what a
    continual stream has released of them so far. Chunk ``k``'s forest is the ``FOREST``
    lane at level ``k``, drawn and made consistent when its first row arrives, so the state
    is the row count, the open block's partial sum (secret) and the smoother's state.

    Error model: every smoother except ``median`` is linear in the block sums, so range-sum
    variances are exact (the rounding of the consistent noise to the lattice, at most
    ``gamma / 2`` per block, aside); ``median``'s are exact given the released positions of
    its medians. The bias bound covers the spreading of a cut block
    (:class:`~dpsql.mechanisms.block_error.BlockStreamNoise`).

    Partitions: :meth:`for_partitions` gives the machine for ``k`` equal-length streams at
    once, each with its own upper bound (ToPS: its own threshold), lattice, draws, forests and
    smoother state, fed ``(k, rows)`` chunks; every partition's release is exactly what its
    own single stream gives. They share one layout: on a grid, one grid (partitions whose keys
    start elsewhere are another batch).

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> with dpsql.testing.seeded(0) as keys:
    ...     machine = HierarchyStream(None, epsilon=1.0, upper=10.0, noise=keys.partition())
    ...     out = np.concatenate([machine.feed(np.full(3000, 4.0)), machine.feed(np.full(1096, 4.0))])
    >>> out.shape, machine.params()["blocks"]
    ((4096,), [128])
    """

    batchable = True
    writes_out = True

    def __init__(self, n: int | None = None, *, epsilon: float, upper: float, lower: float = 0.0,
                 smoother: str = "none", window: int = 8, alpha: float = 0.6, r: int | None = None,
                 fanout: int = 16, consistency: bool = True, depth: int | None = None, block: int | None = None,
                 initial: float | None = None, grid=None, calendar: str = DEFAULT_CALENDAR,
                 max_delay: int | None = None, noise: Draws):
        self.epsilon = _validate.epsilon(epsilon)
        self.lower, self.upper = _validate.bounds(lower, upper)
        (self.fanout, self.consistency, self.smoother_name, self.window, self.alpha, self.r, self.depth,
         self.block, self.grid, self.calendar, self.max_delay) = check_hierarchy_options(
            fanout=fanout, consistency=consistency, smoother=smoother, window=window, alpha=alpha, r=r, depth=depth,
            block=block, grid=grid, calendar=calendar, max_delay=max_delay)
        if self.grid is not None and n is not None:
            self.grid.check_rows(n)
        self.layout = calendar_layout(self.epsilon, self.smoother_name, self.r, self.depth, self.block, self.grid,
                                      self.calendar, self.max_delay) or self._row_count_layout()
        self.cost = (self.epsilon, 0.0)
        if initial is not None:
            initial = _validate.real(initial, "initial")
        self._start(np.array([self.upper]), DrawsBatch([noise]),
                    None if initial is None else np.array([initial - self.lower]), Lane.FOREST)

    def _row_count_layout(self) -> Layout:
        if self.depth is not None:
            fixed_block = self.fanout**self.depth
        elif self.block is not None:
            fixed_block = self.block
        elif self.smoother_name != "none":
            fixed_block = self.fanout ** predictive_depth(self.epsilon, self.r, self.fanout)
        else:
            fixed_block = None  # the flat rule, per chunk
        return Layout(epsilon=self.epsilon, fanout=self.fanout, r=self.r, block=fixed_block,
                      max_block=self.max_delay if self.smoother_name == "none" else None)

    def for_partitions(self, uppers: np.ndarray, draws: DrawsBatch, initials: np.ndarray | None = None,
                       lane: Lane = Lane.FOREST) -> HierarchyStream:
        """This machine (not yet fed) for ``len(uppers)`` equal-length partitions, partition ``j``
        clipped to ``[lower, uppers[j]]`` (public or privately released bounds above ``lower``),
        drawing its forests from ``lane`` of ``draws[j]``, its predictive smoother's first
        guess per row ``initials[j]`` (a value already released, such as a hold-out's mean)."""
        machine = copy.copy(self)
        machine._start(np.asarray(uppers, dtype=np.float64), draws, initials, lane)
        return machine

    def batched(self, draws: DrawsBatch) -> HierarchyStream:
        return self.for_partitions(np.full(len(draws), self.upper), draws)

    def _start(self, uppers: np.ndarray, draws: DrawsBatch, initials, lane: Lane) -> None:
        """Per-partition state for the upper bounds ``uppers``, nothing fed yet."""
        self._uppers = uppers
        self._bounds = uppers - self.lower
        self._draws, self._lane = draws, lane
        guess = self._bounds / 2 if initials is None else np.clip(np.asarray(initials, dtype=np.float64), 0.0,
                                                                  self._bounds)
        first_block = self.layout.chunk(0).block
        self._smoother = make_smoother(self.smoother_name, block=first_block, initial_sum=first_block * guess,
                                       window=self.window, alpha=self.alpha)
        self._lattice_of: dict[float, LatticeBatch] = {}
        self._rows = 0
        self._chunk: Chunk | None = None
        self._leaf_noise: np.ndarray | None = None
        self._partial_units = np.zeros(len(uppers))
        self._prediction = self._smoother.first_prediction * np.ones(len(uppers))
        # the per-row value of the last block released (the flat spread), first the initial guess:
        # what rows of an open block are provisionally released at
        self._last_row = np.array(guess, dtype=np.float64).reshape(-1) * np.ones(len(uppers))
        self._flushed = False
        self._lead = ()

    def _lattices(self, chunk: Chunk) -> tuple[LatticeBatch, ...]:
        """The lattice of each level of ``chunk``'s forest, at that level's budget
        (:meth:`~dpsql.mechanisms.hierarchy.Layout.level_epsilons`). All have the granularity of
        the bound, so a chunk's nodes share their units."""
        lattices = []
        for epsilon in self.layout.level_epsilons(chunk):
            if epsilon not in self._lattice_of:
                self._lattice_of[epsilon] = LatticeBatch(self._bounds, epsilon)
            lattices.append(self._lattice_of[epsilon])
        return tuple(lattices)

    def _enter(self, chunk: Chunk) -> None:
        """Make ``chunk`` the current one: draw its noise forest, make it consistent and keep
        its leaves (integer lattice units), unless it is current already."""
        if self._chunk is not None and self._chunk.index == chunk.index and self._leaf_noise is not None:
            return
        lattices = self._lattices(chunk)
        lane = self._draws.lane(self._lane, chunk.index)
        if not self.consistency:
            leaves = lattices[0].noise_units(lane, 0, chunk.blocks)
        elif isinstance(chunk.forest, Forest):  # Hay's closed form: one lattice for every level
            leaves = chunk.forest.consistent_leaf_noise(lattices[0], lane, 0)
        else:
            leaves = chunk.forest.consistent_leaf_noise(lattices, lane, 0)
        self._chunk, self._leaf_noise = chunk, leaves[:, :chunk.blocks]
        self._leaf_lattice = lattices[0]
        self._inverse_gamma = (1.0 / lattices[0].granularity)[:, None]
        self._bound_units = self._bounds[:, None] * self._inverse_gamma

    def feed(self, chunk: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        rows = chunk.reshape(len(self._uppers), -1)
        count = rows.shape[1]
        if self._on_calendar:  # refused before anything changes
            self.grid.check_rows(self._rows + count)
        # outputs are written straight into one buffer, the caller's when given (its room holds
        # every output to come: a flat spread may release rows held back before); predictive
        # smoothers emit one output per row, a flat spread the rows of the blocks it completes
        if out is not None:
            out = out.reshape(len(rows), -1)
        elif self._smoother.predictive:
            out = np.empty(rows.shape)
        pieces = []
        start = written = 0
        while start < count:
            current = self.layout.chunk_at(self._rows)
            self._enter(current)
            take = min(count - start, current.stop - self._rows)
            piece = self._feed_within_chunk(rows[:, start:start + take], None if out is None else out[:, written:])
            pieces.append(piece)
            start += take
            written += piece.shape[1]
        if out is None:
            out = np.concatenate(pieces, axis=1) if pieces else np.empty((len(rows), 0))
        else:
            out = out[:, :written]
        if self.lower:
            out += self.lower
        self._lead = chunk.shape[:-1]
        return out.reshape((*self._lead, -1))

    def _open_rows(self) -> int:
        """Rows fed of the block still open (0 when the last block fed is complete)."""
        if not self._rows:
            return 0
        chunk = self.layout.chunk_at(self._rows - 1)
        if (self._rows - chunk.start + chunk.phase) % chunk.block == 0:
            return 0
        return self._rows - chunk.block_start(chunk.block_of(self._rows - 1))

    def close(self) -> np.ndarray:
        held = np.empty((len(self._uppers), 0))
        offset = self._open_rows()
        if not self._smoother.predictive and offset:
            # a one-shot release ends inside a block: its rows share the block's noisy partial sum
            self._enter(self.layout.chunk_at(self._rows - 1))
            noise = self._leaf_noise[:, self._chunk.block_of(self._rows - 1)]
            held = np.repeat(self._leaf_lattice.from_units(np.rint(self._partial_units).astype(np.int64) + noise)
                             [:, None] / offset, offset, axis=1)
            if self.lower:
                held += self.lower
            self._flushed = True
        # The machine may be kept to describe its partitions (StreamMachine.batchable): the
        # leaf noise, with the released block sums, would give the exact clipped sums.
        self._leaf_noise = self._partial_units = None
        # outputs are shaped like the inputs: (partitions, rows) chunks or one stream's rows
        return held.reshape((*self._lead, -1))

    def _feed_within_chunk(self, values: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        """Rows ``self._rows ..`` of the current chunk (``values`` one row per partition): clip,
        sum per block in lattice units, release the blocks that complete, and write their outputs
        into the first columns of ``out`` (a new array when None): one per row (predictive), or
        the rows of the completed blocks (flat spread); returns the columns written."""
        chunk = self._chunk
        g = chunk.block
        # pooled: a fresh array here, at every append to a stream, would be faulted in again
        units = pooled_array(values.size).reshape(values.shape)
        np.multiply(values - self.lower if self.lower else values, self._inverse_gamma, out=units)
        np.clip(units, 0.0, self._bound_units, out=units)
        np.rint(units, out=units)
        # Chunks hold whole blocks (the first one short by the chunk's phase), so blocks start at
        # multiples of g from ``phase`` rows before the chunk: this piece continues block b0 at
        # ``offset`` and touches ``pieces`` blocks, all but the first and last whole.
        count = values.shape[1]
        position = self._rows - chunk.start + chunk.phase
        offset = position % g
        head = min(g - offset, count)
        starts = np.arange(head - g, count, g)
        starts[0] = 0
        pieces = len(starts)
        sums = np.add.reduceat(units, starts, axis=1)
        sums[:, 0] += self._partial_units
        lengths = np.full(pieces, g)
        lengths[0] = head
        lengths[-1] = count - starts[-1]
        first_block = position // g
        self._rows += count
        complete = pieces if (self._rows - chunk.start + chunk.phase) % g == 0 else pieces - 1
        self._partial_units = np.zeros(len(sums)) if complete == pieces else sums[:, -1].copy()
        released_units = sums[:, :complete].astype(np.int64) + self._leaf_noise[:, first_block:first_block + complete]
        released = self._leaf_lattice.from_units(released_units)
        if not self._smoother.predictive:
            # every row of each completed block (rows held back before included)
            if not complete:
                return np.empty((len(values), 0)) if out is None else out[:, :0]
            first_length = chunk.block_length(first_block)
            self._last_row = released[:, complete - 1] / (first_length if complete == 1 else g)
            width = (complete - 1) * g + first_length
            spread = np.empty((len(values), width)) if out is None else out[:, :width]
            spread[:, :first_length] = released[:, :1] / first_length
            blocks = spread[:, first_length:]
            blocks.shape = (len(spread), complete - 1, g)  # a view: assigning the shape never copies
            np.divide(released[:, 1:, None], g, out=blocks)
            return spread
        out = out[:, :count]
        predictions = np.concatenate([self._prediction[:, None], self._smoother.predict(released)], axis=1)
        self._prediction = predictions[:, complete].copy()
        _spread(predictions[:, :pieces], lengths, g, out)
        last_rows = starts[:complete] + lengths[:complete] - 1
        out[:, last_rows] = released - (g - 1) * predictions[:, :complete]
        return out

    def snapshot(self) -> dict:
        """The open state; of a closed machine (a released hold-out), what describes it."""
        partial = np.zeros(len(self._uppers)) if self._partial_units is None else self._partial_units
        return {"rows": self._rows, "partial_units": partial, "prediction": self._prediction,
                "smoother": self._smoother.snapshot(), "flushed": self._flushed, "last_row": self._last_row}

    def restore(self, state: dict) -> None:
        self._rows = int(state["rows"])
        self._partial_units = np.asarray(state["partial_units"], dtype=np.float64)
        self._prediction = np.asarray(state["prediction"], dtype=np.float64)
        self._smoother.restore(state["smoother"])
        self._flushed = bool(state["flushed"])
        if "last_row" in state:  # (states written before provisional values start from the guess)
            self._last_row = np.asarray(state["last_row"], dtype=np.float64)

    def provisional(self) -> np.ndarray | None:
        """The rows of the open block (flat spread), each at the per-row value of the last block
        released (the initial guess before the first), clipped to the bounds: released values
        only. Predictive smoothers release every row when it arrives: None."""
        if self._smoother.predictive:
            return None
        guess = np.clip(self._last_row, 0.0, self._bounds) + self.lower
        return np.repeat(guess[:, None], self._open_rows(), axis=1).reshape((*self._lead, -1))

    @property
    def released_rows(self) -> int:
        """Rows whose values have been output: all of them with a predictive smoother, the
        completed blocks' (and a flushed last block's) with the flat spread."""
        if self._smoother.predictive or self._flushed:
            return self._rows
        return self._rows - self._open_rows()

    def params(self, partition: int = 0) -> dict:
        """The public parameters actually used (defaults resolved), of one partition; the
        layout as lists ``chunks`` (rows per chunk), ``blocks`` (rows per block) and ``levels``
        (forest levels) of the chunks reached so far (a fixed layout's one chunk shape)."""
        chunks = self.layout.chunks_until(self._rows) if self.layout.geometric else []
        chunks = chunks or [self.layout.chunk(0)]
        return {"epsilon": self.epsilon, "lower": self.lower, "upper": float(self._uppers[partition]),
                "smoother": self.smoother_name, **self.smoother_params(), "r": self.r, "fanout": self.fanout,
                "consistency": self.consistency, "depth": self.depth, "block": self.block,
                "chunks": [c.rows for c in chunks], "blocks": [c.block for c in chunks],
                "levels": [c.forest.levels for c in chunks], "grid": None if self.grid is None else self.grid.plain(),
                "calendar": self.calendar, "max_delay": self.max_delay,
                "units": None if self.layout.units is None else list(self.layout.units),
                "level_epsilons": list(self.layout.level_epsilons(chunks[0])) if self._on_calendar else None}

    @property
    def _on_calendar(self) -> bool:
        return isinstance(self.layout, CalendarLayout)

    def smoother_params(self) -> dict:
        """The smoother's own public parameters (``window``, ``alpha``), the same for every partition."""
        return self._smoother.params()

    def describe(self) -> dict:
        return self.describe_partition(0)

    def describe_partition(self, partition: int) -> dict:
        return dict(method="hierarchy", params=self.params(partition), error=self.error_model(partition),
                    components={"hierarchy": self.cost})

    def partition_kinds(self) -> np.ndarray | None:
        # partitions are described by their bounds, unless the smoother keeps each one's own history
        if self.smoother_name == "median":
            return None
        return np.unique(self._uppers, return_inverse=True)[1]

    def error_model(self, partition: int) -> BlockStreamNoise | SegmentedNoise | CalendarBlockNoise:
        """Partition ``partition``'s error model for the rows released so far: one model over
        a fixed layout's chunks (a predictive smoother's noise crosses chunk ends), one segment
        per chunk of a geometric layout (independent forests), one model over calendar years."""
        return self._error_model(partition, self.released_rows, self._smoother.partition_terms(partition),
                                 self._flushed)

    def query_mix(self, lengths: tuple[int | str, ...]) -> QueryMix:
        """The range sums of ``lengths`` rows, or of whole calendar units (``"day"``, ``"week"``,
        ``"month"``: :data:`~dpsql.mechanisms.query_mix.CALENDAR_TOTALS`, on a grid), that a threshold
        for this stream should serve, with their noise variance per squared bound (partition 0's;
        public: the layout and epsilon only, no row fed).

        A length's unit variance is the mean over 64 evenly spaced ranges of a stream of
        ``max(2**18, 4 * max(lengths), 128 days)`` rows (short ranges fall anywhere in a long
        stream); a unit's, the mean over the whole units of that stream, whose length is the unit's
        mean number of rows. All rows released, spread evenly over their block (the flat spread, the
        default; a predictive smoother's windows carry more noise, and a median's depends on released
        values): every variance is positive. Calendar totals alone count the clipped excess above a
        candidate, other mixes the values (:func:`~dpsql.mechanisms.query_mix.clipped_measure`).
        Computed once per public layout (cached).

        >>> import dpsql
        >>> stream = HierarchyStream(epsilon=1.0, upper=1.0, noise=dpsql.testing.draws(0))
        >>> [round(v, 3) for v in stream.query_mix((24, 65536)).unit_variances]
        [0.048, 167.298]
        >>> hourly = HierarchyStream(epsilon=1.0, upper=1.0, grid=("2024-01-01", "1h"), noise=dpsql.testing.draws(0))
        >>> mix = hourly.query_mix(("day", "week", "month"))
        >>> mix.lengths, [round(v, 1) for v in mix.unit_variances]  # a day is one node at 0.7 epsilon
        ((24, 168, 731), [4.0, 24.1, 33.6])
        """
        bound = float(self._bounds[0])
        key = (self.epsilon, self.smoother_name, self.r, self.fanout, self.consistency, self.depth, self.block,
               None if self.grid is None else tuple(sorted(self.grid.plain().items())), self.calendar, bound,
               tuple(lengths), self.max_delay)  # every public fact the layout depends on (max_delay: its blocks)
        mix = _QUERY_MIXES.get(key)
        if mix is None:
            units = [length for length in lengths if isinstance(length, str)]
            if units and not self._on_calendar:
                raise InvalidParameter(f"calendar totals ({', '.join(units)}) need a calendar layout (a grid)")
            rows = max(_MIX_ROWS, 4 * max((n for n in lengths if not isinstance(n, str)), default=0),
                       128 * self.grid.rows_per_day if units else 0)
            if self._on_calendar:  # a grid ends with the times numpy holds (2262): a daily one within 2**18 rows
                rows = min(rows, self.grid.last_row)  # (its error model looks one row ahead)
            model = self._error_model(0, rows, {"name": "none"}, True)
            spans, variances = [], []
            for length in lengths:
                if isinstance(length, str):
                    starts, stops = self.grid.unit_ranges(length, rows)
                else:
                    starts = np.linspace(0, max(rows - length, 0), 64).astype(np.int64)
                    stops = np.minimum(starts + length, rows)
                if not len(starts):  # no whole unit in the grid's times (a month near 2262): none asked
                    continue
                spans.append(round(float(np.mean(stops - starts))))
                variances.append(float(np.mean(model.range_variance(starts, stops))) / bound**2)
            if not spans:
                raise InvalidParameter(f"no whole {', '.join(map(str, lengths))} fits the grid's times (they end "
                                       "in 2262): choose focus='windows' or focus='long'")
            if len(_QUERY_MIXES) >= _QUERY_MIXES_KEPT:
                _QUERY_MIXES.clear()
            mix = _QUERY_MIXES[key] = QueryMix(tuple(spans), tuple(variances), clipped_measure(tuple(lengths)))
        return mix

    def focus_mix(self, focus: str, span: int) -> QueryMix:
        """:meth:`query_mix` for what ``focus`` stands for in ranges of ``span`` rows
        (:func:`~dpsql.mechanisms.query_mix.focus_lengths`; the calendar totals on a calendar layout)."""
        return self.query_mix(focus_lengths(focus, span, calendar=self._on_calendar))

    def _error_model(self, partition: int, released: int, terms: dict, flushed: bool
                     ) -> BlockStreamNoise | SegmentedNoise | CalendarBlockNoise:
        """Partition ``partition``'s error model once ``released`` rows are released with the
        smoother ``terms`` (``flushed``: the last block was released short)."""
        bound = float(self._bounds[partition])
        if self._on_calendar:
            variances = [float(lattice.variance[partition]) for lattice in self._lattices(self.layout.chunk(0))]
            return CalendarBlockNoise(n_rows=released, grid=self.grid.plain(), level_variances=variances,
                                      consistent=self.consistency, bound=bound, short_last_block=flushed)

        def model(chunk: Chunk, rows: int, last: bool) -> BlockStreamNoise:
            node_variance = float(self._lattices(chunk)[0].variance[partition])
            return BlockStreamNoise(n_rows=rows, block=chunk.block, chunk_blocks=chunk.blocks, fanout=self.fanout,
                                    levels=chunk.forest.levels, node_variance=node_variance,
                                    consistent=self.consistency, smoother={**terms, "block": chunk.block},
                                    bound=bound, short_last_block=flushed and last)

        if not self.layout.geometric:
            return model(self.layout.chunk(0), released, True)
        chunks = self.layout.chunks_until(released) or [self.layout.chunk(0)]
        boundaries = [c.start for c in chunks] + [released]
        return SegmentedNoise(boundaries, [model(c, max(min(c.stop, released) - c.start, 0), c is chunks[-1])
                                           for c in chunks])


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
