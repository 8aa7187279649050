"""A continual stream's ``max_delay``: how long a row may stay provisional.

Given as a number of rows (``max_delay=24``: a row's value is final at the latest in the append
that brings the row ``max_delay - 1`` places after it in its partition) or as a duration for time
order keys on a regular grid (``"1d"``, ``"6h"``, a ``datetime.timedelta``: a row with key ``t`` is
final by the append that brings its partition's row at ``t + max_delay - step``, the last slot of
``[t, t + max_delay)``; on a grid of ``step`` that is ``max_delay / step`` rows; a partition whose
first append brings one row has no step yet and gets ``max_delay`` one row, every row final when it
arrives, which any duration allows). The methods that
hold rows back (the flat hierarchy's blocks, ToPS's and PAK's hold-out) take it in rows as their
``max_delay`` parameter and choose their layout by it (:mod:`dpsql.streams.hierarchy`,
:mod:`dpsql.streams.holdout`); a duration is converted on each partition's grid, found from its
first append's keys, and the partition then keeps that grid (a gap is refused). The others release
every row final when it arrives, so any ``max_delay`` holds for them.

What can be checked when the stream is registered is checked then, before it is charged: the
form (a positive whole number of rows, a positive duration), a count stream (which has no rows
to hold), and, with rows or a declared ``grid=``, the method's layout against it. A duration
against keys that are not on a grid, or on a grid whose step does not divide it, can only be
seen in the append that brings them: that append is refused (:class:`~dpsql.InvalidParameter`
naming ``max_delay``) and changes nothing.
"""

from __future__ import annotations

import datetime as dt
import numbers
from dataclasses import dataclass

import numpy as np

from dpsql import _validate
from dpsql.errors import InvalidParameter
from dpsql.methods import parameter_names
from dpsql.timegrid import RowGrid, duration, duration_text


@dataclass(frozen=True)
class MaxDelay:
    """A validated ``max_delay``: ``rows`` (a number of rows) or ``ticks`` (a duration in
    nanoseconds), exactly one of them."""

    rows: int | None = None
    ticks: int | None = None

    @classmethod
    def of(cls, value) -> MaxDelay | None:
        """Read ``max_delay`` as a caller gives it, or as :meth:`plain` stored it (None: no bound)."""
        if value is None:
            return None
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return cls(rows=_validate.integer(value, "max_delay", minimum=1))
        if isinstance(value, str) and value.strip().isdigit():  # SQL renders whole numbers as text
            return cls(rows=_validate.integer(int(value), "max_delay", minimum=1))
        if isinstance(value, (str, dt.timedelta, np.timedelta64)):
            return cls(ticks=duration(value, "max_delay"))
        raise InvalidParameter(f"max_delay must be a number of rows (an integer >= 1) or a duration for time keys "
                               f"('1d', '6h', a datetime.timedelta), got {value!r}")

    def plain(self) -> int | str:
        """As the stream's registration keeps it: the rows, or the duration as text."""
        return self.rows if self.rows is not None else duration_text(int(self.ticks))  # type: ignore[arg-type]

    def rows_on(self, step: int | None, where: str, *, appending: bool = False) -> int:
        """``max_delay`` in rows for a partition whose keys are on a grid of ``step`` nanoseconds
        (None or 0: not on a grid); refuses a duration the grid cannot hold (``where``: whose keys;
        ``appending``: an append is refused)."""
        kept = " (nothing of this append was kept)" if appending else ""
        if self.rows is not None:
            return self.rows
        ticks = int(self.ticks)  # type: ignore[arg-type]
        if not step:
            raise InvalidParameter(f"{where}: max_delay={duration_text(ticks)!r} is a duration, but the order keys "
                                   "are not readings on a regular clock (numbers, gaps, uneven steps, or a single "
                                   f"row so far): give max_delay in rows, or rows on a grid{kept}")
        if ticks % step:
            raise InvalidParameter(f"{where}: max_delay={duration_text(ticks)!r} is not a whole number of the keys' "
                                   f"step ({duration_text(step)}): give a multiple of it{kept}")
        return ticks // step


def registered(max_delay, method: str, counts: bool) -> int | str | None:
    """``max_delay`` as a stream of ``method`` keeps it when registered (:meth:`MaxDelay.plain`);
    refused for a count stream (``counts``), whose buckets are released once, when they close."""
    if counts and max_delay is not None:
        raise InvalidParameter(f"max_delay bounds how long a row of values stays provisional; a count stream "
                               f"({method!r}) releases each bucket once, when it closes (until=), got {max_delay!r}")
    delay = MaxDelay.of(max_delay)
    return None if delay is None else delay.plain()


def holds_rows(method: str) -> bool:
    """Does ``method`` hold rows back (so takes ``max_delay`` in rows as a parameter)?"""
    return "max_delay" in parameter_names(method)


@dataclass(frozen=True)
class StreamDelay:
    """A stream's ``max_delay`` (None: no bound) as its registration and appends apply it to
    ``method``'s machines; ``grid``: the grid declared with the stream's parameters, if any;
    ``label``: whose keys, for refusals."""

    delay: MaxDelay | None
    method: str
    grid: object = None
    label: str = "max_delay"

    @classmethod
    def of(cls, spec, label: str = "max_delay") -> StreamDelay:
        """The ``max_delay`` of a stream registered with ``spec`` (a :class:`~dpsql.continual.state.StreamSpec`)."""
        return cls(MaxDelay.of(spec.max_delay), spec.method, spec.params.get("grid"), label)

    @property
    def by_grid(self) -> bool:
        """Is it a duration each partition's grid converts to rows (a method that holds rows
        back, no declared grid)?"""
        return (self.delay is not None and self.delay.rows is None and holds_rows(self.method)
                and self.grid is None)

    @property
    def feeds_pool(self) -> bool:
        """Are a fleet's partitions fed while its pooled hold-out fills? With a ``max_delay`` they
        are (their machines release pooled rows at the bound where the pool could outlast it,
        :mod:`dpsql.streams.holdout`); else they wait, provisional, and join when it is full."""
        return self.delay is not None

    def machine_params(self) -> dict:
        """The ``max_delay`` parameter of the method's machines, where it is known in rows without
        a partition's grid: given in rows, or a duration on the declared grid; else {}."""
        if self.delay is None or not holds_rows(self.method) or (self.delay.rows is None and self.grid is None):
            return {}
        return {"max_delay": self.delay.rows_on(None if self.grid is None else RowGrid.of(self.grid).step,
                                                "the declared grid")}

    def rows(self, step: int | None, seen: int) -> int:
        """``max_delay`` in rows for a partition first fed ``seen`` rows on a grid of ``step`` ns
        (refused, as the append, where the keys are on none or the duration does not fit). A
        partition's first row appended alone has no step yet: 1 row (every row final when it
        arrives), which any duration allows."""
        assert self.delay is not None
        if seen == 1 and step == 0:
            return 1
        return self.delay.rows_on(step, self.label, appending=True)
