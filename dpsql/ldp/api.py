"""Local-DP releases of numpy arrays (and anything array-like), one function per method, and
the device encoder a user's device runs.

Each function validates its arguments and calls :func:`dpsql.publishing.publish`, the single
charging path; the machines behind the names are in :mod:`dpsql.streams.du` and
:mod:`dpsql.streams.topl`. Releases are recorded under their own privacy notions
(``"ldp"``: event-level LDP; ``"w-event-ldp"``: w-event LDP with its window) and are refused
by a ledger scope created for another notion. ``progress=False`` silences the progress bar
that releases expected to take more than two seconds show.

Du et al.'s methods (docs/algorithms.md, "The w-event family") share one signature
``f(values, *, epsilon, w, lower, upper, budget=None, note=None, progress=True, **params)``;
their cost is ``epsilon`` under w-event LDP (neighbours: one user's values in any ``w``
consecutive slots), values outside the public ``[lower, upper]`` are clipped to them, and
the per-report budgets of both accountings are described in :mod:`dpsql.streams.du.plan`.
"""

from __future__ import annotations

import numpy as np

from dpsql import _validate
from dpsql._names import checked_call
from dpsql.budget import Budget
from dpsql.errors import InvalidParameter
from dpsql.methods import machine_for
from dpsql.noise import Draws, Keystream
from dpsql.publishing import publish
from dpsql.release import Release
from dpsql.streams.du.machines import MACHINES, DUStream
from dpsql.streams.du.plan import Plan


class DeviceEncoder:
    """What one user's device runs for a method of Du et al.: push readings, get the reports to send.

    Stateful and online; the budget per report is fixed at construction. Reports are in
    data units (``lower + (upper - lower) * x'``): for the segment methods one report
    per completed segment, for BA-SW one per slot (the value in force). The encoder never
    touches a ledger: the device is the data owner. A trailing partial segment is never
    sent (the collector repeats the last report over it), so the device need not know its
    stream's length.

    ``noise`` is the device's draws: by default a fresh key of its own. Given the draws of
    a release's partition (``keystream.partition(partition_address(user))``), the device
    sends exactly the reports that a release of that partition simulates for the user.

    Examples
    --------
    >>> import dpsql
    >>> with dpsql.testing.seeded(3):
    ...     device = DeviceEncoder("capp", epsilon=1.0, w=10, lower=0.0, upper=100.0)
    ...     reports = np.concatenate([device.push([50.0, 60.0]), device.push([55.0])])
    >>> reports.shape, round(device.epsilon_report, 4)
    ((3,), 0.05)
    """

    def __init__(self, method: str, *, noise: Draws | None = None, **params):
        source = Keystream.fresh().partition() if noise is None else noise
        machine = machine_for(method, None, source, params)
        if not isinstance(machine, DUStream):
            raise InvalidParameter(f"method {method!r} has no device encoder; expected one of {sorted(MACHINES)}")
        self._machine = machine
        self.plan: Plan = machine.plan
        self.epsilon_report = self.plan.epsilon_report

    def push(self, readings) -> np.ndarray:
        data = _validate.values(readings, "readings")
        reports, _ = self._machine.encoder.push(self.plan.to_unit(data)[None, :])
        return self.plan.to_data(reports[0])


@checked_call("dpsql.ldp", method="sw_direct")
def sw_direct(values, *, epsilon: float, w: int, lower: float, upper: float,
              budget: Budget | None = None, note: str | None = None, progress: bool = True, **params) -> Release:
    """Square Wave on every value at ``epsilon / w``; the raw reports are the published stream.

    Cost: ``epsilon`` under w-event LDP (notion ``"w-event-ldp"``, neighbours: one user's
    values in any ``w`` consecutive slots), in both accountings (no feedback). Values are
    clipped to the public ``[lower, upper]``. Parameters: ``accounting``, ``window`` (default 1:
    raw), ``align``.

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> budget = dpsql.Budget.in_memory(epsilon=1.0, notion="w-event-ldp", w=10)
    >>> with dpsql.testing.seeded(0):
    ...     rel = dpsql.ldp.sw_direct(np.full(200, 30.0), epsilon=1.0, w=10, lower=0.0, upper=100.0, budget=budget)
    >>> budget.spent, rel.params["epsilon_report"], len(rel.reports)
    ((1.0, 0.0), 0.1, 200)
    """
    return publish("sw_direct", values, budget=budget, note=note, progress=progress, epsilon=epsilon, w=w,
                   lower=lower, upper=upper, **params)


