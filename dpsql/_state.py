"""A safe binary form for plain data: the state of stream machines, error models, release records.

Values are ``None``, booleans, ints, floats, strings, bytes, numpy arrays (numeric or
boolean) and lists, tuples and string-keyed dicts of them. The form is a JSON header
describing the structure, followed by the raw bytes of the arrays and byte strings,
compressed; decoding never executes anything (no pickle), so a tampered ledger cannot run code.

The body is compressed with LZ4 in frames of at most 4 MiB, on two threads when there are several
(a body over 4 MiB), each frame stored as it is when compression does not shrink it
(noisy values, keyed tags). Records written by earlier versions (``DPS1``: zlib, byte strings
as base64 in the header) are still read.

>>> data = {"rows": 3, "units": np.arange(4), "name": "tops", "nested": [1.5, None, b"k"]}
>>> back = unpack(pack(data))
>>> back["rows"], back["units"].tolist(), back["nested"]
(3, [0, 1, 2, 3], [1.5, None, b'k'])
"""

from __future__ import annotations

import base64
import json
import math
import struct
import zlib

import numpy as np
import pyarrow as pa

from dpsql._parallel import on_two_threads

_MAGIC_V1 = b"DPS1"
_MAGIC = b"DPS2"
_DTYPES = {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float32",
           "float64"}
#: The storable dtypes already in little-endian order (stored as they are), with their names.
_LITTLE = {np.dtype(name).newbyteorder("<"): name for name in _DTYPES}
_FRAME = 1 << 22
#: Bytes of a long frame compressed first, to see whether compressing it is worth it.
_PROBE = 1 << 16
_RAW, _LZ4 = 0, 1
_FRAME_HEADER = struct.Struct("<BQQ")  # codec, stored size, raw size
_codec: pa.Codec | None = None


def _lz4() -> pa.Codec:
    global _codec
    if _codec is None:
        _codec = pa.Codec("lz4")
    return _codec


def pack(value) -> bytes:
    """The binary form of ``value`` (see the module docstring)."""
    buffers: list = []
    header = json.dumps(_encode(value, buffers, [0]), separators=(",", ":"), allow_nan=False).encode()
    frames = _frames([len(header).to_bytes(8, "little") + header, *buffers])
    stored = on_two_threads(_frame, frames) if len(frames) > 1 else [_frame(f) for f in frames]
    out = [_MAGIC, len(stored).to_bytes(4, "little")]
    for (codec, payload), raw in zip(stored, frames):
        out += [_FRAME_HEADER.pack(codec, len(payload), len(raw)), payload]
    return b"".join(out)


def _frames(pieces: list) -> list:
    """The body (``pieces`` one after the other) cut into frames of at most :data:`_FRAME` bytes,
    without copying large pieces: small ones are joined, large ones sliced."""
    frames: list = []
    pending: list = []
    size = 0
    for piece in pieces:
        if size and size + len(piece) > _FRAME:
            frames.append(b"".join(pending))
            pending, size = [], 0
        if len(piece) >= _FRAME:
            view = memoryview(piece)
            frames += [view[a:a + _FRAME] for a in range(0, len(view), _FRAME)]
        else:
            pending.append(piece)
            size += len(piece)
    if pending or not frames:
        frames.append(b"".join(pending))
    return frames


def _frame(raw: memoryview) -> tuple[int, bytes | memoryview]:
    """One frame, LZ4-compressed, or as it is when that does not make it smaller (judged on its
    first :data:`_PROBE` bytes for a long frame: noisy values do not compress, and trying all
    of them would cost as much as storing them)."""
    if len(raw) < 64:
        return _RAW, raw
    if len(raw) >= 4 * _PROBE and 16 * len(_lz4().compress(raw[:_PROBE], asbytes=True)) > 15 * _PROBE:
        return _RAW, raw
    packed = _lz4().compress(raw, asbytes=True)
    return (_LZ4, packed) if len(packed) < len(raw) else (_RAW, raw)


