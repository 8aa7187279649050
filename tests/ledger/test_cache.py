"""The answer cache answers only the principal who made a release, never mixes seeded and private
releases, compares parameters exactly, and keeps what recomputes a release, not its values."""

from __future__ import annotations

import contextlib
import os
import pwd
import sqlite3
import subprocess
import sys

import numpy as np
import pytest

import dpsql
from dpsql import _state

EPSILON = 0.05
KNOWN = np.arange(200) % 20.0  # everything the guesser knows of the data: all but row 100
SECRET = 13.0


def _data(value: float) -> np.ndarray:
    data = KNOWN.copy()
    data[100] = value
    return data


def _release(budget: dpsql.Budget, value: float) -> dpsql.Release:
    return dpsql.laplace(_data(value), epsilon=EPSILON, upper=20.0, budget=budget)


def _guess(budget: dpsql.Budget, value: float, theirs: dpsql.Release) -> tuple:
    """What the guesser sees of one guess: what it cost them, what the history says of it (its
    last row), and whether they were handed the other principal's release."""
    before = budget.spent
    release = _release(budget, value)
    last = budget.history().row(-1, named=True)
    handed = release.release_id == theirs.release_id or np.array_equal(release.values, theirs.values)
    return round(budget.spent[0] - before[0], 12), (last["kind"], last["epsilon"], last["rows"]), handed


def _attack(alice: dpsql.Budget, bob: dpsql.Budget) -> None:
    """Alice releases data with one secret value; Bob releases the same data with a wrong and with
    the right guess of it. Both guesses must be charged, fresh and look alike to Bob."""
    theirs = _release(alice, SECRET)
    wrong, right = (_guess(bob, value, theirs) for value in (SECRET - 1, SECRET))
    assert right == wrong == (EPSILON, ("release", EPSILON, len(KNOWN)), False)
    again = _release(alice, SECRET)  # Alice's own repeat is still answered from the ledger, free
    assert again.release_id == theirs.release_id and np.array_equal(again.values, theirs.values)
    assert alice.spent == pytest.approx((3 * EPSILON, 0.0))
    history = alice.history(full=True)
    assert history["kind"].to_list() == ["release", "release", "release", "cache hit"]
    assert history["principal"].to_list() == [alice.principal, bob.principal, bob.principal, alice.principal]


def _roles(postgres, url: str, names: list[str]) -> dict[str, str]:
    """Login roles ``names`` allowed to use the ledger's tables (made by the admin who created it),
    and their URLs."""
    import psycopg

    with psycopg.connect(postgres.url_of("postgres"), autocommit=True) as conn:
        for name in names:
            if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (name,)).fetchone() is None:
                conn.execute(f"CREATE ROLE {name} LOGIN")
    with psycopg.connect(url, autocommit=True) as conn:
        for name in names:
            conn.execute(f"GRANT USAGE ON SCHEMA public TO {name}")
            conn.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {name}")
            conn.execute(f"GRANT USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA public TO {name}")
    return {name: url.replace("postgres@", f"{name}@", 1) for name in names}


def test_on_a_team_postgres_ledger_another_role_guessing_the_data_is_charged_fresh_right_or_wrong(
        postgres, postgres_url):
    import psycopg

    dpsql.Budget.open(postgres_url, scope="team", epsilon=1.0)  # the admin creates the ledger and scope
    urls = _roles(postgres, postgres_url, ["alice", "bob"])
    alice, bob = (dpsql.Budget.open(urls[name], scope="team") for name in ("alice", "bob"))
    _attack(alice, bob)
    assert (alice.principal, bob.principal) == ("alice", "bob")
    # the stored keys are each role's own: Bob's SQL sees none of Alice's answers
    with psycopg.connect(urls["bob"]) as conn:
        assert {row[0] for row in conn.execute("SELECT principal FROM answers")} == {"bob"}
    with pytest.raises(dpsql.InvalidParameter, match=r"principal='alice' is refused.*'bob'"):
        dpsql.Budget.open(urls["bob"], scope="team", principal="alice")


def test_on_a_shared_sqlite_file_named_principals_get_only_their_own_answers(tmp_path):
    path = tmp_path / "team.sqlite"
    alice = dpsql.Budget.open(path, epsilon=1.0, principal="alice")
    bob = dpsql.Budget.open(path, principal="bob")
    _attack(alice, bob)
    assert "principal='bob'" in repr(bob)
    with pytest.raises(dpsql.InvalidParameter, match="principal must be a non-empty string"):
        dpsql.Budget.open(path, principal="")