@checked_call("dpsql.ldp", method="sampling")
def sampling(values, *, epsilon: float, w: int, lower: float, upper: float,
             budget: Budget | None = None, note: str | None = None, progress: bool = True, **params) -> Release:
    """Naive sampling: SW of each segment's mean (segments of ``qlen // n_s`` slots), no feedback.

    Cost: ``epsilon`` under w-event LDP; per report ``epsilon / (ceil((w-1)/L) + 1)`` (strict,
    ``L`` the segment length) or ``epsilon / ceil(w / L)`` (paper). Values are clipped to
    ``[lower, upper]``. Parameters: ``qlen`` (default ``w``), ``n_s`` (default Eq. 12),
    ``accounting``, ``window``, ``align``.

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> with dpsql.testing.seeded(0):
    ...     rel = dpsql.ldp.sampling(np.full(100, 0.5), epsilon=1.0, w=10, lower=0.0, upper=1.0, n_s=5)
    >>> rel.params["segment_length"], len(rel.reports), rel.params["epsilon_report"]
    (2, 50, 0.16666666666666666)
    """
    return publish("sampling", values, budget=budget, note=note, progress=progress, epsilon=epsilon, w=w,
                   lower=lower, upper=upper, **params)


@checked_call("dpsql.ldp", method="ba_sw")
def ba_sw(values, *, epsilon: float, w: int, lower: float, upper: float,
          budget: Budget | None = None, note: str | None = None, progress: bool = True, **params) -> Release:
    """Budget Absorption with Square Wave (Kellaris et al.'s BA, SW instead of Laplace).

    Cost: ``epsilon`` under w-event LDP: ``epsilon / 2`` per window for the dissimilarity
    reports and at most ``epsilon / 2`` for publications (unit ``epsilon / (2w)``), in both
    accountings. Values are clipped to ``[lower, upper]``. ``.reports`` holds the value in
    force at every slot. Parameters: ``accounting``, ``window``, ``align``.

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> with dpsql.testing.seeded(0):
    ...     rel = dpsql.ldp.ba_sw(np.full(300, 0.5), epsilon=1.0, w=5, lower=0.0, upper=1.0)
    >>> rel.components, rel.params["epsilon_unit"]
    ({'dissimilarity': (0.5, 0.0), 'publication': (0.5, 0.0)}, 0.1)
    """
    return publish("ba_sw", values, budget=budget, note=note, progress=progress, epsilon=epsilon, w=w,
                   lower=lower, upper=upper, **params)


@checked_call("dpsql.ldp", method="ipp")
def ipp(values, *, epsilon: float, w: int, lower: float, upper: float,
        budget: Budget | None = None, note: str | None = None, progress: bool = True, **params) -> Release:
    """Iterative Perturbation Parameterization: the last deviation ``x_{t-1} - x'_{t-1}`` is
    added to the next input (memory 1), published with SMA (default window 3, trailing).

    Cost: ``epsilon`` under w-event LDP with ``epsilon_report = epsilon / (w + 1)``
    (strict) or ``epsilon / w`` (paper, seeded test noise only). Values are clipped to
    ``[lower, upper]``. Parameters: ``accounting``, ``window``, ``align``.

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> with dpsql.testing.seeded(0):
    ...     rel = dpsql.ldp.ipp(np.linspace(0, 1, 50), epsilon=2.0, w=3, lower=0.0, upper=1.0)
    >>> rel.params["epsilon_report"], rel.notion
    (0.5, 'w-event-ldp')
    """
    return publish("ipp", values, budget=budget, note=note, progress=progress, epsilon=epsilon, w=w,
                   lower=lower, upper=upper, **params)


