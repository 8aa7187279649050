"""The ledger: budgets, charges, composition, persistence.

A :class:`Budget` is one *scope* (a named budget, e.g. one data set) inside an SQLite
file. The file lives outside the analysed DuckDB database, so no query can rewrite
it. Check-and-charge is a single ``BEGIN IMMEDIATE`` transaction: SQLite serialises
writers across processes, so concurrent charges can never overspend, and the commit
(WAL, ``synchronous=FULL``) is on disk before any noisy value is handed back. A process
that dies after the commit loses that budget; the ledger never under-counts.

Composition
-----------
* Sequential: the (epsilon, delta) of successive releases in a scope add up.
* Parallel: one release over disjoint partitions of one table is charged once, at the
  maximum over its partitions (the caller passes that maximum, see
  :func:`dpsql.publish.publish`).
* Arithmetic is exact: every charge is stored as the shortest decimal text of its
  float and summed with :class:`decimal.Decimal`, so ten charges of 0.1 fit exactly in
  a budget of 1.0 and rounding can never let a charge slip past the cap.

Notions
-------
A scope's privacy notion is fixed when it is created: ``"central"`` (central DP,
(epsilon, delta)), ``"ldp"`` (event-level local DP) or ``"w-event-ldp"`` (w-event local
DP, with its window ``w``). Releases under another notion are refused: the losses of
different notions do not compose by addition.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sqlite3
import threading
import time
import uuid
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

from dpsql import _validate
from dpsql.errors import BudgetExhausted, InvalidParameter, NonPrivateRelease, NotionMismatch

NOTIONS = ("central", "ldp", "w-event-ldp")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS scopes (
    scope    TEXT PRIMARY KEY,
    notion   TEXT NOT NULL,
    w        INTEGER,
    epsilon  TEXT NOT NULL,
    delta    TEXT NOT NULL,
    created  TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS charges (
    seq        INTEGER PRIMARY KEY AUTOINCREMENT,
    release_id TEXT NOT NULL UNIQUE,
    scope      TEXT NOT NULL REFERENCES scopes(scope),
    time       TEXT NOT NULL,
    method     TEXT NOT NULL,
    params     TEXT NOT NULL,
    epsilon    TEXT NOT NULL,
    delta      TEXT NOT NULL,
    rows       INTEGER NOT NULL,
    partitions INTEGER NOT NULL,
    neighbour  TEXT NOT NULL,
    private    INTEGER NOT NULL,
    note       TEXT
);
CREATE INDEX IF NOT EXISTS charges_scope ON charges(scope);
"""


def _exact(x: float) -> Decimal:
    return Decimal(repr(float(x)))


