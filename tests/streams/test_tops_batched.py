"""Equal-length partitions released in one batched run (``tops``, ``hierarchy``).

The batched run is the single-stream code with a leading partition axis, so every partition's
release must be exactly what its own single stream gives; only the order of the draws in the
noise stream differs. Two kinds of checks:

* with :class:`ScaleKeyedNoise`, whose draws depend only on each draw's scale (not on the
  order or grouping of the calls), the batched and per-partition releases must be identical
  bit for bit: values, thresholds, parameters, components, costs and error models;
* with real (seeded) noise, thresholds and range sums must agree in distribution.
"""

import itertools

import numpy as np
import pytest

import dpsql
from dpsql import api, noise, streams
from dpsql.mechanisms.hierarchy import Forest
from dpsql.mechanisms.laplace import LaplaceLattice, LatticeBatch
from dpsql.mechanisms.noisy_max import nm_threshold, nm_thresholds, report_noisy_max, report_noisy_max_rows
from dpsql.mechanisms.smoothers import SMOOTHERS
from dpsql.noise import NoiseSource, SeededNoise
from dpsql.release import Descriptions, Parts, release_batched
from dpsql.streams.tops import HierarchyStream


class ScaleKeyedNoise(NoiseSource):
    """Non-random test noise: draw ``i`` is ``round(0.37 * scale_i)``, so any grouping of the
    draws into calls gives every draw the same value (and a wrong scale shows)."""

    def discrete_laplace(self, scale, size):
        return np.broadcast_to(np.rint(0.37 * np.asarray(scale, dtype=np.float64)), (size,)).astype(np.int64)


def _rows(k, n, seed=0):
    rng = np.random.default_rng(seed)
    # partitions with different spreads, so that their thresholds (and lattices) differ
    return rng.gamma(2.0, 1.0, (k, n)) * rng.uniform(50.0, 1500.0, (k, 1))


def _batched(template, rows, out):
    """The releases of ``rows`` (``(k, n)``) as one batched run of ``template``."""
    batch = release_batched(template, rows, out)
    return Parts(Descriptions([(batch, j) for j in range(len(rows))]), list(out), private=False)


def _single(method, values, source, **params):
    return streams.run(method, values, noise=source, **params)


def _assert_same_release(got, want, n):
    np.testing.assert_array_equal(got.values, want.values)
    assert got.threshold == want.threshold
    assert dict(got.params) == dict(want.params)
    assert dict(got.components) == dict(want.components)
    assert (got.epsilon, got.delta, got.method) == (want.epsilon, want.delta, want.method)
    rng = np.random.default_rng(1)
    starts = rng.integers(0, n, 300)
    stops = np.minimum(n, starts + rng.integers(1, n, 300))
    np.testing.assert_array_equal(got.range_variance(starts, stops), want.range_variance(starts, stops))


@pytest.mark.parametrize("smoother", SMOOTHERS)
@pytest.mark.parametrize("method", ["tops", "hierarchy"])
def test_batched_partitions_equal_their_single_streams(method, smoother):
    k, n = 6, 3000
    rows = _rows(k, n)
    params = dict(epsilon=0.8, upper=6000.0, lower=-5.0, r=700, smoother=smoother)
    source = ScaleKeyedNoise()
    template = api.machine_for(method, n, source, params)
    out = np.empty((k, n))
    parts = _batched(template, rows, out)
    for j in range(k):
        _assert_same_release(parts[j], _single(method, rows[j], source, **params), n)
    if method == "tops":
        assert len({p.threshold for p in parts}) > 1  # partitions really have their own lattices


