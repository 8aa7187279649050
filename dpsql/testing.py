"""Reproducible noise for tests. Nothing here is private.

>>> import numpy as np, dpsql
>>> with dpsql.testing.seeded(7):
...     a = dpsql.laplace_stream(np.ones(4), epsilon=1.0, upper=2.0)
>>> with dpsql.testing.seeded(7):
...     b = dpsql.laplace_stream(np.ones(4), epsilon=1.0, upper=2.0)
>>> bool((a.values == b.values).all()), a.private
(True, False)
"""

from __future__ import annotations

import contextlib

from dpsql import noise


@contextlib.contextmanager
def seeded(seed: int):
    """Use seeded, non-private noise inside the block (process-wide, all threads).

    Releases made inside are marked ``private=False``; a persistent ledger refuses them
    and an in-memory ledger records them as non-private.
    """
    with noise._installed(noise.SeededNoise(seed)) as source:
        yield source
