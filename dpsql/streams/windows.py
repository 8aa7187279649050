"""Window sums of a count release, re-smoothed with what is known at the window's end.

Everything here is post-processing of a count release: it reads the released estimates,
the Perturber's noisy counts (public, part of what the release's ``epsilon`` pays for) and
the released partition, never the data, so it costs no budget. A window sum at ``t`` may
use every noisy count released up to ``t``, including rows released after the window's
first row: PeGaSus's event monitoring (Chen et al., CCS 2017, section on event monitoring)
replaces each row of a window by the mean of its group's noisy counts as known at ``t``,
which is better than the sum of the per-step estimates each made with less. See
docs/algorithms.md, "Counts of events".
"""

from __future__ import annotations

import numpy as np

from dpsql import _validate
from dpsql.errors import InvalidParameter
from dpsql.mechanisms import LaplaceLattice
from dpsql.release import Release
from dpsql.streams.smoothing import (
    BATCH,
    GAUSS_Z,
    LAPLACE_Z,
    LEVELS,
    AdaptiveSmoother,
    ewm_state,
    level_weights,
    risks_before,
)


def group_windows(noisy: np.ndarray, resets: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray]:
    """PeGaSus's re-smoothed window sums (Chen et al., CCS 2017): the window ending at ``t``
    sums every row replaced by the mean of its group's noisy counts as known at ``t`` (the
    group's rows up to ``t``, including rows after the one replaced). Returns the sums and
    their noise variances in units of one noisy count's variance (``sum_g k_g^2 / known_g``
    for the ``k_g`` rows of group ``g`` in the window, ``known_g`` of its rows known at ``t``).

    >>> noisy = np.array([1.0, 3.0, 5.0, 7.0]); starts = np.array([True, False, True, False])
    >>> sums, units = group_windows(noisy, starts, 3)
    >>> sums.tolist(), units.tolist()
    ([1.0, 4.0, 9.0, 14.0], [1.0, 2.0, 3.0, 2.5])
    """
    n = len(noisy)
    cumulative = np.concatenate([[0.0], np.cumsum(noisy)])
    starts = np.flatnonzero(resets | (np.arange(n) == 0))
    ends = np.append(starts[1:], n)
    group = np.repeat(np.arange(len(starts)), ends - starts)
    t = np.arange(n)
    first = np.maximum(t - window + 1, 0)
    sums, units = np.zeros(n), np.zeros(n)
    for back in range(int((group - group[first]).max()) + 1 if n else 0):  # groups in a window, newest first
        g = group - back
        inside = g >= group[first]
        g = np.where(inside, g, 0)
        known_end = np.minimum(ends[g], t + 1)
        known = known_end - starts[g]
        rows = known_end - np.maximum(starts[g], first)
        mean = (cumulative[known_end] - cumulative[starts[g]]) / known
        sums += np.where(inside, rows * mean, 0.0)
        units += np.where(inside, rows * rows / known, 0.0)
    return sums, units


