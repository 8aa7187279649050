"""What Spark's executors run for :mod:`dpsql.spark`: Arrow batches in, Arrow batches out (no
pyspark here).

Both jobs of a release read the same plan: the rows shuffled by partition key and sorted by
partition, then order key, so that a partition's rows are adjacent and in release order.
:func:`whole_partitions` cuts the batches Spark hands a task into tables of whole partitions;
:func:`check_batches` (before the charge) reports per partition its length, the digest of its
rows (:class:`dpsql.publishing.PartitionFingerprint`) and everything a release would refuse;
:func:`release_batches` (after it) releases whole partitions, many at once, through
:meth:`dpsql.publishing.PartitionTask.release`, which refuses rows whose digest was not checked.
A partition's rows are read here the same way for both (:func:`read_values`, :func:`read_counts`),
so a partition whose data did not change has the same digest in both jobs.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dpsql._validate import EXACT_INTEGERS
from dpsql.addresses import address_ranks, partition_addresses
from dpsql.errors import EnvironmentUnusable
from dpsql.partition_digests import PartitionFingerprint, changed_data
from dpsql.parts import Keys
from dpsql.publishing import PartitionTask
from dpsql.streams.holdout import pooled_by_key
from dpsql.timegrid import TimeDomain

#: The check job's columns after the partition columns (one row per partition), as Spark types.
CHECKED = {"rows": "long", "digest": "binary", "null_keys": "long", "nan_keys": "long", "repeated_key": "string",
           "null_values": "long", "bad_values": "long"}
#: The check's columns offering each partition's candidates for a fleet's pooled hold-out: order keys, values.
POOL_KEYS, POOL_VALUES = "pool_keys", "pool_values"
#: The count stream's input columns beside the partition columns: bucket index, events, events at a NaN time.
BUCKET, EVENTS, NAN_EVENTS = "__bucket", "__events", "__nan_events"


@dataclasses.dataclass
class Partitions:
    """Whole partitions as a release consumes them: partition ``k`` (key: row ``k`` of the key
    columns ``keys``, first row ``starts[k]`` of the batch read) has the values
    ``values[offsets[k]:offsets[k + 1]]`` (float64, in release order) and order keys whose
    canonical bytes are ``order_keys[k]``."""

    keys: list[pa.Array]
    starts: np.ndarray
    values: np.ndarray
    offsets: np.ndarray
    order_keys: list


def whole_partitions(batches: Iterable[pa.RecordBatch], partition_by: Sequence[str]
                     ) -> Iterator[tuple[pa.RecordBatch, np.ndarray]]:
    """Batches of whole partitions from ``batches`` (a partition's rows adjacent), each with the
    first row of each of its partitions: a partition cut between two batches is held back until
    its last row is read (rows are compared only within a batch and across its first row)."""
    held: list[pa.RecordBatch] = []
    held_rows = 0
    for batch in batches:
        if not batch.num_rows:
            continue
        starts = _partition_starts(batch, partition_by)
        if held and not _starts_a_partition(held[-1], batch, partition_by):
            starts = starts[1:]  # the batch begins with the rest of the held partition
        if not starts.size:
            held.append(batch)
            held_rows += batch.num_rows
            continue
        cut = int(starts[-1])
        offsets = np.concatenate([[0] if held else [], held_rows + starts]).astype(np.int64)
        if offsets.size > 1:
            yield _joined([*held, batch.slice(0, cut)]), offsets[:-1]
        held, held_rows = [batch.slice(cut)], batch.num_rows - cut
    if held:
        yield _joined(held), np.zeros(1, dtype=np.int64)


def _joined(batches: list[pa.RecordBatch]) -> pa.RecordBatch:
    return batches[0] if len(batches) == 1 else pa.Table.from_batches(batches).combine_chunks().to_batches()[0]


def _changes(column: pa.Array) -> np.ndarray:
    """For each pair of adjacent values, whether they differ (two NULLs are equal, NaN differs)."""
    after, before = column.slice(1), column.slice(0, len(column) - 1)
    unequal = pc.fill_null(pc.not_equal(after, before), False)
    return pc.or_(unequal, pc.not_equal(pc.is_null(after), pc.is_null(before))).to_numpy(zero_copy_only=False)


def _partition_starts(batch: pa.RecordBatch, partition_by: Sequence[str]) -> np.ndarray:
    changed = np.zeros(batch.num_rows - 1, dtype=bool)
    for column in partition_by:
        changed |= _changes(batch.column(column))
    return np.concatenate([[0], np.flatnonzero(changed) + 1]).astype(np.int64)


def _starts_a_partition(before: pa.RecordBatch, batch: pa.RecordBatch, partition_by: Sequence[str]) -> bool:
    """Whether ``batch``'s first row belongs to another partition than ``before``'s last."""
    return any(_changes(pa.concat_arrays([before.column(c).slice(before.num_rows - 1), batch.column(c).slice(0, 1)]))[0]
               for c in partition_by)


def _keys(table: pa.RecordBatch, starts: np.ndarray, partition_by: Sequence[str]) -> list[pa.Array]:
    """The key columns of the partitions starting at ``starts``."""
    return [table.column(c).take(starts) for c in partition_by]


def _usable(keys: Sequence[pa.Array]) -> np.ndarray:
    """Which partitions have a key that can address noise (no NULL, no NaN: the check refuses both)."""
    usable = np.ones(len(keys[0]), dtype=bool)
    for column in keys:
        usable &= column.is_valid().to_numpy(zero_copy_only=False)
        if pa.types.is_floating(column.type):
            usable &= ~pc.fill_null(pc.is_nan(column), False).to_numpy(zero_copy_only=False)
    return usable


def _per_partition(mask: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """How many rows of each partition ``mask`` marks."""
    return np.add.reduceat(mask.astype(np.int64), starts) if mask.size else np.zeros(len(starts), np.int64)


def _canonical_keys(column: pa.Array, starts: np.ndarray, offsets: np.ndarray) -> list[tuple]:
    """Each partition's order keys as bytes that identify them exactly: its number of NULLs, then
    fixed-width values as stored (times as integers, booleans as bytes), or text and binary as
    lengths and bytes."""
    nulls = _per_partition(column.is_null().to_numpy(zero_copy_only=False), starts)
    bounds = offsets.tolist()
    pairs = list(enumerate(itertools.pairwise(bounds)))
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type) or pa.types.is_binary(
            column.type) or pa.types.is_large_binary(column.type):
        column = column.cast(pa.large_binary())
        ends = np.frombuffer(column.buffers()[1], np.int64)[column.offset:column.offset + len(column) + 1]
        data = column.buffers()[2]
        text = np.frombuffer(data, np.uint8) if data is not None else np.zeros(0, np.uint8)
        return [(nulls[k:k + 1], np.diff(ends[a:b + 1]), text[ends[a]:ends[b]]) for k, (a, b) in pairs]
    if pa.types.is_boolean(column.type):  # stored as bits
        column = column.cast(pa.int8())
    width = column.type.bit_width // 8
    stored = np.frombuffer(column.buffers()[1], np.uint8)[column.offset * width:(column.offset + len(column)) * width]
    return [(nulls[k:k + 1], stored[a * width:b * width]) for k, (a, b) in pairs]


def _floats(column: pa.Array) -> np.ndarray:
    """The values as float64, NULLs as NaN (refused by the check; a digest over them differs)."""
    return np.ascontiguousarray(pc.cast(column, pa.float64(), safe=False).to_numpy(zero_copy_only=False))


def read_values(table: pa.RecordBatch, starts: np.ndarray, *, partition_by: Sequence[str], order_by: str,
                value: str) -> Partitions:
    """A range release's whole partitions: each row's value, in order-key order (the plan's)."""
    offsets = np.append(starts, table.num_rows)
    return Partitions(_keys(table, starts, partition_by), starts, _floats(table.column(value)), offsets,
                      _canonical_keys(table.column(order_by), starts, offsets))


def read_counts(table: pa.RecordBatch, starts: np.ndarray, *, partition_by: Sequence[str], domain: TimeDomain
                ) -> Partitions:
    """A count release's whole partitions: each one's events per bucket of ``domain``, every
    bucket (0 where none); partitions with no event in the domain release nothing."""
    buckets = table.column(BUCKET).to_numpy(zero_copy_only=False)
    inside = (buckets >= 0) & (buckets < domain.n_buckets)  # NULL buckets (NaN) are outside
    partition = np.repeat(np.arange(len(starts)), np.diff(np.append(starts, table.num_rows)))
    released = np.unique(partition[inside])
    slot = np.full(len(starts), -1)
    slot[released] = np.arange(len(released))
    n = domain.n_buckets
    counts = np.zeros((len(released), n))
    counts[slot[partition[inside]], buckets[inside].astype(np.int64)] = _floats(table.column(EVENTS))[inside]
    return Partitions(_keys(table, starts[released], partition_by), starts[released], counts.ravel(),
                      np.arange(len(released) + 1, dtype=np.int64) * n, [()] * len(released))


def check_batches(batches: Iterable[pa.RecordBatch], *, fingerprint: PartitionFingerprint,
                  partition_by: Sequence[str], read: Callable[..., Partitions], version: str,
                  order_by: str | None = None, value: str | None = None, pool: tuple[int, int] | None = None
                  ) -> Iterator[pa.RecordBatch]:
    """The check job (before the charge): one row per partition with its partition columns and
    :data:`CHECKED`: its rows (events, for counts), the digest of what its release consumes (NULL
    when it releases nothing) and what a release refuses (NULL and NaN order keys or event times,
    the first order key repeated within it, NULL values, NaN, infinite values or integers beyond
    2**53). ``order_by`` and ``value`` name a range release's columns; without
    them the batches hold a count stream's events per bucket. ``version``: the driver's dpsql,
    which must be this one (the release's tasks must read and digest rows as the check does).
    ``pool``: ``(rows, holdout)`` when the release pools a hold-out of ``holdout`` rows for the
    fleet: each partition then also offers its first ``rows`` rows as candidates
    (:data:`POOL_KEYS`, :data:`POOL_VALUES`; :func:`pool_candidates`)."""
    _refuse_other_version(version)
    for table, starts in whole_partitions(batches, partition_by):
        yield _checked(table, starts, read(table, starts), fingerprint, partition_by, order_by, value, pool)


def _refuse_other_version(version: str) -> None:
    from dpsql import __version__

    if __version__ != version:
        raise EnvironmentUnusable(f"this executor runs dpsql {__version__}, the driver dpsql {version}: install the "
                                  "same version on both")


def _checked(table: pa.RecordBatch, starts: np.ndarray, parts: Partitions, fingerprint: PartitionFingerprint,
             partition_by: Sequence[str], order_by: str | None, value: str | None, pool: tuple[int, int] | None
             ) -> pa.RecordBatch:
    digests: list = [None] * len(starts)
    usable = _usable(parts.keys)  # the others are refused on the driver
    addresses = [b""] * len(parts.starts)  # (an unusable key's digest is never used)
    if usable.any():
        chosen = np.flatnonzero(usable).tolist()
        for j, address in zip(chosen, partition_addresses([c.take(chosen) for c in parts.keys]).to_pylist()):
            addresses[j] = address
        found = fingerprint.digests(addresses, parts.values, parts.offsets, parts.order_keys)
        place = np.searchsorted(starts, parts.starts)  # a read partition's place among the batch's
        for j in chosen:
            digests[place[j]] = found[j]
    problems = _range_problems(table, starts, order_by, value) if value is not None else _count_problems(table, starts)
    columns = {**{c: table.column(c).take(starts) for c in partition_by}, **problems,
               "digest": pa.array(digests, pa.binary())}
    names = [*partition_by, *CHECKED]  # Spark's order
    if pool is not None and order_by is not None:  # (a range release: its partitions are the batch's)
        offered = usable & (problems["null_keys"] == 0) & (problems["nan_keys"] == 0)
        columns.update(pool_candidates(table.column(order_by), parts, pa.array(addresses, pa.large_binary()),
                                       offered, *pool))
        names += [POOL_KEYS, POOL_VALUES]
    return pa.RecordBatch.from_pydict({c: columns[c] for c in names})


def pool_candidates(order: pa.Array, parts: Partitions, addresses: pa.Array, offered: np.ndarray, rows: int,
                    holdout: int) -> dict[str, pa.Array]:
    """Each partition's candidates for a fleet's pooled hold-out (the fleet's ``holdout`` earliest
    rows by order key ``order``, ties by partition address ``addresses``): the first ``rows`` rows
    of each ``offered`` partition, less those that come after ``holdout`` candidates of this
    task (the fleet's earliest rows are among the earliest of any part of it), as lists of order
    keys (:data:`POOL_KEYS`) and values (:data:`POOL_VALUES`), one per partition."""
    first = np.where(offered, np.minimum(np.diff(parts.offsets), rows), 0)
    owner = np.repeat(np.arange(len(first)), first)
    within = np.arange(int(first.sum())) - np.repeat(np.cumsum(first) - first, first)
    candidates = np.repeat(parts.offsets[:-1], first) + within
    taken = pooled_by_key(order.take(candidates), owner, address_ranks(addresses), holdout, len(first))
    chosen = candidates[within < taken[owner]]
    offsets = pa.array(np.concatenate([[0], np.cumsum(taken)]), pa.int32())
    return {POOL_KEYS: pa.ListArray.from_arrays(offsets, order.take(chosen)),
            POOL_VALUES: pa.ListArray.from_arrays(offsets, pa.array(parts.values[chosen], pa.float64()))}


def _range_problems(table: pa.RecordBatch, starts: np.ndarray, order_by: str, value: str) -> dict:
    """A range release's rows and refusals per partition."""
    order = table.column(order_by)
    lengths = np.diff(np.append(starts, table.num_rows))
    repeated = np.zeros(table.num_rows, dtype=bool)
    if table.num_rows > 1:
        repeated[1:] = ~_changes(order) & ~order.is_null().to_numpy(zero_copy_only=False)[1:]
    repeated[starts] = False  # the first row of a partition repeats nothing
    shown: list = [None] * len(starts)
    for k in np.flatnonzero(_per_partition(repeated, starts)).tolist():
        shown[k] = repr(order[int(starts[k] + np.argmax(repeated[starts[k]:starts[k] + lengths[k]]))].as_py())
    values = table.column(value)
    null_values = values.is_null().to_numpy(zero_copy_only=False)
    if pa.types.is_floating(values.type):
        bad = ~np.isfinite(_floats(values)) & ~null_values
    elif pa.types.is_integer(values.type):
        beyond = pc.or_(pc.greater(values, EXACT_INTEGERS), pc.less(values, -EXACT_INTEGERS))
        bad = pc.fill_null(beyond, False).to_numpy(zero_copy_only=False)
    else:
        bad = np.zeros(table.num_rows, dtype=bool)
    return {"rows": lengths, "null_keys": _per_partition(order.is_null().to_numpy(zero_copy_only=False), starts),
            "nan_keys": _nan_keys(order, starts), "repeated_key": pa.array(shown, pa.string()),
            "null_values": _per_partition(null_values, starts),
            "bad_values": _per_partition(bad, starts)}


def _nan_keys(order: pa.Array, starts: np.ndarray) -> np.ndarray:
    if not pa.types.is_floating(order.type):
        return np.zeros(len(starts), np.int64)
    return _per_partition(pc.fill_null(pc.is_nan(order), False).to_numpy(zero_copy_only=False), starts)


def _count_problems(table: pa.RecordBatch, starts: np.ndarray) -> dict:
    """A count release's events and refusals per partition (events without a time, or at NaN)."""
    events = table.column(EVENTS).to_numpy(zero_copy_only=False)
    nan = table.column(NAN_EVENTS).to_numpy(zero_copy_only=False)
    timeless = np.where(table.column(BUCKET).is_null().to_numpy(zero_copy_only=False), events - nan, 0)
    zeros = np.zeros(len(starts), np.int64)
    return {"rows": np.add.reduceat(events, starts), "null_keys": np.add.reduceat(timeless, starts),
            "nan_keys": np.add.reduceat(nan, starts), "repeated_key": pa.nulls(len(starts), pa.string()),
            "null_values": zeros, "bad_values": zeros}


def release_batches(batches: Iterable[pa.RecordBatch], *, task: PartitionTask, partition_by: Sequence[str],
                    read: Callable[..., Partitions], output: Callable[..., pa.RecordBatch], version: str
                    ) -> Iterator[pa.RecordBatch]:
    """The release job (after the charge): whole partitions at a time, each released only if its
    rows are those checked before the charge (else :class:`dpsql.errors.DataChanged`), by the
    driver's version of dpsql (an executor added since the check may run another)."""
    _refuse_other_version(version)
    for table, starts in whole_partitions(batches, partition_by):
        parts = read(table, starts)
        if not len(parts.starts):
            continue
        unusable = np.flatnonzero(~_usable(parts.keys))
        if unusable.size:  # a NULL or NaN key now: the check found none
            raise changed_data(Keys(parts.keys)[int(unusable[0])])
        yield output(table, parts, task.release(parts.keys, parts.values, parts.offsets, parts.order_keys))


def released_rows(table: pa.RecordBatch, parts: Partitions, values: np.ndarray, *, partition_by: Sequence[str],
                  order_by: str, value: str) -> pa.RecordBatch:
    """A range release's output: its partition columns, order key and private value per row."""
    return pa.RecordBatch.from_pydict({**{c: table.column(c) for c in [*partition_by, order_by]},
                                       value: pa.array(values, pa.float64())})


def released_counts(table: pa.RecordBatch, parts: Partitions, values: np.ndarray, *, partition_by: Sequence[str],
                    order_by: str, count: str, domain: TimeDomain) -> pa.RecordBatch:
    """A count release's output: every bucket of the domain per released partition."""
    rows = np.repeat(parts.starts, domain.n_buckets)
    starts = domain.bucket_starts()
    times = pa.array(starts).cast(pa.timestamp("us")) if domain.datetime else pa.array(starts, pa.float64())
    return pa.RecordBatch.from_pydict({**{c: table.column(c).take(rows) for c in partition_by},
                                       order_by: pa.concat_arrays([times] * len(parts.starts)),
                                       count: pa.array(values, pa.float64())})
