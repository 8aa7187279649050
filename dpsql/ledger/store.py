"""The ledger's logic, written once: scopes, charges with running totals, release records,
row handles and the answer cache. A backend (:mod:`dpsql.ledger.sqlite`,
:mod:`dpsql.ledger.postgres`) only connects, opens transactions and names its failures.

Every write is one transaction, opened with the backend's write lock (SQLite ``BEGIN
IMMEDIATE``; PostgreSQL a row lock on the scope) and committed durably before anything it
paid for leaves the library. Whatever fails, the transaction is rolled back and the ledger is
as before. Ctrl-C (any signal a Python handler turns into an exception) is held back only while
a transaction is opened, committed or rolled back (:mod:`dpsql.ledger.interrupts`), and handled
right after: it can never leave a transaction open, a lock held or a statement half read, while
the work inside a transaction (an append's computation) is interrupted at once and rolled back.
A process killed outright (kill -9) leaves it to the backend's own atomicity: committed or absent.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from fractions import Fraction

from dpsql.accounting import Charge, Notion, exact, fraction_text, parse_fraction
from dpsql.errors import BudgetExhausted, InvalidParameter, LedgerError, NotionMismatch, UnknownRelease
from dpsql.ledger import interrupts, schema
from dpsql.ledger.interrupts import critical, interruptible

#: Row handles start at a random multiple of 2**32 in [2**61, 2**62): handles of another
#: ledger are then almost surely unknown here, and 2**62 handles remain to allocate.
_HANDLE_ORIGIN_BITS = 29
# Connections a forked child inherited: never used again, and kept so that collecting them
# never closes the parent's database handles from the child.
_ABANDONED: list = []


@dataclass(frozen=True)
class ScopeState:
    """A scope's budget and what has been spent of it, exactly."""

    scope: str
    notion: Notion
    w: int | None
    epsilon: Fraction
    delta: Fraction
    spent_epsilon: Fraction
    spent_delta: Fraction
    created: str
    charges: int

    @property
    def remaining(self) -> tuple[Fraction, Fraction]:
        return self.epsilon - self.spent_epsilon, self.delta - self.spent_delta


@dataclass(frozen=True)
class Receipt:
    """What a charge returns: the release's id and the first of its row handles."""

    release_id: str
    first_handle: int


@dataclass(frozen=True)
class CachedAnswer:
    """What the answer cache keeps of a release so that an identical repeat by the same principal
    gets it again: the fingerprint of the request (principal included), whether the release is
    private, its secret key, which recomputes its values from the same data (a secret: never
    shown), and the digest of its values, which checks the recomputation."""

    fingerprint: str
    private: bool
    key: bytes = field(repr=False)
    digest: bytes


@dataclass(frozen=True)
class ReleaseRow:
    release_id: str
    scope: str
    first_handle: int
    handles: int
    description: bytes


