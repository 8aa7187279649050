"""The only place randomness comes from: a keyed, addressable keystream.

Every release has a secret 32-byte key from the operating system's CSPRNG
(``os.urandom``). Every noise draw of the release is a function of that key and of the
draw's *address*: the partition it belongs to, the component of the algorithm that
draws it (a :class:`Lane`), a level and an index (a row, a tree node, a time step).
Nothing is drawn "next": a draw is computed, by AES-256 (OpenSSL, via ``cryptography``),
from its address. Hence

* a row's noise does not depend on how the table was cut into chunks, appends or
  partitions, nor on the order in which partitions run (a continual stream appended a
  row at a time and a one-shot release of the same table draw the same noise);
* a retried or re-executed computation (a Spark task, a crashed append) recomputes the
  same values instead of drawing fresh noise, which would release the data twice.

Addresses
---------
A partition is named by its canonical address bytes (:mod:`dpsql.addresses`: exact and
injective for every key type). Within a partition, a draw's place is the 128-bit counter
``C = lane (16 bits) | level (16 bits) | attempt (32 bits) | index (64 bits)``.

Two AES-256 keys are derived from the release key (BLAKE2b keyed by it): a *mask key* and a
*draw key*. A partition's mask ``T`` is the CBC-MAC, under the mask key, of its address
preceded by one block holding its length (a prefix-free encoding, on which CBC-MAC is a
pseudorandom function of variable-length input). The draw at ``C`` is the AES block, under
the draw key, of ``T + C mod 2**128``: the tweakable block cipher XE(T) of Rogaway (2004),
the partition as the tweak. Within a partition, distinct counters are distinct inputs, and
consecutive indices are consecutive inputs, so a range of draws is AES in counter mode
starting at ``T + C``; the draws of many partitions are one ECB pass over their inputs, so a
release of a million partitions needs no per-partition key schedule. Two partitions' inputs
meet only if their masks differ by the difference of two counters used: for random 128-bit
masks, over all the draws of a release, a probability below ``draws**2 / 2**128``.

Streams registered before this scheme (:data:`LEGACY_SCHEME`) keep theirs: a sub-key per
partition (BLAKE2b keyed by the release key over the address), counters ``C`` unmasked. A
stream's later noise must be drawn as its earlier noise was: mixing the two would release a
block's forest twice.

Keys. ``Keystream.fresh()`` gives a release its key: ``os.urandom(32)``, or, inside
:func:`dpsql.testing.seeded`, a key derived from the seed (non-private; a persistent
ledger refuses such releases).

Draws become noise in :mod:`dpsql.sampling` (float safety is explained there).
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import os
import threading
from collections.abc import Callable, Sequence

import numpy as np
import pyarrow as pa
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from dpsql.addresses import masks
from dpsql.errors import InvalidParameter
from dpsql.sampling import (
    check_indices,
    check_range,
    check_scale,
    fill_discrete_laplace,
    redraw,
    uniform_of,
)

KEY_BYTES = 32
#: The noise scheme of releases made now (see "Addresses" above).
SCHEME = 2
#: The scheme of streams registered before :data:`SCHEME`: a sub-key per partition.
LEGACY_SCHEME = 1
_MASK64 = (1 << 64) - 1
_MASK128 = (1 << 128) - 1
# Draws per keystream call: large enough to amortise a call, small enough that the block
# buffer and its temporaries stay in L2 cache while they are turned into noise.
_PIECE = 1 << 14


class Lane(enum.IntEnum):
    """The components of the algorithms that draw noise: each has its own address space
    (one place lists them all, so no two components can ever share a draw)."""

    ROWS = 1  #: one draw per row (per-value Laplace, count perturbers)
    TREE = 2  #: binary-tree nodes (level, node index)
    FOREST = 3  #: hierarchy forests (level 0, node index across the stream's forests)
    HOLDOUT = 4  #: a hold-out's block hierarchy (level: its chunk)
    NOISY_MAX = 5  #: Report-Noisy-Max candidates
    SMOOTH_SENSITIVITY = 6  #: the smooth-sensitivity quantile's draw
    SVT_THRESHOLD = 7  #: a sparse-vector session's noisy threshold (index: the step that opens it)
    SVT_QUERY = 8  #: a sparse-vector query (index: the step tested)
    EPOCH_TOTAL = 9  #: an epoch's total in the unbounded (hybrid) counter
    LDP_REPORT = 10  #: local-DP reports (level: which uniform of the report)
    LDP_CHOICE = 11  #: a second local-DP report at the same index (BA-SW: the dissimilarity report of a slot)
    VALUE_TAG = 12  #: keyed tags of a continual stream's appended values (no noise: equality checks)


def _derived_key(key: bytes, purpose: bytes) -> bytes:
    return hashlib.blake2b(b"", key=key, digest_size=KEY_BYTES, person=purpose).digest()


class Keystream:
    """The noise of one release: a secret key and, per partition, addressed draws.

    Examples
    --------
    >>> ks = Keystream(bytes(32), private=False)
    >>> lane = ks.partition(b"i7").lane(Lane.ROWS)
    >>> a = lane.discrete_laplace(100.0, start=0, count=10)
    >>> b = np.concatenate([lane.discrete_laplace(100.0, start=0, count=4),
    ...                     lane.discrete_laplace(100.0, start=4, count=6)])
    >>> bool((a == b).all())   # chunking never changes a draw
    True
    >>> batch = ks.partitions([b"i6", b"i7"]).lane(Lane.ROWS).discrete_laplace(100.0, 0, 10)
    >>> bool((batch[1] == a).all())   # nor does the company a partition is released in
    True
    """

    def __init__(self, key: bytes, *, private: bool, scheme: int = SCHEME):
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise InvalidParameter(f"a release key is {KEY_BYTES} bytes")
        if scheme not in (SCHEME, LEGACY_SCHEME):
            raise InvalidParameter(f"unknown noise scheme {scheme!r}: this dpsql draws with schemes "
                                   f"{LEGACY_SCHEME} and {SCHEME}")
        self._key = key
        #: False for test (seeded) keys: releases inherit this flag.
        self.private = private
        #: How draws are derived from the key (see the module docstring).
        self.scheme = scheme
        if scheme == SCHEME:
            self._draw_aes = algorithms.AES(_derived_key(key, b"dpsql-draws"))
            self._mask_aes = algorithms.AES(_derived_key(key, b"dpsql-masks"))

    @classmethod
    def fresh(cls) -> Keystream:
        """A new release's keystream: a key from the OS CSPRNG, or from the seed while
        :func:`dpsql.testing.seeded` is in force."""
        keys = _test_keys
        if keys is None:
            return cls(os.urandom(KEY_BYTES), private=True)
        return cls(keys.next_key(), private=False)

    @property
    def key(self) -> bytes:
        """The secret key, for the ledger that keeps a stream's state. Never log it."""
        return self._key

    def partition(self, address: bytes = b"") -> Draws:
        """The draws of the partition with canonical ``address`` (``b""``: an unpartitioned stream)."""
        if self.scheme == LEGACY_SCHEME:
            sub_key = hashlib.blake2b(address, key=self._key, digest_size=KEY_BYTES,
                                      person=b"dpsql-partition").digest()
            return Draws(algorithms.AES(sub_key), 0, self.private)
        hi, lo = masks(self._mask_aes, [address])[0].tolist()
        return Draws(self._draw_aes, (hi << 64) | lo, self.private)

    def partitions(self, addresses: Sequence[bytes] | pa.Array) -> DrawsBatch:
        """The draws of several partitions (canonical ``addresses``: bytes, or an Arrow binary
        array of them), drawn together (see :class:`DrawsBatch`); no per-partition objects are
        made, so a million partitions cost a few array passes."""
        if self.scheme == LEGACY_SCHEME:
            listed = addresses.to_pylist() if isinstance(addresses, pa.Array) else addresses
            return DrawsBatch([self.partition(a) for a in listed])
        return DrawsBatch.masked(self._draw_aes, masks(self._mask_aes, addresses), self.private)

    def __repr__(self) -> str:
        return f"Keystream(private={self.private})"  # never the key

    def __reduce__(self):
        # A Spark task carries the key inside its closure: that is where it is meant to go.
        return _keystream, (self._key, self.private, self.scheme)


