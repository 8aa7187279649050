"""Released rows as the ledger stores them: one Arrow IPC stream per chunk, each 8-byte column in
the smallest of a few lossless encodings that cost almost nothing to find, and plain columns again
on reading.

A general compressor is the wrong tool here: LZ4 spent a third of a continual append compressing
chunks, and the bytes it saved were then written once more by the commit. What repeats in released
rows has a known shape, and each shape has a direct encoding:

- the order keys ascend, mostly on a grid: their differences form a few runs (a grid: two);
- a released value often holds for many rows (ToPS releases a value per node of its hierarchy);
- the keyed tag of each value repeats as often as the value does (counts, readings in steps).

So every column of 64-bit integers, floats, timestamps or durations, or of 32-bit integers (the
value tags), without nulls, in a table of at least 256 rows (a smaller one is stored as it is), is
stored as its bits (``int64``), the ``key`` and ``dp_index`` columns as the differences of
consecutive values (the first one in the field's metadata), in the first of these that applies:

- run-length encoded, when there are fewer than a third as many runs as rows (the runs of a
  column of differences divided by their common step, in the field's metadata: an hourly grid of
  keys in microseconds runs in steps of 1);
- dictionary encoded with 8- or 16-bit indices, when few distinct values are seen in the
  first rows and the whole column has at most 65,536 (a column may also come encoded so);
- integers (not floats' bits; but a float key's differences) in the narrowest that holds them all,
  when 32 bits do;
- floats as multiples of a power of two (the exponent in the field's metadata), their units in
  the narrowest integers that hold them, when every value is one on a lattice of 32-bit units
  (the Laplace mechanism's releases: about 18 bits a value);
- as it is.

The narrowest integers are 8, 16, 24 or 32 bits; 24 as two planes, the low 16 bits and a byte for
the rest (a struct column; not for runs, whose ends take 32 bits anyway). Bytes saved are worth
more than they cost to find: the ledger writes each byte twice (its write-ahead log, then the
file), about 5 ms a megabyte on a virtual machine's disk.

Bits, not values, so that ``-0.0`` and ``0.0`` stay apart and every float round-trips exactly;
two's complement differences, so any ``int64`` keys do. A large table's columns are encoded on two
threads (numpy lets go of the GIL in its loops).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dpsql._memory import pooled_array
from dpsql._parallel import on_two_threads

#: Field metadata of a stored column: its type (present when it is stored as int64 bits) and,
#: for the columns stored as differences, ``delta`` and the first value.
_TYPE, _ENCODING, _FIRST = b"dpsql.type", b"dpsql.encoding", b"dpsql.first"
#: A column of differences stored divided by their common step (in its runs).
_STEP = b"dpsql.step"
#: A lattice-encoded column's power of two.
_EXPONENT = b"dpsql.exponent"
_INT32 = np.iinfo(np.int32)
#: Integers of 17 to 24 bits stored in two planes: their low 16 bits, and the rest in a byte.
_PLANES = (pa.field("low", pa.uint16(), nullable=False), pa.field("high", pa.int8(), nullable=False))
#: Columns stored as differences: the order keys, and each partition's row numbers (which count up
#: by one along a partition's rows: one run per partition).
_ASCENDING = ("key", "dp_index")
#: Rows looked at before dictionary-encoding a whole column, and how many distinct ones among
#: them make it worth hashing all of it.
_SAMPLE, _FEW = 1024, 256
#: Rows from which a table's columns are encoded: below, finding an encoding costs more time than
#: the bytes it saves are worth (a partition's few pending keys, rewritten at every append).
_ENCODED_FROM = 256
#: Rows from which a table's columns are encoded on two threads (below, starting one costs more
#: than it saves).
_THREADED_FROM = 1 << 16
#: Fibonacci hashing's multiplier (2**64 over the golden ratio, odd): spreads any bits to the top.
_MIX = np.uint64(0x9E3779B97F4A7C15)


def table_bytes(table: pa.Table) -> bytes:
    """``table`` as the bytes the ledger stores (:func:`table_of` restores it, with plain columns).

    A column may come dictionary-encoded already (its chunks with different dictionaries): its
    dictionaries are merged, not its rows hashed again."""
    return table_buffer(table).to_pybytes()


def table_buffer(table: pa.Table) -> pa.Buffer:
    """:func:`table_bytes` in Arrow's memory, not copied: for a chunk of released rows, megabytes
    that the ledger's driver copies itself. A large table's columns are encoded on two threads."""
    encoded = []
    for at, field in enumerate(table.schema):
        column = table.column(at)
        if pa.types.is_dictionary(field.type) and _as_bits(field.type.value_type):
            field, stored = _given_dictionary(field, column)
            table = table.set_column(at, field, stored)
            column = table.column(at)
        if table.num_rows >= _ENCODED_FROM and column.null_count == 0 and _as_bits(field.type):
            encoded.append(at)
    # floats first: checking a lattice costs the most, and each thread takes the next column
    encoded.sort(key=lambda at: not pa.types.is_float64(table.schema.field(at).type))
    columns = [(table.schema.field(at), table.column(at)) for at in encoded]
    if table.num_rows >= _THREADED_FROM and len(columns) > 1:
        stored = on_two_threads(lambda c: _encoded(*c), columns)
    else:
        stored = [_encoded(*c) for c in columns]
    for at, (field, column) in zip(encoded, stored):
        table = table.set_column(at, field, column)
    sink = pa.BufferOutputStream()
    # one thread: handing a table's few buffers to Arrow's pool costs more than it saves, and
    # far more on a busy machine (each task waits for a core)
    with pa.ipc.new_stream(sink, table.schema, options=pa.ipc.IpcWriteOptions(use_threads=False)) as writer:
        writer.write_table(table)
    return sink.getvalue()


def table_of(data: bytes) -> pa.Table:
    """The table :func:`table_bytes` stored, with plain columns; also the LZ4-compressed chunks
    of earlier versions, whose keys' first difference is the first key."""
    table = pa.ipc.open_stream(pa.py_buffer(data), options=pa.ipc.IpcReadOptions(use_threads=False)).read_all()
    for at, field in enumerate(table.schema):
        if field.metadata and _TYPE in field.metadata:
            table = table.set_column(at, *_decoded(field, table.column(at)))
    return table


