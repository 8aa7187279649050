"""Where a macro reads from, and what it finds there.

``tbl`` is one of:

* a table or view of the database, or a file DuckDB can scan (``'readings.parquet'``);
* a query, as text: ``dp_range_sum('SELECT ts, kwh FROM readings WHERE meter = 3', 'ts',
  'kwh', ...)`` (DuckDB's table functions take no subquery, ``(SELECT ...)``, as an argument);
* a Polars, Arrow or pandas data frame, by the name of a variable of the calling Python code
  (DuckDB's own lookup rule).

The source is read through a second connection (``con.cursor()``): code running inside a
query cannot use that query's connection. What is private to the first connection is not
visible there: TEMP tables and views, objects registered with ``con.register()``, common
table expressions (``WITH name AS ...``) of the calling query, and rows not yet committed by
an explicit transaction. Such a name is refused with a message saying what to do instead
(:mod:`dpsql.duckdb.sql_errors` tells which of these it is).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import duckdb
import pyarrow as pa

from dpsql.duckdb.sqltext import quote_ident, quote_literal, tokens
from dpsql.errors import InvalidData, InvalidParameter

if TYPE_CHECKING:
    from dpsql.duckdb.context import Context

NUMERIC_TYPES = ("TINYINT", "SMALLINT", "INTEGER", "BIGINT", "HUGEINT", "UTINYINT", "USMALLINT", "UINTEGER",
                 "UBIGINT", "UHUGEINT", "FLOAT", "DOUBLE", "DECIMAL")
#: First words of a query given as text for ``tbl``.
QUERY_WORDS = ("select", "with", "from", "values", "table", "pivot", "unpivot")
#: What to do instead of naming a source the second connection cannot see.
INSTEAD = ("use a regular table or view (CREATE TABLE / CREATE VIEW, not TEMP), pass the query as text "
           "(dp_range_sum('SELECT ... FROM ...', ...), over regular tables), or pass a Polars/Arrow/pandas "
           "data frame by its variable name")


def source_not_found(message: str, name: str | None) -> InvalidParameter:
    """The refusal of a ``tbl`` the second connection cannot read; ``source_name`` is the name
    asked for (None for a query), which :mod:`dpsql.duckdb.sql_errors` looks up on the first
    connection to say what it is."""
    error = InvalidParameter(message)
    error.source_name = name  # type: ignore[attr-defined]
    return error


@dataclass
class Source:
    """Where a macro reads from: SQL text usable after ``FROM`` on a cursor, plus the
    Python object to register there first when the source is a variable, and ``label``, what
    it is in words (``table hourly``, ``file 'x.csv'``, ``query SELECT ...``, ``data frame df``)."""

    name: str
    sql: str
    python_object: object | None = None
    label: str = ""

    def read(self, columns: Iterable[str | None]) -> str:
        """What a release reading ``columns`` of this source read, as the ledger records it:
        ``table hourly (ts, volume)``."""
        return f"{self.label} ({', '.join(c for c in columns if c is not None)})"

    def cursor(self, con: duckdb.DuckDBPyConnection) -> duckdb.DuckDBPyConnection:
        cur = con.cursor()
        if self.python_object is not None:
            cur.register(self.sql.strip('"'), self.python_object)
        return cur


def column_name(value, parameter: str, *, required: bool = True) -> str | None:
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value:
        raise InvalidParameter(f"{parameter} must be a column name (a non-empty string), got {value!r}")
    return value


def is_query(text: str) -> bool:
    """Is ``text`` a query (``SELECT ...``, ``WITH ...``, ``(...)``) rather than a name?"""
    first = next(iter(tokens(text)), None)
    return first is not None and (first.text == "(" or (first.kind == "name" and not first.text.startswith('"')
                                                         and first.text.lower() in QUERY_WORDS))


def resolve_source(context: Context, table) -> Source:
    """A catalog table or view, a file path DuckDB can scan, a query as text, or a Polars /
    Arrow / pandas object named like a variable of the calling Python code."""
    if not isinstance(table, str) or not table.strip():
        raise InvalidParameter(f"tbl must be a table name or a query (a non-empty string), got {table!r}")
    if is_query(table):
        source = Source(_shortened(table), f"({table.strip().rstrip(';')}) AS dp__query",
                        label="query " + " ".join(table.split()))
    else:
        source = Source(table, f"query_table({quote_literal(table)})")
    cur = context.con.cursor()
    try:
        cur.sql(f"SELECT * FROM {source.sql} LIMIT 0")
        source.label = source.label or _catalog_label(cur, table)
        return source
    except duckdb.CatalogException as error:
        if is_query(table):
            raise source_not_found(f"tbl query {source.name!r} cannot be read: {_first_line(error)}. dpsql reads its "
                                 "input through a second connection, which sees regular tables and views only; "
                                 f"{INSTEAD}", None) from None
    except duckdb.Error as error:
        raise InvalidParameter(f"tbl {source.name!r} cannot be read: {_first_line(error)}") from None
    finally:
        cur.close()
    python_object = _caller_variable(table)
    if python_object is None:
        raise source_not_found(
            f"tbl {table!r} not found: expected a table or view, a file path, a query, or a Polars/Arrow/pandas "
            "variable of that name. dpsql reads its input through a second connection, so TEMP tables and views, "
            "common table expressions (WITH ...) and objects registered with con.register() are not visible to it; "
            f"{INSTEAD}", table)
    return Source(table, quote_ident(f"dp__source_{context.next_id()}"), python_object, label=f"data frame {table}")


def _catalog_label(cur: duckdb.DuckDBPyConnection, name: str) -> str:
    """``table name`` or ``view name`` for a name of the catalog (bare or qualified), else ``file 'name'``."""
    qualified = ("lower({0}) = lower($name) OR lower(schema_name || '.' || {0}) = lower($name) OR "
                 "lower(database_name || '.' || schema_name || '.' || {0}) = lower($name)")
    found = cur.sql(f"SELECT 'view' FROM duckdb_views() WHERE NOT internal AND ({qualified.format('view_name')}) "
                    f"UNION ALL SELECT 'table' FROM duckdb_tables() WHERE {qualified.format('table_name')}",
                    params={"name": name}).fetchall()
    return f"{found[0][0]} {name}" if found else f"file {quote_literal(name)}"


def _shortened(text: str, limit: int = 60) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _first_line(error: BaseException) -> str:
    return str(error).split("\n")[0].rstrip("!.")


def _caller_variable(name: str):
    """Variable ``name`` of the first calling Python frame outside dpsql and duckdb (the
    frame DuckDB's own replacement scan would search), if it is a scannable data frame."""
    frame = inspect.currentframe()
    while frame is not None and _inside_engine(frame):
        frame = frame.f_back
    if frame is None:
        return None
    for scope in (frame.f_locals, frame.f_globals):
        candidate = scope.get(name)
        if candidate is not None and _scannable(candidate):
            return candidate
    return None


def _inside_engine(frame) -> bool:
    module = frame.f_globals.get("__name__", "")
    return module.split(".")[0] in ("duckdb", "_duckdb") or module.startswith("dpsql.duckdb")


def _scannable(obj) -> bool:
    module = type(obj).__module__.split(".")[0]
    return module in ("polars", "pyarrow", "pandas")


def describe(context: Context, source: Source) -> dict[str, str]:
    """Column name -> DuckDB type name of ``source``."""
    cur = source.cursor(context.con)
    try:
        rel = cur.sql(f"SELECT * FROM {source.sql} LIMIT 0")
        return {name: str(t) for name, t in zip(rel.columns, rel.types)}
    finally:
        cur.close()


def require_columns(columns: dict[str, str], source: Source, **named: str | None) -> None:
    """Every named column exists in ``source`` (messages name the parameter and column)."""
    for parameter, name in named.items():
        if name is not None and name not in columns:
            raise InvalidParameter(f"{parameter} {name!r} is not a column of {source.name!r}; "
                                   f"columns are {', '.join(map(repr, columns))}")


def require_numeric(columns: dict[str, str], value_col: str) -> None:
    sql_type = columns[value_col]
    if sql_type.split("(")[0] not in NUMERIC_TYPES:
        raise InvalidData(f"column {value_col!r} must be numeric, got {sql_type}")


def arrow_fields(context: Context, source: Source, names: Iterable[str]) -> list[pa.Field]:
    """The Arrow fields DuckDB reads columns ``names`` of ``source`` as (the result keeps
    the keys' own types)."""
    names = list(names)
    if not names:
        return []
    cur = source.cursor(context.con)
    try:
        schema = cur.sql(f"SELECT {', '.join(map(quote_ident, names))} FROM {source.sql} LIMIT 0").to_arrow_table()
    finally:
        cur.close()
    return list(schema.schema)