def _keystream(key: bytes, private: bool, scheme: int = LEGACY_SCHEME) -> Keystream:
    return Keystream(key, private=private, scheme=scheme)


#: Blocks' first words computed per cipher call at scattered addresses (value tags).
_STEP_AT = 4096


class Draws:
    """One partition's addressed draws; :meth:`lane` selects a component.

    ``aes`` is the release's draw key (its sub-key, for the legacy scheme) and ``mask`` the
    partition's 128-bit mask (0 for the legacy scheme): the block at counter ``C`` is AES of
    ``mask + C``.
    """

    def __init__(self, aes: algorithms.AES, mask: int, private: bool):
        self._aes = aes
        self._mask = mask
        self.private = private

    def lane(self, lane: Lane, level: int = 0) -> LaneDraws:
        return LaneDraws(self, int(lane), int(level))

    def _blocks(self, header: int, start: int, count: int, out: np.ndarray | None = None) -> np.ndarray:
        """Keystream blocks ``start .. start + count - 1`` under ``header`` as ``(count, 2)``
        little-endian words (written into ``out`` when given)."""
        if out is None:
            out = np.empty((count, 2), dtype=np.uint64)
        if count:
            nonce = ((self._mask + ((header << 64) | start)) & _MASK128).to_bytes(16, "big")
            encryptor = Cipher(self._aes, modes.CTR(nonce)).encryptor()
            encryptor.update_into(_zeros(count), out.view(np.uint8).reshape(-1))
        return out

    def tags(self, values: np.ndarray) -> np.ndarray:
        """A keyed 64-bit tag of each float64 value (AES of its bits under the ``VALUE_TAG``
        lane): equal values get equal tags, and without the key a tag says nothing about its
        value. A continual stream keeps tags, not values, to recognise a row appended twice.
        ``-0.0`` is tagged as ``0.0``: the two are the same reading."""
        bits = (np.ascontiguousarray(values, dtype=np.float64).reshape(-1) + 0.0).view(np.uint64)
        return self._blocks_at(int(Lane.VALUE_TAG) << 48, bits, first_word=True)

    def _blocks_at(self, header: int, indices: np.ndarray, *, first_word: bool = False) -> np.ndarray:
        """The keystream blocks at scattered ``indices`` (equal to :meth:`_blocks` there) as
        ``(n, 2)`` words, or only each block's first word."""
        mask = np.array([[self._mask >> 64, self._mask & _MASK64]], dtype=np.uint64)
        return _blocks_at(self._aes, mask, None, header, indices, first_word=first_word)


