"""Noise sources and the float-safe Laplace lattice."""

import itertools
import math
import os

import numpy as np
import pytest
from scipy import stats

import dpsql
from dpsql import noise
from dpsql.mechanisms import LATTICE_BITS, LaplaceLattice, report_noisy_max


def test_default_source_is_the_os_csprng_and_private():
    source = noise.current()
    assert isinstance(source, noise.SystemNoise)
    assert source.private
    assert not hasattr(source, "seed")
    a, b = source.words(4), source.words(4)
    assert not np.array_equal(a, b)


def test_seeded_context_is_reproducible_non_private_and_restored():
    with dpsql.testing.seeded(3) as s1:
        assert not s1.private and noise.current() is s1
        a = s1.discrete_laplace(10.0, 100)
    with dpsql.testing.seeded(3) as s2:
        b = s2.discrete_laplace(10.0, 100)
    np.testing.assert_array_equal(a, b)
    assert isinstance(noise.current(), noise.SystemNoise)


def test_seeded_source_is_visible_from_other_threads():
    import threading

    seen = []
    with dpsql.testing.seeded(1) as source:
        t = threading.Thread(target=lambda: seen.append(noise.current()))
        t.start()
        t.join()
    assert seen == [source]


@pytest.mark.parametrize("scale", [0.7, 5.0, 4096.0])
def test_discrete_laplace_matches_its_pmf(scale):
    with dpsql.testing.seeded(11) as source:
        z = source.discrete_laplace(scale, 400_000)
    a = math.exp(-1 / scale)
    # exact moments: mean 0, variance 2a/(1-a)^2
    var = 2 * a / (1 - a) ** 2
    assert abs(z.mean()) < 5 * math.sqrt(var / z.size)
    assert abs(z.var() / var - 1) < 0.02
    # pmf at a few points, within 5 standard errors
    for k in (0, 1, -1, 3):
        p = (1 - a) / (1 + a) * a ** abs(k)
        observed = np.mean(z == k)
        assert abs(observed - p) < 5 * math.sqrt(p * (1 - p) / z.size) + 1e-12


def test_system_source_parallel_path_has_the_right_distribution():
    z = noise.SystemNoise().discrete_laplace(100.0, 3_000_000)  # > 2 pieces: threaded path
    a = math.exp(-1 / 100.0)
    assert abs(z.var() / (2 * a / (1 - a) ** 2) - 1) < 0.01
    assert z.dtype == np.int64


def test_uniform_is_strictly_inside_the_unit_interval():
    with dpsql.testing.seeded(0) as source:
        u = source.uniform(200_000)
    assert u.min() > 0 and u.max() < 1
    assert stats.kstest(u, "uniform").pvalue > 1e-3


def test_lattice_is_a_power_of_two_fixed_by_public_parameters():
    lap = LaplaceLattice(sensitivity=3.0, epsilon=0.1)
    assert lap.granularity == 2.0 ** (1 - LATTICE_BITS)
    assert math.log2(lap.granularity).is_integer()
    # rounding costs at most a factor 1 + 2^(1 - LATTICE_BITS) on the scale
    assert 1 <= lap.scale / (3.0 / 0.1) <= 1 + 2.0 ** (1 - LATTICE_BITS)


def test_released_values_lie_on_the_lattice_for_any_float_input():
    x = np.array([0.1, 1 / 3, math.pi, 1e-9, 123456.789, -2.5e-5])
    lap = LaplaceLattice(sensitivity=1.0, epsilon=0.5)
    with dpsql.testing.seeded(5) as source:
        out = lap.release(x, source)
    units = out / lap.granularity
    np.testing.assert_array_equal(units, np.round(units))


def test_mironov_attack_does_not_apply_noise_is_exactly_input_independent():
    """Two neighbouring inputs with the same noise draw: the outputs differ exactly by the
    difference of the lattice-rounded inputs, so low-order bits carry nothing about x."""
    lap = LaplaceLattice(sensitivity=1.0, epsilon=1.0)
    x, x_neighbour = np.full(1000, 0.1), np.full(1000, 0.1 + 1.0)
    with dpsql.testing.seeded(9) as source:
        out = lap.release(x, source)
    with dpsql.testing.seeded(9) as source:
        out_neighbour = lap.release(x_neighbour, source)
    shift = (lap.to_units(x_neighbour) - lap.to_units(x)) * lap.granularity
    np.testing.assert_array_equal(out_neighbour - out, shift)
    # the set of reachable outputs is the same lattice for both inputs
    assert np.all(np.mod(out, lap.granularity) == 0) and np.all(np.mod(out_neighbour, lap.granularity) == 0)


