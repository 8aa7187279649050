"""Stream order -- by partition, then time -- for integer-like keys, without a comparison sort
where the keys allow it. Both front ends use it on rows that arrive in physical order.

One int64 key per row orders partition and time at once::

    key = (partition - first_partition) * span + (time - first_time) // step

``step`` is the greatest common divisor of the times' distances from the first time (an
hourly grid of microsecond timestamps has step 3.6e9) and ``span`` the number of steps the
times cover plus one. Then:

* keys that fill at least half of ``[0, max key]`` -- a regular time grid, the usual layout
  of meter readings and traffic counts, with or without gaps -- are *placed*: each row is
  written into its key's slot, no comparison at all;
* sparser keys are sorted as one int64 column, each row's index packed into the low bits
  (a plain sort, several times faster than an argsort; keys too wide for that take two
  such sorts, one per digit);
* keys that do not fit one int64 (times or partition ids spanning about 2**62) give
  ``None``: the caller sorts by its columns.

Every path refuses a time key repeated within a partition (:class:`InvalidTimeKey`).
On the placing path, the common one, full-length arrays come from Arrow's memory pool and
element-wise steps run in pieces that stay in cache: on a virtual machine, fresh memory
(page faults, zeroing) costs more than the arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import polars as pl

from dpsql._memory import count_into, pooled_array
from dpsql.errors import InvalidTimeKey

#: Keys fill at least 1/PLACE_SPARSITY of their range to be placed instead of sorted.
PLACE_SPARSITY = 2
#: Rows per piece of the element-wise steps.
PIECE = 1 << 16


@dataclass(frozen=True)
class StreamOrder:
    """Rows in stream order: ``values`` (float64) by partition then time, partition ``j``
    at positions ``offsets[j]:offsets[j + 1]``; ``permutation[i]`` is the physical row at
    position ``i`` (when asked for, else None). :meth:`times` and :meth:`partition_ids` give the keys
    in that order."""

    values: np.ndarray
    offsets: np.ndarray
    permutation: np.ndarray | None
    keys: np.ndarray
    span: int
    step: int
    first_time: int
    first_partition: int | None

    def times(self) -> np.ndarray:
        """The int64 time keys in stream order, as given."""
        times = pooled_array(len(self.keys), np.int64)
        for start in range(0, len(times), PIECE):
            piece = times[start:start + PIECE]
            np.remainder(self.keys[start:start + PIECE], self.span, out=piece)
            if self.step > 1:
                piece *= self.step
            piece += self.first_time
        return times

    def partition_ids(self) -> np.ndarray:
        """Each partition's id (as given), one per partition."""
        return self.keys[self.offsets[:-1]] // self.span + self.first_partition

    def partition_column(self) -> np.ndarray:
        """Each position's partition id (as given): :meth:`partition_ids` repeated over the
        partitions' rows, in a pooled array (``np.repeat`` would take fresh memory)."""
        column = pooled_array(len(self.keys), np.int64)
        column.fill(0)
        column[self.offsets[:-1]] = np.diff(self.partition_ids(), prepend=0)
        return np.cumsum(column, out=column)