def _blocks_at(aes: algorithms.AES, masks: np.ndarray, rows: np.ndarray | None, header: int, indices: np.ndarray, *,
               first_word: bool = False) -> np.ndarray:
    """AES (``aes``, ECB) of the counters ``mask + (header << 64 | index)`` for each of
    ``indices`` (uint64 or int64), the mask ``masks[rows[i]]`` (``masks``: ``(k, 2)`` words) or,
    without ``rows``, ``masks[0]`` for every index: what counter mode computes at those counters.
    ``(n, 2)`` little-endian words, or each block's first word; a few thousand at a time, so
    counters, masks and blocks stay in cache."""
    indices = np.asarray(indices).view(np.uint64) if np.asarray(indices).dtype == np.int64 else np.asarray(
        indices, dtype=np.uint64)
    n = len(indices)
    step = max(min(n, _STEP_AT if first_word else _PIECE), 1)
    counters = np.empty((step, 2), dtype=np.uint64)
    cipher_in = np.empty((step, 2), dtype=">u8")
    out = np.empty(2 * step + 2, dtype="<u8")  # update_into wants a block to spare
    result = np.empty(n, dtype=np.uint64) if first_word else np.empty((n, 2), dtype=np.uint64)
    encryptor = Cipher(aes, modes.ECB()).encryptor()
    header_word = np.uint64(header & _MASK64)
    if not n:
        return result
    if rows is None:
        mask_high, mask_low = masks[0, 0], masks[0, 1]
    else:
        chosen = np.empty((step, 2), dtype=np.uint64)
    for at in range(0, n, step):
        m = min(step, n - at)
        if rows is not None:  # gathered a step at a time, in cache (take: a 2-D fancy index is 4x slower)
            np.take(masks, rows[at:at + m], axis=0, out=chosen[:m])
            mask_high, mask_low = chosen[:m, 0], chosen[:m, 1]
        np.add(indices[at:at + m], mask_low, out=counters[:m, 1])
        np.add(mask_high, header_word, out=counters[:m, 0])
        counters[:m, 0] += counters[:m, 1] < indices[at:at + m]  # the carry of the low words' sum
        cipher_in[:m] = counters[:m]
        encryptor.update_into(cipher_in[:m].view(np.uint8).reshape(-1), out[:2 * m + 2].view(np.uint8))
        if first_word:
            result[at:at + m] = out[:2 * m:2]
        else:
            result[at:at + m] = out[:2 * m].reshape(m, 2)
    return result