def test_laplace_lattice_variance_is_exact():
    lap = LaplaceLattice(sensitivity=2.0, epsilon=0.25)
    with dpsql.testing.seeded(2) as source:
        draws = lap.from_units(lap.noise_units(source, 400_000))
    assert abs(draws.var() / lap.variance - 1) < 0.02
    assert abs(lap.variance / (2 * (2.0 / 0.25) ** 2) - 1) < 2e-3
    assert stats.kstest(draws, stats.laplace(scale=lap.scale).cdf).statistic < 0.005


@pytest.mark.parametrize("epsilon", [1.0, 5e-6])  # ordinary noise, and noise near the largest scale allowed
def test_lattice_release_is_bit_identical_to_adding_int64_units(epsilon):
    lap = LaplaceLattice(sensitivity=8.0, epsilon=epsilon)
    # 2**42 is 2**51 lattice units: with the largest draws it stays below 2**53, the largest exact release
    with dpsql.testing.seeded(6) as source:
        x = np.concatenate([source.uniform(5000) * 16 - 8,
                            [0.0, -0.0, -1e-300, 2.0**-13, -3 * 2.0**-13, 2.0**42 + 0.5, -(2.0**42)]])
    with dpsql.testing.seeded(7) as source:
        released = lap.release(x, source)
    with dpsql.testing.seeded(7) as source:
        expected = lap.from_units(lap.to_units(x) + lap.noise_units(source, x.size))
    np.testing.assert_array_equal(released, expected)
    np.testing.assert_array_equal(np.signbit(released), np.signbit(expected))


def test_max_neg_log_uniform_bounds_the_largest_draw():
    class ZeroWords(noise.NoiseSource):
        """All-zero words: the smallest uniform the sampler can invert, with a positive sign."""

        def words(self, n):
            return np.zeros(n, dtype=np.uint64)

    scale = 1000.0
    largest = ZeroWords().discrete_laplace(scale, 3)
    assert np.all(largest == math.floor(scale * noise.MAX_NEG_LOG_UNIFORM))


def test_zero_sensitivity_draws_no_noise():
    lap = LaplaceLattice(sensitivity=0.0, epsilon=1.0)
    with dpsql.testing.seeded(0) as source:
        assert np.all(lap.release(np.zeros(5), source) == 0)
    assert lap.variance == 0


def test_report_noisy_max_tracks_a_clear_leader_and_is_random_on_ties():
    with dpsql.testing.seeded(4) as source:
        picks = [report_noisy_max(np.array([0.0, 0.0, 5.0]), epsilon=10.0, noise=source) for _ in range(200)]
        assert picks.count(2) == 200
        ties = [report_noisy_max(np.zeros(2), epsilon=1.0, noise=source) for _ in range(2000)]
    assert 0.45 < np.mean(ties) < 0.55


class _Scripted(noise.NoiseSource):
    """Hands out the given words in order (to probe the sampler's arithmetic)."""

    def __init__(self, words):
        self._words = list(words)

    def words(self, n):
        taken, self._words = self._words[:n], self._words[n:]
        return np.array(taken, dtype=np.uint64)


def test_tiny_uniforms_are_refined_so_far_tail_magnitudes_stay_reachable():
    scale = 2.0**27
    coarse = 5  # U in (5, 6] * 2^-53: without refinement one word, one magnitude
    draws = [_Scripted([coarse, refinement]).discrete_laplace(scale, 1)[0] for refinement in (0, 1 << 52)]
    low = math.floor(-scale * math.log(6 * 2.0**-53))
    high = math.floor(-scale * math.log(5 * 2.0**-53))
    assert draws[0] != draws[1]
    assert all(low <= d <= high for d in draws)
    # a word above the refinement range consumes no second word
    ordinary = _Scripted([1 << 40]).discrete_laplace(scale, 1)[0]
    assert ordinary == math.floor(-scale * math.log(((1 << 40) + 1) * 2.0**-53))


