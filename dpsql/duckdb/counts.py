"""``dp_count_stream``: private count streams from an event table, in SQL.

SQL surface (installed by :func:`dpsql.duckdb.register`)::

    dp_count_stream(tbl, time_col, every := INTERVAL '5 minutes', start := ..., stop := ...,
                    epsilon := ..., method := 'pegasus', partition_by := NULL, hierarchy := false,
                    privacy_unit := NULL, contribution_cap := NULL, window_size := NULL,
                    alarm_threshold := NULL, grouper_share := NULL, theta := NULL, smoother := NULL)

Table macro. Counts the events (rows) of table, view, file or data-frame variable
``tbl`` per bucket ``[start + i * every, start + (i + 1) * every)`` of the public time
domain ``[start, stop)`` (required: never read from the data; the last bucket may be
shorter) and releases every count stream with PeGaSus (``method := 'pegasus'``) or
per-bucket Laplace (``'laplace'``) through :func:`dpsql.counts.release_event_counts`:
one call of :func:`dpsql.api.publish`, one charge. Empty buckets are released; events
outside the domain are dropped and counted nowhere. ``every`` must have a fixed length
(an INTERVAL without months or years, or text such as ``'5m'``, ``'1h30m'``);
``time_col`` may be TIMESTAMP (any precision, with or without time zone: buckets are
computed in UTC), DATE, or a number (then ``start``, ``stop`` and ``every`` are
numbers).

Privacy cost: ``epsilon``-DP, add/remove-one-event neighbours (each event adds 1 to
one count). With ``privacy_unit`` and ``contribution_cap := k``, at most ``k`` events of
one unit are counted per bucket (its earliest, across partitions) and the noise is
scaled to ``k``: neighbours add/remove one unit's events in one bucket.
``partition_by`` (a column or a list of columns) gives disjoint streams, charged once
(parallel composition; the keys present in the events are released). With
``hierarchy := true`` the list is a hierarchy, coarsest first: every level's streams
are released at ``epsilon / L`` each, one charge of ``epsilon``.

Returns one row per (level, partition, bucket), sorted so: the bucket start (named
like ``time_col``), the partition columns (NULL above a row's level), ``dp_level``
(hierarchies only), ``dp_count`` (the estimate), ``dp_std_error`` (noise only) and
``dp_row``, the connection-wide row handle of :mod:`dpsql.duckdb.range_sum`
(consecutive buckets of a stream have consecutive handles; ``dp_release_id(dp_row)``
gives the ledger's ``release_id``); with ``window_size := w``, ``dp_window_sum`` (sum of
the last ``w`` estimates, fewer at the start) and ``dp_window_std_error``; with
``alarm_threshold``, ``dp_alarm`` (``dp_window_sum >= alarm_threshold``: event
monitoring). Windows and alarms are post-processing; so are SQL window functions over
``dp_count``, whose error bars ``dp_range_variance(min(dp_row) OVER w, max(dp_row) OVER w
+ 1)`` gives exactly (with ``w`` partitioned by the partition columns and ``dp_level``).
"""

from __future__ import annotations

import datetime as dt
import json
import re
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from dpsql.counts import ALARM, COUNT, LEVEL, PART, ROW, STD_ERROR, WINDOW_STD_ERROR, WINDOW_SUM, release_event_counts
from dpsql.duckdb._machinery import (
    LIST_TYPES,
    NUMERIC_TYPES,
    Context,
    Source,
    column_name,
    describe,
    params_struct,
    planned,
    quote_ident,
    quote_literal,
    require_columns,
    resolve_source,
    row_handles,
    unnest_sql,
)
from dpsql.errors import InvalidData, InvalidParameter, InvalidTimeKey

MACRO = "dp_count_stream"
#: Named macro parameters besides ``every`` (whose default is an interval).
PARAMETERS = ("start", "stop", "epsilon", "method", "partition_by", "hierarchy", "privacy_unit",
              "contribution_cap", "window_size", "alarm_threshold", "grouper_share", "theta", "smoother")
