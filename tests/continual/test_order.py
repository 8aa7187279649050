"""An append's batch in stream order: the partitions' first rows found while checking the order
agree with sorting and finding them afterwards, whatever the batch (in order or not, keys
repeated, partitions out of order or split), and through the public append."""

from __future__ import annotations

import sqlite3

import numpy as np
import polars as pl
import pytest

import dpsql
from dpsql._chunks import table_of
from dpsql.continual.order import group_starts, in_stream_order, starts_in_order
from dpsql.continual.state import StreamSpec


def _spec(partition_by: tuple[str, ...]) -> StreamSpec:
    return StreamSpec(method="laplace", params={"epsilon": 1.0}, order_by="ts", value="v", partition_by=partition_by)


def _expected(frame: pl.DataFrame, partition_by: tuple[str, ...]) -> tuple[pl.DataFrame, np.ndarray | None]:
    """The oracle: sorted by partition and key, then each partition's first row; None when a key
    repeats in a partition."""
    ordered = frame.sort([*partition_by, "ts"], maintain_order=True)
    keys = ordered.select([*partition_by, "ts"]).rows()
    if len(set(keys)) < len(keys):
        return ordered, None
    parts = [tuple(r) for r in ordered.select(list(partition_by)).rows()] if partition_by else [()] * len(keys)
    return ordered, np.array([i for i in range(len(parts)) if i == 0 or parts[i] != parts[i - 1]])


@pytest.mark.parametrize("partition_by", [(), ("meter",)])
@pytest.mark.parametrize("case", ["in_order", "shuffled", "repeated_key", "descending_partitions", "split_partition",
                                  "floats", "datetimes", "one_row_each"])
def test_partitions_found_while_checking_the_order_are_those_found_after_sorting(partition_by, case):
    rng = np.random.default_rng(abs(hash((case, partition_by))) % 2**32)
    meters, hours = 50, 24
    meter = np.repeat(np.arange(meters), hours)
    ts = np.tile(np.arange(hours), meters) * 3_600 + rng.integers(0, 3_600, meters * hours)
    if case == "shuffled":
        order = rng.permutation(len(ts))
        meter, ts = meter[order], ts[order]
    elif case == "repeated_key":
        ts[7 * hours + 5] = ts[7 * hours + 4]
    elif case == "descending_partitions":
        meter = meter[::-1].copy()
    elif case == "split_partition":  # meter 3's rows again after meter 4's (keys rising within each run)
        meter[4 * hours + 12:5 * hours] = 3
        ts[4 * hours + 12:5 * hours] += 10**6
    elif case == "one_row_each":
        meter, ts = np.arange(meters), np.zeros(meters, np.int64)
    frame = pl.DataFrame({"meter": meter, "ts": ts, "v": np.ones(len(ts))})
    if case == "floats":
        frame = frame.with_columns(pl.col("meter") * 0.5 - 3.0, pl.col("ts") / 7.0)
    if case == "datetimes":
        frame = frame.with_columns(pl.from_epoch("ts", "s").dt.replace_time_zone("Europe/Zurich"))
    if not partition_by:
        frame = frame.unique("ts", keep="first", maintain_order=True) if case != "repeated_key" else frame
        frame = frame.sort("ts") if case in ("in_order", "floats", "datetimes") else frame
    spec = _spec(partition_by)
    expected, starts = _expected(frame, partition_by)
    ordered, found = in_stream_order(frame, spec)
    assert ordered.equals(expected)
    if starts is None:  # a key twice in a partition: refused by group_starts
        assert found is None
        with pytest.raises(dpsql.InvalidTimeKey, match="appears twice in one partition"):
            group_starts(ordered, spec, "stream 's'")
        return
    if found is None:
        found = group_starts(ordered, spec, "stream 's'")
    assert np.array_equal(found, starts)
    # rows in order are recognised without sorting (no copy); a single row needs no check
    in_order = case in ("in_order", "floats", "datetimes", "one_row_each") and frame.height > 1
    assert (starts_in_order(frame, partition_by, "ts") is not None) == in_order