class Budget:
    """A privacy budget backed by a ledger. Create with :meth:`open` or :meth:`in_memory`.

    Examples
    --------
    >>> import dpsql
    >>> b = dpsql.Budget.in_memory(epsilon=1.0)
    >>> b.total, b.spent, b.remaining
    ((1.0, 0.0), (0.0, 0.0), (1.0, 0.0))
    """

    def __init__(self, *_args, **_kwargs):
        raise TypeError("use Budget.open(path, ...) or Budget.in_memory(...)")

    @classmethod
    def open(cls, path, *, scope: str = "default", epsilon: float | None = None, delta: float = 0.0,
             notion: str = "central", w: int | None = None) -> Budget:
        """Create or reopen the persistent ledger scope ``scope`` in the SQLite file ``path``.

        On creation ``epsilon`` is required. When the scope exists, ``epsilon`` / ``delta``
        / ``notion`` / ``w``, if given, must equal what it was created with: a budget can
        never be silently raised.
        """
        self = object.__new__(cls)
        self._path = str(Path(path))
        self._persistent = True
        self._init(scope, epsilon, delta, notion, w)
        return self

    @classmethod
    def in_memory(cls, *, epsilon: float, delta: float = 0.0, notion: str = "central",
                  w: int | None = None) -> Budget:
        """A throw-away ledger for notebooks and tests. It also accepts non-private
        (seeded) releases, recording them as such."""
        self = object.__new__(cls)
        self._path = f"file:dpsql-{uuid.uuid4().hex}?mode=memory&cache=shared"
        self._persistent = False
        self._init("default", epsilon, delta, notion, w)
        return self

    # -- connection handling -------------------------------------------------------

    def _init(self, scope, epsilon, delta, notion, w):
        if not isinstance(scope, str) or not scope:
            raise InvalidParameter(f"scope must be a non-empty string, got {scope!r}")
        self.scope = scope
        self._lock = threading.RLock()
        self._conn = None
        self._pid = None
        _validate.choice(notion, "notion", NOTIONS)
        if notion == "w-event-ldp":
            w = _validate.integer(w, "w", minimum=1)
        elif w is not None:
            raise InvalidParameter(f"w is only meaningful for notion 'w-event-ldp', got w={w!r}")
        conn = self._connection()
        with self._lock:
            conn.execute("BEGIN IMMEDIATE")
            try:
                row = conn.execute("SELECT notion, w, epsilon, delta FROM scopes WHERE scope = ?",
                                   (scope,)).fetchone()
                if row is None:
                    if epsilon is None:
                        raise InvalidParameter(f"scope {scope!r} does not exist yet: pass epsilon to create it")
                    eps = _validate.epsilon(epsilon)
                    dlt = _validate.delta(delta, pure=False, method="Budget")
                    conn.execute("INSERT INTO scopes VALUES (?, ?, ?, ?, ?, ?)",
                                 (scope, notion, w, repr(eps), repr(dlt), _now()))
                else:
                    self._check_reopen(row, epsilon, delta, notion, w)
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        self.notion, self.w = self._scope_row()[:2]

    def _check_reopen(self, row, epsilon, delta, notion, w):
        stored_notion, stored_w, stored_eps, stored_delta = row
        wanted = {"epsilon": (epsilon, stored_eps), "delta": (delta, stored_delta)}
        for name, (given, stored) in wanted.items():
            if given is not None and _exact(given) != Decimal(stored) and not (name == "delta" and given == 0.0):
                raise InvalidParameter(f"scope {self.scope!r} exists with {name}={stored}; "
                                       f"reopening with {name}={given!r} is refused (budgets are never raised)")
        if notion != stored_notion or (stored_w is not None and w is not None and w != stored_w):
            raise NotionMismatch(f"scope {self.scope!r} was created for notion {stored_notion!r}"
                                 f"{'' if stored_w is None else f' (w={stored_w})'}; asked for {notion!r}")

    def _connection(self) -> sqlite3.Connection:
        with self._lock:
            if self._conn is None or self._pid != os.getpid():
                conn = sqlite3.connect(self._path, uri=not self._persistent, timeout=60.0,
                                       isolation_level=None, check_same_thread=False)
                if self._persistent:
                    conn.execute("PRAGMA journal_mode=WAL")
                    conn.execute("PRAGMA synchronous=FULL")
                conn.executescript(_SCHEMA)
                self._conn, self._pid = conn, os.getpid()
            return self._conn

    def _scope_row(self):
        with self._lock:
            return self._connection().execute(
                "SELECT notion, w, epsilon, delta FROM scopes WHERE scope = ?", (self.scope,)).fetchone()

    def _spent_exact(self, conn) -> tuple[Decimal, Decimal]:
        eps, dlt = Decimal(0), Decimal(0)
        for e, d in conn.execute("SELECT epsilon, delta FROM charges WHERE scope = ?", (self.scope,)):
            eps += Decimal(e)
            dlt += Decimal(d)
        return eps, dlt

    # -- public view -----------------------------------------------------------------

    @property
    def persistent(self) -> bool:
        return self._persistent

    @property
    def total(self) -> tuple[float, float]:
        """(epsilon, delta) the scope was created with."""
        _, _, eps, dlt = self._scope_row()
        return float(eps), float(dlt)

    @property
    def spent(self) -> tuple[float, float]:
        """(epsilon, delta) charged so far, sequentially composed."""
        with self._lock:
            eps, dlt = self._spent_exact(self._connection())
        return float(eps), float(dlt)

    @property
    def remaining(self) -> tuple[float, float]:
        """total - spent, per component."""
        _, _, total_eps, total_delta = self._scope_row()
        with self._lock:
            eps, dlt = self._spent_exact(self._connection())
        return float(Decimal(total_eps) - eps), float(Decimal(total_delta) - dlt)

    def history(self):
        """One row per release: time, release_id, method, params (JSON), epsilon, delta,
        rows, partitions, neighbour relation, private flag and the caller's note."""
        import polars as pl

        with self._lock:
            rows = self._connection().execute(
                "SELECT time, release_id, method, params, epsilon, delta, rows, partitions, neighbour, "
                "private, note FROM charges WHERE scope = ? ORDER BY seq", (self.scope,)).fetchall()
        cols = ["time", "release_id", "method", "params", "epsilon", "delta", "rows", "partitions",
                "neighbour", "private", "note"]
        data = {c: [r[k] for r in rows] for k, c in enumerate(cols)}
        data["epsilon"] = [float(x) for x in data["epsilon"]]
        data["delta"] = [float(x) for x in data["delta"]]
        data["private"] = [bool(x) for x in data["private"]]
        schema = {"time": pl.String, "release_id": pl.String, "method": pl.String, "params": pl.String,
                  "epsilon": pl.Float64, "delta": pl.Float64, "rows": pl.Int64, "partitions": pl.Int64,
                  "neighbour": pl.String, "private": pl.Boolean, "note": pl.String}
        return pl.DataFrame(data, schema=schema).with_columns(
            pl.col("time").str.to_datetime(time_zone="UTC"))

    def __repr__(self) -> str:
        (te, td), (se, sd) = self.total, self.spent
        where = self._path if self._persistent else "in memory"
        return (f"Budget(scope={self.scope!r}, notion={self.notion!r}, epsilon {se:g}/{te:g} spent, "
                f"delta {sd:g}/{td:g} spent, {where})")

    # -- charging ----------------------------------------------------------------------

    def check(self, *, epsilon: float, delta: float, notion: str = "central", w: int | None = None,
              private: bool = True) -> None:
        """Raise exactly what :meth:`charge` would raise now, without charging."""
        self._refuse_incompatible(notion, w, private)
        _, _, total_eps, total_delta = self._scope_row()
        with self._lock:
            spent_eps, spent_delta = self._spent_exact(self._connection())
        self._refuse_overspend(Decimal(total_eps) - spent_eps, Decimal(total_delta) - spent_delta,
                               epsilon, delta)

    def charge(self, *, method: str, epsilon: float, delta: float, rows: int, partitions: int = 1,
               params: dict | None = None, neighbour: str, notion: str = "central", w: int | None = None,
               private: bool = True, note: str | None = None) -> str:
        """Atomically check the budget and record one release; return its release id.

        Called only by :func:`dpsql.publish.publish`, after the release is computed and
        before any of its values is returned. Raises :class:`BudgetExhausted`,
        :class:`NonPrivateRelease` or :class:`NotionMismatch` and records nothing.
        """
        self._refuse_incompatible(notion, w, private)
        release_id = uuid.uuid4().hex
        payload = json.dumps(params or {}, sort_keys=True, default=str)
        with self._lock:
            conn = self._connection()
            conn.execute("BEGIN IMMEDIATE")
            try:
                _, _, total_eps, total_delta = conn.execute(
                    "SELECT notion, w, epsilon, delta FROM scopes WHERE scope = ?", (self.scope,)).fetchone()
                spent_eps, spent_delta = self._spent_exact(conn)
                self._refuse_overspend(Decimal(total_eps) - spent_eps, Decimal(total_delta) - spent_delta,
                                       epsilon, delta)
                conn.execute("INSERT INTO charges (release_id, scope, time, method, params, epsilon, delta, rows, "
                             "partitions, neighbour, private, note) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                             (release_id, self.scope, _now(), method, payload, repr(float(epsilon)),
                              repr(float(delta)), int(rows), int(partitions), neighbour, int(private), note))
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        return release_id

    def _refuse_incompatible(self, notion, w, private):
        if self._persistent and not private:
            raise NonPrivateRelease("this release used seeded test noise (dpsql.testing.seeded) and is not "
                                    "private; a persistent ledger refuses it")
        if notion != self.notion or (self.notion == "w-event-ldp" and w != self.w):
            mine = self.notion + ("" if self.w is None else f" (w={self.w})")
            theirs = notion + ("" if w is None else f" (w={w})")
            raise NotionMismatch(f"budget scope {self.scope!r} accounts for {mine}; a {theirs} release "
                                 "cannot be composed with it")

    @staticmethod
    def _refuse_overspend(left_eps: Decimal, left_delta: Decimal, epsilon: float, delta: float):
        want_eps, want_delta = _exact(epsilon), _exact(delta)
        if want_eps > left_eps or want_delta > left_delta:
            raise BudgetExhausted(
                f"budget exhausted: remaining epsilon={float(left_eps):g}, delta={float(left_delta):g}; "
                f"requested epsilon={epsilon:g}, delta={delta:g}. Nothing was charged or released.",
                remaining=(float(left_eps), float(left_delta)), requested=(float(epsilon), float(delta)))


# Cached: a partitioned release asks the same question once per partition.
@functools.lru_cache(maxsize=1024)
def largest_share(total: float, share: float, *, count: int = 1, rest: float = 0.0) -> float:
    """The largest float ``x <= share`` with ``count * x + rest <= total`` in exact
    arithmetic, so that budget pieces never add up to more than ``total`` by rounding.

    >>> largest_share(0.3, 0.3 - 0.03, rest=0.03) + 0.03 <= 0.3
    True
    """
    def exact_sum(x):
        return count * Fraction(x) + Fraction(rest)

    while exact_sum(share) > Fraction(total):
        share = math.nextafter(share, -math.inf)
    return share


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + f".{int(time.time() * 1e6) % 1_000_000:06d}Z"
