"""What every algorithm returns, and the protocol every online algorithm implements.

A :class:`Release` holds the private values (one per input row, input order), the
privacy cost, the public parameters actually used, and an :class:`ErrorModel` from
which error bars of any range sum follow. Releases are built by pure functions that
never touch a ledger; :func:`dpsql.publishing.publish` charges for them.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from dpsql._memory import pooled_array
from dpsql.accounting import Neighbour
from dpsql.error_models import ErrorModel, check_level
from dpsql.errors import InvalidParameter

#: The neighbour relation most releases protect (time order and partition keys public).
REPLACE_ONE = Neighbour.REPLACE_ONE.value


@dataclass(frozen=True, eq=False)
class Release:
    """A private stream. Everything in it is safe to publish.

    Attributes
    ----------
    values : numpy.ndarray
        float64, one private value per input row, input order.
    method, params :
        The algorithm and the public parameters actually used (defaults resolved).
    epsilon, delta :
        The privacy cost of this release under ``notion`` and ``neighbour``.
    threshold :
        The privately estimated clipping threshold, when the method estimates one.
    private :
        False when test (seeded) noise was used; a persistent ledger refuses those.
    components :
        Per-component cost, e.g. ``{"threshold": (eps, 0), "hierarchy": (eps, 0)}``.
    reports :
        Raw local-DP reports, for local-DP methods.
    release_id :
        The ledger's id (a UUID) for this release, once charged; the ledger keeps its public
        description and error model (:meth:`dpsql.Budget.release`, :meth:`from_arrow`).
    first_handle :
        The ledger-wide row handle of the first value (``dp_row`` in SQL), once charged.
    """

    values: np.ndarray
    method: str
    params: Mapping[str, Any]
    epsilon: float
    delta: float
    error: ErrorModel
    private: bool
    neighbour: str = REPLACE_ONE
    notion: str = "central"
    threshold: float | None = None
    components: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    reports: np.ndarray | None = None
    release_id: str | None = None
    first_handle: int | None = None

    def __len__(self) -> int:
        return len(self.values)

    def _check_range(self, i, j) -> tuple[np.ndarray, np.ndarray]:
        i = np.asarray(i, dtype=np.int64)
        j = np.asarray(j, dtype=np.int64)
        n = len(self.values)
        if np.any(i < 0) or np.any(j > n) or np.any(i > j):
            raise InvalidParameter(f"range [i, j) must satisfy 0 <= i <= j <= {n}")
        return i, j

    def range_sum(self, i, j):
        """Private sum of rows ``i`` to ``j - 1`` (Python slice semantics); arrays broadcast."""
        i, j = self._check_range(i, j)
        cumulative = np.concatenate([[0.0], np.cumsum(self.values)])
        out = cumulative[j] - cumulative[i]
        return float(out) if out.ndim == 0 else out

    def range_variance(self, i, j):
        """Noise variance of :meth:`range_sum` (noise only, see :meth:`range_ci`)."""
        i, j = self._check_range(i, j)
        out = self.error.range_variance(np.atleast_1d(i), np.atleast_1d(j)).reshape(np.shape(i + j))
        return float(out) if out.ndim == 0 else out

    def range_ci(self, i, j, level: float = 0.95, *, parts: bool = False):
        """``(low, high)`` interval for the sum of rows ``i..j-1`` at confidence ``level``.

        ``sum ± margin`` with the error model's :meth:`~dpsql.error_models.ErrorModel.range_margin`:
        the noise at ``level`` plus, for a range that cuts a block the release spread over
        its rows, the most that spreading can be off. It covers the sum of the values as
        clipped by the release (to the public bounds, or to the private threshold) at least
        at ``level``; ranges along block boundaries get the noise alone. ``parts=True`` gives
        ``(low, high, noise, spreading)``: the margin's two terms as well.
        """
        level = check_level(level)
        i, j = self._check_range(i, j)
        total = np.asarray(self.range_sum(i, j))
        noise, spreading = (part.reshape(total.shape) for part in
                            self.error.range_margin_parts(np.atleast_1d(i), np.atleast_1d(j), level))
        half = noise + spreading
        out = (total - half, total + half, noise, spreading) if parts else (total - half, total + half)
        return tuple(float(x) for x in out) if total.ndim == 0 else out

    def plot(self, *, ax=None, truth=None, time=None, every: int | None = None, level: float = 0.95,
             value: str = "value", unit: str | None = None, time_label: str | None = None):
        """Draw the released stream (matplotlib): bucket means with their ``level`` interval,
        the hold-out shaded, optionally the ``truth`` (only where you may show it) and ``time``
        on the x axis (one entry per row, labelled ``time_label``); returns the figure.
        Drawing is post-processing: it costs nothing. See :mod:`dpsql.display`."""
        from dpsql.display import plot_release

        return plot_release(self, ax=ax, truth=truth, time=time, every=every, level=level, value=value, unit=unit,
                            time_label=time_label)

    def _repr_html_(self) -> str:
        from dpsql.display import release_html

        return release_html(self)

    def with_id(self, release_id: str, first_handle: int | None = None) -> Release:
        return replace(self, release_id=release_id, first_handle=first_handle)

    def to_polars(self):
        """A Polars DataFrame: ``row`` (input position) and ``value``."""
        import polars as pl

        return pl.DataFrame({"row": np.arange(len(self.values)), "value": self.values})

    def to_arrow(self):
        """A pyarrow Table with the same columns; the cost, method and ``release_id`` travel in
        its metadata, so :meth:`from_arrow` restores the error bars from the ledger (after a
        round trip through Parquet, say)."""
        import pyarrow as pa

        table = pa.table({"row": np.arange(len(self.values)), "value": self.values})
        return table.replace_schema_metadata(_arrow_metadata(self))

    @staticmethod
    def from_arrow(table, *, budget) -> Release | PartitionedRelease:
        """The release a :meth:`to_arrow` table holds, its error model read from ``budget``'s
        ledger by the table's ``release_id`` (:class:`~dpsql.UnknownRelease` if that ledger
        does not record it). The values are the table's, in the order of its ``partition`` and
        ``row`` columns (the table may have been reordered); nothing is charged."""
        import pyarrow as pa

        from dpsql import _current
        from dpsql.errors import InvalidData

        if not isinstance(table, pa.Table):
            raise InvalidParameter(f"Release.from_arrow takes the pyarrow.Table of Release.to_arrow, got "
                                   f"{type(table).__name__}")
        budget = _current.budget if budget is None else budget
        if not callable(getattr(budget, "release", None)):  # a dpsql.Budget (whose module imports this one)
            raise InvalidParameter("Release.from_arrow reads the release's error model from the ledger it was charged "
                                   "to: pass budget=dpsql.Budget.open(<that ledger>, scope=...), or set it with "
                                   f"dpsql.use_budget (got {type(budget).__name__})")
        meta = _metadata_of(table)
        record = budget.release(meta["release_id"])
        columns = [c for c in ("partition", "row", "value") if c in table.column_names]
        if "value" not in columns or ("partition" in columns and "row" not in columns):
            raise InvalidParameter(f"the table of release {record.release_id} lacks its 'row' or 'value' column "
                                   f"(it has {', '.join(map(repr, table.column_names))})")
        for column in columns:
            if table.column(column).null_count:
                raise InvalidData(f"column {column!r} of release {record.release_id} holds "
                                  f"{table.column(column).null_count} null value(s): not the released table")
        values = np.asarray(table.column("value").to_numpy(), dtype=np.float64)
        n = int(record.offsets[-1])
        if len(values) != n:
            raise InvalidParameter(f"release {record.release_id} has {n} values; the table has {len(values)}")
        if "row" in columns:
            position = np.asarray(table.column("row").to_numpy(), dtype=np.int64)
            if "partition" in columns:
                partition = np.asarray(table.column("partition").to_numpy(), dtype=np.int64)
                if partition.size and (partition.min() < 0 or partition.max() >= record.partitions):
                    raise InvalidParameter(f"column 'partition' of release {record.release_id} names partitions "
                                           f"outside 0 .. {record.partitions - 1}")
                position = position + record.offsets[partition]
            if not np.array_equal(np.sort(position), np.arange(n)):
                raise InvalidParameter(f"columns 'partition' and 'row' of release {record.release_id} do not name "
                                       "each of its rows once: not the released table")
            ordered = np.empty(n)
            ordered[position] = values
            values = ordered
        return record.with_values(values)

    def __repr__(self) -> str:
        thr = "" if self.threshold is None else f", threshold={self.threshold:.6g}"
        priv = "" if self.private else ", private=False"
        return (f"Release({self.method}, n={len(self.values)}, epsilon={self.epsilon:g}, "
                f"delta={self.delta:g}{thr}{priv})")


@dataclass(frozen=True, eq=False)
class PartitionedRelease:
    """One release over disjoint partitions (parallel composition: charged once, at the max).

    ``values`` are all partitions' values, concatenated in partition order;
    ``offsets[k]:offsets[k+1]`` are partition ``k``'s rows, ``keys[k]`` its key and ``parts[k]``
    its :class:`Release` (error bars within a partition come from there; each is made when
    first looked at, see :class:`Parts`).
    """

    values: np.ndarray
    offsets: np.ndarray
    parts: Sequence[Release]
    method: str
    epsilon: float
    delta: float
    private: bool
    release_id: str | None
    keys: Sequence | None = None
    first_handle: int | None = None

    def part(self, k: int) -> Release:
        return self.parts[k]

    def __len__(self) -> int:
        return len(self.values)

    def to_arrow(self):
        """A pyarrow Table: ``partition`` (the partition's position), ``row`` (within it) and
        ``value``, with the release's ``release_id`` in its metadata (see :meth:`Release.to_arrow`)."""
        import pyarrow as pa

        lengths = np.diff(self.offsets)
        partition = np.repeat(np.arange(len(lengths)), lengths)
        row = np.arange(len(self.values)) - np.repeat(self.offsets[:-1], lengths)
        table = pa.table({"partition": partition, "row": row, "value": self.values})
        return table.replace_schema_metadata(_arrow_metadata(self))

    def plot(self, *, truth=None, time=None, **options):
        """One panel per partition (the first twelve), as :meth:`Release.plot`; returns the figure."""
        from dpsql.display import plot_partitions

        return plot_partitions(self, truth=truth, time=time, titles=self.keys, **options)

    def _repr_html_(self) -> str:
        from dpsql.display import partitioned_html

        return partitioned_html(self)

    def __repr__(self) -> str:
        return (f"PartitionedRelease({self.method}, partitions={len(self.parts)}, n={len(self.values)}, "
                f"epsilon={self.epsilon:g}, delta={self.delta:g})")


def _arrow_metadata(release: Release | PartitionedRelease) -> dict:
    facts = {"method": release.method, "epsilon": release.epsilon, "delta": release.delta,
             "private": release.private, "release_id": release.release_id}
    if isinstance(release, Release):
        facts.update(threshold=release.threshold, neighbour=release.neighbour, notion=release.notion)
    return {"dpsql": json.dumps(facts, default=str)}


def _metadata_of(table) -> dict:
    raw = (table.schema.metadata or {}).get(b"dpsql")
    if raw is None:
        raise InvalidParameter("this table carries no dpsql release metadata (make it with Release.to_arrow and "
                               "keep its schema metadata, as Parquet does)")
    meta = json.loads(raw)
    if not meta.get("release_id"):
        raise InvalidParameter("this release was never charged to a ledger (no release_id): its error model was "
                               "not recorded")
    return meta


class StreamMachine(ABC):
    """An online algorithm: state plus the next chunk of values -> outputs.

    A machine is built by its factory ``Factory(n, *, noise, **params)``: ``n`` is the
    public length of a one-shot release, ``None`` for a continual stream whose length is
    unknown; no default may depend on it except where a stream must then pass the parameter
    explicitly (PAK's ``delta``). ``noise`` is the partition's addressed draws
    (:class:`dpsql.noise.Draws`): every draw is a function of the release key and its
    address, so feeding the same rows in any chunks gives the same outputs. The constructor
    validates the parameters and draws no noise, so a refused call costs nothing.

    ``feed`` may hold back outputs (a hold-out waits for its threshold, a block waits for its
    last row); ``close`` ends a one-shot release and returns everything still held. Over a
    whole stream the outputs, concatenated, are one value per input row in input order.

    Continual release: :meth:`snapshot` gives the open part of the algorithm (pending rows,
    partial sums, smoother state: secrets included, kilobytes, never the released history)
    and :meth:`restore` continues a freshly built machine (same parameters, same draws) from
    it, exactly as if it had never stopped.

    Class attributes say what a release costs and under which notion; :meth:`describe` gives
    the rest of what a :class:`Release` needs, for the rows output so far.
    """

    #: (epsilon, delta) of the whole release (a whole stream, however long), known at construction.
    cost: tuple[float, float]
    notion: str = "central"
    #: The window of a w-event notion, else None.
    w: int | None = None
    neighbour: str = REPLACE_ONE
    #: Number of outputs over the whole stream; None means one per input row. A
    #: scalar release (a threshold) sets 1.
    n_outputs: int | None = None
    #: True when ``batched(draws)`` gives this machine (not yet fed) for ``len(draws)``
    #: partitions of its length at once, partition ``j`` drawing from ``draws[j]``: fed
    #: ``(k, rows)`` chunks, returning ``(k, outputs)``, with ``describe_partition(j)`` for
    #: partition ``j``. Every partition's release is exactly the release this machine would
    #: give it alone. A batched machine is kept after ``close`` to describe its partitions
    #: when asked, so ``close`` must drop every secret it holds (sums not released).
    batchable: bool = False
    #: True when ``feed(chunk, out=...)`` may write its outputs into ``out``, the caller's
    #: buffer for all the outputs still to come (shaped like them, ``(partitions, room)`` or
    #: ``(room,)``): it returns a view of ``out``'s first columns where it wrote in place
    #: (:func:`written_in_place`), and the caller need not copy them; a stream's values are
    #: then written once. Such a view must be written in full: output buffers come from a
    #: pool that hands back freed memory as it was (:func:`dpsql._memory.pooled_array`).
    writes_out: bool = False

    @abstractmethod
    def feed(self, chunk: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Consume ``chunk`` (already validated float64) and return new outputs (into ``out``
        where the machine :attr:`writes_out`; others never receive it)."""

    @abstractmethod
    def close(self) -> np.ndarray:
        """End of a one-shot release: return the outputs still held back."""

    @abstractmethod
    def describe(self) -> dict:
        """``method``, ``params``, ``error`` and, where they apply, ``threshold``,
        ``components`` and ``reports`` (keyword arguments of :class:`Release`), for the
        outputs so far."""

    def batched(self, draws) -> StreamMachine:
        """This machine (not yet fed) for ``len(draws)`` partitions at once (see :attr:`batchable`)."""
        raise NotImplementedError(f"{type(self).__name__} releases one partition at a time")

    def describe_partition(self, partition: int) -> dict:
        """:meth:`describe` for partition ``partition`` of a batched machine."""
        raise NotImplementedError(f"{type(self).__name__} releases one partition at a time")

    def provisional(self) -> np.ndarray | None:
        """Values for the rows fed but not output yet (a flat block waiting for its last row), in
        the shape of ``feed``'s outputs (``(partitions, rows)`` for a batched machine): a
        prediction from values already released, so post-processing, never a function of the
        waiting rows. A continual stream releases them at once as provisional values and their
        outputs later as final ones. None: this machine outputs every row when it is fed."""
        return None

    def partition_kinds(self) -> np.ndarray | None:
        """Of a batched machine: a number per partition, equal for partitions whose
        :meth:`describe_partition` is equal (described once, :mod:`dpsql.parts`); None when every
        partition has its own description."""
        return None

    def snapshot(self) -> dict:
        """The open state, as plain data (numbers, strings, lists, dicts, numpy arrays). A
        machine that does not override it has no online form (a threshold needs all its rows)."""
        raise NotImplementedError(f"{type(self).__name__} has no online form")

    def restore(self, state: dict) -> None:
        """Continue from :meth:`snapshot`'s ``state`` (on a machine built with the same
        parameters and draws, not yet fed)."""
        raise NotImplementedError(f"{type(self).__name__} has no online form")


def run_machine(machine: StreamMachine, chunks, n: int, out: np.ndarray | None = None) -> np.ndarray:
    """Drive ``machine`` over ``chunks`` of ``n`` rows and collect its outputs in order (into
    ``out``, ``(k, n)`` for a batched machine fed ``(k, rows)`` chunks)."""
    n = n if machine.n_outputs is None else machine.n_outputs
    out = pooled_array(n) if out is None else out
    filled = 0
    for chunk in chunks:
        filled += feed_into(machine, chunk, out[..., filled:]).shape[-1]
    piece = machine.close()
    out[..., filled:filled + piece.shape[-1]] = piece
    filled += piece.shape[-1]
    if filled != n:
        raise AssertionError(f"{type(machine).__name__} produced {filled} outputs, expected {n}")
    return out


def feed_into(machine: StreamMachine, chunk: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``machine`` fed ``chunk``, its new outputs written as the first columns of ``out``
    (in place where it :attr:`~StreamMachine.writes_out`); returns those columns."""
    piece = machine.feed(chunk, out=out) if machine.writes_out else machine.feed(chunk)
    if not written_in_place(piece, out):
        out[..., :piece.shape[-1]] = piece
    return out[..., :piece.shape[-1]]


def written_in_place(piece: np.ndarray, target: np.ndarray) -> bool:
    """Was ``piece`` written in place, as the first columns of ``target``? (A machine that
    :attr:`~StreamMachine.writes_out` returns a view of ``out`` laid out as ``out``.)"""
    return piece.size > 0 and piece.__array_interface__["data"][0] == target.__array_interface__["data"][0]


def release_from(machine: StreamMachine, chunks, n: int, *, private: bool) -> Release:
    """Drive ``machine`` over ``chunks`` of ``n`` rows and wrap its outputs as a :class:`Release`."""
    values = run_machine(machine, chunks, n)
    return Release(values=values, private=private, **described(machine, machine.describe()))


#: Values per chunk of a batched run (all partitions' columns together): a step's fixed cost
#: is paid once for all partitions, and the temporaries stay a fraction of the input
#: (1,000 x 10^4 rows: peak about 2.5 times the input, run time flat from 2^20 to 2^24).
#: Many short partitions are released in batches of about this many values, whole rows each
#: (a chunk of a few columns of 10^6 partitions would be read with a stride). As many as a
#: single stream's chunks (:func:`chunks_of`): 10^6 partitions of 10 rows run about 10 %
#: faster than in chunks of 2^22, whose temporaries of 32 MB leave the cache.
BATCHED_CHUNK = 1 << 20


def release_batched(machine: StreamMachine, rows: np.ndarray, out: np.ndarray, draws) -> StreamMachine:
    """Release the equal-length partitions ``rows`` (``(k, n)``) with ``machine.batched(draws)``
    (``draws`` a :class:`~dpsql.noise.DrawsBatch` of ``k`` partitions) into ``out`` (``(k, n)``);
    returns the driven batch machine (partition ``j`` is described by its ``describe_partition(j)``)."""
    batch = machine.batched(draws)
    run_machine(batch, chunks_of(rows, max(1, BATCHED_CHUNK // len(rows))), rows.shape[1], out)
    return batch


def described(machine: StreamMachine, description: dict) -> dict:
    """A machine's ``description`` with its cost, neighbour relation and notion: a
    :class:`Release`'s arguments but its values, ``private`` and ``release_id``."""
    return dict(epsilon=machine.cost[0], delta=machine.cost[1], neighbour=machine.neighbour, notion=machine.notion,
                **description)


def chunks_of(values: np.ndarray, size: int = 1 << 20):
    """Views of ``values`` in consecutive chunks of ``size`` rows (along the last axis: the
    rows of every partition of a ``(k, n)`` array)."""
    for start in range(0, values.shape[-1], size):
        yield values[..., start:start + size]

