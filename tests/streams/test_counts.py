"""Event tables -> count streams: time domain, bucketing, contribution caps, hierarchies, ledger."""

from __future__ import annotations

import datetime as dt

import numpy as np
import pytest

import dpsql
from dpsql import testing
from dpsql.accounting import Neighbour
from dpsql.counts import bucket_events, release_event_counts, time_domain
from dpsql.methods import run
from dpsql.streams.windows import window_sums

T0 = np.datetime64("2024-03-01T00:00", "ns")


def minutes(*values):
    return T0 + np.array(values, dtype="timedelta64[m]").astype("timedelta64[ns]")


# -- time domain ----------------------------------------------------------------------------------


def test_domain_from_datetimes_strings_and_durations():
    d = time_domain(start=dt.datetime(2024, 3, 1), stop="2024-03-01T01:00", every=dt.timedelta(minutes=15))
    assert d.n_buckets == 4 and d.datetime
    assert time_domain(start=T0, stop=T0 + np.timedelta64(1, "h"), every="1h").n_buckets == 1
    assert time_domain(start=T0, stop="2024-03-01T01:00", every="7m").n_buckets == 9  # last bucket is short
    assert time_domain(start=T0, stop="2024-03-02", every="1h30m").n_buckets == 16
    utc = dt.datetime(2024, 3, 1, 1, tzinfo=dt.timezone(dt.timedelta(hours=1)))
    assert time_domain(start=utc, stop="2024-03-01T01:00", every="1h").start == T0.astype(np.int64)
    assert time_domain(start=0, stop=10.5, every=2).n_buckets == 6


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"start": None, "stop": "2024-03-02", "every": "1h"}, "start is required"),
    ({"start": T0, "stop": None, "every": "1h"}, "stop is required"),
    ({"start": T0, "stop": "2024-03-02", "every": None}, "every is required"),
    ({"start": "2024-03-02", "stop": T0, "every": "1h"}, "stop must be after start"),
    ({"start": T0, "stop": "2024-03-02", "every": "5 minutes"}, "every must be a duration"),
    ({"start": T0, "stop": "2024-03-02", "every": "0m"}, "positive"),
    ({"start": T0, "stop": "2024-03-02", "every": 5}, "every must be a duration"),
    ({"start": "yesterday", "stop": "2024-03-02", "every": "1h"}, "start must be a datetime"),
    ({"start": 0, "stop": 10, "every": 0}, "every must be > 0"),
])
def test_domain_errors_name_the_parameter(kwargs, match):
    with pytest.raises(dpsql.InvalidParameter, match=match):
        time_domain(**kwargs)


# -- bucketing --------------------------------------------------------------------------------------


def test_empty_buckets_released_and_outside_events_dropped():
    d = time_domain(start=T0, stop="2024-03-01T01:00", every="10m")
    b = bucket_events(minutes(-1, 0, 9, 9, 35, 60, 61), domain=d)
    assert b.counts.tolist() == [[3, 0, 0, 1, 0, 0]]
    assert str(d.bucket_starts()[3]) == "2024-03-01T00:30:00.000000000"


def test_partitions_by_key_combination():
    d = time_domain(start=0, stop=4, every=1)
    b = bucket_events([0, 0, 1, 3, 3], domain=d, keys={"ap": ["x", "y", "x", "x", "y"], "floor": [1, 1, 1, 1, 2]})
    assert b.keys["ap"].tolist() == ["x", "y", "y"] and b.keys["floor"].tolist() == [1, 1, 2]
    assert b.counts.tolist() == [[1, 1, 0, 1], [1, 0, 0, 0], [0, 0, 0, 1]]


