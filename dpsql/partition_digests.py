"""What a distributed release (:class:`dpsql.publishing.DistributedRelease`) checked before its
charge, as its tasks compare it: keyed digests of each partition's rows, looked up by the tasks.

Spark re-reads a DataFrame's sources whenever it re-executes it: a released DataFrame read
again after its source changed would release new rows with the charged noise. The check job
before the charge digests each partition's rows (:class:`PartitionFingerprint`); the charged
release's tasks digest the rows they read the same way and release a partition only when its
digest is one of those checked (:class:`AdmittedPartitions`), else refuse it
(:func:`changed_data`). The digests are keyed by a key derived from the release's secret key
(:func:`fingerprint_key`): they reveal nothing of the rows, and nobody can make other rows
match one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import pyarrow as pa

from dpsql.errors import DataChanged

#: Bytes of a partition's digest (BLAKE2b-128: collisions need about 2**64 tries, with the key).
DIGEST_BYTES = 16


def fingerprint_key(release_key: bytes) -> bytes:
    """The key of a release's partition digests: derived from the release's key, one way."""
    return hashlib.blake2b(b"partition digests", key=release_key, digest_size=32, person=b"dpsql-fp-key").digest()


class PartitionFingerprint:
    """Keyed digests (BLAKE2b, 128 bits) of partitions' rows as a release consumes them: the
    partition's address, the front end's canonical bytes of its order keys and its values in
    release order. The key is derived from the release's key, so a digest reveals nothing of
    the rows to whoever lacks it, and nobody can make other rows match one."""

    def __init__(self, key: bytes):
        self._key = key

    def __repr__(self) -> str:
        return "PartitionFingerprint()"  # never the key

    def digests(self, addresses: Sequence[bytes] | pa.Array, values: np.ndarray, offsets: np.ndarray,
                order_keys: Sequence[Sequence]) -> list[bytes]:
        """One digest per partition ``k``: canonical address ``addresses[k]``
        (:mod:`dpsql.addresses`), order keys' canonical bytes ``order_keys[k]`` (buffers), values
        ``values[offsets[k]:offsets[k + 1]]`` (float64)."""
        bounds = np.asarray(offsets).tolist()
        keyed = hashlib.blake2b(key=self._key, digest_size=DIGEST_BYTES, person=b"dpsql-rows")
        digests = []
        for k, address in enumerate(addresses.to_pylist() if isinstance(addresses, pa.Array) else addresses):
            digest = keyed.copy()
            for piece in (address, *order_keys[k], values[bounds[k]:bounds[k + 1]]):
                view = memoryview(piece)
                digest.update(view.nbytes.to_bytes(8, "little"))
                digest.update(view)
            digests.append(digest.digest())
        return digests


class DigestLookup(Protocol):
    """Where a task looks up the digests its release was charged for (:class:`AdmittedPartitions`,
    or a front end's handle on a copy of it shipped to the executors)."""

    def lookup(self, digests: Sequence[bytes]) -> np.ndarray:
        """For each of ``digests``: -1 when it was not admitted, else its partition's rows in the
        fleet's pooled hold-out (0 when the release pools none)."""


class AdmittedPartitions:
    """The digests (:class:`PartitionFingerprint`) of the partitions a distributed release was
    charged for, sorted for lookups, with each partition's rows in the fleet's pooled hold-out
    (``pooled_rows``; none: 0): 16 bytes a partition and a few for its pooled rows (a million
    partitions take about 17 MB, and a second to sort)."""

    def __init__(self, digests, pooled_rows=None):
        high, low = _halves(digests)
        order = np.lexsort((low, high))
        self._high, self._low = high[order], low[order]
        pooled = np.zeros(len(order), np.int64) if pooled_rows is None else np.asarray(pooled_rows, np.int64)[order]
        self._pooled = pooled.astype(np.min_scalar_type(int(pooled.max()) if len(pooled) else 0))

    def __len__(self) -> int:
        return len(self._high)

    def lookup(self, digests: Sequence[bytes]) -> np.ndarray:
        """For each of ``digests``: -1 when it is not admitted, else its partition's pooled rows."""
        high, low = _halves(digests)
        if not len(self):
            return np.full(len(high), -1, np.int64)
        first = np.searchsorted(self._high, high, side="left")
        last = np.searchsorted(self._high, high, side="right")
        place = first.clip(max=len(self) - 1)
        found = (last > first) & (self._low[place] == low)
        for k in np.flatnonzero(~found & (last - first > 1)).tolist():  # first halves equal: about never
            hits = np.flatnonzero(self._low[first[k]:last[k]] == low[k])
            if hits.size:
                found[k], place[k] = True, first[k] + hits[0]
        return np.where(found, self._pooled[place].astype(np.int64), -1)


def _halves(digests) -> tuple[np.ndarray, np.ndarray]:
    """Digests (bytes, or an array of 16-byte strings) as their first and second halves (big-endian
    integers: sorted like the bytes)."""
    words = np.ascontiguousarray(np.asarray(digests, dtype=f"S{DIGEST_BYTES}")).view(">u8").reshape(-1, 2)
    return words[:, 0].astype(np.uint64), words[:, 1].astype(np.uint64)


def changed_data(partition) -> DataChanged:
    """The refusal of partition ``partition`` (its key) of a distributed release, whose rows are
    not those checked before the charge."""
    return DataChanged(f"partition {partition!r} is not the data this release was charged for: its rows changed since "
                       "the check that preceded the charge (a source re-read after it changed, or another DataFrame). "
                       "Nothing of it was released; release again (a new, charged release) to publish the current "
                       "data.")
