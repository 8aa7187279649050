"""The keyed, addressable keystream (dpsql.noise) and the float-safe Laplace lattice."""

import math
import os
import threading

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers import algorithms
from scipy import stats

import dpsql
from dpsql import noise, sampling
from dpsql.addresses import partition_address
from dpsql.mechanisms import LATTICE_BITS, LaplaceLattice, report_noisy_max
from dpsql.mechanisms.laplace import LatticeBatch, draw_bound
from dpsql.noise import Keystream, Lane


def rows(seed: int = 0, partition: bytes = b"") -> noise.LaneDraws:
    """The ROWS lane of a seeded (non-private) keystream's partition."""
    return dpsql.testing.draws(seed, partition).lane(Lane.ROWS)


class ScriptedDraws(noise.Draws):
    """Draws whose keystream blocks are given: ``words[(attempt, index)] = (first, second)``
    (every other block is all zeros). Probes the sampler's arithmetic on chosen blocks."""

    def __init__(self, words):
        self.private = False
        self.words = words
        self.asked = []

    def _block(self, header: int, index: int):
        attempt = header & 0xFFFF_FFFF
        self.asked.append((attempt, index))
        return self.words.get((attempt, index), (0, 0))

    def _blocks(self, header, start, count, out=None):
        blocks = np.array([self._block(header, i) for i in range(start, start + count)], dtype=np.uint64)
        blocks = blocks.reshape(count, 2)
        if out is None:
            return blocks
        out[:] = blocks
        return out

    def _blocks_at(self, header, indices):
        return np.array([self._block(header, int(i)) for i in indices], dtype=np.uint64).reshape(-1, 2)


def scripted(words, scale, count=1):
    """The draws at indices ``0 .. count - 1`` of a scripted lane, by range and by index (equal)."""
    lane = ScriptedDraws(words).lane(Lane.ROWS)
    by_range = lane.discrete_laplace(scale, 0, count)
    np.testing.assert_array_equal(by_range, lane.discrete_laplace_at(scale, np.arange(count)))
    return by_range


# -- keys -------------------------------------------------------------------------------------------


def test_a_fresh_keystream_comes_from_the_os_csprng_and_is_private():
    a, b = Keystream.fresh(), Keystream.fresh()
    assert a.private and b.private
    assert len(a.key) == noise.KEY_BYTES and a.key != b.key
    assert a.key.hex() not in repr(a) and "private=True" in repr(a)
    draws_a = a.partition().lane(Lane.ROWS).discrete_laplace(10.0, 0, 64)
    draws_b = b.partition().lane(Lane.ROWS).discrete_laplace(10.0, 0, 64)
    assert not np.array_equal(draws_a, draws_b)
    with pytest.raises(dpsql.InvalidParameter, match="32 bytes"):
        Keystream(b"short", private=True)


def test_seeded_keys_are_reproducible_non_private_in_order_and_restored():
    with dpsql.testing.seeded(3) as first:
        assert not first.private
        one, two = Keystream.fresh(), Keystream.fresh()  # the block's first and second releases
        a = first.partition().lane(Lane.ROWS).discrete_laplace(10.0, 0, 100)
    assert one.key == first.key and two.key != one.key and not one.private and not two.private
    assert dpsql.testing.keys(3).key == first.key
    with dpsql.testing.seeded(3) as again:
        b = again.partition().lane(Lane.ROWS).discrete_laplace(10.0, 0, 100)
        assert Keystream.fresh().key == one.key and Keystream.fresh().key == two.key
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, rows(3).discrete_laplace(10.0, 0, 100))
    with dpsql.testing.seeded(4) as other:
        assert other.key != first.key
    assert Keystream.fresh().private  # the OS source again after the block


def test_seeded_keys_are_used_by_other_threads():
    seen = []
    with dpsql.testing.seeded(1) as first:
        thread = threading.Thread(target=lambda: seen.append(Keystream.fresh()))
        thread.start()
        thread.join()
    (keys,) = seen
    assert not keys.private and keys.key == first.key


