"""The Polars front end: alignment, one charge per evaluation, refusals, error bars."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

import dpsql
import dpsql.polars
from dpsql import publish
from dpsql.error_models import ErrorModel
from dpsql.mechanisms import LaplaceLattice
from dpsql.methods import METHODS
from dpsql.noise import Lane
from dpsql.release import StreamMachine

LAPLACE = dict(method="laplace", epsilon=0.5, upper=10.0)


def shuffled_frame(n=500, partitions=None, seed=3):
    """Rows in random physical order; ``ts`` strictly increasing within each partition."""
    rng = np.random.default_rng(seed)
    part = np.arange(n) % partitions if partitions else np.zeros(n, dtype=np.int64)
    frame = pl.DataFrame({"meter": part, "ts": np.arange(n) // (partitions or 1) * 7 + 1000,
                          "kwh": rng.uniform(0, 12, n)})
    return frame.sample(fraction=1.0, shuffle=True, seed=seed)


def charges(budget):
    """Rows of the budget's history: charged releases and free answers from the ledger."""
    return budget.history().height


def kinds(budget):
    return budget.history()["kind"].to_list()


def first_keys(ordered: pl.DataFrame, names: list[str], offsets) -> list:
    """Each partition's key as the front end passes it (a value, or a tuple for several columns):
    the partition's noise is addressed by it."""
    rows = ordered.select(names)[np.asarray(offsets[:-1], dtype=np.int64)].rows()
    return [row[0] for row in rows] if len(names) == 1 else rows


def release_of(out: pl.DataFrame, column: str, budget, order: list[str]):
    """The release behind an ``errors=True`` column, rebuilt from its ledger record with the
    released values in release order (partition, then time)."""
    record = budget.release(dp_row=out[column].struct.field("dp_row")[0])
    return record.with_values(out.sort(order)[column].struct.field("value").to_numpy())


# -- alignment and exact oracles ---------------------------------------------------------

def test_values_equal_publish_on_time_ordered_rows_scattered_back():
    frame = shuffled_frame()
    with dpsql.testing.seeded(11):
        out = frame.with_columns(dp=pl.col("kwh").dpsql.range_sum(order_by="ts", **LAPLACE))
    in_time_order = out.sort("ts")
    with dpsql.testing.seeded(11):
        oracle = publish("laplace", in_time_order["kwh"].to_numpy(), epsilon=0.5, upper=10.0)
    np.testing.assert_array_equal(in_time_order["dp"].to_numpy(), oracle.values)
    assert out["dp"].dtype == pl.Float64 and out["kwh"].equals(frame["kwh"])


def test_partitioned_values_equal_publish_with_partition_offsets():
    frame = shuffled_frame(n=600, partitions=4)
    with dpsql.testing.seeded(5):
        out = frame.with_columns(dp=pl.col("kwh").dpsql.range_sum(order_by="ts", partition_by="meter", **LAPLACE))
    grouped = out.sort("meter", "ts")
    offsets = np.concatenate([[0], np.cumsum(grouped.group_by("meter", maintain_order=True).len()["len"])])
    with dpsql.testing.seeded(5):
        oracle = publish("laplace", grouped["kwh"].to_numpy(), partition_offsets=offsets,
                         partition_keys=first_keys(grouped, ["meter"], offsets), epsilon=0.5, upper=10.0)
    np.testing.assert_array_equal(grouped["dp"].to_numpy(), oracle.values)


def test_rows_keep_their_own_values_when_noise_is_small():
    frame = shuffled_frame()
    with dpsql.testing.seeded(0):  # epsilon 100: Laplace scale 0.12, far below the values' spread
        out = frame.with_columns(dp=pl.col("kwh").dpsql.range_sum(order_by="ts", method="laplace", epsilon=100.0,
                                                                   upper=12.0))
    scale = LaplaceLattice(sensitivity=12.0, epsilon=100.0).scale
    assert np.max(np.abs(out["dp"] - out["kwh"]).to_numpy()) < 12 * scale  # misaligned rows would be off by ~4


def test_values_outside_bounds_are_clipped_not_refused():
    frame = pl.DataFrame({"ts": [1, 2, 3], "kwh": [-5.0, 50.0, 3.0]})
    with dpsql.testing.seeded(0):
        out = frame.select(pl.col("kwh").dpsql.range_sum(order_by="ts", method="laplace", epsilon=100.0, upper=10.0))
    with dpsql.testing.seeded(0):
        clipped = publish("laplace", np.array([0.0, 10.0, 3.0]), epsilon=100.0, upper=10.0)
    np.testing.assert_array_equal(out["kwh"].to_numpy(), clipped.values)
    np.testing.assert_allclose(out["kwh"].to_numpy(), [0.0, 10.0, 3.0], atol=1.0)


