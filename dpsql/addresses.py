"""Partition keys as noise addresses: exact canonical bytes, one per distinct key.

A partition's noise is addressed by its key (:mod:`dpsql.noise`). Two partitions whose keys
gave the same bytes would draw identical noise while being charged as disjoint, and the
difference of their releases would reveal their raw values. The encoding is therefore
injective on every key type the front ends accept, exact (no key is rounded: nanoseconds,
decimals and 64-bit integers keep every digit), and equal keys give equal bytes whichever
engine produced them (Python, Polars, DuckDB, Spark, Arrow):

====================================================  ==========================================
key                                                    bytes
====================================================  ==========================================
NULL                                                   ``n``
boolean                                                ``b0``, ``b1``
a number equal to an integer (any integer type, or     ``i`` and its decimal digits
a float or decimal equal to one, ``-0.0`` included)
any other finite number (float, decimal)               ``q`` and its exact decimal expansion
                                                       (every binary float has one), without
                                                       trailing zeros
infinity                                               ``q+inf``, ``q-inf``
string                                                 ``s`` and its UTF-8 bytes
binary                                                 ``y`` and the bytes
date                                                   ``d`` and its days since 1970-01-01
timestamp (any unit; a zoned one as its UTC instant)   ``t`` and its nanoseconds since 1970-01-01
time of day                                            ``h`` and its nanoseconds since midnight
duration                                               ``D`` and its nanoseconds
several columns                                        ``T`` and each column's bytes, each after its
                                                       length (4 bytes, big-endian)
====================================================  ==========================================

The tags make the kinds disjoint, and within a kind the text is a canonical exact form, so
distinct keys never share bytes. Numbers are compared by value: ``3``, ``3.0`` and
``Decimal("3.00")`` are one key, so a list of partition keys holding two of them repeats a
key, which every front end refuses (:func:`refuse_repeated`). NaN is not a key.

The unpartitioned stream's address is ``b""``, which no key's is.
"""

from __future__ import annotations

import datetime as dt
import decimal
import math
from collections.abc import Sequence

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from dpsql._groups import unique
from dpsql.errors import InvalidParameter

_EPOCH = dt.datetime(1970, 1, 1)
_EPOCH_DATE = dt.date(1970, 1, 1)
_NANOSECONDS = {"s": 10**9, "ms": 10**6, "us": 10**3, "ns": 1}
_INT64_LIMIT = 2**63


def partition_address(key) -> bytes:
    """The canonical bytes of one partition key (module docstring); a tuple is a key of
    several columns.

    >>> partition_address(3) == partition_address(3.0) == partition_address(np.int8(3))
    True
    >>> partition_address("3") == partition_address(3), partition_address(0.1)[:12]
    (False, b'q0.100000000')
    """
    if key is None:
        return b"n"
    if isinstance(key, tuple):
        return b"T" + b"".join(len(p).to_bytes(4, "big") + p for p in map(partition_address, key))
    if isinstance(key, (bool, np.bool_)):
        return b"b1" if key else b"b0"
    if isinstance(key, np.timedelta64):  # (before integers: numpy's timedelta64 is a signed integer type)
        return b"D" + str(_numpy_nanoseconds(key, "timedelta64")).encode()
    if isinstance(key, (int, np.integer)):
        return b"i" + str(int(key)).encode()
    if isinstance(key, (float, np.floating)):
        return _number(decimal.Decimal(float(key)) if math.isfinite(key) else float(key))
    if isinstance(key, decimal.Decimal):
        return _number(key)
    if isinstance(key, str):
        try:
            return b"s" + key.encode()
        except UnicodeEncodeError:
            raise InvalidParameter(f"partition key {key!r} is not valid text (it cannot be encoded as UTF-8)") from None
    if isinstance(key, (bytes, bytearray, memoryview)):
        return b"y" + bytes(key)
    if isinstance(key, np.datetime64):
        return b"t" + str(_numpy_nanoseconds(key, "datetime64")).encode()
    if isinstance(key, dt.datetime):
        return b"t" + str(_datetime_nanoseconds(key)).encode()
    if isinstance(key, dt.date):
        return b"d" + str((key - _EPOCH_DATE).days).encode()
    if isinstance(key, dt.time):
        seconds = (key.hour * 60 + key.minute) * 60 + key.second
        return b"h" + str(seconds * 10**9 + key.microsecond * 1000 + getattr(key, "nanosecond", 0)).encode()
    if isinstance(key, dt.timedelta):
        nanoseconds = getattr(key, "value", None)  # a pandas Timedelta keeps its nanoseconds
        if nanoseconds is None:
            nanoseconds = (key.days * 86_400 + key.seconds) * 10**9 + key.microseconds * 1000
        return b"D" + str(int(nanoseconds)).encode()
    raise InvalidParameter(f"partition key {key!r} of type {type(key).__name__} is not supported (partition keys "
                           "are numbers, text, binary, booleans, dates, times, timestamps or durations)")


