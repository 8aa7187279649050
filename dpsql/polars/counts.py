"""Polars front end of count streams: ``dpsql.count_stream(frame, order_by, ...)``.

An event table (one row per event) becomes private count streams, one row per
(partition, bucket) of the public time domain, released with PeGaSus or per-bucket
Laplace through :func:`dpsql.counts.release_event_counts` (one call of
:func:`dpsql.publishing.publish`, one charge). The output is a new frame, not a column of the
input (its rows are buckets, not events), so this is a frame function rather than an
expression. A count column that is already bucketed can be released as an expression
with ``pl.col("n").dpsql.range_sum(method="pegasus", epsilon=..., order_by="ts")``.
"""

from __future__ import annotations

import datetime as dt

import numpy as np
import polars as pl

from dpsql._frontend import COUNT_METHOD, check_budget, checked_call
from dpsql.budget import Budget
from dpsql.counts import release_event_counts
from dpsql.errors import InvalidData, InvalidParameter
from dpsql.ordering import refuse_null_event_times, refuse_null_keys


@checked_call(extra=("window_smoother", "grouper_share", "theta", "smoother"))
def count_stream(frame: pl.DataFrame | pl.LazyFrame, order_by: str | None = None, *, every: str | dt.timedelta,
                 start, stop, epsilon: float, method: str = COUNT_METHOD, partition_by: str | list[str] | None = None,
                 hierarchy: bool = False, privacy_unit: str | None = None, contribution_cap: int | None = None,
                 window: int | None = None, alarm_threshold: float | None = None, budget: Budget | None = None,
                 note: str | None = None, **params) -> pl.DataFrame:
    """Private counts of the events of ``frame`` per bucket of a public time domain.

    Buckets are ``[start + i * every, start + (i + 1) * every)`` up to ``stop`` (the last
    may be shorter); the domain is public and never read from the data. Empty buckets
    are released too; events outside ``[start, stop)`` are dropped and counted nowhere.

    Privacy cost: ``epsilon``-DP (pure), charged once to ``budget``. Neighbours:
    add/remove one event, which changes one count by 1 (event-level DP). With
    ``privacy_unit`` and ``contribution_cap = k``, at most ``k`` events of one unit are
    counted per bucket (its earliest, across all partitions; the rest are dropped) and
    the noise is scaled to ``k``: neighbours then add/remove all of one unit's events in
    one bucket. Partitions are disjoint streams (parallel composition); their keys are
    public (the keys present in the events are released). With ``hierarchy=True``,
    ``partition_by`` lists levels coarsest first (e.g. building, floor, room): every
    level's streams are released, each level at ``epsilon / L`` (sequential across
    levels, parallel within), one charge of ``epsilon`` in total.

    Parameters
    ----------
    frame : polars.DataFrame or polars.LazyFrame
        The event table.
    order_by : str
        The event time column: Datetime (any time zone;
        buckets are computed in UTC), Date, or a number (with numeric ``start``/``stop``/``every``).
    every : str or datetime.timedelta
        Bucket width, e.g. ``"5m"``, ``"1h"``, ``"1h30m"``, ``"1d"`` (fixed lengths only).
    start, stop :
        The public time domain ``[start, stop)``: datetimes or ISO strings (UTC).
    method : {"pegasus", "count_laplace", "count_smoothed"}
        PeGaSus, per-bucket Laplace (the baseline) or per-bucket Laplace then the adaptive
        smoother (post-processing, same cost).
    partition_by, hierarchy, privacy_unit, contribution_cap : optional
        See above.
    window, alarm_threshold : optional
        Add ``dp_window_sum`` (sum of the last ``window`` buckets), ``dp_window_std_error``
        and ``dp_alarm`` (``dp_window_sum >= alarm_threshold``): post-processing, free.
    **params
        ``window_smoother`` (how window sums are formed: re-smoothed from the noisy counts
        known at the window's end by default for ``pegasus`` and ``smoothed``;
        :func:`dpsql.counts.release_event_counts`) and the PeGaSus parameters
        ``grouper_share``, ``theta``, ``smoother``.

    Returns
    -------
    polars.DataFrame
        The bucket start (named like ``order_by``), the partition columns (null above a
        row's level), ``dp_level`` (hierarchies), ``dp_count``, ``dp_std_error`` (noise
        only), ``dp_row``, ``dp_part`` and the window columns if asked for.

    Examples
    --------
    >>> import datetime as dt, polars as pl, dpsql
    >>> events = pl.DataFrame({"ts": [dt.datetime(2024, 1, 1, 0, m) for m in (1, 2, 7, 31)],
    ...                        "room": ["a", "b", "a", "a"]})
    >>> budget = dpsql.Budget.in_memory(epsilon=1.0)
    >>> with dpsql.testing.seeded(0):
    ...     out = dpsql.count_stream(events.lazy(), "ts", every="10m", start="2024-01-01",
    ...                              stop="2024-01-01T01:00", epsilon=1.0, partition_by="room",
    ...                              window=3, alarm_threshold=50, budget=budget)
    >>> out.shape, out.columns[:4], budget.spent
    ((12, 9), ['ts', 'room', 'dp_count', 'dp_std_error'], (1.0, 0.0))
    """
    if order_by is None:
        raise InvalidParameter("dpsql.count_stream() needs order_by, the event time column")
    check_budget(budget)
    if not isinstance(frame, pl.DataFrame | pl.LazyFrame):
        raise InvalidParameter(f"frame must be a polars DataFrame or LazyFrame, got {type(frame).__name__}")
    keys = [partition_by] if isinstance(partition_by, str) else list(partition_by or [])
    names = {"order_by": [order_by], "partition_by": keys,
             "privacy_unit": [] if privacy_unit is None else [privacy_unit]}
    schema = frame.collect_schema()
    for parameter, columns in names.items():
        for name in columns:
            if not isinstance(name, str) or name not in schema:
                raise InvalidParameter(f"{parameter} {name!r} is not a column of the frame; columns are "
                                       f"{', '.join(map(repr, schema.names()))}")
    wanted = list(dict.fromkeys([order_by, *keys, *names["privacy_unit"]]))
    events = frame.select(wanted).collect() if isinstance(frame, pl.LazyFrame) else frame.select(wanted)
    times, time_dtype = _times(events.get_column(order_by), order_by)
    refuse_null_keys({k: events.get_column(k).null_count() for k in keys}, order_label=None, partition_labels=keys)
    result = release_event_counts(
        times, start=start, stop=stop, every=every, epsilon=epsilon, method=method,
        keys={k: events.get_column(k).to_numpy() for k in keys}, hierarchy=hierarchy,
        units=None if privacy_unit is None else events.get_column(privacy_unit).to_numpy(),
        cap=contribution_cap, window=window, alarm_threshold=alarm_threshold, budget=budget, note=note,
        order_by=order_by, source=", ".join(["events", *(f"{parameter} {', '.join(columns)}"
                                                      for parameter, columns in names.items() if columns)]),
        **params)
    columns = result.columns()
    out = {}
    for name, values in columns.items():
        if name == order_by:
            out[name] = _bucket_times(values, time_dtype)
        elif name in keys:
            out[name] = pl.Series(name, values.tolist(), dtype=schema[name])
        else:
            out[name] = pl.Series(name, values)
    return pl.DataFrame(out)


def _times(series: pl.Series, name: str) -> tuple[np.ndarray, pl.DataType]:
    """Event times as numpy (datetime64 in UTC, or numbers) and the column's dtype."""
    refuse_null_event_times(name, series.null_count())
    dtype = series.dtype
    if isinstance(dtype, pl.Datetime):
        if dtype.time_zone is not None:
            series = series.dt.convert_time_zone("UTC").dt.replace_time_zone(None)
        return series.to_numpy(), dtype
    if dtype == pl.Date:
        return series.cast(pl.Datetime("us")).to_numpy(), dtype
    if dtype.is_numeric():
        return series.to_numpy(), dtype
    raise InvalidData(f"time column {name!r} must be a Datetime, Date or number, got {dtype}")


def _bucket_times(starts: np.ndarray, dtype: pl.DataType) -> pl.Series:
    if isinstance(dtype, pl.Datetime):
        series = pl.Series(starts).cast(pl.Datetime(dtype.time_unit))
        if dtype.time_zone is not None:
            series = series.dt.replace_time_zone("UTC").dt.convert_time_zone(dtype.time_zone)
        return series
    if dtype == pl.Date:
        return pl.Series(starts).cast(pl.Datetime("us"))
    return pl.Series(starts)
