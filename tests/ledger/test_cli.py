"""``dpsql ledger``: reads a ledger, never creates or changes one."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import io
import json
import os
import pwd
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import time
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from processes import as_user

import dpsql
from dpsql import cli
from dpsql.accounting import exact


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dpsql.cli", *map(str, args)], capture_output=True, text=True)


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_scopes_history_and_streams_are_shown_without_touching_the_file(tmp_path):
    path = tmp_path / "ledger.sqlite"
    budget = dpsql.Budget.open(path, scope="meters", epsilon=2.0)
    dpsql.laplace(np.ones(10), epsilon=0.5, upper=1.0, budget=budget, note="first")
    budget.stream("kwh", method="laplace", epsilon=0.25, order_by="t", value="v", upper=1.0)
    dpsql.Budget.open(path, scope="other", epsilon=1.0)
    del budget
    gc.collect()  # closes this process's connections now (a reference cycle would close one, and checkpoint, later)
    before = _digest(path)
    shown = _cli("ledger", path, "--history", "--streams")
    assert shown.returncode == 0, shown.stderr
    assert "meters" in shown.stdout and "1.25" in shown.stdout and "first" in shown.stdout and "kwh" in shown.stdout
    data = json.loads(_cli("ledger", path, "--json", "--history", "--streams", "--scope", "meters").stdout)
    assert [s["scope"] for s in data["scopes"]] == ["meters"]
    assert data["scopes"][0]["remaining_epsilon"] == 1.25
    assert [h["kind"] for h in data["history"]] == ["release", "stream"]
    assert data["streams"][0]["params"] == {"epsilon": 0.25, "upper": 1.0}
    assert _digest(path) == before


def test_a_missing_corrupt_or_unknown_ledger_is_an_error_and_nothing_is_created(tmp_path):
    missing = _cli("ledger", tmp_path / "missing.sqlite")
    assert missing.returncode == 2 and "no such file" in missing.stderr
    assert not (tmp_path / "missing.sqlite").exists()
    corrupt = tmp_path / "corrupt.sqlite"
    corrupt.write_bytes(b"not a ledger" * 100)
    refused = _cli("ledger", corrupt)
    assert refused.returncode == 2 and "not a readable dpsql ledger" in refused.stderr
    path = tmp_path / "ledger.sqlite"
    dpsql.Budget.open(path, epsilon=1.0)
    unknown = _cli("ledger", path, "--scope", "nope")
    assert unknown.returncode == 2 and "no scope named 'nope'" in unknown.stderr


def test_the_cli_reads_a_postgres_ledger(postgres_url):
    dpsql.Budget.open(postgres_url, scope="team", epsilon=3.0)
    shown = _cli("ledger", postgres_url, "--json")
    assert json.loads(shown.stdout)["scopes"][0]["scope"] == "team"



root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs two other OS users (tests give root's privileges up)")


@pytest.fixture
def shared_folder(tmp_path):
    """A folder everyone may write in (like a team's share), outside pytest's root-only one; and,
    first, one release and one reading in ``tmp_path``, which load every module they need: the
    forked children, whose users cannot read root's Python, then need none they lack."""
    warm = tmp_path / "warm-up.sqlite"
    _release(warm, epsilon=1.0)
    _cli_in_process("ledger", warm, "--json", "--history")
    folder = Path(tempfile.mkdtemp(prefix="dpsql-shared-"))
    folder.chmod(0o777)
    try:
        yield folder
    finally:
        shutil.rmtree(folder)


def _cli_in_process(*args) -> str:
    """``dpsql ...`` run by :func:`dpsql.cli.main` in this process: exit code, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main([str(a) for a in args])
    return f"{code}\n{out.getvalue()}{err.getvalue()}"


def _release(path, *, epsilon: float | None = None) -> str:
    """Release once (creating the ledger with ``epsilon``), as the process that then closes it."""
    budget = dpsql.Budget.open(path, epsilon=epsilon)
    dpsql.laplace(np.ones(10), epsilon=0.125, upper=1.0, budget=budget, fresh=True)
    budget.ledger.close()
    return "released"


def _files(folder) -> dict[str, int]:
    """The folder's files and their owners."""
    return {file.name: file.stat().st_uid for file in folder.iterdir()}


def _spent_as_shown(user: str, path) -> float:
    shown = as_user(user, lambda: _cli_in_process("ledger", path, "--json"))
    code, output = shown.split("\n", 1)
    assert code == "0", output
    return json.loads(output)["scopes"][0]["spent_epsilon"]


@root_only
@pytest.mark.parametrize("folder_mode", [0o777, 0o555])  # a shared folder; a read-only one
def test_another_user_reads_a_closed_ledger_creating_nothing_and_its_owner_releases_after(shared_folder,
                                                                                          folder_mode):
    path = shared_folder / "ledger.sqlite"
    assert as_user("daemon", lambda: _release(path, epsilon=2.0)) == "released"
    owned = _files(shared_folder)
    assert owned == {"ledger.sqlite": pwd.getpwnam("daemon").pw_uid}  # closed: no -wal, no -shm
    shared_folder.chmod(folder_mode)
    assert _spent_as_shown("nobody", path) == 0.125
    assert _files(shared_folder) == owned
    shared_folder.chmod(0o777)
    assert as_user("daemon", lambda: _release(path)) == "released"
    assert dpsql.Budget.open(path).spent == (0.25, 0.0)


@root_only
def test_another_user_reads_an_open_ledger_through_its_log_in_a_read_only_folder(shared_folder):
    """A process has the ledger open: its last charges are in the -wal, not yet in the file."""
    path = shared_folder / "ledger.sqlite"
    budget = dpsql.Budget.open(path, epsilon=2.0)
    _release(path)
    _release(path)
    owned = _files(shared_folder)
    assert set(owned) == {"ledger.sqlite", "ledger.sqlite-wal", "ledger.sqlite-shm"}
    shared_folder.chmod(0o555)
    assert _spent_as_shown("nobody", path) == 0.25
    assert _files(shared_folder) == owned
    shared_folder.chmod(0o777)
    _release(path)
    assert budget.spent == (0.375, 0.0)


@root_only
def test_a_ledger_another_user_may_not_read_is_a_typed_error_naming_it(shared_folder):
    path = shared_folder / "ledger.sqlite"
    _release(path, epsilon=2.0)
    path.chmod(0o600)
    code, output = as_user("nobody", lambda: _cli_in_process("ledger", path)).split("\n", 1)
    assert code == "2" and str(path) in output and "cannot be read" in output
    assert _files(shared_folder) == {"ledger.sqlite": 0}


def test_a_log_without_its_index_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "ledger.sqlite"
    budget = dpsql.Budget.open(path, epsilon=2.0)
    _release(path)
    for suffix in ("", "-wal"):  # a copy of an open ledger, without its -shm
        shutil.copy(f"{path}{suffix}", tmp_path / f"copy.sqlite{suffix}")
    refused = _cli("ledger", tmp_path / "copy.sqlite")
    assert refused.returncode == 2 and str(tmp_path / "copy.sqlite") in refused.stderr and "-shm" in refused.stderr
    assert not (tmp_path / "copy.sqlite-shm").exists()
    budget.ledger.close()


@pytest.mark.parametrize("state", ["closed", "open"])
def test_the_cli_connection_cannot_write_an_sqlite_ledger(tmp_path, state):
    path = tmp_path / "ledger.sqlite"
    budget = dpsql.Budget.open(path, epsilon=2.0)
    if state == "closed":
        budget.ledger.close()
    conn = cli.connect(str(path))
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        conn.execute("UPDATE scopes SET epsilon = '1000'")
    conn.close()
    assert dpsql.Budget.open(path).total == (2.0, 0.0)


def test_the_cli_connection_cannot_write_a_postgres_ledger(postgres_url):
    import psycopg

    dpsql.Budget.open(postgres_url, epsilon=2.0)
    conn = cli.connect(postgres_url)
    with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
        conn.execute("UPDATE scopes SET epsilon = '1000'")
    conn.close()
    assert dpsql.Budget.open(postgres_url).total == (2.0, 0.0)


def test_reads_while_processes_open_charge_and_close_the_ledger_are_consistent(tmp_path):
    """Each writer's close checkpoints the -wal into the file and deletes it: the CLI reads
    through the -wal or, when there is none, the file alone, and every read adds up."""
    path = tmp_path / "ledger.sqlite"
    dpsql.Budget.open(path, epsilon=1000.0).ledger.close()
    writer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import dpsql
        from dpsql.accounting import Charge, Neighbour
        charge = Charge(method="laplace", epsilon=1e-3, delta=0.0, neighbour=Neighbour.REPLACE_ONE, rows=1)
        print("writing", flush=True)
        while True:
            budget = dpsql.Budget.open({str(path)!r})
            budget.charge(charge)
            budget.ledger.close()
    """)], stdout=subprocess.PIPE)
    try:
        assert writer.stdout.readline().strip() == b"writing"
        seen, started = set(), time.monotonic()
        while len(seen) < 20 and time.monotonic() - started < 30:
            found = cli.read(str(path))
            spent = sum((exact(entry["epsilon"]) for entry in found["history"]), Fraction(0))
            assert found["scopes"][0]["spent_epsilon"] == float(spent)
            seen.add(len(found["history"]))
    finally:
        writer.kill()
        writer.wait()
    assert len(seen) == 20  # the reads saw the ledger change
