"""SQL errors that name what is wrong and say what to do instead.

DuckDB checks a macro call's arguments while it binds the statement, before any dpsql code
runs, and its refusal ("Macro dp_range_sum() does not support the supplied arguments")
does not say which argument. Likewise a source that only the calling connection can see
(a TEMP table, a common table expression) is refused by dpsql's plan, which cannot look
at that connection to say what the name is.

:func:`install` therefore wraps the query methods of DuckDB connections (``sql``,
``query``, ``from_query``, ``execute``, ``executemany``). When DuckDB refuses a statement
on a connection registered with :func:`dpsql.duckdb.register`, the wrapper reads the
statement (:mod:`dpsql.duckdb.sqltext`) and, where it can say more, raises instead an
error that is both a :class:`dpsql.InvalidParameter` and the DuckDB error class it
replaces (so ``except duckdb.Error`` still catches it), with the DuckDB error as its cause:

* a misspelt named parameter (``epsilonn := 1``): named, with the closest valid name and
  the macro's parameters (positional ones first, then the named ones);
* a missing positional argument, an SQL keyword used as a bare name (``window := 3``, which
  must be written ``"window" := 3``), or a subquery as the source (DuckDB's table functions
  take none: the message shows the call with the query as text);
* a source the plan could not read: whether it is a TEMP table or view, a common table
  expression of the statement or an object registered with ``con.register()``, and what to
  pass instead.

A dpsql function that refuses while the statement runs (an exhausted budget, NaN values, an
unknown row handle) raises its dpsql error inside DuckDB, which reports it as its own
``InvalidInputException`` with the text of the error after an internal prefix (``exporting a
stream from the object registered as 'dp__result_5' failed: ...``). The wrappers raise
instead an error that is both that dpsql error's class (:class:`dpsql.BudgetExhausted`,
:class:`dpsql.InvalidData`, ..., with its attributes) and the DuckDB class, with dpsql's
message only. A statement runs where DuckDB executes it: the connection's query and fetch
methods, and a relation's (``fetchall``, ``pl``, ``to_arrow_table``, ``create``, ``show``,
printing it, reading it through the Arrow stream interface...), so those are wrapped too.

Anything else, every statement that succeeds, and every connection that was not registered
pass through untouched.

DuckDB looks up Python variables named in a statement (``FROM df``) in the first calling
frame outside its own modules; the wrappers' globals carry a ``duckdb.`` module name so that
their frames are not taken for that caller.
"""

from __future__ import annotations

import functools
import re
import types

import duckdb

from dpsql._frontend import no_such_parameters
from dpsql.duckdb.context import registered, typed_error
from dpsql.duckdb.sources import is_query
from dpsql.duckdb.sqltext import Call, Signature, calls, quote_ident, quote_literal, tokens
from dpsql.errors import DPError, InvalidParameter

#: The connection methods that take SQL text first.
WRAPPED = ("sql", "query", "from_query", "execute", "executemany")
#: The connection methods that fetch the result of the last ``execute`` (which may still be running).
FETCHES = ("fetchone", "fetchmany", "fetchall", "fetchnumpy", "fetchdf", "fetch_df", "fetch_df_chunk", "df",
           "pl", "arrow", "fetch_arrow_table", "fetch_record_batch", "to_arrow_table", "to_arrow_reader", "torch",
           "tf")
#: The relation methods that run its query (a relation from ``con.sql`` is lazy: it runs when read).
RUNS = ("fetchall", "fetchone", "fetchmany", "fetchnumpy", "fetchdf", "df", "to_df", "pl", "arrow",
        "to_arrow_table", "fetch_arrow_table", "to_arrow_reader", "fetch_arrow_reader", "fetch_record_batch",
        "record_batch", "iter_rows", "to_dicts", "show", "create", "to_table", "insert", "insert_into", "to_csv",
        "write_csv", "to_parquet", "write_parquet", "describe", "materialize", "execute", "torch", "tf", "shape",
        "__arrow_c_stream__", "__repr__", "__str__", "__len__")
#: Words DuckDB reserves: a parameter of that name must be quoted in a call.
RESERVED = frozenset({"window", "order", "group", "limit", "offset", "from", "where", "select", "table", "union",
                      "all", "and", "or", "not", "default", "end", "case", "when", "then", "else", "as", "on",
                      "using", "with", "check", "column", "constraint", "primary", "references", "unique"})


