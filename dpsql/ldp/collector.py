"""The collector's side of Du et al.'s methods: post-processing of the reports of
:func:`dpsql.ldp.capp` and its siblings (free of charge), and DU's metrics.

A release carries ``.values`` (the published per-slot stream as the paper publishes it:
smoothed for IPP/APP/CAPP, raw for the baselines and PP-S), ``.reports`` (raw reports in
data units, one per report sent) and ``.params``; from those, :func:`published_stream`
rebuilds any smoothing, :func:`subsequence_means` and :func:`crowd_distribution` give
DU's estimators, :func:`subsequence_mean_mse`, :func:`cosine_similarity`,
:func:`cosine_distance` and :func:`wasserstein_1` its metrics.
"""

from __future__ import annotations

import numpy as np

from dpsql import _validate
from dpsql.errors import InvalidParameter
from dpsql.mechanisms.ldp.linear import ALIGNS, moving_average
from dpsql.mechanisms.ldp.randomisers import SQUARE_WAVE
from dpsql.streams.du.plan import report_slots, segment_lengths


def report_lengths(release) -> np.ndarray:
    """How many slots each of ``release.reports`` covers (segments for sampling methods)."""
    params = release.params
    if "n_s" in params:
        return segment_lengths(len(release.values), params["qlen"], params["n_s"])
    return np.ones(len(release.reports), dtype=np.int64)


def published_stream(reports, lengths, n: int, *, window: int = 1, align: str = "trailing") -> np.ndarray:
    """The collector's per-slot stream from reports (post-processing, free): each report
    repeated over its ``lengths`` slots, an unsampled tail repeating the last report, then
    a simple moving average over ``window`` slots (``align`` ``"trailing"`` or ``"center"``):
    bit for bit the stream a release publishes.

    Examples
    --------
    >>> published_stream(np.array([1.0, 4.0]), np.array([2, 2]), 5, window=3)
    array([1., 1., 2., 3., 4.])
    """
    reports = np.asarray(reports, dtype=np.float64)
    raw = reports[report_slots(n, np.asarray(lengths, dtype=np.int64))]
    return moving_average(raw, _validate.integer(window, "window", minimum=1),
                          _validate.choice(align, "align", ALIGNS))


def slot_values(release) -> np.ndarray:
    """The unsmoothed per-slot stream of a release (what the reference code scores for means)."""
    return published_stream(release.reports, report_lengths(release), len(release.values))


def debiased_slot_values(release) -> np.ndarray:
    """Per-slot unbiased estimates of the true values from a release WITHOUT feedback
    (``sw_direct``, ``sampling``): each raw SW report mapped back by the inverse of its
    mean, ``(y - q(1 + 2b)/2) / (2b(p - q))`` (P8), in data units. Post-processing, free.
    Raw SW reports are pulled towards the middle of ``[lower, upper]``; this removes that
    pull at the price of a variance larger by ``1 / (2b(p - q))^2``. For the feedback
    methods no per-report inverse exists (their inputs depend on past reports).

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> with dpsql.testing.seeded(0):
    ...     rel = dpsql.ldp.sw_direct(np.full(20000, 10.0), epsilon=2.0, w=1, lower=0.0, upper=100.0)
    >>> 26 <= round(float(slot_values(rel).mean())) <= 29, round(float(debiased_slot_values(rel).mean()))
    (True, 10)
    """
    if release.method not in ("sw_direct", "sampling"):
        raise InvalidParameter(f"debiasing needs independent SW reports (sw_direct, sampling), not {release.method!r}")
    params = release.params
    return debias(slot_values(release), lower=params["lower"], upper=params["upper"],
                  epsilon_report=params["epsilon_report"])


def debias(reports, *, lower: float, upper: float, epsilon_report: float) -> np.ndarray:
    """Raw SW reports in data units -> unbiased estimates of their inputs (see
    :func:`debiased_slot_values`)."""
    unit = (np.asarray(reports, dtype=np.float64) - lower) / (upper - lower)
    return lower + (upper - lower) * SQUARE_WAVE.debias(unit, epsilon_report)


