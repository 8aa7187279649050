"""The single charging path (dpsql.publish), input validation and the Release object."""

import numpy as np
import polars as pl
import pyarrow as pa
import pytest

import dpsql
from dpsql import publishing
from dpsql.accounting import compose
from dpsql.addresses import partition_address, partition_addresses
from dpsql.errors import BudgetExhausted, DPError, InvalidData, InvalidParameter
from dpsql.methods import machine_for
from dpsql.partition_digests import AdmittedPartitions
from dpsql.release import chunks_of, release_from
from dpsql.streams.tops import ToPS


def alone(method, values, seed, key, **params):
    """``values`` released by ``method`` on their own, with the draws of partition ``key`` of the
    first release key of ``seeded(seed)``: what that partition of a partitioned release must be."""
    draws = dpsql.testing.keys(seed).partition(partition_address(key))
    machine = machine_for(method, len(values), draws, params)
    return release_from(machine, chunks_of(np.asarray(values, dtype=float)), len(values), private=False)


def test_publish_charges_once_and_returns_a_charged_release():
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    with dpsql.testing.seeded(0):
        rel = dpsql.publish("laplace", np.arange(10.0), budget=budget, note="hello", epsilon=0.4, upper=10.0)
    assert budget.history().columns == ["time", "kind", "method", "epsilon", "delta", "rows", "source", "note"]
    history = budget.history(full=True)
    assert history.height == 1
    row = history.row(0, named=True)
    assert (row["method"], row["epsilon"], row["rows"], row["partitions"], row["note"], row["source"]) == (
        "laplace", 0.4, 10, 1, "hello", "array of 10 values")
    assert row["release_id"] == rel.release_id and row["kind"] == "release" and row["private"] is False
    assert "replace-one-value" in row["neighbour"]
    assert rel.first_handle is not None and budget.release(rel.release_id).epsilon == 0.4


def test_partitioned_release_is_charged_once_at_the_max():
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    values = np.arange(30.0)
    with dpsql.testing.seeded(1):
        rel = dpsql.publish("laplace", values, budget=budget, partition_offsets=[0, 10, 25, 30], epsilon=0.5,
                            upper=30.0)
    assert isinstance(rel, dpsql.PartitionedRelease)
    assert budget.spent == (0.5, 0.0)
    assert budget.history(full=True)["partitions"].to_list() == [3]
    assert [len(p) for p in rel.parts] == [10, 15, 5]
    np.testing.assert_array_equal(rel.values, np.concatenate([p.values for p in rel.parts]))


@pytest.mark.parametrize("method, params", [("laplace", {"upper": 30.0}), ("count_laplace", {})])
def test_partitions_of_independent_rows_are_batched_with_per_partition_error_models(method, params, monkeypatch):
    """Rows released independently: every partition is exactly its release alone with the draws of
    its own key; partitions of one length are released in one batched run; each part has its own
    length's error model."""
    batched = []
    real = publishing.release_batched
    monkeypatch.setattr(publishing, "release_batched",
                        lambda machine, rows, out, draws: batched.append(rows.shape) or real(machine, rows, out, draws))
    values = np.arange(35.0)
    offsets = [0, 10, 20, 30, 35]
    with dpsql.testing.seeded(2):
        parted = dpsql.publish(method, values, partition_offsets=offsets, epsilon=0.5, **params)
    assert batched == [(3, 10)]  # the three partitions of 10 rows together; the one of 5 alone
    for k, (part, a, b) in enumerate(zip(parted.parts, offsets[:-1], offsets[1:])):
        single = alone(method, values[a:b], 2, k, epsilon=0.5, **params)
        np.testing.assert_array_equal(part.values, single.values)
        np.testing.assert_array_equal(parted.values[a:b], single.values)
        assert len(part) == b - a
        assert part.range_variance(0, b - a) == pytest.approx(single.range_variance(0, b - a))
        assert part.range_variance(0, b - a) == pytest.approx((b - a) * part.range_variance(0, 1))
        assert (part.epsilon, part.method) == (0.5, single.method)
    assert len({part.values[0] - values[a] for part, a in zip(parted.parts, offsets)}) == 4  # no shared draws