def _number(value: decimal.Decimal | float) -> bytes:
    """``i`` and the digits of an integer value, else ``q`` and the exact decimal expansion."""
    if isinstance(value, float):  # an infinity or NaN (finite floats come as their exact Decimal)
        if math.isnan(value):
            raise InvalidParameter("a partition key is NaN; NaN equals nothing, so it cannot name a partition")
        return b"q+inf" if value > 0 else b"q-inf"
    if value.is_nan():
        raise InvalidParameter("a partition key is NaN; NaN equals nothing, so it cannot name a partition")
    if value.is_infinite():
        return b"q+inf" if value > 0 else b"q-inf"
    if value == value.to_integral_value():
        return b"i" + str(int(value)).encode()
    text = format(value, "f")  # exact: formatting a Decimal never rounds it
    return b"q" + text.rstrip("0").encode()


def _datetime_nanoseconds(key: dt.datetime) -> int:
    nanoseconds = getattr(key, "value", None)  # a pandas Timestamp: UTC nanoseconds, exactly
    if nanoseconds is not None:
        return int(nanoseconds)
    if key.tzinfo is not None:
        key = key.astimezone(dt.UTC).replace(tzinfo=None)
    return (key - _EPOCH) // dt.timedelta(microseconds=1) * 1000


def _numpy_nanoseconds(key, kind: str) -> int:
    if np.isnat(key):
        raise InvalidParameter(f"a partition key is NaT (a missing {kind}); it cannot name a partition")
    unit, count = np.datetime_data(key.dtype)
    factors = {"D": 86_400 * 10**9, "h": 3_600 * 10**9, "m": 60 * 10**9, **_NANOSECONDS, "ps": None, "fs": None,
               "as": None}
    factor = factors.get(unit)
    if factor is None:
        raise InvalidParameter(f"partition key {key!r}: {kind} unit {unit!r} is not supported")
    return int(key.astype(np.int64)) * factor * count


def partition_addresses(columns: Sequence[pa.Array | pa.ChunkedArray]) -> pa.Array:
    """The canonical bytes of each row's key (one column, or a tuple of several), as an Arrow
    binary array: equal, row by row, to :func:`partition_address` of the row's key as Python
    holds it (and exact where Python's types are not: nanoseconds).

    >>> import pyarrow as pa
    >>> partition_addresses([pa.array([3, 4])]).to_pylist() == [partition_address(3), partition_address(4)]
    True
    """
    encoded = [_column_addresses(c.combine_chunks() if isinstance(c, pa.ChunkedArray) else c) for c in columns]
    if len(encoded) == 1:
        return encoded[0]
    pieces: list = [pa.scalar(b"T", pa.large_binary())]
    for column in encoded:
        lengths = pc.binary_length(column).to_numpy(zero_copy_only=False).astype(">u4")
        pieces += [pa.FixedSizeBinaryArray.from_buffers(pa.binary(4), len(lengths), [None, pa.py_buffer(
            lengths.tobytes())]).cast(pa.large_binary()), column]
    return pc.binary_join_element_wise(*pieces, pa.scalar(b"", pa.large_binary()))


def _column_addresses(column: pa.Array) -> pa.Array:
    """:func:`partition_address` of every value of one column, vectorised by type."""
    kind = column.type
    if pa.types.is_dictionary(kind):
        return _column_addresses(column.dictionary_decode())
    if pa.types.is_null(kind):
        return pa.array([b"n"] * len(column), pa.large_binary())
    if pa.types.is_string_view(kind) or pa.types.is_binary_view(kind):  # (Arrow cannot filter views: drop_null)
        return _column_addresses(column.cast(pa.large_string() if pa.types.is_string_view(kind) else pa.large_binary()))
    if column.null_count:  # NULL is ``n``, as for a key Python holds as None: the others encoded by type
        return pc.replace_with_mask(pa.array([b"n"] * len(column), pa.large_binary()), column.is_valid(),
                                    _column_addresses(column.drop_null()))
    if pa.types.is_boolean(kind):
        encoded = pc.if_else(column, pa.scalar(b"b1", pa.large_binary()), pa.scalar(b"b0", pa.large_binary()))
    elif pa.types.is_integer(kind):
        encoded = _tagged(b"i", column)
    elif pa.types.is_floating(kind):
        return _float_addresses(column)
    elif pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind):
        encoded = _tagged(b"s", column.cast(pa.large_string()))
    elif pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_fixed_size_binary(kind) or \
            pa.types.is_binary_view(kind):
        encoded = _tagged(b"y", column.cast(pa.large_binary()))
    elif pa.types.is_date(kind):
        encoded = _tagged(b"d", column.cast(pa.date32()).cast(pa.int32()))
    elif pa.types.is_timestamp(kind):
        encoded = _scaled(b"t", column, kind.unit)
    elif pa.types.is_time(kind):
        encoded = _scaled(b"h", column, kind.unit)
    elif pa.types.is_duration(kind):
        encoded = _scaled(b"D", column, kind.unit)
    elif pa.types.is_decimal(kind):  # exact through Python's Decimal (decimal keys are few)
        return pa.array([None if v is None else partition_address(v) for v in column.to_pylist()], pa.large_binary())
    else:
        raise InvalidParameter(f"partition keys of type {kind} are not supported (partition keys are numbers, text, "
                               "binary, booleans, dates, times, timestamps or durations)")
    return encoded


