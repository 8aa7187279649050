"""The privacy-budget ledger: scopes, charges, release records, the answer cache and the
state of continual streams, in an SQLite file (the default), a PostgreSQL database shared
by a team, or memory.

:class:`~dpsql.ledger.store.Ledger` holds the logic once; a backend connects to its store.
:func:`open_ledger` picks the backend from the location.
"""

from __future__ import annotations

import os
from pathlib import Path

from dpsql.errors import InvalidParameter
from dpsql.ledger.sqlite import SqliteBackend
from dpsql.ledger.store import CachedAnswer, Ledger, Receipt, ReleaseRow, ScopeState


def open_ledger(location: str | Path) -> Ledger:
    """The ledger at ``location``: a file path, or a ``postgresql://`` URL."""
    if not isinstance(location, (str, os.PathLike)) or not os.fspath(location):
        raise InvalidParameter(f"a ledger's location must be a file path or a postgresql:// URL, got {location!r}")
    text = os.fspath(location)
    if not isinstance(text, str):
        raise InvalidParameter(f"a ledger's location must be a file path or a postgresql:// URL, got {location!r}")
    if text.startswith(("postgresql://", "postgres://")):
        from dpsql.ledger.postgres import PostgresBackend

        return Ledger(PostgresBackend(text))
    return Ledger(SqliteBackend(text))


def memory_ledger() -> Ledger:
    """A new ledger in this process's memory (gone with the process)."""
    return Ledger(SqliteBackend(None))


__all__ = ["CachedAnswer", "Ledger", "Receipt", "ReleaseRow", "ScopeState", "memory_ledger", "open_ledger"]