def test_contribution_cap_keeps_earliest_events_per_unit_and_bucket_across_partitions():
    d = time_domain(start=0, stop=20, every=10)
    times = [5, 1, 3, 2, 12, 13, 14, 4]
    units = ["a", "a", "a", "a", "a", "a", "a", "b"]
    rooms = ["r1", "r2", "r1", "r1", "r1", "r1", "r1", "r2"]
    b = bucket_events(times, domain=d, keys={"room": rooms}, units=units, cap=2)
    # unit a, bucket 0: times 1 (r2) and 2 (r1) are its earliest two; b's event always counts
    assert b.keys["room"].tolist() == ["r1", "r2"]
    assert b.counts.tolist() == [[1, 2], [2, 0]]


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"units": ["a", "b"]}, dpsql.InvalidParameter, "cap"),
    ({"cap": 2}, dpsql.InvalidParameter, "privacy unit"),
    ({"units": ["a", "b"], "cap": 0}, dpsql.InvalidParameter, "cap must be >= 1"),
    ({"keys": {"room": ["a", None]}}, dpsql.InvalidTimeKey, "partition column 'room' contains 1 NULL value"),
    ({"units": ["a", None], "cap": 1}, dpsql.InvalidData, "'privacy unit' contains 1 null"),
    ({"keys": {"room": ["a"]}}, dpsql.InvalidData, "one value per event"),
])
def test_bucketing_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        bucket_events([1, 2], domain=time_domain(start=0, stop=4, every=1), **kwargs)


def test_order_column_errors():
    d = time_domain(start=T0, stop="2024-03-02", every="1h")
    with pytest.raises(dpsql.InvalidTimeKey, match="'ts' contains 1 null"):
        bucket_events(np.array([T0, np.datetime64("NaT")]), domain=d, order_by="ts")
    with pytest.raises(dpsql.InvalidData, match="must hold datetimes"):
        bucket_events(np.array([1, 2]), domain=d, order_by="ts")
    with pytest.raises(dpsql.InvalidData, match="NaN"):
        bucket_events(np.array([1.0, np.nan]), domain=time_domain(start=0, stop=4, every=1), order_by="ts")


# -- release and ledger ----------------------------------------------------------------------------------


def events(n=4000, seed=0):
    rng = np.random.default_rng(seed)
    times = T0 + rng.integers(0, 6 * 3600, n).astype("timedelta64[s]").astype("timedelta64[ns]")
    building = rng.choice(["B1", "B2"], n)
    floor = rng.choice([1, 2], n)
    room = rng.choice(["a", "b", "c"], n)
    return times, building, floor, room


def test_partitioned_release_charges_epsilon_once():
    times, building, _, _ = events()
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    with testing.seeded(1):
        out = release_event_counts(times, start=T0, stop="2024-03-01T06:00", every="30m", epsilon=0.7,
                                   keys={"building": building}, budget=budget, smoother="average", window=4,
                                   alarm_threshold=600, order_by="ts")
    assert budget.spent == (0.7, 0.0) and len(budget.history()) == 1
    cols = out.columns()
    assert len(cols["dp_count"]) == 2 * 12 and "dp_level" not in cols
    assert cols["building"].tolist() == ["B1"] * 12 + ["B2"] * 12
    assert cols["dp_row"].tolist() == list(range(12)) * 2 and cols["dp_part"].tolist() == [0] * 12 + [1] * 12
    assert str(cols["ts"][1]) == "2024-03-01T00:30:00.000000000"
    true = bucket_events(times, domain=out.domain, keys={"building": building}).counts.ravel()
    assert np.abs(cols["dp_count"] - true).max() < 60
    assert np.all(cols["dp_std_error"] > 0) and np.all(cols["dp_window_std_error"] >= cols["dp_std_error"])
    np.testing.assert_array_equal(cols["dp_alarm"], cols["dp_window_sum"] >= 600)
    part = out.parts()[1]
    assert cols["dp_window_sum"][12 + 5] == pytest.approx(window_sums(part, window=4)[0][5])


