"""A stream's released rows and partitions as the ledger keeps them, read back.

Released rows come in chunks: one per append for all partitions (``dp_partition`` the
partition's ordinal, ``dp_index`` the row within it, ``key``, ``value``, ``dp_final``, the value's
short tag ``dp_tag``), or, for streams stored by earlier versions, one per append and partition
(the partition and its first row given by the chunk's place; every row final, 64-bit tags). A row
released provisionally appears again, final, in a later chunk: the latest version of a row is its
value. Streams stored per partition are converted to the columnar state
(:mod:`dpsql.continual.fleet`) by their next append (:func:`convert`).
"""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np
import polars as pl
import pyarrow as pa

from dpsql._chunks import table_of
from dpsql.addresses import partition_addresses
from dpsql.continual.fleet import SHARD, Fleet, MachineClass, Shard, merge_classes
from dpsql.continual.state import FINAL, TAG, PartitionState, arrow_type, short_tags, stored_keys
from dpsql.errors import ConflictingRow, LateRow

#: Columns every normalised chunk has, in this order (public columns of count machines follow).
COLUMNS = ("dp_partition", "dp_index", "key", "value", FINAL, TAG)


def normalized(ordinal: int, first_row: int, data: bytes) -> pa.Table:
    """A stored chunk with the columns :data:`COLUMNS` (and its public columns)."""
    table = table_of(data)
    if ordinal < 0:
        return table
    n = table.num_rows
    tags = table[TAG].to_numpy() if TAG in table.column_names else np.zeros(n, np.uint64)
    columns = {"dp_partition": pa.array(np.full(n, ordinal, np.int64)),
               "dp_index": pa.array(first_row + np.arange(n, dtype=np.int64)), "key": table["key"],
               "value": table["value"], FINAL: pa.array(np.ones(n, bool)), TAG: pa.array(short_tags(tags))}
    columns.update({c: table[c] for c in table.column_names if c.startswith("dp_") and c != TAG})
    return pa.table(columns)


def latest(chunks: list[pa.Table]) -> pa.Table | None:
    """The rows of ``chunks`` (oldest first), each row's latest version only, by partition and row."""
    if not chunks:
        return None
    table = pa.concat_tables(chunks, promote_options="permissive") if len(chunks) > 1 else chunks[0]
    if not table.num_rows:
        return table
    ordinal = table["dp_partition"].to_numpy()
    index = table["dp_index"].to_numpy()
    order = np.lexsort((np.arange(len(index)), index, ordinal))  # by row, versions oldest first
    ordinal, index = ordinal[order], index[order]
    last = np.append((ordinal[1:] != ordinal[:-1]) | (index[1:] != index[:-1]), True)
    chosen = order[last]
    return table if len(chosen) == table.num_rows and (np.diff(chosen) == 1).all() else table.take(pa.array(chosen))


def directory(store, conn, stream_row, partition_by) -> pa.Table | None:
    """The stream's directory of partitions (key columns, ``__address``, ``__first_handle``), also
    for a stream still stored per partition (read as it is); None before any partition."""
    fleet = Fleet(store, conn, stream_row, tuple(partition_by))
    if fleet.partitions:
        return fleet.directory
    legacy = store.legacy_partitions(conn, stream_row.release_id)
    if not legacy:
        return None
    return _legacy_directory(legacy, partition_by)[0]


def _legacy_directory(legacy, partition_by) -> tuple[pa.Table, pa.Array]:
    """The directory of partitions stored one row each, and the addresses their noise was drawn
    from (which earlier versions derived otherwise)."""
    columns = {}
    for i, column in enumerate(partition_by):
        values, kinds = [], None
        for part in legacy:
            key = json.loads(part.key_text)
            values.append(key["values"][i])
            kinds = kinds or key["types"][i]
        # dates and times were kept as text (JSON): Arrow parses them back
        columns[column] = pa.array(values).cast(arrow_type(kinds))
    keys = pa.table(columns) if columns else None
    addresses = partition_addresses(list(keys.columns)) if keys is not None else pa.array([b""], pa.large_binary())
    table = pa.table({**columns, "__address": addresses.cast(pa.large_binary()),
                      "__first_handle": pa.array([p.first_handle for p in legacy], pa.int64())})
    return table, pa.array([p.address for p in legacy], pa.large_binary())


