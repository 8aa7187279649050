"""Partition addresses are exact and injective, and the attack that found them otherwise fails.

The attack (issue 23): two partitions whose keys differ below the resolution of the old address
(1 ns on a nanosecond timestamp or time, the 20th decimal of a DECIMAL(38, 24), a key given twice)
drew identical noise while being charged as disjoint, so subtracting a known partition's release
from the other's recovered its raw values. Here both partitions hold the same values: with
independent noise their releases differ, with shared noise they are identical."""

import datetime as dt
import decimal

import duckdb
import numpy as np
import polars as pl
import pyarrow as pa
import pytest

import dpsql
from dpsql.addresses import partition_address, partition_addresses
from dpsql.noise import Keystream, Lane

NS = np.array(["2024-03-01T00:00:00.000000001", "2024-03-01T00:00:00.000000002"], dtype="datetime64[ns]")


@pytest.mark.parametrize("column, python", [
    (pa.array([0, -5, 2**63 - 1, -(2**63)]), [0, -5, 2**63 - 1, -(2**63)]),
    (pa.array([2**64 - 1], pa.uint64()), [2**64 - 1]),
    (pa.array([1.0, -0.0, 0.1, 2.5e300, float("inf"), -1.5]), [1, 0, 0.1, 2.5e300, float("inf"), -1.5]),
    (pa.array([decimal.Decimal("1.500"), decimal.Decimal("-0.000000000000000000000001"), decimal.Decimal("7")],
              pa.decimal128(38, 24)), [1.5, decimal.Decimal("-1E-24"), 7]),
    (pa.array(["north", "", "Zürich"]), ["north", "", "Zürich"]),
    (pa.array([b"\x00", b""]), [b"\x00", b""]),
    (pa.array([True, False]), [True, False]),
    (pa.array([dt.date(1969, 12, 31), dt.date(2024, 2, 29)]), [dt.date(1969, 12, 31), dt.date(2024, 2, 29)]),
    (pa.array(NS), list(NS)),
    (pa.array([dt.datetime(2024, 1, 1, 12)], pa.timestamp("s")), [dt.datetime(2024, 1, 1, 12)]),
    (pa.array([dt.datetime(2024, 1, 1, 12, tzinfo=dt.UTC)], pa.timestamp("us", tz="Europe/Paris")),
     [dt.datetime(2024, 1, 1, 13, tzinfo=dt.timezone(dt.timedelta(hours=1)))]),
    (pa.array([1, 2], pa.time64("ns")), [np.timedelta64(1, "ns"), np.timedelta64(2, "ns")]),
    (pa.array([dt.time(1, 2, 3, 4)], pa.time64("us")), [dt.time(1, 2, 3, 4)]),
    (pa.array([dt.timedelta(days=1, microseconds=3)]), [dt.timedelta(days=1, microseconds=3)]),
    (pa.array([dt.time(1, 2, 3), dt.time(0)], pa.time32("s")), [dt.time(1, 2, 3), dt.time(0)]),
    (pa.array([dt.time(23, 59, 59, 999000)], pa.time32("ms")), [dt.time(23, 59, 59, 999000)]),
    # NULL is one key, ``n``, however the column holding it is typed
    (pa.array([None, 7, None]), [None, 7, None]),
    (pa.array([1.5, None]), [1.5, None]),
    (pa.array([None, dt.datetime(2024, 1, 1)], pa.timestamp("ms")), [None, dt.datetime(2024, 1, 1)]),
    (pa.array([dt.time(1), None], pa.time32("s")), [dt.time(1), None]),
    (pa.array(["a", None]).dictionary_encode(), ["a", None]),
    (pa.array(["a", None, ""], pa.string_view()), ["a", None, ""]),
    (pa.array([b"a", None], pa.binary_view()), [b"a", None]),
    # numpy's timedelta64 is an integer type to numpy: still a duration
    (pa.array([5, -7], pa.duration("ns")), [np.timedelta64(5, "ns"), np.timedelta64(-7, "ns")]),
    (pa.array([5], pa.duration("us")), [np.timedelta64(5, "us")]),
])
def test_arrow_and_python_keys_get_the_same_exact_address(column, python):
    addresses = partition_addresses([column]).to_pylist()
    if pa.types.is_time(column.type) and isinstance(python[0], np.timedelta64):  # times of day have no numpy type
        assert addresses == [b"h1", b"h2"]
    else:
        assert addresses == [partition_address(key) for key in python]
    assert len(set(addresses)) == len(addresses) - python.count(None) + min(python.count(None), 1)