def test_an_sqlite_ledgers_principal_is_the_os_user_by_uid_whatever_the_environment(tmp_path):
    path = tmp_path / "mine.sqlite"
    code = (f"import dpsql; b = dpsql.Budget.open({str(path)!r}, epsilon=1.0); "
            "dpsql.laplace([1.0, 2.0], epsilon=0.5, upper=2.0, budget=b); print(b.principal)")
    environment = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
                   "USER": "someone-else", "LOGNAME": "someone-else"}  # no HOME; USER and LOGNAME lie
    shown = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True,
                           check=True).stdout.strip()
    me = pwd.getpwuid(os.getuid()).pw_name
    assert shown == me
    assert dpsql.Budget.open(path).history(full=True)["principal"].to_list() == [me]


def _seeded_or_private(kind: str, budget: dpsql.Budget) -> dpsql.Release:
    with dpsql.testing.seeded(4) if kind == "seeded" else contextlib.nullcontext():
        return dpsql.laplace(np.arange(1000) % 7.0, epsilon=0.5, upper=7.0, budget=budget)


def test_seeded_and_private_releases_never_answer_each_other():
    for first, second in (("seeded", "private"), ("private", "seeded")):
        budget = dpsql.Budget.in_memory(epsilon=10.0)
        made = {kind: _seeded_or_private(kind, budget) for kind in (first, second)}
        assert budget.spent == (1.0, 0.0), f"the {second} call was answered with the {first} release"
        assert made["seeded"].release_id != made["private"].release_id
        assert (made["seeded"].private, made["private"].private) == (False, True)
        assert not np.array_equal(made["seeded"].values, made["private"].values)
        for kind in (first, second):  # each is still answered to its own kind
            again = _seeded_or_private(kind, budget)
            assert again.release_id == made[kind].release_id and np.array_equal(again.values, made[kind].values)
        assert budget.history()["kind"].to_list() == ["release", "release", "cache hit", "cache hit"]


def test_a_seeded_call_after_a_private_release_on_a_persistent_ledger_is_refused_not_answered(tmp_path):
    budget = dpsql.Budget.open(tmp_path / "l.sqlite", epsilon=1.0)
    dpsql.laplace(np.ones(100), epsilon=0.5, upper=1.0, budget=budget)
    with dpsql.testing.seeded(0), pytest.raises(dpsql.NonPrivateRelease):
        dpsql.laplace(np.ones(100), epsilon=0.5, upper=1.0, budget=budget)
    assert budget.spent == (0.5, 0.0) and budget.history()["kind"].to_list() == ["release"]


def test_parameters_are_compared_by_their_exact_value():
    """An integer and a float of the same value ask for one release, in either order (SQL's
    ``upper := 8000``, Python's ``upper=8000.0``); integers are never rounded to floats."""
    values = np.arange(1000) % 11.0
    for given, repeated in ((8000, 8000.0), (8000.0, np.int64(8000)), (np.float32(8000), 8000)):
        budget = dpsql.Budget.in_memory(epsilon=10.0)
        first = dpsql.laplace(values, epsilon=0.5, upper=given, budget=budget)
        again = dpsql.laplace(values, epsilon=0.5, upper=repeated, budget=budget)
        assert again.release_id == first.release_id and budget.spent == (0.5, 0.0)
        assert dpsql.laplace(values, epsilon=0.5, upper=8000.5, budget=budget).release_id != first.release_id
    budget = dpsql.Budget.in_memory(epsilon=10.0)
    exact = dpsql.binary_tree(values, epsilon=1.0, upper=20.0, horizon=2**53, budget=budget)
    beyond = dpsql.binary_tree(values, epsilon=1.0, upper=20.0, horizon=2**53 + 1, budget=budget)
    assert beyond.release_id != exact.release_id and beyond.params["horizon"] == 2**53 + 1
    assert budget.spent == (2.0, 0.0)


def test_order_keys_with_nulls_are_other_data_than_with_what_their_slots_hold():
    """A NULL order key's slot holds anything (an empty string, 0.0): a release whose keys hold a
    NULL there is another request than one with that value, charged anew; an identical repeat
    is still free."""
    import pyarrow as pa

    values = np.arange(4.0)
    for with_null, filled in ((pa.array(["a", None, "c", "d"]), pa.array(["a", "", "c", "d"])),
                              (pa.array([1.0, None, 3.0, 4.0]), pa.array([1.0, float("nan"), 3.0, 4.0]))):
        budget = dpsql.Budget.in_memory(epsilon=10.0)
        first = dpsql.publish("laplace", values, order_keys=[with_null], epsilon=1.0, upper=5.0, budget=budget)
        other = dpsql.publish("laplace", values, order_keys=[filled], epsilon=1.0, upper=5.0, budget=budget)
        assert other.release_id != first.release_id and budget.spent == (2.0, 0.0)
        again = dpsql.publish("laplace", values, order_keys=[with_null], epsilon=1.0, upper=5.0, budget=budget)
        assert again.release_id == first.release_id and budget.spent == (2.0, 0.0)


