"""The ledger under faults, with real processes and signals: interrupts at random instants,
fork, kill -9, a read-only or full disk, a corrupt file, a lock held too long. After each,
nothing is half written: totals equal the recorded charges and other processes can charge."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from fractions import Fraction

import numpy as np
import polars as pl
import pytest
from processes import answer, as_user, in_forked_child, program, say

import dpsql
from dpsql.accounting import Charge, Neighbour, exact
from dpsql.ledger import sqlite as sqlite_backend

CHARGE = Charge(method="laplace", epsilon=1e-4, delta=0.0, neighbour=Neighbour.REPLACE_ONE, rows=1)


def _consistent(location) -> tuple[int, Fraction]:
    """Number of charges and their sum, after checking that the running total equals it (read
    with the backend's own client, in one snapshot)."""
    if str(location).startswith("postgresql://"):
        import psycopg

        connection = psycopg.connect(str(location))
        connection.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    else:
        connection = sqlite3.connect(location, isolation_level=None)
        connection.execute("BEGIN")
    with contextlib.closing(connection) as conn:
        rows = [exact(e) for (e,) in conn.execute("SELECT epsilon FROM charges WHERE kind != 'cache hit'")]
        spent, count = conn.execute("SELECT spent_epsilon, charges FROM scopes").fetchone()
    assert Fraction(spent) == sum(rows, Fraction(0))
    assert count == len(rows)
    return len(rows), Fraction(spent)


def _python(code: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], **kwargs)


def _interrupted_while_another_releases(location: str, *, interrupts: int) -> None:
    """``interrupts`` times, Ctrl-C a process that releases on the ledger at ``location`` at a
    random instant; after each, with that process alive (going on, or idle after catching the
    KeyboardInterrupt), a third process must release within a second. Then the ledger's
    totals must equal its recorded charges."""
    budget = dpsql.Budget.open(location, epsilon=1000.0)
    budget.stream("meters", method="laplace", epsilon=1.0, order_by="hour", value="kwh", upper=10.0)
    budget.ledger.close()
    worker = program("releasing_until_killed", location, "meters", 1)
    other = program("releasing_on_request", location, 2.0)
    try:
        assert answer(worker, 60) == "ready" and answer(other, 60) == "ready"
        rng = random.Random(2)
        for k in range(interrupts):
            time.sleep(rng.uniform(0.0, 0.03))
            worker.send_signal(signal.SIGINT)
            state = answer(worker, 10)
            assert state in ("idle", "busy"), state
            say(other, "release")
            took, outcome = answer(other, 10).split(" ", 1)
            assert outcome == "released" and float(took) < 1.0, f"after interrupt {k} ({state}): {took} s, {outcome}"
            if state == "idle":
                say(worker, "go on")
    finally:
        for process in (worker, other):
            process.kill()
            process.communicate()
    count, _ = _consistent(location)
    assert count > interrupts  # the worker released between interrupts


def test_interrupts_at_random_instants_never_leave_the_sqlite_ledger_locked(tmp_path):
    _interrupted_while_another_releases(str(tmp_path / "l.sqlite"), interrupts=300)


def test_interrupts_at_random_instants_never_leave_the_postgres_ledger_locked(postgres_url):
    _interrupted_while_another_releases(postgres_url, interrupts=100)