def _tagged(tag: bytes, column: pa.Array) -> pa.Array:
    """``tag`` (one byte) followed by each value's text (numbers: their decimal digits) or bytes."""
    text = column if pa.types.is_large_string(column.type) or pa.types.is_large_binary(column.type) else \
        column.cast(pa.large_string())
    return pc.binary_replace_slice(text.cast(pa.large_binary()), 0, 0, tag)


def _scaled(tag: bytes, column: pa.Array, unit: str) -> pa.Array:
    """Timestamps, times and durations as ``tag`` and their nanoseconds (exact: Python's
    integers where nanoseconds would pass an int64)."""
    raw = (column.cast(pa.int32()) if pa.types.is_time32(column.type) else column).cast(pa.int64()).to_numpy(
        zero_copy_only=False)  # (Arrow casts time32 to int32 only)
    factor = _NANOSECONDS[unit]
    limit = _INT64_LIMIT // factor  # (not np.abs: the abs of int64's minimum is itself, negative)
    if factor == 1 or not len(raw) or (raw.max() < limit and raw.min() > -limit):
        return _tagged(tag, pa.array(raw * factor, pa.int64()))
    return pa.array([tag + str(int(v) * factor).encode() for v in raw.tolist()], pa.large_binary())


def _float_addresses(column: pa.Array) -> pa.Array:
    values = column.cast(pa.float64()).to_numpy(zero_copy_only=False)
    if np.isnan(values).any():
        raise InvalidParameter("a partition key is NaN; NaN equals nothing, so it cannot name a partition")
    integral = np.isfinite(values) & (values == np.trunc(values)) & (np.abs(values) < _INT64_LIMIT)
    if integral.all():
        return _tagged(b"i", pa.array(values.astype(np.int64)))
    return pa.array([partition_address(float(v)) for v in values.tolist()], pa.large_binary())


def address_ranks(addresses: pa.Array) -> np.ndarray:
    """Each partition's rank when partitions are ordered by their addresses (``addresses``, one
    per partition): the order in which a fleet's pooled hold-out takes rows of equal order keys,
    the same whichever front end or engine listed the partitions.

    >>> address_ranks(partition_addresses([pa.array(["b", "c", "a"])])).tolist()
    [1, 2, 0]
    """
    ranks = np.empty(len(addresses), np.int64)
    ranks[pc.sort_indices(addresses).to_numpy()] = np.arange(len(addresses))
    return ranks


def refuse_repeated(addresses: Sequence[bytes] | pa.Array, keys: Sequence | None = None, *,
                    what: str = "partition key") -> None:
    """Refuse (:class:`~dpsql.InvalidParameter`) a key given twice: two partitions with one
    address would draw the same noise. ``keys`` (one per address) name it in the message."""
    array = addresses if isinstance(addresses, pa.Array) else pa.array(list(addresses), pa.large_binary())
    if len(array) < 2 or pl.from_arrow(array).n_unique() == len(array):  # (Polars hashes bytes 3x faster than Arrow)
        return
    counts = pc.value_counts(array)
    repeated = pc.filter(counts.field("values"), pc.greater(counts.field("counts"), 1))
    if len(repeated):
        first = int(pc.index(array, repeated[0]).as_py())
        second = first + 1 + int(pc.index(array.slice(first + 1), repeated[0]).as_py())
        if keys is None:
            shown = f"number {first}"
        elif repr(keys[first]) == repr(keys[second]):
            shown = repr(keys[first])
        else:
            shown = f"{keys[first]!r} (as {keys[second]!r})"
        raise InvalidParameter(f"{what} {shown} given twice (partitions {first} and {second}): each partition "
                               "needs its own key, or two partitions would draw the same noise (numbers are one "
                               "key by value: 3 and 3.0 are the same key)")


