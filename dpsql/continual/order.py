"""An append's batch in stream order (by partition, then by order key), and where each
partition's rows start in it (a key twice in one partition refused)."""

from __future__ import annotations

import numpy as np
import polars as pl

from dpsql._memory import pooled_array
from dpsql.continual.state import StreamSpec
from dpsql.errors import InvalidTimeKey


def in_stream_order(frame: pl.DataFrame, spec: StreamSpec) -> tuple[pl.DataFrame, np.ndarray | None]:
    """``frame`` in stream order (sorted only when it does not come so: rows usually arrive in
    order, by time, a fleet's by meter, then time), and the first row of each partition when
    found on the way (else None: :func:`group_starts`)."""
    if (starts := starts_in_order(frame, spec.partition_by, spec.order_by)) is not None:
        return frame, starts
    if ascending(frame, [*spec.partition_by, spec.order_by]):
        return frame, None
    return frame.sort([*spec.partition_by, spec.order_by], maintain_order=True), None


def group_starts(frame: pl.DataFrame, spec: StreamSpec, label: str, *, order: str | None = None,
                  unique_keys: bool = True) -> np.ndarray:
    """The first row of each partition of a sorted batch; refuses a key twice in one partition."""
    order = order or spec.order_by
    n = frame.height
    new = np.zeros(n, dtype=bool)
    new[0] = True
    for column in spec.partition_by:
        c = frame.get_column(column)
        new[1:] |= c.slice(1).ne_missing(c.slice(0, n - 1)).to_numpy()
    if unique_keys:
        key = frame.get_column(order)
        if key.dtype.is_numeric() or key.dtype.is_temporal():  # no nulls (refused): numpy's view, no copy
            keys = key.to_numpy()
            same = keys[1:] == keys[:-1]
        else:
            same = key.slice(1).eq_missing(key.slice(0, n - 1)).to_numpy()
        repeated = np.flatnonzero(~new[1:] & same) if same.any() else np.empty(0, np.int64)
        if repeated.size:
            raise InvalidTimeKey(f"{label}: order key {key[int(repeated[0]) + 1]!r} appears twice in one partition of "
                                 "this append; time keys must be unique within a partition")
    return np.flatnonzero(new)


def starts_in_order(frame: pl.DataFrame, partition_by: tuple[str, ...], order_by: str) -> np.ndarray | None:
    """The first row of each partition, when ``frame``'s rows come by partition, then by order key,
    each key once in its partition (as a fleet's rows usually come), for at most one partition
    column and an order key of numbers or times: found while checking the order, in two passes
    over the columns where :func:`ascending`, then :func:`group_starts` take five; else None (rows
    to sort, a key twice in a partition, other columns)."""
    if len(partition_by) > 1 or frame.height < 2:
        return None
    columns = [frame.get_column(c) for c in (*partition_by, order_by)]
    if not all(c.dtype.is_integer() or c.dtype.is_float() or (c.dtype.is_temporal() and c.dtype != pl.Time)
               for c in columns):
        return None
    # no nulls (refused): numpy's views, no copies; times as their integers (no NaT to mind: faster)
    *partitions, keys = (v.view(np.int64) if v.dtype.kind in "mM" else v for v in (c.to_numpy() for c in columns))
    new = pooled_array(len(keys), np.bool_)  # each row that starts a partition
    new[0] = True
    if partitions:
        np.not_equal(partitions[0][1:], partitions[0][:-1], out=new[1:])
    else:
        new[1:] = False
    rising = np.greater(keys[1:], keys[:-1], out=pooled_array(len(keys) - 1, np.bool_))
    rising |= new[1:]  # each key above the one before, in its partition
    if not rising.all():
        return None
    starts = np.flatnonzero(new)
    # a partition's rows hold one value: its first is above the previous partition's last
    return starts if not partitions or (partitions[0][starts[1:]] > partitions[0][starts[1:] - 1]).all() else None


def ascending(frame: pl.DataFrame, columns: list[str]) -> bool:
    """Whether ``frame``'s rows are in ascending order of ``columns`` (lexicographic), checked
    without sorting for columns of numbers and times (a column of another type: False)."""
    if frame.height < 2:
        return True
    equal_so_far = np.ones(frame.height - 1, bool)  # rows equal to their predecessor in the columns so far
    for name in columns:
        column = frame.get_column(name)
        if not (column.dtype.is_numeric() or column.dtype.is_temporal()):
            return False
        values = column.to_numpy()
        before, after = values[:-1], values[1:]
        if (equal_so_far & (before > after)).any():
            return False
        equal_so_far &= before == after
    return True
