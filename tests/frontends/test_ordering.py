"""dpsql.ordering: every path puts rows in the order a lexicographic sort by (partition, time)
gives, refuses the smallest repeated key, and hands over to the caller's sort (None) exactly
when the keys do not fit."""

import numpy as np
import pytest

from dpsql import ordering
from dpsql.errors import InvalidTimeKey


class Repeated(InvalidTimeKey):
    pass


def refuse(time, partition):
    raise Repeated((time, partition))


def _pieces(array, sizes):
    """``array`` cut into consecutive pieces of the given sizes (the last takes the rest)."""
    bounds = np.cumsum([0, *sizes])
    return [array[a:b] for a, b in zip(bounds, [*bounds[1:-1], len(array)])]


def _layout(name, rng, n):
    """(time, partition) of n rows for each ordering path."""
    partition = rng.integers(-3, 4, n)  # ids need not start at 0
    if name == "placed, every slot":
        rows = 7 * 500
        partition = np.repeat(np.arange(-3, 4), 500)[:rows]
        time = np.tile(np.arange(500) * 3600 + 10**6, 7)[:rows]
    elif name == "placed, with gaps":
        slots = rng.choice(7 * 600, size=n, replace=False)
        partition, time = slots // 600 - 3, (slots % 600) * 15 - 40
    elif name == "sorted, packed":
        slots = rng.choice(7 * 10**9, size=n, replace=False)
        partition, time = slots // 10**9 - 3, slots % 10**9
    elif name == "sorted, two digits":  # keys beyond 2**51: too wide to pack 12 index bits
        time = np.unique(rng.integers(-2**40, 2**40, n))
        partition = rng.integers(-3, 4, len(time)) * 10**5  # sparse ids
    elif name == "already in order":
        return np.arange(n, dtype=np.int64) * 2, np.zeros(n, dtype=np.int64)
    else:
        raise ValueError(name)
    return time.astype(np.int64), partition.astype(np.int64)


PATHS = ["placed, every slot", "placed, with gaps", "sorted, packed", "sorted, two digits", "already in order"]
#: The step each layout must take (None: no reordering at all).
STEP = {"placed, every slot": "_place", "placed, with gaps": "_place", "sorted, packed": "_sort_packed",
        "sorted, two digits": "_sort_packed", "already in order": None}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("piece", [ordering.PIECE, 64])
def test_every_path_equals_a_lexicographic_sort(path, piece, monkeypatch):
    monkeypatch.setattr(ordering, "PIECE", piece)
    taken = []

    def spy(step):
        original = getattr(ordering, step)
        monkeypatch.setattr(ordering, step, lambda *args: taken.append(step) or original(*args))

    spy("_place")
    spy("_sort_packed")
    rng = np.random.default_rng(3)
    time, partition = _layout(path, rng, 3000)
    shuffle = rng.permutation(len(time)) if path != "already in order" else np.arange(len(time))
    time, partition = time[shuffle], partition[shuffle]
    values = rng.uniform(size=len(time))
    sizes = [1, 700, 999]  # pieces like Arrow chunks, not multiples of PIECE
    order = ordering.order_integer_keys(_pieces(time, sizes), values, partition=_pieces(partition, sizes),
                                        permutation=True, refuse_duplicate=refuse)
    expected = np.lexsort((time, partition))
    np.testing.assert_array_equal(order.permutation, expected)
    np.testing.assert_array_equal(order.values, values[expected])
    np.testing.assert_array_equal(order.times(), time[expected])
    starts = np.flatnonzero(np.diff(partition[expected])) + 1
    np.testing.assert_array_equal(order.offsets, np.concatenate([[0], starts, [len(time)]]))
    np.testing.assert_array_equal(order.partition_ids(), np.unique(partition))
    assert taken == ([STEP[path]] if STEP[path] else [])


