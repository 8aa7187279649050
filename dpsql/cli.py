"""``dpsql ledger LOCATION``: read a ledger from the command line, never writing to it.

    dpsql ledger ledger.sqlite                 # scopes: total, spent, remaining
    dpsql ledger ledger.sqlite --history       # every charge and cache hit, per scope
    dpsql ledger ledger.sqlite --streams       # continual streams
    dpsql ledger ledger.sqlite --json          # the same, as JSON
    dpsql ledger postgresql://ana@db/ledger --scope meters

An SQLite file is opened read-only (``mode=ro``): the command can neither create a ledger
nor change one; a missing or corrupt file is an error naming it.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
from pathlib import Path

from dpsql.accounting import exact, parse_fraction
from dpsql.errors import DPError, LedgerError

#: What ``--history`` shows of each charge (``source``: what the release read; ``note``: the caller's words).
HISTORY = ["scope", "time", "kind", "method", "epsilon", "delta", "rows", "source", "note", "release_id"]


def _read_only_sqlite(path: str) -> sqlite3.Connection:
    if not Path(path).is_file():
        raise LedgerError(f"ledger {path}: no such file (the dpsql CLI only reads existing ledgers)")
    uri = Path(path).resolve().as_uri() + "?mode=ro"
    try:
        conn = sqlite3.connect(uri, uri=True)
        conn.execute("SELECT count(*) FROM scopes").fetchone()
    except sqlite3.DatabaseError as error:
        raise LedgerError(f"ledger {path}: not a readable dpsql ledger ({error})") from None
    return conn


def _connection(location: str):
    if location.startswith(("postgresql://", "postgres://")):
        from dpsql.ledger.postgres import PostgresBackend, redacted

        try:
            import psycopg

            conn = psycopg.connect(location, connect_timeout=10)
            conn.read_only = True
        except Exception as error:
            raise LedgerError(f"ledger {redacted(location)}: cannot connect ({type(error).__name__})") from None
        return conn, PostgresBackend(location).execute, redacted(location), psycopg.Error
    conn = _read_only_sqlite(location)
    return conn, lambda c, sql, params=(): c.execute(sql, params), location, sqlite3.Error


def read(location: str, scope: str | None = None) -> dict:
    """Everything the CLI shows: ``{"scopes": [...], "history": [...], "streams": [...]}``."""
    conn, execute, shown, errors = _connection(location)  # shown: the location without its password
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
        raise LedgerError(f"ledger {shown}: not a readable dpsql ledger ({type(error).__name__})") from None
    finally:
        conn.close()
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
