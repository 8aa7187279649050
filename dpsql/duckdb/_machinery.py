"""The old home of the DuckDB front end's machinery, now split by concern:

* :mod:`dpsql.duckdb.context`: one context per connection, result slots, signatures, typed errors;
* :mod:`dpsql.duckdb.sources`: where a macro reads from, and the columns it finds;
* :mod:`dpsql.duckdb.ordered`: the read in stream order, the key checks, the one charge;
* :mod:`dpsql.duckdb.macros`: the generic stream macro and the pieces other macros use;
* :mod:`dpsql.duckdb.sqltext`: quoting, and reading argument lists.

Names imported from here are looked up in those modules (for code written against the old
layout); new code imports from them directly.
"""

from __future__ import annotations

import importlib

_MODULES = ("context", "sources", "ordered", "macros", "sqltext")


def __getattr__(name: str):
    for module in _MODULES:
        found = importlib.import_module(f"dpsql.duckdb.{module}")
        if hasattr(found, name):
            return getattr(found, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