def install() -> None:
    """Wrap the connection and relation methods (once per process; idempotent)."""
    for owner, names in ((duckdb.DuckDBPyConnection, WRAPPED + FETCHES), (duckdb.DuckDBPyRelation, RUNS)):
        for name in names:
            original = owner.__dict__.get(name)
            if isinstance(original, property) and not getattr(original.fget, "__dpsql_wrapped__", False):
                setattr(owner, name, property(_wrapper(original.fget), doc=original.__doc__))
            elif callable(original) and not getattr(original, "__dpsql_wrapped__", False):
                setattr(owner, name, _wrapper(original))


def _wrapper(original):
    def method(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        except duckdb.Error as error:
            better = refined(self, error, args[0] if args else kwargs.get("query"))
            if better is not None:
                raise better from error
            typed = run_time_error(error)
            if typed is None:
                raise
            raise typed from None  # DuckDB's text adds only the internal prefix

    # the same function, its globals under a duckdb module name (module docstring)
    wrapped = types.FunctionType(method.__code__, {**globals(), "__name__": "duckdb.dpsql_sql_errors"},
                                 getattr(original, "__name__", "method"), None, method.__closure__)
    functools.update_wrapper(wrapped, original)
    wrapped.__dpsql_wrapped__ = True  # type: ignore[attr-defined]
    return wrapped


_ERROR_CLASSES: dict[tuple[type, type], type] = {}


def _sql_error(dpsql_class: type, duckdb_class: type) -> type[Exception]:
    """An error class that is both ``dpsql_class`` and ``duckdb_class``, named like the first."""
    key = (dpsql_class, duckdb_class)
    if key not in _ERROR_CLASSES:
        _ERROR_CLASSES[key] = type(dpsql_class.__name__, (dpsql_class, duckdb_class),
                                   {"__module__": dpsql_class.__module__, "__qualname__": dpsql_class.__qualname__})
    return _ERROR_CLASSES[key]


def run_time_error(error: duckdb.Error) -> BaseException | None:
    """The dpsql error that DuckDB's ``error`` reports (raised by a dpsql function while the
    statement ran) as an error of both classes, with its message and attributes; else None."""
    if isinstance(error, DPError):  # already made so by a wrapped method this one called
        return None
    original = typed_error(error)
    if not isinstance(original, DPError):
        return None
    kind = _sql_error(type(original), type(error))
    typed = kind.__new__(kind)
    typed.__dict__.update(original.__dict__)
    typed.args = original.args
    return typed


def refined(con, error: duckdb.Error, query) -> BaseException | None:
    """The clearer error for ``error``, raised by ``query`` on ``con``, or None to keep it."""
    context = registered(con)
    if context is None or not isinstance(query, str):
        return None
    try:
        message = _macro_call_problem(context.signatures, query, error) or _source_problem(con, query, error)
    except Exception:  # a diagnosis must never hide the error it explains
        return None
    return None if message is None else _sql_error(InvalidParameter, type(error))(message)


# -- macro calls --------------------------------------------------------------------------

def _macro_call_problem(signatures: dict[str, Signature], query: str, error: duckdb.Error) -> str | None:
    text = str(error)
    if isinstance(error, duckdb.ParserException):
        for call in calls(query, signatures):
            for argument in call.named:
                if argument.bare and (argument.name or "").lower() in RESERVED:
                    return (f"{call.name}(): {argument.name} is an SQL keyword; quote it to pass it by name: "
                            f"{quote_ident(argument.name or '')} := ...")
        return None
    if not isinstance(error, duckdb.BinderException):
        return None
    if "cannot contain subqueries" in text:
        for call in calls(query, signatures):
            for argument in call.arguments:
                inner = argument.text.split(":=", 1)[-1].strip() if argument.name else argument.text.strip()
                if inner.startswith("(") and inner.endswith(")") and is_query(inner):
                    return (f"{call.name}() takes no subquery as an argument: pass the query as text instead, "
                            f"{call.name}({quote_literal(inner[1:-1].strip())}, ...)")
        return None
    if "does not support the supplied arguments" not in text:
        return None
    named = re.search(r"Macro (\w+)\(\)", text)
    names = [named.group(1).lower()] if named and named.group(1).lower() in signatures else list(signatures)
    for call in calls(query, names):
        problem = call_problem(signatures[call.name], call)
        if problem is not None:
            return problem
    return None


def call_problem(signature: Signature, call: Call) -> str | None:
    """What is wrong with ``call`` of a macro of ``signature``, or None."""
    where = f"{signature.name}()"
    named = {n.lower(): n for n in signature.named}
    given = [(a.name or "").lower() for a in call.named]
    unknown = [a.name or "" for a in call.named if (a.name or "").lower() not in named]
    if unknown:
        return f"{no_such_parameters(where, unknown, signature.valid, fold=str.lower)}. {_listing(signature)}"
    repeated = sorted({n for n in given if given.count(n) > 1})
    if repeated:
        return f"{where}: {', '.join(map(repr, repeated))} given twice. {_listing(signature)}"
    if len(call.positional) < len(signature.positional):
        missing = signature.positional[len(call.positional):]
        return (f"{where} needs {len(signature.positional)} positional argument(s), "
                f"{', '.join(signature.positional)}; missing {', '.join(missing)}. {_listing(signature)}")
    if len(call.positional) > len(signature.positional) + len(signature.named):
        return (f"{where} takes {len(signature.positional)} positional argument(s) "
                f"({', '.join(signature.positional)}); got {len(call.positional)}. {_listing(signature)}")
    return None


def _listing(signature: Signature) -> str:
    named = [quote_ident(n) if n.lower() in RESERVED else n for n in signature.named]
    positional = ", ".join(signature.positional) or "nothing"
    return f"It takes {positional} (in this order), then by name (name := value): {', '.join(named)}"


# -- sources the plan could not read -------------------------------------------------------

def _source_problem(con, query: str, error: duckdb.Error) -> str | None:
    original = typed_error(error)
    name = getattr(original, "source_name", None)
    if name is None:
        return None
    text = f"tbl {name!r} is {{}}. dpsql reads its input through a second connection, which cannot see it; {{}}"
    as_text = "the text of tbl ('SELECT ... FROM ...', over regular tables)"
    if _is_cte(query, name):
        return text.format(f"a common table expression of this statement (WITH {name} AS ...)",
                           f"pass its query as {as_text} instead, or create it as a view "
                           f"(CREATE VIEW {quote_ident(name)} AS ...)")
    kind = _temporary_kind(con, name)
    if kind == "registered":
        return text.format("registered on this connection only (con.register())",
                           "pass the data frame by its Python variable name instead, or create a table from it")
    if kind is not None:
        return text.format(f"a TEMP {kind} of this connection",
                           f"create it as a regular {kind} (CREATE {kind.upper()} {quote_ident(name)} AS ...), or "
                           f"pass the query that fills it as {as_text}")
    return None


def _is_cte(query: str, name: str) -> bool:
    """Does ``query`` define a common table expression ``name`` (``name AS (`` after ``WITH``)?"""
    toks = tokens(query)
    if not any(t.kind == "name" and t.text.upper() == "WITH" for t in toks):
        return False
    for i, tok in enumerate(toks[:-2]):
        if tok.kind == "name" and tok.name.lower() == name.lower() and toks[i + 1].text.upper() == "AS":
            rest = [t.text.upper() for t in toks[i + 2:i + 5]]
            if rest[:1] == ["("] or rest[:2] == ["MATERIALIZED", "("] or rest[:3] == ["NOT", "MATERIALIZED", "("]:
                return True
    return False


def _temporary_kind(con, name: str) -> str | None:
    """``"table"``, ``"view"`` or ``"registered"`` (``con.register``) for a TEMP object ``name`` of ``con``.
    Read with ``con.sql``, which leaves the connection's pending ``execute`` result alone."""
    found = con.sql("SELECT 'table' FROM duckdb_tables() WHERE temporary AND table_name = $name UNION ALL "
                    "SELECT CASE WHEN coalesce(tags['duckdb_python_register'], '') = 'true' THEN 'registered' "
                    "ELSE 'view' END FROM duckdb_views() WHERE temporary AND NOT internal AND view_name = $name",
                    params={"name": name}).fetchall()
    return found[0][0] if found else None