@checked_call("dpsql.ldp", method="app")
def app(values, *, epsilon: float, w: int, lower: float, upper: float,
        budget: Budget | None = None, note: str | None = None, progress: bool = True, **params) -> Release:
    """Accumulated Perturbation Parameterization (DU Alg. 1): the sum of the last ``memory``
    deviations is added to each input; published with SMA (window 3, trailing).

    Cost: ``epsilon`` under w-event LDP with ``epsilon_report = epsilon / (w + memory)``
    (strict; ``memory`` defaults to ``w``) or ``epsilon / w`` (paper, seeded test noise
    only; ``memory="unbounded"`` is the paper's H = infinity). Values are clipped to
    ``[lower, upper]``. Parameters: ``memory``, ``accounting``, ``window``, ``align``.

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> with dpsql.testing.seeded(0):
    ...     rel = dpsql.ldp.app(np.full(40, 0.2), epsilon=1.0, w=4, lower=0.0, upper=1.0, memory=6)
    >>> rel.params["epsilon_report"], rel.params["memory"]
    (0.1, 6)
    """
    return publish("app", values, budget=budget, note=note, progress=progress, epsilon=epsilon, w=w,
                   lower=lower, upper=upper, **params)


@checked_call("dpsql.ldp", method="capp")
def capp(values, *, epsilon: float, w: int, lower: float, upper: float,
         budget: Budget | None = None, note: str | None = None, progress: bool = True, **params) -> Release:
    """Clipped APP (DU Alg. 2): APP whose SW frame is set by ``T = e_s - e_d`` (Eq. 11).

    ``bounds_mode``: ``"reference_code"`` (default; the authors' code: reports shrunk onto
    ``[T, 1 - T]``), ``"paper"`` (input clipped to ``[-T, 1 + T]``) or ``"fixed_delta"``
    (``[-clip_delta, 1 + clip_delta]``). Cost: ``epsilon`` under w-event LDP with
    ``epsilon_report = epsilon / (w + memory)`` (strict) or ``epsilon / w`` (paper, seeded
    test noise only). Values are clipped to ``[lower, upper]``. Parameters: ``memory``,
    ``bounds_mode``, ``clip_delta``, ``accounting``, ``window``, ``align``.

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> with dpsql.testing.seeded(0):
    ...     rel = dpsql.ldp.capp(np.full(40, 0.2), epsilon=1.0, w=10, lower=0.0, upper=1.0)
    >>> [round(v, 4) for v in rel.params["clip_range"]]
    [0.0, 1.0, 0.0607, 0.9393]
    """
    return publish("capp", values, budget=budget, note=note, progress=progress, epsilon=epsilon, w=w,
                   lower=lower, upper=upper, **params)


@checked_call("dpsql.ldp", method="pp_s")
def pp_s(values, *, epsilon: float, w: int, lower: float, upper: float,
         budget: Budget | None = None, note: str | None = None, progress: bool = True, **params) -> Release:
    """Perturbation Parameterization with Sampling (DU Alg. 3): IPP/APP/CAPP (``base``,
    default CAPP) over segment means, each report replicated over its segment.

    ``n_s`` samples per query of ``qlen`` slots (default ``w``) by Eq. 12 with the
    sigma^4-corrected Eq. 13 (:func:`choose_ns`, evaluated at ``epsilon / n`` per sample as
    the paper does, in both accountings; the budget actually used per report is
    ``epsilon_report``). Cost: ``epsilon`` under w-event LDP with
    ``epsilon_report = epsilon / (ceil((w-1)/L) + 1 + memory)`` (strict; ``L`` the
    segment length, ``memory`` in reports, default ``n_s``) or ``epsilon / ceil(w/L)``
    (paper, seeded test noise only). Values are clipped to ``[lower, upper]``.
    Parameters: ``base``, ``qlen``, ``n_s``, ``memory``, ``bounds_mode``, ``clip_delta``,
    ``accounting``, ``window``, ``align``.

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> with dpsql.testing.seeded(0):
    ...     rel = dpsql.ldp.pp_s(np.full(60, 0.4), epsilon=1.0, w=6, lower=0.0, upper=1.0, n_s=3)
    >>> rel.params["segment_length"], rel.params["memory"], rel.params["epsilon_report"]  # 1 / (ceil(5/2) + 1 + 3)
    (2, 3, 0.14285714285714285)
    """
    return publish("pp_s", values, budget=budget, note=note, progress=progress, epsilon=epsilon, w=w,
                   lower=lower, upper=upper, **params)