def test_a_partitions_noise_is_addressed_by_its_key_whatever_is_released_with_it():
    values = np.arange(40.0)
    with dpsql.testing.seeded(4):
        together = dpsql.publish("binary_tree", values, partition_offsets=[0, 16, 40], partition_keys=["a", "b"],
                                 epsilon=0.5, upper=40.0)
    with dpsql.testing.seeded(4):
        b_alone = dpsql.publish("binary_tree", values[16:], partition_offsets=[0, 24], partition_keys=["b"],
                                epsilon=0.5, upper=40.0)
    np.testing.assert_array_equal(together.part(1).values, b_alone.part(0).values)
    with pytest.raises(InvalidParameter, match="one key per partition"):
        dpsql.publish("laplace", values, partition_offsets=[0, 16, 40], partition_keys=["a"], epsilon=0.5, upper=40.0)


def test_partitions_of_dependent_rows_run_one_machine_each():
    values = np.arange(40.0)
    with dpsql.testing.seeded(3):
        parted = dpsql.publish("binary_tree", values, partition_offsets=[0, 16, 40], epsilon=0.5, upper=40.0)
    for k, (a, b) in enumerate([(0, 16), (16, 40)]):
        single = alone("binary_tree", values[a:b], 3, k, epsilon=0.5, upper=40.0)
        np.testing.assert_array_equal(parted.parts[k].values, single.values)
        assert parted.parts[k].params == single.params
        assert parted.parts[k].range_variance(0, b - a) == single.range_variance(0, b - a)


@pytest.mark.parametrize("offsets", [[0, 10], [1, 30], [0, 10, 10, 30], [0, 40]])
def test_bad_partition_offsets_are_refused(offsets):
    with pytest.raises(InvalidParameter, match="partition_offsets"):
        dpsql.publish("laplace", np.arange(30.0), partition_offsets=offsets, epsilon=0.5, upper=30.0)


@pytest.mark.parametrize(("values", "message"), [
    (np.array([1.0, np.nan]), "column 'kwh' contains NaN"),
    (np.array([1.0, np.inf]), "column 'kwh' contains infinite"),
    (np.array([]), "column 'kwh' is empty"),
    (np.ones((2, 2)), "column 'kwh' must be 1-D"),
    (np.array(["a", "b"]), "column 'kwh' must be numeric"),
    ([1.0, None], "column 'kwh' contains 1 null"),
    (pa.array([1.0, None, 2.0]), "column 'kwh' contains 1 null"),
    (pl.Series([1.0, None]), "column 'kwh' contains 1 null"),
])
def test_bad_values_get_a_typed_error_naming_the_column_and_nothing_is_charged(values, message):
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    with pytest.raises(InvalidData, match=message):
        dpsql.publish("laplace", values, budget=budget, column="kwh", epsilon=0.5, upper=1.0)
    assert budget.spent == (0.0, 0.0)


@pytest.mark.parametrize(("params", "message"), [
    ({"epsilon": 0, "upper": 1.0}, "epsilon must be > 0"),
    ({"epsilon": -1, "upper": 1.0}, "epsilon must be > 0"),
    ({"epsilon": float("nan"), "upper": 1.0}, "epsilon must be finite"),
    ({"epsilon": float("inf"), "upper": 1.0}, "epsilon must be finite"),
    ({"epsilon": 1.0, "upper": 0.0}, "upper must be > lower"),
    ({"epsilon": 1.0, "upper": float("inf")}, "upper must be finite"),
    ({"epsilon": 1.0, "upper": 1.0, "delta": 0.1}, "delta"),
    ({"epsilon": 1000.0, "upper": 1.0}, "epsilon must be between 1e-09 and 100"),
])
def test_bad_parameters_get_a_typed_error_and_nothing_is_charged(params, message):
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    with pytest.raises(DPError, match=message):
        dpsql.publish("laplace", np.ones(5), budget=budget, **params)
    assert budget.spent == (0.0, 0.0)