@pytest.mark.parametrize("kind, tag", [(pa.duration("us"), b"D"), (pa.timestamp("ms"), b"t"), (pa.time64("us"), b"h")])
def test_the_earliest_int64_instant_keeps_its_exact_nanoseconds(kind, tag):
    """-2**63 in a coarser unit than nanoseconds has no int64 nanoseconds: it is written exactly
    (its absolute value, in int64, is itself: negative), not wrapped onto another key's address."""
    factor = {"us": 1000, "ms": 10**6}[kind.unit]
    addresses = partition_addresses([pa.array([-(2**63), 0, 1], pa.int64()).cast(kind)]).to_pylist()
    assert addresses == [tag + str(v * factor).encode() for v in (-(2**63), 0, 1)]


def test_addresses_of_several_columns_are_tuples_and_cannot_be_confused():
    a, b = pa.array(["ab", "a"]), pa.array(["c", "bc"])  # "ab|c" and "a|bc": same bytes joined, other keys
    addresses = partition_addresses([a, b]).to_pylist()
    assert addresses == [partition_address(("ab", "c")), partition_address(("a", "bc"))]
    assert addresses[0] != addresses[1]


def test_kinds_never_share_an_address():
    keys = [3, "3", b"3", dt.date(1970, 1, 4), dt.datetime(1970, 1, 1, 0, 0, 0, 3), dt.time(0, 0, 3),
            dt.timedelta(seconds=3), True, None, 3.5, (3,)]
    addresses = [partition_address(k) for k in keys]
    assert len(set(addresses)) == len(keys) and b"" not in addresses


def test_numbers_are_one_key_by_value():
    assert partition_address(3) == partition_address(3.0) == partition_address(decimal.Decimal("3.000"))
    assert partition_address(0.1) != partition_address(decimal.Decimal("0.1"))  # the float is not 1/10
    assert partition_address(2**53 + 1) != partition_address(float(2**53 + 1))
    with pytest.raises(dpsql.InvalidParameter, match="NaN"):
        partition_address(float("nan"))


def test_masks_are_the_addresses_cbc_mac_and_batches_equal_single_partitions():
    keystream = Keystream(bytes(range(32)), private=False)
    addresses = [b"", b"i1", b"s" + b"x" * 15, b"s" + b"x" * 16, b"y" * 40]  # 0, 1, 1, 2 and 3 blocks
    batch = keystream.partitions(addresses).lane(Lane.ROWS).discrete_laplace(4.0, 7, 12)
    for j, address in enumerate(addresses):
        np.testing.assert_array_equal(batch[j], keystream.partition(address).lane(Lane.ROWS).discrete_laplace(
            4.0, 7, 12))
    assert len({tuple(row) for row in batch.tolist()}) == len(addresses)


def _independent(values: np.ndarray) -> bool:
    """Two partitions of the same data: do their releases differ (independent noise)?"""
    first, second = np.split(np.asarray(values, dtype=np.float64), 2)
    return not np.array_equal(first, second)


def _two_meters(keys) -> pl.DataFrame:
    return pl.DataFrame({"meter": keys, "t": [0, 0], "kwh": [5.0, 5.0]}).vstack(
        pl.DataFrame({"meter": keys, "t": [1, 1], "kwh": [7.0, 7.0]})).sort("meter", "t")


@pytest.mark.parametrize("keys", [
    pl.Series("meter", NS, dtype=pl.Datetime("ns")),
    pl.Series("meter", [1, 2]).cast(pl.Time),  # nanoseconds after midnight
    pl.Series("meter", [decimal.Decimal("1.000000000000000000000001"), decimal.Decimal("1.000000000000000000000002")],
              dtype=pl.Decimal(38, 24)),  # one float: 1.0
])
def test_polars_partitions_a_nanosecond_apart_draw_independent_noise(keys):
    frame = _two_meters(keys)
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    with dpsql.testing.seeded(0):
        out = frame.with_columns(pl.col("kwh").dpsql.range_sum(order_by="t", partition_by="meter", method="laplace",
                                                               epsilon=1.0, upper=10.0, budget=budget))
    released = out.sort("meter", "t")["kwh"].to_numpy()
    assert _independent(released)
    assert budget.spent == (1.0, 0.0)  # charged once: the partitions are disjoint


