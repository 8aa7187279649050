"""The ledger under faults, with real processes and signals: interrupts at random instants,
fork, kill -9, a read-only or full disk, a corrupt file, a lock held too long. After each,
nothing is half written: totals equal the recorded charges and other processes can charge."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from fractions import Fraction

import numpy as np
import polars as pl
import pytest
from processes import in_forked_child

import dpsql
from dpsql.accounting import Charge, Neighbour, exact
from dpsql.ledger import sqlite as sqlite_backend

CHARGE = Charge(method="laplace", epsilon=1e-4, delta=0.0, neighbour=Neighbour.REPLACE_ONE, rows=1)


def _consistent(path) -> tuple[int, Fraction]:
    """Number of charges and their sum, after checking that the running total equals it."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        rows = [exact(e) for (e,) in conn.execute("SELECT epsilon FROM charges")]
        spent, count = conn.execute("SELECT spent_epsilon, charges FROM scopes").fetchone()
    assert Fraction(spent) == sum(rows, Fraction(0))
    assert count == len(rows)
    return len(rows), Fraction(spent)


def _python(code: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], **kwargs)


def test_interrupts_at_random_instants_leave_no_open_transaction(tmp_path):
    path = tmp_path / "l.sqlite"
    dpsql.Budget.open(path, epsilon=1000.0)
    worker = _python(f"""
        import dpsql, sys
        from dpsql.accounting import Charge, Neighbour
        charge = Charge(method="laplace", epsilon=1e-4, delta=0.0, neighbour=Neighbour.REPLACE_ONE, rows=1)
        budget = None
        print("ready", flush=True)
        while True:
            try:
                if budget is None:  # interrupts reach opening too
                    budget = dpsql.Budget.open({str(path)!r})
                budget.charge(charge)
            except KeyboardInterrupt:
                if budget is not None and budget.ledger._conn is not None:
                    assert not budget.ledger._conn.in_transaction, "interrupted inside a transaction"
                budget = None if budget is None or hash(id(budget)) % 2 else budget
    """, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert worker.stdout.readline().strip() == b"ready"
    rng = random.Random(1)
    for _ in range(300):
        time.sleep(rng.uniform(0.0, 0.004))
        worker.send_signal(signal.SIGINT)
    worker.kill()
    _, err = worker.communicate()
    assert b"interrupted inside a transaction" not in err
    count, _ = _consistent(path)
    assert count > 0
    started = time.monotonic()
    other = _python(f"""
        import dpsql
        from dpsql.accounting import Charge, Neighbour
        dpsql.Budget.open({str(path)!r}).charge(
            Charge(method="laplace", epsilon=1e-4, delta=0.0, neighbour=Neighbour.REPLACE_ONE, rows=1))
    """)
    assert other.wait(timeout=30) == 0
    assert time.monotonic() - started < 1.0 + _interpreter_start()
    assert _consistent(path)[0] == count + 1


def _interpreter_start() -> float:
    """Seconds a fresh interpreter takes to import dpsql here (not the ledger's doing)."""
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", "import dpsql"], check=True)
    return time.monotonic() - started


def test_kill_9_mid_charges_loses_nothing_and_charges_nothing_twice(tmp_path):
    path = tmp_path / "l.sqlite"
    dpsql.Budget.open(path, epsilon=1000.0)
    workers = [_python(f"""
        import dpsql
        from dpsql.accounting import Charge, Neighbour
        budget = dpsql.Budget.open({str(path)!r})
        charge = Charge(method="laplace", epsilon=1e-4, delta=0.0, neighbour=Neighbour.REPLACE_ONE, rows=1)
        budget.charge(charge)
        print("charging", flush=True)
        while True:
            budget.charge(charge)
    """, stdout=subprocess.PIPE) for _ in range(3)]
    for worker in workers:
        assert worker.stdout.readline().strip() == b"charging"
    time.sleep(0.5)
    for worker in workers:
        worker.send_signal(signal.SIGKILL)
        worker.wait()
    count, spent = _consistent(path)
    assert count > 0 and spent == count * exact(1e-4)


def test_a_forked_child_charges_through_its_own_connection(tmp_path):
    budget = dpsql.Budget.open(tmp_path / "l.sqlite", epsilon=1.0)
    budget.charge(CHARGE)
    # the child's charge must reach the same file
    assert in_forked_child(lambda: budget.charge(CHARGE) and "charged") == "charged"
    budget.charge(CHARGE)
    assert _consistent(tmp_path / "l.sqlite")[0] == 3


def test_an_in_memory_budget_refuses_in_a_forked_child():
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    budget.charge(CHARGE)
    message = in_forked_child(lambda: budget.charge(CHARGE) and "charged")
    assert message.startswith("LedgerError") and "forked child" in message and "Budget.open" in message
    assert budget.spent == (1e-4, 0.0)


def _in_child_as_nobody(action) -> str:
    """Run ``action()`` in a forked child without root's privileges; its error, if any."""
    def as_nobody():
        os.setgid(65534)
        os.setuid(65534)
        action()
        return "no error"

    return in_forked_child(as_nobody)


@pytest.mark.skipif(os.geteuid() != 0, reason="drops root's privileges to make the file read-only for the writer")
def test_a_read_only_ledger_is_a_typed_error_naming_the_file(tmp_path):
    path = tmp_path / "l.sqlite"
    dpsql.Budget.open(path, epsilon=1.0).charge(CHARGE)
    os.chmod(tmp_path, 0o755)
    message = _in_child_as_nobody(lambda: dpsql.Budget.open(path).charge(CHARGE))
    assert message.startswith("LedgerError") and str(path) in message
    assert "read-only" in message or "cannot be opened" in message
    assert _consistent(path)[0] == 1


def test_a_full_disk_is_a_typed_error_and_nothing_is_charged(tmp_path):
    """A small tmpfs when the machine lets root mount one; else a file-size limit (EFBIG)."""
    mount = tmp_path / "small"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
                             capture_output=True).returncode == 0 if os.geteuid() == 0 else False
    try:
        path = mount / "l.sqlite"
        limit = "" if mounted else ("signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
                                    "resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000))")
        code = f"""
            import dpsql, resource, signal
            from dpsql.accounting import Charge, Neighbour
            budget = dpsql.Budget.open({str(path)!r}, epsilon=1e9)
            {limit}
            charge = Charge(method="laplace", epsilon=1.0, delta=0.0, neighbour=Neighbour.REPLACE_ONE, rows=1,
                            note="x" * 4000)
            try:
                while True:
                    budget.charge(charge)
            except dpsql.LedgerError as error:
                print(error)
        """
        out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, timeout=120)
        message = out.stdout.decode()
        assert str(path) in message, out.stderr.decode()[-2000:]
        assert "disk is full" in message or "disk failed" in message
        count, spent = _consistent(path)
        assert spent == count  # every recorded charge is whole, none half-written
    finally:
        if mounted:
            subprocess.run(["umount", "--lazy", str(mount)], check=True)