def test_an_append_whose_partitions_come_split_releases_each_row_once_under_its_meter():
    budget = dpsql.Budget.in_memory(epsilon=10.0)
    stream = budget.stream("fleet", method="laplace", epsilon=1.0, order_by="ts", value="v", partition_by="meter",
                           upper=10.0)
    frame = pl.DataFrame({"meter": [1, 1, 2, 2, 1, 1], "ts": [0, 1, 0, 1, 2, 3], "v": [1.0] * 6})
    out = pl.from_arrow(stream.append(frame))
    assert out.select("meter", "ts").rows() == [(1, 0), (1, 1), (1, 2), (1, 3), (2, 0), (2, 1)]
    assert out["dp_row"].n_unique() == 6
    with pytest.raises(dpsql.InvalidTimeKey, match="appears twice in one partition"):
        stream.append(pl.DataFrame({"meter": [3, 3, 4], "ts": [5, 5, 5], "v": [1.0] * 3}))


def test_interleaved_classes_of_a_fleet_are_stored_and_returned_by_partition(tmp_path, monkeypatch):
    """A tops fleet's partitions fall in classes by how many of their rows went to the pooled
    hold-out: their rows come interleaved, and are put in partition order by moving runs. The
    chunk and the rows returned are those of sorting every row (the general path), in order."""
    from dpsql.continual import appends

    budget = dpsql.Budget.open(tmp_path / "moved.sqlite", epsilon=100.0)
    moved = budget.stream("fleet", method="tops", epsilon=1.0, order_by="ts", value="v", partition_by="meter",
                          upper=50.0)
    with sqlite3.connect(tmp_path / "moved.sqlite") as source, sqlite3.connect(tmp_path / "sorted.sqlite") as copy:
        source.backup(copy)  # the same stream, its secret key too: the two paths must give the same rows
    sorted_ = dpsql.Budget.open(tmp_path / "sorted.sqlite").stream("fleet")
    rng = np.random.default_rng(16)
    days = [pl.DataFrame({"meter": np.repeat(np.arange(300), 24), "ts": np.tile(np.arange(24), 300) + 24 * d,
                          "v": rng.gamma(2.0, 2.0, 7_200)}) for d in range(3)]
    seen = []
    runs_in_turn = appends._runs_in_turn
    monkeypatch.setattr(appends, "_runs_in_turn", lambda *a: seen.append(o := runs_in_turn(*a)) or o)
    returned = [pl.from_arrow(moved.append(day)) for day in days]
    assert any(o is not None for o in seen)  # the classes interleaved: runs moved
    monkeypatch.setattr(appends, "_runs_in_turn", lambda *a: None)
    expected = [pl.from_arrow(sorted_.append(day)) for day in days]
    for got, want, day in zip(returned, expected, days):
        assert got.equals(want)
        assert got.select("meter", "ts").rows() == sorted(day.select("meter", "ts").rows())
    assert pl.from_arrow(moved.released()).equals(pl.from_arrow(sorted_.released()))
    for stream in (moved, sorted_):  # each append's chunk is stored by partition, then row
        with stream.budget.ledger.reading("test") as conn:
            for _, _, _, data in stream._store.chunks(conn, stream.release_id):
                chunk = table_of(data)
                partition, index = chunk["dp_partition"].to_numpy(), chunk["dp_index"].to_numpy()
                assert (np.diff(partition) > 0).sum() == 299 and (np.diff(index)[np.diff(partition) == 0] == 1).all()


