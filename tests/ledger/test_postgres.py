"""The PostgreSQL ledger against a real server: the SQLite ledger's semantics, shared by
processes racing for one scope, surviving killed clients and a restarted server."""

from __future__ import annotations

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

CHARGE = Charge(method="laplace", epsilon=0.01, delta=0.0, neighbour=Neighbour.REPLACE_ONE, rows=1)


def _totals(url):
    import psycopg

    with psycopg.connect(url) as conn:
        rows = [exact(e) for (e,) in conn.execute("SELECT epsilon FROM charges WHERE kind = 'release'")]
        spent, count = conn.execute("SELECT spent_epsilon, charges FROM scopes WHERE scope = 'default'").fetchone()
    assert Fraction(spent) == sum(rows, Fraction(0)) and count == len(rows)
    return len(rows), Fraction(spent)


def test_the_ledger_works_on_postgres_as_on_sqlite(postgres_url):
    budget = dpsql.Budget.open(postgres_url, epsilon=1.0)
    values = np.arange(5000) % 13.0
    first = dpsql.tops(values, epsilon=0.25, upper=20.0, m=500, budget=budget)
    again = dpsql.tops(values, epsilon=0.25, upper=20.0, m=500, budget=budget)
    assert again.release_id == first.release_id and budget.spent == (0.25, 0.0)
    record = dpsql.Budget.open(postgres_url).release(first.release_id)
    assert record.range_variance(0, 5000) == first.range_variance(0, 5000)
    for _ in range(75):
        budget.charge(CHARGE)
    with pytest.raises(dpsql.BudgetExhausted):
        budget.charge(CHARGE)
    assert budget.history()["kind"].to_list()[:2] == ["release", "cache hit"]
    assert "***" not in budget.location and "postgres@127.0.0.1" in budget.location


def test_streams_on_postgres_continue_from_another_process(postgres_url):
    budget = dpsql.Budget.open(postgres_url, epsilon=1.0)
    stream = budget.stream("kwh", method="hierarchy", epsilon=0.5, order_by="ts", value="kwh", partition_by="meter",
                           upper=10.0, r=256, depth=0)
    frame = pl.DataFrame({"meter": np.arange(3000) % 3, "ts": np.arange(3000), "kwh": np.ones(3000)})
    stream.append(frame.head(1000))
    code = f"""
        import dpsql, numpy as np, polars as pl
        frame = pl.DataFrame({{"meter": np.arange(3000) % 3, "ts": np.arange(3000), "kwh": np.ones(3000)}})
        print(dpsql.Budget.open({postgres_url!r}).stream("kwh").append(frame.slice(900)).num_rows)
    """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "2100"
    released = stream.released()
    assert released.num_rows == 3000 and len(set(released["dp_row"].to_pylist())) == 3000
    assert budget.spent == (0.5, 0.0)


def test_eight_processes_racing_one_scope_never_exceed_the_cap(postgres_url):
    dpsql.Budget.open(postgres_url, epsilon=3.0)
    code = f"""
        import dpsql
        from dpsql.accounting import Charge, Neighbour
        budget = dpsql.Budget.open({postgres_url!r})
        charge = Charge(method="laplace", epsilon=0.01, delta=0.0, neighbour=Neighbour.REPLACE_ONE, rows=1)
        accepted = 0
        for _ in range(50):
            try:
                budget.charge(charge)
                accepted += 1
            except dpsql.BudgetExhausted:
                pass
        print(accepted)
    """
    workers = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True)
               for _ in range(8)]
    accepted = sum(int(w.communicate(timeout=300)[0]) for w in workers)
    count, spent = _totals(postgres_url)
    assert accepted == count == 300 and spent == Fraction(3)


def test_a_client_killed_mid_transaction_charges_nothing_twice(postgres_url):
    dpsql.Budget.open(postgres_url, epsilon=100.0)
    code = f"""
        import dpsql, time
        from dpsql.accounting import Charge, Neighbour
        budget = dpsql.Budget.open({postgres_url!r})
        charge = Charge(method="laplace", epsilon=0.01, delta=0.0, neighbour=Neighbour.REPLACE_ONE, rows=1)
        budget.charge(charge)
        with budget.ledger.transaction("hold a scope") as conn:  # a charge that never finishes
            budget.ledger.execute(conn, "SELECT spent_epsilon FROM scopes WHERE scope = 'default' FOR UPDATE")
            print("holding", flush=True)
            time.sleep(60)
    """
    worker = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE)
    assert worker.stdout.readline().strip() == b"holding"
    worker.kill()
    worker.wait()
    budget = dpsql.Budget.open(postgres_url)
    started = time.monotonic()
    budget.charge(CHARGE)  # the server rolled the dead client back and released its lock
    assert time.monotonic() - started < 30
    assert _totals(postgres_url) == (2, Fraction(2, 100))


