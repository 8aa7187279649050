"""Private releases of numpy arrays (and anything array-like), one function per method.

Each function validates its arguments and calls :func:`dpsql.publishing.publish`, the single
charging path; see :mod:`dpsql.methods` for the algorithms behind the names. A misspelt,
old, missing or surplus argument is an :class:`dpsql.InvalidParameter` naming the closest
valid name, as in SQL and Polars (:func:`dpsql._frontend.checked_call`), before anything is
read or charged.
"""

from __future__ import annotations

from dpsql._frontend import THRESHOLD_ESTIMATOR, checked_call
from dpsql.budget import Budget
from dpsql.publishing import publish
from dpsql.release import Release


@checked_call()
def laplace(values, *, epsilon: float, upper: float, lower: float = 0.0, budget: Budget | None = None,
            note: str | None = None, fresh: bool = False) -> Release:
    """Per-value Laplace baseline: every value clipped to ``[lower, upper]`` plus
    Laplace noise of scale ``(upper - lower) / epsilon``.

    Cost: ``epsilon``-DP, replace-one-value neighbours. Values outside the public
    bounds are clipped to them; that is part of the mechanism, not an error.

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> budget = dpsql.Budget.in_memory(epsilon=1.0)
    >>> with dpsql.testing.seeded(0):
    ...     rel = dpsql.laplace(np.full(1000, 5.0), epsilon=0.5, upper=10.0, budget=budget)
    >>> budget.spent
    (0.5, 0.0)
    >>> abs(rel.range_sum(0, 1000) - 5000.0) < 4 * rel.range_variance(0, 1000) ** 0.5
    True
    """
    return publish("laplace", values, budget=budget, note=note, fresh=fresh, epsilon=epsilon, upper=upper,
                   lower=lower)


@checked_call()
def binary_tree(values, *, epsilon: float, upper: float, lower: float = 0.0, horizon: int | None = None,
                budget: Budget | None = None, note: str | None = None, fresh: bool = False) -> Release:
    """Binary-tree continual counter (Dwork et al. 2010, Chan et al. 2011) for real values.

    With ``horizon=H``: ``L = ceil(log2 H)`` levels of dyadic nodes, each with Laplace noise
    for sensitivity ``upper - lower`` at ``epsilon / L``, and at most ``H`` rows. Without
    (the default), the unbounded hybrid counter of Chan, Shi and Song: epochs of doubling
    length, each epoch's total at ``epsilon / 2`` and a tree inside it at ``epsilon / 2``
    (see :mod:`dpsql.streams.binary_tree`). Row ``i`` is released as the difference of
    consecutive noisy prefix sums, so ``range_sum(i, j)`` is the difference of two noisy
    prefixes.

    Cost: ``epsilon``-DP, replace-one-value neighbours (time order public). Values
    outside ``[lower, upper]`` are clipped to it; that is part of the mechanism.

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> budget = dpsql.Budget.in_memory(epsilon=1.0)
    >>> with dpsql.testing.seeded(0):
    ...     rel = dpsql.binary_tree(np.full(1024, 5.0), epsilon=0.5, upper=10.0, horizon=1024, budget=budget)
    >>> budget.spent, rel.params["levels"]
    ((0.5, 0.0), 10)
    >>> abs(rel.range_sum(0, 1024) - 5120.0) < 5 * rel.range_variance(0, 1024) ** 0.5
    True
    """
    return publish("binary_tree", values, budget=budget, note=note, fresh=fresh, epsilon=epsilon, upper=upper,
                   lower=lower, horizon=horizon)


