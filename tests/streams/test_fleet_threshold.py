"""A fleet's threshold (issue 21 item 3): one clipping threshold for all partitions, chosen once from
their pooled first rows; the default for partitioned ToPS and PAK, in every front end and in streams."""

import numpy as np
import polars as pl
import pytest

import dpsql
from dpsql.addresses import partition_address
from dpsql.methods import machine_for
from dpsql.release import release_from
from dpsql.streams.holdout import DEFAULT_HOLDOUT, pooled_by_key, pooled_counts
from dpsql.testing import seeded


def _fleet(partitions, rows, seed=0):
    rng = np.random.default_rng(seed)
    return rng.lognormal(1.0, 1.2, (partitions, rows))


def test_the_pool_takes_the_first_rows_of_every_partition():
    lengths = np.array([5, 1, 5, 3])
    order = np.array([2, 0, 3, 1])  # ranks by address
    counts = pooled_counts(np.zeros(4, np.int64), lengths, order, 9)
    assert counts.tolist() == [3, 1, 2, 3]  # rows 0 and 1 of all, then row 2 by address (3, then 0)
    assert pooled_counts(np.zeros(4, np.int64), lengths, order, 100).tolist() == lengths.tolist()
    # by order key: the fleet's earliest rows, ties by address
    keys = np.array([0, 5, 9, 1, 2, 3, 3])
    owner = np.array([0, 0, 0, 1, 1, 2, 2])
    assert pooled_by_key(keys, owner, np.array([1, 2, 0]), 4, 3).tolist() == [1, 2, 1]


def test_a_fleet_release_is_each_partition_under_the_fleets_threshold():
    """The oracle: the threshold from the pooled rows by the method's own rule, drawn from the fleet's
    (unpartitioned) address; then each partition alone with that threshold and its pooled rows."""
    values = _fleet(300, 50)
    offsets = np.arange(0, 300 * 50 + 1, 50)
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    with seeded(4) as keys:
        release = dpsql.publish("tops", values.ravel(), partition_offsets=offsets, epsilon=1.0, upper=500.0,
                                budget=budget)
    assert budget.spent == (1.0, 0.0)  # the pool is one mechanism: charged as one stream
    pooled = pooled_counts(np.zeros(300, np.int64), np.full(300, 50), np.argsort(np.argsort(
        [partition_address(k) for k in range(300)])), DEFAULT_HOLDOUT)
    pool = np.concatenate([values[p, :c] for p, c in enumerate(pooled)])
    fleet = machine_for("tops", values.size, keys.partition(b""), {"epsilon": 1.0, "upper": 500.0, "m": 4096})
    theta = fleet.pooled_threshold(pool, 50)  # for ranges in a partition's 50 rows
    assert {part.threshold for part in release.parts} == {theta}
    for p in (0, 7, 299):
        machine = machine_for("tops", 50, keys.partition(partition_address(p)),
                              {"epsilon": 1.0, "upper": 500.0, "threshold": theta, "pooled_rows": int(pooled[p])})
        alone = release_from(machine, iter([values[p]]), 50, private=False)
        np.testing.assert_array_equal(release.part(p).values, alone.values)
        assert release.part(p).params["pooled_rows"] == pooled[p]
        assert release.part(p).components["threshold"] == (0.5, 0.0)


def test_the_default_works_on_partitions_of_any_length_and_per_partition_stays_available():
    values = _fleet(2000, 3).ravel()
    offsets = np.arange(0, values.size + 1, 3)
    with seeded(1):
        fleet = dpsql.publish("tops", values, partition_offsets=offsets, epsilon=1.0, upper=500.0)
    assert len(fleet.values) == values.size and len({p.threshold for p in fleet.parts[:20]}) == 1
    with pytest.raises(dpsql.InvalidParameter, match=r"m \(hold-out length\) must be < the number of values"):
        dpsql.publish("tops", values, partition_offsets=offsets, epsilon=1.0, upper=500.0, threshold_by="partition")
    with pytest.raises(dpsql.InvalidParameter, match=r"the fleet's pooled hold-out\) must be < the number of values"):
        dpsql.publish("tops", values[:3000], partition_offsets=offsets[:1001], epsilon=1.0, upper=500.0)
    with pytest.raises(dpsql.InvalidParameter, match="threshold_by"):
        dpsql.publish("tops", values, partition_offsets=offsets, epsilon=1.0, upper=500.0, threshold_by="meter")
    budget = dpsql.Budget.in_memory(epsilon=1.0, delta=1e-6)
    with seeded(2):
        pak = dpsql.publish("pak", values, partition_offsets=offsets, epsilon=1.0, upper=500.0, budget=budget)
    assert len({p.threshold for p in pak.parts[:20]}) == 1
    assert budget.spent == (1.0, pak.delta) and pak.delta == 1.0 / values.size**2  # delta of the pool, once


def test_the_fleets_threshold_beats_the_public_bound_on_short_heavy_tailed_series():
    """Issue 21 item 3: 1,000 partitions of 400 heavy-tailed values, a loose public bound: the default's
    range MSE is at most half the hierarchy's at the public bound."""
    values = _fleet(1000, 400, seed=3)
    offsets = np.arange(0, values.size + 1, 400)
    rng = np.random.default_rng(0)
    starts = rng.integers(0, 300, 50)
    stops = starts + rng.integers(20, 100, 50)
    mse = {}
    for method in ("tops", "hierarchy"):
        with seeded(5):
            release = dpsql.publish(method, values.ravel(), partition_offsets=offsets, epsilon=1.0, upper=5000.0)
        errors = []
        for p in range(0, 1000, 50):
            released = np.concatenate([[0.0], np.cumsum(release.part(p).values)])
            true = np.concatenate([[0.0], np.cumsum(values[p])])
            errors.append((released[stops] - released[starts]) - (true[stops] - true[starts]))
        mse[method] = float(np.mean(np.square(errors)))
    assert mse["tops"] <= 0.5 * mse["hierarchy"], mse


def test_an_hourly_fleet_appended_daily_is_final_by_the_end_of_each_day():
    """Issue 22 item 2: 200 hourly meters appended a day at a time get a value for every row from the
    first append, final (calendar days, the fleet's threshold from the first day) by its end."""
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    stream = budget.stream("meters", method="tops", epsilon=1.0, order_by="ts", value="kwh", partition_by="meter",
                           upper=50.0)
    start = np.datetime64("2026-01-01T00:00", "us")
    rng = np.random.default_rng(2)
    for day in range(3):
        hours = start + (24 * day + np.arange(24)).astype("timedelta64[h]")
        frame = pl.DataFrame({"meter": np.repeat(np.arange(200), 24), "ts": np.tile(hours, 200),
                              "kwh": rng.gamma(2.0, 1.0, 4800)})
        out = stream.append(frame)
        assert out.num_rows == 4800 and out["dp_final"].to_numpy().mean() >= 0.99
    part = stream.release(partition=7)
    assert part.params["grid"] == {"first": "2026-01-01T00:00:00.000000000", "step": "1h"}
    assert part.params["threshold_by"] == "fleet" and len(part) == 72
