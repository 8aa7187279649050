"""Block smoothers (ToPS App. D): predictions from released block sums."""

import numpy as np
import pytest
from oracles import reference_predictions

from dpsql.mechanisms.smoothers import MIN_ALPHA, SMOOTHERS, make_smoother

PREDICTIVE = ["recent", "mean", "median", "moving", "exponential"]


def test_the_smoother_names():
    assert (*PREDICTIVE, "none") == SMOOTHERS and MIN_ALPHA == 0.001
    assert all(make_smoother(name, block=4, initial_sum=0.0, window=2, alpha=0.5).predictive for name in PREDICTIVE)
    assert not make_smoother("none", block=4, initial_sum=0.0, window=2, alpha=0.5).predictive


@pytest.mark.parametrize("name", PREDICTIVE)
def test_smoother_predictions_match_reference(name):
    rng = np.random.default_rng(4)
    sums = rng.normal(50, 20, 301)
    smoother = make_smoother(name, block=16, initial_sum=80.0, window=3, alpha=0.6)
    got = np.concatenate([[smoother.first_prediction]] + [smoother.predict(piece)
                                                          for piece in np.split(sums, [1, 2, 50, 51, 200])])
    np.testing.assert_allclose(got, reference_predictions(name, sums, 16, 80.0), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", PREDICTIVE)
def test_partitions_keep_their_own_state(name):
    """Rows of a 2-D array of sums are independent streams with their own first guesses."""
    rng = np.random.default_rng(5)
    sums = rng.normal(50, 20, (3, 40))
    initial = np.array([10.0, 80.0, 160.0])
    together = make_smoother(name, block=8, initial_sum=initial, window=3, alpha=0.6)
    got = np.concatenate([together.first_prediction[:, None], together.predict(sums[:, :7]),
                          together.predict(sums[:, 7:])], axis=1)
    for j in range(3):
        np.testing.assert_allclose(got[j], reference_predictions(name, sums[j], 8, initial[j]), rtol=1e-12)


@pytest.mark.parametrize("name", ["mean", "median", "moving", "exponential"])
def test_snapshot_and_restore_continue_the_predictions(name):
    sums = np.random.default_rng(6).normal(50, 20, 60)
    whole = make_smoother(name, block=4, initial_sum=8.0, window=5, alpha=0.3).predict(sums)
    first = make_smoother(name, block=4, initial_sum=8.0, window=5, alpha=0.3)
    head = first.predict(sums[:23])
    second = make_smoother(name, block=4, initial_sum=8.0, window=5, alpha=0.3)
    second.restore(first.snapshot())
    np.testing.assert_array_equal(np.concatenate([head, second.predict(sums[23:])]), whole)


def test_exponential_filter_is_stable_over_long_runs():
    smoother = make_smoother("exponential", block=1, initial_sum=0.0, window=1, alpha=0.001)
    assert np.allclose(smoother.predict(np.full(200_000, 7.0)), 7.0, rtol=1e-12)


def test_flat_spread_prefix_terms():
    """``none``: the prefix up to offset a of block t of len rows is U(t) + a / len * (U(t+1) - U(t))."""
    smoother = make_smoother("none", block=10, initial_sum=0.0, window=1, alpha=1.0)
    points, coefs = smoother.prefix_terms(np.array([0, 3, 7]), np.array([0, 4, 3]), np.array([10, 10, 6]))
    np.testing.assert_array_equal(points, [[1, 0], [4, 3], [8, 7]])
    np.testing.assert_allclose(coefs, [[0.0, 1.0], [0.4, 0.6], [0.5, 0.5]])