@checked_call("dpsql.ldp")
def topl(values, *, epsilon: float, upper: float, lower: float = 0.0, m: int | None = None,
         threshold_epsilon: float | None = None, r: int | None = None, pruning: str = "paper",
         variance_units: str = "paper", bias_coefficient: str = "paper", budget: Budget | None = None,
         note: str | None = None, progress: bool = True) -> Release:
    """ToPL: every value reported once under local DP; unbiased estimates of the clipped values.

    Simulates the collection: each value's device reports it (:class:`ToplDevice`), the
    server estimates the threshold from the first ``m`` reports and then every later
    value's estimate (module docstring).

    Parameters
    ----------
    values : array-like
        One value per event, in time order; clipped to ``[lower, upper]``.
    epsilon : float
        LDP parameter of each stream report (Hybrid mechanism).
    upper, lower : float
        Public bounds of the values.
    m : int, optional
        Hold-out length; default 4096 (:data:`dpsql.streams.holdout.DEFAULT_HOLDOUT`, fixed:
        no default depends on the stream's length).
    threshold_epsilon : float, optional
        LDP parameter of each hold-out report (Square Wave); default ``epsilon``.
    r : int, optional
        Maximal range length for Eq. 8; default ``2**20``, the paper's.
    pruning : {"paper", "code", "none"}
        SW-W pruning rule; ``"none"`` is the paper's plain-SW baseline. On the retail and
        traffic streams (BENCHMARKS.md, ToPL section) both pruning rules fired inside the
        data's support, because EM without smoothing returns a spiky density, and
        ``"none"`` was never worse and up to several hundred times better in range-sum
        MSE; the paper's rule stays the default as specified.
    variance_units, bias_coefficient : {"paper", "code"}
        Eq. 8 as in the paper (``theta^2/4``, ``r^2/6``) or the reference code (``theta^2``, ``r^2/24``).
    budget : Budget, optional
        An ``"ldp"`` scope; charged ``max(threshold_epsilon, epsilon)`` once through
        :func:`dpsql.publishing.publish`. A central-DP scope refuses the release (NotionMismatch).
    progress : bool
        Show a progress bar when the release is expected to take more than two seconds.

    Returns
    -------
    Release
        Notion ``"ldp"``; ``threshold`` in data units; ``reports`` the raw reports.

    Privacy
    -------
    Event-level ``max(threshold_epsilon, epsilon)``-LDP: each value is perturbed once by an
    LDP randomiser; a value may be replaced by any other in ``[lower, upper]``.

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> budget = dpsql.Budget.in_memory(epsilon=2.0, notion="ldp")
    >>> values = np.tile(np.arange(1.0, 11.0), 2000)
    >>> with dpsql.testing.seeded(4):
    ...     rel = dpsql.ldp.topl(values, epsilon=1.0, upper=20.0, m=5000, budget=budget)
    >>> budget.spent, rel.notion
    ((1.0, 0.0), 'ldp')
    >>> 0 < rel.threshold <= 20.0
    True
    """
    return publish("topl", values, budget=budget, note=note, progress=progress, epsilon=epsilon, upper=upper,
                   lower=lower, m=m, threshold_epsilon=threshold_epsilon, r=r, pruning=pruning,
                   variance_units=variance_units, bias_coefficient=bias_coefficient)


@checked_call("dpsql.ldp")
def pm_direct(values, *, epsilon: float, w: int, lower: float = 0.0, upper: float = 1.0,
              budget: Budget | None = None, note: str | None = None, progress: bool = True) -> Release:
    """Piecewise-mechanism reports of one user's stream at ``epsilon / w`` each (DU's "ToPL" baseline).

    Values are clipped to ``[lower, upper]`` (part of the mechanism). Privacy: w-event
    ``epsilon``-LDP (one user's values may change arbitrarily within any ``w`` consecutive
    slots); ``budget`` must be a ``"w-event-ldp"`` scope with the same ``w`` and is
    charged ``epsilon`` through :func:`dpsql.publishing.publish`.

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> budget = dpsql.Budget.in_memory(epsilon=1.0, notion="w-event-ldp", w=10)
    >>> with dpsql.testing.seeded(2):
    ...     rel = dpsql.ldp.pm_direct(np.full(5000, 0.25), epsilon=1.0, w=10, budget=budget)
    >>> rel.params["epsilon_report"], budget.spent
    (0.1, (1.0, 0.0))
    >>> bool(abs(rel.values.mean() - 0.25) < 4 * rel.range_variance(0, 5000) ** 0.5 / 5000)
    True
    """
    return publish("pm_direct", values, budget=budget, note=note, progress=progress, epsilon=epsilon, w=w,
                   lower=lower, upper=upper)