def _as_bits(kind: pa.DataType) -> bool:
    return (pa.types.is_int64(kind) or pa.types.is_uint64(kind) or pa.types.is_float64(kind)
            or pa.types.is_timestamp(kind) or pa.types.is_duration(kind) or pa.types.is_int32(kind))


def _encoded(field: pa.Field, column: pa.ChunkedArray) -> tuple[pa.Field, pa.Array]:
    narrow = pa.types.is_int32(field.type)  # the value tags: only a run-length or dictionary encoding is smaller
    metadata = {_TYPE: str(field.type).encode()}
    if field.name in _ASCENDING:
        bits, first = _differences(column, narrow)
        metadata.update({_ENCODING: b"delta", _FIRST: str(first).encode()})
    else:
        bits = _bits(column, narrow)
    changed = np.not_equal(bits[1:], bits[:-1], out=pooled_array(len(bits) - 1, np.bool_))
    stored = None
    if 3 * (1 + np.count_nonzero(changed)) < len(bits):
        ends = np.append(np.flatnonzero(changed) + 1, len(bits)).astype(np.int32)
        runs = bits[ends - 1]
        if field.name in _ASCENDING and (step := _common_step(runs)) > 1:
            metadata[_STEP] = str(step).encode()
            runs //= step
        stored = pa.RunEndEncodedArray.from_arrays(ends, _narrowest(runs, planes=False))
    elif (found := distinct(bits)) is not None:
        stored = _dictionary(*found)
    # floats' bits (which fit 32 only for 0.0 and tiny subnormals), not the differences of a float key's bits:
    # as floats those are not the values, so their lattice would restore them, not the keys
    floats = pa.types.is_float64(field.type) and field.name not in _ASCENDING
    if stored is None and not (narrow or floats) and _INT32.min <= bits.min() and bits.max() <= _INT32.max:
        stored = _narrowest(bits)
    if stored is None and floats and (found_lattice := lattice(bits.view(np.float64))):
        exponent, units = found_lattice
        metadata.update({_ENCODING: b"lattice", _EXPONENT: str(exponent).encode()})
        stored = _narrowest(units)
    if stored is None:
        if field.name not in _ASCENDING:
            return field, column
        stored = pa.array(bits)
    return pa.field(field.name, stored.type, nullable=field.nullable, metadata=metadata), stored