def test_module_function_equals_namespace_method():
    frame = shuffled_frame(n=50)
    with dpsql.testing.seeded(2):
        a = frame.select(pl.col("kwh").dpsql.range_sum(order_by="ts", **LAPLACE))
    with dpsql.testing.seeded(2):
        b = frame.select(dpsql.polars.range_sum(pl.col("kwh"), order_by="ts", **LAPLACE))
    assert a.equals(b)


# -- one logical release = one charge ----------------------------------------------------

@pytest.mark.parametrize("engine", ["eager", "in-memory", "streaming"])
def test_one_charge_per_evaluation_on_every_engine(engine):
    frame = shuffled_frame(n=300_000, partitions=3)  # several streaming morsels
    budget = dpsql.Budget.in_memory(epsilon=10.0)
    expr = pl.col("kwh").dpsql.range_sum(order_by="ts", partition_by="meter", budget=budget, **LAPLACE)
    with dpsql.testing.seeded(1):
        if engine == "eager":
            out = frame.with_columns(dp=expr)
        else:
            out = frame.lazy().with_columns(dp=expr).filter(pl.col("ts") > 0).collect(engine=engine)
        head = frame.lazy().with_columns(dp=expr).head(5).collect(engine="auto" if engine == "eager" else engine)
    assert out.height == 300_000 and out["dp"].null_count() == 0 and head.height == 5
    # the head() query released every row too (no slice reaches the release): the same release,
    # answered from the ledger
    history = budget.history(full=True)
    assert history["partitions"].to_list() == [3, 3] and history["rows"].to_list() == [300_000, 300_000]
    assert history["kind"].to_list() == ["release", "cache hit"] and budget.spent == (0.5, 0.0)
    with dpsql.testing.seeded(1):  # a seeded release answers only seeded repeats
        again = frame.lazy().with_columns(dp=expr).head(5).collect()
    np.testing.assert_array_equal(head["dp"].to_numpy(), again["dp"])


def test_collecting_a_lazy_query_twice_answers_from_the_ledger_unless_fresh():
    frame = shuffled_frame(n=200)
    budget = dpsql.Budget.in_memory(epsilon=10.0)
    query = frame.lazy().select(pl.col("kwh").dpsql.range_sum(order_by="ts", budget=budget, **LAPLACE))
    fresh = frame.lazy().select(pl.col("kwh").dpsql.range_sum(order_by="ts", budget=budget, fresh=True, **LAPLACE))
    with dpsql.testing.seeded(4):
        first, second = query.collect(), query.collect()
        third, fourth = fresh.collect(), fresh.collect()
    assert first.equals(second)
    for other in (third, fourth):
        assert not np.array_equal(first["kwh"].to_numpy(), other["kwh"].to_numpy())
    assert not np.array_equal(third["kwh"].to_numpy(), fourth["kwh"].to_numpy())
    assert kinds(budget) == ["release", "cache hit", "release", "release"] and budget.spent == (1.5, 0.0)


def test_partitioned_release_is_charged_once_at_the_max():
    frame = shuffled_frame(n=300, partitions=5)
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    frame.select(pl.col("kwh").dpsql.range_sum(order_by="ts", partition_by=["meter"], budget=budget, **LAPLACE))
    assert budget.spent == (0.5, 0.0) and charges(budget) == 1


@pytest.mark.parametrize("engine", ["in-memory", "streaming", "auto"])
@pytest.mark.parametrize("reuse", [False, True])
def test_cse_never_shares_a_draw_between_two_expressions(engine, reuse):
    """Polars never merges two dpsql expressions (common subexpression elimination): each is
    evaluated, so each fresh release draws its own noise and is charged."""
    frame = shuffled_frame(n=300)
    budget = dpsql.Budget.in_memory(epsilon=10.0)
    shared = pl.col("kwh").dpsql.range_sum(order_by="ts", budget=budget, fresh=True, **LAPLACE)

    def release():
        return shared if reuse else pl.col("kwh").dpsql.range_sum(order_by="ts", budget=budget, fresh=True,
                                                                   **LAPLACE)

    for query in (frame.lazy().select(a=release(), b=release(), c=release() * 2),
                  frame.lazy().with_columns(a=release(), b=release() + 0.0, c=release() * 2)):
        assert "__POLARS_CSER" not in query.explain(optimizations=pl.QueryOptFlags(comm_subexpr_elim=True))
        out = query.collect(engine=engine, optimizations=pl.QueryOptFlags(comm_subexpr_elim=True))
        assert not np.array_equal(out["a"].to_numpy(), out["b"].to_numpy())
        assert not np.array_equal(2 * out["a"].to_numpy(), out["c"].to_numpy())
    assert kinds(budget) == ["release"] * 6 and budget.spent == (3.0, 0.0)