def test_lattice_scale_never_rounds_below_its_exact_value():
    from fractions import Fraction

    for epsilon in (0.1, 0.3, 0.7, 1 / 3, 0.01, 2.9):
        lap = LaplaceLattice(sensitivity=1.0, epsilon=epsilon)
        units = math.ceil(1.0 / lap.granularity) + 1
        assert Fraction(lap.scale_units) >= Fraction(units) / Fraction(epsilon)


def test_top_bit_is_the_sign_and_negative_zero_is_redrawn():
    scale = 10.0
    low = (1 << 52) + 12345  # U about 1/2: magnitude floor(10 ln 2) = 6
    magnitude = math.floor(-scale * math.log((low + 1) * 2.0**-53))
    sign = 1 << 63
    assert _Scripted([low]).discrete_laplace(scale, 1)[0] == magnitude
    assert _Scripted([sign | low]).discrete_laplace(scale, 1)[0] == -magnitude
    near_one = (1 << 53) - 2  # U just below 1: magnitude 0
    assert _Scripted([near_one]).discrete_laplace(scale, 1)[0] == 0
    # (negative, 0) would count zero twice: that draw is rejected and the next word used
    assert _Scripted([sign | near_one, sign | low]).discrete_laplace(scale, 1)[0] == -magnitude


def test_pieces_and_threads_do_not_change_the_distribution():
    """SystemNoise splits large requests between threads and cache-sized pieces; every share is
    filled (no zeros left from the allocation) and the pieces are independent."""
    z = noise.SystemNoise().discrete_laplace(1e6, 1_000_003)
    assert np.count_nonzero(z == 0) < 20  # P(0) is about 5e-7 at this scale
    half = len(z) // 2
    assert abs(np.corrcoef(z[:half], z[half:2 * half])[0, 1]) < 0.01
    assert abs(np.std(z) / (math.sqrt(2) * 1e6) - 1) < 0.01


def test_prefetched_words_are_handed_out_once_in_order_then_fresh_ones(monkeypatch):
    counter = itertools.count()
    monkeypatch.setattr(noise, "_urandom_words",
                        lambda n: np.fromiter(counter, dtype=np.uint64, count=n))
    monkeypatch.setattr(noise, "_PREFETCH_PIECE", 300)
    monkeypatch.setattr(noise, "_MAX_PREFETCHED", 2000)
    source = noise.SystemNoise()
    source.prefetch(1000)  # read ahead: words 0..999, in pieces of 300
    drawn = np.concatenate([source.words(600), source.words(250), source.words(400)])
    np.testing.assert_array_equal(drawn, np.arange(1250))
    assert source._reserved == 0 and not source._ready and not source._pending
    source.prefetch(2500)  # capped: memory stays bounded
    assert source._reserved == 2000
    assert source.words(2100)[-1] == 1250 + 2099


def test_prefetch_is_a_hint_seeded_sources_ignore():
    with dpsql.testing.seeded(11) as source:
        a = source.discrete_laplace(3.0, 50)
    with dpsql.testing.seeded(11) as source:
        source.prefetch(1000)
        b = source.discrete_laplace(3.0, 50)
    np.testing.assert_array_equal(a, b)


def test_a_forked_child_never_hands_out_its_parents_read_ahead_words():
    """Review finding: a child inherited the reservoir and drew the parent's words."""
    source = noise.SystemNoise()
    source.prefetch(1 << 12)
    source.words(1)  # wait for the read-ahead to arrive, so the child inherits ready words
    source.prefetch(1 << 22)  # and a read still pending at the fork: the child must not wait for it
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        try:
            os.write(write, source.words(64).tobytes())
        finally:
            os._exit(0)
    os.close(write)
    child = b""
    while len(child) < 64 * 8:
        piece = os.read(read, 64 * 8)
        if not piece:
            break
        child += piece
    os.waitpid(pid, 0)
    os.close(read)
    parent = source.words(64)
    assert len(child) == 64 * 8
    assert not set(np.frombuffer(child, dtype=np.uint64).tolist()) & set(parent.tolist())