def _common_step(differences: np.ndarray) -> int:
    """The greatest common divisor of ``differences`` (the runs of a column of order keys on a grid:
    an hour in microseconds, and the step back to the next partition), 0 when there is none
    that divides them all exactly (all 0, or int64's least value)."""
    step = int(np.gcd.reduce(differences))
    return step if step > 0 and (differences // step * step == differences).all() else 0


def _bits(column: pa.ChunkedArray, narrow: bool) -> np.ndarray:
    """A column of 8-byte items (or 32-bit integers, when ``narrow``) as one array of ``int64``:
    a view of its one chunk, else its chunks copied into pooled memory."""
    if column.num_chunks == 1 and not narrow:
        return np.ascontiguousarray(column.chunk(0).to_numpy()).view(np.int64)
    bits, at = pooled_array(len(column), np.int64), 0
    for chunk in column.chunks:
        np.copyto(bits[at:at + len(chunk)], _chunk_bits(chunk, narrow))
        at += len(chunk)
    return bits


def _differences(column: pa.ChunkedArray, narrow: bool) -> tuple[np.ndarray, int]:
    """The differences of consecutive items of a column (:func:`_bits`; the first one 0) and its
    first item, computed chunk by chunk (not from the chunks copied into one array first)."""
    deltas, at, first, last = pooled_array(len(column), np.int64), 0, 0, None
    for chunk in column.chunks:
        if not len(chunk):
            continue
        bits = _chunk_bits(chunk, narrow)
        if last is None:
            first, last = int(bits[0]), bits[:1]
        # arrays, not scalars: numpy warns of a scalar difference that wraps (two's complement)
        np.subtract(bits[:1], last, out=deltas[at:at + 1])
        np.subtract(bits[1:], bits[:-1], out=deltas[at + 1:at + len(bits)])
        at, last = at + len(bits), bits[-1:]
    return deltas, first


def _chunk_bits(chunk: pa.Array, narrow: bool) -> np.ndarray:
    items = chunk.to_numpy()
    return items.astype(np.int64) if narrow else items.view(np.int64)


def _narrowest(integers: np.ndarray, *, planes: bool = True) -> pa.Array:
    """Integers in the narrowest of 8, 16, 24 (two planes: :data:`_PLANES`, when ``planes``),
    32 or 64 bits that holds them all (:func:`_integers` restores them)."""
    if not len(integers):
        return pa.array(integers)
    low, high = int(integers.min()), int(integers.max())
    for kind in (np.int8, np.int16):
        if np.iinfo(kind).min <= low and high <= np.iinfo(kind).max:
            return pa.array(integers.astype(kind))
    if planes and low >= -(1 << 23) and high < 1 << 23:
        # the low 16 bits as they are, the high ones (sign included) in a byte
        return pa.StructArray.from_arrays([pa.array(integers.astype(np.uint16)),
                                           pa.array((integers >> 16).astype(np.int8))], fields=list(_PLANES))
    if _INT32.min <= low and high <= _INT32.max:
        return pa.array(integers.astype(np.int32))
    return pa.array(integers.astype(np.int64))


def _integers(stored: pa.Array) -> np.ndarray:
    """The integers :func:`_narrowest` stored, as ``int64`` (or ``int32`` for two planes)."""
    if pa.types.is_struct(stored.type):
        integers = stored.field("high").to_numpy().astype(np.int32)
        integers <<= 16
        integers |= stored.field("low").to_numpy()
        return integers
    return stored.to_numpy()


def lattice(values: np.ndarray) -> tuple[int, np.ndarray] | None:
    """``(e, units)`` with ``values == units * 2.0**e`` bit for bit, ``units`` ``int32``, when the
    values are such multiples of a power of two (the Laplace mechanism's releases are, on its
    lattice; so are counts); else None.

    ``e`` is the lowest set bit's exponent among the first rows; every value is checked.

    >>> lattice(np.array([0.375, -2.0, 1.125]))
    (-3, array([  3, -16,   9], dtype=int32))
    >>> lattice(np.array([0.375, -0.0])) is None  # -0.0 would come back as 0.0
    True
    """
    sample = values[:_SAMPLE]
    sample = sample[np.isfinite(sample) & (sample != 0)]
    if not len(sample):
        return None
    fractions, exponents = np.frexp(sample)
    mantissas = np.ldexp(fractions, 53).astype(np.int64)  # exactly: 53 significant bits
    lowest = np.frexp((mantissas & -mantissas).astype(np.float64))[1] - 1  # each mantissa's lowest set bit
    exponent = int((exponents - 53 + lowest).min())
    # in pooled memory, computed in place: fresh arrays of a column's size would be faulted in
    scaled, units = pooled_array(len(values)), pooled_array(len(values), np.int32)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):  # out of range: checked next
        # products with powers of two (exact, or rounded as ldexp rounds; several times faster)
        np.multiply(values, np.ldexp(1.0, -exponent), out=scaled)
        np.copyto(units, scaled, casting="unsafe")
    # the decoded bits (:func:`_lattice_values`), not the scaled values: -0.0 (whose unit is 0) must not
    # pass for 0.0, nor a value that underflows to 0 units
    decoded = _lattice_values(units, exponent, out=scaled)
    if not np.equal(decoded.view(np.int64), values.view(np.int64), out=pooled_array(len(values), np.bool_)).all():
        return None
    return exponent, units