_INTERVAL = re.compile(r"^(?:(?P<days>-?\d+) days?)?\s*(?:(?P<sign>-)?(?P<h>\d+):(?P<m>\d\d):(?P<s>\d\d(?:\.\d+)?))?$")


@dataclass
class CountPlan:
    source: Source
    time_col: str
    time_type: str
    keys: list[str]
    key_types: dict[str, str]
    privacy_unit: str | None
    options: dict
    note: str


def install(con, context: Context) -> None:
    def plan(table, time_col, params_json):
        time_col = column_name(time_col, "time_col")
        options = {k: v for k, v in json.loads(params_json).items() if v is not None}
        partition_by = options.pop("partition_by", None)
        keys = [partition_by] if isinstance(partition_by, str) else list(partition_by or [])
        privacy_unit = options.pop("privacy_unit", None)
        source = resolve_source(context, table)
        columns = describe(context, source)
        named = {"time_col": time_col, "privacy_unit": privacy_unit}
        named.update({f"partition_by[{k}]": key for k, key in enumerate(keys)})
        for parameter, name in named.items():
            if name is not None and not isinstance(name, str):
                raise InvalidParameter(f"{parameter} must be a column name, got {name!r}")
        require_columns(columns, source, **named)
        taken = {time_col, *keys}
        if len(taken) < 1 + len(keys) or taken & {LEVEL, COUNT, STD_ERROR, ROW, WINDOW_SUM,
                                                  WINDOW_STD_ERROR, ALARM}:
            raise InvalidParameter(f"time_col and partition_by must be distinct columns without dpsql's output "
                                   f"names; got {[time_col, *keys]}")
        time_type = _time_output_type(columns[time_col], time_col)
        token = str(context.next_id())
        context.plans[token] = CountPlan(source, time_col, columns[time_col], keys,
                                         {k: columns[k] for k in keys}, privacy_unit, options,
                                         f"duckdb {MACRO}({table!r}, {time_col!r})")
        outputs = [(time_col, time_type, time_col)]
        outputs += [(k, columns[k], k) for k in keys]
        if options.get("hierarchy"):
            outputs.append((LEVEL, "BIGINT", LEVEL))
        outputs += [(COUNT, "DOUBLE", COUNT), (STD_ERROR, "DOUBLE", STD_ERROR), (ROW, "BIGINT", ROW)]
        if options.get("window_size") is not None:
            outputs += [(WINDOW_SUM, "DOUBLE", WINDOW_SUM), (WINDOW_STD_ERROR, "DOUBLE", WINDOW_STD_ERROR)]
            if options.get("alarm_threshold") is not None:
                outputs.append((ALARM, "BOOLEAN", ALARM))
        return unnest_sql(f"dp__run_count_stream({quote_literal(token)})", outputs)

    def run(token):
        count_plan = planned(context, token)
        times, keys, units, key_types = _read_events(context, count_plan)
        options = dict(count_plan.options)
        every = options.pop("every")
        result = release_event_counts(
            times, start=_instant(options.pop("start", None)), stop=_instant(options.pop("stop", None)),
            every=_duration(every), epsilon=options.pop("epsilon", None), method=options.pop("method", "pegasus"),
            keys=keys, hierarchy=bool(options.pop("hierarchy", False)), units=units,
            cap=options.pop("contribution_cap", None), window=options.pop("window_size", None),
            alarm_threshold=options.pop("alarm_threshold", None), budget=context.budget, note=count_plan.note,
            time_column=count_plan.time_col, **options)
        columns = result.columns()
        # The core's per-stream bucket and stream indices give way to row handles: its
        # rows are in the release's order (stream, then bucket).
        del columns[PART]
        columns[ROW] = row_handles(context, result.release)
        held = {}
        for name, values in columns.items():
            if name == ROW:
                held[name] = values
            elif name == count_plan.time_col:
                held[name] = _bucket_times(values, count_plan.time_type)
            elif name in key_types:
                held[name] = pa.array(values.tolist(), key_types[name])
            else:
                held[name] = pa.array(values)
        return context.hold(held)

    context.udf("dp__plan_count_stream", plan, ["VARCHAR"] * 3, "VARCHAR")
    context.udf("dp__run_count_stream", run, ["VARCHAR"], "BIGINT")
    defaults = ", ".join(f"{quote_ident(n)} := {'false' if n == 'hierarchy' else 'NULL'}" for n in PARAMETERS)
    context.macro(f"{MACRO}(tbl, time_col, every := INTERVAL '5 minutes', {defaults}) AS TABLE "
                  f"FROM query(dp__plan_count_stream(tbl, time_col, {params_struct(('every', *PARAMETERS))}))")