def test_publish_groups_partitions_by_length():
    """Several lengths: an adjacent group (views), an interleaved one (gathered), a group of one."""
    lengths = [2000, 3500, 3500, 3500, 5000, 2000, 2000, 3000, 2000]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    values = np.concatenate([row[:length] for row, length in zip(_rows(len(lengths), max(lengths), 3), lengths)])
    params = dict(epsilon=1.0, upper=5000.0, smoother="mean")
    source = ScaleKeyedNoise()
    with noise._installed(source):  # publish draws from the source in force
        release = api.publish("tops", values, partition_offsets=offsets, **params)
    for j, (a, b) in enumerate(itertools.pairwise(offsets)):
        _assert_same_release(release.part(j), _single("tops", values[a:b], source, **params), int(b - a))
    np.testing.assert_array_equal(release.values, np.concatenate([p.values for p in release.parts]))


def test_one_partition_is_the_single_stream_with_the_same_draws():
    values = _rows(1, 20_000, 5)[0]
    params = dict(epsilon=0.5, upper=4000.0, r=3000, smoother="exponential")
    single = _single("tops", values, SeededNoise(9), **params)
    batched = _batched(api.machine_for("tops", len(values), SeededNoise(9), params), values[None],
                       np.empty((1, len(values))))[0]
    _assert_same_release(batched, single, len(values))


def test_single_stream_draws_are_those_of_the_per_partition_code():
    """Pinned from the release of the code before batching (same seed, same draw order)."""
    values = np.random.default_rng(0).gamma(2.0, 300.0, 60_000)
    with dpsql.testing.seeded(7):
        release = api.publish("tops", values, epsilon=0.7, upper=3000.0, r=5000)
    assert release.threshold == 1008.0
    assert (release.values.sum(), release.values[123], release.values[-1]) == (32733833.75, 548.974725, -6670.8125)
    assert release.range_variance(100, 40000) == pytest.approx(1565960655.3178272, rel=1e-12)


@pytest.mark.parametrize("method", ["tops", "hierarchy"])
def test_batched_and_per_partition_releases_agree_in_distribution(method):
    """Identical partitions: thresholds and a range sum have the same means and spreads
    whether the partitions are released together or one by one."""
    k, n, seeds = 40, 4000, 10
    row = _rows(1, n, 11)[0]
    params = dict(epsilon=0.3, upper=8000.0, r=1000)
    batched, single = [], []
    for seed in range(seeds):
        parts = _batched(api.machine_for(method, n, SeededNoise(seed), params), np.tile(row, (k, 1)),
                         np.empty((k, n)))
        batched += [(p.threshold or 0.0, p.range_sum(1200, 3900)) for p in parts]
        source = SeededNoise(1000 + seed)
        single += [(p.threshold or 0.0, p.range_sum(1200, 3900))
                   for p in (_single(method, row, source, **params) for _ in range(k))]
    batched, single = np.array(batched), np.array(single)
    spread = single.std(axis=0)
    # means within 4 standard errors, spreads within 20 %
    assert np.all(np.abs(batched.mean(axis=0) - single.mean(axis=0)) <= 4 * spread * np.sqrt(2 / len(single)) + 1e-9)
    np.testing.assert_allclose(batched.std(axis=0), spread, rtol=0.2, atol=1e-9)
    expected_sd = np.sqrt(parts[0].range_variance(1200, 3900)) if method == "hierarchy" else None
    if expected_sd is not None:
        assert batched[:, 1].std() == pytest.approx(expected_sd, rel=0.2)


def test_noisy_max_rows_are_independent_report_noisy_max():
    rng = np.random.default_rng(2)
    scores = rng.normal(0.0, 3.0, (50, 200))
    source = ScaleKeyedNoise()
    np.testing.assert_array_equal(report_noisy_max_rows(scores, epsilon=0.5, noise=source),
                                  [report_noisy_max(row, epsilon=0.5, noise=source) for row in scores])
    # with real noise: the winning index's distribution, row by row and alone
    two = np.array([[0.0, 1.0, 0.5]] * 4000)
    together = report_noisy_max_rows(two, epsilon=2.0, noise=SeededNoise(3))
    alone = [report_noisy_max(two[0], epsilon=2.0, noise=SeededNoise(10_000 + s)) for s in range(4000)]
    np.testing.assert_allclose(np.bincount(together, minlength=3) / 4000, np.bincount(alone, minlength=3) / 4000,
                               atol=0.035)


