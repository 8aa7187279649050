"""Equal-length partitions released in one batched run (``tops``, ``hierarchy``).

The batched run is the single-stream code with a leading partition axis, and every partition
draws from its own address (the release key and the partition's key), so every partition's
release must be exactly, bit for bit, what its own single stream gives with those draws:
values, thresholds, parameters, components, costs and error models."""

import itertools

import numpy as np
import pytest

import dpsql
from dpsql import api, noise
from dpsql.addresses import partition_address
from dpsql.mechanisms.laplace import LaplaceLattice, LatticeBatch
from dpsql.mechanisms.smoothers import SMOOTHERS
from dpsql.methods import machine_for, run
from dpsql.noise import Keystream, Lane
from dpsql.release import release_from, run_machine, written_in_place
from dpsql.streams.hierarchy import HierarchyStream
from dpsql.testing import draws, keys, seeded


def _rows(k, n, seed=0):
    rng = np.random.default_rng(seed)
    # partitions with different spreads, so that their thresholds (and lattices) differ
    return rng.gamma(2.0, 1.0, (k, n)) * rng.uniform(50.0, 1500.0, (k, 1))


def _single(method, values, release_keys, key, **params):
    """Partition ``key``'s release alone, from the draws at its address."""
    machine = machine_for(method, len(values), release_keys.partition(partition_address(key)), params)
    return release_from(machine, iter([values]), len(values), private=False)


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
    np.testing.assert_array_equal(got.error.range_bias_bound(starts, stops), want.error.range_bias_bound(starts, stops))


@pytest.mark.parametrize("smoother", SMOOTHERS)
@pytest.mark.parametrize("method", ["tops", "hierarchy"])
def test_batched_partitions_equal_their_single_streams(method, smoother):
    k, n = 6, 6000
    rows = _rows(k, n)
    params = dict(epsilon=0.8, upper=6000.0, lower=-5.0, smoother=smoother)
    if method == "tops":  # each partition its own threshold, as alone
        params["threshold_by"] = "partition"
    if smoother != "none":
        params["r"] = 2000
    with seeded(3) as release_keys:
        release = api.publish(method, rows.ravel(), partition_offsets=np.arange(0, k * n + 1, n), **params)
    for j in range(k):
        _assert_same_release(release.part(j), _single(method, rows[j], release_keys, j, **params), n)
    if method == "tops":
        assert len({p.threshold for p in release.parts}) > 1  # partitions really have their own lattices


def test_publish_groups_partitions_by_length():
    """Several lengths: an adjacent group (views), an interleaved one (gathered), a group of one."""
    lengths = [5000, 6500, 6500, 6500, 8000, 5000, 5000, 6000, 5000]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    values = np.concatenate([row[:length] for row, length in zip(_rows(len(lengths), max(lengths), 3), lengths)])
    keys_ = [f"p{j}" for j in range(len(lengths))]
    params = dict(epsilon=1.0, upper=5000.0, smoother="mean", threshold_by="partition")
    with seeded(4) as release_keys:
        release = api.publish("tops", values, partition_offsets=offsets, partition_keys=keys_, **params)
    for j, (a, b) in enumerate(itertools.pairwise(offsets)):
        _assert_same_release(release.part(j), _single("tops", values[a:b], release_keys, keys_[j], **params),
                             int(b - a))
    np.testing.assert_array_equal(release.values, np.concatenate([p.values for p in release.parts]))


def test_a_partitions_release_does_not_depend_on_the_others():
    rows = _rows(4, 5000, 5)
    offsets = np.arange(0, 4 * 5000 + 1, 5000)
    with seeded(6):
        four = api.publish("tops", rows.ravel(), partition_offsets=offsets, partition_keys=["a", "b", "c", "d"],
                           epsilon=0.5, upper=4000.0, threshold_by="partition")
    with seeded(6):
        two = api.publish("tops", rows[[2, 0]].ravel(), partition_offsets=offsets[:3], partition_keys=["c", "a"],
                          epsilon=0.5, upper=4000.0, threshold_by="partition")
    np.testing.assert_array_equal(two.part(0).values, four.part(2).values)
    np.testing.assert_array_equal(two.part(1).values, four.part(0).values)