@pytest.mark.parametrize("kind", ["int", "text", "datetime", "float"])
def test_a_day_of_every_meter_in_order_gets_their_ordinals_without_addresses(tmp_path, monkeypatch, kind):
    """A fleet's day holds every meter, as the directory holds them: ordinals 0, 1, ... without
    addresses. The same stream (a copy of its ledger) through the addresses gives the same rows,
    for days that hold every meter, one meter swapped for a new one, or one more."""
    from dpsql.continual.fleet import Fleet

    def meters(ids):
        ids = np.asarray(ids)
        return {"int": ids, "text": np.char.add("m", ids.astype(str)),
                "datetime": ids.astype("datetime64[D]").astype("datetime64[us]"), "float": ids * 1.5}[kind]

    def day(number, ids):
        return pl.DataFrame({"meter": np.repeat(meters(ids), 4), "ts": np.tile(np.arange(4), len(ids)) + 4 * number,
                             "v": np.arange(4 * len(ids)) % 7 * 1.0})

    budget = dpsql.Budget.open(tmp_path / "fast.sqlite", epsilon=100.0)
    fast = budget.stream("fleet", method="laplace", epsilon=1.0, order_by="ts", value="v", partition_by="meter",
                         upper=10.0)
    fast.append(day(0, np.arange(40)))
    with sqlite3.connect(tmp_path / "fast.sqlite") as source, sqlite3.connect(tmp_path / "slow.sqlite") as copy:
        source.backup(copy)
    slow = dpsql.Budget.open(tmp_path / "slow.sqlite").stream("fleet")
    days = [day(1, np.arange(40)), day(2, [*range(39), 77]), day(3, [*range(40), 78]), day(4, [*range(40), 77, 78])]
    used = []
    in_order = Fleet.in_order
    monkeypatch.setattr(Fleet, "in_order", lambda self, columns: used.append(o := in_order(self, columns)) or o)
    returned = [pl.from_arrow(fast.append(d)) for d in days]
    # (the meters added since sort last as numbers and times, but "m77" before "m8" as text)
    assert used == [kind != "float", False, False, kind in ("int", "datetime")]
    monkeypatch.setattr(Fleet, "in_order", lambda self, columns: False)
    for got, d in zip(returned, days):
        assert got.equals(pl.from_arrow(slow.append(d)))
    assert pl.from_arrow(fast.released()).equals(pl.from_arrow(slow.released()))


@pytest.mark.parametrize("first_handles", [np.arange(5) * 2**32 + 7, np.array([7, 2**32 + 7, 5 * 2**32, 6 * 2**32]),
                                           np.array([2**40])])
def test_row_handles_by_arithmetic_are_the_gathered_ones(first_handles):
    from dpsql.continual.fleet import row_handles

    rng = np.random.default_rng(18)
    ordinals = np.sort(rng.integers(0, len(first_handles), 1_000))
    indices = rng.integers(0, 2**20, 1_000)
    assert np.array_equal(row_handles(first_handles, ordinals, indices), first_handles[ordinals] + indices)
    narrow = ordinals.astype(np.uint16)  # (in int64 throughout, whatever the ordinals' type)
    assert np.array_equal(row_handles(first_handles, narrow, indices), first_handles[ordinals] + indices)


@pytest.mark.parametrize(("method", "meters"), [("tops", 0), ("hierarchy", 0), ("tops", 1), ("tops", 3)])
def test_a_lazy_frame_whose_later_batch_completes_rows_returns_and_stores_each_row_once(method, meters):
    """A lazy frame comes in batches (Polars splits even 1,000 rows); a later batch completes rows
    an earlier one released provisionally (a hold-out filled, a block completed), in the same
    partition as the earlier batch's last rows: one run of the partition, holding two versions of
    a row. The append returns each row once, at its latest version, as :meth:`released` does."""
    budget = dpsql.Budget.in_memory(epsilon=100.0)
    partitioned = {"partition_by": "meter"} if meters else {}
    stream = budget.stream("s", method=method, epsilon=1.0, order_by="ts", value="v", upper=10.0, **partitioned,
                           **({"m": 300} if method == "tops" else {}))
    n = 1_000 // max(meters, 1)
    frame = pl.DataFrame({"ts": np.tile(np.arange(n), max(meters, 1)),
                          "v": np.random.default_rng(19).uniform(0.0, 10.0, n * max(meters, 1))})
    if meters:
        frame = frame.with_columns(meter=np.repeat(np.arange(meters), n))
    returned = pl.from_arrow(stream.append(frame.lazy()))
    released = pl.from_arrow(stream.released())
    assert returned.height == frame.height and returned["dp_row"].n_unique() == frame.height
    assert returned.select(released.columns).equals(released)
    with budget.ledger.reading("test") as conn:
        (_, _, _, data), = stream._store.chunks(conn, stream.release_id)
    chunk = table_of(data)
    assert chunk.num_rows == frame.height
