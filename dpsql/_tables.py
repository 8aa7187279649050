"""Tables from wherever a user keeps them, as Arrow: the one conversion every front end uses."""

from __future__ import annotations

from collections.abc import Sequence

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