# -- group-wise evaluation is refused before any charge ------------------------------------

@pytest.mark.parametrize("build", [
    lambda f, e: f.with_columns(dp=e.over("meter")),
    lambda f, e: f.with_columns(dp=e.cum_sum().over("meter")),
    lambda f, e: f.lazy().select(e.over("meter")).collect(),
    lambda f, e: f.group_by("meter").agg(e),
    lambda f, e: f.sort("ts").group_by_dynamic("ts", every="70i").agg(e),
])
def test_group_wise_evaluation_is_refused_pointing_to_partition_by(build):
    frame = shuffled_frame(n=200, partitions=2)
    budget = dpsql.Budget.in_memory(epsilon=10.0)
    expr = pl.col("kwh").dpsql.range_sum(order_by="ts", budget=budget, **LAPLACE)
    with pytest.raises(dpsql.InvalidParameter, match="partition_by"):
        build(frame, expr)
    assert charges(budget) == 0


# -- coexistence with OpenDP --------------------------------------------------------------

def test_coexists_with_opendp_dp_namespace():
    import opendp.prelude  # noqa: F401  (registers .dp)

    expr = pl.col("kwh")
    assert type(expr.dp).__module__.startswith("opendp")
    assert isinstance(expr.dpsql, dpsql.polars.DpsqlExpr)
    frame = shuffled_frame(n=100)
    with dpsql.testing.seeded(0):  # seeded: no budget needed
        out = frame.with_columns(dp=expr.dpsql.range_sum(order_by="ts", **LAPLACE), clipped=expr.clip(0, 10))
    assert out["dp"].dtype == pl.Float64 and out.height == 100


# -- refusals: typed, naming the column, nothing charged -----------------------------------

@pytest.mark.parametrize(("kwh", "ts", "error", "text"), [
    ([1.0, float("nan"), 2.0], [1, 2, 3], dpsql.InvalidData, "'kwh' contains NaN"),
    ([1.0, None, 2.0], [1, 2, 3], dpsql.InvalidData, "'kwh' contains 1 null"),
    ([1.0, float("inf"), 2.0], [1, 2, 3], dpsql.InvalidData, "'kwh' contains infinite"),
    ([], [], dpsql.InvalidData, "'kwh' is empty"),
    (["a", "b", "c"], [1, 2, 3], dpsql.InvalidData, "'kwh' must be numeric"),
    ([1.0, 2.0, 3.0], [1, None, 3], dpsql.InvalidTimeKey, "order column 'ts' contains 1 NULL value"),
    ([1.0, 2.0, 3.0], [1, 2, 1], dpsql.InvalidTimeKey,
     "order column 'ts' has duplicate value 1; time keys must be unique$"),
])
def test_bad_data_is_refused_with_typed_errors(kwh, ts, error, text):
    frame = pl.DataFrame({"kwh": kwh, "ts": ts}, schema_overrides={"ts": pl.Int64})
    if not kwh:
        frame = frame.cast({"kwh": pl.Float64})
    budget = dpsql.Budget.in_memory(epsilon=10.0)
    with pytest.raises(error, match=text):
        frame.select(pl.col("kwh").dpsql.range_sum(order_by="ts", budget=budget, **LAPLACE))
    assert charges(budget) == 0


def test_duplicate_times_are_allowed_across_partitions_but_not_within_one():
    frame = pl.DataFrame({"meter": ["a", "b", "a", "b"], "ts": [1, 1, 2, 2], "kwh": [1.0, 2.0, 3.0, 4.0]})
    with dpsql.testing.seeded(0):
        out = frame.select(pl.col("kwh").dpsql.range_sum(order_by="ts", partition_by="meter", **LAPLACE))
    assert out.height == 4
    with pytest.raises(dpsql.InvalidTimeKey, match="'ts' has duplicate value 1 within a partition of 'meter'; "):
        frame.with_columns(meter=pl.lit("a")).select(
            pl.col("kwh").dpsql.range_sum(order_by="ts", partition_by="meter", **LAPLACE))