def test_hierarchy_levels_share_epsilon_and_ledger_equals_epsilon():
    times, building, floor, room = events()
    for epsilon in (1.0, 0.3, 0.1):
        budget = dpsql.Budget.in_memory(epsilon=epsilon)
        with testing.seeded(2):
            out = release_event_counts(times, start=T0, stop="2024-03-01T06:00", every="1h", epsilon=epsilon,
                                       keys={"building": building, "floor": floor, "room": room},
                                       hierarchy=True, budget=budget)
        assert budget.spent == (epsilon, 0.0) and len(budget.history()) == 1
        assert budget.history()["note"][0] == "hierarchy of 3 levels at epsilon / 3 each"
        assert out.release.epsilon == epsilon
        parts = out.parts()
        assert {p.epsilon for p in parts} == {dpsql.accounting.largest_share(epsilon, epsilon / 3, count=3)}
        assert abs(parts[0].epsilon - epsilon / 3) < 1e-15
    cols = out.columns()
    levels = cols["dp_level"]
    # 2 buildings, 4 (building, floor), 12 (building, floor, room) streams of 6 hours
    assert np.bincount(levels).tolist() == [0, 2 * 6, 4 * 6, 12 * 6]
    assert all(v is None for v in cols["floor"][levels == 1]) and all(v is None for v in cols["room"][levels < 3])
    # every level counts every event once: true totals agree across levels
    true = {lvl: bucket_events(times, domain=out.domain,
                               keys=dict(list({"building": building, "floor": floor, "room": room}.items())[:lvl]))
            for lvl in (1, 2, 3)}
    assert len({int(t.counts.sum()) for t in true.values()}) == 1


def test_laplace_method_without_a_cap_is_the_event_level_baseline():
    times = events(n=500)[0]
    with testing.seeded(3):
        out = release_event_counts(times, start=T0, stop="2024-03-01T06:00", every="1h", epsilon=1.0,
                                   method="count_laplace")
    part = out.parts()[0]
    assert part.method == "count_laplace" and part.params["sensitivity"] == 1.0
    assert part.range_variance(0, 1) == pytest.approx(2 * 1.0, rel=1e-3)
    assert part.neighbour == Neighbour.ADD_REMOVE_EVENT
    true = bucket_events(times, domain=out.domain).counts.ravel()
    assert np.abs(part.values - true).max() < 20


def test_a_cap_of_k_is_sensitivity_k_for_the_count_machines():
    """What release_event_counts hands the machines for ``cap=3``: noise for sensitivity 3 (9 times
    the variance) under the privacy-unit neighbour."""
    counts = np.full(50, 4.0)
    for method in ("count_laplace", "pegasus"):
        one = run(method, counts, noise=testing.keys(3), epsilon=1.0)
        three = run(method, counts, noise=testing.keys(3), epsilon=1.0, sensitivity=3)
        assert three.params["sensitivity"] == 3.0 and "privacy unit" in three.neighbour
        assert three.range_variance(0, 1) == pytest.approx(9 * one.range_variance(0, 1), rel=1e-3)
    assert three.params["theta"] == pytest.approx(3 * one.params["theta"], rel=1e-3)  # up to lattice rounding


def test_laplace_method_and_cap_sensitivity():
    times = events(n=500)[0]
    units = np.arange(500) % 50
    with testing.seeded(3):
        out = release_event_counts(times, start=T0, stop="2024-03-01T06:00", every="1h", epsilon=1.0,
                                   method="count_laplace", units=units, cap=3)
    part = out.parts()[0]
    assert part.method == "count_laplace" and part.params["sensitivity"] == 3.0
    assert part.range_variance(0, 1) == pytest.approx(2 * 9.0, rel=1e-3)
    assert "privacy unit" in part.neighbour


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"method": "tree"}, dpsql.InvalidParameter, "method"),
    ({"method": "count_laplace", "smoother": "js"}, dpsql.InvalidParameter, "smoother"),
    ({"epsilon": -1.0}, dpsql.InvalidParameter, "epsilon"),
    ({"smoother": "mode"}, dpsql.InvalidParameter, "smoother"),
    ({"hierarchy": True}, dpsql.InvalidParameter, "hierarchy needs"),
    ({"window": 0}, dpsql.InvalidParameter, "window"),
    ({"alarm_threshold": 3.0}, dpsql.InvalidParameter, "alarm_threshold needs window"),
    ({"window": 2, "alarm_threshold": float("nan")}, dpsql.InvalidParameter, "alarm_threshold"),
    ({"start": "2030-01-01", "stop": "2030-01-02", "keys": {"b": ["x"] * 3}}, dpsql.InvalidData, "no event"),
])
def test_refused_release_charges_nothing(kwargs, error, match):
    budget = dpsql.Budget.in_memory(epsilon=2.0)
    params = {"start": T0, "stop": "2024-03-01T06:00", "every": "1h", "epsilon": 1.0, **kwargs}
    with pytest.raises(error, match=match):
        release_event_counts(minutes(1, 2, 3), budget=budget, **params)
    assert budget.spent == (0.0, 0.0)