def test_unknown_method_lists_the_known_ones():
    with pytest.raises(InvalidParameter, match=r"unknown method 'magic'.*'laplace'"):
        dpsql.publish("magic", np.ones(3), epsilon=1.0)


def test_exhausted_budget_releases_nothing_and_charges_nothing():
    budget = dpsql.Budget.in_memory(epsilon=0.3)
    with pytest.raises(BudgetExhausted) as refused:
        dpsql.laplace(np.ones(4), epsilon=0.5, upper=1.0, budget=budget)
    assert refused.value.remaining == (0.3, 0.0) and refused.value.requested == (0.5, 0.0)
    frames, tb = [], refused.value.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    assert frames[-1] == "publish"  # scrubbed: no frame that held drawn values is reachable from the error
    assert refused.value.__context__ is None and refused.value.__cause__ is None
    assert budget.history().height == 0


def test_an_exception_inside_the_algorithm_charges_nothing(monkeypatch):
    from dpsql.streams.laplace import LaplaceStream

    def boom(self, chunk):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(LaplaceStream, "feed", boom)
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    with pytest.raises(RuntimeError, match="disk on fire"):
        dpsql.laplace(np.ones(4), epsilon=0.5, upper=1.0, budget=budget)
    assert budget.spent == (0.0, 0.0) and budget.history().height == 0


def test_budget_must_be_a_budget():
    with pytest.raises(InvalidParameter, match=r"dpsql\.Budget"):
        dpsql.laplace(np.ones(4), epsilon=0.5, upper=1.0, budget=1.0)
    with pytest.raises(InvalidParameter, match=r"use_budget takes a dpsql\.Budget"):
        dpsql.use_budget(1.0)


def test_values_outside_the_bounds_are_clipped_not_refused():
    with dpsql.testing.seeded(0):
        rel = dpsql.laplace(np.array([-1e9, 1e9, 0.5]), epsilon=100.0, upper=1.0)  # noise scale 1/100
    np.testing.assert_allclose(rel.values, [0.0, 1.0, 0.5], atol=0.1)
    with dpsql.testing.seeded(0):
        clipped = dpsql.laplace(np.array([0.0, 1.0, 0.5]), epsilon=100.0, upper=1.0)
    np.testing.assert_array_equal(rel.values, clipped.values)  # exactly the release of the clipped values


def test_laplace_release_is_unbiased_with_the_analytic_variance():
    values = np.linspace(0, 10, 200_000)
    with dpsql.testing.seeded(7):
        rel = dpsql.laplace(values, epsilon=0.5, upper=10.0)
    err = rel.values - values
    assert abs(err.mean()) < 5 * np.sqrt(2 * 20.0**2 / values.size)
    assert abs(err.var() / (2 * 20.0**2) - 1) < 0.02
    assert abs(rel.range_variance(0, 1) / (2 * 20.0**2) - 1) < 1e-3
    assert rel.range_variance(5, 15) == pytest.approx(10 * rel.range_variance(0, 1))


