"""ToPL (Wang et al., CCS 2021, §4): a stream of single values under event-level local DP,
and DU's ``pm_direct`` baseline. The machines behind :func:`dpsql.ldp.topl` and :func:`dpsql.ldp.pm_direct`.

Each value belongs to one report made by its owner's device; the server only post-processes.

* Hold-out (the first ``m`` values): the device sends a Square Wave report of
  ``(v - lower) / (upper - lower)`` at ``threshold_epsilon``. The server estimates the
  value distribution by EM over those reports (no smoothing step), prunes its upper tail
  (SW-W, :func:`dpsql.mechanisms.ldp.sw_w_prune`) and picks the threshold ``theta`` that
  minimises Eq. 8 (:func:`threshold_objective`). ``theta`` is broadcast to the devices.
* Stream (every later value): the device clips its value to ``[0, theta]`` (after
  subtracting ``lower``), maps it to ``[-1, 1]`` and sends a Hybrid-mechanism report at
  ``epsilon``; the server's estimate ``lower + (y + 1) theta / 2`` is unbiased for the
  clipped value. Range sums add estimates.

Privacy: every value is used by exactly one ``eps``-LDP randomiser (SW at
``threshold_epsilon`` in the hold-out, HM at ``epsilon`` afterwards); the threshold, EM,
pruning and estimates are post-processing of reports. The release is event-level LDP at
``max(threshold_epsilon, epsilon)``: each report, hence each value, is protected
against replacement by any other value in ``[lower, upper]``. Values outside
``[lower, upper]`` are clipped (part of the mechanism, not an error); later values are
also clipped at the private threshold, which biases large values downwards.

Released values: hold-out rows carry the debiased SW estimate
``lower + (upper - lower) * (y - q(1+2b)/2) / (2b(p-q))`` (unbiased for the clipped value;
the paper publishes nothing for them), later rows the HM estimate. ``Release.reports``
holds the raw reports: SW reports on ``[-b, 1+b]`` for rows ``< m``, HM reports on
``[-C, C]`` after. The error model gives per-row noise variances: exact for HM when
``epsilon > 0.61`` (its variance does not depend on the value), otherwise the worst case
over the input domain (SW and SR variances depend on the private value), so range
intervals are conservative there.
"""

from __future__ import annotations

import copy

import numpy as np

from dpsql import _validate
from dpsql.accounting import largest_share
from dpsql.error_models import IndependentNoise
from dpsql.errors import InvalidParameter
from dpsql.mechanisms.ldp import (
    EVENT_LDP_NEIGHBOUR,
    HYBRID,
    PIECEWISE,
    SQUARE_WAVE,
    W_EVENT_LDP_NEIGHBOUR,
    report_uniforms,
    sw_em,
    sw_w_prune,
)
from dpsql.noise import Draws, DrawsBatch, Keystream
from dpsql.release import StreamMachine
from dpsql.streams.holdout import DEFAULT_HOLDOUT

#: The paper's maximal query range ``r`` (Eq. 8), the default.
PAPER_RANGE = 1 << 20
PRUNING_RULES = ("paper", "code", "none")
COMPAT = ("paper", "code")


class ToplDevice:
    """The device side: what one user's device runs on its own readings.

    Until the server broadcasts the threshold (:meth:`set_threshold`) readings are sent as
    Square Wave reports at ``threshold_epsilon``; afterwards as Hybrid-mechanism reports at
    ``epsilon`` of the reading clipped to ``[0, threshold]`` and mapped to ``[-1, 1]``.
    Each report is ``eps``-LDP for the reading it encodes (module docstring).

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> with dpsql.testing.seeded(0) as keys:
    ...     device = ToplDevice(upper=10.0, epsilon=1.0, noise=keys.partition())
    ...     first = device.report(np.array([3.0, 12.0]))   # hold-out: SW reports
    ...     device.set_threshold(4.0)
    ...     later = device.report(np.array([3.0]))           # HM report of 2*3/4 - 1
    >>> bool(np.all(np.abs(later) <= dpsql.mechanisms.ldp.HYBRID.output_range(1.0)[1]))
    True
    """

    def __init__(self, *, upper: float, epsilon: float, lower: float = 0.0, threshold_epsilon: float | None = None,
                 noise: Draws | None = None):
        self.epsilon = _validate.epsilon(epsilon)
        self.threshold_epsilon = self.epsilon if threshold_epsilon is None else _validate.epsilon(
            threshold_epsilon, "threshold_epsilon")
        self.lower, self.upper = _validate.bounds(lower, upper)
        self.threshold: float | None = None
        # the device's own key unless given: report t's uniforms are at index t
        self._noise = Keystream.fresh().partition() if noise is None else noise
        self._reports = 0

    def set_threshold(self, threshold: float) -> None:
        """Receive the server's threshold (in data units above ``lower``; public)."""
        self.threshold = _validate.real(threshold, "threshold", minimum=0.0, strict=True)

    def report(self, values) -> np.ndarray:
        """One report per reading."""
        shifted = np.asarray(values, dtype=np.float64) - self.lower
        randomiser = SQUARE_WAVE if self.threshold is None else HYBRID
        u = report_uniforms(self._noise, self._reports, shifted.size, uniforms=randomiser.uniforms)
        u = u.reshape(*shifted.shape, -1)
        self._reports += shifted.size
        if self.threshold is None:
            return SQUARE_WAVE.perturb(shifted / (self.upper - self.lower), self.threshold_epsilon, u)
        return HYBRID.perturb(2.0 * np.clip(shifted, 0.0, self.threshold) / self.threshold - 1.0, self.epsilon, u)