def test_nm_thresholds_unsorted_rows_equal_nm_threshold_on_sorted():
    holdouts = _rows(30, 700, 4)
    source = ScaleKeyedNoise()
    for upper in (6000.0, 100.5):  # the grid placement (m < candidates) and the search (m >= candidates)
        clipped = np.clip(holdouts, 0.0, upper)
        got = nm_thresholds(clipped, epsilon=0.5, upper=upper, epsilon_perturber=1.0, r=2000, is_sorted=False,
                            noise=source)
        want = [nm_threshold(np.sort(row), epsilon=0.5, upper=upper, epsilon_perturber=1.0, r=2000, noise=source)
                for row in clipped]
        np.testing.assert_array_equal(got, want)


def test_lattice_batch_is_each_partitions_lattice():
    sensitivities = np.array([3.0, 1000.0, 3.0, 0.01])
    batch = LatticeBatch(sensitivities, epsilon=0.4)
    values = np.random.default_rng(6).normal(0.0, 100.0, (4, 5))
    got = batch.release(values, ScaleKeyedNoise())
    for j, s in enumerate(sensitivities):
        lap = LaplaceLattice(s, 0.4)
        assert (batch.granularity[j], batch.scale_units[j], batch.variance[j]) == (
            lap.granularity, lap.scale_units, lap.variance)
        np.testing.assert_array_equal(got[j], lap.release(values[j], ScaleKeyedNoise()))


def test_forests_of_a_batch_are_each_partitions_forest():
    forest = Forest(fanout=4, levels=3, roots=2)
    batch = LatticeBatch(np.array([10.0, 300.0]), epsilon=1.0)
    got = forest.consistent_leaf_noise(batch, SeededNoise(8), 29)
    draws = batch.noise_units(SeededNoise(8), sum(forest.level_sizes()))
    for j in range(2):
        levels = np.split(draws[j].astype(np.float64), np.cumsum(forest.level_sizes()[:-1]))
        np.testing.assert_array_equal(got[j], np.rint(forest.consistent(levels)[0][:29]))


def test_array_scales_are_elementwise_scalar_scales():
    scalar = SeededNoise(4).discrete_laplace(7.5, 300_000)  # threaded sizes in private mode
    np.testing.assert_array_equal(SeededNoise(4).discrete_laplace(np.full(300_000, 7.5), 300_000), scalar)
    scales = np.repeat([0.5, 0.0, 40.0], 200_000)
    draws = SeededNoise(5).discrete_laplace(scales, len(scales))
    assert not draws[200_000:400_000].any()
    for piece, scale in ((draws[:200_000], 0.5), (draws[400_000:], 40.0)):
        a = np.exp(-1.0 / scale)
        assert piece.var() == pytest.approx(2 * a / (1 - a) ** 2, rel=0.03)
        assert abs(piece.mean()) < 4 * np.sqrt(2 * a / (1 - a) ** 2 / len(piece))
    with pytest.raises(ValueError):
        SeededNoise(0).discrete_laplace(np.array([1.0, -1.0]), 2)
    with pytest.raises(ValueError):
        SeededNoise(0).discrete_laplace(np.array([1.0, 2.0]), 3)


def test_median_smoother_keeps_one_history_per_partition():
    k, n = 3, 2000
    rows = _rows(k, n, 8)
    params = dict(epsilon=1.0, upper=3000.0, smoother="median", r=500)
    source = ScaleKeyedNoise()
    parts = _batched(api.machine_for("hierarchy", n, source, params), rows, np.empty((k, n)))
    for j in range(k):
        _assert_same_release(parts[j], _single("hierarchy", rows[j], source, **params), n)


