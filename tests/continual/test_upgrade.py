"""A ledger written by round 2's dpsql (a row of state per stream partition, a chunk per append and
partition, per-partition noise sub-keys) is converted by the next append and continues exactly.

``tests/data/round2_streams.sqlite`` was made by dpsql 0.2.0 (commit 28083f4): streams ``hier``,
``tops`` and ``lap`` (3 meters) appended with the first 1,200 rows of ``round2_streams.parquet``,
and a count stream ``counts`` with the events of ``round2_events.parquet`` before hour 30 (closed up
to hour 20)."""

import shutil
import sqlite3
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow.compute as pc
import pytest

import dpsql
from dpsql.methods import machine_for
from dpsql.noise import LEGACY_SCHEME, Keystream
from dpsql.release import run_machine

DATA = Path(__file__).resolve().parents[1] / "data"
# round 2 chose ToPS's thresholds by Eq. 6, its default then (focus="paper" now): the stream keeps them
PARAMS = {"hier": ("hierarchy", {"upper": 60.0, "r": 1024}),
          "tops": ("tops", {"upper": 200.0, "m": 300, "r": 1024, "focus": "paper"}),
          "lap": ("laplace", {"upper": 60.0})}


@pytest.fixture
def ledger(tmp_path):
    path = tmp_path / "round2.sqlite"
    shutil.copy(DATA / "round2_streams.sqlite", path)
    return path


def _legacy_keystream(path, name) -> Keystream:
    with sqlite3.connect(path) as conn:
        secret = bytes(conn.execute("SELECT secret FROM streams WHERE name = ?", (name,)).fetchone()[0])
    assert len(secret) == 33  # round 2: the key and the private flag, no scheme
    return Keystream(secret[:32], private=secret[32] == 1, scheme=LEGACY_SCHEME)


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_a_round_two_stream_continues_exactly_after_its_conversion(ledger, name):
    frame = pl.read_parquet(DATA / "round2_streams.parquet")
    budget = dpsql.Budget.open(ledger, scope="round2")
    stream = budget.stream(name)
    before = stream.released()  # read from the rows round 2 stored, before any conversion
    assert before.num_rows == stream.info()["rows"] and pc.all(before["dp_final"]).as_py()
    spent = budget.spent
    stream.append(frame)  # the whole table again: the first 1,200 rows repeat, the rest are new
    after = stream.released()
    assert after.num_rows == frame.height and budget.spent == spent
    with sqlite3.connect(ledger) as conn:  # converted: the per-partition rows are gone
        assert conn.execute("SELECT count(*) FROM stream_partitions WHERE release_id = (SELECT release_id FROM "
                            "streams WHERE name = ?)", (name,)).fetchone()[0] == 0
    method, params = PARAMS[name]
    keystream = _legacy_keystream(ledger, name)
    final = after.filter(after["dp_final"])
    for meter in range(3):
        values = frame.filter(pl.col("meter") == meter)["kwh"].to_numpy()
        machine = machine_for(method, len(values), keystream.partition(b"i%d" % meter), {"epsilon": 1.0, **params})
        expected = run_machine(machine, [values], len(values))
        mine = final.filter(pc.equal(final["meter"], meter))["kwh"].to_numpy()
        assert len(mine) > len(values) - 300 and np.array_equal(mine, expected[:len(mine)])
        kept = before.filter(pc.equal(before["meter"], meter))
        assert np.array_equal(kept["kwh"].to_numpy(), mine[:kept.num_rows])  # round 2's rows unchanged


def test_a_round_two_count_stream_continues_exactly(ledger):
    events = pl.read_parquet(DATA / "round2_events.parquet")
    budget = dpsql.Budget.open(ledger, scope="round2")
    stream = budget.stream("counts")
    before = stream.released()
    assert before.num_rows == 3 * 20
    stream.append(events.filter(pl.col("t") >= 30), until=48.0)
    after = stream.released().sort_by([("ap", "ascending"), ("t", "ascending")])
    assert after.num_rows == 3 * 48
    keystream = _legacy_keystream(ledger, "counts")
    for ap in range(3):
        counts = np.bincount(events.filter(pl.col("ap") == ap)["t"].cast(pl.Int64).to_numpy(), minlength=48)
        machine = machine_for("count_laplace", 48, keystream.partition(b"i%d" % ap), {"epsilon": 1.0})
        expected = run_machine(machine, [counts[:48].astype(np.float64)], 48)
        assert np.array_equal(after.filter(pc.equal(after["ap"], ap))["count"].to_numpy(), expected)


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_a_changed_value_of_a_round_two_row_is_refused(ledger, name):
    """Round 2 kept 64-bit tags; a ``laplace`` stream now tells a change by the row's release, drawn
    from the address round 2 drew it from: either way, the recorded rows are kept and the change refused."""
    frame = pl.read_parquet(DATA / "round2_streams.parquet").head(1_200)
    stream = dpsql.Budget.open(ledger, scope="round2").stream(name)
    recorded = stream.released()
    assert stream.append(frame.filter(pl.col("meter") == 1)).num_rows > 0  # a repeat (converts the stream)
    changed = frame.with_columns(pl.when(pl.int_range(pl.len()) == 450).then(pl.col("kwh") + 1.0)
                                 .otherwise(pl.col("kwh")).alias("kwh"))
    with pytest.raises(dpsql.ConflictingRow, match="appended before with another value"):
        stream.append(changed)
    assert stream.released().equals(recorded)
