"""Continual streams in SQL: register once, append from any table, read what was released.

``dp_stream_create(name, order_by, value_col, method := ..., partition_by := NULL, ...)``
    Table macro returning one row describing the stream ``name`` (name, method, epsilon,
    delta, rows, partitions, watermark, created, release_id). The first execution registers
    it in the bound budget's ledger and charges its whole cost once (:meth:`dpsql.Budget.stream`):
    it needs ``method`` and ``epsilon``, as in Python. Later ones reopen it for free
    (``dp_stream_create('kwh', NULL, NULL)`` or with the same parameters), refusing other ones. Count streams
    (``method := 'pegasus'``, ``'count_laplace'`` or ``'count_smoothed'``) take the event table's time column
    as ``order_by`` (``value_col`` NULL) and their public grid ``every := INTERVAL ...`` and
    ``start := TIMESTAMP ...``.

``dp_stream_append(name, tbl, until := NULL)``
    Releases the new rows of ``tbl`` (a table, view, file or Python data frame, as for
    ``dp_range_sum``) and returns what this append released: the partition key, the order key,
    the private value (named like the value column; ``count`` for count streams) and
    ``dp_row``. Rows repeated from an earlier append return their recorded values. ``until``
    closes a count stream's buckets ending at or before it. Costs nothing: the stream was
    charged when created. Executing the same query again is an idempotent re-append for a stream of
    values; a count stream's events carry no identity, so appending them again is refused
    (``LateRow``) once their buckets are closed and counted twice while they are open.

``dp_stream(name)``
    Every row the stream has released so far (free).

The same ledger rows as the Python API: a stream created in SQL is appended to from Python,
Polars or another process, and back.

>>> import duckdb, dpsql
>>> con = duckdb.connect()
>>> dpsql.duckdb.register(con, budget=dpsql.Budget.in_memory(epsilon=1.0))
>>> _ = con.execute("CREATE TABLE readings AS SELECT range AS hour, (range % 5)::DOUBLE AS kwh FROM range(48)")
>>> con.sql("SELECT name, method, epsilon FROM dp_stream_create('kwh', 'hour', 'kwh', method := 'laplace', "
...         "epsilon := 0.5, upper := 10)").fetchall()
[('kwh', 'laplace', 0.5)]
>>> con.sql("SELECT count(*) FROM dp_stream_append('kwh', 'readings')").fetchall()
[(48,)]
>>> con.sql("SELECT count(*) FROM dp_stream('kwh')").fetchall()
[(48,)]
"""

from __future__ import annotations

import functools

import pyarrow as pa

from dpsql.continual import ROW_COLUMN, Stream
from dpsql.continual.state import FINAL
from dpsql.duckdb.context import Context
from dpsql.duckdb.counts import sql_duration, sql_instant
from dpsql.duckdb.macros import method_parameters, params_struct, parse_params
from dpsql.duckdb.sources import Source, arrow_fields, column_name, describe, require_columns, resolve_source
from dpsql.duckdb.sqltext import quote_ident
from dpsql.errors import InvalidParameter

INFO_SCHEMA = pa.schema([("name", pa.string()), ("method", pa.string()), ("epsilon", pa.float64()),
                         ("delta", pa.float64()), ("rows", pa.int64()), ("partitions", pa.int64()),
                         ("watermark", pa.string()), ("created", pa.string()), ("release_id", pa.string())])


def _stream_name(name) -> str:
    if not isinstance(name, str) or not name:
        raise InvalidParameter(f"name must be a stream's name (a non-empty string), got {name!r}")
    return name


def install(con, context: Context) -> None:
    _install_create(context)
    _install_append(context)
    _install_read(context)