def test_a_forked_child_never_draws_its_parents_noise():
    """Every release draws its key from os.urandom when it starts, so a forked child (a
    worker of a pool started after the parent made releases) never repeats the parent's keys."""
    parent = Keystream.fresh()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        try:
            child = Keystream.fresh()
            os.write(write, child.key + child.partition().lane(Lane.ROWS).blocks(0, 64).tobytes())
        finally:
            os._exit(0)
    os.close(write)
    received = b""
    while True:
        piece = os.read(read, 4096)
        if not piece:
            break
        received += piece
    os.waitpid(pid, 0)
    os.close(read)
    mine = Keystream.fresh()
    assert len(received) == noise.KEY_BYTES + 64 * 16
    child_key, child_blocks = received[:noise.KEY_BYTES], received[noise.KEY_BYTES:]
    assert child_key not in (parent.key, mine.key)
    parent_words = set(parent.partition().lane(Lane.ROWS).blocks(0, 64).ravel().tolist())
    assert not parent_words & set(np.frombuffer(child_blocks, dtype=np.uint64).tolist())


# -- addresses ------------------------------------------------------------------------------------


def test_draws_are_a_function_of_their_address_whatever_the_chunks():
    lane = rows(5)
    scale = 3.0
    n = 3 * (1 << 14) + 17  # several of the sampler's pieces
    whole = lane.discrete_laplace(scale, 0, n)
    for cut in (1, 1 << 14, (1 << 14) + 5, n - 1):
        np.testing.assert_array_equal(
            whole, np.concatenate([lane.discrete_laplace(scale, 0, cut), lane.discrete_laplace(scale, cut, n - cut)]))
    picked = np.random.default_rng(0).choice(n, 500, replace=False)
    np.testing.assert_array_equal(lane.discrete_laplace_at(scale, picked), whole[picked])
    np.testing.assert_array_equal(lane.uniform_at(picked), lane.uniform(0, n)[picked])
    # a retried computation recomputes the same values from another object of the same key
    np.testing.assert_array_equal(dpsql.testing.draws(5).lane(Lane.ROWS).discrete_laplace(scale, 7, 9), whole[7:16])


def test_distinct_addresses_never_share_keystream():
    keys = dpsql.testing.keys(0)
    lanes = [keys.partition(partition_address(p)).lane(lane, level)
             for p in (0, 1, "0") for lane in (Lane.ROWS, Lane.TREE) for level in (0, 1)]
    blocks = [lane.blocks(0, 2048) for lane in lanes] + [lanes[0].blocks(0, 2048, attempt=1)]
    every = np.concatenate(blocks)
    assert len(np.unique(every, axis=0)) == len(every)  # 26,624 blocks of 128 bits: no two equal
    assert partition_address(1) == partition_address(np.int16(1)) == partition_address(1.0)
    assert len({partition_address(k) for k in (1, "1", b"1", (1,), 1.5, None, True)}) == 7


def test_a_batch_of_partitions_draws_each_partitions_own_noise():
    keys = dpsql.testing.keys(2)
    addresses = [partition_address(k) for k in range(5)]
    batch = keys.partitions(addresses).lane(Lane.ROWS)
    scales = np.array([0.0, 0.7, 5.0, 5.0, 300.0])
    for count in (50, (1 << 14) + 3):  # the shared arithmetic, and partition by partition
        drawn = batch.discrete_laplace(scales, 11, count)
        for j, address in enumerate(addresses):
            own = keys.partition(address).lane(Lane.ROWS).discrete_laplace(float(scales[j]), 11, count)
            np.testing.assert_array_equal(drawn[j], own)
    assert not drawn[0].any()  # scale 0: no noise
    uniforms = batch.uniform(3, 10)
    np.testing.assert_array_equal(uniforms[4], keys.partition(addresses[4]).lane(Lane.ROWS).uniform(3, 10))
    many = [partition_address(k) for k in range(2_500)]  # short rows of many partitions: cache-sized groups
    scales = np.resize(scales, len(many))
    drawn = keys.partitions(many).lane(Lane.ROWS).discrete_laplace(scales, 11, 10)
    for j in (0, 1, 1_637, 1_638, 1_639, 2_499):  # either side of the first group's end (16,384 draws / 10)
        own = keys.partition(many[j]).lane(Lane.ROWS).discrete_laplace(float(scales[j]), 11, 10)
        np.testing.assert_array_equal(drawn[j], own)


