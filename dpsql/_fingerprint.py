"""Cryptographic fingerprints of a release request: which method, parameters, scope and
principal, and exactly the bytes the mechanism consumes (values in stream order, partition
boundaries and keys, order keys). Two requests with the same fingerprint are the identical
release of identical data, so the second may be answered with the first's values, recomputed
from its key; the digest of a release's values (:func:`values_digest`) checks the recomputation.

SHA-256 as a two-level tree: the data are cut into 4 MiB leaves, hashed on two threads
(hashlib releases the GIL) when they hold more than two leaves' worth, and the root hashes the
header and the leaf digests with their lengths, leaves and root under distinct prefixes.
Collision resistance is SHA-256's; current x86 and ARM processors compute it in hardware, about
twice as fast as BLAKE2b (see BENCHMARKS.md, "Answer cache").
"""

from __future__ import annotations

import hashlib
import json

import numpy as np

from dpsql._parallel import on_two_threads

_LEAF = 1 << 22


def _contents(array) -> list[np.ndarray]:
    """Contiguous numpy arrays holding exactly ``array``'s values (an Arrow string column: its
    offsets from 0 and its characters); for an Arrow array with NULLs, its valid values and
    which rows are valid (a NULL's slot holds anything: ``["a", NULL]`` must not pass for
    ``["a", ""]``, nor ``[1.0, NULL]`` for ``[1.0, NaN]``)."""
    import pyarrow as pa

    if isinstance(array, np.ndarray):
        if array.dtype.kind in "Mm":
            return [np.ascontiguousarray(array).view(np.int64)]
        if array.dtype.kind not in "O":
            return [np.ascontiguousarray(array)]
        array = pa.array(array)

    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if array.null_count:  # the valid values, and where they are
        valid = array.is_valid().to_numpy(zero_copy_only=False).astype(np.uint8)
        return [valid] if pa.types.is_null(array.type) else [*_contents(array.drop_null()), valid]
    if pa.types.is_string(array.type) or pa.types.is_binary(array.type) or pa.types.is_large_string(
            array.type) or pa.types.is_large_binary(array.type):
        width = np.int64 if pa.types.is_large_string(array.type) or pa.types.is_large_binary(array.type) else np.int32
        offsets = np.frombuffer(array.buffers()[1], dtype=width)[array.offset:array.offset + len(array) + 1]
        data = np.frombuffer(array.buffers()[2], dtype=np.uint8)[offsets[0]:offsets[-1]] if len(array) else np.empty(
            0, dtype=np.uint8)
        return [offsets - offsets[0], data]
    values = array.to_numpy(zero_copy_only=False)
    if values.dtype.kind == "O":  # decimals, times, ...: Python objects; hash their fixed-width storage instead
        width = array.type.bit_width // 8
        start = array.offset * width
        return [np.frombuffer(array.buffers()[1], dtype=np.uint8)[start:start + len(array) * width]]
    return _contents(values)


def _leaf(piece: memoryview) -> bytes:
    leaf = hashlib.sha256(b"dpsql-leaf\0")
    leaf.update(piece)
    return leaf.digest()


def fingerprint(header: dict, arrays) -> str:
    """Hex digest of ``header`` (JSON-able, canonicalised) and the contents of ``arrays``
    (numpy arrays, or Arrow arrays of any non-null type), each with its type and length."""
    root = hashlib.sha256(b"dpsql-root\0")
    root.update(json.dumps(header, sort_keys=True, separators=(",", ":"), default=repr).encode())
    pieces = []
    for array in (piece for a in arrays for piece in _contents(a)):
        view = memoryview(array).cast("B")
        root.update(f"|{array.dtype.str}:{array.size}|".encode())
        pieces += [view[a:a + _LEAF] for a in range(0, len(view), _LEAF)]
    for digest in _leaves(pieces):
        root.update(digest)
    return root.hexdigest()


def _leaves(pieces: list[memoryview]) -> list[bytes]:
    """Each piece's leaf digest: on two threads above two leaves' worth."""
    if sum(len(p) for p in pieces) <= 2 * _LEAF:
        return [_leaf(p) for p in pieces]
    return on_two_threads(_leaf, pieces)


def values_digest(values: np.ndarray) -> bytes:
    """The 32-byte digest of a release's values, by which a recomputed answer is checked to be
    exactly the values released."""
    return bytes.fromhex(fingerprint({"released values": True}, [values]))