@pytest.mark.parametrize("level", [0.9, 0.95])
@pytest.mark.parametrize("width", [1, 4, 100])
def test_range_ci_coverage_is_at_least_nominal(width, level):
    values = np.full(400, 3.0)
    starts = np.arange(0, 400, width)
    covered = []
    with dpsql.testing.seeded(width):
        for _ in range(2000 // len(starts)):
            rel = dpsql.laplace(values, epsilon=1.0, upper=5.0)
            low, high = rel.range_ci(starts, starts + width, level=level)
            covered.append((low <= 3.0 * width) & (3.0 * width <= high))
    rate = np.mean(covered)
    se = np.sqrt(level * (1 - level) / np.size(covered))
    assert level - 3 * se <= rate <= level + 0.03


def test_unknown_parameters_are_refused_and_delta_zero_is_fine_for_pure_methods():
    with pytest.raises(InvalidParameter, match=r"unknown parameter\(s\) 'fanout' for method 'laplace'"):
        dpsql.publish("laplace", np.ones(3), epsilon=1.0, upper=1.0, fanout=16)
    with pytest.raises(InvalidParameter, match=r"missing required parameter\(s\) 'upper'"):
        dpsql.publish("laplace", np.ones(3), epsilon=1.0)
    with dpsql.testing.seeded(0):
        assert dpsql.publish("laplace", np.ones(3), epsilon=1.0, upper=1.0, delta=0.0).delta == 0.0


def test_release_exports_and_range_arguments():
    with dpsql.testing.seeded(0):
        rel = dpsql.laplace(np.arange(5.0), epsilon=1.0, upper=5.0)
    assert rel.to_polars().columns == ["row", "value"]
    table = rel.to_arrow()
    assert b"dpsql" in table.schema.metadata and table.num_rows == 5
    assert rel.range_sum(0, 5) == pytest.approx(rel.values.sum())
    np.testing.assert_allclose(rel.range_sum([0, 1], [2, 3]), [rel.values[:2].sum(), rel.values[1:3].sum()])
    with pytest.raises(InvalidParameter, match="range"):
        rel.range_sum(3, 2)
    with pytest.raises(InvalidParameter, match="level"):
        rel.range_ci(0, 2, level=1.5)
    assert "private=False" in repr(rel)


def test_composed_level_costs_are_never_recorded_below_their_exact_sum():
    from fractions import Fraction

    cost = compose([1.1, 0.45, 0.3], [0, 1, 1])
    assert Fraction(cost) >= Fraction(1.1) + Fraction(0.45)
    assert cost == pytest.approx(1.55, abs=1e-15)
    assert compose([0.5, 0.25], [0, 1]) == 0.75  # exact sums stay exact
    budget = dpsql.Budget.in_memory(epsilon=2.0)
    with dpsql.testing.seeded(0):  # two levels of partitions: the maxima add up, as recorded
        dpsql.publish("laplace", np.ones(30), partition_offsets=[0, 10, 20, 30], partition_levels=[0, 1, 1],
                      epsilon=0.45, upper=1.0, budget=budget)
    assert budget.spent == (0.9, 0.0)


@pytest.mark.parametrize("levels", [0, [0.5, 0.9, 0.9], ["0", "1", "1"], [0, float("nan"), 1], [0, 1], [[0], [1], [1]],
                                    [np.array([0]), 1, 1]])
def test_partition_levels_that_are_not_one_whole_number_per_partition_are_refused_before_the_charge(levels):
    """A level truncated to another (0.5 to 0) would be charged as that level: refused, as are a
    single level, texts, NaN and a wrong count, with nothing spent."""
    budget = dpsql.Budget.in_memory(epsilon=5.0)
    with pytest.raises(dpsql.InvalidParameter, match="partition_levels"):
        dpsql.publish("laplace", np.ones(30), partition_offsets=[0, 10, 20, 30], partition_levels=levels,
                      epsilon=1.0, upper=1.0, budget=budget)
    assert budget.spent == (0.0, 0.0)
    release = dpsql.publish("laplace", np.ones(30), partition_offsets=[0, 10, 20, 30],
                            partition_levels=np.array([0.0, 1.0, 1.0]), epsilon=1.0, upper=1.0, budget=budget)
    assert release.epsilon == budget.spent[0] == 2.0  # whole numbers held as floats are levels


@pytest.mark.parametrize("levels", [[-(2**63), 0, 0], [2**62, -(2**62), 0], np.array([2**63, 0, 0], np.uint64),
                                    [2**63 - 1, -(2**63), 0]])
def test_extreme_partition_levels_are_charged_as_distinct_levels(levels):
    """Levels are only told apart: however far apart they are (the ends of int64, uint64 above
    it), distinct levels add up, as ``compose`` says, with partitions of two lengths (two
    groups of machines, numbered with the levels)."""
    budget = dpsql.Budget.in_memory(epsilon=10.0)
    dpsql.publish("laplace", np.ones(35), partition_offsets=[0, 10, 20, 35], partition_levels=levels, epsilon=0.5,
                  upper=1.0, budget=budget)
    assert budget.spent[0] == compose([0.5] * 3, [int(v) for v in levels])


def test_partitions_are_described_when_looked_at_and_error_models_do_not_hold_values():
    import gc
    import weakref

    offsets = np.arange(0, 40_001, 4000)
    values = np.tile(np.arange(4000.0), 10)
    with dpsql.testing.seeded(1):
        release = dpsql.publish("tops", values, partition_offsets=offsets, epsilon=1.0, upper=4000.0, m=1000)
    described = release.parts.descriptions
    assert len(described.described_kinds()) <= 1  # at most the first, which names the method
    third = release.part(3)
    assert release.part(3) is third and third.threshold is not None
    np.testing.assert_array_equal(third.values, release.values[12_000:16_000])
    errors = release.parts.errors
    assert errors[3] is third.error and len(errors) == 10
    held = weakref.ref(release.values)
    del release, third
    gc.collect()
    assert held() is None  # error models alone keep no released values alive
    assert errors[7].range_variance(np.array([0]), np.array([4000]))[0] > 0


def _reachable_arrays(root):
    """Every numpy array reachable from ``root`` through object references."""
    import gc
    import types

    seen, stack, arrays = set(), [root], []
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType, types.FunctionType)):
            continue
        seen.add(id(obj))
        if isinstance(obj, np.ndarray):
            arrays.append(obj)
        stack.extend(gc.get_referents(obj))
    return arrays


