"""A ``laplace`` stream keeps no value tags: a row appended again is told from a changed one by
releasing its value again with the row's own draw and comparing with the recorded release.

Through the public path (appends, a reopened ledger, another process): repeats come back as
recorded and change nothing; a value whose release would differ is a ConflictingRow that keeps
nothing; values the release cannot tell apart (the same lattice point, or both beyond a bound) are
repeats. The release made for the comparison never leaves: only the recorded one does."""

from __future__ import annotations

import contextlib
import sqlite3
import subprocess
import sys
import textwrap

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest

import dpsql
from dpsql._chunks import table_of
from dpsql.mechanisms.laplace import LatticeBatch
from dpsql.noise import Keystream, Lane
from dpsql.streams.laplace import LaplaceStream

UPPER = 50.0
STEP = 2.0**-7  # the lattice step at sensitivity 50: 2**(floor(log2 50) - 12)


def _day(meters: int, day: int) -> pl.DataFrame:
    rng = np.random.default_rng(day)
    start = np.datetime64("2026-01-01T00:00") + np.timedelta64(24 * day, "h")
    hours = (start + np.arange(24).astype("timedelta64[h]")).astype("datetime64[us]")
    return pl.DataFrame({"meter": np.repeat(np.arange(meters), 24), "ts": np.tile(hours, meters),
                         "kwh": np.round(rng.gamma(2.0, 1.5, 24 * meters), 3)})


def _stored(path):
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return (conn.execute("SELECT shard, data FROM stream_state ORDER BY release_id, shard").fetchall(),
                conn.execute("SELECT ordinal, first_row, rows, data FROM stream_rows ORDER BY rowid").fetchall())


def _frames(error: BaseException) -> list[str]:
    names, tb = [], error.__traceback__
    while tb is not None:
        names.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    return names


def _fleet(path, method="laplace", **params):
    return dpsql.Budget.open(path, epsilon=10.0).stream(
        "meters", method=method, epsilon=1.0, order_by="ts", value="kwh", partition_by="meter", upper=UPPER, **params)


def test_release_at_gives_the_release_of_feed_bit_for_bit():
    keys = Keystream(bytes(32), private=False)
    draws = keys.partitions([b"a", b"b", b"c"])
    rng = np.random.default_rng(5)
    values = rng.uniform(-20.0, 80.0, (3, 600))  # clipped both ways
    machine = LaplaceStream(None, epsilon=0.7, upper=UPPER, lower=-3.5, noise=draws[0]).batched(draws)
    released = np.concatenate([machine.feed(values[:, :250]), machine.feed(values[:, 250:])], axis=1)
    partitions, indices = rng.integers(0, 3, 2_000), rng.integers(0, 600, 2_000)
    again = LaplaceStream(None, epsilon=0.7, upper=UPPER, lower=-3.5, noise=draws[0]).batched(draws)
    at = again.release_at(values[partitions, indices], partitions, indices)
    assert np.array_equal(at.view(np.int64), released[partitions, indices].view(np.int64))
    assert again.rows == 0  # the state is not changed
    # partitions of different sensitivities: each on its own lattice, with its own draws
    lattice = LatticeBatch(np.array([1.0, 1000.0, 1.0]), epsilon=0.5)
    lane = draws.lane(Lane.ROWS)
    whole = lattice.release(values, lane)
    assert np.array_equal(lattice.release_at(values[partitions, indices], lane, partitions, indices),
                          whole[partitions, indices])


def test_a_laplace_fleet_recognises_repeats_by_their_release_and_refuses_changed_values(tmp_path):
    path = tmp_path / "l.sqlite"
    stream = _fleet(path)
    first = stream.append(_day(40, 0))
    second = stream.append(_day(40, 1))
    stored = _stored(path)
    assert all("dp_tag" not in table_of(bytes(data)).column_names for *_, data in stored[1])
    spent = dpsql.Budget.open(path).spent

    again = stream.append(pl.concat([_day(40, 0), _day(40, 1)]).sort("meter", "ts"))  # a retry of both days
    expected = pl.concat([pl.from_arrow(first), pl.from_arrow(second)]).sort("meter", "ts")
    assert pl.from_arrow(again).select(expected.columns).equals(expected)
    assert _stored(path) == stored

    changes = [
        (1, 24 * 5 + 7, 1.0),  # a clear change
        (0, 0, 2 * STEP),  # two lattice steps: another lattice point
        (1, 24 * 39 + 23, -0.4),
    ]
    for day, row, delta in changes:
        changed = _day(40, day).with_columns(pl.when(pl.int_range(pl.len()) == row).then(pl.col("kwh") + delta)
                                             .otherwise(pl.col("kwh")).alias("kwh"))
        with pytest.raises(dpsql.ConflictingRow, match="appended before with another value") as refused:
            stream.append(changed)
        # the comparison's release never leaves: no frame that held it is reachable from the error
        assert _frames(refused.value)[-1] == "append" and refused.value.__context__ is None
        assert _stored(path) == stored
    assert dpsql.Budget.open(path).spent == spent

    # what the release cannot tell apart is the same value: the same lattice point
    day0 = _day(40, 0)
    lattice_point = np.rint(day0["kwh"].to_numpy() / STEP) * STEP
    same_point = day0.with_columns(pl.Series("kwh", lattice_point))
    assert not same_point["kwh"].equals(day0["kwh"])  # other values ...
    assert pl.from_arrow(stream.append(same_point)).equals(pl.from_arrow(first))  # ... the recorded release


