"""The SQLite backend: a ledger file beside the analyst (or a process's memory).

A write transaction is ``BEGIN IMMEDIATE``: SQLite serialises writers across processes, so
concurrent charges can never overspend. Persistent ledgers use write-ahead logging with
``synchronous=FULL``: a committed charge is on disk before its release is returned.
"""

from __future__ import annotations

import os
import sqlite3
import time
import uuid
from pathlib import Path

from dpsql.errors import LedgerError
from dpsql.ledger.interrupts import interruptible

#: Seconds a writer waits for another process's transaction before giving up (LedgerError).
LOCK_TIMEOUT = 60.0

_CAUSES = [
    ("readonly", "the ledger file or its directory is read-only (dpsql needs to write the ledger and its -wal "
                 "and -shm files beside it)"),
    ("disk is full", "the disk is full"),
    ("database or disk is full", "the disk is full"),
    ("not a database", "the file is not a dpsql ledger (corrupt, or another kind of file)"),
    ("malformed", "the ledger file is corrupt"),
    ("locked", "another process held the ledger's write lock for more than {timeout:g} s"),
    ("busy", "another process held the ledger's write lock for more than {timeout:g} s"),
    ("unable to open", "the file cannot be opened (missing directory or no permission)"),
    ("disk i/o error", "the disk failed to read or write the ledger"),
]


# Seconds between tries for the write lock: short, so that a waiting writer gets its turn.
_FIRST_PAUSE, _LAST_PAUSE = 0.0005, 0.004

# An SQLite commit either happens or not, and the error says which: a failed call charged nothing.
_OUTCOME = "Nothing was charged or released."


class SqliteBackend:
    errors = (sqlite3.Error,)
    lock_row = ""  # BEGIN IMMEDIATE already holds the database's write lock
    #: Whoever can write the file can read all of it: a principal other than the OS user may be named
    #: (several people sharing one file, each under their own name).
    names_principals = True

    def __init__(self, path: str | Path | None):
        """``path``: the ledger file; None for a ledger in this process's memory."""
        self.persistent = path is not None
        self.location = str(Path(path)) if self.persistent else "in memory"
        self._target = self.location if self.persistent else f"file:dpsql-{uuid.uuid4().hex}?mode=memory&cache=shared"

    def connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self._target, uri=not self.persistent, timeout=LOCK_TIMEOUT, isolation_level=None,
                               check_same_thread=False)
        try:
            if self.persistent:
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=FULL")
            conn.execute("PRAGMA foreign_keys=ON")
        except BaseException:
            conn.close()
            raise
        return conn

    def begin(self, conn) -> None:
        """``BEGIN IMMEDIATE``, waiting up to :data:`LOCK_TIMEOUT` for another process's write
        lock in short sleeps that an interrupt ends. (SQLite's own wait ignores signals and
        backs off to 100 ms between tries, so a process writing in a loop could starve this one.)"""
        deadline = time.monotonic() + LOCK_TIMEOUT
        pause = _FIRST_PAUSE
        conn.execute("PRAGMA busy_timeout = 0")
        try:
            while True:
                try:
                    conn.execute("BEGIN IMMEDIATE")
                    return
                except sqlite3.OperationalError as error:
                    if error.sqlite_errorcode & 0xFF != sqlite3.SQLITE_BUSY or time.monotonic() > deadline:
                        raise
                _pause(pause)
                pause = min(2 * pause, _LAST_PAUSE)
        finally:
            conn.execute(f"PRAGMA busy_timeout = {int(LOCK_TIMEOUT * 1000)}")

    def prepare(self, conn) -> None:
        """Nothing to do: ``BEGIN IMMEDIATE`` already serialises the creation of the tables."""

    def commit(self, conn) -> None:
        conn.execute("COMMIT")

    def rollback(self, conn) -> None:
        if conn.in_transaction:
            conn.execute("ROLLBACK")

    def execute(self, conn, sql: str, params=()):
        return conn.execute(sql, params)

    def ddl(self, statement: str) -> str:
        return statement.format(blob="BLOB", serial="INTEGER PRIMARY KEY AUTOINCREMENT", bigint="INTEGER")

    def blob(self, data: bytes):
        return sqlite3.Binary(data)

    def broken(self, conn) -> bool:
        """A local file's connection never breaks: errors leave it usable."""
        return False

    def principal(self, conn) -> str:
        """Who uses the ledger: the operating system's user of this process."""
        return os_user()

    def secure(self, conn) -> None:
        """Nothing to do: a file's permissions are all there is to restrict."""

    def columns(self, conn) -> dict[str, set[str]]:
        tables = [row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        return {t: {row[1] for row in conn.execute(f'PRAGMA table_info("{t}")')} for t in tables}

    def failure(self, error: Exception, what: str, *, committing: bool = False) -> LedgerError:
        text = str(error)
        cause = next((c for needle, c in _CAUSES if needle in text.lower()), text).format(timeout=LOCK_TIMEOUT)
        return LedgerError(f"ledger {self.location}: cannot {what}: {cause} (SQLite: {text}). {_OUTCOME}")


def os_user() -> str:
    """The name of this process's user, found by its uid (HOME, USER and LOGNAME may be unset or
    say anything); ``uid <n>`` for a uid without a name."""
    try:
        import pwd
    except ImportError:  # no uids (Windows): the login name
        import getpass

        return getpass.getuser()
    uid = os.getuid()
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:  # e.g. a container run with an arbitrary uid
        return f"uid {uid}"


@interruptible  # waiting: the transaction is not open yet
def _pause(seconds: float) -> None:
    time.sleep(seconds)