def resmoothed_windows(noisy: np.ndarray, variance: float, window: int, resets: np.ndarray | None = None, *,
                       groups: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Window sums ``sum(c[t-window+1 .. t])`` for every ``t``, re-smoothed from the noisy counts
    known at ``t`` (post-processing), and their noise variances (a plug-in, as
    :class:`AdaptiveNoise`).

    Candidates, each linear in the noisy counts ``y``: the raw sum ``Y_t`` of the window's
    noisy counts; each level's mean at ``t`` times the window's rows (every row re-estimated
    by the level known at ``t``), of the adaptive smoother over the whole stream and, with
    ``resets`` (PeGaSus's groups), of the one restarted at them; with ``groups``, PeGaSus's
    group re-smoothing (:func:`group_windows`). For a candidate ``T`` putting total weight ``A``
    on the window's rows, ``(T - Y)^2 - w sigma2 + 2 sigma2 A`` is an unbiased estimate of its
    squared error (C_p, as for single rows); averaged over past windows, the admissible
    candidate of least risk after shrinkage toward ``Y`` is taken, with risks known before ``t``.
    """
    noisy = np.asarray(noisy, dtype=np.float64)
    n = len(noisy)
    s2 = float(variance)
    cumulative = np.concatenate([[0.0], np.cumsum(noisy)])
    rows = np.minimum(np.arange(1, n + 1), window).astype(np.float64)
    raw = cumulative[1:] - cumulative[np.maximum(np.arange(1, n + 1) - window, 0)]
    group_sums, group_units = group_windows(noisy, resets, window) if groups else (None, None)
    # (smoother, its restarts): the whole stream's, and the groups' where there are groups
    smoothers = [(AdaptiveSmoother(s2), None)] + ([] if resets is None else [(AdaptiveSmoother(s2), resets)])
    candidates = 1 + LEVELS * len(smoothers) + (1 if groups else 0)
    risk_state = ewm_state(1, candidates - 1)
    risk_before = np.full((1, candidates - 1), np.inf)
    sums, variances = np.empty(n), np.empty(n)
    for lo in range(0, n, BATCH):
        hi = min(n, lo + BATCH)
        m, w = hi - lo, rows[lo:hi]
        total, weight, units = np.empty((candidates, m)), np.empty((candidates, m)), np.empty((candidates, m))
        ok = np.ones((candidates, m), dtype=bool)
        total[0], weight[0], units[0] = raw[lo:hi], w, w
        for first, (smoother, restarts) in zip(range(1, candidates, LEVELS), smoothers):
            out = smoother.feed(noisy[None, lo:hi], None if restarts is None else restarts[None, lo:hi],
                                internals=True)
            length, means, v, admissible = out.length[0], out.means[0], out.v[0], out.admissible[0]
            covered = np.minimum(w.astype(np.int64), length)
            for k in range(1, LEVELS + 1):
                c = first + k - 1
                total[c] = w * means[k]
                # the level's weights on the window's rows, times its rows
                weight[c] = w * level_weights(k, length)[0] / level_weights(k, covered)[0]
                units[c] = w * w * v[k]
                ok[c] = admissible[k]
        if groups:
            total[-1], weight[-1], units[-1] = group_sums[lo:hi], group_units[lo:hi], group_units[lo:hi]
        # each candidate must agree with the raw sum (the window-level guard)
        spread = np.sqrt(np.maximum(units[1:] + w - 2.0 * weight[1:], 0.0) * s2)
        ok[1:] &= np.abs(total[1:] - raw[lo:hi]) <= np.maximum(GAUSS_Z * spread, LAPLACE_Z * np.sqrt(s2))
        terms = (total[1:] - raw[lo:hi]) ** 2 - s2 * w + 2.0 * s2 * weight[1:]
        before, risk_before = risks_before(terms[None], risk_state, risk_before)
        before = before[0]
        best, choice = s2 * w, np.zeros(m, dtype=np.intp)
        lam = np.zeros((candidates, m))
        for c in range(1, candidates):
            gain = s2 * (w - weight[c])
            spread2 = before[c - 1] + s2 * w - 2.0 * s2 * weight[c]
            full = gain >= spread2
            with np.errstate(invalid="ignore", divide="ignore"):
                lam[c] = np.where(full, 1.0, np.maximum(gain, 0.0) / spread2)
                shrunk = np.where(full, before[c - 1], s2 * w - np.maximum(gain, 0.0) ** 2 / spread2)
            better = ok[c] & (shrunk < best)
            best = np.where(better, shrunk, best)
            choice[better] = c
        pick = choice[None]
        lam_c = np.take_along_axis(lam, pick, axis=0)[0]
        total_c = np.take_along_axis(total, pick, axis=0)[0]
        weight_c = np.take_along_axis(weight, pick, axis=0)[0]
        units_c = np.take_along_axis(units, pick, axis=0)[0]
        sums[lo:hi] = raw[lo:hi] + lam_c * (total_c - raw[lo:hi])
        variances[lo:hi] = s2 * ((1 - lam_c) ** 2 * w + 2 * lam_c * (1 - lam_c) * weight_c + lam_c**2 * units_c)
    return sums, variances


#: How :func:`window_sums` forms a window's sum.
WINDOW_SMOOTHERS = ("adaptive", "group", "none")
#: Count methods that smooth and keep their noisy counts (``Release.reports``): their window
#: sums are re-smoothed by default. ``count_laplace``, the baseline, sums its values unless asked.
SMOOTHED_METHODS = ("pegasus", "count_smoothed")


def window_sums(release: Release, *, window: int, smoother: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Sliding-window sums ``sum(c[t-window+1 .. t])`` of a count release and their noise
    variances, for every row ``t`` (windows shrink at the start of the stream).

    Post-processing of released values: free, no budget. ``smoother``:

    * ``"none"``: the sum of the released estimates over the window, with the variance the
      release's error model gives;
    * ``"group"`` (PeGaSus releases): Chen et al.'s re-smoothing, every row of the window
      replaced by the mean of its group's noisy counts as known at ``t`` (the partition at
      ``t``: a group that has grown since the row was released gives it a longer average);
    * ``"adaptive"`` (default for ``pegasus`` and ``count_smoothed`` releases that carry their
      noisy counts; ``count_laplace``, the baseline, defaults to ``"none"``): the sum re-smoothed from the
      noisy counts known at ``t``, choosing between the raw sum, every level of the adaptive
      smoother known at ``t`` and, for PeGaSus, the group re-smoothing, by the C_p risk of
      past windows (:func:`resmoothed_windows`). The variances are
      then a plug-in given the choices.

    The noisy counts are the Perturber's output (``Release.reports`` of ``pegasus`` and
    ``count_smoothed``, the values of ``count_laplace``): public, part of what the release's
    ``epsilon`` pays for. A release rebuilt from a ledger record (an answer-cache hit, a
    continual stream's rows) finds them in its error model (``error.noisy``); one whose
    record predates them (a PeGaSus stream registered under the legacy defaults) sums its
    values (``"none"``) and refuses the others with :class:`~dpsql.InvalidParameter`.

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> with dpsql.testing.seeded(2) as keys:
    ...     rel = dpsql.methods.run("pegasus", np.full(100, 10.0), noise=keys, epsilon=1.0, smoother="average")
    >>> sums, variances = window_sums(rel, window=24)
    >>> sums.shape, bool(abs(sums[-1] - 240.0) < 4 * variances[-1] ** 0.5)
    ((100,), True)
    """
    window = _validate.integer(window, "window", minimum=1)
    noisy = _noisy_counts(release)
    if smoother is None:
        smoother = "adaptive" if noisy is not None and release.method in SMOOTHED_METHODS else "none"
    smoother = _validate.choice(smoother, "smoother", WINDOW_SMOOTHERS)
    if smoother == "none":
        stop = np.arange(1, len(release) + 1)
        start = np.maximum(stop - window, 0)
        return release.range_sum(start, stop), release.range_variance(start, stop)
    if noisy is None:
        raise InvalidParameter(f"smoother={smoother!r} re-smooths window sums from the noisy counts, which this "
                               f"release ({release.method}) does not carry; use smoother='none'")
    grouped = release.method == "pegasus"
    if smoother == "group" and not grouped:
        raise InvalidParameter("smoother='group' re-smooths with PeGaSus's groups; this release has none "
                               "(use 'adaptive' or 'none')")
    variance, resets = _noise_variance(release), None
    if grouped:
        resets = np.zeros(len(noisy), dtype=bool)
        resets[release.error.starts[release.error.starts < len(noisy)]] = True
    if smoother == "group":
        sums, units = group_windows(noisy, resets, window)
        return sums, variance * units
    return resmoothed_windows(noisy, variance, window, resets, groups=grouped)


def _noisy_counts(release: Release) -> np.ndarray | None:
    """The Perturber's noisy counts of a count release (public), or None where unknown."""
    if release.method == "count_laplace":  # its values are the noisy counts
        return np.asarray(release.values, dtype=np.float64)
    if release.method not in SMOOTHED_METHODS:
        return None
    noisy = release.reports
    if noisy is None:  # a release rebuilt from its ledger record: its error model keeps them
        noisy = getattr(release.error, "noisy", None)
    if noisy is None or len(noisy) != len(release):
        return None
    return np.asarray(noisy, dtype=np.float64)


def _noise_variance(release: Release) -> float:
    """The variance of one noisy count, from the release's public parameters."""
    p = release.params
    epsilon = p["eps_p"] if release.method == "pegasus" else p["epsilon"]
    return LaplaceLattice(float(p.get("sensitivity", 1.0)), float(epsilon)).variance


def window_alarms(release: Release, *, window: int, threshold: float, smoother: str | None = None) -> np.ndarray:
    """Event monitoring: ``True`` at row ``t`` when the private window sum ending at ``t``
    (:func:`window_sums`, with ``smoother``) is at least ``threshold`` (Chen et al.'s event
    monitoring; post-processing, free).

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> counts = np.r_[np.zeros(50), np.full(50, 40.0)]
    >>> with dpsql.testing.seeded(4) as keys:
    ...     rel = dpsql.methods.run("pegasus", counts, noise=keys, epsilon=1.0)
    >>> alarms = window_alarms(rel, window=5, threshold=100.0)
    >>> bool(alarms[:45].any()), bool(alarms[60:].all())
    (False, True)
    """
    threshold = _validate.real(threshold, "threshold")
    return window_sums(release, window=window, smoother=smoother)[0] >= threshold
