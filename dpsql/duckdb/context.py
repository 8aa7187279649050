"""One :class:`Context` per registered connection: the bound budget, the result slots, the
functions' signatures and the recent typed errors.

A DuckDB table macro cannot run Python, and code running inside a query cannot use that
query's connection. A private release from SQL therefore happens in three steps, all driven
by one table macro::

    CREATE MACRO dp_x(tbl, ...) AS TABLE FROM query(dp__plan_x(tbl, ...))

1. **Plan, at bind time.** DuckDB folds the arguments of a table function while it binds,
   so ``dp__plan_x`` (a Python UDF, ``side_effects=True``) runs once per binding. It
   resolves the source (:mod:`dpsql.duckdb.sources`), checks the columns, and fixes the
   result's Arrow schema. It hands schema and run to the next of the connection's
   :class:`ResultSlot` objects and returns ``SELECT * FROM dp__result_<i>``: the result
   query (:meth:`Context.result_query`). It draws no noise and charges nothing (binding may
   happen more than once).
2. **Run, at execution time.** The slots are Arrow stream sources registered on the
   connection once, by :func:`install_result_slots`. Binding the result query reads a
   slot's schema; executing it asks the slot for its stream, and only then does the
   release run (:func:`dpsql.duckdb.ordered.release_ordered`: the read in stream order
   through a second connection, the key checks and the one charge through
   :func:`dpsql.publishing.publish`).
3. **Return.** The slot's stream is the key columns in stream order, the private values and
   the row handles: DuckDB scans them like any Arrow object. Every execution of the query
   asks for a new stream: an identical one (same call, same data) is answered from the
   ledger's record of the first, free (the answer cache of :func:`dpsql.publishing.publish`);
   DuckDB itself never caches a registered source between executions.

Consequences, documented in the user-facing docstrings:

* Each execution of a query is one release (charged once, or free when identical to an
  earlier one); two macro calls in one query are two releases (a common table expression
  that DuckDB reads twice scans its slot once: one release). One query may hold up to
  :data:`RESULT_SLOTS` dpsql macro calls (a further call would share the first one's slot:
  not detected, because binding gives no statement boundary to count from). Nothing is
  charged when the run fails (bad argument, bad data, budget exhausted, an error raised
  while the source is read). Once a release is charged, later failures of the surrounding
  query are not refunded: their errors may depend on the private values.
* The source is read through a second connection, so it must be visible there
  (:mod:`dpsql.duckdb.sources`).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
from collections import OrderedDict
from collections.abc import Callable

import duckdb
import pyarrow as pa

from dpsql.budget import Budget
from dpsql.duckdb.sqltext import Signature, quote_ident, signature
from dpsql.errors import DPError, InvalidParameter
from dpsql.handles import HandleResolver

#: Rows per batch of a result stream handed to DuckDB.
SCAN_BATCH_ROWS = 1 << 16
#: Result sources registered per connection (``dp__result_0`` ...): the most dpsql macro
#: calls one query can hold. Binding a query assigns its calls consecutive slots, and the
#: connection binds nothing else before it runs, so no slot is reassigned in between.
RESULT_SLOTS = 8


class _Bounded(OrderedDict):
    """A dict that forgets its oldest entries beyond ``limit``."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        while len(self) > self.limit:
            self.popitem(last=False)