def unpack(data: bytes):
    """The value :func:`pack` encoded; ``ValueError`` when ``data`` is not such a form."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError("not a dpsql state record")
    magic = bytes(data[:4])
    if magic not in (_MAGIC, _MAGIC_V1):
        raise ValueError("not a dpsql state record")
    try:
        body = _body_v1(data) if magic == _MAGIC_V1 else _body(memoryview(data))
        size = int.from_bytes(body[:8], "little")
        header = json.loads(bytes(body[8:8 + size]))
    except (zlib.error, ValueError, struct.error, pa.ArrowException) as error:
        raise ValueError(f"corrupt dpsql state record: {error}") from None
    return _decode(header, memoryview(body)[8 + size:])


def _body_v1(data) -> bytes:
    return zlib.decompress(bytes(data[4:]))


def _body(data: memoryview) -> bytes:
    count = int.from_bytes(data[4:8], "little")
    at, pieces = 8, []
    for _ in range(count):
        codec, stored, raw = _FRAME_HEADER.unpack_from(data, at)
        at += _FRAME_HEADER.size
        payload = data[at:at + stored]
        if len(payload) != stored:
            raise ValueError("truncated")
        at += stored
        if codec == _RAW:
            pieces.append(payload)
        elif codec == _LZ4:
            pieces.append(_lz4().decompress(payload, decompressed_size=raw, asbytes=True))
        else:
            raise ValueError(f"unknown frame codec {codec}")
        if len(pieces[-1]) != raw:
            raise ValueError("frame size")
    if at != len(data):
        raise ValueError("trailing bytes")
    return b"".join(pieces)


def _encode(value, buffers: list, end: list[int]):
    """The header node of ``value``; arrays and byte strings go to ``buffers`` (``end[0]``: their
    total length so far)."""
    # dicts first: a machine's state is mostly nested dicts, packed at every append
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError("state dicts have string keys")
        return {"dict": {k: _encode(v, buffers, end) for k, v in value.items()}}
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, np.integer)) and not isinstance(value, np.bool_):
        return int(value) if abs(int(value)) < 2**53 else {"int": str(int(value))}
    if isinstance(value, (float, np.floating)):
        value = float(value)
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, bytes):
        buffers.append(value)
        end[0] += len(value)
        return {"blob": end[0] - len(value), "size": len(value)}
    if isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value)
        name = _LITTLE.get(array.dtype)
        if name is None:  # another byte order (or a dtype that cannot be stored)
            if array.dtype.name not in _DTYPES:
                raise TypeError(f"cannot store arrays of dtype {array.dtype}")
            name = array.dtype.name
            array = array.astype(array.dtype.newbyteorder("<"))
        data = memoryview(array.reshape(-1)).cast("B")
        buffers.append(data)
        end[0] += len(data)
        return {"array": name, "shape": list(array.shape), "at": end[0] - len(data), "size": len(data)}
    if isinstance(value, (list, tuple)):
        return {"list" if isinstance(value, list) else "tuple": [_encode(v, buffers, end) for v in value]}
    raise TypeError(f"cannot store a {type(value).__name__}")


def _decode(node, data: memoryview):
    if not isinstance(node, dict):
        return node
    if "int" in node:
        return int(node["int"])
    if "float" in node:
        return float(node["float"])
    if "bytes" in node:  # DPS1
        return base64.b64decode(node["bytes"])
    if "blob" in node:
        raw = data[node["blob"]:node["blob"] + node["size"]]
        if len(raw) != node["size"]:
            raise ValueError("corrupt dpsql state record: truncated")
        return bytes(raw)
    if "array" in node:
        if node["array"] not in _DTYPES:
            raise ValueError(f"corrupt dpsql state record: dtype {node['array']!r}")
        dtype = np.dtype(node["array"]).newbyteorder("<")
        raw = data[node["at"]:node["at"] + node["size"]]
        return np.frombuffer(raw, dtype=dtype).astype(dtype.newbyteorder("="), copy=True).reshape(node["shape"])
    if "list" in node:
        return [_decode(v, data) for v in node["list"]]
    if "tuple" in node:
        return tuple(_decode(v, data) for v in node["tuple"])
    if "dict" in node:
        return {k: _decode(v, data) for k, v in node["dict"].items()}
    raise ValueError("corrupt dpsql state record")
