"""A continual stream's open state as columns, for fleets of up to millions of partitions.

A stream keeps, for every partition (one meter, one store), what its next append needs and
nothing of its released history:

* the **directory**: each partition's key (the partition columns, typed as they came), its
  canonical address (:mod:`dpsql.addresses`: its noise address) and its first row handle, in
  the order partitions appeared (a partition's *ordinal*); written only when partitions are added;
* per **shard** of :data:`SHARD` partitions (ordinal ``// SHARD``): each partition's rows
  appended, rows released with their final value, and last order key (the watermark); the rows
  whose released value is still provisional (their keys and value tags: the append that
  finalises them returns them with their keys); and the machines' open state, by **class**.

A class is a set of partitions whose online machines are at the same public position (the same
rows fed, the same phase of the algorithm): a batched machine (:attr:`StreamMachine.batchable`)
advances all of them at once, and its snapshot (arrays whose first axis is the partition) is
their state. A fleet appended a day at a time stays one class; an append that brings some
partitions more rows than others splits a class, and classes whose states line up again are
merged. Machines that release one partition at a time keep a class per partition.

Noise needs no storage: a draw is a function of the stream's key and its address. So an idle
partition of a laplace, hierarchy or ToPS stream costs its watermark, two counts and a few
numbers of machine state, stored column by column (runs and repeats compress to nothing).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dpsql import _state
from dpsql._chunks import table_bytes, table_of
from dpsql._memory import gathered, pooled_array
from dpsql.ledger.streams import PARTITION_HANDLES

#: Partitions per shard of the stored state: an append rewrites the shards it touches.
SHARD = 1 << 16


@dataclass
class MachineClass:
    """Partitions (positions in their shard, ascending) at one machine position, the snapshot of
    the batched machine over them (None: nothing fed yet) and the parameters their machine takes
    besides the stream's (a fleet's pooled threshold and each one's pooled rows; None: none yet)."""

    members: np.ndarray
    state: dict | None = None
    params: dict | None = None


@dataclass
class Shard:
    """The open state of the partitions ``index * SHARD ..`` (module docstring)."""

    index: int
    rows: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    final: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    watermark: pa.Array | None = None
    classes: list[MachineClass] = field(default_factory=list)
    #: rows released with a provisional value: ``position``, ``index`` (row within the partition),
    #: ``key`` and ``tag``, sorted by position then index
    pending: pa.Table | None = None
    #: count streams: the open buckets' event counts (``position``, ``bucket``, ``count``: secret)
    counts: pa.Table | None = None

    @property
    def size(self) -> int:
        return len(self.rows)

    def grow(self, count: int, key_type: pa.DataType) -> np.ndarray:
        """Add ``count`` partitions (nothing appended yet, one new class); their positions."""
        positions = np.arange(self.size, self.size + count, dtype=np.int64)
        self.rows = np.concatenate([self.rows, np.zeros(count, np.int64)])
        self.final = np.concatenate([self.final, np.zeros(count, np.int64)])
        nulls = pa.nulls(count, key_type)
        self.watermark = nulls if self.watermark is None else pa.concat_arrays([self.watermark.cast(key_type), nulls])
        self.classes.append(MachineClass(positions))
        return positions

    def pack(self) -> bytes:
        return _state.pack({
            "rows": self.rows, "final": self.final,
            "watermark": None if self.watermark is None else table_bytes(pa.table({"key": self.watermark})),
            "classes": [{"members": c.members, "state": c.state, "params": c.params} for c in self.classes],
            "pending": None if self.pending is None else table_bytes(self.pending),
            "counts": None if self.counts is None else table_bytes(self.counts)})

    @classmethod
    def unpack(cls, index: int, data: bytes) -> Shard:
        d = _state.unpack(data)
        return cls(index, np.asarray(d["rows"], np.int64), np.asarray(d["final"], np.int64),
                   None if d["watermark"] is None else table_of(d["watermark"])["key"].combine_chunks(),
                   [MachineClass(np.asarray(c["members"], np.int64), c["state"], c.get("params"))
                    for c in d["classes"]],
                   None if d["pending"] is None else table_of(d["pending"]),
                   None if d["counts"] is None else table_of(d["counts"]))


# -- Splitting and merging a class's state ---------------------------------------------------------
#
# A batched machine's snapshot holds each partition's numbers as arrays (and lists) whose first
# axis is the partition; every other item (a row count, a flag, None) is the class's, shared by
# its partitions.


