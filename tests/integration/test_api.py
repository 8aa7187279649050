"""The single charging path, input validation and the Release object."""

import numpy as np
import polars as pl
import pyarrow as pa
import pytest

import dpsql
from dpsql import api
from dpsql.errors import BudgetExhausted, DPError, InvalidData, InvalidParameter


def test_publish_charges_once_and_returns_a_charged_release():
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    with dpsql.testing.seeded(0):
        rel = api.publish("laplace", np.arange(10.0), budget=budget, note="hello", epsilon=0.4, upper=10.0)
    history = budget.history()
    assert history.height == 1
    row = history.row(0, named=True)
    assert (row["method"], row["epsilon"], row["rows"], row["partitions"], row["note"]) == ("laplace", 0.4, 10, 1,
                                                                                           "hello")
    assert row["release_id"] == rel.release_id
    assert "replace-one-value" in row["neighbour"]


def test_partitioned_release_is_charged_once_at_the_max():
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    values = np.arange(30.0)
    with dpsql.testing.seeded(1):
        rel = api.publish("laplace", values, budget=budget, partition_offsets=[0, 10, 25, 30], epsilon=0.5,
                          upper=30.0)
    assert isinstance(rel, api.PartitionedRelease)
    assert budget.spent == (0.5, 0.0)
    assert budget.history()["partitions"].to_list() == [3]
    assert [len(p) for p in rel.parts] == [10, 15, 5]
    np.testing.assert_array_equal(rel.values, np.concatenate([p.values for p in rel.parts]))


@pytest.mark.parametrize("method, params", [("laplace", {"upper": 30.0}), ("count_laplace", {})])
def test_partitions_of_independent_rows_are_one_run_with_per_partition_error_models(method, params):
    """Rows released independently: the partitioned release is the unpartitioned one cut at the
    offsets (same seeded draws), drawn in one call, each part with its own length's error model."""
    values = np.arange(30.0)
    offsets = [0, 10, 25, 30]
    with dpsql.testing.seeded(2):
        whole = api.publish(method, values, epsilon=0.5, **params)
    with dpsql.testing.seeded(2) as source:
        calls = []
        real = source.discrete_laplace
        source.discrete_laplace = lambda scale, size: calls.append(size) or real(scale, size)
        parted = api.publish(method, values, partition_offsets=offsets, epsilon=0.5, **params)
    assert calls == [30]
    np.testing.assert_array_equal(parted.values, whole.values)
    for part, a, b in zip(parted.parts, offsets[:-1], offsets[1:]):
        np.testing.assert_array_equal(part.values, whole.values[a:b])
        assert len(part) == b - a
        assert part.range_variance(0, b - a) == pytest.approx(whole.range_variance(a, b))
        assert (part.epsilon, part.method) == (0.5, whole.method)


def test_partitions_of_dependent_rows_run_one_machine_each():
    values = np.arange(40.0)
    with dpsql.testing.seeded(3):
        parted = api.publish("binary_tree", values, partition_offsets=[0, 16, 40], epsilon=0.5, upper=40.0)
    with dpsql.testing.seeded(3):
        first = api.publish("binary_tree", values[:16], epsilon=0.5, upper=40.0)
    np.testing.assert_array_equal(parted.parts[0].values, first.values)
    assert parted.parts[1].params == api.publish("binary_tree", values[16:], epsilon=0.5, upper=40.0).params


@pytest.mark.parametrize("offsets", [[0, 10], [1, 30], [0, 10, 10, 30], [0, 40]])
def test_bad_partition_offsets_are_refused(offsets):
    with pytest.raises(InvalidParameter, match="partition_offsets"):
        api.publish("laplace", np.arange(30.0), partition_offsets=offsets, epsilon=0.5, upper=30.0)


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
        api.publish("laplace", values, budget=budget, column="kwh", epsilon=0.5, upper=1.0)
    assert budget.spent == (0.0, 0.0)


@pytest.mark.parametrize(("params", "message"), [
    ({"epsilon": 0, "upper": 1.0}, "epsilon must be > 0"),
    ({"epsilon": -1, "upper": 1.0}, "epsilon must be > 0"),
    ({"epsilon": float("nan"), "upper": 1.0}, "epsilon must be finite"),
    ({"epsilon": float("inf"), "upper": 1.0}, "epsilon must be finite"),
    ({"epsilon": 1.0, "upper": 0.0}, "upper must be > lower"),
    ({"epsilon": 1.0, "upper": float("inf")}, "upper must be finite"),
    ({"epsilon": 1.0, "upper": 1.0, "delta": 0.1}, "delta"),
])
def test_bad_parameters_get_a_typed_error_and_nothing_is_charged(params, message):
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    with pytest.raises(DPError, match=message):
        api.publish("laplace", np.ones(5), budget=budget, **params)
    assert budget.spent == (0.0, 0.0)


def test_unknown_method_lists_the_known_ones():
    with pytest.raises(InvalidParameter, match=r"unknown method 'magic'.*'laplace'"):
        api.publish("magic", np.ones(3), epsilon=1.0)


def test_exhausted_budget_releases_nothing_and_charges_nothing():
    budget = dpsql.Budget.in_memory(epsilon=0.3)
    with pytest.raises(BudgetExhausted):
        dpsql.laplace_stream(np.ones(4), epsilon=0.5, upper=1.0, budget=budget)
    assert budget.history().height == 0


def test_an_exception_inside_the_algorithm_charges_nothing(monkeypatch):
    from dpsql.streams.laplace import LaplaceStream

    def boom(self, chunk):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(LaplaceStream, "feed", boom)
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    with pytest.raises(RuntimeError):
        dpsql.laplace_stream(np.ones(4), epsilon=0.5, upper=1.0, budget=budget)
    assert budget.spent == (0.0, 0.0)