def order_integer_keys(time: Sequence[np.ndarray], values: np.ndarray, *,
                       partition: Sequence[np.ndarray] | None = None, permutation: bool = False,
                       refuse_duplicate: Callable[[int, int | None], None]) -> StreamOrder | None:
    """Put rows in stream order by integer keys, or return None when they do not fit one
    int64 key (the times span ``2**62`` or more, or the partition ids times the time steps
    reach ``2**62``) or there are more than ``2**32`` rows; the caller then sorts by its own
    columns.

    Parameters
    ----------
    time : sequence of numpy.ndarray
        The time key of each row as integers of any width (the physical integers of dates
        and timestamps), in consecutive non-empty pieces (Arrow chunks, or one array); at
        least one row.
    values : numpy.ndarray
        float64, one per row, moved along.
    partition : sequence of numpy.ndarray, optional
        Integer partition ids, cut into pieces exactly as ``time``; partitions come in
        increasing id order.
    permutation : bool
        Also give each position's physical row (a front end returning rows in their
        physical order needs it).
    refuse_duplicate : callable
        ``(time, partition id or None)`` of a time key found twice within a partition: raises
        the front end's :class:`InvalidTimeKey` naming the columns and the value.

    Examples
    --------
    >>> from dpsql.errors import InvalidTimeKey
    >>> def refuse(time, partition):
    ...     raise InvalidTimeKey(f"time {time} repeats in partition {partition}")
    >>> order = order_integer_keys([np.array([30, 10, 20, 10])], np.array([3.0, 1.0, 2.0, 5.0]),
    ...                            partition=[np.array([7, 7, 7, 8])], refuse_duplicate=refuse)
    >>> order.values, order.offsets, order.times(), order.partition_ids()
    (array([1., 2., 3., 5.]), array([0, 3, 4]), array([10, 20, 30, 10]), array([7, 8]))
    >>> order_integer_keys([np.array([10, 10])], np.ones(2), partition=[np.array([4, 4])], refuse_duplicate=refuse)
    Traceback (most recent call last):
    ...
    dpsql.errors.InvalidTimeKey: time 10 repeats in partition 4
    """
    n = len(values)
    if n > 2**32:  # the row index and a radix digit would not fit one int64 together
        return None
    first_time, last_time = min(int(t.min()) for t in time), max(int(t.max()) for t in time)
    if last_time - first_time >= 2**62:
        return None
    step = _common_step(time, first_time)
    span = (last_time - first_time) // step + 1
    first_partition = None
    if partition is not None:
        first_partition = min(int(p.min()) for p in partition)
        if (max(int(p.max()) for p in partition) - first_partition + 1) * span >= 2**62:
            return None
    keys, top, ascending = _keys(time, partition, first_time, step, span, first_partition, n)

    def refuse(key: int):
        refuse_duplicate(first_time + key % span * step,
                         None if partition is None else key // span + first_partition)

    if ascending:
        rows = np.arange(n) if permutation else None
    elif top < PLACE_SPARSITY * n:
        rows, keys, values = _place(keys, values, top, permutation, refuse)
    else:
        rows, keys, values = _sort_packed(keys, values, top, refuse)
        rows = rows if permutation else None
    offsets = np.array([0, n]) if partition is None else _partition_offsets(keys, span)
    return StreamOrder(values=values, offsets=offsets, permutation=rows, keys=keys, span=span, step=step,
                       first_time=first_time, first_partition=first_partition)


def _common_step(time: Sequence[np.ndarray], first_time: int) -> int:
    """The greatest common divisor of the times' distances from ``first_time`` (1 if none)."""
    step = 0
    for piece_times in time:
        for at in range(0, len(piece_times), PIECE):
            distances = np.subtract(piece_times[at:at + PIECE], first_time, dtype=np.int64)  # int8 keys too
            step = int(np.gcd.reduce(distances, initial=step))
            if step == 1:
                return 1
    return max(step, 1)


def _keys(time, partition, first_time: int, step: int, span: int, first_partition: int | None, n: int):
    """Every row's key (in a pooled array), the largest one, and whether they already ascend."""
    keys = pooled_array(n, np.int64)
    top, ascending, previous = -1, True, -1
    start = 0
    for index, piece_times in enumerate(time):
        for at in range(0, len(piece_times), PIECE):
            stop = min(at + PIECE, len(piece_times))
            out = keys[start + at:start + stop]
            np.subtract(piece_times[at:stop], first_time, out=out, dtype=np.int64)
            if step > 1:
                out //= step
            if partition is not None:
                ids = np.subtract(partition[index][at:stop], first_partition, dtype=np.int64)
                ids *= span
                out += ids
            top = max(top, int(out.max()))
            if ascending:
                ascending = previous < out[0] and bool(np.all(out[1:] > out[:-1]))
                previous = out[-1]
        start += len(piece_times)
    return keys, top, ascending


def _place(keys: np.ndarray, values: np.ndarray, top: int, permutation: bool, refuse: Callable[[int], None]):
    """Order by small non-negative keys by writing each row into its key's slot (random
    writes are much cheaper than the random reads of a gather)."""
    n = len(keys)
    if permutation:
        # pooled, not fresh: a column-sized array's pages would each be faulted in again
        slot = pooled_array(top + 1, np.int64)
        slot.fill(-1)
        slot[keys] = count_into(pooled_array(n, np.int64))
        filled = np.greater_equal(slot, 0, out=pooled_array(top + 1, np.bool_))
    else:
        filled = pooled_array(top + 1, np.bool_)
        filled.fill(False)
        filled[keys] = True
    if np.count_nonzero(filled) < n:
        refuse(int(np.argmax(np.bincount(keys) > 1)))
    placed = pooled_array(top + 1, np.float64)
    placed[keys] = values
    if top + 1 == n:  # every slot filled: the slots are the stream order, and the keys 0 .. n - 1
        count_into(keys)
        return (slot if permutation else None), keys, placed
    return (slot[filled] if permutation else None), np.flatnonzero(filled), placed[filled]


def _sort_packed(keys: np.ndarray, values: np.ndarray, top: int, refuse: Callable[[int], None]):
    """Order by non-negative keys up to ``top < 2**62`` with plain int64 sorts.

    Each row's index goes into the low ``bits`` bits of its key (``bits`` enough for the
    row count), so one sort gives both the order and the permutation, and rows with equal
    keys keep their order. Keys wider than the ``63 - bits`` bits left are sorted in two
    such passes, low digit first, then high digit (a least-significant-digit radix sort:
    the second pass keeps the first one's order among equal high digits).
    """
    n = len(keys)
    bits = max(int(n - 1).bit_length(), 1)
    digit = 63 - bits
    two_digits = top >= 1 << digit
    rows = None
    # column-sized arrays pooled, not fresh (their pages would each be faulted in again)
    row_numbers = count_into(pooled_array(n, np.int64))
    for shift in (0, digit) if two_digits else (0,):
        current = keys if rows is None else keys[rows]
        packed = pooled_array(n, np.int64)
        if shift:
            np.right_shift(current, shift, out=packed)
        else:
            np.bitwise_and(current, (1 << digit) - 1, out=packed)
        packed <<= bits
        packed |= row_numbers
        packed = _sorted(packed)
        order = np.bitwise_and(packed, (1 << bits) - 1, out=pooled_array(n, np.int64))
        rows = order if rows is None else rows[order]
    # one pass: the sorted keys are the packed values above the row bits
    ordered = keys[rows] if two_digits else np.right_shift(packed, bits, out=pooled_array(n, np.int64))
    repeated = np.flatnonzero(ordered[1:] == ordered[:-1])
    if repeated.size:
        refuse(int(ordered[repeated[0]]))
    return rows, ordered, values[rows]


def _sorted(values: np.ndarray) -> np.ndarray:
    """``np.sort(values)`` (``int64``, all distinct: any sort gives the same; in place, or
    read-only), by Polars for a long column: its parallel sort takes about a quarter of
    numpy's time on 10^7 keys."""
    if len(values) < _POLARS_SORT_FROM:
        values.sort()
        return values
    return pl.Series(values).sort().to_numpy()


#: Rows from which :func:`_sorted` hands the sort to Polars (below, calling it costs more).
_POLARS_SORT_FROM = 1 << 16


def _partition_offsets(keys: np.ndarray, span: int) -> np.ndarray:
    """Where each partition starts in ascending ``keys`` (partition ``key // span``), and the end."""
    starts = [np.zeros(1, dtype=np.int64)]
    previous = keys[0] // span
    for at in range(0, len(keys), PIECE):
        ids = keys[at:at + PIECE] // span
        if ids[0] != previous:
            starts.append(np.array([at]))
        starts.append(np.flatnonzero(ids[1:] != ids[:-1]) + (at + 1))
        previous = ids[-1]
    return np.concatenate([*starts, [len(keys)]])


def where_in_partition(partition_labels: Sequence[str]) -> str:
    """`` within a partition of 'g'`` (or nothing): the place of a key in a message."""
    if not partition_labels:
        return ""
    return " within a partition of " + ", ".join(map(repr, partition_labels))


def duplicate_time_message(order_label: str, shown_value: str, partition_labels: Sequence[str]) -> str:
    """The one message of a repeated time key, whichever front end and ordering path finds it."""
    where = where_in_partition(partition_labels)
    return (f"order column {order_label!r} has duplicate value {shown_value}{where}; time keys must be unique"
            + (" within a partition" if where else ""))


def refuse_null_keys(nulls: Mapping[str, int], *, order_label: str | None,
                     partition_labels: Sequence[str] = ()) -> None:
    """Refuse NULL keys: ``nulls`` maps each key column's label (the user's name) to its
    number of NULL values. Every row needs its partition key and its time key."""
    for label in partition_labels:
        if nulls.get(label):
            raise InvalidTimeKey(f"partition column {label!r} contains {nulls[label]} NULL value(s); every row needs "
                                 "a partition key")
    if order_label is not None and nulls.get(order_label):
        raise InvalidTimeKey(f"order column {order_label!r} contains {nulls[order_label]} NULL value(s)"
                             f"{where_in_partition(partition_labels)}; every row needs a time key")


def refuse_null_event_times(label: str, nulls: int) -> None:
    """Refuse events without a time (count streams: every event falls in one bucket)."""
    if nulls:
        raise InvalidTimeKey(f"time column {label!r} contains {nulls} null value(s); every event needs a time")


def refuse_nan_key(label: str, *, partition: bool = False, events: bool = False) -> None:
    """NaN neither orders nor equals itself, so it cannot be a key (``events``: a count
    stream's time column)."""
    kind = "partition column" if partition else "time column" if events else "order column"
    raise InvalidTimeKey(f"{kind} {label!r} contains NaN; keys must be comparable values")


def refuse_rows_without_keys(columns: Sequence[pl.Series], labels: Sequence[str], *, events: bool = False) -> None:
    """Refuse NULL and NaN keys of a Polars frame's key ``columns`` (the order column first, then
    the partition columns; ``labels``: the user's names of them), in every front end's words:
    a row without its keys belongs to no stream. ``events``: a count stream's time column."""
    nulls = {label: column.null_count() for label, column in zip(labels, columns)}
    if events:
        refuse_null_event_times(labels[0], nulls[labels[0]])
    refuse_null_keys(nulls, order_label=None if events else labels[0], partition_labels=labels[1:])
    for at, (label, column) in enumerate(zip(labels, columns)):
        if column.dtype.is_float() and column.is_nan().any():
            refuse_nan_key(label, partition=at > 0, events=events)


def refuse_duplicate_time(order_label: str, shown_value: str, partition_labels: Sequence[str] = ()) -> None:
    """A time key repeated within a partition (``shown_value`` as the front end prints it)."""
    raise InvalidTimeKey(duplicate_time_message(order_label, shown_value, partition_labels))
