"""Argument and data checks shared by every mechanism and front end.

They run before any noise is drawn or budget is charged, and raise the typed errors
of :mod:`dpsql.errors` with messages naming the parameter or column.
"""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Iterable
from decimal import Decimal

import numpy as np
import pyarrow as pa

from dpsql._memory import pooled_array
from dpsql.errors import InvalidData, InvalidParameter

#: The epsilons dpsql accepts. Below, no lattice can carry the noise (its scale would pass the
#: sampler's 2**33 units for any sensitivity); above, e**epsilon overflows in local-DP
#: randomisers and every mechanism is indistinguishable from publishing the data.
EPSILON_RANGE = (1e-9, 100.0)
#: The widest and narrowest public bounds (``upper - lower``): the power-of-two lattices
#: under them stay normal floats, and every error model's variance stays finite.
BOUND_RANGE = (1e-100, 1e100)


def epsilon(value, name: str = "epsilon") -> float:
    """A finite real number in :data:`EPSILON_RANGE`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidParameter(f"{name} must be a real number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise InvalidParameter(f"{name} must be finite, got {value!r}")
    if value <= 0:
        raise InvalidParameter(f"{name} must be > 0, got {value!r}")
    low, high = EPSILON_RANGE
    if not low <= value <= high:
        raise InvalidParameter(f"{name} must be between {low:g} and {high:g}, got {value!r}: below, no noise "
                               "scale dpsql can draw is wide enough; above, the release is not private in any "
                               "useful sense")
    return value


def delta(value, *, pure: bool, method: str, name: str = "delta") -> float:
    """0 <= delta < 1, and exactly 0 for a pure-DP method."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidParameter(f"{name} must be a real number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise InvalidParameter(f"{name} must be finite, got {value!r}")
    if not 0 <= value < 1:
        raise InvalidParameter(f"{name} must satisfy 0 <= {name} < 1, got {value!r}")
    if pure and value > 0:
        raise InvalidParameter(f"{name} must be 0 for {method!r}, a pure epsilon-DP method; got {value!r}")
    return value


def real(value, name: str, *, minimum: float | None = None, strict: bool = False) -> float:
    """A finite real number, optionally bounded below."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidParameter(f"{name} must be a real number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise InvalidParameter(f"{name} must be finite, got {value!r}")
    if minimum is not None and (value <= minimum if strict else value < minimum):
        raise InvalidParameter(f"{name} must be {'>' if strict else '>='} {minimum}, got {value!r}")
    return value


def integer(value, name: str, *, minimum: int | None = None) -> int:
    """An integer (not a bool), optionally bounded below."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidParameter(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise InvalidParameter(f"{name} must be >= {minimum}, got {value!r}")
    return value


def probability(value, name: str) -> float:
    """A real number strictly between 0 and 1."""
    value = real(value, name)
    if not 0 < value < 1:
        raise InvalidParameter(f"{name} must satisfy 0 < {name} < 1, got {value!r}")
    return value


def bounds(lower, upper) -> tuple[float, float]:
    """Public clipping bounds with lower < upper, both finite, ``upper - lower`` in :data:`BOUND_RANGE`."""
    lower = real(lower, "lower")
    upper = real(upper, "upper")
    if not lower < upper:
        raise InvalidParameter(f"upper must be > lower, got lower={lower!r}, upper={upper!r}")
    low, high = BOUND_RANGE
    if not low <= upper - lower <= high:
        raise InvalidParameter(f"upper - lower must be between {low:g} and {high:g}, got lower={lower!r}, "
                               f"upper={upper!r}: rescale the data (a public unit change) first")
    return lower, upper


def choice(value, name: str, choices: Iterable[str]) -> str:
    """One of a fixed set of names; another is refused naming the closest one, if any is close.

    >>> choice("windos", "focus", ("mixed", "windows"))
    Traceback (most recent call last):
    ...
    dpsql.errors.InvalidParameter: unknown focus 'windos' (did you mean 'windows'?); expected one of 'mixed', 'windows'
    """
    choices = tuple(choices)
    if value not in choices:
        close = difflib.get_close_matches(value, choices, n=1, cutoff=0.6) if isinstance(value, str) else []
        guess = f" (did you mean {close[0]!r}?)" if close else ""
        raise InvalidParameter(f"unknown {name} {value!r}{guess}; expected one of {', '.join(map(repr, choices))}")
    return value