@pytest.mark.parametrize("kind, first, second", [
    ("TIMESTAMP_NS", "'2024-03-01 00:00:00.000000001'", "'2024-03-01 00:00:00.000000002'"),
    ("DECIMAL(38, 24)", "1.000000000000000000000001", "1.000000000000000000000002"),  # one float: 1.0
    ("TIME", "'00:00:00.000001'", "'00:00:00.000002'"),
])
def test_duckdb_partitions_a_nanosecond_apart_draw_independent_noise(kind, first, second):
    con = duckdb.connect()
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    dpsql.register(con, budget=budget)
    con.execute(f"""CREATE TABLE readings AS SELECT CAST(m AS {kind}) AS meter, t, kwh FROM (VALUES
                    ({first}, 0, 5.0), ({second}, 0, 5.0), ({first}, 1, 7.0), ({second}, 1, 7.0)) v(m, t, kwh)""")
    with dpsql.testing.seeded(0):
        out = con.sql("SELECT * FROM dp_range_sum('readings', 't', 'kwh', method := 'laplace', epsilon := 1, "
                      "upper := 10, partition_by := 'meter') ORDER BY meter, t").fetchall()
    assert _independent([row[2] for row in out])
    assert budget.spent == (1.0, 0.0)


@pytest.mark.parametrize("keys", [["north", "north"], [3, 3.0], [3, decimal.Decimal("3.00")],
                                  [dt.datetime(2024, 1, 1), np.datetime64("2024-01-01T00:00:00.000000000")],
                                  pa.array([0.0, -0.0]), pa.array([b"k", b"k"]), pa.array([None, None], pa.int64()),
                                  [None, None]])
def test_publish_refuses_a_key_given_twice_and_charges_nothing(keys):
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    with pytest.raises(dpsql.InvalidParameter, match="given twice"):
        dpsql.publish("laplace", np.ones(4), partition_offsets=[0, 2, 4], partition_keys=keys, epsilon=1.0,
                      upper=1.0, budget=budget)
    assert budget.spent == (0.0, 0.0)


def test_publish_with_arrow_keys_keeps_nanoseconds():
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    with dpsql.testing.seeded(0):
        release = dpsql.publish("laplace", np.full(4, 5.0), partition_offsets=[0, 2, 4],
                                partition_keys=pa.array(NS), epsilon=1.0, upper=10.0, budget=budget)
    assert _independent(release.values)
    assert list(release.keys) == [pa.scalar(NS[0]).as_py(), pa.scalar(NS[1]).as_py()]


def test_masks_of_any_length_and_any_slice_are_the_cbc_mac_of_their_bytes():
    """The vectorised masks (strings gathered eight bytes at a time, grouped by block count) equal
    CBC-MAC computed directly, for every length around the block boundaries, and for an Arrow
    array that is a slice of a larger one."""
    import os

    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    from dpsql.addresses import masks

    aes = algorithms.AES(bytes(range(32)))
    rng = np.random.default_rng(13)
    addresses = [rng.integers(0, 256, length, dtype=np.uint8).tobytes() for length in range(0, 70)] + [os.urandom(9)]

    def cbc_mac(address: bytes) -> list[int]:
        message = len(address).to_bytes(16, "big") + address + bytes(-len(address) % 16)
        last = Cipher(aes, modes.CBC(bytes(16))).encryptor().update(message)[-16:]
        return [int.from_bytes(last[:8], "big"), int.from_bytes(last[8:], "big")]

    whole = pa.array([b"ahead", *addresses, b"behind" * 5], pa.large_binary())
    for array in (pa.array(addresses, pa.large_binary()), whole.slice(1, len(addresses)), pa.array(addresses)):
        assert masks(aes, array).tolist() == [cbc_mac(a) for a in addresses]
    # groups whose words are all inside or all past their strings (8, 16, 24 and 3 bytes each), and
    # addresses too long for the table of length blocks
    for lengths in ([8] * 5, [16] * 5, [24] * 4, [3] * 6, [4096, 4097, 5000], [1, 4097]):
        same = [rng.integers(0, 256, length, dtype=np.uint8).tobytes() for length in lengths]
        assert masks(aes, pa.array(same, pa.large_binary())).tolist() == [cbc_mac(a) for a in same]