@checked_call()
def pak(values, *, epsilon: float, upper: float, delta: float | None = None, lower: float = 0.0,
        m: int | None = None, holdout_share: float = 0.15, tail_p: float = 0.005, lam: float = 0.85,
        beta_lt: float = 0.006, rho: float = 1.0, horizon: int | None = None, threshold: float | None = None,
        budget: Budget | None = None, note: str | None = None, fresh: bool = False) -> Release:
    """PAK (Perrier, Asghar, Kaafar, NDSS 2019): a private threshold from the first ``m``
    rows by smooth sensitivity, then the binary-tree counter clipped at that threshold.

    The threshold is the hold-out's empirical ``1 - lam * tail_p`` quantile plus a
    smooth-sensitivity margin (PAK's ``kappa`` offset, NRS07 constant
    ``b = epsilon_1 / (2 ln(2 / delta))``, two-sided window), times ``rho``; it uses
    ``epsilon_1 = (1 - holdout_share) * epsilon`` and ``delta``. The hold-out rows are
    released by the flat :func:`hierarchy` at ``holdout_share * epsilon``, clipped at the
    threshold (PAK publishes their noisy total: the case of one block). The other rows go
    through :func:`binary_tree` with bounds ``[lower, lower + threshold]`` at the full
    ``epsilon`` (unbounded, or with the declared ``horizon``). A ``threshold`` released
    before (and paid for then) skips the hold-out.

    Cost: ``(epsilon, delta)``-DP, replace-one-value neighbours (time order public);
    ``delta`` defaults to ``1 / n**2`` and must be > 0. Values outside ``[lower, upper]``
    are clipped to it; that is part of the mechanism. Only Laplace noise is offered.
    ``m`` defaults to 4096 (:data:`dpsql.streams.holdout.DEFAULT_HOLDOUT`).

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> budget = dpsql.Budget.in_memory(epsilon=2.0, delta=1e-6)
    >>> values = np.arange(200_000) % 20.0
    >>> with dpsql.testing.seeded(1):
    ...     rel = dpsql.pak(values, epsilon=1.0, upper=100.0, m=50_000, budget=budget)
    >>> budget.spent == (1.0, 1 / 200_000**2), 19.0 <= rel.threshold < 70.0
    (True, True)
    """
    return publish("pak", values, budget=budget, note=note, fresh=fresh, epsilon=epsilon, upper=upper, delta=delta,
                   lower=lower, m=m, holdout_share=holdout_share, tail_p=tail_p, lam=lam, beta_lt=beta_lt, rho=rho,
                   horizon=horizon, threshold=threshold)


@checked_call()
def tops(values, *, epsilon: float, upper: float, lower: float = 0.0, m: int | None = None,
         smoother: str = "none", window: int = 8, alpha: float = 0.6, r: int | None = None, fanout: int = 16,
         depth: int | None = None, block: int | None = None, holdout_share: float = 0.5, focus: str = "mixed",
         c: float | None = None, step: float | None = None, levels_for_nm: str | None = None,
         threshold: float | None = None, grid=None, calendar: str = "day", budget: Budget | None = None,
         note: str | None = None, fresh: bool = False) -> Release:
    """ToPS (Wang et al., CCS 2021): a Noisy-Max threshold from the first ``m`` rows, then
    :func:`hierarchy` on the later rows, clipped at that threshold.

    Threshold: Report-Noisy-Max at ``(1 - holdout_share) * epsilon`` over a score for what the
    release is for, ``focus``: ``"mixed"`` (default: 24-row windows, weeks and months of hourly
    rows, and long ranges; on a calendar layout, whole days, weeks and months), ``"windows"`` or
    ``"long"`` trade the values clipped against the noise the threshold brings to those range sums
    (docs/algorithms.md, "tops");
    ``"paper"`` is ToPS Eq. 6 with the paper's constants whatever the table's length
    (candidates ``step, 2 step, ..., upper - lower``, ``c``; ``levels_for_nm="code"`` counts
    levels as the reference code; these three apply to it alone). Hold-out rows (``m``,
    default 4096: fixed, so that a stream's first rows are released as soon as 4096 have
    arrived): the flat hierarchy at ``holdout_share * epsilon``, clipped at the threshold.
    Later rows: :func:`hierarchy` with the threshold as bound, at the full ``epsilon``;
    ``smoother``, ``r``, ``fanout``, ``depth``, ``block``, ``grid`` and ``calendar`` as there
    (with a grid the hold-out's blocks are calendar days too). A ``threshold`` released before
    (and paid for then) skips the hold-out.

    Cost: ``epsilon``-DP (delta = 0), replace-one-value neighbours (time order public). Values
    outside ``[lower, upper]`` are clipped to it, and values above the threshold to the
    threshold: that is part of the mechanism. ``range_ci`` covers the clipped sum: the noise,
    plus the spreading of any block a range cuts.

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> budget = dpsql.Budget.in_memory(epsilon=1.0)
    >>> values = np.arange(300_000) % 10.0
    >>> with dpsql.testing.seeded(2):
    ...     rel = dpsql.tops(values, epsilon=0.5, upper=1000.0, budget=budget)
    >>> budget.spent, rel.params["m"], rel.params["blocks"], 9.0 <= rel.threshold <= 1000.0
    ((0.5, 0.0), 4096, [256, 512, 512], True)
    >>> low, high = rel.range_ci(100_000, 200_000)
    >>> bool(low <= values[100_000:200_000].sum() <= high)
    True
    """
    return publish("tops", values, budget=budget, note=note, fresh=fresh, epsilon=epsilon, upper=upper, lower=lower,
                   m=m, smoother=smoother, window=window, alpha=alpha, r=r, fanout=fanout, depth=depth, block=block,
                   holdout_share=holdout_share, focus=focus, c=c, step=step, levels_for_nm=levels_for_nm,
                   threshold=threshold, grid=grid, calendar=calendar)


