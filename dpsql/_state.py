"""A safe binary form for plain data: the state of stream machines, error models, answers.

Values are ``None``, booleans, ints, floats, strings, bytes, numpy arrays (numeric or
boolean) and lists, tuples and string-keyed dicts of them. The form is a JSON header
describing the structure, followed by the raw bytes of the arrays, compressed; decoding
never executes anything (no pickle), so a tampered ledger cannot run code.

>>> data = {"rows": 3, "units": np.arange(4), "name": "tops", "nested": [1.5, None, b"k"]}
>>> back = unpack(pack(data))
>>> back["rows"], back["units"].tolist(), back["nested"]
(3, [0, 1, 2, 3], [1.5, None, b'k'])
"""

from __future__ import annotations

import base64
import json
import math
import zlib

import numpy as np

_MAGIC = b"DPS1"
_DTYPES = {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float32",
           "float64"}


def pack(value) -> bytes:
    """The binary form of ``value`` (see the module docstring)."""
    buffers: list[bytes] = []
    header = json.dumps(_encode(value, buffers), separators=(",", ":"), allow_nan=False).encode()
    body = len(header).to_bytes(8, "little") + header + b"".join(buffers)
    return _MAGIC + zlib.compress(body, 1)


def unpack(data: bytes):
    """The value :func:`pack` encoded; ``ValueError`` when ``data`` is not such a form."""
    if not isinstance(data, (bytes, bytearray, memoryview)) or bytes(data[:4]) != _MAGIC:
        raise ValueError("not a dpsql state record")
    try:
        body = zlib.decompress(bytes(data[4:]))
        size = int.from_bytes(body[:8], "little")
        header = json.loads(body[8:8 + size])
    except (zlib.error, ValueError) as error:
        raise ValueError(f"corrupt dpsql state record: {error}") from None
    return _decode(header, memoryview(body)[8 + size:])


def _encode(value, buffers: list[bytes]):
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
        return {"bytes": base64.b64encode(value).decode()}
    if isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value)
        if array.dtype.name not in _DTYPES:
            raise TypeError(f"cannot store arrays of dtype {array.dtype}")
        offset = sum(map(len, buffers))
        data = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
        buffers.append(data)
        return {"array": array.dtype.name, "shape": list(array.shape), "at": offset, "size": len(data)}
    if isinstance(value, (list, tuple)):
        return {"list" if isinstance(value, list) else "tuple": [_encode(v, buffers) for v in value]}
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError("state dicts have string keys")
        return {"dict": {k: _encode(v, buffers) for k, v in value.items()}}
    raise TypeError(f"cannot store a {type(value).__name__}")


def _decode(node, data: memoryview):
    if not isinstance(node, dict):
        return node
    if "int" in node:
        return int(node["int"])
    if "float" in node:
        return float(node["float"])
    if "bytes" in node:
        return base64.b64decode(node["bytes"])
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
