"""Exact, context-free accounting: running totals, refusals, and what the ledger records."""

from __future__ import annotations

import contextlib
import decimal
import multiprocessing
import os
import signal
import sqlite3
from fractions import Fraction

import duckdb
import numpy as np
import polars as pl
import pytest

import dpsql
from dpsql.accounting import Charge, Neighbour, Notion, exact


def _charge(budget, epsilon, delta=0.0, **kw):
    budget.charge(Charge(method="laplace", epsilon=epsilon, delta=delta, neighbour=Neighbour.REPLACE_ONE, rows=1,
                         **kw))


def _recorded_totals(path, scope="default"):
    """The sum of the recorded charges, read straight from the file, and the running total."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        rows = conn.execute("SELECT epsilon, delta FROM charges WHERE scope = ?", (scope,)).fetchall()
        spent = conn.execute("SELECT spent_epsilon, spent_delta FROM scopes WHERE scope = ?", (scope,)).fetchone()
    return (sum((exact(e) for e, _ in rows), Fraction(0)), sum((exact(d) for _, d in rows), Fraction(0))), \
        (Fraction(spent[0]), Fraction(spent[1]))


def test_ledger_arithmetic_ignores_the_callers_decimal_context(tmp_path):
    budget = dpsql.Budget.open(tmp_path / "l.sqlite", epsilon=2.0)
    accepted = 0
    with decimal.localcontext() as context:
        context.prec = 1  # 0.4 + 0.4 + ... would round to 0.4, 1, 1, ... in this context
        for _ in range(20):
            try:
                _charge(budget, 0.4)
                accepted += 1
            except dpsql.BudgetExhausted:
                pass
    assert accepted == 5
    assert budget.spent == (2.0, 0.0) and budget.remaining == (0.0, 0.0)


def test_ten_tenths_fill_a_budget_of_one_exactly():
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    for _ in range(10):
        _charge(budget, 0.1)
    assert budget.remaining == (0.0, 0.0)
    with pytest.raises(dpsql.BudgetExhausted) as refused:
        _charge(budget, 1e-300)
    assert refused.value.remaining == (0.0, 0.0) and refused.value.requested == (1e-300, 0.0)


def test_overspend_is_refused_with_remaining_and_requested_and_charges_nothing():
    budget = dpsql.Budget.in_memory(epsilon=1.0, delta=1e-6)
    _charge(budget, 0.75, 5e-7)
    with pytest.raises(dpsql.BudgetExhausted, match=r"remaining epsilon=0.25.*requested epsilon=0.3") as info:
        _charge(budget, 0.3)
    assert info.value.remaining == (0.25, 5e-7) and info.value.requested == (0.3, 0.0)
    with pytest.raises(dpsql.BudgetExhausted, match="delta"):
        _charge(budget, 0.1, 6e-7)
    assert budget.spent == (0.75, 5e-7)
    assert budget.history().height == 1


def test_running_totals_equal_the_sum_of_recorded_charges(tmp_path):
    path = tmp_path / "l.sqlite"
    budget = dpsql.Budget.open(path, epsilon=3.0, delta=1e-3)
    rng = np.random.default_rng(0)
    for _ in range(200):
        with contextlib.suppress(dpsql.BudgetExhausted):
            _charge(budget, float(rng.choice([0.001, 0.01, 1 / 3, 0.07])), float(rng.choice([0.0, 1e-6])))
    recorded, running = _recorded_totals(path)
    assert recorded == running
    assert budget.spent == (float(running[0]), float(running[1]))


def test_a_delta_charge_on_a_pure_scope_says_that_the_scope_needs_delta():
    budget = dpsql.Budget.in_memory(epsilon=5.0)
    with pytest.raises(dpsql.BudgetExhausted, match="created with delta=0"), dpsql.testing.seeded(0):
        dpsql.pak(np.arange(10_000) % 7.0, epsilon=1.0, upper=10.0, m=1000, budget=budget)
    assert budget.spent == (0.0, 0.0)


def test_a_persistent_ledger_survives_reopening_with_its_totals_and_history(tmp_path):
    path = tmp_path / "ledger.sqlite"
    budget = dpsql.Budget.open(path, scope="meters", epsilon=2.0, delta=1e-5)
    _charge(budget, 0.5, 1e-6, note="first")
    again = dpsql.Budget.open(path, scope="meters")
    assert again.total == (2.0, 1e-5) and again.spent == (0.5, 1e-6) and again.remaining == (1.5, 9e-6)
    history = again.history()
    assert history["note"].to_list() == ["first"] and history["kind"].to_list() == ["release"]
    assert history.schema["time"] == pl.Datetime("us", "UTC")
    other = dpsql.Budget.open(path, scope="traffic", epsilon=1.0)  # scopes of one file are independent
    assert other.spent == (0.0, 0.0) and other.history().height == 0


def test_reopening_never_raises_a_budget(tmp_path):
    path = tmp_path / "l.sqlite"
    dpsql.Budget.open(path, scope="meters", epsilon=1.0)
    with pytest.raises(dpsql.InvalidParameter, match="budgets are never raised"):
        dpsql.Budget.open(path, scope="meters", epsilon=2.0)
    with pytest.raises(dpsql.NotionMismatch):
        dpsql.Budget.open(path, scope="meters", notion="ldp")
    with pytest.raises(dpsql.InvalidParameter, match="does not exist yet"):
        dpsql.Budget.open(path, scope="new")
    assert dpsql.Budget.open(path, scope="meters").total == (1.0, 0.0)


def test_persistent_ledgers_refuse_seeded_releases_and_in_memory_ones_record_them(tmp_path):
    persistent = dpsql.Budget.open(tmp_path / "l.sqlite", epsilon=1.0)
    with dpsql.testing.seeded(0), pytest.raises(dpsql.NonPrivateRelease):
        dpsql.laplace(np.ones(5), epsilon=0.1, upper=1.0, budget=persistent)
    assert persistent.spent == (0.0, 0.0) and persistent.history().height == 0
    notebook = dpsql.Budget.in_memory(epsilon=1.0)
    with dpsql.testing.seeded(0):
        dpsql.laplace(np.ones(5), epsilon=0.1, upper=1.0, budget=notebook)
    assert notebook.spent == (0.1, 0.0)
    assert notebook.history(full=True)["private"].to_list() == [False]


def test_a_scopes_notion_and_window_are_fixed(tmp_path):
    ldp = dpsql.Budget.open(tmp_path / "l.sqlite", scope="devices", epsilon=4.0, notion="w-event-ldp", w=10)
    with pytest.raises(dpsql.NotionMismatch, match="w-event-ldp"):
        dpsql.laplace(np.ones(5), epsilon=0.1, upper=1.0, budget=ldp)
    with pytest.raises(dpsql.NotionMismatch, match="w=20"):
        _charge(ldp, 0.1, notion=Notion.W_EVENT_LDP, w=20)
    _charge(ldp, 0.1, notion=Notion.W_EVENT_LDP, w=10)
    assert ldp.spent == (0.1, 0.0)
    with pytest.raises(dpsql.NotionMismatch):
        dpsql.Budget.open(tmp_path / "l.sqlite", scope="devices", notion="central")
    with pytest.raises(dpsql.InvalidParameter, match="notion"):
        dpsql.Budget.in_memory(epsilon=1.0, notion="renyi")
    with pytest.raises(dpsql.InvalidParameter, match="w is only meaningful"):
        dpsql.Budget.in_memory(epsilon=1.0, w=3)
    with pytest.raises(dpsql.InvalidParameter, match="w"):
        dpsql.Budget.in_memory(epsilon=1.0, notion="w-event-ldp")


@pytest.mark.parametrize("epsilon", [0, -1.0, float("nan"), float("inf"), True, "1"])
def test_a_budgets_epsilon_is_validated(epsilon):
    with pytest.raises(dpsql.InvalidParameter, match="epsilon"):
        dpsql.Budget.in_memory(epsilon=epsilon)


def test_the_budget_constructor_is_not_public():
    with pytest.raises(TypeError, match=r"Budget\.open"):
        dpsql.Budget()


def _race(path, scope, attempts, results):
    budget = dpsql.Budget.open(path, scope=scope)
    granted = 0
    for _ in range(attempts):
        try:
            _charge(budget, 0.01)
            granted += 1
        except dpsql.BudgetExhausted:
            pass
    results.put(granted)


def test_processes_racing_one_sqlite_scope_never_exceed_the_cap(tmp_path):
    path = str(tmp_path / "race.sqlite")
    dpsql.Budget.open(path, scope="race", epsilon=1.0)
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_race, args=(path, "race", 60, results)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    granted = sum(results.get(timeout=10) for _ in procs)
    budget = dpsql.Budget.open(path, scope="race")
    assert granted == 100  # 240 attempts of 0.01 against 1.0
    assert budget.spent == (1.0, 0.0)
    assert budget.history().height == 100


def _charge_then_die(path):
    budget = dpsql.Budget.open(path, scope="crash")
    _charge(budget, 0.25)
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_charge_survives_the_process_being_killed_right_after_it(tmp_path):
    path = str(tmp_path / "crash.sqlite")
    dpsql.Budget.open(path, scope="crash", epsilon=1.0)
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=_charge_then_die, args=(path,))
    proc.start()
    proc.join(60)
    assert proc.exitcode == -signal.SIGKILL
    assert dpsql.Budget.open(path, scope="crash").spent == (0.25, 0.0)


def test_a_private_release_without_a_budget_is_refused_and_use_budget_sets_one():
    values = np.ones(100)
    with pytest.raises(dpsql.InvalidParameter, match="use_budget"):
        dpsql.laplace(values, epsilon=0.5, upper=1.0)
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    with dpsql.use_budget(budget):
        dpsql.laplace(values, epsilon=0.5, upper=1.0)
    assert budget.spent == (0.5, 0.0)
    with pytest.raises(dpsql.InvalidParameter, match="use_budget"):
        dpsql.laplace(values, epsilon=0.5, upper=1.0, fresh=True)
    dpsql.use_budget(budget)  # a notebook's default, until replaced
    try:
        dpsql.laplace(values + 1, epsilon=0.25, upper=2.0)
    finally:
        dpsql.use_budget(None)
    assert budget.spent == (0.75, 0.0)
    frame = pl.DataFrame({"ts": range(100), "v": values})
    with pytest.raises(dpsql.InvalidParameter, match="use_budget"):
        frame.select(pl.col("v").dpsql.range_sum(order_by="ts", method="laplace", epsilon=0.1, upper=1.0))
    with pytest.raises(dpsql.InvalidParameter, match=r"register\(con, budget=dpsql.Budget.open"):
        dpsql.register(duckdb.connect(), budget=None)
    assert budget.spent == (0.75, 0.0)


def test_a_version_one_ledger_is_upgraded_with_its_totals(tmp_path):
    path = tmp_path / "old.sqlite"
    with contextlib.closing(sqlite3.connect(path)) as conn:  # round 1's layout and rows
        conn.executescript("""
            CREATE TABLE scopes (scope TEXT PRIMARY KEY, notion TEXT NOT NULL, w INTEGER, epsilon TEXT NOT NULL,
                                 delta TEXT NOT NULL, created TEXT NOT NULL);
            CREATE TABLE charges (seq INTEGER PRIMARY KEY AUTOINCREMENT, release_id TEXT NOT NULL UNIQUE,
                scope TEXT NOT NULL REFERENCES scopes(scope), time TEXT NOT NULL, method TEXT NOT NULL,
                params TEXT NOT NULL, epsilon TEXT NOT NULL, delta TEXT NOT NULL, rows INTEGER NOT NULL,
                partitions INTEGER NOT NULL, neighbour TEXT NOT NULL, private INTEGER NOT NULL, note TEXT);
            INSERT INTO scopes VALUES ('default', 'central', NULL, '2.0', '0.0', '2025-01-01T00:00:00Z');
            INSERT INTO charges (release_id, scope, time, method, params, epsilon, delta, rows, partitions,
                                 neighbour, private, note)
            VALUES ('a', 'default', '2025-01-01T00:00:00Z', 'tops', '{}', '0.1', '0.0', 10, 1, 'x', 1, NULL),
                   ('b', 'default', '2025-01-01T00:00:01Z', 'tops', '{}', '0.2', '0.0', 10, 1, 'x', 1, NULL);
        """)
    budget = dpsql.Budget.open(path)
    assert budget.spent == (0.3, 0.0)
    assert _recorded_totals(path)[1][0] == Fraction(3, 10)
    assert budget.history()["kind"].to_list() == ["release", "release"]
    _charge(budget, 1.7)
    with pytest.raises(dpsql.BudgetExhausted):
        _charge(budget, 1e-9)


def test_a_version_two_ledger_is_upgraded_and_a_newer_one_refused(tmp_path):
    """Version 3 changed how released rows are stored, not the tables: opening a version-2 ledger
    marks it with this version (which version-2 dpsql refuses, instead of misreading its rows); a
    ledger newer than this dpsql is refused before anything is written."""
    from dpsql.ledger import schema

    path = tmp_path / "l.sqlite"
    _charge(dpsql.Budget.open(path, epsilon=1.0), 0.25)

    def version():
        with contextlib.closing(sqlite3.connect(path)) as conn:
            return int(conn.execute("SELECT value FROM ledger_meta WHERE key = 'version'").fetchone()[0])

    def set_version(v):
        with contextlib.closing(sqlite3.connect(path)) as conn, conn:
            conn.execute("UPDATE ledger_meta SET value = ? WHERE key = 'version'", (str(v),))

    assert version() == schema.VERSION == 7
    for older in (2, 5, 6):
        set_version(older)
        assert dpsql.Budget.open(path).spent == (0.25, 0.0) and version() == 7
    set_version(8)
    with pytest.raises(dpsql.LedgerError, match="version 8, newer than this dpsql understands"):
        dpsql.Budget.open(path)
    assert version() == 8


def test_a_charge_reads_the_running_total_not_the_history(tmp_path):
    """On a ledger of 200k charges a charge reads its scope's running total (no statement reads
    the charges table) and takes milliseconds, not a pass over the history (0.48 s before)."""
    import statistics
    import time

    path = tmp_path / "l.sqlite"
    budget = dpsql.Budget.open(path, epsilon=1e6)
    _charge(budget, 0.5)
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        row = conn.execute("SELECT scope, time, method, params, epsilon, delta, rows, partitions, neighbour, private "
                           "FROM charges").fetchone()
        conn.executemany("INSERT INTO charges (release_id, scope, time, method, params, epsilon, delta, rows, "
                         "partitions, neighbour, private) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                         ((f"bulk-{k}", *row) for k in range(200_000)))
        conn.execute("UPDATE scopes SET spent_epsilon = '200001/2', charges = 200001")
    statements: list[str] = []
    budget.ledger._conn.set_trace_callback(statements.append)
    try:
        _charge(budget, 0.5)
    finally:
        budget.ledger._conn.set_trace_callback(None)
    reads = [s for s in statements if s.lstrip().upper().startswith("SELECT")]
    assert any("FROM scopes" in s for s in reads)
    assert not [s for s in reads if "charges" in s.split("FROM", 1)[-1]], reads
    took = []
    for _ in range(15):
        started = time.perf_counter()
        _charge(budget, 0.5)
        took.append(time.perf_counter() - started)
    assert statistics.median(took) < 0.1, took
    recorded, running = _recorded_totals(path)
    assert recorded == running == (Fraction(200_017, 2), 0)


@pytest.mark.parametrize("location", [None, "", 3, b"ledger.sqlite"])
def test_a_ledger_location_must_be_a_path_or_url(location, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(dpsql.InvalidParameter, match="location must be a file path or a postgresql:// URL"):
        dpsql.Budget.open(location, epsilon=1.0)
    assert list(tmp_path.iterdir()) == []  # no file named "None" (or anything) was created


def test_a_row_handle_beyond_64_bits_is_an_unknown_release():
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    for handle in (2**63, 2**70):
        with pytest.raises(dpsql.UnknownRelease, match=f"dp_row {handle}"):
            budget.release(dp_row=handle)
