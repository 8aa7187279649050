"""``dp_count_stream``: private count streams from an event table, in SQL.

SQL surface (installed by :func:`dpsql.duckdb.register`)::

    dp_count_stream(tbl, order_by, every := INTERVAL '5 minutes', start := ..., stop := ...,
                    epsilon := ..., method := 'pegasus', partition_by := NULL, hierarchy := false,
                    privacy_unit := NULL, contribution_cap := NULL, "window" := NULL,
                    alarm_threshold := NULL, window_smoother := NULL, grouper_share := NULL, theta := NULL,
                    smoother := NULL)

Table macro. Counts the events (rows) of table, view, file or data-frame variable
``tbl`` per bucket ``[start + i * every, start + (i + 1) * every)`` of the public time
domain ``[start, stop)`` (required: never read from the data; the last bucket may be
shorter) and releases every count stream with PeGaSus (``method := 'pegasus'``),
per-bucket Laplace (``'count_laplace'``) or per-bucket Laplace then the adaptive smoother
(``'count_smoothed'``, post-processing at the same cost) through :func:`dpsql.counts.release_event_counts`:
one call of :func:`dpsql.publishing.publish`, one charge. Empty buckets are released; events
outside the domain are dropped and counted nowhere. ``every`` must have a fixed length
(an INTERVAL without months or years, or text such as ``'5m'``, ``'1h30m'``);
``order_by`` may be TIMESTAMP (any precision, with or without time zone: buckets are
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
like ``order_by``), the partition columns (NULL above a row's level), ``dp_level``
(hierarchies only), ``dp_count`` (the estimate), ``dp_std_error`` (noise only) and
``dp_row``, the connection-wide row handle of :mod:`dpsql.duckdb.range_sum`
(consecutive buckets of a stream have consecutive handles; ``dp_release_id(dp_row)``
gives the ledger's ``release_id``); with ``"window" := w`` (quoted: an SQL keyword), ``dp_window_sum``
(the sum of the last ``w`` buckets, fewer at the start: for ``'pegasus'`` and ``'count_smoothed'``
re-smoothed from the noisy counts known at the window's end, for ``'count_laplace'`` the sum of
the released counts; ``window_smoother := 'none'`` sums the released counts,
:func:`dpsql.streams.windows.window_sums`) and ``dp_window_std_error``; with
``alarm_threshold``, ``dp_alarm`` (``dp_window_sum >= alarm_threshold``: event
monitoring). Windows and alarms are post-processing; so are SQL window functions over
``dp_count`` (equal to ``dp_window_sum`` with ``window_smoother := 'none'``), whose error
bars ``dp_range_variance(min(dp_row) OVER w, max(dp_row) OVER w + 1)`` gives exactly (with
``w`` partitioned by the partition columns and ``dp_level``).
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import re
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from dpsql._frontend import COUNT_METHOD
from dpsql.counts import ALARM, COUNT, LEVEL, PART, ROW, STD_ERROR, WINDOW_STD_ERROR, WINDOW_SUM, release_event_counts
from dpsql.duckdb.context import Context
from dpsql.duckdb.macros import params_struct, row_handles
from dpsql.duckdb.sources import (
    NUMERIC_TYPES,
    Source,
    arrow_fields,
    column_name,
    describe,
    require_columns,
    resolve_source,
)
from dpsql.duckdb.sqltext import quote_ident
from dpsql.errors import InvalidData, InvalidParameter
from dpsql.ordering import refuse_null_event_times, refuse_null_keys

MACRO = "dp_count_stream"
#: Named macro parameters besides ``every`` (whose default is an interval).
PARAMETERS = ("start", "stop", "epsilon", "method", "partition_by", "hierarchy", "privacy_unit",
              "contribution_cap", "window", "alarm_threshold", "window_smoother", "grouper_share", "theta",
              "smoother", "note")
_INTERVAL = re.compile(r"^(?:(?P<days>-?\d+) days?)?\s*(?:(?P<sign>-)?(?P<h>\d+):(?P<m>\d\d):(?P<s>\d\d(?:\.\d+)?))?$")


@dataclass
class CountPlan:
    source: Source
    order_by: str
    time_type: pa.DataType
    keys: list[str]
    privacy_unit: str | None
    options: dict
    #: what the release reads, for the ledger (:meth:`Source.read`)
    reads: str


def install(con, context: Context) -> None:
    def plan(table, order_by, params_json):
        order_by = column_name(order_by, "order_by")
        options = {k: v for k, v in json.loads(params_json).items() if v is not None}
        partition_by = options.pop("partition_by", None)
        keys = [partition_by] if isinstance(partition_by, str) else list(partition_by or [])
        privacy_unit = options.pop("privacy_unit", None)
        source = resolve_source(context, table)
        columns = describe(context, source)
        named = {"order_by": order_by, "privacy_unit": privacy_unit}
        named.update({f"partition_by[{k}]": key for k, key in enumerate(keys)})
        for parameter, name in named.items():
            if name is not None and not isinstance(name, str):
                raise InvalidParameter(f"{parameter} must be a column name, got {name!r}")
        require_columns(columns, source, **named)
        taken = {order_by, *keys}
        if len(taken) < 1 + len(keys) or taken & {LEVEL, COUNT, STD_ERROR, ROW, WINDOW_SUM,
                                                  WINDOW_STD_ERROR, ALARM}:
            raise InvalidParameter(f"order_by and partition_by must be distinct columns without dpsql's output "
                                   f"names; got {[order_by, *keys]}")
        time_type = _time_output_type(columns[order_by], order_by)
        count_plan = CountPlan(source, order_by, time_type, keys, privacy_unit, options,
                               source.read([order_by, *keys, privacy_unit]))
        fields = [pa.field(order_by, time_type), *arrow_fields(context, source, keys)]
        if options.get("hierarchy"):
            fields.append(pa.field(LEVEL, pa.int64()))
        fields += [pa.field(COUNT, pa.float64()), pa.field(STD_ERROR, pa.float64()), pa.field(ROW, pa.int64())]
        if options.get("window") is not None:
            fields += [pa.field(WINDOW_SUM, pa.float64()), pa.field(WINDOW_STD_ERROR, pa.float64())]
            if options.get("alarm_threshold") is not None:
                fields.append(pa.field(ALARM, pa.bool_()))
        schema = pa.schema(fields)
        return context.result_query(schema, functools.partial(run, count_plan, schema))

    def run(count_plan: CountPlan, schema: pa.Schema) -> pa.Table:
        times, keys, units = _read_events(context, count_plan)
        options = dict(count_plan.options)
        every = options.pop("every")
        result = release_event_counts(
            times, start=sql_instant(options.pop("start", None)), stop=sql_instant(options.pop("stop", None)),
            every=sql_duration(every), epsilon=options.pop("epsilon", None), method=options.pop("method", COUNT_METHOD),
            keys=keys, hierarchy=bool(options.pop("hierarchy", False)), units=units,
            cap=options.pop("contribution_cap", None), window=options.pop("window", None),
            alarm_threshold=options.pop("alarm_threshold", None), budget=context.budget,
            note=options.pop("note", None), source=count_plan.reads,
            order_by=count_plan.order_by, **options)
        columns = result.columns()
        # The core's per-stream bucket and stream indices give way to row handles: its
        # rows are in the release's order (stream, then bucket).
        del columns[PART]
        columns[ROW] = row_handles(result.release)
        columns[count_plan.order_by] = _bucket_times(columns[count_plan.order_by], count_plan.time_type)
        return pa.Table.from_arrays([pa.array(columns[f.name], f.type) if not isinstance(columns[f.name], pa.Array)
                                     else columns[f.name] for f in schema], schema=schema)

    context.udf("dp__plan_count_stream", plan, ["VARCHAR"] * 3, "VARCHAR")
    defaults = ", ".join(f"{quote_ident(n)} := {'false' if n == 'hierarchy' else 'NULL'}" for n in PARAMETERS)
    context.macro(f"{MACRO}(tbl, order_by, every := INTERVAL '5 minutes', {defaults}) AS TABLE "
                  f"FROM query(dp__plan_count_stream(tbl, order_by, {params_struct(('every', *PARAMETERS))}))")


def _time_output_type(sql_type: str, name: str) -> pa.DataType:
    """Bucket starts are UTC timestamps for time zone aware times, naive timestamps for
    other timestamps and dates, doubles for numbers."""
    if sql_type == "TIMESTAMP WITH TIME ZONE":
        return pa.timestamp("us", tz="UTC")
    if sql_type.startswith("TIMESTAMP") or sql_type == "DATE":
        return pa.timestamp("us")
    if sql_type.split("(")[0] in NUMERIC_TYPES:
        return pa.float64()
    raise InvalidData(f"order_by {name!r} must be a TIMESTAMP, DATE or number, got {sql_type}")


def _read_events(context: Context, plan: CountPlan):
    """The event table's time, key and unit columns as numpy (one scan, no order needed)."""
    wanted = list(dict.fromkeys([plan.order_by, *plan.keys, *([plan.privacy_unit] if plan.privacy_unit else [])]))
    select = [quote_ident(name) for name in wanted]
    cur = plan.source.cursor(context.con)
    try:
        table = cur.sql(f"SELECT {', '.join(select)} FROM {plan.source.sql}").to_arrow_table()
    finally:
        cur.close()
    time = table.column(plan.order_by)
    refuse_null_event_times(plan.order_by, time.null_count)
    if pa.types.is_timestamp(time.type) and time.type.tz is not None:
        time = time.cast(pa.timestamp(time.type.unit))
    times = time.to_numpy()
    refuse_null_keys({k: table.column(k).null_count for k in plan.keys}, order_label=None, partition_labels=plan.keys)
    keys = {k: table.column(k).to_numpy(zero_copy_only=False) for k in plan.keys}
    units = table.column(plan.privacy_unit).to_numpy(zero_copy_only=False) if plan.privacy_unit else None
    return times, keys, units


