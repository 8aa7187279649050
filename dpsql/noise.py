"""The only place randomness comes from: a keyed, addressable keystream.

Every release has a secret 32-byte key from the operating system's CSPRNG
(``os.urandom``). Every noise draw of the release is a function of that key and of the
draw's *address*: the partition it belongs to, the component of the algorithm that
draws it (a :class:`Lane`), a level and an index (a row, a tree node, a time step).
Nothing is drawn "next": a draw is computed, by AES-256 in counter mode (OpenSSL, via
``cryptography``), from its address. Hence

* a row's noise does not depend on how the table was cut into chunks, appends or
  partitions, nor on the order in which partitions run (a continual stream appended a
  row at a time and a one-shot release of the same table draw the same noise);
* a retried or re-executed computation (a Spark task, a crashed append) recomputes the
  same values instead of drawing fresh noise, which would release the data twice.

Keys. ``Keystream.fresh()`` gives a release its key: ``os.urandom(32)``, or, inside
:func:`dpsql.testing.seeded`, a key derived from the seed (non-private; a persistent
ledger refuses such releases). A partition's draws use a sub-key, BLAKE2b keyed by the
release key over the partition's canonical address (:func:`partition_address`), so
partitions never share a counter space whatever their number. Within a partition the
128-bit counter block is ``lane (16 bits) | level (16 bits) | attempt (32 bits) | index
(64 bits)``, each draw using one block: distinct addresses never share keystream.

Float safety
------------
Textbook ``x + laplace()`` on doubles leaks ``x`` through the rounding of the sum
(Mironov, CCS 2012). dpsql never adds continuous noise to a private float: mechanisms
snap the private quantity to a lattice ``gamma * Z`` whose power-of-two spacing depends
only on public parameters and add *integer* noise from :meth:`LaneDraws.discrete_laplace`
(see :class:`dpsql.mechanisms.LaplaceLattice`).

The discrete Laplace draw ``P(Z = k) ∝ exp(-|k| / scale)`` takes one 128-bit block: one
bit of its first word for the sign, 53 bits for a uniform ``U`` in (0, 1], and
``|Z| = floor(-scale * ln U)`` (a geometric variable); the pair (negative sign, 0) is
rejected and redrawn from the same address with the next *attempt*, so that zero is not
counted twice. Every ``U < 2^-20`` (one draw in a million) is refined with the 53 bits of
the block's second word, ``U = (k + V) * 2^-53``: the relative spacing of ``U`` is then
at most ``2^-33`` everywhere, so every integer magnitude is reachable for scales up to
``2^33`` lattice units (:data:`MAX_SCALE`); which outputs are unreachable could otherwise
depend on the input. What remains is the rounding of ``log`` (relative error about
1e-16 on each probability), computed from public quantities only.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import decimal
import enum
import hashlib
import math
import os
import threading
from collections.abc import Sequence

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from dpsql.errors import InvalidParameter

KEY_BYTES = 32
_TWO_POW_M53 = 2.0**-53
_MASK53 = np.uint64((1 << 53) - 1)
# Uniforms below 2^-20 (53-bit grid values below 2^33) are refined; see the module docstring.
_REFINE_BELOW = np.uint64(1 << 33)
_SIGN_BIT = np.uint64(1 << 63)
#: Every uniform the discrete Laplace draw inverts is at least ``2^-106`` (a refined
#: one's smallest value), so every draw has ``|Z| <= scale * MAX_NEG_LOG_UNIFORM``.
MAX_NEG_LOG_UNIFORM = 106 * math.log(2)
#: The largest scale :meth:`LaneDraws.discrete_laplace` accepts: up to it every integer
#: magnitude is reachable (see "Float safety" above).
MAX_SCALE = 2.0**33
#: Indices must stay below this (the counter block's index field, with room to spare).
MAX_INDEX = 1 << 62
# Draws per keystream call: large enough to amortise a call, small enough that the block
# buffer and its temporaries stay in L2 cache while they are turned into noise.
_PIECE = 1 << 14
_MAX_ATTEMPTS = 1 << 31


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


class Keystream:
    """The noise of one release: a secret key and, per partition, addressed draws.

    Examples
    --------
    >>> ks = Keystream(bytes(32), private=False)
    >>> lane = ks.partition(partition_address(7)).lane(Lane.ROWS)
    >>> a = lane.discrete_laplace(100.0, start=0, count=10)
    >>> b = np.concatenate([lane.discrete_laplace(100.0, start=0, count=4),
    ...                     lane.discrete_laplace(100.0, start=4, count=6)])
    >>> bool((a == b).all())   # chunking never changes a draw
    True
    """

    def __init__(self, key: bytes, *, private: bool):
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise InvalidParameter(f"a release key is {KEY_BYTES} bytes")
        self._key = key
        #: False for test (seeded) keys: releases inherit this flag.
        self.private = private

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
        sub_key = hashlib.blake2b(address, key=self._key, digest_size=KEY_BYTES, person=b"dpsql-partition").digest()
        return Draws(sub_key, self.private)

    def partitions(self, addresses: Sequence[bytes]) -> DrawsBatch:
        """The draws of several partitions, drawn together (see :class:`DrawsBatch`)."""
        return DrawsBatch([self.partition(a) for a in addresses])

    def __repr__(self) -> str:
        return f"Keystream(private={self.private})"  # never the key

    def __reduce__(self):
        # A Spark task carries the key inside its closure: that is where it is meant to go.
        return _keystream, (self._key, self.private)


def _keystream(key: bytes, private: bool) -> Keystream:
    return Keystream(key, private=private)


#: Blocks' first words computed per cipher call by :meth:`Draws._blocks_at` (value tags).
_STEP_AT = 4096


class Draws:
    """One partition's addressed draws; :meth:`lane` selects a component."""

    def __init__(self, sub_key: bytes, private: bool):
        self._aes = algorithms.AES(sub_key)
        self.private = private

    def lane(self, lane: Lane, level: int = 0) -> LaneDraws:
        return LaneDraws(self, int(lane), int(level))

    def _blocks(self, header: int, start: int, count: int, out: np.ndarray | None = None) -> np.ndarray:
        """Keystream blocks ``start .. start + count - 1`` under ``header`` as ``(count, 2)``
        little-endian words (written into ``out`` when given)."""
        if out is None:
            out = np.empty((count, 2), dtype=np.uint64)
        if count:
            nonce = header.to_bytes(8, "big") + start.to_bytes(8, "big")
            encryptor = Cipher(self._aes, modes.CTR(nonce)).encryptor()
            encryptor.update_into(_zeros(count), out.view(np.uint8).reshape(-1))
        return out

    def tags(self, values: np.ndarray) -> np.ndarray:
        """A keyed 64-bit tag of each float64 value (AES of its bits under the ``VALUE_TAG``
        lane): equal values get equal tags, and without the key a tag says nothing about its
        value. A continual stream keeps tags, not values, to recognise a row appended twice."""
        bits = np.ascontiguousarray(values, dtype=np.float64).reshape(-1).view(np.uint64)
        return self._blocks_at(int(Lane.VALUE_TAG) << 48, bits, first_word=True)

    def _blocks_at(self, header: int, indices: np.ndarray, *, first_word: bool = False) -> np.ndarray:
        """The keystream blocks at scattered ``indices`` (equal to :meth:`_blocks` there) as
        ``(n, 2)`` words, or only each block's first word: AES of the counter blocks themselves,
        which is what counter mode computes."""
        n = len(indices)
        # first words: a few thousand at a time, so that counters and cipher blocks stay in cache
        # (not two arrays of 16 bytes an index); whole blocks: one call, the cipher's output is the result
        step = min(n, _STEP_AT) if first_word else n
        counters = np.empty((step, 2), dtype=">u8")
        counters[:, 0] = header
        out = np.empty(2 * step + 2, dtype="<u8")  # update_into wants a block to spare
        result = np.empty(n, dtype=np.uint64) if first_word else out[:2 * n].reshape(n, 2).view(np.uint64)
        encryptor = Cipher(self._aes, modes.ECB()).encryptor()
        for at in range(0, n, max(step, 1)):
            m = min(step, n - at)
            counters[:m, 1] = indices[at:at + m]
            encryptor.update_into(counters[:m].view(np.uint8).reshape(-1), out[:2 * m + 2].view(np.uint8))
            if first_word:
                result[at:at + m] = out[:2 * m:2]
        return result


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
        _check_range(start, count)
        return self._draws._blocks(self._header | attempt, start, count)

    def uniform(self, start: int, count: int) -> np.ndarray:
        """Uniform doubles in (0, 1) on the ``2^-53`` grid shifted by half a step, one per index."""
        return _uniform_of(self.blocks(start, count))

    def uniform_at(self, indices: np.ndarray) -> np.ndarray:
        """:meth:`uniform` at scattered ``indices``."""
        indices = _check_indices(indices)
        return _uniform_of(self._draws._blocks_at(self._header, indices))

    def discrete_laplace(self, scale: float, start: int, count: int) -> np.ndarray:
        """``count`` draws ``P(Z = k) = (1-a)/(1+a) * a**|k|``, ``a = exp(-1/scale)``, at indices
        ``start ..``: int64, mean 0, variance ``2a / (1-a)**2`` (about ``2 scale**2``).
        ``scale = 0`` gives zeros; scales above :data:`MAX_SCALE` are refused."""
        _check_range(start, count)
        _check_scale(scale)
        out = np.empty(count, dtype=np.int64)
        if scale == 0:
            out[:] = 0
            return out
        blocks = np.empty((min(count, _PIECE), 2), dtype=np.uint64)
        for a in range(0, count, _PIECE):
            b = min(count, a + _PIECE)
            piece = self._draws._blocks(self._header, start + a, b - a, blocks[: b - a])
            rejected = _fill_discrete_laplace(piece, scale, out[a:b])
            if rejected.size:
                self._redraw(scale, start + a + rejected, out[a:b], rejected)
        return out

    def discrete_laplace_at(self, scale: float, indices: np.ndarray) -> np.ndarray:
        """:meth:`discrete_laplace` at scattered ``indices`` (the same draw as at a range)."""
        indices = _check_indices(indices)
        _check_scale(scale)
        out = np.zeros(len(indices), dtype=np.int64)
        if scale == 0 or not len(indices):
            return out
        rejected = _fill_discrete_laplace(self._draws._blocks_at(self._header, indices), scale, out)
        if rejected.size:
            self._redraw(scale, indices[rejected], out, rejected)
        return out

    def _redraw(self, scale: float, indices: np.ndarray, out: np.ndarray, where: np.ndarray) -> None:
        """Redraw the rejected draws at ``indices`` (``out[where]``) with the next attempts."""
        attempt = 1
        while where.size:
            if attempt >= _MAX_ATTEMPTS:  # probability below 2**-(2**31): never
                raise RuntimeError("discrete Laplace: too many rejections")
            blocks = self._draws._blocks_at(self._header | attempt, indices)
            redraw = np.empty(len(indices), dtype=np.int64)
            still = _fill_discrete_laplace(blocks, scale, redraw)
            keep = np.ones(len(indices), dtype=bool)
            keep[still] = False
            out[where[keep]] = redraw[keep]
            where, indices = where[still], indices[still]
            attempt += 1