def test_a_batch_carries_into_the_high_word_where_a_partitions_counters_wrap():
    """Short rows of many partitions are drawn by ECB over counters built in numpy: where a mask's
    low word plus an index passes 2**64, the carry goes into the high word, as counter mode
    (one partition alone) carries it. Groups with and without a wrap are both checked."""
    aes = algorithms.AES(bytes(range(32)))
    top = 2**64 - 1
    lows = [top - 3, top, 2**63, 5, top - 12, top - 13]  # wrap inside the row, at its start, never
    masks = np.array([[2**64 - 1 - j, low] for j, low in enumerate(lows)], dtype=np.uint64)
    masks = np.concatenate([masks, np.array([[7, 9]] * 3000, dtype=np.uint64)])  # later groups: no wrap
    batch = noise.DrawsBatch.masked(aes, masks, private=False).lane(Lane.ROWS, level=3)
    drawn, uniforms = batch.discrete_laplace(40.0, 2, 10), batch.uniform(2, 10)
    for j in [*range(len(lows)), len(masks) - 1]:
        alone = noise.Draws(aes, (int(masks[j, 0]) << 64) | int(masks[j, 1]), private=False).lane(Lane.ROWS, 3)
        np.testing.assert_array_equal(drawn[j], alone.discrete_laplace(40.0, 2, 10))
        np.testing.assert_array_equal(uniforms[j], alone.uniform(2, 10))


# -- the discrete Laplace sampler -----------------------------------------------------------------


@pytest.mark.parametrize("scale", [0.7, 5.0, 4096.0])
def test_discrete_laplace_matches_its_pmf(scale):
    z = rows(11).discrete_laplace(scale, 0, 400_000)
    a = math.exp(-1 / scale)
    var = 2 * a / (1 - a) ** 2  # exact: mean 0, variance 2a / (1 - a)^2
    assert z.dtype == np.int64
    assert abs(z.mean()) < 5 * math.sqrt(var / z.size)
    assert abs(z.var() / var - 1) < 0.02
    for k in (0, 1, -1, 3):  # the pmf at a few points, within 5 standard errors
        p = (1 - a) / (1 + a) * a ** abs(k)
        observed = np.mean(z == k)
        assert abs(observed - p) < 5 * math.sqrt(p * (1 - p) / z.size) + 1e-12


def test_private_draws_across_many_pieces_have_the_right_distribution():
    """Requests are cut into cache-sized pieces: every piece is filled (no zeros left from the
    allocation), pieces are independent, and the spread is the scale's."""
    z = Keystream.fresh().partition().lane(Lane.ROWS).discrete_laplace(1e6, 0, 1_000_003)
    assert np.count_nonzero(z == 0) < 20  # P(0) is about 5e-7 at this scale
    half = len(z) // 2
    assert abs(np.corrcoef(z[:half], z[half:2 * half])[0, 1]) < 0.01
    assert abs(np.std(z) / (math.sqrt(2) * 1e6) - 1) < 0.01
    assert abs(np.median(z)) < 0.01 * 1e6


def test_uniform_is_strictly_inside_the_unit_interval():
    u = rows(0).uniform(0, 200_000)
    assert u.min() > 0 and u.max() < 1
    assert stats.kstest(u, "uniform").pvalue > 1e-3
    extremes = ScriptedDraws({(0, 1): (2**64 - 1, 0)}).lane(Lane.ROWS).uniform(0, 2)
    assert extremes.tolist() == [0.5 * 2.0**-53, 1 - 0.5 * 2.0**-53]


def test_max_neg_log_uniform_bounds_the_largest_draw():
    """All-zero blocks give the smallest uniform the sampler can invert (a refined one,
    2**-106) with a positive sign: the largest draw there is."""
    scale = 1000.0
    largest = scripted({}, scale, count=3)
    assert np.all(largest == math.floor(scale * sampling.MAX_NEG_LOG_UNIFORM))
    assert largest[0] <= draw_bound(scale)
    z = rows(1).discrete_laplace(scale, 0, 100_000)
    assert np.abs(z).max() <= draw_bound(scale)


def test_tiny_uniforms_are_refined_so_far_tail_magnitudes_stay_reachable():
    scale = 2.0**27
    coarse = 5  # U in (5, 6] * 2^-53: without refinement one block, one magnitude
    draws = [scripted({(0, 0): (coarse, refinement)}, scale)[0] for refinement in (0, 1 << 52)]
    low = math.floor(-scale * math.log(6 * 2.0**-53))
    high = math.floor(-scale * math.log(5 * 2.0**-53))
    assert draws[0] != draws[1]
    assert all(low <= d <= high for d in draws)
    # a block above the refinement range ignores its second word
    ordinary = [scripted({(0, 0): (1 << 40, second)}, scale)[0] for second in (0, 12345, 2**64 - 1)]
    assert ordinary == [math.floor(-scale * math.log(((1 << 40) + 1) * 2.0**-53))] * 3


