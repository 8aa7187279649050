"""The PostgreSQL backend: one ledger for a team, shared by every analyst and machine.

``Budget.open("postgresql://user@host:port/db", scope=..., epsilon=...)`` (psycopg 3; install
``dpsql[postgres]``). The ledger's logic is :mod:`dpsql.ledger.store`'s, unchanged: a charge
locks its scope's row (``SELECT ... FOR UPDATE``) inside one transaction, so concurrent charges
from any number of clients are serialised per scope and can never overspend; a commit is
durable on the server before the release is returned. A client that dies mid-transaction
leaves the server to roll it back; a server that goes away fails the call with a
:class:`~dpsql.LedgerError` (nothing released), and the next call reconnects.

The connection string's password never appears in messages, ``history()`` or logs: the
ledger's location is the URL without it.
"""

from __future__ import annotations

import re

from dpsql.errors import LedgerError

try:
    # submodules named in full: an import interrupted earlier can leave them off the package
    import psycopg
    from psycopg import errors as pg_errors
    from psycopg.conninfo import conninfo_to_dict
    from psycopg.pq import TransactionStatus
except ImportError as missing:  # pragma: no cover - exercised only without the optional extra
    raise LedgerError("a postgresql:// ledger needs psycopg 3: pip install 'dpsql[postgres]'") from missing

#: Seconds a client waits to connect, and for another client's lock on a scope, before giving up.
CONNECT_TIMEOUT = 10
LOCK_TIMEOUT_MS = 60_000
# An advisory lock serialising the creation of a new ledger's tables (any fixed number works).
_CREATE_LOCK = 0x6470_7371_6C00


class PostgresBackend:
    errors = (psycopg.Error,)
    lock_row = " FOR UPDATE"
    persistent = True
    #: The principal is the database role, authenticated by the server: naming another is refused.
    names_principals = False

    def __init__(self, url: str):
        self._url = url
        self.location = redacted(url)
        problem = None
        try:
            self._password = conninfo_to_dict(url).get("password")
        except psycopg.Error as error:
            # psycopg quotes the whole URL, password included: raised outside this block, redacted,
            # so that neither the message nor the exception's context holds the password
            problem = str(error).strip().replace(url, self.location)
        if problem is not None:
            raise LedgerError(f"ledger {self.location}: not a valid PostgreSQL connection URL ({problem}). Nothing "
                              "was charged or released.")

    def connect(self):
        conn = psycopg.connect(self._url, autocommit=True, connect_timeout=CONNECT_TIMEOUT)
        conn.execute(f"SET lock_timeout = {LOCK_TIMEOUT_MS}")
        return conn

    def begin(self, conn) -> None:
        conn.execute("BEGIN")

    def commit(self, conn) -> None:
        conn.execute("COMMIT")

    def rollback(self, conn) -> None:
        if not conn.closed and conn.info.transaction_status != TransactionStatus.IDLE:
            conn.execute("ROLLBACK")

    def execute(self, conn, sql: str, params=()):
        return conn.execute(sql.replace("?", "%s"), params)

    def ddl(self, statement: str) -> str:
        return statement.format(blob="BYTEA", serial="BIGSERIAL PRIMARY KEY", bigint="BIGINT")

    def blob(self, data: bytes):
        return bytes(data)

    def broken(self, conn) -> bool:
        """Is the connection lost (the server went away)? Then it is dropped and the next call reconnects."""
        return conn.closed or conn.broken

    def prepare(self, conn) -> None:
        """Serialise the creation of a new ledger's tables between clients."""
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_CREATE_LOCK,))

    def principal(self, conn) -> str:
        """Who uses the ledger: the database role this connection acts as (``current_user``)."""
        return conn.execute("SELECT current_user").fetchone()[0]

    def secure(self, conn) -> None:
        """Let each role see only its own stored answers (they hold release keys), table owner included:
        row-level security on ``answers``. Answers stored before principals were kept (NULL) are nobody's."""
        conn.execute("ALTER TABLE answers ENABLE ROW LEVEL SECURITY")
        conn.execute("ALTER TABLE answers FORCE ROW LEVEL SECURITY")
        conn.execute("DROP POLICY IF EXISTS answers_of_their_principal ON answers")
        conn.execute("CREATE POLICY answers_of_their_principal ON answers "
                     "USING (principal = current_user) WITH CHECK (principal = current_user)")

    def columns(self, conn) -> dict[str, set[str]]:
        rows = conn.execute("SELECT table_name, column_name FROM information_schema.columns "
                            "WHERE table_schema = current_schema()").fetchall()
        found: dict[str, set[str]] = {}
        for table, column in rows:
            found.setdefault(table, set()).add(column)
        return found

    def failure(self, error: Exception, what: str, *, committing: bool = False) -> LedgerError:
        if isinstance(error, pg_errors.DiskFull):
            cause = "the server's disk is full"
        elif isinstance(error, pg_errors.ReadOnlySqlTransaction):
            cause = "the server accepts only reads (a read-only standby or database)"
        elif isinstance(error, pg_errors.LockNotAvailable):
            cause = f"another client held the ledger's lock for more than {LOCK_TIMEOUT_MS / 1000:g} s"
        elif isinstance(error, pg_errors.InsufficientPrivilege):
            cause = "this user may not write the ledger's tables"
        elif isinstance(error, psycopg.OperationalError):
            cause = "the server cannot be reached or went away"
        else:
            cause = "the server refused the statement"
        text = str(error).strip()
        if self._password:
            text = text.replace(self._password, "***")
        # A connection lost while committing may have lost only the server's acknowledgement.
        outcome = ("Nothing was released; the charge may have been recorded (the connection was lost while "
                   "committing), so check history() before retrying." if committing else
                   "Nothing was charged or released.")
        return LedgerError(f"ledger {self.location}: cannot {what}: {cause} (PostgreSQL: {text}). {outcome}")


def redacted(url: str) -> str:
    """``url`` without its password.

    >>> redacted("postgresql://ana:s3cret@db.example:5432/ledger?sslmode=require")
    'postgresql://ana@db.example:5432/ledger?sslmode=require'
    >>> redacted("postgresql://db.example/ledger?user=ana&password=s3cret")
    'postgresql://db.example/ledger?user=ana&password=***'
    """
    url = re.sub(r"^(postgres(?:ql)?://[^:@/]*):[^@/]*@", r"\1@", url)
    return re.sub(r"([?&]password=)[^&]*", r"\1***", url)
