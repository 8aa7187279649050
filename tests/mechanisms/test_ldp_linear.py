"""The collector's linear post-processing (the sequence smoothers of docs/algorithms.md) and its noise model: the moving
average by pieces against the whole stream, and range variances against dense matrices."""

import itertools

import numpy as np
import pytest

from dpsql.mechanisms.ldp import ReportNoise, feedback_impulse, moving_average
from dpsql.mechanisms.ldp.linear import reach


def dense_variances(report_index, variance, gain, memory, window, align):
    """``Var(sum_{i<=t<j} values_t) = sum_k Var(xi_k) (G^T R^T S^T 1_[i,j))_k^2`` for every ``i < j``,
    with the three matrices written out."""
    n = len(report_index)
    reports = report_index.max() + 1
    back, ahead = reach(window, align)
    smoothing = np.zeros((n, n))
    for row in range(n):
        lo, hi = max(row - back, 0), min(row + ahead + 1, n)
        smoothing[row, lo:hi] = 1.0 / (hi - lo)
    replication = np.zeros((n, reports))
    replication[np.arange(n), report_index] = 1.0
    g = feedback_impulse(gain, memory, reports)
    feedback = np.zeros((reports, reports))
    for k in range(reports):
        feedback[k:k + len(g), k] = g[:reports - k]
    out = {}
    for i, j in itertools.combinations(range(n + 1), 2):
        ones = np.zeros(n)
        ones[i:j] = 1.0
        c = feedback.T @ replication.T @ smoothing.T @ ones
        out[i, j] = float(np.broadcast_to(variance, (reports,)) @ c**2)
    return out


@pytest.mark.parametrize("window, align", [(1, "trailing"), (3, "trailing"), (5, "center"), (4, "trailing")])
@pytest.mark.parametrize("gain, memory", [(0.0, 0), (0.3, 1), (0.2, 3), (0.05, None)])
@pytest.mark.parametrize("segments", ["slots", "segments"])
def test_range_variances_equal_the_dense_matrices(window, align, gain, memory, segments):
    n = 40
    if segments == "slots":
        report_index = np.arange(n)
    else:  # a period of 2, 2, 3 slots, the last report over an unsampled tail of 1
        report_index = np.minimum(np.repeat(np.arange(20), np.resize([2, 2, 3], 20))[:n], 15)
    variance = np.random.default_rng(1).uniform(0.5, 2.0, report_index.max() + 1)  # test values
    model = ReportNoise(report_index=report_index, report_variance=variance, gain=gain, memory=memory,
                        window=window, align=align)
    expected = dense_variances(report_index, variance, gain, memory, window, align)
    pairs = np.array(list(expected))
    np.testing.assert_allclose(model.range_variance(pairs[:, 0], pairs[:, 1]), list(expected.values()),
                               rtol=1e-9, atol=1e-12)


def test_a_long_range_costs_no_more_than_a_short_one():
    import time

    n = 2_000_000
    model = ReportNoise(report_index=np.arange(n), report_variance=1.0, gain=0.2, memory=3, window=3)
    start = time.perf_counter()
    model.range_variance(np.zeros(200, dtype=np.int64), np.full(200, n))
    assert time.perf_counter() - start < 2.0  # a dense evaluation would take minutes


@pytest.mark.parametrize("window, align", [(1, "trailing"), (3, "trailing"), (7, "center")])
def test_moving_average_by_pieces_is_the_whole_streams(window, align):
    x = np.random.default_rng(2).normal(size=(3, 200))  # test values
    whole = moving_average(x, window, align)
    back, ahead = reach(window, align)
    pieces, emitted = [], 0
    for stop in (1, 2, 50, 51, 120, 200):  # rows released as pieces arrive; the rest at the end
        ready = max(stop - ahead, emitted) if stop < 200 else 200
        first = max(emitted - back, 0)
        pieces.append(moving_average(x[:, first:stop], window, align, emitted, ready, first=first,
                                     length=200 if stop == 200 else None))
        emitted = ready
    np.testing.assert_array_equal(np.concatenate(pieces, axis=1), whole)
    for t in (0, 1, 57, 199):  # each row is its window's mean, the window shrunk at the ends
        lo, hi = max(t - back, 0), min(t + ahead + 1, 200)
        np.testing.assert_allclose(whole[:, t], x[:, lo:hi].mean(axis=1), rtol=1e-13)