def _install_create(context: Context) -> None:
    names = [n for n in method_parameters(exclude=("method", "fresh")) if n not in ("every", "start")]

    def plan(name, order_by, value_col, partition_by, method, every, start, params_json):
        arguments = dict(name=_stream_name(name), method=method,
                         order_by=column_name(order_by, "order_by", required=False),
                         value=column_name(value_col, "value_col", required=False),
                         partition_by=column_name(partition_by, "partition_by", required=False),
                         every=sql_duration(every) if every is not None else None,
                         start=sql_instant(start) if start is not None else None, **parse_params(params_json))
        if arguments.get("max_delay") is not None:  # rows, or a duration: an INTERVAL as JSON renders it, or text
            arguments["max_delay"] = sql_duration(arguments["max_delay"], "max_delay")
        return context.result_query(INFO_SCHEMA, functools.partial(run, arguments))

    def run(arguments: dict) -> pa.Table:
        stream = context.budget.stream(**{k: v for k, v in arguments.items() if v is not None})
        return pa.Table.from_pylist([{**stream.info(), "release_id": stream.release_id}], schema=INFO_SCHEMA)

    context.udf("dp__plan_stream_create", plan, ["VARCHAR"] * 8, "VARCHAR")
    defaults = ", ".join(f"{quote_ident(n)} := NULL" for n in names)
    context.macro(
        f"dp_stream_create(name, order_by, value_col, method := NULL, partition_by := NULL, "
        f"every := NULL, start := NULL, {defaults}) AS TABLE FROM query(dp__plan_stream_create(name, order_by, "
        f"value_col, partition_by, method, CAST(every AS VARCHAR), CAST(start AS VARCHAR), "
        f"{params_struct(names)}))")


def _output_schema(stream: Stream, key_fields: dict[str, pa.Field]) -> pa.Schema:
    """What an append or a read returns: partition keys (their source types), order key, value, dp_row,
    dp_final."""
    spec = stream.spec
    empty = stream._empty_output()
    fields = [key_fields.get(c, empty.schema.field(c)) for c in spec.partition_by]
    fields.append(empty.schema.field(spec.order_by) if spec.counts else key_fields.get(spec.order_by,
                                                                                       empty.schema.field(spec.order_by)))
    return pa.schema([*fields, pa.field(stream._value_column(), pa.float64()), pa.field(ROW_COLUMN, pa.int64()),
                      pa.field(FINAL, pa.bool_())])


def _install_append(context: Context) -> None:
    def plan(name, table, until):
        stream = context.budget.stream(_stream_name(name))
        source = resolve_source(context, table)
        columns = describe(context, source)
        spec = stream.spec
        require_columns(columns, source, order_by=spec.order_by, value_col=spec.value,
                        **{f"partition_by ({c})": c for c in spec.partition_by})
        keys = [*spec.partition_by, spec.order_by]
        fields = {f.name: f for f in arrow_fields(context, source, keys)}
        schema = _output_schema(stream, fields)
        return context.result_query(schema, functools.partial(run, stream, source, schema,
                                                              None if until is None else sql_instant(until)))

    def run(stream: Stream, source: Source, schema: pa.Schema, until) -> pa.Table:
        columns = stream.spec.columns()
        cur = source.cursor(context.con)
        try:
            data = cur.sql(f"SELECT {', '.join(map(quote_ident, columns))} FROM {source.sql}").to_arrow_table()
        finally:
            cur.close()
        return stream.append(data, until=until).cast(schema)

    context.udf("dp__plan_stream_append", plan, ["VARCHAR"] * 3, "VARCHAR")
    context.macro("dp_stream_append(name, tbl, until := NULL) AS TABLE "
                  "FROM query(dp__plan_stream_append(name, tbl, CAST(until AS VARCHAR)))")


def _install_read(context: Context) -> None:
    def plan(name):
        stream = context.budget.stream(_stream_name(name))
        schema = stream.released_schema() or _output_schema(stream, {})
        return context.result_query(schema, lambda: stream.released().cast(schema))

    context.udf("dp__plan_stream", plan, ["VARCHAR"], "VARCHAR")
    context.macro("dp_stream(name) AS TABLE FROM query(dp__plan_stream(name))")


__all__ = ["install"]