class _GridBlocks:
    """The blocks of groups of partitions at the same indices (:meth:`blocks`), with one cipher
    context and scratch arrays for the largest group, reused from group to group."""

    def __init__(self, aes: algorithms.AES, header: int, indices: np.ndarray, group: int):
        self._encryptor = Cipher(aes, modes.ECB()).encryptor()
        self._header = np.uint64(header & _MASK64)
        self._indices = indices
        # a mask's low word above this wraps when the last index is added: its high word takes a carry
        self._no_carry_below = np.uint64(_MASK64 - int(indices[-1])) if len(indices) else np.uint64(_MASK64)
        self._counters = np.empty((group, len(indices), 2), dtype=">u8")
        self._out = np.empty(2 * group * len(indices) + 2, dtype=np.uint64)  # update_into wants a block to spare

    def blocks(self, masks: np.ndarray) -> np.ndarray:
        """The blocks of every partition of ``masks`` (``(k, 2)`` words, ``k`` at most the group) at
        each index, as ``(k, len(indices), 2)`` words (a view of scratch memory, valid until the
        next call): AES of the counters ``mask + (header << 64 | index)``, built by broadcasting."""
        k, n = len(masks), len(self._indices)
        counters = self._counters[:k]
        np.add(masks[:, 1:2], self._indices, out=counters[..., 1])
        counters[..., 0] = (masks[:, 0] + self._header)[:, None]
        if masks[:, 1].max(initial=0) > self._no_carry_below:  # about one group in 2**64 / (group * last index)
            counters[..., 0] += counters[..., 1] < self._indices  # the low words' sums that wrapped carry up
        out = self._out[:2 * k * n + 2]
        self._encryptor.update_into(counters.reshape(-1).view(np.uint8), out.view(np.uint8))
        return out[:2 * k * n].reshape(k, n, 2)


class LaneDraws:
    """The draws of one component (lane) at one level of one partition, by index."""

    def __init__(self, draws: Draws, lane: int, level: int):
        if not 0 <= lane < 1 << 16 or not 0 <= level < 1 << 16:
            raise ValueError("lane and level are 16-bit")
        self._draws = draws
        self._header = (lane << 48) | (level << 32)

    @property
    def private(self) -> bool:
        return self._draws.private

    def blocks(self, start: int, count: int, attempt: int = 0) -> np.ndarray:
        check_range(start, count)
        return self._draws._blocks(self._header | attempt, start, count)

    def uniform(self, start: int, count: int) -> np.ndarray:
        """Uniform doubles in (0, 1) on the ``2^-53`` grid shifted by half a step, one per index."""
        return uniform_of(self.blocks(start, count))

    def uniform_at(self, indices: np.ndarray) -> np.ndarray:
        """:meth:`uniform` at scattered ``indices``."""
        indices = check_indices(indices)
        return uniform_of(self._draws._blocks_at(self._header, indices))

    def discrete_laplace(self, scale: float, start: int, count: int) -> np.ndarray:
        """``count`` draws ``P(Z = k) = (1-a)/(1+a) * a**|k|``, ``a = exp(-1/scale)``, at indices
        ``start ..``: int64, mean 0, variance ``2a / (1-a)**2`` (about ``2 scale**2``).
        ``scale = 0`` gives zeros; scales above :data:`dpsql.sampling.MAX_SCALE` are refused."""
        check_range(start, count)
        check_scale(scale)
        out = np.empty(count, dtype=np.int64)
        if scale == 0:
            out[:] = 0
            return out
        blocks = np.empty((min(count, _PIECE), 2), dtype=np.uint64)
        for a in range(0, count, _PIECE):
            b = min(count, a + _PIECE)
            piece = self._draws._blocks(self._header, start + a, b - a, blocks[: b - a])
            rejected = fill_discrete_laplace(piece, scale, out[a:b])
            if rejected.size:
                self._redraw(scale, start + a + rejected, out[a:b], rejected)
        return out

    def discrete_laplace_at(self, scale: float, indices: np.ndarray) -> np.ndarray:
        """:meth:`discrete_laplace` at scattered ``indices`` (the same draw as at a range)."""
        indices = check_indices(indices)
        check_scale(scale)
        out = np.zeros(len(indices), dtype=np.int64)
        if scale == 0 or not len(indices):
            return out
        rejected = fill_discrete_laplace(self._draws._blocks_at(self._header, indices), scale, out)
        if rejected.size:
            self._redraw(scale, indices[rejected], out, rejected)
        return out

    def _redraw(self, scale: float, indices: np.ndarray, out: np.ndarray, where: np.ndarray) -> None:
        """Redraw the rejected draws at ``indices`` (``out[where]``) with the next attempts."""
        redraw(lambda attempt, chosen: self._draws._blocks_at(self._header | attempt, indices[chosen]), scale,
                out, where)