def masks(aes: algorithms.AES, addresses: Sequence[bytes] | pa.Array) -> np.ndarray:
    """Each canonical address's 128-bit mask (:mod:`dpsql.noise`, "Addresses") as ``(n, 2)``
    uint64 words (high, low): CBC-MAC under ``aes`` of one block holding the address's length
    (big-endian) followed by the address, zero-padded to whole blocks. Addresses are handled in
    groups of equal block counts, each group's blocks laid out by numpy and chained with one ECB
    call per block."""
    if isinstance(addresses, pa.ChunkedArray):
        addresses = addresses.combine_chunks()
    if not isinstance(addresses, pa.Array):
        addresses = pa.array(list(addresses), pa.large_binary())
    addresses = addresses.cast(pa.large_binary())
    offsets = np.frombuffer(addresses.buffers()[1], np.int64)[addresses.offset:addresses.offset + len(addresses) + 1]
    lengths = np.diff(offsets)
    blocks = (lengths + 15) >> 4
    encryptor = Cipher(aes, modes.ECB()).encryptor()
    longest = int(lengths.max()) if len(lengths) else 0
    # the first block holds the length alone: for addresses of up to _LENGTH_TABLE bytes, each
    # possible length's is encrypted once and looked up
    tabled = longest <= _LENGTH_TABLE
    first = np.zeros((longest + 1 if tabled else len(lengths), 2), dtype=">u8")
    first[:, 1] = np.arange(longest + 1) if tabled else lengths
    state = _encrypted(encryptor, first.view(np.uint8))
    if tabled:
        state = _rows(state, lengths)
    raw = np.frombuffer(addresses.buffers()[2], np.uint8) if len(addresses) else np.empty(0, np.uint8)
    counts = unique(blocks).tolist()
    for count in counts:
        if count == 0:
            continue
        every = len(counts) == 1  # (then its rows' masks are the whole state: no gather, no scatter)
        rows = None if every else np.flatnonzero(blocks == count)
        data = _padded(raw, offsets[:-1] if every else offsets[rows], lengths if every else lengths[rows], count)
        chained = state if every else _rows(state, rows)
        for b in range(count):
            chained ^= data[:, 16 * b:16 * (b + 1)]
            chained = _encrypted(encryptor, chained)
        if every:
            state = chained
        else:
            state[rows] = chained
    return state.view(">u8").astype(np.uint64)


def _rows(blocks: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The rows ``rows`` of ``blocks`` (``(n, 16)`` uint8), taken as 16-byte items (a 2-D fancy
    index copies them a byte at a time, eight times slower)."""
    return np.take(blocks.view(np.complex128).reshape(-1), rows).view(np.uint8).reshape(-1, 16)


def _padded(raw: np.ndarray, starts: np.ndarray, lengths: np.ndarray, count: int) -> np.ndarray:
    """The byte strings ``raw[starts[i]:starts[i] + lengths[i]]``, each zero-padded to ``count``
    blocks, as the rows of a ``(n, 16 * count)`` matrix, gathered eight bytes at a time (a view
    of ``raw`` whose i-th word starts at byte i), the bytes past each string's end masked off."""
    buffer = np.concatenate([raw, np.zeros(16 * count + 8, np.uint8)])
    words = np.ndarray((len(buffer) - 7,), dtype="<u8", buffer=buffer, strides=(1,))
    data = np.empty((len(starts), 2 * count), dtype="<u8")
    shortest, longest = (int(lengths.min()), int(lengths.max())) if len(lengths) else (0, 0)
    for w in range(2 * count):
        if longest <= 8 * w:  # past every string's end
            data[:, w] = 0
        elif shortest >= 8 * (w + 1):  # inside every string
            np.take(words, starts + 8 * w, out=data[:, w])
        else:  # each string's bytes of this word kept, the rest masked off
            np.bitwise_and(words[starts + 8 * w], _KEPT[np.clip(lengths - 8 * w, 0, 8)], out=data[:, w])
    return data.view(np.uint8)


#: The mask keeping a word's first ``j`` bytes (little-endian), ``j = 0 .. 8``.
_KEPT = np.array([(1 << (8 * j)) - 1 for j in range(9)], dtype=np.uint64)
#: Addresses up to this length have their length block encrypted once per distinct length.
_LENGTH_TABLE = 1 << 12


def _encrypted(encryptor, blocks: np.ndarray) -> np.ndarray:
    """``blocks`` (``(n, 16)`` uint8) through the ECB ``encryptor``."""
    out = np.empty(16 * len(blocks) + 16, dtype=np.uint8)  # update_into wants a block to spare
    encryptor.update_into(np.ascontiguousarray(blocks).reshape(-1), out)
    return out[:16 * len(blocks)].reshape(-1, 16)