def test_an_unpartitioned_release_is_the_single_stream_with_the_empty_address():
    values = _rows(1, 20_000, 5)[0]
    params = dict(epsilon=0.5, upper=4000.0, r=3000, smoother="exponential")
    with seeded(9) as release_keys:
        release = api.publish("tops", values, **params)
    machine = machine_for("tops", len(values), release_keys.partition(b""), params)
    _assert_same_release(release, release_from(machine, iter([values]), len(values), private=False), len(values))
    _assert_same_release(release, run("tops", values, noise=release_keys, **params), len(values))


def test_a_seeded_release_draws_the_same_noise_as_before():
    """Pinned values of a seeded release (the current noise scheme's addressed draws): a continual
    stream appended later must draw what it drew, so the noise of an address may never change."""
    values = np.random.default_rng(0).gamma(2.0, 300.0, 60_000)
    with seeded(7):  # Eq. 6, the objective these values were pinned with (the draws are the same for any)
        release = api.publish("tops", values, epsilon=0.7, upper=3000.0, focus="paper")
    assert release.threshold == 2981.0
    assert (release.values[123], release.values[-1]) == (485.58203125, 735.8177083333334)
    assert release.values.sum() == pytest.approx(35979900.5, rel=1e-13)
    assert release.range_variance(100, 40000) == pytest.approx(4237112935.326926, rel=1e-12)


def test_the_legacy_scheme_still_draws_what_it_drew():
    """Streams registered before the masked scheme keep drawing with per-partition sub-keys:
    the values pinned under that scheme in round 2, exactly."""
    values = np.random.default_rng(0).gamma(2.0, 300.0, 60_000)
    legacy = Keystream(noise._SeededKeys(7).next_key(), private=False, scheme=noise.LEGACY_SCHEME)
    release = run("tops", values, noise=legacy, epsilon=0.7, upper=3000.0, focus="paper")
    assert release.threshold == 2914.0
    assert (release.values[123], release.values[-1]) == (620.4296875, 726.65625)
    assert release.values.sum() == pytest.approx(36036294.5, rel=1e-13)
    assert release.range_variance(100, 40000) == pytest.approx(4048820579.087105, rel=1e-12)


def test_lattice_batch_is_each_partitions_lattice():
    sensitivities = np.array([3.0, 1000.0, 3.0, 0.01])
    batch = LatticeBatch(sensitivities, epsilon=0.4)
    values = np.random.default_rng(6).normal(0.0, 100.0, (4, 5))
    partitions = keys(7).partitions([b"a", b"b", b"c", b"d"])
    got = batch.release(values, partitions.lane(Lane.ROWS))
    for j, s in enumerate(sensitivities):
        lap = LaplaceLattice(s, 0.4)
        assert (batch.granularity[j], batch.scale_units[j], batch.variance[j]) == (
            lap.granularity, lap.scale_units, lap.variance)
        np.testing.assert_array_equal(got[j], lap.release(values[j], partitions[j].lane(Lane.ROWS)))


def test_median_smoother_keeps_one_history_per_partition():
    k, n = 3, 2000
    rows = _rows(k, n, 8)
    params = dict(epsilon=1.0, upper=3000.0, smoother="median", r=500)
    with seeded(10) as release_keys:
        release = api.publish("hierarchy", rows.ravel(), partition_offsets=np.arange(0, k * n + 1, n), **params)
    for j in range(k):
        _assert_same_release(release.part(j), _single("hierarchy", rows[j], release_keys, j, **params), n)