@pytest.mark.parametrize(("params", "text"), [
    (dict(epsilon=0.0), "epsilon must be > 0"),
    (dict(epsilon=float("nan")), "epsilon must be finite"),
    (dict(epsilon=1.0, upper=-1.0), "upper must be > lower"),
])
def test_bad_parameters_are_refused_at_evaluation_and_nothing_is_charged(params, text):
    budget = dpsql.Budget.in_memory(epsilon=10.0)
    frame = shuffled_frame(n=20)
    with pytest.raises(dpsql.InvalidParameter, match=text):
        frame.select(pl.col("kwh").dpsql.range_sum(order_by="ts", method="laplace", budget=budget,
                                                   **{"upper": 10.0, **params}))
    assert charges(budget) == 0


def test_unknown_method_parameters_are_refused_before_any_charge():
    budget = dpsql.Budget.in_memory(epsilon=10.0)
    with pytest.raises(dpsql.InvalidParameter, match=r"has no parameter 'epsilonn' \(did you mean 'epsilon'\?\)"):
        shuffled_frame(n=20).select(pl.col("kwh").dpsql.range_sum(order_by="ts", budget=budget, epsilonn=1.0,
                                                                  **LAPLACE))
    assert charges(budget) == 0


def test_bad_options_are_refused_when_the_expression_is_built():
    with pytest.raises(dpsql.InvalidParameter, match="unknown method 'nope'"):
        pl.col("kwh").dpsql.range_sum(method="nope", order_by="ts", epsilon=1.0, upper=1.0)
    with pytest.raises(dpsql.InvalidParameter, match=r"budget must be a dpsql\.Budget"):
        pl.col("kwh").dpsql.range_sum(budget=1.0, order_by="ts", **LAPLACE)
    with pytest.raises(dpsql.InvalidParameter, match="needs order_by"):
        pl.col("kwh").dpsql.range_sum(order_by=None, **LAPLACE)


def test_budget_exhaustion_refuses_the_whole_query():
    budget = dpsql.Budget.in_memory(epsilon=0.7)
    frame = shuffled_frame(n=50)
    frame.select(pl.col("kwh").dpsql.range_sum(order_by="ts", budget=budget, **LAPLACE))
    frame.select(pl.col("kwh").dpsql.range_sum(order_by="ts", budget=budget, **LAPLACE))  # the same: free
    with pytest.raises(dpsql.BudgetExhausted):
        frame.select(pl.col("kwh").dpsql.range_sum(order_by="ts", budget=budget, fresh=True, **LAPLACE))
    with pytest.raises(dpsql.BudgetExhausted):
        frame.head(49).select(pl.col("kwh").dpsql.range_sum(order_by="ts", budget=budget, **LAPLACE))
    assert budget.spent == (0.5, 0.0) and kinds(budget) == ["release", "cache hit"]


# -- error bars -------------------------------------------------------------------------------

class TelescopingNoise(ErrorModel):
    """Row ``i`` carries ``Z_i - Z_{i-1}``: a range sum's noise is ``Z_{j-1} - Z_{i-1}``."""

    def __init__(self, variance):
        self.variance = variance

    def range_variance(self, starts, stops):
        return np.where(stops > starts, np.where(starts == 0, 1.0, 2.0) * self.variance, 0.0)


class TelescopingStream(StreamMachine):
    """Test-only machine with strongly correlated noise (per-row variances do not add); row
    ``i``'s draw is index ``i`` of the ROWS lane."""

    def __init__(self, n=None, *, noise, epsilon=1.0, upper=1.0):
        self.cost = (epsilon, 0.0)
        self._lap = LaplaceLattice(sensitivity=upper, epsilon=epsilon)
        self._lane, self._rows, self._previous = noise.lane(Lane.ROWS), 0, 0

    def feed(self, chunk):
        z = self._lap.noise_units(self._lane, self._rows, len(chunk))
        self._rows += len(chunk)
        steps = np.diff(z, prepend=self._previous)
        self._previous = z[-1] if len(z) else self._previous
        return self._lap.from_units(self._lap.to_units(chunk) + steps)

    def close(self):
        return np.empty(0)

    def describe(self):
        return dict(method="telescoping", params={}, error=TelescopingNoise(self._lap.variance))


@pytest.fixture
def telescoping():
    METHODS["telescoping"] = TelescopingStream  # the registry is a dict of machine factories
    yield "telescoping"
    del METHODS["telescoping"]