def test_a_server_restart_between_two_charges_loses_nothing(postgres, postgres_url):
    budget = dpsql.Budget.open(postgres_url, epsilon=1.0)
    budget.charge(CHARGE)
    postgres.restart()
    with pytest.raises(dpsql.LedgerError, match="cannot be reached or went away") as lost:
        budget.charge(CHARGE)  # the connection died with the server: refused, nothing charged
    assert "Nothing was charged" in str(lost.value)
    budget.charge(CHARGE)  # reconnects
    assert _totals(postgres_url) == (2, Fraction(2, 100))
    assert budget.spent == (0.02, 0.0)


def test_unreachable_and_wrong_servers_are_typed_errors_without_the_password(postgres):
    with pytest.raises(dpsql.LedgerError, match="cannot be reached") as refused:
        dpsql.Budget.open("postgresql://ana:s3cret@127.0.0.1:1/nowhere", epsilon=1.0)
    assert "s3cret" not in str(refused.value) and "ana@127.0.0.1:1" in str(refused.value)
    with pytest.raises(dpsql.LedgerError) as missing:
        dpsql.Budget.open(postgres.url_of("no_such_database"), epsilon=1.0)
    assert "no_such_database" in str(missing.value)


def test_a_server_going_away_mid_charge_releases_nothing_and_charges_nothing(postgres, postgres_url, monkeypatch):
    budget = dpsql.Budget.open(postgres_url, epsilon=1.0)
    budget.charge(CHARGE)
    values = np.arange(4000) % 11.0
    backend = budget.ledger.backend
    commit = backend.commit

    def server_stops_then_commit(conn):  # the charge's rows are written, the server dies before COMMIT
        postgres.stop("immediate")
        commit(conn)

    monkeypatch.setattr(backend, "commit", server_stops_then_commit)
    try:
        with pytest.raises(dpsql.LedgerError, match="cannot be reached or went away") as lost:
            dpsql.laplace(values, epsilon=0.5, upper=20.0, budget=budget)
    finally:
        monkeypatch.undo()
        postgres.start()
    assert "check history() before retrying" in str(lost.value)  # the commit's fate is unknown to the client
    assert lost.value.__context__ is None and all(isinstance(a, str) for a in lost.value.args)
    assert _totals(postgres_url) == (1, Fraction(1, 100))  # the server rolled the transaction back
    release = dpsql.laplace(values, epsilon=0.5, upper=20.0, budget=budget)  # reconnects; charged once
    assert _totals(postgres_url) == (2, Fraction(51, 100)) and budget.spent == (0.51, 0.0)
    assert budget.history(full=True)["release_id"].to_list()[-1] == release.release_id


def test_the_password_never_appears_in_history_errors_logs_or_the_cli(postgres, postgres_url, caplog):
    import logging

    caplog.set_level(logging.DEBUG)
    secret = "pa55-Sesame"
    database = postgres_url.rsplit("/", 1)[1]
    urls = [f"postgresql://postgres:{secret}@127.0.0.1:{postgres.port}/{database}",  # trust: any password works
            f"postgresql://127.0.0.1:{postgres.port}/{database}?user=postgres&password={secret}"]
    budget = dpsql.Budget.open(urls[0], epsilon=1.0, delta=1e-6)
    release = dpsql.laplace(np.arange(100) % 3.0, epsilon=0.25, upper=3.0, budget=budget, note="with a password")
    dpsql.laplace(np.arange(100) % 3.0, epsilon=0.25, upper=3.0, budget=budget)  # a cache hit
    shown = [budget.location, repr(budget), repr(budget.history(full=True).rows()),
             repr(budget.release(release.release_id)), repr(budget.streams().rows())]
    errors, locations = [], []
    for url in urls:
        other = dpsql.Budget.open(url)
        locations.append(other.location)
        too_much = Charge(method="laplace", epsilon=5.0, delta=0.0, neighbour=Neighbour.REPLACE_ONE)
        for attempt, argument in ((lambda u: dpsql.Budget.open(u, epsilon=2.0), url),  # a different total
                                  (lambda u: dpsql.Budget.open(u, scope="missing"), url),
                                  (other.charge, too_much), (other.release, "no-such-release")):
            with pytest.raises(dpsql.DPError) as refused:
                attempt(argument)
            errors.append(refused.value)
    postgres.restart()
    with pytest.raises(dpsql.LedgerError, match="went away") as lost:
        budget.charge(CHARGE)
    errors.append(lost.value)
    malformed = f"postgresql://postgres:{secret}@[127.0.0.1/{database}"
    with pytest.raises(dpsql.LedgerError, match="not a valid PostgreSQL connection URL") as invalid:
        dpsql.Budget.open(malformed, epsilon=1.0)
    errors.append(invalid.value)
    for error in errors:
        chain = [error, error.__cause__, error.__context__]
        shown += [repr(e) for e in chain if e is not None] + [str(e) for e in chain if e is not None]
    for args in (["--history", "--streams"], ["--scope", "missing"], ["--json", "--history"]):
        for url in [*urls, malformed]:
            out = subprocess.run([sys.executable, "-m", "dpsql.cli", "ledger", url, *args], capture_output=True,
                                 text=True)
            shown += [out.stdout, out.stderr]
    leaked = [text for text in shown + locations + [caplog.text] if secret in text]
    assert not leaked
    assert "postgres@127.0.0.1" in locations[0] and "password=***" in locations[1]
    assert any("no scope named 'missing'" in text for text in shown)


