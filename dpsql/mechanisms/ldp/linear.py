"""Server-side linear post-processing of reports and its noise model.

The published stream of every DU method is linear in the reports: reports are
replicated over the slots they cover (``R``), then smoothed by a simple moving average
(``S``, ALGORITHMS.md P13). Under deviation feedback the report noise itself passes
through a linear filter ``G`` (see :class:`ReportNoise`).
"""

from __future__ import annotations

import numpy as np

from dpsql.release import ErrorModel

ALIGNS = ("trailing", "center")


def reach(window: int, align: str) -> tuple[int, int]:
    """Slots before and after a row that its moving average covers."""
    return (window - 1, 0) if align == "trailing" else (window // 2, window // 2)


def moving_average(x: np.ndarray, window: int, align: str, start: int = 0, stop: int | None = None, *,
                   first: int = 0, length: int | None = None) -> np.ndarray:
    """Rows ``start:stop`` of the simple moving average of a stream (post-processing).

    ``align="trailing"``: mean of the last ``window`` values (DU reference code,
    ``movmean(x, [W-1 0], 'shrink')``), causal. ``align="center"``: mean of the ``window``
    values centred on the row (paper, ``window = 2k + 1``). Windows shrink at both ends
    of the stream, so neither variant is exactly sum-preserving there.

    ``x`` holds the stream's rows ``first ..`` (along its last axis, one stream per row of a
    2-D ``x``): all of it by default, or, for a stream released piece by piece, the rows the
    requested windows reach. ``length`` is the stream's length where it is known (windows
    shrink there); by default ``first + x.shape[-1]``. Each output is its window's values
    added in time order, then divided: a function of the window alone, so a stream cut
    into pieces gets the very same outputs.

    Examples
    --------
    >>> moving_average(np.array([3.0, 6.0, 9.0, 0.0]), 3, "trailing")
    array([3. , 4.5, 6. , 5. ])
    >>> moving_average(np.array([3.0, 6.0, 9.0, 0.0]), 3, "center")
    array([4.5, 6. , 5. , 4.5])
    >>> moving_average(np.array([6.0, 9.0, 0.0]), 3, "center", 2, 4, first=1, length=4)
    array([5. , 4.5])
    """
    x = np.asarray(x, dtype=np.float64)
    end = first + x.shape[-1]
    length = end if length is None else length
    stop = length if stop is None else stop
    back, ahead = reach(window, align)
    lo, hi = start - back, stop + ahead  # the rows the windows reach; zeros beyond the stream add nothing
    if max(lo, 0) < first or min(hi, length) > end:
        raise ValueError(f"rows {start}:{stop} need stream rows {max(lo, 0)}:{min(hi, length)}, "
                         f"x holds {first}:{end}")
    pad = [(0, 0)] * (x.ndim - 1) + [(max(0, -lo), max(0, hi - length))]
    values = np.pad(x[..., max(lo, 0) - first:min(hi, length) - first], pad)
    rows = stop - start
    total = values[..., :rows].copy()
    for k in range(1, window):
        total += values[..., k:k + rows]
    positions = np.arange(start, stop)
    return total / (np.minimum(positions + ahead + 1, length) - np.maximum(positions - back, 0))


def _moving_average_transpose(e: np.ndarray, window: int, align: str) -> np.ndarray:
    """``S^T e`` row-wise: how much each slot's raw value weighs in ``sum_r e_r * SMA_r``."""
    n = e.shape[1]
    back, ahead = reach(window, align)
    rows = np.arange(n)
    count = np.minimum(rows + ahead + 1, n) - np.maximum(rows - back, 0)
    cumulative = np.concatenate([np.zeros((e.shape[0], 1)), np.cumsum(e / count, axis=1)], axis=1)
    return cumulative[:, np.minimum(rows + back + 1, n)] - cumulative[:, np.maximum(rows - ahead, 0)]


def feedback_impulse(gain: float, memory: int | None, length: int) -> np.ndarray:
    """Impulse response ``g`` of report noise under deviation feedback.

    Without clipping, the noise ``eta`` of the reports solves
    ``eta_k + gain * sum_{h=1..memory} eta_{k-h} = xi_k`` (``xi`` the fresh randomiser
    noise), so ``eta = G xi`` with ``G`` lower-triangular Toeplitz of first column
    ``g``. The filter is stable for ``0 <= gain < 1`` (its poles lie strictly inside the
    unit circle, Eneström-Kakeya), so ``g`` is cut once ``memory`` consecutive terms are
    below 1e-14 (``g_0 = 1``): what follows is the response of a negligible state.
    The window sum is recomputed at every step rather than updated by add-and-drop,
    whose rounding error would persist (that form has a pole at 1).
    """
    if memory == 0 or gain == 0.0:
        return np.ones(1)
    g = np.zeros(length)
    g[0] = 1.0
    total = 0.0
    quiet = 0
    span = memory or 1
    for k in range(1, length):  # sequential recursion, cut early (typically a few hundred terms)
        if memory is None:
            total += g[k - 1]
            g[k] = -gain * total
        else:
            g[k] = -gain * g[max(0, k - memory):k].sum()
        quiet = quiet + 1 if abs(g[k]) < 1e-14 else 0
        if quiet > span:
            return g[:k + 1]
    return g


class ReportNoise(ErrorModel):
    """Noise of range sums of ``S R G xi``: fresh per-report noise ``xi`` (independent,
    variance ``report_variance``), the feedback filter ``G`` (:func:`feedback_impulse`),
    replication over each report's slots ``R`` and the moving average ``S``.

    ``Var(sum_{i<=t<j} values_t) = sum_k c_k^2 Var(xi_k)`` with ``c = G^T R^T S^T 1_[i,j)``,
    computed with FFTs, blocks of queries at a time.

    What it covers: the randomiser's own noise, exactly propagated. ``report_variance``
    is the worst case over inputs (Square Wave's variance is largest at the ends of
    [0, 1], smallest at 1/2), so for runs where the feedback input is never clipped the
    true variance lies between this model evaluated at the smallest and at the largest
    per-report variance. Not covered (as for every :class:`ErrorModel`): the bias of raw
    SW reports towards the middle, and the data-dependent effect of clipping the
    feedback input, which makes the filter non-linear.
    """

    def __init__(self, *, report_index: np.ndarray, report_variance, gain: float = 0.0,
                 memory: int | None = 0, window: int = 1, align: str = "trailing"):
        self._n = len(report_index)
        self._report_starts = np.flatnonzero(np.diff(report_index, prepend=-1))
        reports = len(self._report_starts)
        self._variance = np.broadcast_to(np.asarray(report_variance, dtype=np.float64), (reports,))
        self._impulse = feedback_impulse(gain, memory, reports)
        self._window, self._align = window, align

    def range_variance(self, starts, stops):
        starts = np.asarray(starts, dtype=np.int64)
        stops = np.asarray(stops, dtype=np.int64)
        out = np.empty(starts.shape, dtype=np.float64)
        block = max(1, (1 << 22) // max(self._n, 1))
        for first in range(0, len(starts), block):
            out[first:first + block] = self._block(starts[first:first + block], stops[first:first + block])
        return out

    def _block(self, starts, stops):
        rows = np.arange(len(starts))
        indicator = np.zeros((len(starts), self._n + 1))
        np.add.at(indicator, (rows, starts), 1.0)
        np.add.at(indicator, (rows, stops), -1.0)
        slot_weight = np.cumsum(indicator[:, :-1], axis=1)
        if self._window > 1:
            slot_weight = _moving_average_transpose(slot_weight, self._window, self._align)
        report_weight = np.add.reduceat(slot_weight, self._report_starts, axis=1)
        if len(self._impulse) > 1:
            report_weight = self._through_feedback(report_weight)
        return (report_weight**2 * self._variance).sum(axis=1)

    def _through_feedback(self, v: np.ndarray) -> np.ndarray:
        """``G^T v`` row-wise: ``c_s = sum_{k >= s} g_{k-s} v_k`` (a correlation)."""
        reports = v.shape[1]
        size = 1 << int(np.ceil(np.log2(reports + len(self._impulse))))
        spectrum = np.fft.rfft(v[:, ::-1], size, axis=1) * np.fft.rfft(self._impulse, size)
        return np.fft.irfft(spectrum, size, axis=1)[:, :reports][:, ::-1]