def test_a_clipped_value_repeats_any_value_beyond_the_bound(tmp_path):
    path = tmp_path / "l.sqlite"
    stream = _fleet(path)
    frame = _day(5, 0).with_columns(pl.when(pl.col("ts").dt.hour() == 3).then(UPPER * 2).otherwise(pl.col("kwh"))
                                    .alias("kwh"))
    first = stream.append(frame)
    stored = _stored(path)
    beyond = frame.with_columns(pl.when(pl.col("ts").dt.hour() == 3).then(UPPER * 7).otherwise(pl.col("kwh"))
                                .alias("kwh"))
    assert pl.from_arrow(stream.append(beyond)).equals(pl.from_arrow(first))
    assert _stored(path) == stored
    inside = frame.with_columns(pl.when(pl.col("ts").dt.hour() == 3).then(UPPER - 1).otherwise(pl.col("kwh"))
                                .alias("kwh"))
    with pytest.raises(dpsql.ConflictingRow, match="order key"):
        stream.append(inside)
    assert _stored(path) == stored


def test_another_process_tells_repeats_and_changes_apart(tmp_path):
    path = tmp_path / "l.sqlite"
    first = _fleet(path).append(_day(30, 0))
    _day(30, 0).write_parquet(tmp_path / "day0.parquet")
    code = f"""
        import polars as pl, dpsql
        stream = dpsql.Budget.open({str(path)!r}).stream("meters")
        day = pl.read_parquet({str(tmp_path / "day0.parquet")!r})
        stream.append(day).to_pandas().to_parquet({str(tmp_path / "again.parquet")!r})
        try:
            stream.append(day.with_columns(pl.col("kwh") + 0.5))
        except dpsql.ConflictingRow as error:
            print("refused:", error)
    """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("refused: stream 'meters': order key")
    again = pq.read_table(tmp_path / "again.parquet")
    assert np.array_equal(again["kwh"].to_numpy(), first["kwh"].to_numpy())


def test_other_methods_keep_value_tags(tmp_path):
    """``hierarchy`` releases blocks: a row's release is not its own value's, so its tag is kept."""
    path = tmp_path / "l.sqlite"
    stream = _fleet(path, method="hierarchy")
    stream.append(_day(10, 0))
    assert all("dp_tag" in table_of(bytes(data)).column_names for *_, data in _stored(path)[1])
    with pytest.raises(dpsql.ConflictingRow):
        stream.append(_day(10, 0).with_columns(pl.col("kwh") + STEP / 8))  # below a lattice step: still told


def test_a_value_on_another_lattice_point_is_refused_where_adding_lower_back_rounds(tmp_path):
    """With ``lower`` far from 0 for its range (here just below 2**40, the range 1), adding it back
    to a release that lands above 2**40 rounds to a float step as wide as the lattice step: two
    neighbouring lattice points can give the same release. A stream whose release cannot tell its
    lattice points apart keeps value tags, so a changed value is still a ConflictingRow."""
    power, step = 2.0**40, 2.0**-12  # the lattice step at sensitivity 1; above 2**40, the float step too
    lower = power - 2000.5 * step  # the lower bound is a multiple of 2**-13 only: sums above 2**40 round
    path = tmp_path / "l.sqlite"
    stream = dpsql.Budget.open(path, epsilon=10.0).stream("far", method="laplace", epsilon=1.0, order_by="t",
                                                          value="v", lower=lower, upper=lower + 1.0)
    units = 1000 + np.arange(300) % 999  # values below 2**40, each exactly its lattice point
    frame = pl.DataFrame({"t": np.arange(300), "v": lower + units * step})
    assert np.array_equal(frame["v"].to_numpy() - lower, units * step)
    first = stream.append(frame)
    stored = _stored(path)
    rounded = np.flatnonzero(first["v"].to_numpy() >= power + 2 * step)[:4]  # releases where lower's addition rounds
    assert len(rounded)
    for row in rounded.tolist():
        for delta in (step, -step):  # the neighbouring lattice points: one of them gives the same release
            changed = frame.with_columns(pl.when(pl.col("t") == row).then(pl.col("v") + delta).otherwise(pl.col("v")))
            assert changed["v"][row] - lower == (units[row] + np.sign(delta)) * step
            with pytest.raises(dpsql.ConflictingRow, match="appended before with another value"):
                stream.append(changed)
            assert _stored(path) == stored
    assert pl.from_arrow(stream.append(frame)).equals(pl.from_arrow(first))  # the same values: a repeat