def _ledger_bytes(path) -> int:
    """The ledger's size with every committed page in the main file."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        return conn.execute("PRAGMA page_count").fetchone()[0] * conn.execute("PRAGMA page_size").fetchone()[0]


def test_the_ledger_keeps_what_recomputes_a_release_not_its_values(tmp_path):
    path = tmp_path / "l.sqlite"
    budget = dpsql.Budget.open(path, epsilon=10.0)
    values = np.random.default_rng(0).uniform(0, 20, 1_000_000)  # 8 MB of values, released three times
    methods = {"laplace": {}, "tops": {"m": 1000}, "hierarchy": {}}
    before = _ledger_bytes(path)
    releases = {method: dpsql.publish(method, values, budget=budget, epsilon=1.0, upper=20.0, **params)
                for method, params in methods.items()}
    assert _ledger_bytes(path) - before < 3 * 64 * 1024
    with contextlib.closing(sqlite3.connect(path)) as conn:
        assert max(length for (length,) in conn.execute("SELECT length(answer) FROM answers")) <= 32
    for method, release in releases.items():  # recomputed exactly
        again = dpsql.publish(method, values, budget=budget, epsilon=1.0, upper=20.0, **methods[method])
        assert again.release_id == release.release_id and np.array_equal(again.values, release.values)
        assert again.range_variance(10, 900_000) == release.range_variance(10, 900_000)
    assert budget.spent == (3.0, 0.0) and budget.history()["kind"].to_list()[3:] == ["cache hit"] * 3


def test_an_answer_whose_recomputation_differs_from_the_release_is_not_given(tmp_path):
    """As if the algorithm had changed since the release: the recomputed values are not the ones
    released, and handing them out would release the data a second time, free."""
    path = tmp_path / "l.sqlite"
    budget = dpsql.Budget.open(path, epsilon=1.0)
    values = np.arange(500) % 9.0
    first = dpsql.laplace(values, epsilon=0.25, upper=9.0, budget=budget)
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        conn.execute("UPDATE answers SET secret = ?", (bytes(32),))
    second = dpsql.laplace(values, epsilon=0.25, upper=9.0, budget=budget)
    assert second.release_id != first.release_id and budget.spent == (0.5, 0.0)
    third = dpsql.laplace(values, epsilon=0.25, upper=9.0, budget=budget)  # the fresh release's answer
    assert third.release_id == second.release_id and np.array_equal(third.values, second.values)
    assert budget.history()["kind"].to_list() == ["release", "release", "cache hit"]


def test_answers_of_an_older_ledger_are_kept_but_answer_no_one(tmp_path):
    """A version-3 ledger stored answers' values, with no principal: whose they were is unknown,
    so after the upgrade they answer nobody (the repeat is charged, then answered as usual)."""
    path = tmp_path / "old.sqlite"
    budget = dpsql.Budget.open(path, epsilon=1.0)
    values = np.arange(300) % 5.0
    old = dpsql.laplace(values, epsilon=0.25, upper=5.0, budget=budget)
    budget.ledger.close()
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:  # back to version 3's tables and answer
        for table, column in (("answers", "principal"), ("answers", "private"), ("answers", "secret"),
                              ("charges", "principal")):
            conn.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
        conn.execute("UPDATE answers SET answer = ?, fingerprint = ?",  # an older fingerprint, of no principal
                     (_state.pack({"values": old.values}), "f" * 64))
        conn.execute("UPDATE ledger_meta SET value = '3' WHERE key = 'version'")
    upgraded = dpsql.Budget.open(path)
    assert upgraded.history(full=True)["principal"].to_list() == [None]
    repeat = dpsql.laplace(values, epsilon=0.25, upper=5.0, budget=upgraded)
    assert repeat.release_id != old.release_id and upgraded.spent == (0.5, 0.0)
    again = dpsql.laplace(values, epsilon=0.25, upper=5.0, budget=upgraded)
    assert again.release_id == repeat.release_id and upgraded.spent == (0.5, 0.0)
    assert upgraded.clear_cache() == 2  # the old answer and the new one
