"""The ledger: exact arithmetic, refusal, persistence, concurrency, notions."""

import multiprocessing
import os
import signal

import numpy as np
import polars as pl
import pytest

import dpsql
from dpsql.errors import BudgetExhausted, InvalidParameter, NonPrivateRelease, NotionMismatch
from dpsql.release import REPLACE_ONE


def _charge(budget, eps, delta=0.0, **kw):
    return budget.charge(method="test", epsilon=eps, delta=delta, rows=10, neighbour=REPLACE_ONE, **kw)


def test_sequential_composition_is_exact_in_decimal():
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    for _ in range(10):
        _charge(budget, 0.1)
    assert budget.spent == (1.0, 0.0)
    assert budget.remaining == (0.0, 0.0)
    with pytest.raises(BudgetExhausted):
        _charge(budget, 1e-12)


def test_overspend_is_refused_with_remaining_and_requested_and_charges_nothing():
    budget = dpsql.Budget.in_memory(epsilon=1.0, delta=1e-6)
    _charge(budget, 0.75, 5e-7)
    with pytest.raises(BudgetExhausted, match=r"remaining epsilon=0.25.*requested epsilon=0.3") as info:
        _charge(budget, 0.3)
    assert info.value.remaining == (0.25, 5e-7) and info.value.requested == (0.3, 0.0)
    with pytest.raises(BudgetExhausted, match="delta"):
        _charge(budget, 0.1, 6e-7)
    assert budget.spent == (0.75, 5e-7)
    assert budget.history().height == 1


def test_persistent_ledger_survives_reopen_and_refuses_raising_the_budget(tmp_path):
    path = tmp_path / "ledger.sqlite"
    budget = dpsql.Budget.open(path, scope="meters", epsilon=2.0, delta=1e-5)
    _charge(budget, 0.5, 1e-6, note="first")
    again = dpsql.Budget.open(path, scope="meters")
    assert again.total == (2.0, 1e-5)
    assert again.spent == (0.5, 1e-6)
    history = again.history()
    assert history["note"].to_list() == ["first"]
    assert history.schema["time"] == pl.Datetime("us", "UTC")
    with pytest.raises(InvalidParameter, match="never raised"):
        dpsql.Budget.open(path, scope="meters", epsilon=3.0)
    other = dpsql.Budget.open(path, scope="traffic", epsilon=1.0)
    assert other.spent == (0.0, 0.0)
    with pytest.raises(InvalidParameter, match="pass epsilon"):
        dpsql.Budget.open(path, scope="unknown")


def test_persistent_ledger_refuses_non_private_releases_in_memory_records_them(tmp_path):
    persistent = dpsql.Budget.open(tmp_path / "l.sqlite", epsilon=1.0)
    with dpsql.testing.seeded(0), pytest.raises(NonPrivateRelease):
        dpsql.laplace_stream(np.ones(5), epsilon=0.1, upper=1.0, budget=persistent)
    assert persistent.spent == (0.0, 0.0)
    notebook = dpsql.Budget.in_memory(epsilon=1.0)
    with dpsql.testing.seeded(0):
        dpsql.laplace_stream(np.ones(5), epsilon=0.1, upper=1.0, budget=notebook)
    assert notebook.history()["private"].to_list() == [False]


def test_notion_is_fixed_per_scope(tmp_path):
    ldp = dpsql.Budget.open(tmp_path / "l.sqlite", scope="devices", epsilon=4.0, notion="w-event-ldp", w=10)
    with pytest.raises(NotionMismatch, match="w-event-ldp"):
        dpsql.laplace_stream(np.ones(5), epsilon=0.1, upper=1.0, budget=ldp)
    with pytest.raises(NotionMismatch):
        _charge(ldp, 0.1, notion="w-event-ldp", w=20)
    _charge(ldp, 0.1, notion="w-event-ldp", w=10)
    with pytest.raises(NotionMismatch):
        dpsql.Budget.open(tmp_path / "l.sqlite", scope="devices", notion="central")
    with pytest.raises(InvalidParameter, match="notion"):
        dpsql.Budget.in_memory(epsilon=1.0, notion="renyi")


@pytest.mark.parametrize("epsilon", [0, -1.0, float("nan"), float("inf"), True, "1"])
def test_budget_epsilon_is_validated(epsilon):
    with pytest.raises(InvalidParameter, match="epsilon"):
        dpsql.Budget.in_memory(epsilon=epsilon)


def _race(path, scope, attempts, results):
    budget = dpsql.Budget.open(path, scope=scope)
    ok = 0
    for _ in range(attempts):
        try:
            _charge(budget, 0.01)
            ok += 1
        except BudgetExhausted:
            pass
    results.put(ok)


def test_eight_processes_racing_never_exceed_the_cap(tmp_path):
    path = str(tmp_path / "race.sqlite")
    dpsql.Budget.open(path, scope="race", epsilon=1.0)
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_race, args=(path, "race", 50, results)) for _ in range(8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    granted = sum(results.get(timeout=10) for _ in procs)
    budget = dpsql.Budget.open(path, scope="race")
    assert granted == 100  # 400 attempts of 0.01 against 1.0
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


def test_budget_constructor_is_not_public():
    with pytest.raises(TypeError, match=r"Budget\.open"):
        dpsql.Budget()