class DrawsBatch:
    """Several partitions' draws, drawn together: each partition's draws are exactly its own
    :class:`Draws`' (from its own mask); only the arithmetic turning blocks into noise is shared.

    Made by :meth:`Keystream.partitions` (masks only, no per-partition objects: the draws of
    all partitions come from one cipher pass) or from any :class:`Draws` (test doubles, the
    legacy scheme's sub-keys), which are then drawn from one by one.
    """

    def __init__(self, partitions: Sequence[Draws]):
        parts = list(partitions)
        self.private = all(p.private for p in parts)
        aes = parts[0]._aes if parts and type(parts[0]) is Draws else None
        if aes is not None and all(type(p) is Draws and p._aes is aes for p in parts):
            self._aes: algorithms.AES | None = aes
            self._masks = np.array([[p._mask >> 64, p._mask & _MASK64] for p in parts], dtype=np.uint64)
            self._parts: list[Draws] | None = None
        else:
            self._aes, self._masks, self._parts = None, np.empty((len(parts), 2), np.uint64), parts

    @classmethod
    def masked(cls, aes: algorithms.AES, masks: np.ndarray, private: bool) -> DrawsBatch:
        """The partitions whose masks are the rows of ``masks`` (``(k, 2)`` words) under ``aes``."""
        batch = cls.__new__(cls)
        batch.private, batch._aes, batch._masks, batch._parts = private, aes, masks, None
        return batch

    def __len__(self) -> int:
        return len(self._masks)

    def __getitem__(self, k: int) -> Draws:
        if self._parts is not None:
            return self._parts[k]
        high, low = self._masks[k].tolist()
        return Draws(self._aes, (high << 64) | low, self.private)  # type: ignore[arg-type]

    def take(self, indices: np.ndarray) -> DrawsBatch:
        """The partitions at positions ``indices``, as a batch."""
        if self._parts is not None:
            return DrawsBatch([self._parts[int(k)] for k in np.asarray(indices).tolist()])
        masks = np.take(self._masks, np.asarray(indices, dtype=np.intp), axis=0)  # (a 2-D fancy index: 4x slower)
        return DrawsBatch.masked(self._aes, masks, self.private)  # type: ignore[arg-type]

    def lane(self, lane: Lane, level: int = 0) -> BatchLaneDraws:
        if self._parts is not None:
            return BatchLaneDraws([p.lane(lane, level) for p in self._parts])
        header = (int(lane) << 48) | (int(level) << 32)
        return BatchLaneDraws.masked(self._aes, self._masks, header, self.private)  # type: ignore[arg-type]

    def tags(self, rows: np.ndarray, values: np.ndarray) -> np.ndarray:
        """:meth:`Draws.tags` of each value, ``values[i]`` in partition ``rows[i]``."""
        bits = (np.ascontiguousarray(values, dtype=np.float64).reshape(-1) + 0.0).view(np.uint64)
        header = int(Lane.VALUE_TAG) << 48
        if self._parts is not None:
            return _per_partition(rows, len(self), lambda j, at: self._parts[j]._blocks_at(  # type: ignore[index]
                header, bits[at], first_word=True), np.uint64)
        rows = None if len(self._masks) == 1 else np.asarray(rows, dtype=np.intp)
        return _blocks_at(self._aes, self._masks, rows, header, bits, first_word=True)  # type: ignore[arg-type]