class Ledger:
    """One ledger (an SQLite file, a PostgreSQL database, or memory), used by the
    :class:`~dpsql.Budget` of each of its scopes. Thread-safe; a forked child opens its own
    connection (an in-memory ledger refuses: its copy would double the budget)."""

    def __init__(self, backend):
        self.backend = backend
        self.location = backend.location
        self._lock = threading.RLock()
        self._depth = 0  # blocks open in the thread holding the lock
        # the cursors of the blocks open (weak: no callback, whose interrupt Python would swallow)
        self._cursors: list[weakref.ref] = []
        self._conn = None
        self._pid = os.getpid()
        self._created_in = os.getpid()
        with self.reading("open the ledger") as conn:
            ready = self._current(conn)
            #: Who charges through this object: the backend's principal (the OS user, the database role).
            self.principal: str = self.backend.principal(conn)
        if not ready:
            with self.transaction("create the ledger's tables") as conn:
                self._prepare(conn)

    # -- connections and transactions --------------------------------------------------------

    @interruptible  # opening may wait for a server: an interrupt ends it, and the block that asked cleans up
    def _connection(self):
        if os.getpid() != self._pid or self._conn is None:
            if os.getpid() != self._created_in and not self.backend.persistent:
                raise LedgerError(f"this in-memory ledger belongs to process {self._created_in}; a forked child "
                                  "cannot use it (its copy would spend the same budget twice): share a budget "
                                  "between processes with a persistent ledger (dpsql.Budget.open)")
            if self._conn is not None:
                _ABANDONED.append(self._conn)
                self._cursors = []  # the parent's: never closed from here
            self._conn = None
            self._conn = self._typed(self.backend.connect, "open the ledger")
            self._pid = os.getpid()
        return self._conn

    def _typed(self, action, what: str):
        try:
            return action()
        except self.backend.errors as error:
            raise self.backend.failure(error, what) from error

    def transaction(self, what: str, *, opened=None) -> _Block:
        """A write transaction, ``with ledger.transaction(what) as conn``: committed when the
        block ends, rolled back (and every backend failure raised as :class:`LedgerError`
        naming ``what``) if it raises. ``opened(conn)``, if given, runs once the transaction is
        open, and what it returns is what the ``with`` statement gets."""
        return _Block(self, what, writes=True, opened=opened)

    def reading(self, what: str) -> _Block:
        """A block of reads, ``with ledger.reading(what) as conn``."""
        return _Block(self, what, writes=False)

    def _roll_back(self, conn) -> None:
        """End whatever transaction ``conn`` is in. A connection that cannot (lost, or left
        mid-statement by an interrupt) is closed, which ends it too, and replaced next time."""
        with contextlib.suppress(*self.backend.errors):
            if not self.backend.broken(conn):
                self.backend.rollback(conn)
                return
        with contextlib.suppress(*self.backend.errors):
            conn.close()
        if self._conn is conn:
            self._conn = None

    def execute(self, conn, sql: str, params=()):
        """Run ``sql`` on a cursor that the block closes when it ends, whatever interrupts
        reading it: an SQLite statement left unfinished keeps its snapshot, and then this
        connection's next write fails as locked."""
        cursor = conn.cursor()
        self._cursors.append(weakref.ref(cursor))
        return self.backend.execute(cursor, sql, params)

    def _current(self, conn) -> bool:
        """Does the ledger already have this version's tables and columns (so opening writes nothing)?"""
        columns = self.backend.columns(conn)
        if "ledger_meta" not in columns:
            return False
        row = self.execute(conn, "SELECT value FROM ledger_meta WHERE key = 'version'").fetchone()
        if row is not None and int(row[0]) > schema.VERSION:
            raise LedgerError(f"ledger {self.location} has table layout version {row[0]}, newer than this "
                              f"dpsql understands ({schema.VERSION}): upgrade dpsql")
        return row is not None and int(row[0]) == schema.VERSION and not schema.upgrades(columns)

    def _prepare(self, conn) -> None:
        self.backend.prepare(conn)
        existing = self.backend.columns(conn)
        for statement in schema.upgrades(existing):
            self.execute(conn, self.backend.ddl(statement))
        for statement in schema.TABLES:
            self.execute(conn, self.backend.ddl(statement))
        self.backend.secure(conn)
        meta = dict(self.execute(conn, "SELECT key, value FROM ledger_meta").fetchall())
        if "version" not in meta:
            origin = (secrets.randbits(_HANDLE_ORIGIN_BITS) + (1 << _HANDLE_ORIGIN_BITS)) << 32
            for key, value in {"version": schema.VERSION, "id": str(uuid.uuid4()), "next_handle": origin}.items():
                self.execute(conn, "INSERT INTO ledger_meta (key, value) VALUES (?, ?)", (key, str(value)))
            if "charges" in existing:  # a version-1 ledger: running totals from its history
                for (scope,) in self.execute(conn, "SELECT scope FROM scopes").fetchall():
                    self._recount(conn, scope)
        elif int(meta["version"]) < schema.VERSION:  # its columns added above; the version keeps out older dpsql
            self.execute(conn, "UPDATE ledger_meta SET value = ? WHERE key = 'version'", (str(schema.VERSION),))

    def _recount(self, conn, scope: str) -> None:
        rows = self.execute(conn, "SELECT epsilon, delta FROM charges WHERE scope = ?", (scope,)).fetchall()
        spent_eps = sum((exact(e) for e, _ in rows), Fraction(0))
        spent_delta = sum((exact(d) for _, d in rows), Fraction(0))
        self.execute(conn, "UPDATE scopes SET spent_epsilon = ?, spent_delta = ?, charges = ? WHERE scope = ?",
                     (fraction_text(spent_eps), fraction_text(spent_delta), len(rows), scope))

    # -- scopes --------------------------------------------------------------------------

    def open_scope(self, scope: str, *, epsilon: float | None, delta: float, notion: Notion,
                   w: int | None) -> ScopeState:
        """Create scope ``scope`` (``epsilon`` required then) or check that the given budget
        equals the one it was created with: a budget is never raised silently."""
        with self.reading(f"open scope {scope!r}") as conn:
            state = self._scope(conn, scope, lock=False)
        if state is None:
            state = self._create_scope(scope, epsilon=epsilon, delta=delta, notion=notion, w=w)
        for name, given, stored in (("epsilon", epsilon, state.epsilon), ("delta", delta, state.delta)):
            if given is not None and exact(given) != stored and not (name == "delta" and given == 0.0):
                raise InvalidParameter(f"scope {scope!r} exists with {name}={float(stored)!r}; reopening with "
                                       f"{name}={given!r} is refused (budgets are never raised)")
        if notion != state.notion or (state.w is not None and w is not None and w != state.w):
            raise NotionMismatch(f"scope {scope!r} was created for notion {state.notion.value!r}"
                                 f"{'' if state.w is None else f' (w={state.w})'}; asked for {notion.value!r}")
        return state

    def _create_scope(self, scope: str, *, epsilon, delta, notion: Notion, w) -> ScopeState:
        with self.transaction(f"create scope {scope!r}") as conn:
            state = self._scope(conn, scope, lock=True)
            if state is not None:  # another process created it meanwhile
                return state
            if epsilon is None:
                raise InvalidParameter(f"scope {scope!r} does not exist yet in ledger {self.location}: pass "
                                       "epsilon to create it")
            self.execute(conn, "INSERT INTO scopes (scope, notion, w, epsilon, delta, created) "
                               "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (scope) DO NOTHING",
                         (scope, notion.value, w, repr(float(epsilon)), repr(float(delta)), _now()))
            return self._scope(conn, scope, lock=False)

    def scope(self, scope: str) -> ScopeState:
        with self.reading(f"read scope {scope!r}") as conn:
            state = self._scope(conn, scope, lock=False)
        if state is None:
            raise InvalidParameter(f"scope {scope!r} does not exist in ledger {self.location}")
        return state

    def scopes(self) -> list[ScopeState]:
        with self.reading("list the scopes") as conn:
            names = [row[0] for row in self.execute(conn, "SELECT scope FROM scopes ORDER BY scope").fetchall()]
            return [self._scope(conn, name, lock=False) for name in names]

    def _scope(self, conn, scope: str, *, lock: bool) -> ScopeState | None:
        row = self.execute(conn, "SELECT notion, w, epsilon, delta, spent_epsilon, spent_delta, created, charges "
                                 "FROM scopes WHERE scope = ?" + (self.backend.lock_row if lock else ""),
                           (scope,)).fetchone()
        if row is None:
            return None
        notion, w, eps, delta, spent_eps, spent_delta, created, charges = row
        return ScopeState(scope, Notion(notion), w, exact(eps), exact(delta), parse_fraction(spent_eps),
                          parse_fraction(spent_delta), created, charges)

    # -- charging: the one path ------------------------------------------------------------

    def charge(self, scope: str, charge: Charge, *, principal: str, handles: int = 0,
               description: bytes | None = None, answer: CachedAnswer | None = None, then=None) -> Receipt:
        """Check and charge ``charge`` to ``scope`` in one transaction, recording the release
        (made by ``principal``): its description (with ``handles`` row handles allocated to it)
        and, for an identical repeat by the same principal later, its ``answer``.
        ``then(conn, receipt)`` runs inside the same transaction (a stream's registration).
        Raises :class:`BudgetExhausted` and records nothing when the budget cannot pay."""
        want_eps, want_delta = exact(charge.epsilon), exact(charge.delta)
        with self.transaction(f"charge scope {scope!r}") as conn:
            state = self._scope(conn, scope, lock=True)
            if state is None:
                raise InvalidParameter(f"scope {scope!r} does not exist in ledger {self.location}")
            refuse_overspend(state, want_eps, want_delta, charge)
            release_id = str(uuid.uuid4())
            first_handle = self.allocate_handles(conn, handles)
            self._insert_charge(conn, scope, release_id, charge, charge.epsilon, charge.delta, principal)
            self.execute(conn, "UPDATE scopes SET spent_epsilon = ?, spent_delta = ?, charges = charges + 1 "
                               "WHERE scope = ?",
                         (fraction_text(state.spent_epsilon + want_eps), fraction_text(state.spent_delta + want_delta),
                          scope))
            if description is not None:
                self.execute(conn, "INSERT INTO releases (release_id, scope, first_handle, handles, description) "
                                   "VALUES (?, ?, ?, ?, ?)",
                             (release_id, scope, first_handle, handles, self.backend.blob(description)))
            if answer is not None:
                self.execute(conn, "INSERT INTO answers (fingerprint, scope, release_id, created, answer, principal, "
                                   "private, secret) VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (fingerprint) DO "
                                   "UPDATE SET release_id = excluded.release_id, created = excluded.created, "
                                   "answer = excluded.answer, principal = excluded.principal, "
                                   "private = excluded.private, secret = excluded.secret",
                             (answer.fingerprint, scope, release_id, _now(), self.backend.blob(answer.digest),
                              principal, int(answer.private), self.backend.blob(answer.key)))
            receipt = Receipt(release_id, first_handle)
            if then is not None:
                then(conn, receipt)
            return receipt

    def _insert_charge(self, conn, scope: str, release_id: str, charge: Charge, epsilon: float, delta: float,
                       principal: str, answers: str | None = None) -> None:
        self.execute(conn, "INSERT INTO charges (release_id, scope, time, method, params, epsilon, delta, rows, "
                           "partitions, neighbour, private, note, kind, stream, answers, principal, source) "
                           "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                     (release_id, scope, _now(), charge.method, json.dumps(charge.params, sort_keys=True, default=str),
                      repr(float(epsilon)), repr(float(delta)), int(charge.rows), int(charge.partitions),
                      charge.neighbour.value, int(charge.private), charge.note, charge.kind.value, charge.stream,
                      answers, principal, charge.source))

    def allocate_handles(self, conn, count: int) -> int:
        """Reserve ``count`` consecutive row handles (inside a write transaction); the first."""
        first = int(self.execute(conn, "SELECT value FROM ledger_meta WHERE key = 'next_handle'"
                                 + self.backend.lock_row).fetchone()[0])
        if count:
            self.execute(conn, "UPDATE ledger_meta SET value = ? WHERE key = 'next_handle'", (str(first + count),))
        return first

    def record_hit(self, scope: str, charge: Charge, release_id: str, *, principal: str) -> None:
        """Record that ``principal``'s identical repeat of ``release_id`` was answered from the ledger (free)."""
        with self.transaction(f"record a cache hit in scope {scope!r}") as conn:
            self._insert_charge(conn, scope, str(uuid.uuid4()), charge, 0.0, 0.0, principal, answers=release_id)

    # -- reading --------------------------------------------------------------------------

    def history(self, scope: str) -> list[tuple]:
        with self.reading(f"read the history of scope {scope!r}") as conn:
            return self.execute(conn, "SELECT time, kind, release_id, method, params, epsilon, delta, rows, "
                                      "partitions, neighbour, private, note, stream, answers, principal, source "
                                      "FROM charges "
                                      "WHERE scope = ? ORDER BY seq", (scope,)).fetchall()

    def release(self, release_id: str) -> ReleaseRow:
        with self.reading(f"read release {release_id!r}") as conn:
            row = self.execute(conn, "SELECT release_id, scope, first_handle, handles, description FROM releases "
                                     "WHERE release_id = ?", (str(release_id),)).fetchone()
        if row is None:
            raise UnknownRelease(f"release {release_id!r} is not recorded in ledger {self.location}")
        return ReleaseRow(row[0], row[1], int(row[2]), int(row[3]), bytes(row[4]))

    def release_at(self, handle: int) -> ReleaseRow | None:
        """The release whose row handles include ``handle``, or None."""
        if not 0 <= handle < 2**63:  # handles are 64-bit integers in every backend
            return None
        with self.reading("resolve a row handle") as conn:
            row = self.execute(conn, "SELECT release_id, scope, first_handle, handles, description FROM releases "
                                     "WHERE first_handle <= ? ORDER BY first_handle DESC LIMIT 1",
                               (int(handle),)).fetchone()
        if row is None or not int(row[2]) <= handle < int(row[2]) + int(row[3]):
            return None
        return ReleaseRow(row[0], row[1], int(row[2]), int(row[3]), bytes(row[4]))

    def answer(self, scope: str, fingerprint: str, *, principal: str, private: bool) -> tuple[str, CachedAnswer] | None:
        """What answers ``principal``'s identical repeat (``private`` or seeded, as the release was)
        of an earlier release in ``scope``: (release id, answer). Another principal's answer, one of
        the other kind and one stored before answers had principals are never found."""
        with self.reading("look up a stored answer") as conn:
            row = self.execute(conn, "SELECT release_id, secret, answer FROM answers WHERE fingerprint = ? AND "
                                     "scope = ? AND principal = ? AND private = ?",
                               (fingerprint, scope, principal, int(private))).fetchone()
        return None if row is None else (row[0], CachedAnswer(fingerprint, private, bytes(row[1]), bytes(row[2])))

    def clear_answers(self, scope: str, *, principal: str) -> int:
        """Forget ``principal``'s stored answers in ``scope``, and those stored before answers had
        principals (which answer no one); how many."""
        with self.transaction(f"clear the stored answers of scope {scope!r}") as conn:
            return self.execute(conn, "DELETE FROM answers WHERE scope = ? AND (principal = ? OR principal IS NULL)",
                                (scope, principal)).rowcount

    def close(self) -> None:
        with self._lock:
            if self._conn is not None and os.getpid() == self._pid:
                self._conn.close()
            self._conn = None


