"""``dpsql ledger LOCATION``: read a ledger from the command line, never writing to it.

    dpsql ledger ledger.sqlite                 # scopes: total, spent, remaining
    dpsql ledger ledger.sqlite --history       # every charge and cache hit, per scope
    dpsql ledger ledger.sqlite --streams       # continual streams
    dpsql ledger ledger.sqlite --json          # the same, as JSON
    dpsql ledger postgresql://ana@db/ledger --scope meters

The command reads one consistent snapshot and writes nothing, so it works for anyone who may
read the ledger: another user, a read-only directory or disk.

PostgreSQL: one ``READ ONLY``, ``REPEATABLE READ`` transaction; the server refuses any write in it.

SQLite: a ledger is in write-ahead-log (WAL) mode, and opening a WAL database even with
``mode=ro`` makes SQLite create its ``-wal`` and ``-shm`` files when they are missing: owned by
whoever ran the command, they would break the owner's next release, and in a read-only directory
the open fails (sqlite.org/wal.html, "Read-Only Databases"). So:

- ``-wal`` and ``-shm`` exist (a process has the ledger open, or one died with it open): opened
  with ``mode=ro``, sharing their index like any reader (its newest transactions live in the
  ``-wal``); SQLite falls back to a private copy of the index when ``-shm`` is not writable.
  Nothing is created. (Should the last writer close in the microseconds between seeing them and
  opening, SQLite would create them again: the one window left.)
- no ``-wal`` (nobody has it open): everything committed is in the file itself, read with
  ``immutable=1``, which creates nothing and takes no lock. A process that opens the ledger
  meanwhile writes to a new ``-wal`` first and the file itself only when it checkpoints, so the
  read is kept only if the file's size, times and inode are the same after it as before;
  otherwise it is read again (then, likely, through the ``-wal``).
- a ``-wal`` without its ``-shm`` for a second (SQLite makes the ``-shm`` right after the
  ``-wal``): refused, naming the file, rather than read without the ``-wal``'s transactions or
  with a new ``-shm``.

A ledger in rollback-journal mode (not written by dpsql) is opened with ``mode=ro``: its readers
create no files. A missing, corrupt or unreadable file is an error naming it.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
import time
from collections.abc import Callable
from pathlib import Path

from dpsql.accounting import exact, parse_fraction
from dpsql.errors import DPError, LedgerError

# Reads of a quiet SQLite ledger that a writer changed meanwhile (and looks at a -wal without its
# -shm, 50 ms apart), before giving up.
_ATTEMPTS = 20
_WAL_MODE = 2  # byte 18 of an SQLite file's header: its journal mode (1 rollback, 2 WAL)
#: What ``--history`` shows of each charge (``source``: what the release read; ``note``: the caller's words).
HISTORY = ["scope", "time", "kind", "method", "epsilon", "delta", "rows", "source", "note", "release_id"]


def connect(location: str):
    """A DB-API connection to the ledger at ``location`` (an SQLite file or a ``postgresql://``
    URL) that cannot write and creates no file (see the module docstring); raises
    :class:`~dpsql.LedgerError` naming the ledger (without a password) when it cannot.

    Privacy: it releases and charges nothing; through it one reads what the file's permissions
    or the server's grants already allow, which includes streams' keys and open state (keep a
    ledger as safe as the raw data)."""
    if _is_postgres(location):
        return _postgres(location)
    return _sqlite(location)[0]


def read(location: str, scope: str | None = None) -> dict:
    """Everything the CLI shows: ``{"scopes": [...], "history": [...], "streams": [...]}``, from
    one snapshot of the ledger at ``location``. Privacy: only the public record (budgets,
    charges, streams' public parameters); no key, open state or released value."""
    if _is_postgres(location):
        import psycopg

        from dpsql.ledger.postgres import PostgresBackend, redacted

        conn = _postgres(location)
        try:
            return _gather(conn, PostgresBackend(location).execute, redacted(location), psycopg.Error, scope)
        finally:
            conn.close()
    for _ in range(_ATTEMPTS):
        conn, unchanged = _sqlite(location)
        try:
            conn.execute("BEGIN")  # one snapshot for every query
            found = _gather(conn, lambda c, sql, params=(): c.execute(sql, params), location, sqlite3.Error, scope)
        finally:
            conn.close()
        if unchanged():
            return found
        time.sleep(0.05)
    raise LedgerError(f"ledger {location}: it was written during each of {_ATTEMPTS} reads; try again")


def _is_postgres(location: str) -> bool:
    return location.startswith(("postgresql://", "postgres://"))


def _postgres(location: str):
    from dpsql.ledger.postgres import redacted

    try:
        import psycopg

        conn = psycopg.connect(location, connect_timeout=10)
        conn.read_only = True
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    except Exception as error:
        raise LedgerError(f"ledger {redacted(location)}: cannot connect ({type(error).__name__})") from None
    return conn


def _sqlite(path: str) -> tuple[sqlite3.Connection, Callable[[], bool]]:
    """A read-only connection to the SQLite ledger at ``path`` and a function telling, once it
    has been read, whether that read can be trusted (see the module docstring)."""
    file = Path(path)
    if not file.is_file():
        raise LedgerError(f"ledger {path}: no such file (the dpsql CLI only reads existing ledgers)")
    wal, shm = Path(f"{path}-wal"), Path(f"{path}-shm")
    before = _identity(file)
    try:
        with file.open("rb") as header:
            journal = header.read(20)[18:19]
    except OSError as error:
        raise LedgerError(f"ledger {path}: cannot be read ({error.strerror})") from None
    for _ in range(_ATTEMPTS):  # a process opening the ledger creates the -wal, then the -shm
        logged = wal.exists()
        if not logged or shm.exists():
            break
        time.sleep(0.05)
    else:
        raise LedgerError(f"ledger {path}: it has a write-ahead log ({wal.name}) but not its index ({shm.name}) "
                          "(a process killed while opening it?); open the ledger with dpsql (Budget.open) as its "
                          "owner to recover it, then read it again")
    quiet = journal == bytes([_WAL_MODE]) and not logged
    uri = file.resolve().as_uri() + ("?mode=ro&immutable=1" if quiet else "?mode=ro")
    try:
        conn = sqlite3.connect(uri, uri=True, isolation_level=None)
    except sqlite3.Error as error:
        raise LedgerError(f"ledger {path}: not a readable dpsql ledger ({error})") from None
    return conn, (lambda: not quiet or _identity(file) == before)


def _identity(file: Path) -> tuple[int, ...]:
    """What changes when the file is written or replaced (nothing, once it is gone)."""
    try:
        status = os.stat(file)
    except OSError:
        return ()
    return status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns


def _gather(conn, execute, shown: str, errors, scope: str | None) -> dict:
    """Read everything from ``conn`` (``shown``: the location without its password)."""
    try:
        where, params = ("WHERE scope = ?", (scope,)) if scope else ("", ())
        scopes = []
        for name, notion, w, eps, delta, spent_eps, spent_delta, created in execute(
                conn, f"SELECT scope, notion, w, epsilon, delta, spent_epsilon, spent_delta, created FROM scopes "
                      f"{where} ORDER BY scope", params).fetchall():
            total = (exact(eps), exact(delta))
            spent = (parse_fraction(spent_eps), parse_fraction(spent_delta))
            scopes.append({"scope": name, "notion": notion, "w": w, "epsilon": float(total[0]),
                           "delta": float(total[1]), "spent_epsilon": float(spent[0]),
                           "spent_delta": float(spent[1]), "remaining_epsilon": float(total[0] - spent[0]),
                           "remaining_delta": float(total[1] - spent[1]), "created": created})
        # every column, by name: a ledger written before a column was added (source) lacks it
        charges = execute(conn, f"SELECT * FROM charges {where} ORDER BY seq", params)
        names = [column[0] for column in charges.description]
        history = [{name: found.get(name) for name in HISTORY}
                   for found in (dict(zip(names, row)) for row in charges.fetchall())]
        streams = [dict(zip(["scope", "name", "method", "spec", "rows", "partitions", "created"], row))
                   for row in execute(conn, f"SELECT scope, name, method, spec, rows, partitions, created FROM streams "
                                            f"{where} ORDER BY created", params).fetchall()]
    except errors as error:
        raise LedgerError(f"ledger {shown}: not a readable dpsql ledger ({type(error).__name__}: {error})") from None
    for entry in history:
        entry["epsilon"], entry["delta"] = float(entry["epsilon"]), float(entry["delta"])
    for entry in streams:
        entry["params"] = json.loads(entry.pop("spec"))["params"]
    if scope and not scopes:
        raise LedgerError(f"ledger {shown}: no scope named {scope!r}")
    return {"scopes": scopes, "history": history, "streams": streams}


def _table(rows: list[dict], columns: list[str]) -> str:
    cells = [[("" if r.get(c) is None else f"{r[c]:.6g}" if isinstance(r[c], float) else str(r[c])) for c in columns]
             for r in rows]
    widths = [max([len(c)] + [len(row[k]) for row in cells]) for k, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dpsql", description="dpsql's command line (read-only).")
    commands = parser.add_subparsers(dest="command", required=True)
    ledger = commands.add_parser("ledger", help="show a ledger's scopes, history and streams (never writes)")
    ledger.add_argument("location", help="an SQLite ledger file, or a postgresql:// URL")
    ledger.add_argument("--scope", help="only this scope")
    ledger.add_argument("--history", action="store_true", help="every charge and cache hit")
    ledger.add_argument("--streams", action="store_true", help="continual streams")
    ledger.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    try:
        found = read(args.location, args.scope)
    except DPError as error:
        print(f"dpsql: {error}", file=sys.stderr)
        return 2
    if args.json:
        shown = {"scopes": found["scopes"]}
        if args.history:
            shown["history"] = found["history"]
        if args.streams:
            shown["streams"] = found["streams"]
        print(json.dumps(shown, indent=2, default=str))
        return 0
    print(_table(found["scopes"], ["scope", "notion", "epsilon", "spent_epsilon", "remaining_epsilon", "delta",
                                   "spent_delta", "remaining_delta"]))
    if args.history:
        print("\nhistory\n" + _table(found["history"], HISTORY[:-1]))
    if args.streams:
        print("\nstreams\n" + _table(found["streams"], ["scope", "name", "method", "rows", "partitions", "created"]))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