def test_window_intervals_use_range_variances_not_summed_row_variances(telescoping):
    frame = shuffled_frame(n=400, partitions=2)
    budget = dpsql.Budget.in_memory(epsilon=10.0)
    with dpsql.testing.seeded(8):
        out = frame.with_columns(dp=pl.col("kwh").dpsql.range_sum(method=telescoping, order_by="ts",
                                                                  partition_by="meter", errors=True, budget=budget))
        bands = dpsql.polars.window_ci(out, "dp", order_by="ts", period=70, partition_by="meter")
    variance = LaplaceLattice(sensitivity=1.0, epsilon=1.0).variance
    rel = release_of(out, "dp", budget, ["meter", "ts"])
    ordered = bands.sort("meter", "ts")
    k = (ordered["dp_high"] - ordered["dp_sum"]).to_numpy() / np.sqrt(2 * variance)
    first_of_partition = ordered["ts"].to_numpy() < 1070  # these windows start at the partition's first row
    np.testing.assert_allclose(k[~first_of_partition], k[~first_of_partition][0])
    np.testing.assert_allclose(k[first_of_partition], k[~first_of_partition][0] / np.sqrt(2))
    assert 1.9 < k[~first_of_partition][0] < 2.3
    rolling = ordered.select(pl.col("dp").struct.field("value").rolling_sum_by("ts", window_size="70i")
                             .over("meter"))
    np.testing.assert_allclose(ordered["dp_sum"].to_numpy(), rolling.to_series().to_numpy(), atol=1e-9)
    assert isinstance(rel, dpsql.PartitionedRelease) and rel.method == "telescoping"
    assert rel.part(1).range_variance(5, 15) == pytest.approx(2 * variance)  # the error model, from the ledger
    np.testing.assert_allclose(ordered["dp"].struct.field("sd").to_numpy()[~first_of_partition],
                               np.sqrt(2 * variance))


def test_window_intervals_cover_the_true_window_sums(telescoping):
    frame = shuffled_frame(n=300, seed=9)
    truth = frame.sort("ts").with_columns(true=pl.col("kwh").clip(0, 12).rolling_sum_by("ts", window_size="35i"))
    budget = dpsql.Budget.in_memory(epsilon=100.0)
    hits = []
    for seed in range(40):
        with dpsql.testing.seeded(seed):  # fresh: each seed's own draws, not the first release's answer
            out = frame.with_columns(dp=pl.col("kwh").dpsql.range_sum(method=telescoping, order_by="ts",
                                                                      epsilon=1.0, upper=12.0, errors=True,
                                                                      budget=budget, fresh=True))
        bands = dpsql.polars.window_ci(out, "dp", order_by="ts", period=35).sort("ts")
        hits.append(((bands["dp_low"] <= truth["true"]) & (truth["true"] <= bands["dp_high"])).to_numpy())
    coverage = np.mean(hits)
    assert 0.93 < coverage < 0.995


def test_window_interval_variance_matches_empirical_variance_of_window_sums():
    frame = shuffled_frame(n=100, seed=2)
    budget = dpsql.Budget.in_memory(epsilon=1000.0)
    sums, sd = [], None
    for seed in range(300):
        with dpsql.testing.seeded(seed):
            out = frame.with_columns(dp=pl.col("kwh").dpsql.range_sum(order_by="ts", errors=True, budget=budget,
                                                                      fresh=True, **LAPLACE))
        bands = dpsql.polars.window_ci(out, "dp", order_by="ts", period=70).sort("ts")
        sums.append(bands["dp_sum"][-1])
        sd = (bands["dp_high"][-1] - bands["dp_low"][-1]) / 2
    truth = frame.sort("ts")["kwh"].clip(0, 10).tail(10).sum()
    assert abs(np.mean(sums) - truth) < 4 * np.std(sums) / np.sqrt(300)
    expected = np.sqrt(10 * LaplaceLattice(sensitivity=10.0, epsilon=0.5).variance)
    assert abs(np.std(sums) / expected - 1) < 0.15
    assert 1.9 < sd / expected < 2.3


def test_bucket_intervals_match_release_range_ci():
    frame = shuffled_frame(n=240, partitions=2, seed=4)
    budget = dpsql.Budget.in_memory(epsilon=10.0)
    with dpsql.testing.seeded(6):
        out = frame.with_columns(dp=pl.col("kwh").dpsql.range_sum(order_by="ts", partition_by="meter", errors=True,
                                                                  budget=budget, **LAPLACE))
    daily = dpsql.polars.bucket_ci(out, "dp", order_by="ts", every="168i", partition_by="meter", level=0.9)
    rel = release_of(out, "dp", budget, ["meter", "ts"])
    part0 = daily.filter(pl.col("meter") == 0)
    sizes = out.filter(pl.col("meter") == 0).group_by_dynamic(pl.col("ts").sort(), every="168i").agg(pl.len())
    stops = np.cumsum(sizes["len"].to_numpy())
    low, high = rel.part(0).range_ci(stops - sizes["len"].to_numpy(), stops, level=0.9)
    np.testing.assert_allclose(part0["dp_low"].to_numpy(), low)
    np.testing.assert_allclose(part0["dp_high"].to_numpy(), high)
    assert daily.columns == ["meter", "ts", "dp_sum", "dp_low", "dp_high"]