def test_top_bit_is_the_sign_and_negative_zero_is_redrawn_at_the_next_attempt():
    scale = 10.0
    low = (1 << 52) + 12345  # U about 1/2: magnitude floor(10 ln 2) = 6
    magnitude = math.floor(-scale * math.log((low + 1) * 2.0**-53))
    sign = 1 << 63
    assert scripted({(0, 0): (low, 0)}, scale)[0] == magnitude
    assert scripted({(0, 0): (sign | low, 0)}, scale)[0] == -magnitude
    near_one = (1 << 53) - 2  # U just below 1: magnitude 0
    assert scripted({(0, 0): (near_one, 0)}, scale)[0] == 0
    # (negative, 0) would count zero twice: that draw is rejected and drawn again from the same
    # index with the next attempt; the other indices keep their first draw
    words = {(0, 0): (low, 0), (0, 1): (sign | near_one, 0), (1, 1): (sign | near_one, 0), (2, 1): (sign | low, 0),
             (0, 2): (sign | low, 0), (1, 0): (sign | low, 0)}
    assert scripted(words, scale, count=3).tolist() == [magnitude, -magnitude, -magnitude]
    source = ScriptedDraws(words)
    source.lane(Lane.ROWS).discrete_laplace(scale, 0, 3)
    assert sorted(a for a in source.asked if a[0] > 0) == [(1, 1), (2, 1)]


def test_scales_beyond_the_samplers_resolution_are_refused():
    lane = rows(0)
    assert lane.discrete_laplace(sampling.MAX_SCALE, 0, 3).dtype == np.int64
    for bad in (math.nextafter(sampling.MAX_SCALE, math.inf), -1.0, float("nan")):
        with pytest.raises(dpsql.InvalidParameter, match=r"2\*\*33"):
            lane.discrete_laplace(bad, 0, 3)
    assert not lane.discrete_laplace(0.0, 0, 5).any()
    with pytest.raises(ValueError, match="out of range"):
        lane.discrete_laplace(1.0, -1, 3)
    with pytest.raises(ValueError, match="out of range"):
        lane.discrete_laplace_at(1.0, np.array([sampling.MAX_INDEX]))


# -- the lattice ------------------------------------------------------------------------------------


def test_lattice_is_a_power_of_two_fixed_by_public_parameters():
    lap = LaplaceLattice(sensitivity=3.0, epsilon=0.1)
    assert lap.granularity == 2.0 ** (1 - LATTICE_BITS)
    assert math.log2(lap.granularity).is_integer()
    # rounding costs at most a factor 1 + 2^(1 - LATTICE_BITS) on the scale
    assert 1 <= lap.scale / (3.0 / 0.1) <= 1 + 2.0 ** (1 - LATTICE_BITS)


def test_released_values_lie_on_the_lattice_for_any_float_input():
    x = np.array([0.1, 1 / 3, math.pi, 1e-9, 123456.789, -2.5e-5])
    lap = LaplaceLattice(sensitivity=1.0, epsilon=0.5)
    out = lap.release(x, rows(5))
    units = out / lap.granularity
    np.testing.assert_array_equal(units, np.round(units))


def test_mironov_attack_does_not_apply_noise_is_exactly_input_independent():
    """Two neighbouring inputs with the same noise draw: the outputs differ exactly by the
    difference of the lattice-rounded inputs, so low-order bits carry nothing about x."""
    lap = LaplaceLattice(sensitivity=1.0, epsilon=1.0)
    x, x_neighbour = np.full(1000, 0.1), np.full(1000, 0.1 + 1.0)
    out = lap.release(x, rows(9))
    out_neighbour = lap.release(x_neighbour, rows(9))
    shift = (lap.to_units(x_neighbour) - lap.to_units(x)) * lap.granularity
    np.testing.assert_array_equal(out_neighbour - out, shift)
    # the set of reachable outputs is the same lattice for both inputs
    assert np.all(np.mod(out, lap.granularity) == 0) and np.all(np.mod(out_neighbour, lap.granularity) == 0)


def test_laplace_lattice_variance_is_exact():
    lap = LaplaceLattice(sensitivity=2.0, epsilon=0.25)
    draws = lap.from_units(lap.noise_units(rows(2), 0, 400_000))
    assert abs(draws.var() / lap.variance - 1) < 0.02
    assert abs(lap.variance / (2 * (2.0 / 0.25) ** 2) - 1) < 2e-3
    assert stats.kstest(draws, stats.laplace(scale=lap.scale).cdf).statistic < 0.005