@checked_call()
def hierarchy(values, *, epsilon: float, upper: float, lower: float = 0.0, smoother: str = "none", window: int = 8,
              alpha: float = 0.6, r: int | None = None, fanout: int = 16, consistency: bool = True,
              depth: int | None = None, block: int | None = None, initial: float | None = None, grid=None,
              calendar: str = "day", budget: Budget | None = None, note: str | None = None,
              fresh: bool = False) -> Release:
    """Range sums of a stream with a known public bound: a consistent fan-out-16 forest over
    blocks of rows, each block's noisy sum spread over its rows (ToPS's perturber, ``H^c_16``).

    Values are clipped to ``[lower, upper]``. The stream is cut into chunks (by default of
    ``4096 * 16**k`` rows, so the layout needs no length), each chunk into blocks whose
    length minimises ToPS Eq. 7 for the ``smoother``; a forest of ``fanout``-ary trees over
    each chunk's block sums gets Laplace noise at ``epsilon / levels`` per level and is made
    least-squares consistent (Hay et al., online). ``smoother="none"`` (default) gives each
    row of a block the block's sum over its length, released with the block's last row; the
    predictive smoothers (``recent``, ``mean``, ``median``, ``moving`` with ``window``,
    ``exponential`` with ``alpha``, starting from ``initial``) release each row when it
    arrives, in the paper's layout (chunks of ``r = 2**20`` rows, blocks of ``16**s``).
    ``depth`` (blocks of ``fanout**depth`` rows; 0 is the exact tree) or ``block`` override
    the block rule; ``consistency=False`` keeps each block's own noise (ablation).

    ``grid``: the rows' public time grid, ``(first order key, step)`` (or a
    :class:`dpsql.timegrid.RowGrid`; :func:`dpsql.timegrid.row_grid` finds it from the order
    keys), meaning row ``i`` has key ``first + i * step``, ``step`` dividing a day or one day.
    With it (and the flat spread, no ``r``, ``depth`` or ``block``) blocks are calendar days
    (UTC) and the tree's levels months and years: a daily, monthly or yearly total is one node
    and its interval the noise alone. ``calendar`` splits ``epsilon`` over the day, month and year
    levels: ``"day"`` (default: 0.7, 0.2, 0.1), ``"month"`` (0.3, 0.5, 0.2), ``"balanced"``
    (0.45, 0.35, 0.2), or ``"none"``: row-count blocks, best for arbitrary long ranges
    (docs/algorithms.md says why).

    Cost: ``epsilon``-DP (delta = 0), replace-one-value neighbours (time order public). Values
    outside ``[lower, upper]`` are clipped to it: that is part of the mechanism. The grid and
    ``calendar`` are public: the layout never depends on the values.

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> with dpsql.testing.seeded(4):
    ...     rel = dpsql.hierarchy(np.full(2**16, 3.0), epsilon=1.0, upper=8.0, r=2**16, fanout=2, depth=0)
    >>> rel.params["levels"], rel.epsilon
    ([16], 1.0)
    >>> bool(abs(rel.range_sum(0, 2**16) - 3.0 * 2**16) < 5 * rel.range_variance(0, 2**16) ** 0.5)
    True
    >>> with dpsql.testing.seeded(5):  # hourly readings from 9 am: the first day has 15 rows
    ...     daily = dpsql.hierarchy(np.full(24 * 60, 3.0), epsilon=1.0, upper=8.0, grid=("2024-03-01T09:00", "1h"))
    >>> daily.params["units"], daily.range_ci(15, 39, parts=True)[3]  # a calendar day: no spreading
    (['day', 'month', 'year'], 0.0)
    """
    return publish("hierarchy", values, budget=budget, note=note, fresh=fresh, epsilon=epsilon, upper=upper,
                   lower=lower, smoother=smoother, window=window, alpha=alpha, r=r, fanout=fanout,
                   consistency=consistency, depth=depth, block=block, initial=initial, grid=grid, calendar=calendar)