def test_no_events_without_keys_releases_the_zero_stream():
    """Without partition keys the domain alone says what is released: every bucket, even when no
    event falls in the domain, is the release of a count of 0."""
    with testing.seeded(4):
        out = release_event_counts(minutes(500), start=T0, stop="2024-03-01T01:00", every="10m", epsilon=1.0,
                                   theta=1.0)
    with testing.seeded(4):
        zeros = dpsql.publish("pegasus", np.zeros(6), epsilon=1.0, theta=1.0)
    cols = out.columns()
    assert len(cols["dp_count"]) == 6
    np.testing.assert_array_equal(cols["dp_count"], zeros.values)
    np.testing.assert_allclose(cols["dp_std_error"], np.sqrt(zeros.range_variance(np.arange(6), np.arange(1, 7))))


@pytest.mark.parametrize("method", ["pegasus", "count_smoothed", "count_laplace"])
def test_degenerate_streams_release_and_counts_beyond_the_lattice_are_refused_uncharged(method):
    """All-zero streams and a single bucket are released like any other (the smoothers' warm-up
    and choices need no history); counts at the int64 limit cannot carry lattice noise and are
    refused with the typed error, before any charge."""
    budget = dpsql.Budget.in_memory(epsilon=5.0)
    with testing.seeded(5):
        zero = dpsql.publish(method, np.zeros(300), epsilon=0.5, budget=budget)
        single = release_event_counts(minutes(5, 7), start=T0, stop="2024-03-01T00:10", every="10m", epsilon=0.5,
                                      method=method, budget=budget, window=3)
    assert np.isfinite(zero.values).all() and zero.range_variance(0, 300) > 0
    cols = single.columns()
    assert len(cols["dp_count"]) == 1 and np.isfinite([cols["dp_std_error"][0], cols["dp_window_sum"][0]]).all()
    assert budget.spent == (1.0, 0.0)
    for huge in (np.full(10, float(np.iinfo(np.int64).max)), np.array([0.0, 2.0**62])):
        with pytest.raises(dpsql.InvalidParameter, match=r"2\*\*53"):
            dpsql.publish(method, huge, epsilon=0.5, budget=budget)
    assert budget.spent == (1.0, 0.0) and len(budget.history()) == 2


@pytest.mark.parametrize(("keys", "match"), [
    ({"room": np.array([1.0, np.nan])}, "partition column 'room' contains NaN"),
    ({"room": np.array(["a", None], dtype=object)}, "partition column 'room' contains 1 NULL value"),
])
def test_partition_keys_without_a_value_are_refused_in_the_shared_words(keys, match):
    with pytest.raises(dpsql.InvalidTimeKey, match=match):
        bucket_events([1, 2], domain=time_domain(start=0, stop=4, every=1), keys=keys)


def test_front_ends_tell_null_partition_keys_from_nan():
    """An integer column's NULL becomes NaN in numpy: the front ends count NULLs first."""
    import polars as pl

    budget = dpsql.Budget.in_memory(epsilon=10.0)
    for column, match in [(pl.Series("g", [1, None], dtype=pl.Int64), "contains 1 NULL value"),
                          (pl.Series("g", [1.0, float("nan")]), "contains NaN")]:
        frame = pl.DataFrame({"ts": [1.0, 2.0], "g": column})
        with pytest.raises(dpsql.InvalidTimeKey, match=f"partition column 'g' {match}"):
            dpsql.count_stream(frame, "ts", every=1.0, start=0.0, stop=5.0, epsilon=1.0, partition_by="g",
                               budget=budget)
    assert budget.spent == (0.0, 0.0)