@pytest.mark.parametrize("consistency", [True, False])
def test_draws_ahead_are_the_draws_the_next_chunk_makes(consistency):
    class Counting(ScaleKeyedNoise):
        drawn = 0

        def discrete_laplace(self, scale, size):
            self.drawn += size
            return super().discrete_laplace(scale, size)

    source = Counting()
    machine = HierarchyStream(5000, epsilon=1.0, upper=10.0, r=1500, fanout=4, consistency=consistency,
                              noise=source)
    while machine._rows < machine.n:  # whole chunks, the last one short
        ahead, before = machine.draws_ahead(), source.drawn
        machine.feed(np.ones(min(machine.chunk_rows, machine.n - machine._rows)))
        assert source.drawn - before == ahead > 0


@pytest.mark.parametrize("smoother", ["recent", "mean", "moving", "exponential", "median", "none"])
def test_every_smoother_accepts_pieces_that_complete_no_block(smoother):
    """The online contract: feeding row by row (most pieces complete no block) gives the
    release fed whole; and a batched chunk shorter than a block works (review finding)."""
    values = np.linspace(0.0, 10.0, 700)
    with dpsql.testing.seeded(8) as source:
        machine = HierarchyStream(700, epsilon=0.5, upper=10.0, r=512, fanout=4, depth=2, smoother=smoother,
                                  noise=source)
        whole = np.concatenate([machine.feed(values), machine.close()])
    with dpsql.testing.seeded(8) as source:
        machine = HierarchyStream(700, epsilon=0.5, upper=10.0, r=512, fanout=4, depth=2, smoother=smoother,
                                  noise=source)
        pieces = np.concatenate([*(machine.feed(values[i:i + 1]) for i in range(700)), machine.close()])
    np.testing.assert_allclose(pieces, whole, rtol=1e-9, atol=1e-9)
    offsets = np.arange(0, 5 * 20_000 + 1, 20_000)
    rng = np.random.default_rng(0)
    with dpsql.testing.seeded(9):
        release = dpsql.api.publish("tops", rng.uniform(0, 1000, offsets[-1]), partition_offsets=offsets,
                                    epsilon=0.01, upper=1000.0, smoother=smoother, r=5000)
    assert len(release.values) == offsets[-1]


@pytest.mark.parametrize("method, smoother", [("tops", "recent"), ("tops", "none"), ("hierarchy", "median"),
                                              ("pak", None)])
def test_machines_writing_into_the_callers_buffer_release_the_same_values(method, smoother):
    """``feed(chunk, out=...)`` (``writes_out``) writes the outputs in place where it can and
    gives the same values as feeding without a buffer, chunk by chunk, for one stream and
    for a batch of partitions."""
    from dpsql.release import run_machine, written_in_place

    params = dict(epsilon=0.8, upper=6000.0, lower=-5.0)
    if method != "pak":
        params.update(r=700, smoother=smoother)
    rows = _rows(3, 5000, 8)
    for k, data in ((1, rows[0]), (3, rows))[: 1 if method == "pak" else 2]:  # PAK is not batchable
        template = api.machine_for(method, 5000, SeededNoise(4), params)
        machine = template if k == 1 else template.batched(3)
        plain = api.machine_for(method, 5000, SeededNoise(4), params)
        plain = plain if k == 1 else plain.batched(3)
        assert machine.writes_out
        out = np.full(data.shape, np.nan)
        filled, in_place = 0, []
        for start in range(0, 5000, 1700):
            chunk = data[..., start:start + 1700]
            piece = machine.feed(chunk, out=out[..., filled:])
            in_place.append(written_in_place(piece, out[..., filled:]))
            expected = plain.feed(chunk)
            np.testing.assert_array_equal(piece, expected)
            out[..., filled:filled + piece.shape[-1]] = piece
            filled += piece.shape[-1]
        assert filled + machine.close().shape[-1] == 5000 and plain.close().shape[-1] == 5000 - filled
        if method == "tops" and smoother == "recent":
            assert all(in_place[1:])  # once the hold-out is released, every piece is written in place
    assert run_machine(api.machine_for(method, 5000, SeededNoise(4), params), iter([rows[0]]), 5000).shape == (5000,)
