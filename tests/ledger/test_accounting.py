"""Exact, context-free accounting: running totals, refusals, and what the ledger records."""

from __future__ import annotations

import contextlib
import decimal
import sqlite3
from fractions import Fraction

import numpy as np
import pytest

import dpsql
from dpsql.accounting import Charge, Neighbour, exact


def _charge(budget, epsilon, delta=0.0):
    budget.charge(Charge(method="laplace", epsilon=epsilon, delta=delta, neighbour=Neighbour.REPLACE_ONE, rows=1))


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