@pytest.mark.parametrize("method, params, most_bytes", [
    # blocks of one row (large epsilon, depth 0): leaf noise as large as the values
    ("tops", dict(epsilon=100.0, upper=4000.0, m=1000), 0.02),
    ("hierarchy", dict(epsilon=0.1, upper=4000.0, depth=0), 0.02),
    ("binary_tree", dict(epsilon=1.0, upper=4000.0), 0.02),
    # a local-DP error model keeps each report's start and variance (two arrays of a row's size),
    # its description also the public reports (a third; for PP-S they are the released values)
    ("pp_s", dict(epsilon=1.0, w=10, lower=0.0, upper=4000.0), 3.05),
])
def test_error_models_hold_neither_noise_nor_values(method, params, most_bytes):
    """What a release keeps to describe its partitions later (and the DuckDB front end keeps
    for error bars) must not reveal more than the release: no noise (released values minus
    noise would be the clipped data), no values, and little memory."""
    values = np.random.default_rng(3).uniform(0, 4000, 40_000)
    offsets = np.arange(0, 40_001, 5000)
    with dpsql.testing.seeded(2):
        release = dpsql.publish(method, values, partition_offsets=offsets, **params)
    errors = release.parts.errors  # before any partition is described, as DuckDB takes them
    parts = [release.part(k).values.copy() for k in range(len(release.parts))]
    descriptions = release.parts.descriptions
    del release
    public = {id(descriptions[k].get("reports")) for k in range(len(parts))}  # the published reports
    for kept in (errors, descriptions):
        held = _reachable_arrays(kept)
        assert sum(a.nbytes for a in held) <= most_bytes * values.nbytes
        for part in parts:
            assert not any(a.shape == part.shape and np.array_equal(a, part) for a in held if id(a) not in public)
    assert errors[3] is descriptions[3]["error"]