def test_without_partitions_and_without_permutation():
    time = np.array([40, 10, 30, 20], dtype=np.int32)  # int32, like an Arrow date32
    order = ordering.order_integer_keys([time], np.array([4.0, 1.0, 3.0, 2.0]), refuse_duplicate=refuse)
    assert order.permutation is None
    np.testing.assert_array_equal(order.values, [1.0, 2.0, 3.0, 4.0])
    np.testing.assert_array_equal(order.offsets, [0, 4])
    np.testing.assert_array_equal(order.times(), [10, 20, 30, 40])
    assert order.step == 10 and order.span == 4


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32])
def test_narrow_integer_keys_spanning_beyond_their_type_keep_their_values(dtype):
    """Distances between narrow keys can exceed the type (int8: 100 - -100): int64 arithmetic."""
    info = np.iinfo(dtype)
    time = np.array([info.max, info.min, 26, -90, 50, 0], dtype=dtype)
    order = ordering.order_integer_keys([time], np.arange(6.0), refuse_duplicate=refuse)
    np.testing.assert_array_equal(order.times(), np.sort(time.astype(np.int64)))
    np.testing.assert_array_equal(order.values, np.argsort(time).astype(float))


def test_an_hourly_grid_of_microsecond_timestamps_is_placed_by_its_step():
    hours = np.random.default_rng(0).permutation(1000)
    time = 1_700_000_000 * 10**6 + hours * 3600 * 10**6
    order = ordering.order_integer_keys([time], hours.astype(float), refuse_duplicate=refuse)
    assert order.step == 3600 * 10**6 and order.span == 1000
    np.testing.assert_array_equal(order.values, np.arange(1000.0))


@pytest.mark.parametrize(("time", "partition"), [
    (np.array([0, 2**62 + 1]), None),                         # times spanning 2**62
    (np.array([0, 2**31 + 1, 2]), np.array([0, 2**31, 10])),  # partition ids times time steps reach 2**62
])
def test_keys_that_do_not_fit_are_left_to_the_caller(time, partition):
    pieces = None if partition is None else [partition]
    assert ordering.order_integer_keys([time], np.zeros(len(time)), partition=pieces, refuse_duplicate=refuse) is None


@pytest.mark.parametrize("path", PATHS[:4])
def test_the_smallest_repeated_key_is_refused_on_every_path(path):
    rng = np.random.default_rng(5)
    time, partition = _layout(path, rng, 3000)
    # repeat two keys: the refusal names the one that comes first in stream order
    order = np.lexsort((time, partition))
    first, second = order[100], order[2000]
    time[order[101]], partition[order[101]] = time[first], partition[first]
    time[order[2001]], partition[order[2001]] = time[second], partition[second]
    shuffle = rng.permutation(len(time))
    with pytest.raises(Repeated) as refused:
        ordering.order_integer_keys([time[shuffle]], np.zeros(len(time)), partition=[partition[shuffle]],
                                    refuse_duplicate=refuse)
    assert refused.value.args[0] == (time[first], partition[first])


def test_a_time_repeated_in_two_partitions_is_fine():
    order = ordering.order_integer_keys([np.array([5, 5, 6])], np.array([1.0, 2.0, 3.0]),
                                        partition=[np.array([1, 0, 0])], refuse_duplicate=refuse)
    np.testing.assert_array_equal(order.values, [2.0, 3.0, 1.0])
    np.testing.assert_array_equal(order.offsets, [0, 2, 3])


def test_the_message_names_columns_and_value():
    assert ordering.duplicate_time_message("ts", "7", ["g"]) == (
        "order column 'ts' has duplicate value 7 within a partition of 'g'; time keys must be unique within a "
        "partition")
    assert ordering.duplicate_time_message("ts", "7", []) == (
        "order column 'ts' has duplicate value 7; time keys must be unique")


def test_more_rows_than_a_row_index_and_a_digit_can_share_are_left_to_the_caller():
    class Huge:  # only its length is looked at
        def __len__(self):
            return 2**32 + 1

    assert ordering.order_integer_keys([np.array([1])], Huge(), refuse_duplicate=refuse) is None