def holdout(m, n: int, *, default: int) -> int:
    """The hold-out length: ``1 <= m < n``."""
    m = default if m is None else integer(m, "m", minimum=1)
    if m >= n:
        raise InvalidParameter(f"m (hold-out length) must be < the number of values ({n}), got m={m}")
    return m


#: The largest integer magnitude every float64 holds exactly.
EXACT_INTEGERS = 2**53


def _joined(column: pa.ChunkedArray) -> np.ndarray:
    """A numeric chunked column (no nulls) as one float64 array from the memory pool."""
    joined = pooled_array(len(column))
    at = 0
    for chunk in column.chunks:
        joined[at:at + len(chunk)] = chunk.to_numpy(zero_copy_only=True)
        at += len(chunk)
    return joined


def _inexact_integers(column: str, where: str = "") -> str:
    return (f"column {column!r} holds integers beyond 2**53{where}, which float64 arithmetic cannot hold exactly; "
            "rescale them (or subtract a public offset) first")


def _refuse_objects(items: np.ndarray, column: str) -> None:
    """Python objects as values: numbers only (no None, no text or other objects) and no
    integer beyond 2**53, which converting to float64 would round."""
    nulls = sum(v is None for v in items)
    if nulls:
        raise InvalidData(f"column {column!r} contains {nulls} null value(s); "
                          "drop or impute them before a private release")
    for row, item in enumerate(items):
        if not isinstance(item, numbers.Real | Decimal):
            raise InvalidData(f"column {column!r} must be numeric: row {row} holds {type(item).__name__} {item!r}")
        whole = isinstance(item, numbers.Integral) or (isinstance(item, Decimal) and item.is_finite()
                                                        and item == item.to_integral_value())
        if whole and abs(integer := int(item)) > EXACT_INTEGERS:  # type: ignore[arg-type]
            raise InvalidData(_inexact_integers(column, f" (row {row}: {integer})"))


def values(data, column: str = "values") -> np.ndarray:
    """A non-empty, 1-D, finite float64 array; the message names ``column``.

    Accepts numpy arrays, sequences, pyarrow arrays and polars Series. Nulls (None,
    Arrow or Polars nulls), NaN and infinities are refused, each with its own message.
    """
    arr = numeric(data, column)
    finite = np.isfinite(arr)
    if not finite.all():
        bad = np.flatnonzero(~finite)
        kind = "NaN" if np.isnan(arr[bad[0]]) else "infinite"
        raise InvalidData(f"column {column!r} contains {kind} values ({bad.size} non-finite, first at row "
                          f"{bad[0]}); clean them before a private release")
    return arr


def numeric(data, column: str = "values") -> np.ndarray:
    """:func:`values` without the check for NaN and infinities (a front end reordering
    the rows first, so that ``publish`` names the first bad row in stream order)."""
    null_count = getattr(data, "null_count", None)
    if callable(null_count):  # polars Series
        null_count = null_count()
    if null_count:
        raise InvalidData(f"column {column!r} contains {null_count} null value(s); "
                          "drop or impute them before a private release")
    if isinstance(data, pa.ChunkedArray) and data.num_chunks > 1 and (
            pa.types.is_floating(data.type) or pa.types.is_integer(data.type)):
        data = _joined(data)
    elif hasattr(data, "to_numpy") and not isinstance(data, np.ndarray):
        try:
            data = data.to_numpy(zero_copy_only=False)
        except TypeError:
            data = data.to_numpy()
    arr = np.asarray(data)
    if arr.dtype.kind == "f" and isinstance(data, list | tuple) and arr.size and np.abs(arr).max() >= EXACT_INTEGERS:
        # Python integers among floats, made floats by numpy: those beyond 2**53 were rounded
        _refuse_objects(np.asarray(data, dtype=object).ravel(), column)
    if arr.dtype == object:
        _refuse_objects(arr.ravel(), column)
    if arr.dtype.kind not in "biuf" and arr.dtype != object:
        raise InvalidData(f"column {column!r} must be numeric, got dtype {arr.dtype}")
    if arr.dtype.kind in "iu" and arr.size and max(int(arr.max()), -int(arr.min())) > EXACT_INTEGERS:
        raise InvalidData(_inexact_integers(column))
    try:
        arr = arr.astype(np.float64, copy=False)
    except (TypeError, ValueError):
        raise InvalidData(f"column {column!r} must be numeric") from None
    if arr.ndim != 1:
        raise InvalidData(f"column {column!r} must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        raise InvalidData(f"column {column!r} is empty: nothing to release")
    return arr
