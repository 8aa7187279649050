"""Server-side linear post-processing of reports and its noise model.

The published stream of every DU method is linear in the reports: reports are
replicated over the slots they cover (``R``), then smoothed by a simple moving average
(``S``). Under deviation feedback the report noise itself passes
through a linear filter ``G`` (see :class:`ReportNoise`).
"""

from __future__ import annotations

import numpy as np

from dpsql import _validate
from dpsql.error_models import ErrorModel
from dpsql.errors import InvalidParameter

ALIGNS = ("trailing", "center")


def check_window(window, align) -> tuple[int, str]:
    """A moving average's validated ``window`` (rows) and ``align``; a centred window is odd."""
    window = _validate.integer(window, "window", minimum=1)
    align = _validate.choice(align, "align", ALIGNS)
    if align == "center" and window % 2 == 0:
        raise InvalidParameter(f"window must be odd (2k+1) with align='center', got {window}")
    return window, align


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

    ``Var(sum_{i<=t<j} values_t) = sum_k c_k^2 Var(xi_k)`` with ``c = G^T R^T S^T 1_[i,j)``.
    A slot's weight in the range is ``1`` wherever every moving-average window that holds
    it lies inside the range, so a report ``k`` of ``L_k`` slots there weighs ``L_k`` and,
    when the next ``len(g)`` reports do too, ``c_k = sum_m g_m L_{k+m}``, the same for
    every range: those terms come from one prefix sum over the stream. Only the reports
    near the range's two ends, within the impulse's length and a window and a report of
    them, are computed one by one, so a range costs ``O(len(g) + window)`` reports
    whatever its length.

    What it covers: the randomiser's own noise, exactly propagated. ``report_variance``
    is the worst case over inputs (Square Wave's variance is largest at the ends of
    [0, 1], smallest at 1/2), so for runs where the feedback input is never clipped the
    true variance lies between this model evaluated at the smallest and at the largest
    per-report variance. Not covered (as for every :class:`ErrorModel`): the bias of raw
    SW reports towards the middle, and the data-dependent effect of clipping the
    feedback input, which makes the filter non-linear.

    Examples
    --------
    >>> model = ReportNoise(report_index=np.repeat(np.arange(4), 2), report_variance=1.0, window=1)
    >>> model.range_variance(np.array([0, 1]), np.array([8, 3])).tolist()  # 4 reports of 2 slots; 1 + 1
    [16.0, 2.0]
    """

    def __init__(self, *, report_index: np.ndarray, report_variance, gain: float = 0.0,
                 memory: int | None = 0, window: int = 1, align: str = "trailing"):
        n = len(report_index)
        self._n = n
        self._starts = np.flatnonzero(np.diff(report_index, prepend=-1))
        self._ends = np.append(self._starts[1:], n)
        reports = len(self._starts)
        self._variance = np.broadcast_to(np.asarray(report_variance, dtype=np.float64), (reports,))
        self._impulse = feedback_impulse(gain, memory, reports)
        self._back, self._ahead = reach(window, align)
        rows = np.arange(n)
        count = np.minimum(rows + self._ahead + 1, n) - np.maximum(rows - self._back, 0)
        self._row_weight = np.concatenate([[0.0], np.cumsum(1.0 / count)])  # prefix sums of 1 / window size
        steady = _correlate(np.diff(np.append(self._starts, n)).astype(np.float64), self._impulse)
        self._steady_energy = np.concatenate([[0.0], np.cumsum(self._variance * steady**2)])

    def range_variance(self, starts, stops):
        starts = np.asarray(starts, dtype=np.int64)
        stops = np.asarray(stops, dtype=np.int64)
        return np.array([self._range(int(i), int(j)) for i, j in zip(starts.ravel(), stops.ravel())],
                        dtype=np.float64).reshape(starts.shape)

    def _range(self, i: int, j: int) -> float:
        if j <= i:
            return 0.0
        back, ahead, taps = self._back, self._ahead, len(self._impulse)
        # Reports whose slots all weigh 1: every window holding them lies in [i, j) and is whole.
        steady_first = int(np.searchsorted(self._starts, max(i, back) + ahead, side="left"))
        steady_stop = int(np.searchsorted(self._ends, min(j, self._n - ahead) - back, side="right"))
        # Reports with a slot of non-zero weight, and those reached from them through G^T.
        first = max(int(np.searchsorted(self._starts, max(i - back, 0), side="right")) - 1 - (taps - 1), 0)
        stop = int(np.searchsorted(self._starts, min(j + ahead, self._n), side="left"))
        middle_stop = steady_stop - taps + 1  # c_k = sum_m g_m L_{k+m} below this
        if middle_stop <= steady_first:
            return self._explicit(i, j, first, stop)
        return (self._explicit(i, j, first, steady_first) + self._explicit(i, j, middle_stop, stop)
                + self._steady_energy[middle_stop] - self._steady_energy[steady_first])

    def _explicit(self, i: int, j: int, first: int, stop: int) -> float:
        """``sum_k Var(xi_k) c_k^2`` over reports ``first .. stop - 1``, each ``c_k`` computed."""
        if stop <= first:
            return 0.0
        reach_stop = min(stop + len(self._impulse) - 1, len(self._starts))
        slot_first, slot_stop = self._starts[first], self._ends[reach_stop - 1]
        t = np.arange(slot_first, slot_stop)
        # a slot's weight: 1 / window size summed over the rows of [i, j) whose windows hold it
        high = np.clip(t + self._back + 1, i, j)
        low = np.clip(t - self._ahead, i, j)
        slot_weight = np.where(high > low, self._row_weight[high] - self._row_weight[low], 0.0)
        report_weight = np.add.reduceat(slot_weight, self._starts[first:reach_stop] - slot_first)
        c = _correlate(report_weight, self._impulse)[:stop - first]
        return float(self._variance[first:stop] @ c**2)


def _correlate(v: np.ndarray, g: np.ndarray) -> np.ndarray:
    """``c_k = sum_m g_m v_{k+m}`` for every ``k`` of ``v`` (``v`` zero beyond its end)."""
    if len(g) == 1:
        return v * g[0]
    size = 1 << int(np.ceil(np.log2(len(v) + len(g))))
    return np.fft.irfft(np.fft.rfft(v[::-1], size) * np.fft.rfft(g, size), size)[:len(v)][::-1]