def split_state(state, size: int, chosen: np.ndarray):
    """The snapshot of the partitions ``chosen`` (positions within the class) of a class of
    ``size`` partitions whose snapshot is ``state``."""
    if isinstance(state, dict):
        return {k: split_state(v, size, chosen) for k, v in state.items()}
    if isinstance(state, np.ndarray) and state.ndim and state.shape[0] == size:
        return state[chosen]
    if isinstance(state, list) and len(state) == size:
        return [state[int(j)] for j in chosen]
    return state


def merged_state(first, first_size: int, second, second_size: int):
    """The snapshot of two classes together (``first``'s partitions, then ``second``'s), or
    None when they are not at the same position (their shared items differ)."""
    missing = object()

    def merge(a, b):
        if isinstance(a, dict) and isinstance(b, dict):
            if a.keys() != b.keys():
                return missing
            out = {k: merge(a[k], b[k]) for k in a}
            return missing if any(v is missing for v in out.values()) else out
        a_rows = isinstance(a, np.ndarray) and a.ndim and a.shape[0] == first_size
        b_rows = isinstance(b, np.ndarray) and b.ndim and b.shape[0] == second_size
        if a_rows and b_rows:
            if a.shape[1:] != b.shape[1:] or a.dtype != b.dtype:
                return missing
            return np.concatenate([a, b])
        if isinstance(a, list) and isinstance(b, list) and len(a) == first_size and len(b) == second_size:
            return a + b
        if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
            same = isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.shape == b.shape and \
                np.array_equal(a, b)
            return a if same else missing
        return a if type(a) is type(b) and a == b else missing

    if first is None or second is None:
        return None
    out = merge(first, second)
    return None if out is missing else out


def merge_classes(classes: list[MachineClass], batchable: bool) -> list[MachineClass]:
    """``classes`` with those at one position joined (only for batched machines)."""
    if not batchable or len(classes) < 2:
        return classes
    out: list[MachineClass] = []
    for c in classes:
        for o in out:
            if o.params != c.params:
                continue
            state = merged_state(o.state, len(o.members), c.state, len(c.members))
            if state is not None or (o.state is None and c.state is None):
                order = np.argsort(np.concatenate([o.members, c.members]), kind="stable")
                o.members = np.concatenate([o.members, c.members])[order]
                o.state = None if state is None else split_state(state, len(order), order)
                break
        else:
            out.append(c)
    return out


# -- The whole state, as an append reads and writes it ----------------------------------------------

_FACTS, _DIRECTORY = -1, -2
_ADDRESS, _NOISE_ADDRESS, _FIRST_HANDLE = "__address", "__noise_address", "__first_handle"


