"""Empirical coverage of ``range_ci`` on data whose shape lies inside the blocks (daily cycles,
level shifts): short windows inside the hold-out, windows after it and across it, and
whole-table ranges, at 95 % and 80 %. The intervals must cover the clipped truth at least at
their stated level; the noise-only interval (without the spreading bound) must not, which is
why the bound is there.

Many releases are made at once as partitions of one release: each partition draws from its own
address, exactly as an independent stream (``tests/streams/test_tops_batched.py``)."""

import numpy as np
import pytest

import dpsql
from dpsql.error_models import quantile_multiplier
from dpsql.methods import run
from dpsql.testing import keys, seeded

N = 12_000
LEVELS = (0.95, 0.8)


def shaped(n=N, seed=0):
    """Hourly counts with a strong daily cycle, level shifts every 500 hours and rare spikes
    (integers, so clipping is the only rounding)."""
    hours = np.arange(n)
    cycle = 60 + 55 * np.sin(2 * np.pi * hours / 24) + 40 * ((hours // 500) % 2)
    values = np.rint(np.clip(cycle + np.random.default_rng(seed).normal(0, 5, n), 0, None))
    values[np.random.default_rng(seed + 1).integers(0, n, n // 200)] = 900.0
    return values


def windows(low, high, count, seed, shortest=3, longest=48):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(shortest, longest + 1, count)
    starts = rng.integers(low, high - lengths)
    return starts, starts + lengths


def release_many(method, values, k, seed, **params):
    """``k`` independent releases of ``values``, as partitions of one release (each its own
    threshold: these stand for independent streams)."""
    n = len(values)
    if method in ("tops", "pak"):
        params.setdefault("threshold_by", "partition")
    with seeded(seed):
        release = dpsql.publish(method, np.tile(values, k), partition_offsets=np.arange(0, k * n + 1, n), **params)
    return release


def coverage(release, values, starts, stops, level, *, bias=True):
    """Per range, the share of partitions whose interval covers the truth clipped at the
    partition's threshold (or the public upper bound). Partitions with the same threshold share
    an error model, so margins are computed once per threshold."""
    k, n = len(release.parts), len(values)
    released = np.concatenate([np.zeros((k, 1)), np.cumsum(release.values.reshape(k, n), axis=1)], axis=1)
    sums = released[:, stops] - released[:, starts]
    thresholds = np.array([part.params["upper"] if part.threshold is None else part.threshold
                           for part in release.parts])
    covered = np.zeros(sums.shape, dtype=bool)
    for theta in np.unique(thresholds):
        rows = np.flatnonzero(thresholds == theta)
        error = release.parts[int(rows[0])].error
        if bias:
            margin = error.range_margin(starts, stops, level)
        else:
            margin = quantile_multiplier(level, error.excess_kurtosis) * np.sqrt(error.range_variance(starts, stops))
        truth = np.concatenate([[0.0], np.cumsum(np.minimum(values, theta))])
        covered[rows] = np.abs(sums[rows] - (truth[stops] - truth[starts])) <= margin
    return covered.mean(axis=0)


def slack(level, count):
    """Three binomial standard errors of an estimated coverage."""
    return 3 * np.sqrt(level * (1 - level) / count)


@pytest.fixture(scope="module")
def tops_release():
    values = shaped()
    return values, release_many("tops", values, 2000, 1, epsilon=1.0, upper=1000.0)


def test_the_releases_have_their_own_thresholds(tops_release):
    _, release = tops_release
    thresholds = {part.threshold for part in release.parts}
    # each partition chose its own: most keep the 900 spikes (917 or 1000, the candidates above them),
    # a few percent clip them (about 200)
    assert len(thresholds) > 3 and max(thresholds) - min(thresholds) > 500.0


@pytest.mark.parametrize("where", ["inside the hold-out", "after the hold-out", "across the hold-out's end"])
@pytest.mark.parametrize("level", LEVELS)
def test_short_windows_cover_the_clipped_truth(tops_release, where, level):
    values, release = tops_release
    low, high = {"inside the hold-out": (0, 4096), "after the hold-out": (4096, N),
                 "across the hold-out's end": (4096 - 48, 4096 + 48)}[where]
    starts, stops = windows(low, high, 60, 2)
    shares = coverage(release, values, starts, stops, level)
    k = len(release.parts)
    assert shares.mean() >= level - slack(level, k * len(starts))
    assert shares.min() >= level - 1.5 * slack(level, k)
    # without the spreading bound the same intervals fall far short: the bound is needed
    noise_only = coverage(release, values, starts, stops, level, bias=False)
    assert noise_only.mean() < level - 0.1 and noise_only.min() < 0.1


@pytest.mark.parametrize("level", LEVELS)
def test_whole_table_ranges_cover_at_their_level(tops_release, level):
    """Ranges along block boundaries carry no spreading error: the noise's quantile alone."""
    values, release = tops_release
    starts, stops = np.array([0, 0, 4096, 0]), np.array([N, 4096, N, 8192])
    part = release.parts[0]
    assert not part.error.range_bias_bound(starts, stops).any()
    shares = coverage(release, values, starts, stops, level)
    assert shares.min() >= level - slack(level, len(release.parts))
    # long ranges that cut blocks at both ends: the bound is a small part of their margin
    starts, stops = np.array([100, 1000, 4000]), np.array([N - 77, 9000, 11_000])
    assert coverage(release, values, starts, stops, level).min() >= level - slack(level, len(release.parts))


@pytest.mark.parametrize("params", [{"smoother": "recent", "r": 4096}, {"smoother": "mean", "r": 4096, "depth": 2},
                                    {"block": 1000}])
@pytest.mark.parametrize("level", LEVELS)
def test_hierarchy_windows_cover_the_clipped_truth(params, level):
    """The known-bound hierarchy: predictive smoothers (a * bound per cut) and the flat spread."""
    values = shaped(6000, 3)
    release = release_many("hierarchy", values, 1500, 4, epsilon=1.0, upper=300.0, **params)
    starts, stops = windows(0, 6000, 60, 5)
    shares = coverage(release, values, starts, stops, level)
    assert shares.mean() >= level - slack(level, 1500 * len(starts))
    assert shares.min() >= level - 1.5 * slack(level, 1500)
    whole = coverage(release, values, np.array([0, 0]), np.array([6000, 4096]), level)
    assert whole.min() >= level - slack(level, 1500)


def test_pak_holdout_windows_cover_the_clipped_truth():
    """PAK releases its hold-out through the same flat hierarchy (one stream at a time: PAK is
    not batchable)."""
    values = shaped(6000, 6)
    starts, stops = windows(0, 4096, 40, 7)
    runs, covered, noise_only = 250, [], []
    for seed in range(runs):
        rel = run("pak", values, noise=keys(seed), epsilon=1.0, upper=1000.0, delta=1e-6)
        truth = np.concatenate([[0.0], np.cumsum(np.minimum(values, rel.threshold))])
        error = np.abs(rel.range_sum(starts, stops) - (truth[stops] - truth[starts]))
        covered.append(error <= rel.error.range_margin(starts, stops, 0.95))
        noise_only.append(error <= 2.12 * np.sqrt(rel.range_variance(starts, stops)))
    assert np.mean(covered) >= 0.95 - slack(0.95, runs * len(starts))
    assert np.mean(noise_only) < 0.95 - 0.1 and np.mean(noise_only, axis=0).min() < 0.1
