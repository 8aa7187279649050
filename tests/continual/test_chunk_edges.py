"""Edge cases of the ledger's encodings and batched draws found by review: each value restored bit
for bit whatever its magnitude, dictionary columns of 32-bit integers, batches of no partition."""

from __future__ import annotations

import warnings

import numpy as np
import polars as pl
import pyarrow as pa

import dpsql
from dpsql._chunks import table_bytes, table_of
from dpsql.noise import Lane


def _restored_bits(values: np.ndarray) -> np.ndarray:
    return table_of(table_bytes(pa.table({"value": values})))["value"].to_numpy().view(np.uint64)


def test_a_value_far_below_the_lattice_of_the_first_rows_is_restored_exactly():
    # the first rows are multiples of 2**100 (a lattice); a later value so small that scaling it
    # to that lattice underflows to +0.0 must not be stored as unit 0
    values = 2.0**100 * np.arange(1, 2001)
    values[1500] = 2.0**-1000
    assert np.array_equal(_restored_bits(values), values.view(np.uint64))
    values = 2.0 * np.arange(1, 2001)  # even integers, then the smallest subnormal
    values[-1] = 5e-324
    assert np.array_equal(_restored_bits(values), values.view(np.uint64))


def test_a_float_partition_key_below_the_directorys_lattice_comes_back(tmp_path):
    path = tmp_path / "l.sqlite"
    stream = dpsql.Budget.open(path, epsilon=10.0).stream("s", method="laplace", epsilon=1.0, order_by="ts",
                                                         value="kwh", partition_by="meter", upper=10.0)
    keys = 2.0**100 * np.arange(1, 1025)
    stream.append(pl.DataFrame({"meter": keys, "ts": np.zeros(1024, np.int64), "kwh": np.ones(1024)}))
    stream.append(pl.DataFrame({"meter": [1e-300], "ts": [0], "kwh": [1.0]}))
    meters = dpsql.Budget.open(path).stream("s").released()["meter"].to_pylist()
    assert sorted(meters) == sorted([*keys.tolist(), 1e-300])


def test_storing_values_of_any_magnitude_warns_nothing():
    values = np.concatenate([[5e-324], np.arange(1.0, 300.0) * 1e300])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert np.array_equal(_restored_bits(values), values.view(np.uint64))


def test_a_dictionary_column_of_32_bit_integers_round_trips():
    for entries in ([7, -1, 2**31 - 1], [7, -1, 2**31 - 1, -(2**31)]):
        column = pa.DictionaryArray.from_arrays(pa.array(np.arange(300) % len(entries), pa.int8()),
                                                pa.array(entries, pa.int32()))
        restored = table_of(table_bytes(pa.table({"dp_tag": column})))["dp_tag"]
        assert restored.to_pylist() == column.dictionary_decode().to_pylist()


def test_a_batch_of_no_partition_draws_nothing():
    batch = dpsql.testing.keys(1).partitions([])
    assert batch.tags(np.empty(0, np.intp), np.empty(0)).shape == (0,)
    assert batch.take(np.empty(0, np.intp)).tags(np.empty(0, np.intp), np.empty(0)).shape == (0,)
    assert batch.lane(Lane.ROWS).uniform(0, 4).shape == (0, 4)