def _time_output_type(sql_type: str, name: str) -> str:
    if sql_type == "TIMESTAMP WITH TIME ZONE":
        return sql_type
    if sql_type.startswith("TIMESTAMP") or sql_type == "DATE":
        return "TIMESTAMP"
    if sql_type.split("(")[0] in NUMERIC_TYPES:
        return "DOUBLE"
    raise InvalidData(f"time_col {name!r} must be a TIMESTAMP, DATE or number, got {sql_type}")


def _read_events(context: Context, plan: CountPlan):
    """The event table's time, key and unit columns as numpy (one scan, no order needed),
    and the Arrow types the keys are handed back in (VARCHAR for types outside
    ``LIST_TYPES``; the result query casts them back)."""
    wanted = list(dict.fromkeys([plan.time_col, *plan.keys, *([plan.privacy_unit] if plan.privacy_unit else [])]))
    select = []
    for name in wanted:
        quoted = quote_ident(name)
        held = plan.key_types.get(name)
        select.append(f"CAST({quoted} AS VARCHAR) AS {quoted}" if held is not None and held not in LIST_TYPES
                      else quoted)
    cur = plan.source.cursor(context.con)
    try:
        table = cur.sql(f"SELECT {', '.join(select)} FROM {plan.source.sql}").to_arrow_table()
    finally:
        cur.close()
    time = table.column(plan.time_col)
    if time.null_count:
        raise InvalidTimeKey(f"time_col {plan.time_col!r} contains {time.null_count} NULL value(s); every event "
                             "needs a time")
    if pa.types.is_timestamp(time.type) and time.type.tz is not None:
        time = time.cast(pa.timestamp(time.type.unit))
    times = time.to_numpy()
    keys = {k: table.column(k).to_numpy(zero_copy_only=False) for k in plan.keys}
    units = table.column(plan.privacy_unit).to_numpy(zero_copy_only=False) if plan.privacy_unit else None
    return times, keys, units, {k: table.column(k).type for k in plan.keys}


def _instant(value):
    """A JSON-rendered SQL TIMESTAMP / DATE / VARCHAR (ISO text, optional UTC offset) or a number."""
    if isinstance(value, str):
        try:
            return dt.datetime.fromisoformat(value)
        except ValueError:
            raise InvalidParameter(f"start and stop must be timestamps or ISO strings, got {value!r}") from None
    return value


def _duration(value):
    """A JSON-rendered SQL INTERVAL (``'1 day 00:05:00'``) as a timedelta. Numbers and
    short duration strings (``'5m'``, ``'1h30m'``) pass through to the core's parser."""
    if not isinstance(value, str):
        return value
    match = _INTERVAL.match(value.strip()) if value.strip() else None
    if match is None:
        if re.search(r"mon|year", value):
            raise InvalidParameter(f"every must be an INTERVAL of fixed length (days, hours, minutes, seconds; "
                                   f"no months or years), got {value!r}")
        return value
    seconds = float(match["h"] or 0) * 3600 + float(match["m"] or 0) * 60 + float(match["s"] or 0)
    return dt.timedelta(days=int(match["days"] or 0), seconds=-seconds if match["sign"] else seconds)


def _bucket_times(starts: np.ndarray, output_type: str) -> pa.Array:
    if output_type == "TIMESTAMP WITH TIME ZONE":
        return pa.array(starts.astype("datetime64[us]")).cast(pa.timestamp("us", tz="UTC"))
    if output_type == "TIMESTAMP":
        return pa.array(starts.astype("datetime64[us]"))
    return pa.array(starts, pa.float64())