def sql_instant(value):
    """A JSON-rendered SQL TIMESTAMP / DATE / VARCHAR (ISO text, optional UTC offset) or a number."""
    if isinstance(value, str):
        try:
            return dt.datetime.fromisoformat(value)
        except ValueError:
            raise InvalidParameter(f"start and stop must be timestamps or ISO strings, got {value!r}") from None
    return value


def sql_duration(value, name: str = "every"):
    """A JSON-rendered SQL INTERVAL (``'1 day 00:05:00'``) as a timedelta. Numbers and
    short duration strings (``'5m'``, ``'1h30m'``) pass through to the core's parser.
    Refusals name the parameter ``name``."""
    if not isinstance(value, str):
        return value
    match = _INTERVAL.match(value.strip()) if value.strip() else None
    if match is None:
        if re.search(r"mon|year", value):
            raise InvalidParameter(f"{name} must be an INTERVAL of fixed length (days, hours, minutes, seconds; "
                                   f"no months or years), got {value!r}")
        return value
    seconds = float(match["h"] or 0) * 3600 + float(match["m"] or 0) * 60 + float(match["s"] or 0)
    return dt.timedelta(days=int(match["days"] or 0), seconds=-seconds if match["sign"] else seconds)


def _bucket_times(starts: np.ndarray, output_type: pa.DataType) -> pa.Array:
    if pa.types.is_timestamp(output_type):
        return pa.array(starts.astype("datetime64[us]")).cast(output_type)
    return pa.array(starts, pa.float64())
