"""``dpsql ledger``: reads a ledger, never creates or changes one."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import numpy as np

import dpsql


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