@pytest.mark.parametrize("epsilon", [1.0, 5e-6])  # ordinary noise, and noise near the largest scale allowed
def test_lattice_release_is_bit_identical_to_adding_int64_units(epsilon):
    lap = LaplaceLattice(sensitivity=8.0, epsilon=epsilon)
    # 2**42 is 2**51 lattice units: with the largest draws it stays below 2**53, the largest exact release
    x = np.concatenate([rows(6).uniform(0, 5000) * 16 - 8,
                        [0.0, -0.0, -1e-300, 2.0**-13, -3 * 2.0**-13, 2.0**42 + 0.5, -(2.0**42)]])
    released = lap.release(x, rows(7), start=3)
    expected = lap.from_units(lap.to_units(x) + lap.noise_units(rows(7), 3, x.size))
    np.testing.assert_array_equal(released, expected)
    np.testing.assert_array_equal(np.signbit(released), np.signbit(expected))


def test_a_lattice_batch_releases_each_partition_on_its_own_lattice():
    keys = dpsql.testing.keys(8)
    addresses = [b"a", b"b", b"c"]
    sensitivities = np.array([1.0, 1000.0, 1.0])
    values = np.stack([np.linspace(0, 1, 40), np.linspace(0, 1000, 40), np.linspace(1, 0, 40)])
    batch = LatticeBatch(sensitivities, epsilon=0.5)
    released = batch.release(values, keys.partitions(addresses).lane(Lane.ROWS), start=2)
    for j, address in enumerate(addresses):
        alone = LaplaceLattice(float(sensitivities[j]), 0.5).release(values[j], keys.partition(address).lane(Lane.ROWS),
                                                                     start=2)
        np.testing.assert_array_equal(released[j], alone)
    assert batch.variance.tolist() == [LaplaceLattice(s, 0.5).variance for s in sensitivities]


def test_lattice_scale_never_rounds_below_its_exact_value():
    from fractions import Fraction

    for epsilon in (0.1, 0.3, 0.7, 1 / 3, 0.01, 2.9):
        lap = LaplaceLattice(sensitivity=1.0, epsilon=epsilon)
        units = math.ceil(1.0 / lap.granularity) + 1
        assert Fraction(lap.scale_units) >= Fraction(units) / Fraction(epsilon)


def test_zero_sensitivity_draws_no_noise():
    lap = LaplaceLattice(sensitivity=0.0, epsilon=1.0)
    assert np.all(lap.release(np.zeros(5), rows(0)) == 0)
    assert lap.variance == 0


def test_report_noisy_max_tracks_a_clear_leader_and_is_random_on_ties():
    keys = dpsql.testing.keys(4)

    def lane(k):  # one partition per call: each call its own draws
        return keys.partition(partition_address(k)).lane(Lane.NOISY_MAX)

    picks = [report_noisy_max(np.array([0.0, 0.0, 5.0]), epsilon=10.0, noise=lane(k)) for k in range(200)]
    assert picks.count(2) == 200
    ties = [report_noisy_max(np.zeros(2), epsilon=1.0, noise=lane(k)) for k in range(2000)]
    assert 0.45 < np.mean(ties) < 0.55
    # the same draws give the same answer: a retried call releases nothing new
    assert [report_noisy_max(np.zeros(2), epsilon=1.0, noise=lane(k)) for k in range(50)] == ties[:50]


@pytest.mark.parametrize("n", [0, 1, 4095, 4096, 4097, 10_000])
def test_value_tags_are_the_addressed_blocks_of_the_values_bits(n):
    """A value's tag is the first word of AES of (VALUE_TAG lane, its bits), whatever the batch size."""
    draws = Keystream(bytes(range(32)), private=False).partition(b"p")
    values = np.random.default_rng(n).normal(size=n)
    values[::7] = 1.5  # equal values, equal tags
    tags = draws.tags(values)
    assert tags.dtype == np.uint64 and tags.shape == (n,)
    assert np.array_equal(tags, draws._blocks_at(int(Lane.VALUE_TAG) << 48, values.view(np.uint64))[:, 0])
    assert len(set(tags[::7].tolist())) <= 1
    if n > 1:
        assert np.array_equal(draws.tags(values[1:]), tags[1:])