def report_view(release) -> tuple[np.ndarray, np.ndarray]:
    """Per slot of a release (or of every partition of a partitioned one, concatenated):
    the raw report covering it and that report's 0-based index in its user's stream.
    This is the row form of a report table that the table front ends return."""
    parts = getattr(release, "parts", (release,))
    reports, index = [], []
    for part in parts:
        slots = report_slots(len(part.values), report_lengths(part))
        reports.append(np.asarray(part.reports)[slots])
        index.append(slots)
    return np.concatenate(reports), np.concatenate(index)


def subsequence_means(stream, starts, stops) -> np.ndarray:
    """Means of ``stream[..., start:stop]`` per subsequence (last axis time; a 2-D array is
    users x slots and gives users x subsequences).

    Examples
    --------
    >>> subsequence_means(np.array([[1.0, 2.0, 3.0], [0.0, 0.0, 6.0]]), [0, 1], [2, 3])
    array([[1.5, 2.5],
           [0. , 3. ]])
    """
    stream = np.asarray(stream, dtype=np.float64)
    starts = np.asarray(starts, dtype=np.int64)
    stops = np.asarray(stops, dtype=np.int64)
    if np.any(stops <= starts) or np.any(starts < 0) or np.any(stops > stream.shape[-1]):
        raise InvalidParameter("subsequences must satisfy 0 <= start < stop <= number of slots")
    cumulative = np.concatenate([np.zeros((*stream.shape[:-1], 1)), np.cumsum(stream, axis=-1)], axis=-1)
    return (cumulative[..., stops] - cumulative[..., starts]) / (stops - starts)


def crowd_distribution(means) -> tuple[np.ndarray, np.ndarray]:
    """Empirical distribution of per-user means: ``(sorted support, CDF at each point)``.

    Examples
    --------
    >>> crowd_distribution([0.3, 0.1, 0.3])
    (array([0.1, 0.3]), array([0.33333333, 1.        ]))
    """
    support, counts = np.unique(np.asarray(means, dtype=np.float64), return_counts=True)
    return support, np.cumsum(counts) / counts.sum()


def subsequence_mean_mse(estimate, truth, starts, stops) -> float:
    """DU's mean MSE: ``(mean(estimate[i:j]) - mean(truth[i:j]))^2`` averaged over subsequences
    (and users for 2-D input)."""
    return float(np.mean((subsequence_means(estimate, starts, stops) - subsequence_means(truth, starts, stops)) ** 2))


def cosine_similarity(estimate, truth) -> np.ndarray:
    """``<u, v> / (|u| |v|)`` along the last axis (what the reference code saves as
    "distribution_result": higher is better)."""
    u = np.asarray(estimate, dtype=np.float64)
    v = np.asarray(truth, dtype=np.float64)
    return (u * v).sum(axis=-1) / (np.linalg.norm(u, axis=-1) * np.linalg.norm(v, axis=-1))


def cosine_distance(estimate, truth) -> np.ndarray:
    """``1 - cosine_similarity`` (the paper's metric: lower is better).

    Examples
    --------
    >>> float(cosine_distance([1.0, 0.0], [1.0, 1.0])).__round__(4)
    0.2929
    """
    return 1.0 - cosine_similarity(estimate, truth)


def wasserstein_1(a, b) -> float:
    """W1 between the empirical distributions of samples ``a`` and ``b``: the integral of
    ``|F - G|`` over the sorted union of support points, weighted by the gaps (the true
    1-D W1; DU leaves the grid unspecified).

    Examples
    --------
    >>> wasserstein_1([0.0, 1.0], [0.5, 1.5])
    0.5
    """
    a = np.sort(np.asarray(a, dtype=np.float64))
    b = np.sort(np.asarray(b, dtype=np.float64))
    grid = np.union1d(a, b)
    f = np.searchsorted(a, grid[:-1], side="right") / len(a)
    g = np.searchsorted(b, grid[:-1], side="right") / len(b)
    return float(np.sum(np.abs(f - g) * np.diff(grid)))
