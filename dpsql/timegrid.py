"""Public time grids: buckets of a fixed width from a fixed start, never read from the data.

Count releases cut event times into buckets ``[start + i * every, start + (i + 1) * every)``.
Times are int64 nanoseconds since the epoch for datetimes (``datetime``, ``numpy.datetime64``,
ISO text, Arrow timestamps and dates; time zones converted to UTC) or plain numbers; widths
are durations (``timedelta``, ``numpy.timedelta64``, text such as ``"5m"``, ``"1h30m"``) or
numbers. A one-shot release covers a domain ``[start, stop)`` (:class:`TimeDomain`); a
continual count stream an unbounded :class:`TimeGrid`.

A range-sum stream whose rows are readings on a regular clock (hourly, every 15 minutes, daily)
has a :class:`RowGrid`: row ``i`` of a partition has order key ``first + i * step``. The
hierarchy then cuts its blocks and tree levels at calendar days, months and years
(:mod:`dpsql.mechanisms.calendar`); :func:`row_grid` finds the grid of a partition's order keys,
or None when they are not on one (gaps, irregular steps), and those keep row-count blocks.

Calendar units are UTC: zoned keys are converted to UTC, naive keys are taken as UTC wall-clock
times (so a naive local clock is used as it reads). Local days of a zone with daylight saving
time have 23 or 25 hours; keys stored on such a local clock skip or repeat an hour when the
clocks change, are no grid (:func:`row_grid` gives None) and keep row-count blocks.
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
#: One day in nanoseconds.
DAY = _DURATION_UNITS["d"]


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


@dataclass(frozen=True)
class RowGrid:
    """A partition's rows on a regular clock: row ``i`` has order key ``first + i * step``
    (int64 nanoseconds, UTC), with ``step`` dividing a day or equal to one, and no gaps.

    Public: it is a property of the order keys (public under replace-one-value neighbours), or
    declared by the caller, never read from the values. :meth:`of` validates one given as a
    pair or a mapping; :meth:`plain` is the form release records keep.

    Examples
    --------
    >>> grid = RowGrid.of(("2024-03-01T09:00", "1h"))
    >>> grid.rows_per_day, grid.plain()
    (24, {'first': '2024-03-01T09:00:00.000000000', 'step': '1h'})
    >>> int(grid.first_row_of_day(grid.day_of_row(0) + 1))  # the next midnight is row 15
    15
    """

    first: int
    step: int

    @classmethod
    def of(cls, grid, name: str = "grid") -> RowGrid:
        """A grid given as a :class:`RowGrid`, a pair ``(first, step)`` or a mapping with keys
        ``first`` and ``step``: ``first`` a datetime (``datetime``, ``numpy.datetime64``, ISO
        text), ``step`` a duration (``timedelta``, ``numpy.timedelta64``, text such as ``"1h"``)
        that divides a day or equals one."""
        if isinstance(grid, RowGrid):
            return grid
        if isinstance(grid, dict) and set(grid) == {"first", "step"}:
            first, step = grid["first"], grid["step"]
        elif isinstance(grid, (list, tuple)) and len(grid) == 2:
            first, step = grid
        else:
            raise InvalidParameter(f"{name} must be a pair (first order key, step), e.g. ('2024-01-01', '1h'), "
                                   f"got {grid!r}")
        if isinstance(first, (int, float)) or isinstance(step, (int, float)):
            raise InvalidParameter(f"{name} must pair a datetime with a duration (a time grid of numbers has no "
                                   f"calendar), got {grid!r}")
        step_ns = duration(step)
        if not (DAY % step_ns == 0 or step_ns == DAY):
            raise InvalidParameter(f"{name}'s step must divide a day (such as '1h', '15m', '1s') or be one day, "
                                   f"got {step!r}")
        return cls(instant(first, f"{name}'s first key"), step_ns)

    @property
    def rows_per_day(self) -> int:
        return max(DAY // self.step, 1)

    @property
    def last_row(self) -> int:
        """The last row whose key int64 nanoseconds can hold (2262-04-11)."""
        return (np.iinfo(np.int64).max - self.first) // self.step

    def check_rows(self, rows: int, name: str = "grid") -> None:
        """Refuse (:class:`~dpsql.InvalidData`) rows past :attr:`last_row`: their keys have no time."""
        if rows - 1 > self.last_row:
            raise InvalidData(f"{name}: row {rows - 1} would have a key past 2262-04-11, beyond int64 nanoseconds "
                              f"(the grid from {self.plain()['first']} holds {self.last_row + 1} rows)")

    def shifted(self, rows: int) -> RowGrid:
        """The grid of the rows from row ``rows`` on."""
        return RowGrid(self.first + rows * self.step, self.step)

    def day_of_row(self, rows):
        """The day (since 1970-01-01, UTC) of each row's key."""
        return (self.first + np.asarray(rows, dtype=np.int64) * self.step) // DAY

    def first_row_of_day(self, days):
        """The first row whose key falls on or after the start of each day (0 for days before the first key)."""
        offset = np.asarray(days, dtype=np.int64) * DAY - self.first
        return np.maximum(-(-offset // self.step), 0)

    def day_starts(self, rows: int) -> np.ndarray:
        """The rows below ``rows`` that are the first of their day (row 0 when its key is the
        first slot of its day)."""
        first_day, last_day = (int(d) for d in self.day_of_row(np.array([0, max(rows - 1, 0)])))
        starts = self.first_row_of_day(np.arange(first_day + 1, last_day + 1))
        whole_first_day = self.first - first_day * DAY < self.step
        return np.concatenate([[0] if whole_first_day and rows else [], starts]).astype(np.int64)

    def unit_ranges(self, unit: str, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """The first and stop rows of the whole calendar ``unit`` buckets (``"day"``, ``"week"``:
        from Monday, ``"month"``; UTC) among the first ``rows`` rows (a partial first or last one left out).

        >>> starts, stops = RowGrid.of(("2024-02-28T09:00", "1h")).unit_ranges("month", 24 * 70)
        >>> starts.tolist(), stops.tolist()  # March and April 2024, from row 39 (midnight of March 1st)
        ([39, 783], [783, 1503])
        """
        starts = self.day_starts(rows)
        days = self.day_of_row(starts)
        if unit == "week":
            keep = (days + 3) % 7 == 0  # 1970-01-01 was a Thursday
        elif unit == "month":
            keep = days.astype("datetime64[D]") == days.astype("datetime64[D]").astype("datetime64[M]")
        elif unit == "day":
            keep = np.ones(len(starts), dtype=bool)
        else:
            raise InvalidParameter(f"unknown calendar unit {unit!r}; expected 'day', 'week' or 'month'")
        starts = starts[keep]
        return starts[:-1], starts[1:]

    def plain(self) -> dict:
        """The grid as plain text (exact to the nanosecond), as :meth:`of` reads it back."""
        return {"first": str(np.datetime64(self.first, "ns")), "step": duration_text(self.step)}


def row_grid(keys) -> RowGrid | None:
    """The :class:`RowGrid` of one partition's order keys, or None when they are not on one.

    ``keys`` (numpy ``datetime64``, a sequence of datetimes, an Arrow timestamp or date
    column, zoned or not) are a grid when there are at least two, all temporal and not null,
    each one ``step`` after the one before, with ``step`` dividing a day or equal to one.
    Anything else (numbers, gaps, repeated or unequal steps, a single row) gives None: the
    release keeps row-count blocks. Zoned keys are converted to UTC (module docstring).
    Reads only the keys, which are public (the time order is public under replace-one-value
    neighbours); never a value.

    Examples
    --------
    >>> import numpy as np
    >>> hours = np.datetime64("2024-03-01T09:00") + np.arange(48) * np.timedelta64(1, "h")
    >>> row_grid(hours).plain(), row_grid(np.delete(hours, 5))
    ({'first': '2024-03-01T09:00:00.000000000', 'step': '1h'}, None)
    """
    if not hasattr(keys, "cast") and np.asarray(keys).dtype == object:  # datetimes as Python objects
        try:
            keys = np.array([instant(key, "order key") for key in keys], dtype="datetime64[ns]")
        except InvalidParameter:
            return None
    try:
        times = ticks(keys, "order key", datetime=True)
    except (InvalidData, InvalidParameter):
        return None
    if len(times) < 2:
        return None
    steps = np.diff(times)
    step = int(steps[0])
    if step <= 0 or not (DAY % step == 0 or step == DAY) or not np.all(steps == step):
        return None
    return RowGrid(int(times[0]), step)


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


def duration(value, name: str = "every") -> int:
    """A positive duration in nanoseconds (refusals name the parameter ``name``)."""
    if isinstance(value, str):
        parts = re.findall(r"(\d+)(ns|us|ms|s|m|h|d|w)", value.strip())
        if not parts or "".join(a + b for a, b in parts) != value.strip():
            raise InvalidParameter(f"{name} must be a duration such as '5m', '1h30m' or '1d', got {value!r}")
        ticks_ = sum(int(a) * _DURATION_UNITS[b] for a, b in parts)
    elif isinstance(value, (dt.timedelta, np.timedelta64)):
        ticks_ = int(np.timedelta64(value, "ns").astype(np.int64))
    else:
        raise InvalidParameter(f"{name} must be a duration (timedelta or a string like '5m') for datetime "
                               f"bounds, got {value!r}")
    if ticks_ <= 0:
        raise InvalidParameter(f"{name} must be a positive duration, got {value!r}")
    return ticks_


def duration_text(ticks_: int) -> str:
    """A positive duration in nanoseconds as :func:`duration` reads it back, in its largest
    whole unit (``"1d"``, ``"90m"``).

    >>> duration_text(3600 * 10**9), duration_text(90 * 60 * 10**9), duration(duration_text(7))
    ('1h', '90m', 7)
    """
    unit = next(u for u, size in sorted(_DURATION_UNITS.items(), key=lambda item: -item[1]) if ticks_ % size == 0)
    return f"{ticks_ // _DURATION_UNITS[unit]}{unit}"


def ticks(times, column: str, datetime: bool) -> np.ndarray:
    """Event times as int64 ns (a datetime grid) or float64 (a numeric one): numpy arrays,
    sequences, or Arrow columns (timestamps of any unit or zone, dates)."""
    if hasattr(times, "type") and hasattr(times, "cast"):  # an Arrow array or chunked array
        import pyarrow as pa

        try:  # a safe cast: times outside 1677-2262 have no nanosecond timestamp
            if pa.types.is_timestamp(times.type):
                times = times.cast(pa.timestamp("ns", tz=times.type.tz)).cast(pa.timestamp("ns"))
            elif pa.types.is_date(times.type):
                times = times.cast(pa.timestamp("ns"))
        except pa.ArrowInvalid:
            raise InvalidTimeKey(f"column {column!r} holds times outside the years 1677-2262, which nanosecond "
                                 "timestamps cannot hold") from None
        times = times.to_numpy(zero_copy_only=False)
    arr = np.asarray(times)
    if arr.ndim != 1:
        raise InvalidData(f"column {column!r} must be 1-D, got shape {arr.shape}")
    if datetime:
        if arr.dtype.kind != "M":
            raise InvalidData(f"column {column!r} must hold datetimes for datetime bounds, got dtype {arr.dtype}")
        as_ns = arr.astype("datetime64[ns]", copy=False)  # numpy wraps around silently where ns overflow
        if arr.dtype != as_ns.dtype and (as_ns.astype(arr.dtype) != arr)[~np.isnat(arr)].any():
            raise InvalidTimeKey(f"column {column!r} holds times outside the years 1677-2262, which nanosecond "
                                 "timestamps cannot hold")
        arr = as_ns
        nulls = int(np.isnat(arr).sum())
        if nulls:
            raise InvalidTimeKey(f"column {column!r} contains {nulls} null time(s)")
        return arr.view(np.int64)
    if arr.dtype.kind == "M":
        raise InvalidData(f"column {column!r} holds datetimes: give start as a datetime and every as a duration")
    return _validate.values(arr, column) if arr.size else arr.astype(np.float64)


def _numeric(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def partition_grids(keys, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """The :class:`RowGrid` of every partition at once: ``(first, step)`` per partition (step 0
    where its keys are not on a grid: one row, a gap, unequal steps), the rows ``offsets[k] ..
    offsets[k + 1] - 1`` of ``keys`` (temporal, ascending within each partition) being partition
    ``k``'s; None when the keys are not temporal (no partition has a calendar).

    >>> hours = np.datetime64("2024-03-01") + np.arange(6) * np.timedelta64(1, "h")
    >>> first, step = partition_grids(np.r_[hours[:3], hours[[0, 2, 3]]], np.array([0, 3, 6]))
    >>> step.tolist()
    [3600000000000, 0]
    """
    try:
        times = ticks(keys, "order key", datetime=True)
    except (InvalidData, InvalidParameter, InvalidTimeKey):
        return None
    starts, lengths = offsets[:-1], np.diff(offsets)
    partitions = len(starts)
    first = times[starts] if partitions else np.empty(0, np.int64)
    steps = np.diff(times)  # partition [a, b)'s steps are steps[a : b - 1]
    inside = np.ones(len(steps), bool)
    inside[offsets[1:-1] - 1] = False  # the step from one partition's last row to the next one's first
    owner = np.repeat(np.arange(partitions), np.maximum(lengths - 1, 0))
    candidate = np.zeros(partitions, np.int64)
    many = lengths >= 2
    candidate[many] = steps[starts[many]]
    differs = np.bincount(owner, weights=steps[inside] != candidate[owner], minlength=partitions) > 0
    positive = np.maximum(candidate, 1)
    good = many & ~differs & (candidate > 0) & ((DAY % positive == 0) | (candidate == DAY))
    return first, np.where(good, candidate, 0)
