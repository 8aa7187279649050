"""Large arrays without fresh memory: on a virtual machine, touching fresh pages (page
faults, zeroing, the host backing them) can cost more than the arithmetic done on them,
and it varies from run to run. Arrays allocated here come from Arrow's memory pool, which
keeps freed blocks for the next allocation."""

from __future__ import annotations

import numpy as np
import pyarrow as pa


def pooled_array(n: int, dtype=np.float64) -> np.ndarray:
    """An uninitialised 1-D array of ``n`` items from Arrow's memory pool: the pool keeps freed
    blocks for the next call, where a fresh numpy array of this size would be faulted in and
    zeroed again page by page (slow on virtual machines). Released values allocated here also
    go to Arrow consumers (DuckDB, Polars) as they are."""
    dtype = np.dtype(dtype)
    return np.frombuffer(pa.allocate_buffer(dtype.itemsize * n), dtype=dtype)


def gathered(values: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``values[rows]`` in pooled memory (every row one of ``values``'s: numpy's mode clip gathers
    straight into it, where its default buffers first): twice as fast as Arrow's take."""
    return np.take(values, rows, mode="clip", out=pooled_array(len(rows), values.dtype))


def count_into(out: np.ndarray, start: int = 0) -> np.ndarray:
    """``out[:] = start + np.arange(len(out))`` in cache-sized pieces, with no temporary of
    the column's size; returns ``out``."""
    steps = np.arange(min(len(out), _COUNT_PIECE), dtype=out.dtype)
    for at in range(0, len(out), _COUNT_PIECE):
        piece = out[at:at + _COUNT_PIECE]
        np.add(steps[:len(piece)], start + at, out=piece)
    return out


#: Below glibc's threshold for memory of its own mapping (128 KiB), so reused, not faulted in.
_COUNT_PIECE = 1 << 13