class Context:
    """What one connection's dpsql functions share: the bound budget, the result slots,
    the row-handle resolver (through the budget's ledger), the macros' signatures and recent
    typed errors."""

    def __init__(self, con: duckdb.DuckDBPyConnection, budget: Budget):
        self.con = con
        self.slots = [ResultSlot(f"dp__result_{i}") for i in range(RESULT_SLOTS)]
        self._next_slot = itertools.cycle(self.slots)
        self.recent_errors: _Bounded = _Bounded(32)
        #: macro name -> its parameters (what :mod:`dpsql.duckdb.sql_errors` checks calls against)
        self.signatures: dict[str, Signature] = {}
        self._ids = itertools.count()
        self.bind(budget)

    def next_id(self) -> int:
        """A number unique on this connection (names of sources registered on cursors)."""
        return next(self._ids)

    def bind(self, budget: Budget) -> None:
        """Charge ``budget`` from now on, and resolve row handles through its ledger."""
        self.budget = budget
        self.handles = HandleResolver(budget)

    # -- registering functions ---------------------------------------------------------

    def udf(self, name: str, function: Callable, parameters: list[str], return_type: str, *,
            arrow: bool = False) -> None:
        """Register a Python UDF (replacing an older one of that name) with
        ``side_effects=True`` (never folded, never shared between rows or calls), NULLs
        passed through to Python, and dpsql errors remembered for :func:`typed_error`."""
        with contextlib.suppress(duckdb.Error):
            self.con.remove_function(name)
        self.con.create_function(name, self._remembering(function), parameters, return_type,
                                 type="arrow" if arrow else "native", null_handling="special",
                                 side_effects=True)

    def macro(self, sql: str) -> None:
        """``CREATE OR REPLACE`` a (table) macro; ``sql`` starts after ``MACRO``. Its signature
        is kept for the error messages of calls that do not match it."""
        self.con.execute("CREATE OR REPLACE MACRO " + sql)
        found = signature(sql)
        self.signatures[found.name] = found

    def _remembering(self, function: Callable) -> Callable:
        @functools.wraps(function)
        def call(*args):
            try:
                return function(*args)
            except DPError as error:
                self.recent_errors[f"{type(error).__name__}: {error}"] = error
                raise
        return call

    # -- results handed back to SQL ----------------------------------------------------

    def result_query(self, schema: pa.Schema, run: Callable[[], pa.Table]) -> str:
        """The SQL of a result query whose execution calls ``run`` (a release returning a
        table of ``schema``); to be returned by a plan UDF."""
        slot = next(self._next_slot)
        slot.assign(schema, self._remembering(run))
        return f"SELECT * FROM {quote_ident(slot.name)}"


class ResultSlot:
    """An Arrow stream source registered on the connection (``dp__result_<i>``) whose
    rows are made when a query scans it: binding reads :meth:`__arrow_c_schema__` (the
    schema its last plan fixed), executing asks for :meth:`__arrow_c_stream__`, which
    runs the release. DuckDB checks the stream's columns against the bound schema."""

    #: What an unassigned slot offers (a registered source needs a column).
    UNASSIGNED = pa.schema([("dp__unassigned", pa.int8())])

    def __init__(self, name: str):
        self.name = name
        self._schema = self.UNASSIGNED
        self._run: Callable[[], pa.Table] | None = None

    def assign(self, schema: pa.Schema, run: Callable[[], pa.Table]) -> None:
        self._schema, self._run = schema, run

    def __arrow_c_schema__(self):
        return self._schema.__arrow_c_schema__()

    def __arrow_c_stream__(self, requested_schema=None):
        if self._run is None:
            raise InvalidParameter(f"{self.name} holds the results of dpsql's table macros; call a dp_ macro")
        table = self._run()
        # DuckDB scans a stream on one thread; batches of 2^16 rows (zero-copy slices) scan
        # about 10 % faster than the 2^20-row batches of the ordered read.
        return pa.RecordBatchReader.from_batches(table.schema, table.to_batches(max_chunksize=SCAN_BATCH_ROWS)
                                                 ).__arrow_c_stream__(requested_schema)


def install_result_slots(context: Context) -> None:
    """Register the connection's result slots (again: a second ``register`` replaces them)."""
    for slot in context.slots:
        context.con.register(slot.name, slot)


def typed_error(error: BaseException) -> BaseException:
    """The dpsql error a DuckDB error carries (same type, same message), else ``error``. (An
    error of both classes, :mod:`dpsql.duckdb.sql_errors`, carries the one of its name and message.)"""
    text = f"{type(error).__name__}: {error}" if isinstance(error, DPError) else str(error)
    for context in _CONTEXTS.values():
        for message, original in reversed(context.recent_errors.items()):
            if message in text:
                return original
    return error


#: id(connection) -> its Context (checked with ``context.con is con``).
_CONTEXTS: dict[int, Context] = {}


def registered(con) -> Context | None:
    """The context of ``con`` if it was registered (and is still open), else None."""
    context = _CONTEXTS.get(id(con))
    return context if context is not None and context.con is con else None


@atexit.register
def _close_registered_connections() -> None:
    """A connection that still holds dpsql's Python UDFs when the interpreter shuts down
    makes DuckDB's bindings print pages of reference-leak warnings; close them first."""
    for context in list(_CONTEXTS.values()):
        with contextlib.suppress(duckdb.Error):
            context.con.close()


def context_for(con: duckdb.DuckDBPyConnection, budget: Budget) -> Context:
    """The connection's context, created or rebound to ``budget``."""
    existing = registered(con)
    if existing is not None:
        existing.bind(budget)
        return existing
    context = Context(con, budget)
    _CONTEXTS[id(con)] = context
    return context