def test_partitioned_release_pickles_as_its_parts():
    import pickle

    with dpsql.testing.seeded(5):
        release = dpsql.publish("tops", np.arange(20_000.0) % 700, partition_offsets=[0, 8000, 16_000, 20_000],
                                epsilon=1.0, upper=1000.0, m=2000)
    copy = pickle.loads(pickle.dumps(release))
    np.testing.assert_array_equal(copy.values, release.values)
    assert [p.threshold for p in copy.parts] == [p.threshold for p in release.parts]
    assert copy.part(2).range_variance(0, 4000) == release.part(2).range_variance(0, 4000)


def test_partitioned_thresholds_have_one_output_per_partition():
    budget = dpsql.Budget.in_memory(epsilon=5.0)
    values = np.r_[np.full(10, 3.0), np.full(20, 30.0)]
    with dpsql.testing.seeded(1):
        release = dpsql.publish("threshold", values, partition_offsets=[0, 10, 30], epsilon=1.0, upper=40.0)
    assert len(release.parts) == 2 and len(release) == 2
    assert [p.values.tolist() for p in release.parts] == [[p.threshold] for p in release.parts]
    np.testing.assert_array_equal(release.values, [p.threshold for p in release.parts])
    with dpsql.testing.seeded(1):
        charged = dpsql.publish("threshold", values, partition_offsets=[0, 10, 30], epsilon=1.0, upper=40.0,
                                budget=budget)
    np.testing.assert_array_equal(charged.values, release.values)  # the same key: the same thresholds
    assert budget.history(full=True)["partitions"].to_list() == [2]
    assert charged.part(1).release_id == charged.release_id


def test_a_distributed_release_is_charged_once_before_its_tasks_and_releases_like_publish():
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    rng = np.random.default_rng(5)
    parts = {b"north": rng.uniform(0, 60, 700), b"south": rng.uniform(0, 60, 300)}
    keys, values, offsets = list(parts), np.concatenate(list(parts.values())), np.array([0, 700, 1000])
    columns = [pa.array(keys)]  # the partition key column, one row per partition
    order = [(np.arange(700),), (np.arange(300),)]  # the front end's bytes of each partition's order keys
    with dpsql.testing.seeded(3):
        planned = publishing.DistributedRelease("hierarchy", {"epsilon": 0.75, "upper": 60.0, "r": 256},
                                                budget=budget)
        assert budget.spent == (0.0, 0.0)  # planning validates and draws nothing
        checked = planned.fingerprint.digests([partition_address(k) for k in keys], values, offsets, order)
        assert checked == planned.fingerprint.digests(partition_addresses(columns), values, offsets, order)
        task = planned.charge(shapes={(700, 0): b"north", (300, 0): b"south"}, admitted=AdmittedPartitions(checked))
    assert budget.spent == (0.75, 0.0) and budget.history().height == 1  # once, for every partition
    assert task.key.hex() not in repr(task) and repr(task.key) not in repr(task)
    assert task.key.hex() not in repr(planned.fingerprint)
    with dpsql.testing.seeded(3):
        local = dpsql.publish("hierarchy", values, partition_offsets=offsets, partition_keys=keys, epsilon=0.75,
                              upper=60.0, r=256)
    released = task.release(columns, values, offsets, order)
    np.testing.assert_array_equal(released, local.values)
    # a retried task (here releasing one of the partitions) releases the same values
    south = [pa.array([b"south"])]
    np.testing.assert_array_equal(task.release(south, parts[b"south"], [0, 300], order[1:]), released[700:])
    # rows other than those checked (one value, or the order keys) are refused before anything is drawn
    changed = parts[b"south"].copy()
    changed[5] += 1.0
    with pytest.raises(dpsql.DataChanged, match="partition b'south' is not the data this release was charged for"):
        task.release(south, changed, [0, 300], order[1:])
    with pytest.raises(dpsql.DataChanged, match="partition b'north'"):
        task.release(columns, values, offsets, [(np.arange(1, 701),), order[1]])
    # the digests are keyed by the release: another release's digests of the same rows differ
    other = publishing.DistributedRelease("laplace", {"epsilon": 0.5, "upper": 60.0}, budget=budget)
    assert other.fingerprint.digests([b"x"], values, [0, 1000], [()]) != planned.fingerprint.digests(
        [b"x"], values, [0, 1000], [()])
    # a length the method's machine refuses is refused, naming the partition, before the charge
    with pytest.raises(InvalidParameter, match=r"partition 'x' has 10 row\(s\): m \(hold-out length\) must be <"):
        publishing.DistributedRelease("tops", {"epsilon": 0.1, "upper": 1.0, "m": 20, "threshold_by": "partition"},
                                      budget=budget).charge(shapes={(10, 0): "x"}, admitted=AdmittedPartitions([]))
    # digests are looked up by both halves: equal first halves (about never, with 64-bit halves) are told apart
    twins = [b"A" * 8 + bytes([k]) * 8 for k in range(4)]
    assert AdmittedPartitions(twins[:3], [5, 6, 7]).lookup([twins[2], twins[0], twins[3]]).tolist() == [7, 5, -1]
    assert AdmittedPartitions([]).lookup([twins[0]]).tolist() == [-1]
    # a second release that no longer fits is refused at its charge, charging nothing
    with pytest.raises(BudgetExhausted):
        other.charge(shapes={(1000, 0): "x"}, admitted=AdmittedPartitions([]))
    assert budget.spent == (0.75, 0.0)
    with pytest.raises(InvalidParameter, match="upper"):
        publishing.DistributedRelease("laplace", {"epsilon": 0.5, "upper": -1.0}, budget=budget)


