"""How the ledger stores released rows: every column restored bit for bit under each encoding,
the chunks of earlier versions still readable, and repeats stored in a fraction of their size."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from dpsql._chunks import distinct, table_bytes, table_of

INT64 = np.iinfo(np.int64)
REE = pa.run_end_encoded(pa.int32(), pa.int64())
#: Runs whose values fit a byte (grids of order keys, divided by their step; row numbers).
REE8 = pa.run_end_encoded(pa.int32(), pa.int8())
#: Integers of 17 to 24 bits: their low 16 bits and a byte for the rest.
PLANES = pa.struct([pa.field("low", pa.uint16(), nullable=False), pa.field("high", pa.int8(), nullable=False)])


def _chunk(keys, kind=None, values=None, tags=None) -> pa.Table:
    keys = np.asarray(keys, dtype=np.int64)
    rng = np.random.default_rng(len(keys))
    values = rng.normal(size=len(keys)) if values is None else np.asarray(values, dtype=np.float64)
    tags = rng.integers(0, 2**63, len(keys)).astype(np.uint64) if tags is None else tags
    return pa.table({"key": pa.array(keys).view(kind or pa.int64()), "value": values, "dp_tag": pa.array(tags)})


def _stored_types(data: bytes) -> dict[str, pa.DataType]:
    schema = pa.ipc.open_stream(pa.py_buffer(data)).schema
    return {field.name: field.type for field in schema}


def _round_trip(chunk: pa.Table) -> dict[str, pa.DataType]:
    data = table_bytes(chunk)
    restored = table_of(data)
    assert restored.schema == chunk.schema
    for name in chunk.column_names:  # bits, so that -0.0 and NaN payloads would count too
        assert np.array_equal(np.asarray(restored[name].to_numpy()).view(np.uint64),
                              np.asarray(chunk[name].to_numpy()).view(np.uint64)), name
    return _stored_types(data)


@pytest.mark.parametrize(("keys", "encoding"), [
    (np.arange(10_000) * 60 + 1_700_000_000_000_000, REE8),  # a grid: two runs of differences (0, then 1 step)
    (np.arange(10_000) * 3_600_000_000 + 1_700_000_000_000_000, REE8),  # hourly, in microseconds
    (np.cumsum(np.repeat(np.resize([2**40 + 1, -(2**40)], 20), 50)), REE),  # runs without a common step
    # runs of int64's least difference (whose absolute value numpy's gcd cannot take), wrapping
    (np.cumsum(np.repeat(np.array([INT64.min, 2, INT64.min, 6]), 100)), REE),
    (np.cumsum(np.repeat(np.array([INT64.min, 0, INT64.min]), 100)), REE),
    (np.cumsum(np.random.default_rng(1).choice([60, 61, 59], 10_000)) + 2**60, pa.dictionary(pa.uint8(), pa.int64())),
    (np.cumsum(np.random.default_rng(1).integers(1, 10**6, 10_000)) + 2**60, PLANES),
    (np.cumsum(np.random.default_rng(1).integers(1, 2**30, 10_000)), pa.int32()),
    (np.cumsum(np.random.default_rng(2).integers(1, 2**40, 10_000)), pa.int64()),
    # differences wrap around: two's complement restores them
    (np.resize([INT64.min, -1, 0, INT64.max], 256), pa.dictionary(pa.uint8(), pa.int64())),
    ([INT64.min, -1, 0, INT64.max], pa.int64()),  # a few rows: stored as they are
    (np.arange(255) * 60, pa.int64()),
])
def test_keys_round_trip_under_each_encoding(keys, encoding):
    assert _round_trip(_chunk(keys))["key"] == encoding


def test_values_and_tags_round_trip_under_each_encoding():
    n = 20_000
    rng = np.random.default_rng(3)
    held = np.repeat(rng.normal(size=n // 500), 500)  # a value held for 500 rows
    held[:250] = -0.0
    held[250:500] = 0.0
    counts = rng.poisson(300.0, n).astype(np.float64)
    stored = _round_trip(_chunk(np.arange(n), values=held, tags=counts.view(np.uint64)))
    assert stored["value"] == REE and stored["dp_tag"] == pa.dictionary(pa.uint8(), pa.int64())
    # 200 distinct in the rows looked at first, 1,000 in all: 16-bit indices
    many = (rng.integers(0, 200, n) + 200 * (np.arange(n) // 4_000)).astype(np.float64)
    stored = _round_trip(_chunk(np.arange(n), values=many, tags=np.arange(n, dtype=np.uint64) * 2**40))
    assert stored["value"] == pa.dictionary(pa.uint16(), pa.int64()) and stored["dp_tag"] == pa.uint64()


@pytest.mark.parametrize("kind", [pa.timestamp("us", tz="Europe/Zurich"), pa.timestamp("ns"), pa.duration("ms")])
def test_temporal_keys_keep_their_type(kind):
    _round_trip(_chunk(np.arange(1_000) * 3_600_000 + 1_600_000_000_000, kind))


def test_other_columns_are_stored_as_they_are():
    chunk = pa.table({"key": pa.array(["a", "b"]), "value": [1.0, None], "dp_count": pa.array([1, 2], pa.int32())})
    assert table_of(table_bytes(chunk)).equals(chunk)
    single = _chunk([INT64.max])
    assert table_of(table_bytes(single)).equals(single)


def test_repeats_cost_a_fraction_of_their_size():
    n = 100_000
    counts = np.random.default_rng(4).poisson(300.0, n).astype(np.float64)
    chunk = _chunk(np.arange(n) + 10**12, values=np.repeat(counts[::1000], 1000), tags=counts.view(np.uint64))
    assert len(table_bytes(chunk)) < 2 * n  # 24 bytes a row as they are; one byte for the tag's index
    noisy = _chunk(np.arange(n) + 10**12)
    assert len(table_bytes(noisy)) < 16 * n + 2_000  # noisy values and random tags, and almost nothing for keys


def test_chunks_of_earlier_versions_are_read():
    """Earlier versions compressed with LZ4 and kept the first key as the first difference."""
    keys = np.array([10**15, 10**15 + 7, 10**15 + 9], dtype=np.int64)
    chunk = _chunk(keys, pa.timestamp("us"))
    metadata = {b"dpsql.encoding": b"delta", b"dpsql.type": b"timestamp[us]"}
    # as earlier versions wrote it: not null (their reader made it nullable again)
    old = chunk.set_column(0, pa.field("key", pa.int64(), nullable=False, metadata=metadata),
                           pa.array(np.diff(keys, prepend=0)))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, old.schema, options=pa.ipc.IpcWriteOptions(compression="lz4")) as writer:
        writer.write_table(old)
    restored = table_of(sink.getvalue().to_pybytes())
    assert restored.equals(chunk) and restored.schema == chunk.schema
    later = table_of(table_bytes(_chunk(keys + 100, pa.timestamp("us"))))
    assert pa.concat_tables([restored, later]).num_rows == 6  # a stream's chunks, old and new, read as one


def test_chunks_of_the_version_before_narrow_integers_are_read():
    """Before narrow integers, runs held 64-bit values (differences not divided by a step) and
    lattice units 32 bits: a ledger written then reads back the same rows."""
    keys = np.arange(1_000, dtype=np.int64) * 3_600_000_000 + 1_700_000_000_000_000
    values = np.arange(1_000) * 0.25 - 100.0
    ends = pa.array([1, 1_000], pa.int32())
    schema = pa.schema([
        pa.field("key", REE, metadata={b"dpsql.type": b"timestamp[us]", b"dpsql.encoding": b"delta",
                                       b"dpsql.first": str(keys[0]).encode()}),
        pa.field("value", pa.int32(), metadata={b"dpsql.type": b"double", b"dpsql.encoding": b"lattice",
                                                b"dpsql.exponent": b"-2"})])
    old = pa.table([pa.RunEndEncodedArray.from_arrays(ends, pa.array([0, 3_600_000_000], pa.int64())),
                    pa.array((values * 4).astype(np.int32))], schema=schema)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, old.schema) as writer:
        writer.write_table(old)
    restored = table_of(sink.getvalue().to_pybytes())
    assert restored["key"].to_numpy().view(np.int64).tolist() == keys.tolist()
    assert restored["key"].type == pa.timestamp("us") and restored["value"].to_pylist() == values.tolist()


def test_repeats_and_conflicts_are_recognised_whichever_way_tags_were_stored():
    """Values that repeat get their tags as a dictionary (one cipher block per distinct value);
    values that do not get a tag per row. Appends of either kind, their pending rows and their
    released chunks must recognise a repeated row and refuse a changed one alike."""
    import polars as pl

    import dpsql

    n = 2_000
    few = np.arange(n) % 3 * 1.0  # 3 distinct values: tags as a dictionary
    many = np.random.default_rng(5).uniform(0.0, 100.0, n)  # all distinct: a tag per row
    for head, tail in [(few, many), (many, few)]:
        budget = dpsql.Budget.in_memory(epsilon=1.0)
        stream = budget.stream("s", method="tops", epsilon=1.0, order_by="ts", value="v", upper=100.0, m=50,
                               smoother="recent")
        frame = pl.DataFrame({"ts": np.arange(n), "v": np.where(np.arange(n) < 1_000, head, tail)})
        waiting = stream.append(frame.slice(0, 30))  # provisional: the hold-out is not full
        assert waiting.num_rows == 30 and not pc.any(waiting["dp_final"]).as_py()
        first = stream.append(frame.slice(0, 1_200))  # repeats the pending rows
        assert first["ts"].to_pylist() == list(range(1_200))
        again = stream.append(frame.slice(900, 500))  # 300 repeated, 200 new
        assert again["ts"].to_pylist() == list(range(900, 1_400))
        assert again["v"].to_pylist()[:300] == first["v"].to_pylist()[900:]
        for start in (10, 990, 1_300):  # a changed value among rows of each append
            changed = frame.slice(start, 5).with_columns(pl.col("v") + 0.5)
            with pytest.raises(dpsql.ConflictingRow, match="appended before with another"):
                stream.append(changed)
        assert stream.append(frame.slice(1_390, 610))["ts"].to_pylist() == list(range(1_390, n))


def test_a_column_given_as_dictionaries_is_stored_with_them_merged():
    first = pa.DictionaryArray.from_arrays(pa.array([0, 1, 1, 0], pa.int32()), pa.array([5, 2**64 - 1], pa.uint64()))
    second = pa.DictionaryArray.from_arrays(pa.array([1, 0, 2], pa.int32()), pa.array([7, 5, 9], pa.uint64()))
    tags = pa.chunked_array([first, second])
    chunk = pa.table({"key": np.arange(7), "dp_tag": tags})
    data = table_bytes(chunk)
    assert _stored_types(data)["dp_tag"] == pa.dictionary(pa.uint8(), pa.int64())
    restored = table_of(data)
    assert restored["dp_tag"].type == pa.uint64()
    assert restored["dp_tag"].to_pylist() == [5, 2**64 - 1, 2**64 - 1, 5, 5, 7, 9]
    wide = np.arange(70_000, dtype=np.uint64) * 3  # more entries than 16-bit indices reach: stored plain
    given = pa.DictionaryArray.from_arrays(pa.array(np.arange(70_000)[::-1].astype(np.int32)), pa.array(wide))
    restored = table_of(table_bytes(pa.table({"dp_tag": given})))
    assert np.array_equal(restored["dp_tag"].to_numpy(), wide[::-1])


@pytest.mark.parametrize("case", ["tail", "negative", "extremes", "later_values", "steps", "wide"])
def test_distinct_values_encode_every_row(case):
    """Values the first rows do not show, hash collisions and the int64 extremes all come back;
    a column with more values than 16-bit indices reach is not encoded."""
    rng = np.random.default_rng(6)
    n = 100_000
    bits = {
        "tail": rng.poisson(300.0, n).astype(np.float64).view(np.int64),  # rare values after the first rows
        "negative": (-rng.poisson(3.0, n).astype(np.float64)).view(np.int64),
        "extremes": rng.choice(np.array([INT64.min, INT64.max, 0, -1], dtype=np.int64), n),
        "later_values": np.r_[np.zeros(n // 2, np.int64), rng.integers(0, 5_000, n // 2)],  # Arrow encodes these
        "steps": np.repeat(rng.integers(-2**62, 2**62, n // 100), 100),
        "wide": np.r_[np.zeros(2_000, np.int64), np.arange(70_000)],
    }[case]
    found = distinct(bits)
    if case == "wide":
        assert found is None
        return
    indices, dictionary = found
    assert indices.dtype == np.intp and dictionary.dtype == np.int64 and len(dictionary) <= 1 << 16
    assert np.array_equal(dictionary[indices], bits)
    assert set(dictionary.tolist()) == set(np.unique(bits).tolist())


@pytest.mark.parametrize("case", ["tail", "negative", "extremes", "later_values", "steps", "wide"])
@pytest.mark.parametrize("given", ["overlapping", "disjoint", "duplicated"])
def test_distinct_values_looked_up_in_a_given_dictionary_encode_every_row(case, given):
    """An earlier batch's dictionary looked up first: every row still comes back, and the
    dictionary starts with the given one unless Arrow's encoder did all of it."""
    rng = np.random.default_rng(7)
    n = 50_000
    bits = {
        "tail": rng.poisson(300.0, n).astype(np.float64).view(np.int64),
        "negative": (-rng.poisson(3.0, n).astype(np.float64)).view(np.int64),
        "extremes": rng.choice(np.array([INT64.min, INT64.max, 0, -1], dtype=np.int64), n),
        "later_values": np.r_[np.zeros(n // 2, np.int64), rng.integers(0, 5_000, n // 2)],
        "steps": np.repeat(rng.integers(-2**62, 2**62, n // 100), 100),
        "wide": rng.permutation(70_000).astype(np.int64),
    }[case]
    seen = {"overlapping": np.unique(rng.poisson(300.0, 1_000).astype(np.float64).view(np.int64)),
            "disjoint": np.arange(10**9, 10**9 + 200, dtype=np.int64),
            "duplicated": np.array([0, 0, -1, INT64.max, INT64.max], dtype=np.int64)}[given]
    found = distinct(bits, seen)
    if case == "wide":
        assert found is None
        return
    indices, dictionary = found
    assert np.array_equal(dictionary[indices], bits) and len(dictionary) <= 1 << 16
    if np.count_nonzero(~np.isin(bits, seen)) * 16 < n:  # few rows miss the given values: looked up there
        assert np.array_equal(dictionary[:len(seen)], seen)


def test_a_given_dictionary_that_does_not_fit_costs_no_more_than_none():
    """Continuous values after a batch of counts: judged by their own first rows (not encoded
    whole by Arrow only to be found too many); an empty given dictionary is no dictionary."""
    rng = np.random.default_rng(9)
    counts = np.unique(rng.poisson(3.0, 1_000).astype(np.float64).view(np.int64))
    continuous = rng.uniform(0, 1, 200_000).view(np.int64)
    assert distinct(continuous, counts) is None
    few = rng.poisson(3.0, 1_000).astype(np.float64).view(np.int64)
    indices, dictionary = distinct(few, np.empty(0, np.int64))
    assert np.array_equal(dictionary[indices], few)


def test_value_tags_of_many_partitions_are_each_partitions_own():
    """A fleet's rows are tagged in one pass: each row's tag is its own partition's tag of its value
    (so a value repeated in another partition, or a -0.0 for a 0.0, is recognised as it should be)."""
    from dpsql.continual.state import short_tags
    from dpsql.noise import Keystream

    keystream = Keystream.fresh()
    addresses = [b"i1", b"i2", b"sx"]
    rng = np.random.default_rng(8)
    rows, values = rng.integers(0, 3, 5_000), rng.poisson(30.0, 5_000).astype(np.float64)
    values[:4] = [0.0, -0.0, 5.0, 5.0]
    rows[:4] = [0, 0, 1, 2]
    tags = keystream.partitions(addresses).tags(rows, values)
    for j, address in enumerate(addresses):
        mine = rows == j
        np.testing.assert_array_equal(tags[mine], keystream.partition(address).tags(values[mine]))
    assert tags[0] == tags[1] and tags[2] != tags[3]
    assert short_tags(tags).dtype == np.int32 and (short_tags(tags) == short_tags(short_tags(tags))).all()


def test_a_partition_s_repeated_values_are_tagged_once_each_with_the_tags_of_each_row():
    """One partition's batch of values that repeat is tagged one cipher block per distinct value:
    every row gets the tag its value gets alone (a -0.0 the tag of 0.0)."""
    from dpsql.continual.state import short_tags, value_tags
    from dpsql.noise import Keystream

    draws = Keystream.fresh().partitions([b"meter 7"])
    rng = np.random.default_rng(10)
    for values in (rng.poisson(30.0, 5_000).astype(np.float64), rng.uniform(0, 1, 5_000)):
        values[:2] = [0.0, -0.0]
        rows = np.zeros(len(values), np.intp)
        np.testing.assert_array_equal(value_tags(draws, rows, values), short_tags(draws.tags(rows, values)))


def test_short_tags_that_repeat_are_stored_as_a_dictionary_and_restored_as_they_were():
    from dpsql.continual.state import short_tags

    n = 20_000
    rng = np.random.default_rng(6)
    repeating = short_tags(rng.poisson(300.0, n).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15))
    stored = _round_trip(pa.table({"key": pa.array(np.arange(n)), "dp_tag": pa.array(repeating)}))
    assert stored["dp_tag"] == pa.dictionary(pa.uint8(), pa.int64())
    random = short_tags(rng.integers(0, 2**63, n).astype(np.uint64))
    assert _round_trip(pa.table({"key": pa.array(np.arange(n)), "dp_tag": pa.array(random)}))["dp_tag"] == pa.int32()


@pytest.mark.parametrize("partitions", [1, 1_000])
def test_row_numbers_are_stored_as_runs_of_differences(partitions):
    """A chunk's row numbers count up by one along each partition's rows: one run per partition."""
    n = 24_000
    per = n // partitions
    index = np.tile(np.arange(per) + 48, partitions).astype(np.int64)
    chunk = pa.table({"dp_partition": np.repeat(np.arange(partitions), per), "dp_index": index,
                      "key": pa.array(np.tile(np.arange(per), partitions))})
    stored = _round_trip(chunk)
    assert stored["dp_index"] == REE8
    # 24 bytes a row as they are; runs of 5 bytes: two per partition for the keys and the row
    # numbers (one up the partition, one back to the next), one of 6 for the partition
    assert len(table_bytes(chunk)) < 26 * partitions + 2_000


def test_laplace_releases_are_stored_as_lattice_units_and_restored_bit_for_bit():
    """A Laplace release's values are multiples of its lattice's power of two: three bytes a row
    (units of up to 24 bits). Values off every such 32-bit lattice, or a -0.0, are stored as they
    are."""
    import dpsql
    from dpsql.mechanisms.laplace import LaplaceLattice

    n = 20_000
    rng = np.random.default_rng(12)
    draws = dpsql.noise.Keystream.fresh().partition().lane(dpsql.noise.Lane.ROWS)
    released = LaplaceLattice(sensitivity=1000.0, epsilon=0.5).release(rng.uniform(0, 1000, n), draws)
    stored = _round_trip(_chunk(np.arange(n), values=released))
    assert stored["value"] == PLANES
    assert len(table_bytes(_chunk(np.arange(n), values=released))) < 11 * n + 2_000  # and the 8-byte tags
    finer = released.copy()
    finer[n - 1] += 2.0**-30  # beyond the first rows: found by the check of every value
    signed = released.copy()
    signed[5] = -0.0
    huge = released + 2.0**40  # units beyond 32 bits
    for values in (finer, signed, huge):
        assert _round_trip(_chunk(np.arange(n), values=values))["value"] == pa.float64()


@pytest.mark.parametrize(("units", "stored"), [
    ([-(2**15), 2**15 - 1], pa.int16()),
    ([-(2**15), 2**15], PLANES),
    ([-(2**23), 2**23 - 1], PLANES),
    ([-(2**23) - 1, 0], pa.int32()),
    ([0, 2**23], pa.int32()),
    ([-(2**31), 2**31 - 1], pa.int32()),
])
def test_lattice_units_are_stored_in_the_narrowest_integers_that_hold_them(units, stored):
    """Units up to each width's bounds (both signs): each value comes back bit for bit. (Units of
    8 bits are few: a dictionary, as any column of few values.)"""
    picked = np.random.default_rng(13).integers(units[0], units[1] + 1, 5_000)
    picked[:2] = units
    values = picked * 0.125  # on the lattice of 2**-3 (exactly: units of at most 32 bits)
    values[values == 0] = 0.0  # (not -0.0, stored as it is)
    assert _round_trip(_chunk(np.arange(5_000), values=values))["value"] == stored


@pytest.mark.parametrize(("runs", "stored"), [
    ([2**7 - 1, -(2**7)], pa.int8()),
    ([2**15 - 1, -(2**15)], pa.int16()),
    ([2**15, -(2**15)], pa.int32()),  # (runs take no planes: a run costs four bytes of its end anyway)
    ([2**31, 1], pa.int64()),
])
def test_runs_are_stored_in_the_narrowest_integers_that_hold_them(runs, stored):
    values = np.repeat(np.resize(np.array(runs, dtype=np.int64), 100), 50)
    chunk = pa.table({"dp_partition": values})
    assert _round_trip(chunk)["dp_partition"] == pa.run_end_encoded(pa.int32(), stored)


def test_columns_in_several_chunks_round_trip_with_the_differences_across_chunks():
    """A chunk of released rows holds one piece per batch of partitions fed together: the
    differences of its keys and row numbers run across the pieces (an empty one included)."""
    keys = np.arange(3_000, dtype=np.int64) * 3_600 + 2**40
    pieces = [keys[:1_000], keys[:0], keys[1_000:1_001], keys[1_001:]]
    index = np.tile(np.arange(100, dtype=np.int64), 30)
    values = np.random.default_rng(14).integers(-5_000, 5_000, 3_000) / 8.0 + 0.0
    chunk = pa.table({"key": pa.chunked_array([pa.array(p).view(pa.timestamp("s")) for p in pieces]),
                      "dp_index": pa.chunked_array([index[:1_500], index[1_500:]]),
                      "value": pa.chunked_array([values[:10], values[10:]]),
                      "dp_tag": pa.chunked_array([pa.array(np.arange(3_000)[:7], pa.int32()),
                                                  pa.array(np.arange(3_000)[7:], pa.int32())])})
    restored = table_of(table_bytes(chunk))
    assert restored.schema == chunk.schema
    for name in chunk.column_names:
        assert np.array_equal(np.asarray(restored[name].to_numpy()).view(np.uint64) if name != "dp_tag" else
                              restored[name].to_numpy(), np.asarray(chunk[name].to_numpy()).view(np.uint64)
                              if name != "dp_tag" else chunk[name].to_numpy()), name
    stored = _stored_types(table_bytes(chunk))
    assert stored["key"] == REE8 and stored["dp_index"] == REE8 and stored["value"] == pa.int16()


def test_large_tables_encoded_on_two_threads_come_back_as_encoded_on_one(monkeypatch):
    """From :data:`_THREADED_FROM` rows, the columns are encoded on two threads: the same bytes."""
    from dpsql import _chunks

    n = 1 << 17
    rng = np.random.default_rng(15)
    chunk = pa.table({"dp_partition": np.repeat(np.arange(n // 24 + 1), 24)[:n], "dp_index": np.arange(n),
                      "key": pa.array(np.arange(n) * 60).view(pa.timestamp("s")),
                      "value": rng.integers(-2**20, 2**20, n) / 4.0 + 0.0, "dp_final": np.ones(n, bool)})
    threaded = table_bytes(chunk)
    monkeypatch.setattr(_chunks, "_THREADED_FROM", 2 * n)
    assert threaded == table_bytes(chunk)
    assert table_of(threaded).equals(chunk)


def test_float_order_keys_whose_differences_look_like_a_lattice_come_back_bit_for_bit(tmp_path):
    """Float keys are stored as differences of their bits; those differences, read as floats,
    can be multiples of one power of two (keys that grow by whole binades: here each difference
    reads as a multiple of 2**-1023). Stored as lattice units, they came back as the
    differences themselves, not the keys: another key released than the one appended."""
    import polars as pl

    import dpsql

    n = 260  # more distinct differences than a dictionary takes, too many runs to run-length encode
    rng = np.random.default_rng(16)
    steps = (rng.integers(2, 128, n - 1) * np.ldexp(1.0, -1023)).view(np.int64)
    keys = np.concatenate([[0], np.cumsum(steps)]).view(np.float64)
    assert np.isfinite(keys).all() and (np.diff(keys) > 0).all()
    _round_trip(pa.table({"key": keys}))
    path = tmp_path / "l.sqlite"
    stream = dpsql.Budget.open(path, epsilon=1.0).stream("s", method="laplace", epsilon=1.0, order_by="t",
                                                         value="v", upper=10.0)
    frame = pl.DataFrame({"t": keys, "v": rng.uniform(0.0, 10.0, n)})
    appended = stream.append(frame)
    released = dpsql.Budget.open(path).stream("s").released()
    assert np.array_equal(released["t"].to_numpy().view(np.uint64), keys.view(np.uint64))
    assert released.equals(appended)
    assert stream.append(frame).equals(appended)  # a repeat, recognised as one
