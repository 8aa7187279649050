"""Rows grouped by their values in a few integer columns (partitions alike: one length, one
threshold, one grid), without ``np.unique(..., axis=...)``, which compares whole records (seconds
for 10^6 partitions) where a fleet's columns are usually constant or have few distinct values."""

from __future__ import annotations

import numpy as np


def unique(values: np.ndarray, *, return_index: bool = False, return_inverse: bool = False):
    """``np.unique`` of a 1-D array (its distinct values, and as asked the first index of each and
    each value's place among them), without sorting when every value is the same (a fleet's
    partitions: one length, one bound).

    >>> unique(np.array([3, 3, 3]), return_index=True, return_inverse=True)
    (array([3]), array([0]), array([0, 0, 0]))
    """
    values = np.asarray(values).reshape(-1)
    if len(values) and (values == values[0]).all():
        found = (values[:1], np.zeros(1, np.intp), np.zeros(len(values), np.intp))
    else:
        found = np.unique(values, return_index=True, return_inverse=True)
        found = (found[0], found[1], found[2].reshape(-1))
    if not (return_index or return_inverse):
        return found[0]
    return (found[0],) + ((found[1],) if return_index else ()) + ((found[2],) if return_inverse else ())


def group_codes(*columns: np.ndarray) -> np.ndarray:
    """Each row's group, numbered in ascending (lexicographic) order of the columns' values:
    ``np.unique(np.stack(columns), axis=1, return_inverse=True)[1]``.

    >>> group_codes(np.array([2, 1, 2, 1]), np.array([0, 0, 0, 5]))
    array([2, 0, 2, 1])
    """
    n = len(columns[0])
    if not n or all((column == column[0]).all() for column in columns):
        return np.zeros(n, np.int64)
    combined = np.zeros(n, np.int64)
    size = 1
    for column in columns:
        distinct, inverse = np.unique(column, return_inverse=True)
        size *= len(distinct)
        if size >= 2**62:  # too many combinations for one integer: compact what there is so far
            combined = np.unique(combined, return_inverse=True)[1].reshape(-1).astype(np.int64)
            size = int(combined.max()) + 1 if n else 1
            size *= len(distinct)
        combined = combined * len(distinct) + inverse.reshape(-1)
    return np.unique(combined, return_inverse=True)[1].reshape(-1).astype(np.int64)


def same_groups(*columns: np.ndarray) -> list[np.ndarray]:
    """The indices of each group of rows equal in every column, the groups in ascending order of
    their values (the common case, every row alike, without sorting).

    >>> same_groups(np.array([2, 1, 2, 1]), np.array([0, 0, 0, 5]))
    [array([1]), array([3]), array([0, 2])]
    """
    n = len(columns[0])
    if not n:
        return []
    if all((column == column[0]).all() for column in columns):
        return [np.arange(n)]
    codes = group_codes(*columns)
    order = np.argsort(codes, kind="stable")
    return np.split(order, np.flatnonzero(np.diff(codes[order])) + 1)