def test_a_distributed_fleet_chooses_its_threshold_after_the_charge(monkeypatch):
    """The fleet's threshold is a private value: its Noisy Max draws happen only once the release
    is charged (a refused charge draws nothing), and the tasks release each partition under it
    with its pooled rows, as publish does."""
    chosen = []
    pooled_threshold = ToPS.pooled_threshold
    monkeypatch.setattr(ToPS, "pooled_threshold", lambda self, values, rows=None: chosen.append(len(values)) or
                        pooled_threshold(self, values, rows))
    rng = np.random.default_rng(4)
    values, offsets = rng.gamma(2.0, 3.0, 300), np.array([0, 100, 110, 300])
    keys = [pa.array(["a", "b", "c"])]
    pooled = np.array([20, 10, 20])  # the pool: the first 20, 10 and 20 rows, by row number
    order = [(np.arange(n),) for n in np.diff(offsets)]
    small = dpsql.Budget.in_memory(epsilon=0.5)
    with dpsql.testing.seeded(2):
        planned = publishing.DistributedRelease("tops", {"epsilon": 1.0, "upper": 40.0, "m": 50}, budget=small)
    assert planned.holdout == 50
    with pytest.raises(BudgetExhausted):
        planned.charge(shapes={(100, 20): "a"}, admitted=AdmittedPartitions([]), rows=300, pool=values[:50])
    assert chosen == [] and small.spent == (0.0, 0.0)
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    with dpsql.testing.seeded(2):
        planned = publishing.DistributedRelease("tops", {"epsilon": 1.0, "upper": 40.0, "m": 50}, budget=budget)
        digests = planned.fingerprint.digests(partition_addresses(keys), values, offsets, order)
        pool = np.concatenate([values[a:a + c] for a, c in zip(offsets[:-1], pooled)])
        task = planned.charge(shapes={(100, 20): "a", (10, 10): "b", (190, 20): "c"},
                              admitted=AdmittedPartitions(digests, pooled), rows=300, pool=pool)
    assert chosen == [50] and budget.spent == (1.0, 0.0)
    with dpsql.testing.seeded(2):
        local = dpsql.publish("tops", values, partition_offsets=offsets, partition_keys=keys[0], epsilon=1.0,
                              upper=40.0, m=50)
    np.testing.assert_array_equal(task.release(keys, values, offsets, order), local.values)
    assert [p.params["pooled_rows"] for p in local.parts] == pooled.tolist()