def test_budget_must_be_a_budget():
    with pytest.raises(InvalidParameter, match=r"dpsql\.Budget"):
        dpsql.laplace_stream(np.ones(4), epsilon=0.5, upper=1.0, budget=1.0)


def test_values_outside_the_bounds_are_clipped_not_refused():
    with dpsql.testing.seeded(0):
        rel = dpsql.laplace_stream(np.array([-1e9, 1e9]), epsilon=1e6, upper=1.0)
    np.testing.assert_allclose(rel.values, [0.0, 1.0], atol=1e-3)


def test_laplace_release_is_unbiased_with_the_analytic_variance():
    values = np.linspace(0, 10, 200_000)
    with dpsql.testing.seeded(7):
        rel = dpsql.laplace_stream(values, epsilon=0.5, upper=10.0)
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
            rel = dpsql.laplace_stream(values, epsilon=1.0, upper=5.0)
            low, high = rel.range_ci(starts, starts + width, level=level)
            covered.append((low <= 3.0 * width) & (3.0 * width <= high))
    rate = np.mean(covered)
    se = np.sqrt(level * (1 - level) / np.size(covered))
    assert level - 3 * se <= rate <= level + 0.03


def test_unknown_parameters_are_refused_and_delta_zero_is_fine_for_pure_methods():
    with pytest.raises(InvalidParameter, match=r"unknown parameter\(s\) 'fanout' for method 'laplace'"):
        api.publish("laplace", np.ones(3), epsilon=1.0, upper=1.0, fanout=16)
    with dpsql.testing.seeded(0):
        assert api.publish("laplace", np.ones(3), epsilon=1.0, upper=1.0, delta=0.0).delta == 0.0


def test_release_exports_and_range_arguments():
    with dpsql.testing.seeded(0):
        rel = dpsql.laplace_stream(np.arange(5.0), epsilon=1.0, upper=5.0)
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

    cost = api._compose([1.1, 0.45, 0.3], [0, 1, 1])
    assert Fraction(cost) >= Fraction(1.1) + Fraction(0.45)
    assert cost == pytest.approx(1.55, abs=1e-15)
    assert api._compose([0.5, 0.25], [0, 1]) == 0.75  # exact sums stay exact


def test_partitions_are_described_when_looked_at_and_error_models_do_not_hold_values():
    import gc
    import weakref

    offsets = np.arange(0, 40_001, 4000)
    values = np.tile(np.arange(4000.0), 10)
    with dpsql.testing.seeded(1):
        release = api.publish("tops", values, partition_offsets=offsets, epsilon=1.0, upper=4000.0)
    described = release.parts.descriptions
    assert sum(d is not None for d in described._described) <= 1  # at most the one the ledger record needs
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
    ("tops", dict(epsilon=100.0, upper=4000.0), 0.02),
    ("hierarchy", dict(epsilon=0.1, upper=4000.0, depth=0), 0.02),
    ("binary_tree", dict(epsilon=1.0, upper=4000.0), 0.02),
    # a local-DP error model keeps each report's start and variance (two arrays of a row's size),
    # its description also the public reports (a third)
    ("pp_s", dict(epsilon=1.0, w=10, lower=0.0, upper=4000.0), 3.05),
])
def test_error_models_hold_neither_noise_nor_values(method, params, most_bytes):
    """What a release keeps to describe its partitions later (and the DuckDB front end keeps
    for error bars) must not reveal more than the release: no noise (released values minus
    noise would be the clipped data), no values, and little memory."""
    values = np.random.default_rng(3).uniform(0, 4000, 40_000)
    offsets = np.arange(0, 40_001, 5000)
    with dpsql.testing.seeded(2):
        release = api.publish(method, values, partition_offsets=offsets, **params)
    errors = release.parts.errors  # before any partition is described, as DuckDB takes them
    parts = [release.part(k).values.copy() for k in range(len(release.parts))]
    descriptions = release.parts.descriptions
    del release
    for kept in (errors, descriptions):
        held = _reachable_arrays(kept)
        assert sum(a.nbytes for a in held) <= most_bytes * values.nbytes
        for part in parts:
            assert not any(a.shape == part.shape and np.array_equal(a, part) for a in held)
    assert errors[3] is descriptions[3]["error"]


def test_partitioned_release_pickles_as_its_parts():
    import pickle

    with dpsql.testing.seeded(5):
        release = api.publish("tops", np.arange(20_000.0) % 700, partition_offsets=[0, 8000, 16_000, 20_000],
                              epsilon=1.0, upper=1000.0)
    copy = pickle.loads(pickle.dumps(release))
    np.testing.assert_array_equal(copy.values, release.values)
    assert [p.threshold for p in copy.parts] == [p.threshold for p in release.parts]
    assert copy.part(2).range_variance(0, 4000) == release.part(2).range_variance(0, 4000)


def test_partitioned_thresholds_have_one_output_per_partition():
    budget = dpsql.Budget.in_memory(epsilon=5.0)
    values = np.r_[np.full(10, 3.0), np.full(20, 30.0)]
    with dpsql.testing.seeded(1):
        release = api.publish("threshold", values, partition_offsets=[0, 10, 30], epsilon=1.0, upper=40.0)
    assert len(release.parts) == 2 and len(release) == 2
    assert [p.values.tolist() for p in release.parts] == [[p.threshold] for p in release.parts]
    np.testing.assert_array_equal(release.values, [p.threshold for p in release.parts])
    with dpsql.testing.seeded(1):
        charged = api.publish("threshold", values, partition_offsets=[0, 10, 30], epsilon=1.0, upper=40.0,
                              budget=budget)
    assert budget.history()["partitions"].to_list() == [2] and charged.part(1).release_id == charged.release_id