def threshold_objective(density, *, bound: float, epsilon: float, r: int, variance_units: str = "paper",
                        bias_coefficient: str = "paper") -> tuple[np.ndarray, np.ndarray]:
    """ToPL Eq. 8 over the threshold grid: ``(grid, Err(grid))``.

    ``density`` is the estimated mass of ``N`` equal bins of ``[0, bound]`` (bin centres
    ``t``); the grid is the bins' right edges ``bound (k + 1) / N`` (so ``bound`` itself is a
    candidate and no candidate is 0). ``Err(theta) = (r / 3) Var(theta) + c r^2
    (sum_{t > theta} f_t (t - theta))^2`` with ``Var(theta) = theta^2 / 4 * Var_HM`` (mapping
    ``[0, theta]`` onto HM's ``[-1, 1]``; ``variance_units="code"``: ``theta^2 Var_HM`` as in
    the reference code) and ``c = 1/6`` (paper; ``bias_coefficient="code"``: ``1/24``).
    ``Var_HM`` is the worst-case HM variance at ``epsilon``.

    Examples
    --------
    >>> grid, err = threshold_objective(np.array([0.5, 0.5]), bound=2.0, epsilon=1.0, r=10)
    >>> grid.tolist()
    [1.0, 2.0]
    >>> bool(err[0] == 10 / 3 * 1.0 / 4 * HYBRID.worst_variance(1.0) + 100 / 6 * (0.5 * 0.5) ** 2)
    True
    """
    density = np.asarray(density, dtype=np.float64)
    n_bins = density.size
    grid = bound * np.arange(1, n_bins + 1) / n_bins
    centres = bound * (np.arange(n_bins) + 0.5) / n_bins
    # Bins strictly above candidate k are k+1..N-1: suffix sums starting one bin later.
    mass_above = np.concatenate([np.cumsum(density[::-1])[::-1][1:], [0.0]])
    moment_above = np.concatenate([np.cumsum((density * centres)[::-1])[::-1][1:], [0.0]])
    bias = moment_above - grid * mass_above
    scale = 0.25 if variance_units == "paper" else 1.0
    coefficient = 1.0 / 6.0 if bias_coefficient == "paper" else 1.0 / 24.0
    error = r / 3.0 * scale * grid**2 * HYBRID.worst_variance(epsilon) + coefficient * r**2 * bias**2
    return grid, error


def estimate_threshold(sw_reports, *, bound: float, threshold_epsilon: float, epsilon: float, r: int,
                       pruning: str = "paper", variance_units: str = "paper", bias_coefficient: str = "paper",
                       n_bins: int = 1024) -> float:
    """The server's threshold from hold-out SW reports: EM, SW-W pruning, argmin of Eq. 8.

    ``pruning="none"`` is the paper's "SW" baseline (EM without pruning). Post-processing
    of the reports: costs nothing beyond the reports themselves.

    Examples
    --------
    >>> import dpsql
    >>> from dpsql.mechanisms.ldp import report_uniforms
    >>> with dpsql.testing.seeded(1) as keys:
    ...     reports = SQUARE_WAVE.perturb(np.full(20_000, 0.25), 2.0, report_uniforms(keys.partition(), 0, 20_000))
    >>> theta = estimate_threshold(reports, bound=100.0, threshold_epsilon=2.0, epsilon=1.0, r=10_000, n_bins=128)
    >>> 20.0 <= theta <= 30.0
    True
    """
    density = sw_em(sw_reports, threshold_epsilon, n_out=n_bins, n_in=n_bins)
    if pruning != "none":
        density = sw_w_prune(density, rule=pruning)
    grid, error = threshold_objective(density, bound=bound, epsilon=epsilon, r=r, variance_units=variance_units,
                                      bias_coefficient=bias_coefficient)
    return float(grid[np.argmin(error)])