def test_a_corrupt_file_is_a_typed_error_naming_it(tmp_path):
    path = tmp_path / "not-a-ledger.sqlite"
    path.write_bytes(b"this is not a database" * 500)
    with pytest.raises(dpsql.LedgerError, match="not a dpsql ledger") as refused:
        dpsql.Budget.open(path, epsilon=1.0)
    assert str(path) in str(refused.value)


def test_a_lock_held_too_long_is_a_typed_error(tmp_path, monkeypatch):
    path = tmp_path / "l.sqlite"
    dpsql.Budget.open(path, epsilon=1.0)
    holder = _python(f"""
        import sqlite3, sys, time
        conn = sqlite3.connect({str(path)!r}, isolation_level=None)
        conn.execute("BEGIN IMMEDIATE")
        print("locked", flush=True)
        time.sleep(30)
    """, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == b"locked"
        monkeypatch.setattr(sqlite_backend, "LOCK_TIMEOUT", 0.2)
        budget = dpsql.Budget.open(path)
        with pytest.raises(dpsql.LedgerError, match="write lock") as refused:
            budget.charge(CHARGE)
        assert str(path) in str(refused.value)
    finally:
        holder.kill()
        holder.wait()
    budget.charge(CHARGE)
    assert _consistent(path)[0] == 1


def test_a_release_refused_at_its_charge_leaves_nothing_noisy_reachable(tmp_path):
    """Another process spends the budget between the check and the charge (the race the
    charge's own check exists for): the refusal must not carry the release's values."""
    path = tmp_path / "l.sqlite"
    budget = dpsql.Budget.open(path, epsilon=1.0)
    values = np.arange(5000) % 17.0
    real_charge = budget.charge

    def racing_charge(*args, **kwargs):
        subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
            import dpsql
            from dpsql.accounting import Charge, Neighbour
            dpsql.Budget.open({str(path)!r}).charge(
                Charge(method="laplace", epsilon=0.9, delta=0.0, neighbour=Neighbour.REPLACE_ONE, rows=1))
        """)], check=True)
        return real_charge(*args, **kwargs)

    budget.charge = racing_charge
    with pytest.raises(dpsql.BudgetExhausted) as refused:
        dpsql.laplace(values, epsilon=0.5, upper=20.0, budget=budget)
    _assert_nothing_noisy(refused.value, values)
    assert budget.spent == (0.9, 0.0)


def test_parameters_that_would_overflow_are_refused_before_any_noise(monkeypatch):
    drawn = []
    original = dpsql.noise.LaneDraws.discrete_laplace
    monkeypatch.setattr(dpsql.noise.LaneDraws, "discrete_laplace",
                        lambda self, *a, **k: drawn.append(a) or original(self, *a, **k))
    budget = dpsql.Budget.in_memory(epsilon=10.0)
    for method in ("laplace", "binary_tree", "hierarchy", "tops", "pak", "threshold"):
        for params in ({"upper": 1e300}, {"upper": 1e158, "lower": -1e158}, {"epsilon": 5e-324},
                       {"epsilon": 1e-320}, {"upper": 5e-324}):
            arguments = {"epsilon": 1.0, "upper": 10.0, "m": 100, **params}
            if method not in ("tops", "pak"):
                arguments.pop("m")
            with pytest.raises(dpsql.InvalidParameter) as refused, dpsql.testing.seeded(0):
                dpsql.publish(method, np.arange(1000.0), budget=budget, **arguments)
            _assert_nothing_noisy(refused.value, None)
    assert drawn == [] and budget.spent == (0.0, 0.0)


def _assert_nothing_noisy(error: BaseException, data) -> None:
    """No frame of the traceback holds a released value, a release, a machine or a key, and the
    exception has no context, cause or non-text argument."""
    assert error.__context__ is None and error.__cause__ is None
    _assert_frames_hold_nothing_noisy(error, data)


def test_a_release_whose_charge_fails_to_commit_leaves_nothing_noisy_reachable(tmp_path, monkeypatch):
    """The disk fills while the charge commits: a typed LedgerError naming the file, rolled back,
    and neither the exception nor anything it leads to holds the computed release."""
    path = tmp_path / "l.sqlite"
    budget = dpsql.Budget.open(path, epsilon=1.0)
    values = np.arange(5000) % 17.0

    def full_disk(conn):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(budget.ledger.backend, "commit", full_disk)
    with pytest.raises(dpsql.LedgerError, match="disk is full") as failed:
        dpsql.laplace(values, epsilon=0.5, upper=20.0, budget=budget)
    assert str(path) in str(failed.value)
    _assert_nothing_noisy(failed.value, values)
    monkeypatch.undo()
    assert _consistent(path) == (0, 0) and budget.spent == (0.0, 0.0)
    assert not budget.ledger._conn.in_transaction
    dpsql.laplace(values, epsilon=0.5, upper=20.0, budget=budget)  # the ledger is usable as before
    assert _consistent(path)[0] == 1


@pytest.mark.parametrize("method", ["laplace", "tops", "pegasus", "count_laplace"])
def test_integers_beyond_exact_float_range_are_refused_before_any_noise(method, monkeypatch):
    """2**53 + 1 would silently become 2**53 in float64: refused, naming the column, nothing drawn
    or charged. Counts of 2**51 and more cannot carry exact lattice noise: refused too."""
    drawn = []
    original = dpsql.noise.LaneDraws.discrete_laplace
    monkeypatch.setattr(dpsql.noise.LaneDraws, "discrete_laplace",
                        lambda self, *a, **k: drawn.append(a) or original(self, *a, **k))
    budget = dpsql.Budget.in_memory(epsilon=10.0)
    params = {"upper": 2.0**60} if method in ("laplace", "tops") else {}
    for big, error in ((2**53 + 1, dpsql.InvalidData), (-(2**53) - 1, dpsql.InvalidData), (2**62, dpsql.InvalidData),
                       (2**51, dpsql.DPError)):
        if big == 2**51 and method not in ("pegasus", "count_laplace"):
            continue
        values = np.full(200, big, dtype=np.int64)
        with pytest.raises(error) as refused, dpsql.testing.seeded(0):
            dpsql.publish(method, values, budget=budget, epsilon=1.0, **params)
        if error is dpsql.InvalidData:
            assert "beyond 2**53" in str(refused.value) and "'values'" in str(refused.value)
        _assert_nothing_noisy(refused.value, None)
    frame = pl.DataFrame({"ts": np.arange(200), "v": np.full(200, 2**53 + 1, dtype=np.int64)})
    if method in ("laplace", "tops"):
        with pytest.raises(dpsql.InvalidData, match="'v' holds integers beyond 2\\*\\*53"):
            frame.select(pl.col("v").dpsql.range_sum(order_by="ts", method=method, epsilon=1.0, budget=budget,
                                                     **params))
    assert drawn == [] and budget.spent == (0.0, 0.0) and budget.history().height == 0


@pytest.mark.parametrize("front_end", ["polars", "duckdb"])
def test_a_front_end_release_refused_at_its_charge_leaves_nothing_noisy_reachable(front_end):
    import duckdb

    budget = dpsql.Budget.in_memory(epsilon=1.0)
    values = np.arange(5000) % 17.0
    real_charge = budget.charge

    def racing_charge(charge, **kwargs):  # another release spends the budget between check and charge
        real_charge(CHARGE.__class__(**{**CHARGE.__dict__, "epsilon": 0.9}))
        return real_charge(charge, **kwargs)

    budget.charge = racing_charge
    frame = pl.DataFrame({"ts": np.arange(5000), "v": values})
    with pytest.raises(dpsql.BudgetExhausted) as refused:
        if front_end == "polars":
            frame.select(pl.col("v").dpsql.range_sum(order_by="ts", method="laplace", epsilon=0.5, upper=20.0,
                                                     budget=budget))
        else:
            con = duckdb.connect()
            dpsql.register(con, budget=budget)
            con.register("frame", frame.to_arrow())
            with dpsql.duckdb.typed_errors():
                con.sql("SELECT * FROM dp_range_sum('frame', 'ts', 'v', method := 'laplace', epsilon := 0.5, "
                        "upper := 20)").fetchall()
    error = refused.value
    for linked in (error, error.__cause__, error.__context__):
        if linked is not None:
            _assert_frames_hold_nothing_noisy(linked, values)
    assert budget.spent == (0.9, 0.0)


def _assert_frames_hold_nothing_noisy(error: BaseException, data) -> None:
    """:func:`_assert_nothing_noisy` for an exception a front end re-raised (which may chain the
    engine's own exception): its arguments and every frame of its traceback."""
    from dpsql.noise import Draws, Keystream
    from dpsql.release import PartitionedRelease, Release, StreamMachine

    assert all(isinstance(a, (str, int, float, tuple)) for a in error.args)
    traceback = error.__traceback__
    while traceback is not None:
        for name, value in traceback.tb_frame.f_locals.items():
            assert not isinstance(value, (Release, PartitionedRelease, StreamMachine, Keystream, Draws)), name
            if isinstance(value, np.ndarray) and value.dtype == np.float64 and data is not None:
                assert value.shape != data.shape or np.array_equal(value, data), f"{name} holds released values"
        traceback = traceback.tb_next
