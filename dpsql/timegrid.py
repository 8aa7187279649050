"""Public time grids: buckets of a fixed width from a fixed start, never read from the data.

Count releases cut event times into buckets ``[start + i * every, start + (i + 1) * every)``.
Times are int64 nanoseconds since the epoch for datetimes (``datetime``, ``numpy.datetime64``,
ISO text, Arrow timestamps and dates; time zones converted to UTC) or plain numbers; widths
are durations (``timedelta``, ``numpy.timedelta64``, text such as ``"5m"``, ``"1h30m"``) or
numbers. A one-shot release covers a domain ``[start, stop)`` (:class:`TimeDomain`); a
continual count stream an unbounded :class:`TimeGrid`.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass

import numpy as np

from dpsql import _validate
from dpsql.errors import InvalidData, InvalidParameter, InvalidTimeKey

_DURATION_UNITS = {"ns": 1, "us": 10**3, "ms": 10**6, "s": 10**9, "m": 60 * 10**9, "h": 3600 * 10**9,
                   "d": 86400 * 10**9, "w": 7 * 86400 * 10**9}


@dataclass(frozen=True)
class TimeGrid:
    """Buckets ``[start + i * every, start + (i + 1) * every)`` for ``i >= 0``: times in int64
    nanoseconds (``datetime``) or numbers."""

    start: float | int
    every: float | int
    datetime: bool

    @classmethod
    def of(cls, *, start, every) -> TimeGrid:
        """Validate a grid: a datetime ``start`` with a duration ``every``, or numbers."""
        for name, value in (("start", start), ("every", every)):
            if value is None:
                raise InvalidParameter(f"{name} is required: a count release's time grid is public and never read "
                                       "from the data")
        if _numeric(start):
            return cls(_validate.real(start, "start"), _validate.real(every, "every", minimum=0.0, strict=True),
                       datetime=False)
        return cls(instant(start, "start"), duration(every), datetime=True)

    def buckets(self, times: np.ndarray) -> np.ndarray:
        """The bucket of each time (negative before ``start``)."""
        return np.floor_divide(np.asarray(times) - self.start, self.every).astype(np.int64)

    def starts(self, buckets: np.ndarray) -> np.ndarray:
        """The start of each bucket (datetimes as ``datetime64[ns]``)."""
        starts = self.start + np.asarray(buckets, dtype=np.int64) * self.every
        return starts.astype("datetime64[ns]") if self.datetime else starts


@dataclass(frozen=True)
class TimeDomain(TimeGrid):
    """The grid's buckets up to ``stop`` (the last one cut there)."""

    stop: float | int = 0

    @property
    def n_buckets(self) -> int:
        return int(-(-(self.stop - self.start) // self.every))

    def bucket_starts(self) -> np.ndarray:
        return self.starts(np.arange(self.n_buckets))

    def buckets(self, times: np.ndarray) -> np.ndarray:
        """Bucket index of every time, ``-1`` outside ``[start, stop)``."""
        bucket = super().buckets(times)
        inside = (bucket >= 0) & (np.asarray(times) < self.stop)
        return np.where(inside, bucket, -1)


def time_domain(*, start, stop, every) -> TimeDomain:
    """Validate a public time domain ``[start, stop)`` with bucket width ``every``.

    Examples
    --------
    >>> d = time_domain(start="2024-01-01", stop="2024-01-01T01:00", every="25m")
    >>> d.n_buckets, str(d.bucket_starts()[-1])
    (3, '2024-01-01T00:50:00.000000000')
    """
    if stop is None:
        raise InvalidParameter("stop is required: the time domain [start, stop) is public and never read from the data")
    grid = TimeGrid.of(start=start, every=every)
    if grid.datetime == _numeric(stop):
        raise InvalidParameter(f"start and stop must both be datetimes or both numbers, got {start!r}, {stop!r}")
    end = instant(stop, "stop") if grid.datetime else _validate.real(stop, "stop")
    if not end > grid.start:
        raise InvalidParameter(f"stop must be after start, got start={start!r}, stop={stop!r}")
    return TimeDomain(grid.start, grid.every, grid.datetime, end)


def instant(value, name: str) -> int:
    """A datetime (``datetime``, ``date``, ``numpy.datetime64`` or ISO text) in int64 UTC nanoseconds."""
    if isinstance(value, dt.datetime) and value.tzinfo is not None:
        value = value.astimezone(dt.UTC).replace(tzinfo=None)
    try:
        stamp = np.datetime64(value, "ns")
    except (TypeError, ValueError):
        raise InvalidParameter(f"{name} must be a datetime (or an ISO string), got {value!r}") from None
    if np.isnat(stamp):
        raise InvalidParameter(f"{name} must not be null, got {value!r}")
    return int(stamp.astype(np.int64))


def duration(value) -> int:
    """A positive duration in nanoseconds."""
    if isinstance(value, str):
        parts = re.findall(r"(\d+)(ns|us|ms|s|m|h|d|w)", value.strip())
        if not parts or "".join(a + b for a, b in parts) != value.strip():
            raise InvalidParameter(f"every must be a duration such as '5m', '1h30m' or '1d', got {value!r}")
        ticks_ = sum(int(a) * _DURATION_UNITS[b] for a, b in parts)
    elif isinstance(value, (dt.timedelta, np.timedelta64)):
        ticks_ = int(np.timedelta64(value, "ns").astype(np.int64))
    else:
        raise InvalidParameter(f"every must be a duration (timedelta or a string like '5m') for datetime "
                               f"bounds, got {value!r}")
    if ticks_ <= 0:
        raise InvalidParameter(f"every must be a positive duration, got {value!r}")
    return ticks_


def ticks(times, column: str, datetime: bool) -> np.ndarray:
    """Event times as int64 ns (a datetime grid) or float64 (a numeric one): numpy arrays,
    sequences, or Arrow columns (timestamps of any unit or zone, dates)."""
    if hasattr(times, "type") and hasattr(times, "cast"):  # an Arrow array or chunked array
        import pyarrow as pa

        if pa.types.is_timestamp(times.type):
            times = times.cast(pa.timestamp("ns", tz=times.type.tz)).cast(pa.timestamp("ns"))
        elif pa.types.is_date(times.type):
            times = times.cast(pa.timestamp("ns"))
        times = times.to_numpy(zero_copy_only=False)
    arr = np.asarray(times)
    if arr.ndim != 1:
        raise InvalidData(f"column {column!r} must be 1-D, got shape {arr.shape}")
    if datetime:
        if arr.dtype.kind != "M":
            raise InvalidData(f"column {column!r} must hold datetimes for datetime bounds, got dtype {arr.dtype}")
        arr = arr.astype("datetime64[ns]", copy=False)
        nulls = int(np.isnat(arr).sum())
        if nulls:
            raise InvalidTimeKey(f"column {column!r} contains {nulls} null time(s)")
        return arr.view(np.int64)
    if arr.dtype.kind == "M":
        raise InvalidData(f"column {column!r} holds datetimes: give start as a datetime and every as a duration")
    return _validate.values(arr, column) if arr.size else arr.astype(np.float64)


def _numeric(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