def convert(fleet: Fleet, store, conn, stream_row, partition_by, batchable: bool) -> None:
    """Convert a stream stored one row per partition (earlier versions) to the columnar state, in
    the transaction of the append that found it: each partition's machine, counts, pending keys
    and tags kept as they were, its noise still drawn from the address it was drawn from."""
    legacy = store.legacy_partitions(conn, stream_row.release_id)
    table, noise_addresses = _legacy_directory(legacy, partition_by)
    keys = table.select(list(partition_by))
    fleet.add_partitions(list(keys.columns), table["__address"].combine_chunks(), noise_addresses,
                         first_handles=table["__first_handle"].to_numpy(), key_type=pa.null())
    closed = 0
    for part in legacy:
        shard = fleet.shard(part.ordinal // SHARD)
        position = part.ordinal - shard.index * SHARD
        state = PartitionState.unpack(part.state)
        watermark = None if part.watermark is None else stored_keys(part.watermark)
        if watermark is not None:
            shard.watermark = _typed_watermark(shard, watermark)
            shard.watermark = _put(shard.watermark, position, watermark)
        shard.rows[position], shard.final[position] = state.fed, part.rows
        closed = max(closed, state.fed)
        shard.classes = [c for c in shard.classes if position not in c.members.tolist()] + [
            MachineClass(np.array([position]), state.machine)]
        if state.pending_keys:
            pending = stored_keys(state.pending_keys)
            rows = pa.table({"position": pa.array(np.full(len(pending), position, np.int64)),
                             "index": pa.array(part.rows + np.arange(len(pending), dtype=np.int64)),
                             "key": pending, TAG: pa.array(short_tags(state.pending_tags))})
            shard.pending = rows if shard.pending is None else pa.concat_tables([shard.pending, rows])
        if state.counts:
            buckets = sorted(state.counts)
            rows = pa.table({"position": pa.array(np.full(len(buckets), position, np.int64)),
                             "bucket": pa.array(np.array(buckets, np.int64)),
                             "count": pa.array([state.counts[b] for b in buckets], pa.float64())})
            shard.counts = rows if shard.counts is None else pa.concat_tables([shard.counts, rows])
    for index in range(-(-fleet.partitions // SHARD)):
        shard = fleet.shard(index)
        shard.classes = merge_classes(sorted(shard.classes, key=lambda c: int(c.members[0])), batchable)
    fleet.facts["closed"] = closed
    fleet.facts["threshold_by"] = "partition"  # earlier versions chose a threshold per partition
    store.drop_legacy_partitions(conn, stream_row.release_id)


def _typed_watermark(shard: Shard, watermark: pa.Array) -> pa.Array:
    if shard.watermark is None or pa.types.is_null(shard.watermark.type):
        return pa.nulls(shard.size, watermark.type)
    return shard.watermark


def _put(column: pa.Array, position: int, value: pa.Array) -> pa.Array:
    values = column.to_pylist()
    values[position] = value[0].as_py()
    return pa.array(values, column.type)


def recorded_rows(chunks, ordinals: np.ndarray, keys: pa.Array) -> tuple[pa.Table | None, np.ndarray]:
    """The latest recorded version of each row ``keys[i]`` of partition ``ordinals[i]``, reading
    ``chunks`` (newest first: the first version found is the latest) back only until every row is
    found; and where each row's version is in that table (-1: none recorded)."""
    where = np.full(len(keys), -1, np.int64)
    found, taken = [], 0
    wanted = np.arange(len(keys))
    partitions = np.unique(ordinals)
    for chunk_ordinal, first_row, _rows, data in chunks:
        if chunk_ordinal >= 0 and not np.isin(chunk_ordinal, partitions):  # an earlier version's chunk
            continue
        table = normalized(chunk_ordinal, first_row, data)
        hit, at = matching(ordinals[wanted], keys.take(pa.array(wanted)), table["dp_partition"], table["key"])
        if len(hit):
            found.append(table.take(pa.array(at)))
            where[wanted[hit]] = taken + np.arange(len(hit))
            taken += len(hit)
            wanted = np.delete(wanted, hit)
        if not len(wanted):
            break
    if not found:
        return None, where
    return (pa.concat_tables(found, promote_options="permissive") if len(found) > 1 else found[0]), where


def matching(ordinals: np.ndarray, keys: pa.Array, table_ordinals, table_keys) -> tuple[np.ndarray, np.ndarray]:
    """The pairs ``(i, j)`` with ``(ordinals[i], keys[i]) == (table_ordinals[j], table_keys[j])``
    (each pair in the table at most once), as two arrays: a join, in Polars."""
    if not len(keys) or not len(table_keys):
        return np.empty(0, np.int64), np.empty(0, np.int64)
    table_keys = table_keys.combine_chunks() if isinstance(table_keys, pa.ChunkedArray) else table_keys
    left = pl.from_arrow(pa.table({"p": pa.array(np.asarray(ordinals, np.int64)), "k": keys.cast(table_keys.type),
                                   "i": pa.array(np.arange(len(keys)))}))
    right = pl.from_arrow(pa.table({"p": pa.array(np.asarray(table_ordinals, np.int64)), "k": table_keys,
                                    "j": pa.array(np.arange(len(table_keys)))}))
    pairs = left.join(right, on=["p", "k"], how="inner")
    return pairs["i"].to_numpy(), pairs["j"].to_numpy()


def repeated(chunks, shard: Shard, ordinals: np.ndarray, keys: pa.Array, watermarks: pa.Array, label: str, *,
             tags: np.ndarray | None = None,
             release: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None) -> pa.Table | None:
    """The recorded rows (read from ``chunks``, newest first) that the rows ``keys`` of partitions
    ``ordinals`` (at or below their ``watermarks``; all in ``shard``) repeat; refuses any that is
    not a repeat (:class:`~dpsql.LateRow`) or repeats a key with another value
    (:class:`~dpsql.ConflictingRow`). Another value is told by the values' ``tags``, or by
    ``release(rows, indices)``: the releases of rows ``rows`` as the rows ``indices`` of their
    partitions, against the recorded releases (streams that keep no tags: nothing of theirs is
    ever pending). Rows appended but never released (pending in a stream converted from an
    earlier version) are repeats with nothing to return."""
    recorded, where = recorded_rows(chunks, ordinals, keys)
    found = where >= 0
    differs = np.zeros(len(keys), bool)
    if release is not None:
        if recorded is not None:
            again = release(np.flatnonzero(found), recorded["dp_index"].to_numpy()[where[found]])
            differs[found] = again.view(np.int64) != recorded["value"].to_numpy()[where[found]].view(np.int64)
    else:
        recorded_tags = np.zeros(len(keys), np.int64)
        if recorded is not None:
            recorded_tags[found] = recorded[TAG].to_numpy()[where[found]]
        if shard.pending is not None and not found.all():
            missing = np.flatnonzero(~found)
            pending = shard.pending
            wanted, at = matching(ordinals[missing] - shard.index * SHARD, keys.take(pa.array(missing)),
                                  pending["position"], pending["key"])
            recorded_tags[missing[wanted]] = pending[TAG].to_numpy()[at]
            found[missing[wanted]] = True
        differs = found & (recorded_tags != tags)
    if differs.any():
        raise ConflictingRow(f"{label}: order key {keys[int(np.flatnonzero(differs)[0])].as_py()!r} was appended "
                             "before with another value; a released row never changes (nothing of this append was "
                             "kept)")
    if not found.all():
        late = int(np.flatnonzero(~found)[0])
        raise LateRow(f"{label}: a row with order key {keys[late].as_py()!r} arrives at or below its partition's "
                      f"watermark {watermarks[late].as_py()!r} and repeats no row appended before; nothing of this "
                      "append was kept")
    return recorded