def refuse_overspend(state: ScopeState, epsilon: Fraction, delta: Fraction, charge: Charge) -> None:
    """Raise :class:`BudgetExhausted` unless ``state``'s remaining budget pays (epsilon, delta)."""
    left_eps, left_delta = state.remaining
    if epsilon <= left_eps and delta <= left_delta:
        return
    if delta > 0 and state.delta == 0:
        raise BudgetExhausted(
            f"method {charge.method!r} costs delta={float(delta):g} > 0, but scope {state.scope!r} was created with "
            "delta=0: open a scope with a delta budget (Budget.open(..., delta=...)) for (epsilon, delta) methods. "
            "Nothing was charged or released.",
            remaining=(float(left_eps), float(left_delta)), requested=(float(epsilon), float(delta)))
    raise BudgetExhausted(
        f"budget exhausted in scope {state.scope!r}: remaining epsilon={float(left_eps):g}, "
        f"delta={float(left_delta):g}; requested epsilon={float(epsilon):g}, delta={float(delta):g}. "
        "Nothing was charged or released.",
        remaining=(float(left_eps), float(left_delta)), requested=(float(epsilon), float(delta)))


class _Block:
    """One block of work on a ledger's connection (:meth:`Ledger.transaction`,
    :meth:`Ledger.reading`), holding the ledger's thread lock.

    Opening it and ending it are critical (:mod:`dpsql.ledger.interrupts`): a signal arriving
    then is handled once the transaction is open (and if its handler raises, the block ends at
    once), or once it is committed or rolled back, its cursors closed and the lock released. The
    body between is interrupted at once, and its interrupt ends the block like any exception."""

    def __init__(self, ledger: Ledger, what: str, *, writes: bool, opened=None):
        self.ledger, self.what, self.writes, self.opened = ledger, what, writes, opened
        self.held = self.began = False
        self.conn = None

    @critical
    def __enter__(self):
        self.held = interrupts.hold()
        self.ledger._lock.acquire()
        self.ledger._depth += 1
        try:
            self.conn = self.ledger._connection()
            if self.writes:
                self.ledger.backend.begin(self.conn)
                self.began = True
            entered = self.conn if self.opened is None else _interruptibly(self.opened, self.conn)
            interrupts.deliver()
        except BaseException as error:
            self._finish(error)
            raise
        return entered

    @critical
    def __exit__(self, kind, error, traceback) -> None:
        self._finish(error)

    def _finish(self, error: BaseException | None) -> None:
        """End the block after ``error`` (None: the body completed): commit or roll back, close
        its cursors, release the lock and the signals held back; raise what replaces ``error``
        (a :class:`LedgerError` for a backend failure), if anything."""
        ledger = self.ledger
        try:
            failure = self._end(error)
        finally:
            ledger._depth -= 1
            ledger._lock.release()
            interrupts.release(self.held)
        if failure is not None:
            raise failure

    def _end(self, error: BaseException | None) -> BaseException | None:
        """Close the cursors (an outermost block), commit or roll back; what :meth:`_finish` raises."""
        ledger, backend = self.ledger, self.ledger.backend
        outermost = ledger._depth == 1
        if outermost:
            cursors, ledger._cursors = ledger._cursors, []
            for cursor in filter(None, (ref() for ref in cursors)):
                with contextlib.suppress(*backend.errors):
                    cursor.close()
        failure, committing = error, error is None and self.writes
        if committing:
            try:
                backend.commit(self.conn)
            except BaseException as failed:
                failure = failed
        if failure is not None and self.conn is not None and (self.began or outermost):
            ledger._roll_back(self.conn)  # an inner block leaves the transaction to the block that began it
        if isinstance(failure, backend.errors):
            typed = backend.failure(failure, self.what, committing=committing)
            typed.__cause__ = failure
            return typed
        return None if failure is error else failure


@interruptible  # the body of opening (a wait for a stream's lock): the block cleans up after an interrupt
def _interruptibly(action, *args):
    return action(*args)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + f".{int(time.time() * 1e6) % 1_000_000:06d}Z"