class Fleet:
    """A stream's open state inside one append's transaction: its facts, its directory of
    partitions and the shards the append touches, read when first needed and written back by
    :meth:`commit` (only what changed). ``partition_by``: the stream's partition columns."""

    def __init__(self, store, conn, stream_row, partition_by: tuple[str, ...]):
        self._store, self._conn, self._row = store, conn, stream_row
        self._partition_by = partition_by
        facts = store.state(conn, stream_row.release_id, _FACTS)
        self.facts: dict = {"partitions": 0, "appends": 0} if facts is None else _state.unpack(facts)
        self._read: dict[int, bytes | None] = {}  # each shard's record as read (to write back only changes)
        self._directory: pa.Table | None = None
        self._directory_changed = False
        self._lookup: pa.Array | None = None
        self._shards: dict[int, Shard] = {}

    @property
    def partitions(self) -> int:
        return int(self.facts["partitions"])

    # -- the directory ------------------------------------------------------------------------

    @property
    def directory(self) -> pa.Table:
        """Every partition's key columns, address, noise address (streams converted from earlier
        versions) and first row handle, in ordinal order."""
        if self._directory is None:
            data = self._store.state(self._conn, self._row.release_id, _DIRECTORY)
            self._directory = None if data is None else table_of(data)
        if self._directory is None:
            raise LookupError("no partitions yet")
        return self._directory

    def in_order(self, key_columns: list[pa.Array]) -> bool:
        """Whether ``key_columns`` are every partition's keys in ordinal order (a fleet's day, its
        meters as they were first registered), value for value and of the directory's types:
        integers, text or times, whose equal values are one key (not floats: -0.0 equals 0.0). Their
        ordinals are then 0, 1, ... with no address computed."""
        if not self.partitions or len(key_columns[0]) != self.partitions:
            return False
        for name, column in zip(self._partition_by, key_columns):
            stored = self.directory[name]
            kind = column.type
            if kind != stored.type or not (pa.types.is_integer(kind) or pa.types.is_string(kind)
                                           or pa.types.is_large_string(kind) or pa.types.is_temporal(kind)):
                return False
            if not column.equals(stored.combine_chunks()):
                return False
        return True

    def ordinals(self, addresses: pa.Array) -> np.ndarray:
        """The ordinal of each address's partition, -1 where it has none yet."""
        if not self.partitions:
            return np.full(len(addresses), -1, dtype=np.int64)
        if self._lookup is None:
            self._lookup = self.directory[_ADDRESS].combine_chunks()
        if len(addresses) == len(self._lookup) and addresses.cast(self._lookup.type).equals(self._lookup):
            return np.arange(len(addresses), dtype=np.int64)  # every partition, in order (a fleet's day): no lookup
        found = pc.index_in(addresses, value_set=self._lookup)
        return found.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)

    def add_partitions(self, key_columns: list[pa.Array], addresses: pa.Array,
                       noise_addresses: pa.Array | None = None, first_handles: np.ndarray | None = None, *,
                       key_type: pa.DataType) -> np.ndarray:
        """Register new partitions (their key columns, one array per partition column, and their
        addresses), reserving their row handles and a place in their shards (watermarks of
        ``key_type``, the order key's); their ordinals."""
        count, first = len(addresses), self.partitions
        if first_handles is None:
            start = self._store.reserve_handles(self._conn, self._row, first, count)
            first_handles = start + PARTITION_HANDLES * np.arange(count, dtype=np.int64)
        names = [*self._partition_by, _ADDRESS, _FIRST_HANDLE]
        columns = [*key_columns, addresses.cast(pa.large_binary()), pa.array(first_handles, pa.int64())]
        if noise_addresses is not None or (first and _NOISE_ADDRESS in self.directory.column_names):
            names.append(_NOISE_ADDRESS)
            columns.append((addresses if noise_addresses is None else noise_addresses).cast(pa.large_binary()))
        added = pa.Table.from_arrays(columns, names=names)
        if first:
            directory = self.directory
            added = pa.concat_tables([directory, added.cast(directory.schema)])
        self._directory, self._directory_changed, self._lookup = added, True, None
        self.facts["partitions"] = first + count
        ordinals = np.arange(first, first + count, dtype=np.int64)
        for index in np.unique(ordinals // SHARD).tolist():
            self.shard(index).grow(int(np.count_nonzero(ordinals // SHARD == index)), key_type)
        return ordinals

    def keys(self, ordinals: np.ndarray) -> pa.Table:
        """The partition columns of the partitions ``ordinals``."""
        return self.directory.select(list(self._partition_by)).take(pa.array(ordinals))

    def noise_addresses(self, ordinals: np.ndarray) -> pa.Array:
        column = _NOISE_ADDRESS if _NOISE_ADDRESS in self.directory.column_names else _ADDRESS
        return self.directory[column].take(pa.array(ordinals)).combine_chunks()

    def first_handles(self, ordinals: np.ndarray) -> np.ndarray:
        return self.directory[_FIRST_HANDLE].take(pa.array(ordinals)).to_numpy()

    # -- shards ---------------------------------------------------------------------------------

    def shard(self, index: int) -> Shard:
        """Shard ``index``, read once in this append (and written back by :meth:`commit`)."""
        if index not in self._shards:
            data = self._read[index] = self._store.state(self._conn, self._row.release_id, index)
            self._shards[index] = Shard(index) if data is None else Shard.unpack(index, data)
        return self._shards[index]

    def commit(self) -> None:
        """Write back what this append changed: the shards it read, the directory when
        partitions were added, the facts."""
        release_id = self._row.release_id
        changed = self._directory_changed
        for index, shard in self._shards.items():
            data = shard.pack()
            if data != self._read[index]:  # (an append of repeats only changes nothing)
                self._store.save_state(self._conn, release_id, index, data)
                changed = True
        if changed:  # names the new state: a stream object keeps its machines warm while the ledger holds it
            self.facts["commit"] = secrets.token_hex(16)
        if self._directory_changed:
            self._store.save_state(self._conn, release_id, _DIRECTORY, table_bytes(self._directory))
        self._store.save_state(self._conn, release_id, _FACTS, _state.pack(self.facts))


def row_handles(first_handles: np.ndarray, ordinals: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """Each row's handle (``dp_row``): its partition's first handle plus its index; by arithmetic
    when the first handles are evenly spaced (partitions registered together, as a fleet's are:
    :data:`PARTITION_HANDLES` apart), where gathering millions of rows' first handles takes three
    times as long."""
    step = int(first_handles[1] - first_handles[0]) if len(first_handles) > 1 else 0
    if len(first_handles) > 1 and (np.diff(first_handles) == step).all():
        handles = np.multiply(ordinals, step, out=pooled_array(len(ordinals), np.int64), dtype=np.int64)
        handles += int(first_handles[0])
    else:
        handles = gathered(first_handles, ordinals)
    handles += indices
    return handles