def test_interval_functions_work_on_lazy_frames_with_one_release():
    frame = shuffled_frame(n=120)
    budget = dpsql.Budget.in_memory(epsilon=10.0)
    lazy = frame.lazy().with_columns(dp=pl.col("kwh").dpsql.range_sum(order_by="ts", errors=True, budget=budget,
                                                                      **LAPLACE))
    with dpsql.testing.seeded(1):
        windows = dpsql.polars.window_ci(lazy, "dp", order_by="ts", period=70).collect()
    with dpsql.testing.seeded(1):
        eager = dpsql.polars.window_ci(lazy.collect(), "dp", order_by="ts", period=70)
    assert windows.drop("dp").equals(eager.drop("dp"))
    assert kinds(budget) == ["release", "cache hit"]  # two evaluations of one release


def test_interval_functions_refuse_bad_levels_and_forgotten_releases():
    frame = shuffled_frame(n=30)
    budget = dpsql.Budget.in_memory(epsilon=10.0)
    out = frame.with_columns(dp=pl.col("kwh").dpsql.range_sum(order_by="ts", errors=True, budget=budget, **LAPLACE))
    with pytest.raises(dpsql.InvalidParameter, match="level"):
        dpsql.polars.window_ci(out, "dp", order_by="ts", period=14, level=1.5)
    forged = out.with_columns(pl.col("dp").struct.with_fields(pl.lit(-1, dtype=pl.Int64).alias("dp_row")))
    with pytest.raises(dpsql.InvalidParameter, match="pass budget="):  # no release of this process has it
        dpsql.polars.window_ci(forged, "dp", order_by="ts", period=14)
    with pytest.raises(dpsql.UnknownRelease, match="not a row handle"):
        dpsql.polars.window_ci(forged, "dp", order_by="ts", period=14, budget=budget)
    with pytest.raises(dpsql.UnknownRelease, match="not a row handle"):  # another ledger does not know them
        dpsql.polars.window_ci(out, "dp", order_by="ts", period=14, budget=dpsql.Budget.in_memory(epsilon=1.0))
    with dpsql.testing.seeded(0), pytest.raises(dpsql.InvalidParameter, match="errors=True needs a release recorded"):
        frame.with_columns(dp=pl.col("kwh").dpsql.range_sum(order_by="ts", errors=True, **LAPLACE))


# -- time keys of every kind sort the same way --------------------------------------------