def estimate_holdout(sw_reports, *, bound: float, threshold_epsilon: float) -> np.ndarray:
    """Unbiased estimates (above ``lower``) of the clipped hold-out values from their SW reports.

    Examples
    --------
    >>> b, p, q = SQUARE_WAVE.constants(1.0)
    >>> float(estimate_holdout(np.array([q * (1 + 2 * b) / 2]), bound=10.0, threshold_epsilon=1.0)[0])
    0.0
    """
    return bound * SQUARE_WAVE.debias(sw_reports, threshold_epsilon)


def estimate_stream(hm_reports, *, threshold: float) -> np.ndarray:
    """Unbiased estimates (above ``lower``) of the values clipped at ``threshold`` from their HM reports.

    Examples
    --------
    >>> estimate_stream(np.array([-1.0, 0.0, 1.0]), threshold=4.0).tolist()
    [0.0, 2.0, 4.0]
    """
    return (np.asarray(hm_reports, dtype=np.float64) + 1.0) * threshold / 2.0


class ToplStream(StreamMachine):
    """ToPL as an online machine: the device (:class:`ToplDevice`) and the server
    (:func:`estimate_threshold`, :func:`estimate_holdout`, :func:`estimate_stream`) in one
    loop, so a whole collection can be simulated and published in one call.

    Every row is released as soon as it is read. ``r`` defaults to ``2**20``, the paper's
    maximal query range, and ``m`` to 4096 (:data:`dpsql.streams.holdout.DEFAULT_HOLDOUT`):
    fixed, not derived from the length.
    """

    notion = "ldp"
    neighbour = EVENT_LDP_NEIGHBOUR

    def __init__(self, n: int | None = None, *, epsilon: float, upper: float, lower: float = 0.0,
                 m: int | None = None, threshold_epsilon: float | None = None, r: int | None = None,
                 pruning: str = "paper", variance_units: str = "paper", bias_coefficient: str = "paper",
                 noise: Draws):
        self.m = DEFAULT_HOLDOUT if m is None else _validate.integer(m, "m", minimum=1)
        if n is not None and self.m >= n:
            raise InvalidParameter(f"m (hold-out length) must be < the number of values ({n}), got m={self.m}")
        self.r = PAPER_RANGE if r is None else _validate.integer(r, "r", minimum=1)
        self.pruning = _validate.choice(pruning, "pruning", PRUNING_RULES)
        self.variance_units = _validate.choice(variance_units, "variance_units", COMPAT)
        self.bias_coefficient = _validate.choice(bias_coefficient, "bias_coefficient", COMPAT)
        self._device = ToplDevice(upper=upper, lower=lower, epsilon=epsilon, threshold_epsilon=threshold_epsilon,
                                  noise=noise)
        self.cost = (max(self._device.epsilon, self._device.threshold_epsilon), 0.0)
        self._reports: list[np.ndarray] = []
        self._rows = 0

    @property
    def _bound(self) -> float:
        return self._device.upper - self._device.lower

    def feed(self, chunk: np.ndarray) -> np.ndarray:
        holdout_rows = max(0, min(len(chunk), self.m - self._rows))
        outputs = []
        if holdout_rows:
            reports = self._device.report(chunk[:holdout_rows])
            self._reports.append(reports)
            outputs.append(estimate_holdout(reports, bound=self._bound,
                                            threshold_epsilon=self._device.threshold_epsilon))
            self._rows += holdout_rows
            if self._rows == self.m:
                self._device.set_threshold(self._server_threshold())
        if holdout_rows < len(chunk):
            reports = self._device.report(chunk[holdout_rows:])
            self._reports.append(reports)
            outputs.append(estimate_stream(reports, threshold=self._device.threshold))
            self._rows += len(reports)
        return np.concatenate(outputs) + self._device.lower if outputs else np.empty(0)

    def _server_threshold(self) -> float:
        return estimate_threshold(np.concatenate(self._reports), bound=self._bound,
                                  threshold_epsilon=self._device.threshold_epsilon, epsilon=self._device.epsilon,
                                  r=self.r, pruning=self.pruning, variance_units=self.variance_units,
                                  bias_coefficient=self.bias_coefficient)

    def close(self) -> np.ndarray:
        return np.empty(0)

    def row_variances(self) -> np.ndarray:
        """Per-row noise variance of the released estimates (see the module docstring)."""
        device = self._device
        holdout = self._bound**2 * float(SQUARE_WAVE.debiased_variance(1.0, device.threshold_epsilon))
        stream = (device.threshold / 2.0) ** 2 * HYBRID.worst_variance(device.epsilon)
        return np.where(np.arange(self._rows) < self.m, holdout, stream)

    def describe(self) -> dict:
        device = self._device
        params = {"epsilon": device.epsilon, "threshold_epsilon": device.threshold_epsilon, "lower": device.lower,
                  "upper": device.upper, "m": self.m, "r": self.r, "pruning": self.pruning,
                  "variance_units": self.variance_units, "bias_coefficient": self.bias_coefficient}
        return dict(method="topl", params=params, threshold=device.threshold + device.lower,
                    error=IndependentNoise(self.row_variances(), self._rows, excess_kurtosis=max(
                        SQUARE_WAVE.worst_excess_kurtosis(device.threshold_epsilon),
                        HYBRID.worst_excess_kurtosis(device.epsilon))),
                    components={"threshold": (device.threshold_epsilon, 0.0), "stream": (device.epsilon, 0.0)},
                    reports=np.concatenate(self._reports))


