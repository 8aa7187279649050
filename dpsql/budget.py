"""A privacy budget: one scope of a ledger, charged by every private release.

A :class:`Budget` is a named scope (e.g. one data set) in a ledger: an SQLite file outside
the analysed database (the default), a PostgreSQL database shared by a team
(``postgresql://...``), or memory. Check-and-charge is one transaction; the charge is durable
before any noisy value is returned; concurrent processes cannot overspend; a refused or
failed call charges nothing. Sequential releases add up, exactly (see
:mod:`dpsql.accounting`); one release over disjoint partitions costs the maximum over them.

A scope's privacy notion is fixed when it is created: ``"central"`` (central DP, (epsilon,
delta)), ``"ldp"`` (event-level local DP) or ``"w-event-ldp"`` (w-event local DP, with its
window ``w``). Releases under another notion are refused: the losses of different notions
do not compose by addition.

The ledger file holds secrets besides the public record: the keys and open state of
continual streams (raw rows still pending, partial sums) and the keys of cached answers. Keep
it as safe as the raw data; only released rows may leave it.

Identical repeats are answered from the ledger, free, but only to the *principal* who made the
release: on PostgreSQL the database role (``current_user``), elsewhere the operating system's
user, or the name given with ``Budget.open(..., principal=...)`` when several people share one
SQLite file. Another principal's identical call is a fresh, charged release: a free answer would
tell them that their guess of someone else's data is right.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from dpsql import _current, _state, _validate
from dpsql.accounting import Charge, Kind, Neighbour, Notion, exact
from dpsql.continual import Stream, open_stream
from dpsql.errors import InvalidParameter, NonPrivateRelease, NotionMismatch, UnknownRelease
from dpsql.ledger import CachedAnswer, Ledger, Receipt, memory_ledger, open_ledger
from dpsql.ledger.store import refuse_overspend
from dpsql.ledger.streams import StreamStore
from dpsql.records import ReleaseRecord


class Budget:
    """A privacy budget backed by a ledger. Create with :meth:`open` or :meth:`in_memory`.

    Examples
    --------
    >>> import dpsql
    >>> b = dpsql.Budget.in_memory(epsilon=1.0)
    >>> b.total, b.spent, b.remaining
    ((1.0, 0.0), (0.0, 0.0), (1.0, 0.0))
    """

    _ledger: Ledger
    #: The scope's name in its ledger.
    scope: str
    #: The scope's privacy notion, and its window for w-event LDP.
    notion: Notion
    w: int | None
    #: Whether identical repeats are answered from stored answers.
    caches: bool
    #: Who charges this budget: only their own identical repeats are answered from the ledger.
    principal: str

    def __init__(self, *_args, **_kwargs):
        raise TypeError("use Budget.open(path, ...) or Budget.in_memory(...)")

    @classmethod
    def open(cls, location: str | Path, *, scope: str = "default", epsilon: float | None = None,
             delta: float = 0.0, notion: str = "central", w: int | None = None, cache: bool = True,
             principal: str | None = None) -> Budget:
        """Create or reopen scope ``scope`` of the ledger at ``location`` (an SQLite file path,
        or a ``postgresql://user@host:port/db`` URL).

        On creation ``epsilon`` is required. When the scope exists, ``epsilon`` / ``delta`` /
        ``notion`` / ``w``, if given, must equal what it was created with: a budget can never be
        silently raised. ``cache=False`` stores no answers (identical repeats are then charged).

        ``principal``: who charges through this budget, recorded with each charge; identical
        repeats are answered free only to the principal who made the release. Default: the
        database role on PostgreSQL (which refuses any other name: the server authenticates it),
        the operating system's user on SQLite. Name one when several people share one SQLite
        file (each can read the whole file, so there the name is their agreement, not a lock).
        """
        return cls._make(open_ledger(location), scope, epsilon, delta, notion, w, cache, principal)

    @classmethod
    def in_memory(cls, *, epsilon: float, delta: float = 0.0, notion: str = "central",
                  w: int | None = None, cache: bool = True) -> Budget:
        """A throw-away ledger for notebooks and tests, in this process only (a forked child
        refuses to use it). It also accepts non-private (seeded) releases, recording them as such."""
        return cls._make(memory_ledger(), "default", epsilon, delta, notion, w, cache, None)

    @classmethod
    def _make(cls, ledger: Ledger, scope, epsilon, delta, notion, w, cache, principal) -> Budget:
        if not isinstance(scope, str) or not scope:
            raise InvalidParameter(f"scope must be a non-empty string, got {scope!r}")
        notion = Notion(_validate.choice(notion, "notion", [n.value for n in Notion]))
        if notion is Notion.W_EVENT_LDP:
            w = _validate.integer(w, "w", minimum=1)
        elif w is not None:
            raise InvalidParameter(f"w is only meaningful for notion 'w-event-ldp', got w={w!r}")
        if epsilon is not None:  # a budget's total, not a release's cost: any finite positive amount
            epsilon = _validate.real(epsilon, "epsilon", minimum=0.0, strict=True)
        delta = _validate.delta(delta, pure=False, method="Budget")
        principal = _principal(ledger, principal)
        state = ledger.open_scope(scope, epsilon=epsilon, delta=delta, notion=notion, w=w)
        self = object.__new__(cls)
        self._ledger = ledger
        self.scope = scope
        self.notion = state.notion
        self.w = state.w
        self.caches = bool(cache)
        self.principal = principal
        return self

    # -- public view -------------------------------------------------------------------

    @property
    def ledger(self) -> Ledger:
        return self._ledger

    @property
    def persistent(self) -> bool:
        return self._ledger.backend.persistent

    @property
    def location(self) -> str:
        """The ledger's file, server (without password) or ``"in memory"``."""
        return self._ledger.location

    @property
    def total(self) -> tuple[float, float]:
        """(epsilon, delta) the scope was created with."""
        state = self._ledger.scope(self.scope)
        return float(state.epsilon), float(state.delta)

    @property
    def spent(self) -> tuple[float, float]:
        """(epsilon, delta) charged so far, sequentially composed (read from the running total)."""
        state = self._ledger.scope(self.scope)
        return float(state.spent_epsilon), float(state.spent_delta)

    @property
    def remaining(self) -> tuple[float, float]:
        """total - spent, per component."""
        left_eps, left_delta = self._ledger.scope(self.scope).remaining
        return float(left_eps), float(left_delta)

    def history(self, *, full: bool = False):
        """One row per charge and per identical repeat answered from the ledger (``kind``:
        ``release``, ``stream`` or ``cache hit``, which costs 0), oldest first, as a Polars
        DataFrame: time, kind, method, epsilon, delta, rows, source (what the release read: ``table
        hourly (ts, volume)``, ``column volume, order_by ts``, ``array of 48204 values``), note (the
        caller's ``note=``); ``full=True`` adds release_id, params (JSON), partitions, neighbour,
        private, stream, for a cache hit the release it answered with, and the principal who
        charged (or was answered)."""
        import polars as pl

        rows = self._ledger.history(self.scope)
        names = ["time", "kind", "release_id", "method", "params", "epsilon", "delta", "rows", "partitions",
                 "neighbour", "private", "note", "stream", "answers", "principal", "source"]
        data = {name: [row[k] for row in rows] for k, name in enumerate(names)}
        data["epsilon"] = [float(x) for x in data["epsilon"]]
        data["delta"] = [float(x) for x in data["delta"]]
        data["private"] = [bool(x) for x in data["private"]]
        schema = {name: pl.String for name in names} | {"epsilon": pl.Float64, "delta": pl.Float64,
                                                        "rows": pl.Int64, "partitions": pl.Int64,
                                                        "private": pl.Boolean}
        frame = pl.DataFrame(data, schema=schema).with_columns(pl.col("time").str.to_datetime(time_zone="UTC"))
        if full:
            return frame
        return frame.select("time", "kind", "method", "epsilon", "delta", "rows", "source", "note")

    def release(self, release_id: str | None = None, *, dp_row: int | None = None) -> ReleaseRecord:
        """What the ledger recorded of release ``release_id`` (or of the release that holds the
        row handle ``dp_row``, from a released SQL table or Polars column): its public
        description and error model, no values. ``record.with_values(values)`` (or
        :meth:`dpsql.Release.from_arrow`) joins them with the released values."""
        if (release_id is None) == (dp_row is None):
            raise InvalidParameter("give a release_id or a dp_row handle")
        if release_id is None:  # so dp_row is given
            row = self._ledger.release_at(_validate.integer(dp_row, "dp_row", minimum=0))
            if row is None or "stream" in _state.unpack(row.description):
                raise UnknownRelease(f"dp_row {dp_row} is not a row of a one-shot release in ledger {self.location} "
                                     "(rows of a continual stream: budget.stream(name))")
            release_id = row.release_id
        record = ReleaseRecord.from_row(self._ledger.release(str(release_id)))
        if record.scope != self.scope:
            raise InvalidParameter(f"release {release_id} belongs to scope {record.scope!r}, not {self.scope!r}")
        return record

    def stream(self, name: str, *, method: str | None = None, epsilon: float | None = None,
               order_by: str | None = None, value: str | None = None, partition_by=None, delta: float = 0.0,
               max_delay=None, **params) -> Stream:
        """Register the continual stream ``name`` in this scope, charging its whole cost once, or
        reopen it (from any process, free).

        The first call needs ``method`` (any per-row method with an online form: ``tops``,
        ``hierarchy``, ``pak``, ``binary_tree``, ``laplace``; or a count stream, ``pegasus`` or
        ``count_laplace``), ``epsilon``, ``order_by`` (the public time key) and ``value`` (the
        private column; for a count stream, ``every`` and ``start``: the public bucket grid of
        the time column ``order_by``), plus the method's parameters. A later call with the
        same name may repeat them (each must equal what is stored, else
        :class:`~dpsql.InvalidParameter` naming it) or pass none. Parameters that a one-shot
        release derives from the table's length have fixed defaults here (a stream's length is
        unknown); PAK needs ``delta``. ``threshold=`` (a threshold released and charged before)
        skips ToPS's or PAK's hold-out.

        Every appended row is released by the append that brings it, final or provisional
        (``dp_final``); ``max_delay`` bounds how long a row stays provisional: a number of rows,
        or a duration (``"1d"``, ``"6h"``, a ``timedelta``) for time keys on a regular clock
        (:mod:`dpsql.continual.delay`). The method's blocks and hold-out are laid out so that
        no row waits longer (a hold-out that would is released as it comes, at the public
        bound); what it forbids is refused before anything is charged.

        Examples
        --------
        >>> import dpsql, polars as pl
        >>> budget = dpsql.Budget.in_memory(epsilon=1.0)
        >>> with dpsql.testing.seeded(0):
        ...     meters = budget.stream("kwh", method="laplace", epsilon=0.5, order_by="hour", value="kwh",
        ...                            upper=10.0)
        >>> meters.append(pl.DataFrame({"hour": [0, 1, 2], "kwh": [1.0, 4.0, 2.5]})).num_rows
        3
        >>> budget.stream("kwh").append(pl.DataFrame({"hour": [3], "kwh": [3.0]})).column_names
        ['hour', 'kwh', 'dp_row', 'dp_final']
        >>> budget.spent
        (0.5, 0.0)
        """
        return open_stream(self, name, method=method, epsilon=epsilon, order_by=order_by, value=value,
                           partition_by=partition_by, delta=delta, max_delay=max_delay, **params)

    def streams(self):
        """This scope's streams as a Polars DataFrame: name, method, params (JSON), epsilon,
        delta, rows released, partitions, watermark (the largest order key appended), created."""
        import polars as pl

        rows = [Stream(self, row).info() for row in StreamStore(self._ledger).all(self.scope)]
        schema = {"name": pl.String, "method": pl.String, "params": pl.String, "epsilon": pl.Float64,
                  "delta": pl.Float64, "rows": pl.Int64, "partitions": pl.Int64, "watermark": pl.String,
                  "created": pl.String}
        return pl.DataFrame(rows, schema=schema, orient="row")

    def clear_cache(self) -> int:
        """Forget this principal's stored answers in this scope (later repeats are charged), and
        those stored before answers had principals; returns how many."""
        return self._ledger.clear_answers(self.scope, principal=self.principal)

    def plot(self, *, ax=None):
        """The budget's burn-down (matplotlib): epsilon spent over time, stacked by method, under
        its total; returns the figure, which pyplot does not hold (a notebook shows it once, as a
        cell's value; :mod:`dpsql.display`)."""
        from dpsql.display import plot_budget

        return plot_budget(self, ax=ax)

    def _repr_html_(self) -> str:
        from dpsql.display import budget_html

        return budget_html(self)

    def __repr__(self) -> str:
        state = self._ledger.scope(self.scope)
        where = self.location
        return (f"Budget(scope={self.scope!r}, notion={self.notion.value!r}, epsilon {float(state.spent_epsilon):g}/"
                f"{float(state.epsilon):g} spent, delta {float(state.spent_delta):g}/{float(state.delta):g} spent, "
                f"principal={self.principal!r}, {where})")

    # -- charging (dpsql.publish and continual streams only) ---------------------------------

    def check(self, charge: Charge) -> None:
        """Raise exactly what :meth:`charge` would raise now, without charging."""
        self._refuse_incompatible(charge)
        refuse_overspend(self._ledger.scope(self.scope), exact(charge.epsilon), exact(charge.delta), charge)

    def charge(self, charge: Charge, *, handles: int = 0, description: dict | None = None,
               answer: CachedAnswer | None = None, then=None) -> Receipt:
        """Atomically check the budget and record one release (see :meth:`Ledger.charge`).

        Called only by :func:`dpsql.publishing.publish` (after the release is computed, before any
        of its values is returned) and by a continual stream's registration. Raises
        :class:`~dpsql.BudgetExhausted`, :class:`~dpsql.NonPrivateRelease`,
        :class:`~dpsql.NotionMismatch` or :class:`~dpsql.LedgerError` and records nothing.
        """
        self._refuse_incompatible(charge)
        packed = None if description is None else _state.pack(description)
        return self._ledger.charge(self.scope, charge, principal=self.principal, handles=handles, description=packed,
                                   answer=answer if self.caches else None, then=then)

    def stored_answer(self, fingerprint: str, *, private: bool) -> tuple[ReleaseRecord, CachedAnswer] | None:
        """The record and cached answer of this principal's identical earlier release (``private``
        or seeded, as asked), or None."""
        if not self.caches:
            return None
        found = self._ledger.answer(self.scope, fingerprint, principal=self.principal, private=private)
        if found is None:
            return None
        release_id, answer = found
        return ReleaseRecord.from_row(self._ledger.release(release_id)), answer

    def record_hit(self, record: ReleaseRecord, *, rows: int, note: str | None, source: str | None = None) -> None:
        """Record that ``record``'s answer was given again, free (to a call that read ``source``)."""
        charge = Charge(method=record.method, epsilon=0.0, delta=0.0,
                        neighbour=Neighbour(record.description["neighbour"]), notion=self.notion, w=self.w,
                        rows=rows, partitions=record.partitions,
                        params=json.loads(json.dumps(record.params, default=str)),
                        private=record.description["private"], note=note, kind=Kind.CACHE_HIT, source=source)
        self._ledger.record_hit(self.scope, charge, record.release_id, principal=self.principal)

    def _refuse_incompatible(self, charge: Charge) -> None:
        if self.persistent and not charge.private:
            raise NonPrivateRelease("this release used seeded test noise (dpsql.testing.seeded) and is not "
                                    "private; a persistent ledger refuses it")
        if charge.notion != self.notion or (self.notion is Notion.W_EVENT_LDP and charge.w != self.w):
            mine = self.notion.value + ("" if self.w is None else f" (w={self.w})")
            theirs = Notion(charge.notion).value + ("" if charge.w is None else f" (w={charge.w})")
            raise NotionMismatch(f"budget scope {self.scope!r} accounts for {mine}; a {theirs} release "
                                 "cannot be composed with it")


def _principal(ledger: Ledger, named: str | None) -> str:
    """The principal of a budget on ``ledger``: ``named``, or the ledger's own (see :meth:`Budget.open`)."""
    if named is None:
        return ledger.principal
    if not isinstance(named, str) or not named:
        raise InvalidParameter(f"principal must be a non-empty string, got {named!r}")
    if named != ledger.principal and not ledger.backend.names_principals:
        raise InvalidParameter(f"principal={named!r} is refused: ledger {ledger.location} knows its principals "
                               f"by their database role, and this connection's is {ledger.principal!r} (connect "
                               "as that role instead)")
    return named


# -- the default budget ------------------------------------------------------------------------------


class use_budget(contextlib.AbstractContextManager):
    """Make ``budget`` the default of every release that passes no ``budget=``.

    Called on its own (a notebook's first cell), it sets the default for the rest of the
    session; as a context manager, for the block only, restoring the previous default after.

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> budget = dpsql.Budget.in_memory(epsilon=1.0)
    >>> with dpsql.use_budget(budget):
    ...     release = dpsql.laplace(np.ones(10), epsilon=0.25, upper=1.0)
    >>> budget.spent
    (0.25, 0.0)
    """

    def __init__(self, budget: Budget | None):
        if budget is not None and not isinstance(budget, Budget):
            raise InvalidParameter(f"use_budget takes a dpsql.Budget, got {type(budget).__name__}")
        self._previous, _current.budget = _current.budget, budget
        self.budget = budget

    def __enter__(self) -> Budget | None:
        return self.budget

    def __exit__(self, *exc) -> None:
        _current.budget = self._previous


def default_budget() -> Budget | None:
    """The budget set by :func:`use_budget`, if any."""
    return _current.budget