def _lattice_values(units: np.ndarray, exponent: int, out: np.ndarray | None = None) -> np.ndarray:
    """The floats :func:`lattice` stored as ``units`` of ``2.0**exponent`` (into ``out`` when given)."""
    return np.multiply(units, np.ldexp(1.0, exponent), out=out)


def distinct(bits: np.ndarray, seen: np.ndarray | None = None, *,
             mostly_seen: bool = False) -> tuple[np.ndarray, np.ndarray] | None:
    """``(indices, dictionary)`` with ``dictionary[indices] == bits`` (``int64``) when ``bits``
    holds few distinct values: few among its first rows, at most 65,536 in all; else None.

    The values seen first are looked up by multiplicative hashing in a table with 32 slots per
    value (a gather, not Arrow's general hash table: half the time); a row whose slot holds
    another value (one not seen first, or a collision) is encoded afterwards, and when those
    rows are many, Arrow's encoder does all of it. The dictionary may hold a value twice.
    ``seen``: the values to look up first instead (at most a few hundred: an earlier call's
    dictionary, for the next batch of the same column); the dictionary then starts with them.
    When many rows miss them, the column is judged by its own first rows, as without ``seen``.
    ``mostly_seen``: None instead when many rows miss the values seen first (for a caller to
    whom a dictionary is only worth the hashing when it comes that cheap).

    Examples
    --------
    >>> distinct(np.array([7, 3, 7, 7, 3, 7, 7, 7, 7, 7, 7, 9], dtype=np.int64))
    (array([1, 0, 1, 1, 0, 1, 1, 1, 1, 1, 1, 2]), array([3, 7, 9]))
    >>> distinct(np.arange(8, dtype=np.int64)) is None
    True
    """
    given = seen is not None and len(seen) > 0
    if not given:
        seen = np.unique(bits[:_SAMPLE])
        if len(seen) > min(_FEW, len(bits) // 4):
            return None
    size = max(8, (32 * len(seen)).bit_length())
    shift = np.uint64(64 - size)
    # intp: numpy gathers with any other index type convert the indices first (four times slower)
    table = np.zeros(1 << size, dtype=np.intp)  # an empty slot points at seen[0]: a miss unless equal
    table[(seen.view(np.uint64) * _MIX) >> shift] = np.arange(len(seen))
    # in pooled memory, computed in place: fresh arrays of a column's size at every append would be
    # faulted in page by page, which costs more than the hashing
    slots = pooled_array(len(bits), np.uint64)
    np.multiply(bits.view(np.uint64), _MIX, out=slots)
    slots >>= shift  # below 2**size: the same numbers as intp
    # mode="clip" (every slot is in range) gathers element by element, so in place is safe
    indices = table.take(slots.view(np.intp), mode="clip", out=slots.view(np.intp))
    recovered = seen.take(indices, mode="clip", out=pooled_array(len(bits), np.int64))
    missed = np.flatnonzero(np.not_equal(recovered, bits, out=pooled_array(len(bits), np.bool_)))
    if len(missed) > len(bits) // 8 and given:
        return distinct(bits)  # other values than the given ones: judged by its own first rows
    if len(missed) > len(bits) // 8 and mostly_seen:
        return None
    if len(missed) > len(bits) // 8:
        encoded = pc.dictionary_encode(pa.array(bits, pa.int64()))
        indices, dictionary = encoded.indices.to_numpy().astype(np.intp), encoded.dictionary.to_numpy()
    elif len(missed):
        extra, at = np.unique(bits[missed], return_inverse=True)
        indices[missed] = len(seen) + at
        dictionary = np.concatenate([seen, extra])
    else:
        dictionary = seen
    return (indices, dictionary) if len(dictionary) <= 1 << 16 else None


def index_type(entries: int) -> type:
    """The narrowest indices into a dictionary of ``entries``: 8 or 16 bits (the ledger stores
    those), else 32 (:func:`table_bytes` then stores the column decoded)."""
    return np.uint8 if entries <= 1 << 8 else np.uint16 if entries <= 1 << 16 else np.int32


def _dictionary(indices: np.ndarray, dictionary: np.ndarray) -> pa.DictionaryArray:
    """A dictionary array with the smallest unsigned indices (at most 65,536 entries)."""
    narrow = indices.astype(index_type(len(dictionary)))
    # safe=False: the indices came from an encoder, so checking them again would only cost time
    return pa.DictionaryArray.from_arrays(narrow, pa.array(dictionary, pa.int64()), safe=False)


def _given_dictionary(field: pa.Field, column: pa.ChunkedArray) -> tuple[pa.Field, pa.Array]:
    """A dictionary-encoded column stored with its dictionaries merged (its indices kept as they
    are when it comes as one chunk with 8- or 16-bit indices); plain when they hold too many
    entries (or it has nulls), to be encoded like any other column."""
    if column.num_chunks == 1:
        merged = column.chunk(0)
    else:
        merged = column.unify_dictionaries().combine_chunks() if column.num_chunks else pa.array([], field.type)
    kind = field.type.value_type
    if merged.null_count or len(merged.dictionary) > 1 << 16:
        return pa.field(field.name, kind, nullable=field.nullable), merged.dictionary_decode()
    entries = merged.dictionary.to_numpy()
    dictionary = entries.astype(np.int64) if pa.types.is_int32(kind) else np.ascontiguousarray(entries).view(np.int64)
    if merged.indices.type in (pa.uint8(), pa.uint16()):
        stored = pa.DictionaryArray.from_arrays(merged.indices, pa.array(dictionary, pa.int64()), safe=False)
    else:
        stored = _dictionary(merged.indices.to_numpy(), dictionary)
    metadata = {_TYPE: str(kind).encode()}
    return pa.field(field.name, stored.type, nullable=field.nullable, metadata=metadata), stored


def _decoded(field: pa.Field, column: pa.ChunkedArray) -> tuple[pa.Field, pa.Array]:
    stored = column.combine_chunks()
    if pa.types.is_run_end_encoded(stored.type):
        stored = pc.run_end_decode(stored)
    elif pa.types.is_dictionary(stored.type):
        stored = stored.dictionary_decode()
    if field.metadata.get(_ENCODING) == b"lattice":
        values = _lattice_values(_integers(stored), int(field.metadata[_EXPONENT]))
        return pa.field(field.name, pa.float64()), pa.array(values)
    bits = _integers(stored).astype(np.int64, copy=False)
    if field.metadata.get(_ENCODING) == b"delta":
        if _STEP in field.metadata:
            bits = bits * np.int64(int(field.metadata[_STEP]))
        bits = np.cumsum(bits, dtype=np.int64)
        bits += np.int64(int(field.metadata.get(_FIRST, b"0")))
    kind = _stored_type(field.metadata[_TYPE].decode())
    # nullable, as every chunk's columns are: earlier versions stored their keys as not null
    if pa.types.is_int32(kind):
        return pa.field(field.name, kind), pa.array(bits.astype(np.int32))
    return pa.field(field.name, kind), pa.array(bits).view(kind)


def _stored_type(name: str) -> pa.DataType:
    if name.startswith("timestamp[") or name.startswith("duration["):
        inside = name[name.index("[") + 1:-1].split(", tz=")
        if name.startswith("duration["):
            return pa.duration(inside[0])
        return pa.timestamp(inside[0], tz=inside[1] if len(inside) > 1 else None)
    return pa.type_for_alias(name)