class PmDirectStream(StreamMachine):
    """The reference DU code's "ToPL" baseline, named ``pm_direct`` (docs/algorithms.md, "pm_direct"):
    every slot of one user's stream reported once by the Piecewise mechanism at ``epsilon / w``.

    The value is mapped from ``[lower, upper]`` to ``[-1, 1]``; the published value
    ``lower + (upper - lower) (y + 1) / 2`` is unbiased for the clipped value. No threshold
    phase, no feedback: any window of ``w`` slots holds ``w`` reports at ``epsilon / w``, so
    the stream is w-event ``epsilon``-LDP. Per-row variances in the error model are the
    worst case over the input domain (PM's variance grows with ``|x|``).
    """

    notion = "w-event-ldp"
    neighbour = W_EVENT_LDP_NEIGHBOUR
    batchable = True

    def __init__(self, n: int | None = None, *, epsilon: float, w: int, lower: float = 0.0, upper: float = 1.0,
                 noise: Draws):
        self.epsilon = _validate.epsilon(epsilon)
        self.w = _validate.integer(w, "w", minimum=1)
        self.lower, self.upper = _validate.bounds(lower, upper)
        self.epsilon_report = largest_share(self.epsilon, self.epsilon / self.w, count=self.w)
        self.cost = (self.epsilon, 0.0)
        self._start(DrawsBatch([noise]))

    def batched(self, draws: DrawsBatch) -> PmDirectStream:
        """This machine for ``len(draws)`` users of its length, fed ``(users, rows)`` chunks."""
        machine = copy.copy(self)
        machine._start(draws)
        return machine

    def _start(self, draws: DrawsBatch) -> None:
        self._draws = draws
        self._reports: list[np.ndarray] = []
        self._rows = 0
        self._lead: tuple = ()

    def feed(self, chunk: np.ndarray) -> np.ndarray:
        self._lead = chunk.shape[:-1]
        rows = chunk.reshape(len(self._draws), -1)
        scale = self.upper - self.lower
        u = report_uniforms(self._draws, self._rows, rows.shape[1], uniforms=PIECEWISE.uniforms)
        self._rows += rows.shape[1]
        reports = PIECEWISE.perturb(2.0 * (rows - self.lower) / scale - 1.0, self.epsilon_report, u)
        self._reports.append(reports)
        return (self.lower + scale * (reports + 1.0) / 2.0).reshape(chunk.shape)

    def close(self) -> np.ndarray:
        return np.empty((*self._lead, 0))

    def describe(self) -> dict:
        return self.describe_partition(0)

    def describe_partition(self, partition: int) -> dict:
        if len(self._reports) != 1:  # concatenated once for all users
            self._reports = [np.concatenate(self._reports, axis=1)]
        params = {"epsilon": self.epsilon, "w": self.w, "lower": self.lower, "upper": self.upper,
                  "epsilon_report": self.epsilon_report}
        row_variance = ((self.upper - self.lower) / 2.0) ** 2 * PIECEWISE.worst_variance(self.epsilon_report)
        kurtosis = PIECEWISE.worst_excess_kurtosis(self.epsilon_report)
        return dict(method="pm_direct", params=params,
                    error=IndependentNoise(row_variance, self._rows, excess_kurtosis=kurtosis),
                    components={"reports": (self.epsilon, 0.0)}, reports=self._reports[0][partition])