@pytest.mark.parametrize("smoother", SMOOTHERS)
def test_every_smoother_accepts_pieces_that_complete_no_block(smoother):
    """The online contract: feeding row by row (most pieces complete no block) gives the
    release fed whole; and a batched chunk shorter than a block works."""
    values = np.linspace(0.0, 10.0, 700)
    whole = HierarchyStream(700, epsilon=0.5, upper=10.0, r=512, fanout=4, depth=2, smoother=smoother,
                            noise=draws(8))
    expected = np.concatenate([whole.feed(values), whole.close()])
    machine = HierarchyStream(700, epsilon=0.5, upper=10.0, r=512, fanout=4, depth=2, smoother=smoother,
                              noise=draws(8))
    pieces = np.concatenate([*(machine.feed(values[i:i + 1]) for i in range(700)), machine.close()])
    np.testing.assert_array_equal(pieces, expected)
    offsets = np.arange(0, 5 * 20_000 + 1, 20_000)
    with seeded(9):
        release = api.publish("tops", np.random.default_rng(0).uniform(0, 1000, offsets[-1]),
                              partition_offsets=offsets, epsilon=0.01, upper=1000.0, smoother=smoother, r=5000)
    assert len(release.values) == offsets[-1]
    batch = HierarchyStream(100, epsilon=0.5, upper=10.0, r=512, fanout=4, depth=2, smoother=smoother,
                            noise=draws(8)).batched(keys(8).partitions([b"x", b"y"]))
    out = np.concatenate([batch.feed(np.full((2, 5), 3.0)), batch.feed(np.full((2, 95), 3.0)), batch.close()],
                         axis=1)
    assert out.shape == (2, 100)


@pytest.mark.parametrize("method, smoother", [("tops", "recent"), ("tops", "none"), ("hierarchy", "median"),
                                              ("hierarchy", "none"), ("pak", None)])
def test_machines_writing_into_the_callers_buffer_release_the_same_values(method, smoother):
    """``feed(chunk, out=...)`` (``writes_out``) writes the outputs in place where it can and
    gives the same values as feeding without a buffer, chunk by chunk, for one stream and
    for a batch of partitions."""
    params = dict(epsilon=0.8, upper=6000.0, lower=-5.0)
    if method != "pak":
        params.update(smoother=smoother)
        if smoother != "none":
            params["r"] = 700
    else:
        params["delta"] = 1e-6
    rows = _rows(3, 9000, 8)
    batch = keys(4).partitions([b"a", b"b", b"c"])
    for k, data in ((1, rows[0]), (3, rows))[: 1 if method == "pak" else 2]:  # PAK is not batchable
        template = machine_for(method, 9000, draws(4), params)
        machine = template if k == 1 else template.batched(batch)
        plain = machine_for(method, 9000, draws(4), params)
        plain = plain if k == 1 else plain.batched(batch)
        assert machine.writes_out
        out = np.full(data.shape, np.nan)
        filled, in_place = 0, []
        for start in range(0, 9000, 1700):
            chunk = data[..., start:start + 1700]
            piece = machine.feed(chunk, out=out[..., filled:])
            in_place.append(written_in_place(piece, out[..., filled:]))
            np.testing.assert_array_equal(piece, plain.feed(chunk))
            out[..., filled:filled + piece.shape[-1]] = piece
            filled += piece.shape[-1]
        assert filled + machine.close().shape[-1] == 9000 and plain.close().shape[-1] == 9000 - filled
        if method == "tops" and smoother == "recent":
            assert all(in_place[3:])  # once the hold-out is released, every piece is written in place
    assert run_machine(machine_for(method, 9000, draws(4), params), iter([rows[0]]), 9000).shape == (9000,)


def test_batched_releases_of_identical_partitions_are_independent():
    """Identical partitions of one release: the same data, independent noise (their own
    addresses), so their range sums spread as the error model says."""
    k, n = 400, 5000
    row = _rows(1, n, 11)[0]
    with seeded(12):
        release = dpsql.publish("hierarchy", np.tile(row, k), partition_offsets=np.arange(0, k * n + 1, n),
                                epsilon=0.3, upper=8000.0, block=50)
    sums = np.array([p.range_sum(1200, 3900) for p in release.parts])
    assert len(np.unique(sums)) == k
    expected = release.part(0).range_variance(1200, 3900)
    assert ((sums - np.clip(row, 0, 8000)[1200:3900].sum()) ** 2).mean() == pytest.approx(expected, rel=4 * (5 / k)
                                                                                          ** 0.5)