class DrawsBatch:
    """Several partitions' draws, for machines that release equal-length partitions
    together: each partition's draws are exactly its own :class:`Draws`' (computed from
    its own sub-key); only the arithmetic turning blocks into noise is shared."""

    def __init__(self, partitions: Sequence[Draws]):
        self.partitions = list(partitions)
        self.private = all(p.private for p in self.partitions)

    def __len__(self) -> int:
        return len(self.partitions)

    def __getitem__(self, k: int) -> Draws:
        return self.partitions[k]

    def lane(self, lane: Lane, level: int = 0) -> BatchLaneDraws:
        return BatchLaneDraws([p.lane(lane, level) for p in self.partitions])


class BatchLaneDraws:
    """:class:`LaneDraws` of every partition of a batch; results are ``(partitions, count)``."""

    def __init__(self, lanes: Sequence[LaneDraws]):
        self.lanes = list(lanes)

    def discrete_laplace(self, scale: float | np.ndarray, start: int, count: int) -> np.ndarray:
        """Partition ``j``'s row is ``lanes[j].discrete_laplace(scale[j], start, count)``
        (``scale`` one value per partition, or one for all)."""
        scales = np.broadcast_to(np.asarray(scale, dtype=np.float64), (len(self.lanes),))
        out = np.empty((len(self.lanes), count), dtype=np.int64)
        if len(self.lanes) == 1 or count >= _PIECE:
            for j, lane in enumerate(self.lanes):
                out[j] = lane.discrete_laplace(float(scales[j]), start, count)
            return out
        group = _PIECE // max(count, 1)
        if len(self.lanes) > group:  # cache-sized groups of partitions: the arithmetic's arrays stay small
            for g in range(0, len(self.lanes), group):
                out[g:g + group] = BatchLaneDraws(self.lanes[g:g + group]).discrete_laplace(
                    scales[g:g + group], start, count)
            return out
        _check_range(start, count)
        for s in np.unique(scales).tolist():
            _check_scale(s)
        blocks = np.empty((len(self.lanes), count, 2), dtype=np.uint64)
        for j, lane in enumerate(self.lanes):
            lane._draws._blocks(lane._header, start, count, blocks[j])
        flat_scale = np.repeat(scales, count)
        zero = flat_scale == 0
        rejected = _fill_discrete_laplace(blocks.reshape(-1, 2), np.where(zero, 1.0, flat_scale), out.reshape(-1))
        out.reshape(-1)[zero] = 0
        rejected = rejected[~zero[rejected]]
        for j in np.unique(rejected // count).tolist():
            mine = rejected[rejected // count == j] - j * count
            self.lanes[j]._redraw(float(scales[j]), start + mine, out[j], mine)
        return out

    def uniform(self, start: int, count: int) -> np.ndarray:
        """``(partitions, count)``: row ``j`` is ``lanes[j].uniform(start, count)``."""
        out = np.empty((len(self.lanes), count))
        for j, lane in enumerate(self.lanes):
            out[j] = lane.uniform(start, count)
        return out

    def discrete_laplace_at(self, scale: float, rows: np.ndarray, indices: np.ndarray) -> np.ndarray:
        """One draw per pair: partition ``rows[i]`` at index ``indices[i]`` (one scale for all)."""
        out = np.empty(len(indices), dtype=np.int64)
        rows = np.asarray(rows)
        if not len(rows):
            return out
        if not (rows[1:] < rows[:-1]).any():  # grouped by partition already (Noisy Max's contenders): slices
            bounds = np.searchsorted(rows, np.arange(len(self.lanes) + 1)).tolist()
            indices = np.asarray(indices)
            for j in range(int(rows[0]), int(rows[-1]) + 1):  # the partitions asked for
                if bounds[j + 1] > bounds[j]:
                    out[bounds[j]:bounds[j + 1]] = self.lanes[j].discrete_laplace_at(
                        scale, indices[bounds[j]:bounds[j + 1]])
            return out
        order = np.argsort(rows, kind="stable")
        bounds = np.searchsorted(rows[order], np.arange(len(self.lanes) + 1))
        for j in range(len(self.lanes)):
            picked = order[bounds[j]:bounds[j + 1]]
            if picked.size:
                out[picked] = self.lanes[j].discrete_laplace_at(scale, indices[picked])
        return out


def _fill_discrete_laplace(blocks: np.ndarray, scale, out: np.ndarray) -> np.ndarray:
    """Signed geometric draws from ``blocks`` (``(n, 2)`` words) into ``out``; the indices
    to redraw (negative zeros). ``scale`` is one value or one per draw (all positive)."""
    first = blocks[:, 0]
    bits = first & _MASK53
    u = np.add(bits, 1.0)
    if bits.min(initial=_REFINE_BELOW) < _REFINE_BELOW:
        coarse = np.flatnonzero(bits < _REFINE_BELOW)
        refinement = (blocks[coarse, 1] & _MASK53).astype(np.float64)
        u[coarse] = bits[coarse].astype(np.float64) + (refinement + 1.0) * _TWO_POW_M53
    u *= _TWO_POW_M53
    np.log(u, out=u)
    u *= -np.asarray(scale)
    # The word's top bit becomes the float's sign bit; the conversion to int64 then truncates
    # toward zero, i.e. gives -floor(x) for negative x.
    u.view(np.uint64)[:] |= first & _SIGN_BIT
    out[:] = u
    zeros = np.flatnonzero(out == 0)
    return zeros[first[zeros] >= _SIGN_BIT]


def _uniform_of(blocks: np.ndarray) -> np.ndarray:
    return ((blocks[:, 0] >> np.uint64(11)).astype(np.float64) + 0.5) * _TWO_POW_M53


def _check_range(start: int, count: int) -> None:
    if not (start >= 0 and count >= 0 and start + count <= MAX_INDEX):
        raise ValueError(f"draw indices {start}..{start + count} out of range")


def _check_indices(indices) -> np.ndarray:
    indices = np.asarray(indices, dtype=np.int64)
    if indices.size and (indices.min() < 0 or indices.max() >= MAX_INDEX):
        raise ValueError("draw indices out of range")
    return indices


def _check_scale(scale: float) -> None:
    if not 0 <= scale <= MAX_SCALE:
        raise InvalidParameter(f"discrete_laplace scale must be in [0, 2**33] (the sampler's resolution limit), "
                               f"got {scale!r}")


_ZEROS = threading.local()


def _zeros(count: int) -> memoryview:
    """``16 * count`` zero bytes (the plaintext of counter mode), reused per thread."""
    buffer = getattr(_ZEROS, "buffer", b"")
    if len(buffer) < 16 * count:
        buffer = _ZEROS.buffer = bytes(16 * max(count, _PIECE))
    return memoryview(buffer)[: 16 * count]


# -- Partition addresses ---------------------------------------------------------------------------

_EPOCH = _dt.datetime(1970, 1, 1)
_EPOCH_DATE = _dt.date(1970, 1, 1)


def partition_address(key) -> bytes:
    """The canonical bytes of a partition key: equal for equal keys whichever engine
    produced them (an int from DuckDB, Polars, Spark or Python; a date; a timestamp as its
    microseconds), distinct for distinct keys. A tuple is a multi-column key.

    >>> partition_address(3) == partition_address(np.int8(3)), partition_address("3") == partition_address(3)
    (True, False)
    """
    if key is None:  # null keys form one partition where a front end allows them
        return b"n"
    if isinstance(key, tuple):
        return b"T" + b"".join(len(p).to_bytes(4, "big") + p for p in map(partition_address, key))
    if isinstance(key, (bool, np.bool_)):
        return b"b" + (b"1" if key else b"0")
    if isinstance(key, (int, np.integer)):
        return b"i" + str(int(key)).encode()
    if isinstance(key, (float, np.floating)):
        value = float(key)
        if value.is_integer():
            return b"i" + str(int(value)).encode()
        return b"f" + value.hex().encode()
    if isinstance(key, decimal.Decimal):
        return b"i" + str(int(key)).encode() if key == key.to_integral_value() else b"f" + float(key).hex().encode()
    if isinstance(key, str):
        return b"s" + key.encode()
    if isinstance(key, bytes):
        return b"y" + key
    if isinstance(key, _dt.datetime):
        if key.tzinfo is not None:
            key = key.astimezone(_dt.UTC).replace(tzinfo=None)
        return b"t" + str((key - _EPOCH) // _dt.timedelta(microseconds=1)).encode()
    if isinstance(key, _dt.date):
        return b"d" + str((key - _EPOCH_DATE).days).encode()
    if isinstance(key, _dt.time):
        return b"h" + key.isoformat().encode()
    if isinstance(key, np.datetime64):
        return partition_address(key.astype("datetime64[us]").astype(_dt.datetime))
    raise InvalidParameter(f"partition key {key!r} of type {type(key).__name__} is not supported")


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