def test_ctrl_c_at_each_line_of_a_large_fingerprint_raises_keyboard_interrupt_and_charges_nothing(tmp_path):
    """A release's fingerprint (the answer cache's key) hashes more than two leaves' worth of data
    on two threads. Ctrl-C at each line the releasing thread runs there (and in ``threading`` and
    ``concurrent.futures``), one release at a time, must raise KeyboardInterrupt and charge
    nothing: never another error (a future's condition variable, interrupted just as it lets go
    of its lock, raises RuntimeError)."""
    code = f"""
        import faulthandler, json, signal, sys
        import numpy as np
        import dpsql
        faulthandler.register(signal.SIGUSR1)
        budget = dpsql.Budget.open({str(tmp_path / "l.sqlite")!r}, epsilon=1e6)
        values = np.ones((1 << 20) + 1)  # just over two leaves: hashed on two threads
        watched = ("threading.py", "concurrent/futures", "dpsql/_fingerprint.py", "dpsql/_parallel.py")
        outcomes = []
        while True:
            lines = [0]
            def line(frame, event, arg):
                if event == "line":
                    lines[0] += 1
                    if lines[0] == len(outcomes) + 1:
                        signal.raise_signal(signal.SIGINT)
                return line
            def call(frame, event, arg):
                return line if any(w in frame.f_code.co_filename for w in watched) else None
            spent = budget.spent
            sys.settrace(call)
            try:
                dpsql.laplace(values, epsilon=1.0, upper=1.0, budget=budget, fresh=True)
                outcome = "released"
            except KeyboardInterrupt:
                outcome = "interrupted" if budget.spent == spent else "interrupted, charged"
            except BaseException as error:
                outcome = repr(error)
            finally:
                sys.settrace(None)
            outcomes.append(outcome)
            if lines[0] < len(outcomes):  # released without reaching the next line: each was tried
                break
        print(json.dumps(outcomes))
    """
    done = _python(code, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = done.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        done.send_signal(signal.SIGUSR1)  # where it is stuck (the program dumps its stacks)
        time.sleep(0.5)
        done.kill()
        pytest.fail(f"a release stuck after a Ctrl-C: {done.communicate()[1][-3000:]}")
    assert done.returncode == 0, err[-3000:]
    outcomes = json.loads(out)
    assert len(outcomes) > 20  # the lines were tried, each in turn
    assert outcomes[:-1] == ["interrupted"] * (len(outcomes) - 1) and outcomes[-1] == "released", outcomes


def test_an_interrupt_aborts_an_append_while_it_computes_and_leaves_nothing_locked(tmp_path):
    """The append computes inside its transaction: Ctrl-C there must end it at once, rolled back,
    not once it is done; and the process, alive, holds no lock."""
    path = tmp_path / "l.sqlite"
    budget = dpsql.Budget.open(path, epsilon=1.0)
    meters = budget.stream("meters", method="laplace", epsilon=0.5, order_by="hour", value="kwh", upper=10.0,
                           partition_by="meter")
    budget.ledger.close()
    other = program("releasing_on_request", str(path), 2.0)  # first: it releases once to warm up
    assert answer(other, 60) == "ready"
    worker = program("appending_once", str(path), "meters", 4_000_000)  # an append of ~10 s here
    try:
        assert answer(worker, 60) == "appending"
        with contextlib.closing(sqlite3.connect(path, timeout=0, isolation_level=None)) as probe:
            while True:  # until the append holds the write lock: inside its transaction
                try:
                    probe.execute("BEGIN IMMEDIATE")
                    probe.execute("ROLLBACK")
                except sqlite3.OperationalError:
                    break
        time.sleep(0.2)
        sent = time.monotonic()
        worker.send_signal(signal.SIGINT)
        assert answer(worker, 30) == "interrupted"
        assert time.monotonic() - sent < 3.0  # the end of one step of the computation, not of the append
        say(other, "release")
        took, outcome = answer(other, 10).split(" ", 1)
        assert outcome == "released" and float(took) < 1.0
    finally:
        for process in (worker, other):
            process.kill()
            process.communicate()
    assert meters.released().num_rows == 0 and budget.streams()["rows"].to_list() == [0]
    assert _consistent(path)[0] == 3  # the stream and the other process's two releases


@pytest.fixture
def python_sigint():
    """Python's own SIGINT handler (KeyboardInterrupt) for the test, whatever the runner was started
    with: a process started in the background by a non-interactive shell ignores SIGINT, and Python
    then installs no handler, so a SIGINT would do nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("own_handler", [False, True])
def test_an_interrupt_while_committing_is_handled_once_committed(tmp_path, monkeypatch, own_handler, python_sigint):
    """Python's handler (KeyboardInterrupt) or the program's own: held while the charge commits,
    handled right after, and the program's handler is installed again after."""
    budget = dpsql.Budget.open(tmp_path / "l.sqlite", epsilon=1.0)
    handled = []
    commit = budget.ledger.backend.commit

    def interrupted_commit(conn):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)  # Python's handlers run between bytecodes: here, unless held
        handled.append("committing")
        commit(conn)

    def handler(number, frame):
        handled.append("handled")

    monkeypatch.setattr(budget.ledger.backend, "commit", interrupted_commit)
    if own_handler:
        previous = signal.signal(signal.SIGINT, handler)
        try:
            budget.charge(CHARGE)
            assert signal.getsignal(signal.SIGINT) is handler
        finally:
            signal.signal(signal.SIGINT, previous)
    else:
        with pytest.raises(KeyboardInterrupt):
            budget.charge(CHARGE)
        handled.append("handled")
    assert handled == ["committing", "handled"]
    assert _consistent(tmp_path / "l.sqlite")[0] == 1 and not budget.ledger._conn.in_transaction


def test_the_body_of_a_transaction_is_interrupted_at_once_and_rolled_back(tmp_path, python_sigint):
    budget = dpsql.Budget.open(tmp_path / "l.sqlite", epsilon=1.0)
    with pytest.raises(KeyboardInterrupt), budget.ledger.transaction("compute inside a transaction") as conn:
        budget.ledger.execute(conn, "UPDATE scopes SET spent_epsilon = '1/2'")
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)  # interrupted at once
        raise AssertionError("not interrupted")
    assert budget.spent == (0.0, 0.0) and not budget.ledger._conn.in_transaction


def test_threads_charge_without_touching_signal_handlers(tmp_path):
    budget = dpsql.Budget.open(tmp_path / "l.sqlite", epsilon=1.0)
    installed = signal.getsignal(signal.SIGINT)
    seen = []

    def charge_twenty():
        for _ in range(20):
            budget.charge(CHARGE)
            seen.append(signal.getsignal(signal.SIGINT))

    threads = [threading.Thread(target=charge_twenty) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(seen) == 80 and set(seen) == {installed}
    assert _consistent(tmp_path / "l.sqlite")[0] == 80


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


@pytest.mark.skipif(os.geteuid() != 0, reason="drops root's privileges to make the file read-only for the writer")
def test_a_read_only_ledger_is_a_typed_error_naming_the_file(tmp_path):
    path = tmp_path / "l.sqlite"
    dpsql.Budget.open(path, epsilon=1.0).charge(CHARGE)
    os.chmod(tmp_path, 0o755)
    message = as_user("nobody", lambda: dpsql.Budget.open(path).charge(CHARGE) and "no error")
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
