"""Reproducible noise for tests. Nothing here is private.

>>> import numpy as np, dpsql
>>> with dpsql.testing.seeded(7):
...     a = dpsql.laplace(np.ones(4), epsilon=1.0, upper=2.0)
>>> with dpsql.testing.seeded(7):
...     b = dpsql.laplace(np.ones(4), epsilon=1.0, upper=2.0)
>>> bool((a.values == b.values).all()), a.private
(True, False)
"""

from __future__ import annotations

import contextlib

from dpsql import noise


@contextlib.contextmanager
def seeded(seed: int):
    """Derive release keys from ``seed`` inside the block (process-wide, all threads):
    the ``i``-th release made in the block gets the ``i``-th key of the seed, so a release
    repeated in a fresh ``seeded(seed)`` block draws the same noise.

    Releases made inside are marked ``private=False``; a persistent ledger refuses them
    and an in-memory ledger records them as non-private. Yields the seed's first
    :class:`~dpsql.noise.Keystream` (the first release's), for driving machines by hand.
    """
    with noise._seeded(seed) as first:
        yield first


def keys(seed: int) -> noise.Keystream:
    """A non-private keystream derived from ``seed`` (the first key :func:`seeded` gives)."""
    return noise.Keystream(noise._SeededKeys(seed).next_key(), private=False)


def draws(seed: int, partition: bytes = b"") -> noise.Draws:
    """The draws of one partition of :func:`keys`, for driving a machine by hand."""
    return keys(seed).partition(partition)