@pytest.mark.parametrize(("meter", "ts"), [
    (pl.col("meter").cast(pl.String), pl.col("ts")),                       # string keys: dense ranks
    (pl.col("meter") * 1_000_003, pl.col("ts")),                           # sparse integer keys
    (pl.col("meter"), pl.col("ts").cast(pl.Float64) / 3),                  # float time: multi-column sort
    (pl.col("meter"), pl.from_epoch("ts", time_unit="s")),                 # datetime time key
    (pl.col("meter"), pl.when(pl.col("ts") > 1200).then(2**62).otherwise(-(2**62)) + pl.col("ts")),  # huge span
    ([pl.col("meter") % 2, pl.col("meter") // 2], pl.col("ts").cast(pl.Int32)),  # two partition columns
])
def test_every_key_kind_releases_partitions_in_key_order_and_time_order(meter, ts):
    frame = shuffled_frame(n=240, partitions=4, seed=7)
    keys = [meter] if isinstance(meter, pl.Expr) else meter
    with dpsql.testing.seeded(3):
        out = frame.with_columns(dp=pl.col("kwh").dpsql.range_sum(order_by=ts, partition_by=meter, **LAPLACE))
    ordered = out.with_columns(*(k.alias(f"key{i}") for i, k in enumerate(keys)), ts.alias("time")).sort(
        [f"key{i}" for i in range(len(keys))] + ["time"])
    sizes = ordered.group_by([f"key{i}" for i in range(len(keys))], maintain_order=True).len()["len"]
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    with dpsql.testing.seeded(3):
        oracle = publish("laplace", ordered["kwh"].to_numpy(), epsilon=0.5, upper=10.0, partition_offsets=offsets,
                         partition_keys=first_keys(ordered, [f"key{i}" for i in range(len(keys))], offsets))
    np.testing.assert_array_equal(ordered["dp"].to_numpy(), oracle.values)


def test_partition_order_does_not_change_values_in_time_order():
    frame = shuffled_frame(n=240, partitions=4, seed=7)
    budget = dpsql.Budget.in_memory(epsilon=10.0)
    with dpsql.testing.seeded(3):
        ints = frame.select(pl.col("kwh").dpsql.range_sum(order_by="ts", partition_by="meter", errors=True,
                                                          budget=budget, **LAPLACE), "meter", "ts")
    with dpsql.testing.seeded(3):
        floats = frame.select(pl.col("kwh").dpsql.range_sum(order_by=pl.col("ts") / 3, partition_by="meter",
                                                            errors=True, budget=budget, **LAPLACE), "meter", "ts")
    for out in (ints, floats):  # row handles are numbered in release order: partition, then time
        by_handle = out.sort(pl.col("kwh").struct.field("dp_row"))
        assert by_handle.select(["meter", "ts"]).equals(out.sort("meter", "ts").select(["meter", "ts"]))
    assert ints["kwh"].struct.field("value").equals(floats["kwh"].struct.field("value"))
    assert kinds(budget) == ["release", "release"]  # other order keys: another release (of the same draws)


@pytest.mark.parametrize(("meters", "message"), [
    (["a", None, "a", None], "partition column 'meter' contains 2 NULL value"),
    ([1.0, float("nan"), 1.0, 2.0], "partition column 'meter' contains NaN"),
])
def test_null_or_nan_partition_keys_are_refused_as_in_every_front_end(meters, message):
    """A row without a partition key belongs to no stream: DuckDB, Spark and continual streams
    refuse it, and so does Polars (it would otherwise group the NULLs into a partition)."""
    frame = pl.DataFrame({"meter": meters, "ts": [1, 1, 2, 2], "kwh": [1.0, 2.0, 3.0, 4.0]})
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    with pytest.raises(dpsql.InvalidTimeKey, match=message):
        frame.select(pl.col("kwh").dpsql.range_sum(order_by="ts", partition_by="meter", budget=budget, **LAPLACE))
    assert budget.spent == (0.0, 0.0)


def test_partition_by_without_order_by_is_refused():
    with pytest.raises(dpsql.InvalidParameter, match="partition_by needs order_by"):
        dpsql.polars._machinery.private_expression(pl.col("kwh"), None, order_by=None, partition_by="meter",
                                                   output=None, return_dtype=pl.Float64)


# -- the paper methods and the threshold through the front end ----------------------------

@pytest.mark.parametrize(("method", "params"), [
    ("tops", dict(epsilon=1.0, upper=30.0, m=200)),
    ("pak", dict(epsilon=1.0, upper=30.0, delta=1e-6, m=200)),
    ("binary_tree", dict(epsilon=1.0, upper=30.0)),
])
def test_paper_methods_pass_parameters_through_and_match_publish(method, params):
    frame = shuffled_frame(n=1200, partitions=2, seed=12)
    budget = dpsql.Budget.in_memory(epsilon=5.0, delta=1e-3)
    with dpsql.testing.seeded(21):
        out = frame.with_columns(dp=pl.col("kwh").dpsql.range_sum(method=method, order_by="ts", partition_by="meter",
                                                                  budget=budget, **params))
    ordered = out.sort("meter", "ts")
    with dpsql.testing.seeded(21):
        oracle = publish(method, ordered["kwh"].to_numpy(), partition_offsets=[0, 600, 1200], partition_keys=[0, 1],
                         **params)
    np.testing.assert_array_equal(ordered["dp"].to_numpy(), oracle.values)
    assert budget.spent == (oracle.epsilon, oracle.delta) and charges(budget) == 1


def test_tree_method_window_variance_matches_empirical_variance():
    frame = shuffled_frame(n=256, seed=13)
    budget = dpsql.Budget.in_memory(epsilon=1000.0)
    sums, variances = [], None
    for seed in range(300):
        with dpsql.testing.seeded(seed):
            out = frame.with_columns(dp=pl.col("kwh").dpsql.range_sum(method="binary_tree", epsilon=1.0, upper=12.0,
                                                                      order_by="ts", errors=True, budget=budget,
                                                                      fresh=True))
        rel = release_of(out, "dp", budget, ["ts"])
        windows = np.array([[0, 256], [3, 200], [100, 101], [17, 90]])
        sums.append(rel.range_sum(windows[:, 0], windows[:, 1]))
        variances = dpsql.polars.range_variance(rel, windows[:, 0], windows[:, 1])
    empirical = np.var(np.array(sums), axis=0)
    np.testing.assert_allclose(empirical / variances, 1.0, atol=0.25)
    assert variances[1] < 153 * variances[2]  # correlated: far below the sum of per-row variances


def test_threshold_is_one_scalar_charged_once():
    frame = pl.DataFrame({"kwh": np.linspace(0.0, 9.0, 3000)})
    budget = dpsql.Budget.in_memory(epsilon=2.0)
    with dpsql.testing.seeded(2):
        out = frame.lazy().select(pl.col("kwh").dpsql.threshold(epsilon=1.0, upper=10.0, method="nm",
                                                                budget=budget)).collect()
    with dpsql.testing.seeded(2):
        oracle = publish("threshold", frame["kwh"].to_numpy(), epsilon=1.0, upper=10.0, estimator="nm")
    assert out.shape == (1, 1) and out.item() == oracle.values[0]
    assert budget.spent == (1.0, 0.0)
    with pytest.raises(dpsql.InvalidParameter, match="'nope'"):
        frame.select(pl.col("kwh").dpsql.threshold(epsilon=1.0, upper=10.0, method="nope", budget=budget))
    assert charges(budget) == 1


@pytest.mark.parametrize("layout", ["dense grid", "sparse", "too sparse to pack", "already sorted"])
def test_each_ordering_path_matches_publish_and_refuses_duplicates(layout):
    rng = np.random.default_rng(17)
    n = 400
    ts = {"dense grid": np.arange(n) * 3600 + 50,
          "sparse": np.sort(rng.choice(10**12, size=n, replace=False)),
          "too sparse to pack": np.unique(rng.integers(0, 2**60, n + 10))[:n],
          "already sorted": np.arange(n) * 5}[layout]
    frame = pl.DataFrame({"meter": np.arange(n) % 2, "ts": ts, "kwh": rng.uniform(0, 12, n)})
    if layout != "already sorted":
        frame = frame.sample(fraction=1.0, shuffle=True, seed=1)
    with dpsql.testing.seeded(9):
        out = frame.with_columns(dp=pl.col("kwh").dpsql.range_sum(order_by="ts", partition_by="meter", **LAPLACE))
    ordered = out.sort("meter", "ts")
    with dpsql.testing.seeded(9):
        oracle = publish("laplace", ordered["kwh"].to_numpy(), partition_offsets=[0, n // 2, n], epsilon=0.5,
                         upper=10.0)
    np.testing.assert_array_equal(ordered["dp"].to_numpy(), oracle.values)
    repeated = frame.with_columns(pl.when(pl.col("ts") == ts[3]).then(ts[1]).otherwise(pl.col("ts")).alias("ts"))
    with pytest.raises(dpsql.InvalidTimeKey, match=f"has duplicate value {ts[1]} within a partition of 'meter'; "):
        repeated.select(pl.col("kwh").dpsql.range_sum(order_by="ts", partition_by="meter", **LAPLACE))


def test_128_bit_integer_keys_are_ordered_by_polars():
    frame = pl.DataFrame({"ts": [3, 1, 2, 1], "meter": [0, 0, 0, 1], "kwh": [1.0, 2.0, 3.0, 4.0]})
    for cast in ({"ts": pl.Int128}, {"meter": pl.Int128}, {"ts": pl.UInt128, "meter": pl.UInt128}):
        with dpsql.testing.seeded(3):
            out = frame.cast(cast).with_columns(dp=pl.col("kwh").dpsql.range_sum(order_by="ts", partition_by="meter",
                                                                                  **LAPLACE))
        with dpsql.testing.seeded(3):
            oracle = publish("laplace", np.array([2.0, 3.0, 1.0, 4.0]), partition_offsets=[0, 3, 4], epsilon=0.5,
                             upper=10.0)
        np.testing.assert_array_equal(out.sort("meter", "ts")["dp"].to_numpy(), oracle.values)
    repeated = frame.cast({"ts": pl.Int128}).with_columns(meter=pl.lit(0))
    with pytest.raises(dpsql.InvalidTimeKey, match="has duplicate value 1 within a partition of 'meter'"):
        repeated.select(pl.col("kwh").dpsql.range_sum(order_by="ts", partition_by="meter", **LAPLACE))


def test_a_method_releasing_one_value_per_stream_is_refused_when_the_expression_is_built():
    with pytest.raises(dpsql.InvalidParameter, match="method 'threshold' releases 1 value"):
        pl.col("kwh").dpsql.range_sum(method="threshold", epsilon=1.0, upper=10.0, order_by="ts")