def _per_partition(rows: np.ndarray, partitions: int, draw: Callable[[int, np.ndarray], np.ndarray],
                   dtype) -> np.ndarray:
    """``out[i] = draw(rows[i], ...)``: ``draw(j, at)`` gives partition ``j``'s values at the
    positions ``at`` (where ``rows == j``), partition by partition."""
    rows = np.asarray(rows)
    out = np.empty(len(rows), dtype=dtype)
    order = np.argsort(rows, kind="stable")
    bounds = np.searchsorted(rows[order], np.arange(partitions + 1)).tolist()
    for j in range(partitions):
        if bounds[j + 1] > bounds[j]:
            at = order[bounds[j]:bounds[j + 1]]
            out[at] = draw(j, at)
    return out


class BatchLaneDraws:
    """:class:`LaneDraws` of every partition of a batch; results are ``(partitions, count)``.

    Made from any lanes, one per partition (drawn from one by one), or by
    :meth:`DrawsBatch.lane` from a batch's masks (drawn together, one cipher pass).
    """

    def __init__(self, lanes: Sequence[LaneDraws]):
        self._lanes: list[LaneDraws] | None = list(lanes)
        self._aes: algorithms.AES | None = None
        self._masks = np.empty((len(self._lanes), 2), dtype=np.uint64)
        self._header, self._private = 0, False  # (the lanes say it themselves)

    @classmethod
    def masked(cls, aes: algorithms.AES, masks: np.ndarray, header: int, private: bool) -> BatchLaneDraws:
        """The lane ``header`` of the partitions whose masks are the rows of ``masks``."""
        batch = cls.__new__(cls)
        batch._lanes, batch._aes, batch._masks, batch._header, batch._private = None, aes, masks, header, private
        return batch

    @classmethod
    def of(cls, lane: LaneDraws) -> BatchLaneDraws:
        """One partition's lane as a batch of one."""
        return cls([lane])

    def __len__(self) -> int:
        return len(self._masks)

    def _lane_of(self, j: int) -> LaneDraws:
        if self._lanes is not None:
            return self._lanes[j]
        high, low = self._masks[j].tolist()
        draws = Draws(self._aes, (high << 64) | low, self._private)  # type: ignore[arg-type]
        return LaneDraws(draws, self._header >> 48, (self._header >> 32) & 0xFFFF)

    def _masked_blocks(self, rows: np.ndarray, indices: np.ndarray, attempt: int = 0) -> np.ndarray:
        return _blocks_at(self._aes, self._masks, np.asarray(rows, dtype=np.intp), self._header | attempt,  # type: ignore[arg-type]
                          indices)

    def discrete_laplace(self, scale: float | np.ndarray, start: int, count: int) -> np.ndarray:
        """Partition ``j``'s row is ``lanes[j].discrete_laplace(scale[j], start, count)``
        (``scale`` one value per partition, or one for all)."""
        k = len(self)
        scales = np.broadcast_to(np.asarray(scale, dtype=np.float64), (k,))
        out = np.empty((k, count), dtype=np.int64)
        if k == 1 or count >= _PIECE:  # long rows: counter mode, partition by partition
            for j in range(k):
                out[j] = self._lane_of(j).discrete_laplace(float(scales[j]), start, count)
            return out
        check_range(start, count)
        for s in np.unique(scales).tolist():
            check_scale(s)
        group = max(_PIECE // max(count, 1), 1)  # cache-sized groups of partitions
        one_scale = scales[0] if (scales == scales[0]).all() else None
        indices = np.arange(start, start + count, dtype=np.uint64)
        grid = None if self._aes is None else _GridBlocks(self._aes, self._header, indices, min(group, k))
        scratch = np.empty((min(group, k), count, 2), dtype=np.uint64) if grid is None else None
        for g in range(0, k, group):
            members = min(group, k - g)
            flat = out[g:g + members].reshape(-1)
            if grid is not None:
                blocks = grid.blocks(self._masks[g:g + members])
            else:
                blocks = scratch[:members]
                for j in range(members):
                    lane = self._lane_of(g + j)
                    lane._draws._blocks(lane._header, start, count, blocks[j])
            flat_scale = one_scale if one_scale is not None else np.repeat(scales[g:g + members], count)
            if one_scale == 0:
                flat[:] = 0
                continue
            zero = flat_scale == 0
            rejected = fill_discrete_laplace(blocks.reshape(-1, 2), np.where(zero, 1.0, flat_scale), flat)
            if one_scale is None:
                flat[zero] = 0
                rejected = rejected[~zero[rejected]]
            if rejected.size:
                self._redraw(np.broadcast_to(flat_scale, flat.shape)[rejected], g + rejected // count,
                             start + rejected % count, flat, rejected)
        return out

    def _redraw(self, scale: np.ndarray, rows: np.ndarray, indices: np.ndarray, out: np.ndarray,
                where: np.ndarray) -> None:
        """Redraw ``out[where]``, rejected draws of partitions ``rows`` at ``indices``."""
        indices = np.asarray(indices, dtype=np.int64)
        if self._aes is not None:
            redraw(lambda attempt, chosen: self._masked_blocks(rows[chosen], indices[chosen], attempt), scale, out,
                    where)
            return
        for j in np.unique(rows).tolist():
            mine = np.flatnonzero(rows == j)
            self._lane_of(j)._redraw(float(scale[mine[0]]), indices[mine], out, where[mine])

    def uniform(self, start: int, count: int) -> np.ndarray:
        """``(partitions, count)``: row ``j`` is ``lanes[j].uniform(start, count)``."""
        k = len(self)
        if self._aes is None or k == 1 or count >= _PIECE:
            out = np.empty((k, count))
            for j in range(k):
                out[j] = self._lane_of(j).uniform(start, count)
            return out
        check_range(start, count)
        rows = np.repeat(np.arange(k), count)
        indices = np.tile(np.arange(start, start + count, dtype=np.uint64), k)
        return uniform_of(self._masked_blocks(rows, indices)).reshape(k, count)

    def discrete_laplace_at(self, scale: float, rows: np.ndarray, indices: np.ndarray) -> np.ndarray:
        """One draw per pair: partition ``rows[i]`` at index ``indices[i]`` (one scale for all)."""
        rows = np.asarray(rows, dtype=np.intp)
        indices = check_indices(indices)
        check_scale(scale)
        if not len(rows) or scale == 0:
            return np.zeros(len(rows), dtype=np.int64)
        if self._aes is None:
            return _per_partition(rows, len(self), lambda j, at: self._lane_of(j).discrete_laplace_at(
                scale, indices[at]), np.int64)
        out = np.empty(len(rows), dtype=np.int64)
        rejected = fill_discrete_laplace(self._masked_blocks(rows, indices), scale, out)
        if rejected.size:
            self._redraw(np.full(len(rejected), scale), rows[rejected], indices[rejected], out, rejected)
        return out


_ZEROS = threading.local()


def _zeros(count: int) -> memoryview:
    """``16 * count`` zero bytes (the plaintext of counter mode), reused per thread."""
    buffer = getattr(_ZEROS, "buffer", b"")
    if len(buffer) < 16 * count:
        buffer = _ZEROS.buffer = bytes(16 * max(count, _PIECE))
    return memoryview(buffer)[: 16 * count]


# -- Test mode -------------------------------------------------------------------------------------


class _SeededKeys:
    """Keys derived from a seed, in order: the i-th release of the block gets key i."""

    def __init__(self, seed: int):
        self._seed = int(seed).to_bytes(16, "big", signed=True)
        self._count = 0
        self._lock = threading.Lock()

    def next_key(self) -> bytes:
        with self._lock:
            count, self._count = self._count, self._count + 1
        return hashlib.blake2b(count.to_bytes(8, "big"), key=self._seed, digest_size=KEY_BYTES,
                               person=b"dpsql-test-key").digest()


_test_keys: _SeededKeys | None = None
_test_lock = threading.Lock()


@contextlib.contextmanager
def _seeded(seed: int):
    """Derive release keys from ``seed`` inside the block (process-wide, all threads); yield
    the keystream of the seed's first key (for driving machines by hand in tests)."""
    global _test_keys
    keys = _SeededKeys(seed)
    with _test_lock:
        previous, _test_keys = _test_keys, keys
    try:
        yield Keystream(_SeededKeys(seed).next_key(), private=False)
    finally:
        with _test_lock:
            _test_keys = previous
