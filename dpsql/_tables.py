"""Tables from wherever a user keeps them, as Arrow: the one conversion every front end uses."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from dpsql.errors import InvalidData, InvalidParameter


def as_arrow(data, columns: Sequence[str], *, what: str) -> pa.Table:
    """``columns`` of ``data`` as one Arrow table.

    ``data`` may be a pyarrow Table, RecordBatch or RecordBatchReader, a Polars DataFrame
    or LazyFrame (only ``columns`` are collected, by the streaming engine), a pandas
    DataFrame, a DuckDB relation, or anything exporting an Arrow stream. A missing column
    is an :class:`~dpsql.InvalidParameter` naming it and ``what`` the data is for.
    """
    columns = list(dict.fromkeys(columns))
    table = _whole(data, columns, what)
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise InvalidParameter(f"{what}: column(s) {', '.join(map(repr, missing))} not found; the data has "
                               f"{', '.join(map(repr, table.column_names))}")
    return table.select(columns)


def arrow_batches(data, columns: Sequence[str], order: Sequence[str], *, what: str):
    """``columns`` of ``data`` as Arrow tables: one table, or for a Polars LazyFrame its rows
    sorted by ``order`` (lazily) and collected in batches by the streaming engine, so that a
    large lazy query is never materialised at once."""
    module = type(data).__module__.split(".")[0]
    if module == "polars":
        import polars as pl

        if isinstance(data, pl.LazyFrame):
            present = set(data.collect_schema().names())
            missing = [c for c in columns if c not in present]
            if missing:
                raise InvalidParameter(f"{what}: column(s) {', '.join(map(repr, missing))} not found; the data has "
                                       f"{', '.join(map(repr, present))}")
            query = data.select(list(dict.fromkeys(columns))).sort(list(order), maintain_order=True)
            return (batch.to_arrow() for batch in query.collect_batches())
    return iter([as_arrow(data, columns, what=what)])


def _whole(data, columns: list[str], what: str) -> pa.Table:
    if isinstance(data, pa.Table):
        return data
    if isinstance(data, pa.RecordBatch):
        return pa.Table.from_batches([data])
    if isinstance(data, pa.RecordBatchReader):
        return data.read_all()
    module = type(data).__module__.split(".")[0]
    if module == "polars":
        import polars as pl

        if isinstance(data, pl.LazyFrame):
            present = set(data.collect_schema().names())
            return data.select([c for c in columns if c in present]).collect(engine="streaming").to_arrow()
        return data.to_arrow()
    if module == "pandas":
        return pa.Table.from_pandas(data, preserve_index=False)
    if module in ("duckdb", "_duckdb"):
        return data.to_arrow_table()
    if hasattr(data, "__arrow_c_stream__"):
        return pa.table(data)
    raise InvalidData(f"{what}: cannot read a {type(data).__name__}; pass a pyarrow Table or RecordBatchReader, "
                      "a Polars DataFrame or LazyFrame, a pandas DataFrame or a DuckDB relation")


#: Field metadata of a stored ``key`` column kept as differences of consecutive keys.
_DELTA = {b"dpsql.encoding": b"delta"}


def table_bytes(table: pa.Table) -> bytes:
    """``table`` as LZ4-compressed Arrow IPC bytes (what the ledger stores of released rows:
    LZ4 is fast where noisy values and keyed tags barely compress, and shrinks the keys).

    A 64-bit integer or timestamp ``key`` column (order keys, ascending) is stored as the
    differences of consecutive keys, the first key as it is: keys on a grid become one
    repeated number, which LZ4 compresses to almost nothing and at once (it finds only short
    matches in the keys themselves). :func:`table_of` restores them exactly (two's complement
    arithmetic, so any int64 keys round-trip)."""
    if "key" in table.column_names and table.num_rows > 1:
        table = _delta_keys(table)
    sink = pa.BufferOutputStream()
    # one thread: handing a table's few buffers to Arrow's pool costs more than it saves, and
    # far more on a busy machine (each task waits for a core)
    options = pa.ipc.IpcWriteOptions(compression="lz4", use_threads=False)
    with pa.ipc.new_stream(sink, table.schema, options=options) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def table_of(data: bytes) -> pa.Table:
    """The table :func:`table_bytes` stored."""
    table = pa.ipc.open_stream(pa.py_buffer(data), options=pa.ipc.IpcReadOptions(use_threads=False)).read_all()
    if "key" in table.column_names:
        field = table.schema.field("key")
        if field.metadata and field.metadata.get(b"dpsql.encoding") == b"delta":
            table = _undelta_keys(table, field)
    return table


def _delta_keys(table: pa.Table) -> pa.Table:
    at = table.schema.get_field_index("key")
    kind = table.schema.field(at).type
    if not (pa.types.is_int64(kind) or pa.types.is_timestamp(kind) or pa.types.is_duration(kind)):
        return table
    column = table.column(at)
    if column.null_count:
        return table
    keys = column.combine_chunks().view(pa.int64()).to_numpy()
    deltas = np.empty_like(keys)
    deltas[0] = keys[0]
    np.subtract(keys[1:], keys[:-1], out=deltas[1:])
    field = pa.field("key", pa.int64(), nullable=False, metadata={**_DELTA, b"dpsql.type": str(kind).encode()})
    return table.set_column(at, field, pa.array(deltas))


def _undelta_keys(table: pa.Table, field: pa.Field) -> pa.Table:
    at = table.schema.get_field_index("key")
    keys = np.cumsum(table.column(at).combine_chunks().to_numpy())
    kind = _stored_type(field.metadata[b"dpsql.type"].decode())
    return table.set_column(at, pa.field("key", kind), pa.array(keys, pa.int64()).view(kind))


def _stored_type(name: str) -> pa.DataType:
    if name.startswith("timestamp[") or name.startswith("duration["):
        inside = name[name.index("[") + 1:-1].split(", tz=")
        if name.startswith("duration["):
            return pa.duration(inside[0])
        return pa.timestamp(inside[0], tz=inside[1] if len(inside) > 1 else None)
    return pa.type_for_alias(name)