def test_a_lock_held_too_long_is_a_typed_error_and_charges_nothing(postgres_url, monkeypatch):
    from dpsql.ledger import postgres as postgres_backend

    dpsql.Budget.open(postgres_url, epsilon=1.0)
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import psycopg, time
        with psycopg.connect({postgres_url!r}) as conn:  # a transaction holding the scope's row
            conn.execute("SELECT 1 FROM scopes WHERE scope = 'default' FOR UPDATE")
            print("locked", flush=True)
            time.sleep(60)
    """)], stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == b"locked"
        monkeypatch.setattr(postgres_backend, "LOCK_TIMEOUT_MS", 300)
        budget = dpsql.Budget.open(postgres_url)
        with pytest.raises(dpsql.LedgerError, match=r"held the ledger's lock for more than 0\.3 s") as refused:
            dpsql.laplace(np.ones(100), epsilon=0.5, upper=1.0, budget=budget)
        assert "postgres@127.0.0.1" in str(refused.value) and "Nothing was charged" in str(refused.value)
    finally:
        holder.kill()
        holder.wait()
    dpsql.laplace(np.ones(100), epsilon=0.5, upper=1.0, budget=budget)
    assert _totals(postgres_url) == (1, Fraction(1, 2))


def test_a_forked_child_charges_through_its_own_connection(postgres_url):
    """The parent's connection is never used (nor closed) by a forked child: both keep charging."""
    budget = dpsql.Budget.open(postgres_url, epsilon=1.0)
    budget.charge(CHARGE)
    parent_backend = budget.ledger._conn.info.backend_pid
    def charge_twice():
        budget.charge(CHARGE)
        budget.charge(CHARGE)
        return budget.ledger._conn.info.backend_pid

    child_backend = in_forked_child(charge_twice)
    assert child_backend.isdigit() and int(child_backend) != parent_backend, child_backend
    budget.charge(CHARGE)  # the parent's connection still works
    assert budget.ledger._conn.info.backend_pid == parent_backend
    assert _totals(postgres_url) == (4, Fraction(4, 100))


def test_a_role_without_write_rights_is_a_typed_error_and_charges_nothing(postgres, postgres_url):
    import psycopg

    budget = dpsql.Budget.open(postgres_url, epsilon=1.0)
    budget.charge(CHARGE)
    database = postgres_url.rsplit("/", 1)[1]
    role = f"reader_{time.time_ns()}"  # roles are the server's, shared by every test database
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN")
        conn.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {role}")
    reader = f"postgresql://{role}@127.0.0.1:{postgres.port}/{database}"
    read_only = dpsql.Budget.open(reader)  # reading needs no write rights
    assert read_only.spent == (0.01, 0.0)
    with pytest.raises(dpsql.LedgerError, match="may not write the ledger's tables") as refused:
        dpsql.laplace(np.ones(100), epsilon=0.5, upper=1.0, budget=read_only)
    assert f"{role}@127.0.0.1" in str(refused.value) and "Nothing was charged" in str(refused.value)
    empty = postgres.url(f"t_empty_{time.time_ns()}").rsplit("/", 1)[1]
    other = f"postgresql://{role}@127.0.0.1:{postgres.port}/{empty}"
    with pytest.raises(dpsql.LedgerError, match="may not write"):  # cannot create a new ledger's tables
        dpsql.Budget.open(other, epsilon=1.0)
    assert _totals(postgres_url) == (1, Fraction(1, 100))