@checked_call(method="threshold")
def threshold(values, *, epsilon: float, upper: float, lower: float = 0.0, method: str = THRESHOLD_ESTIMATOR,
              budget: Budget | None = None, note: str | None = None, fresh: bool = False, **params) -> Release:
    """A private clipping threshold for ``values`` in ``[lower, upper]``, released on its own.

    ``method="nm"``: Report-Noisy-Max, ``epsilon``-DP, for the hierarchy release it is for
    (``epsilon_perturber``, default ``epsilon``; ``r``, its chunk length, default geometric
    chunks; ``fanout``, 16), over a score for ``focus`` (``"mixed"``, the default, ``"windows"``,
    ``"long"``: as in :func:`tops`), or ToPS Eq. 6 (``focus="paper"``, with ``r`` the query range,
    default 2**20, and its own options ``c`` (60), ``step``, ``levels_for_nm``
    (``"paper"``/``"code"``)). ``method="pak"``: PAK's smooth-sensitivity
    quantile, ``(epsilon, delta)``-DP; options ``delta`` (default ``1 / n**2``), ``tail_p``,
    ``lam``, ``beta_lt``, ``rho``. (``method`` is the same word in SQL, ``dp_threshold``, and
    Polars, ``.dpsql.threshold``; ``estimator=``, its old name, is a :class:`dpsql.RenamedParameter`.)

    Replace-one-value neighbours. Values outside ``[lower, upper]`` are clipped to it (part of
    the mechanism). The release has one value, also in ``Release.threshold``; it has no range
    sums.

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> budget = dpsql.Budget.in_memory(epsilon=1.0)
    >>> values = np.r_[np.full(9_900, 20.0), np.full(100, 900.0)]
    >>> with dpsql.testing.seeded(5):
    ...     rel = dpsql.threshold(values, epsilon=0.5, upper=1000.0, budget=budget)
    >>> 20.0 <= rel.threshold < 30.0, len(rel), budget.spent  # the 1 % at 900 is clipped
    (True, 1, (0.5, 0.0))
    """
    return publish("threshold", values, budget=budget, note=note, fresh=fresh, epsilon=epsilon, upper=upper,
                   lower=lower, estimator=method, **params)
