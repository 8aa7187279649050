"""The single charging path.

:func:`publish` is the only function in dpsql that hands private values to a caller.
It validates everything, runs the pure algorithm with the noise source in force,
charges the ledger once (one transaction, durable) and only then returns the release.
Python wrappers, the DuckDB and the Polars front ends all call it; none of them
charges or adds noise by itself.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from dpsql import _validate, noise
from dpsql._memory import pooled_array
from dpsql.accountant import Budget
from dpsql.errors import InvalidParameter
from dpsql.release import Descriptions, Parts, Release, StreamMachine, chunks_of, release_batched, run_machine

#: name -> machine factory ``(n, *, noise, **params) -> StreamMachine``. Algorithm
#: modules add themselves in :mod:`dpsql.streams`.
METHODS: dict[str, Callable[..., StreamMachine]] = {}


def register_method(name: str, factory: Callable[..., StreamMachine]) -> None:
    METHODS[name] = factory


@dataclass(frozen=True, eq=False)
class PartitionedRelease:
    """One release over disjoint partitions (parallel composition: charged once, at the max).

    ``values`` are all partitions' values, concatenated in partition order;
    ``offsets[k]:offsets[k+1]`` are partition ``k``'s rows and ``parts[k]`` its
    :class:`Release` (error bars within a partition come from there; each is made when
    first looked at, see :class:`~dpsql.release.Parts`).
    """

    values: np.ndarray
    offsets: np.ndarray
    parts: Parts
    method: str
    epsilon: float
    delta: float
    private: bool
    release_id: str | None

    def part(self, k: int) -> Release:
        return self.parts[k]

    def __len__(self) -> int:
        return len(self.values)

    def __repr__(self) -> str:
        return (f"PartitionedRelease({self.method}, partitions={len(self.parts)}, n={len(self.values)}, "
                f"epsilon={self.epsilon:g}, delta={self.delta:g})")


@functools.cache
def _parameters(factory: Callable[..., StreamMachine]):
    # Cached: a partitioned release builds one machine per partition (thousands).
    return inspect.signature(factory).parameters


def check_method(method: str, *, per_row: bool = False) -> None:
    """Refuse an unknown method (:class:`InvalidParameter`) before anything runs; with
    ``per_row``, also a method that does not release one value per row (a threshold), for
    front ends that return one private value per input row."""
    from dpsql import streams  # noqa: F401  (registers the methods)

    if method not in METHODS:
        raise InvalidParameter(f"unknown method {method!r}; expected one of {', '.join(map(repr, sorted(METHODS)))}")
    outputs = getattr(METHODS[method], "n_outputs", None)
    if per_row and outputs is not None:
        raise InvalidParameter(f"method {method!r} releases {outputs} value(s) per stream, not one per row: release "
                               "it with the front end's threshold function (dp_threshold, .dpsql.threshold)")


def machine_for(method: str, n: int, source: noise.NoiseSource, params: dict) -> StreamMachine:
    """The validated state machine for ``method`` over ``n`` rows (draws no noise)."""
    check_method(method)
    factory = METHODS[method]
    accepted = _parameters(factory)
    params = dict(params)
    if "delta" in params and "delta" not in accepted:
        _validate.delta(params.pop("delta"), pure=True, method=method)
    unknown = sorted(set(params) - set(accepted) - {"n", "noise"})
    if unknown:
        known = sorted(set(accepted) - {"n", "noise"})
        raise InvalidParameter(f"unknown parameter(s) {', '.join(map(repr, unknown))} for method {method!r}; "
                               f"expected {', '.join(map(repr, known))}")
    missing = [name for name, p in accepted.items()
               if p.kind is p.KEYWORD_ONLY and p.default is p.empty and name not in params and name != "noise"]
    if missing:
        raise InvalidParameter(f"missing required parameter(s) {', '.join(map(repr, missing))} for method {method!r}")
    return factory(n, noise=source, **params)


def publish(method: str, values, *, budget: Budget | None = None, column: str = "values",
            partition_offsets: Sequence[int] | None = None, partition_levels: Sequence[int] | None = None,
            note: str | None = None, **params) -> Release | PartitionedRelease:
    """Release ``values`` privately with ``method`` and charge ``budget`` (if given) once.

    Parameters
    ----------
    method : str
        A registered method name (``dpsql.api.METHODS``).
    values : array-like
        One numeric value per row, in time order. Errors name ``column``.
    budget : Budget, optional
        Charged once, atomically, before anything is returned. Without a budget the
        caller is responsible for accounting (the release still states its cost).
    partition_offsets : sequence of int, optional
        ``[0, o_1, ..., n]``: rows ``o_k:o_{k+1}`` form partition ``k`` (disjoint, rows
        grouped by partition, each in time order). Each partition is released
        independently; the charge is the maximum over partitions.
    partition_levels : sequence of int, optional
        One level per partition, for releases in which every event is counted once per
        level (a hierarchy of aggregations): partitions of one level are disjoint
        (parallel composition, maximum) and levels compose sequentially (their maxima
        add up, exactly). Default: all partitions in one level.
    note : str, optional
        Recorded in the ledger with the release.
    **params
        The method's parameters (``epsilon``, ``upper``, ...).
    """
    if budget is not None and not isinstance(budget, Budget):
        raise InvalidParameter(f"budget must be a dpsql.Budget, got {type(budget).__name__}")
    data = _validate.values(values, column)
    offsets = _offsets(partition_offsets, len(data))
    source = noise.current()
    # One machine per partition length: machines of one length (and these parameters) are
    # identical until fed, and cost the same.
    lengths = np.diff(offsets).tolist()
    templates: dict[int, StreamMachine] = {}
    for n in lengths:
        if n not in templates:
            templates[n] = machine_for(method, n, source, params)
    machines = [templates[n] for n in lengths]
    levels = [0] * len(machines) if partition_levels is None else list(partition_levels)
    if len(levels) != len(machines):
        raise InvalidParameter(f"partition_levels must give one level per partition ({len(machines)}), "
                               f"got {len(levels)}")
    epsilon = _compose([m.cost[0] for m in machines], levels)
    delta = _compose([m.cost[1] for m in machines], levels)
    first = machines[0]
    if budget is not None:
        budget.check(epsilon=epsilon, delta=delta, notion=first.notion, w=first.w, private=source.private)
    parts, values = _run_partitions(method, templates, data, offsets, source, params)
    release_id = None
    if budget is not None:
        release_id = budget.charge(method=parts[0].method, epsilon=epsilon, delta=delta, rows=len(data),
                                   partitions=len(parts), params=dict(parts[0].params), neighbour=first.neighbour,
                                   notion=first.notion, w=first.w, private=source.private, note=note)
    if partition_offsets is None:
        return parts[0].with_id(release_id) if release_id else parts[0]
    parts = parts.with_id(release_id) if release_id else parts
    return PartitionedRelease(values=values, offsets=offsets, parts=parts,
                              method=parts[0].method, epsilon=epsilon, delta=delta, private=source.private,
                              release_id=release_id)


def _run_partitions(method: str, templates: dict[int, StreamMachine], data: np.ndarray, offsets: np.ndarray,
                    source: noise.NoiseSource, params: dict) -> tuple[Parts, np.ndarray]:
    """One :class:`Release` per partition (made when looked at), and all their values in one array.

    ``templates`` holds one unfed machine per partition length. Machines whose rows are
    independent release all partitions in one run of one machine (cut at the offsets), so
    many small partitions cost what one long stream does. Batchable machines release each
    group of equal-length partitions in one run over a ``(k, n)`` view of their rows (a
    group of one is the ordinary single stream); the others run partition by partition.
    """
    lengths = np.diff(offsets)
    first = templates[int(lengths[0])]
    spans = list(itertools.pairwise(offsets.tolist()))
    if len(lengths) > 1 and first.rows_independent:
        values = run_machine(machine_for(method, len(data), source, params), chunks_of(data), len(data))
        sources = [(templates[b - a], None) for a, b in spans]
    elif first.batchable and len(lengths) > 1:
        values = pooled_array(len(data))
        sources: list = [None] * len(lengths)
        for n, template in templates.items():
            group = np.flatnonzero(lengths == n)
            for j, released in zip(group.tolist(), _release_group(template, data, values, offsets[group], n)):
                sources[j] = released
    else:
        unused = dict(templates)
        machines = [unused.pop(b - a, None) or machine_for(method, b - a, source, params) for a, b in spans]
        pieces = [run_machine(m, chunks_of(data[a:b]), b - a) for m, (a, b) in zip(machines, spans)]
        values = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        sources = [(m, None) for m in machines]
    # a partition's outputs: one per row, or the machine's fixed number (a threshold: one)
    outputs = np.cumsum([0] + [templates[b - a].n_outputs or b - a for a, b in spans]).tolist()
    parts = Parts(Descriptions(sources), [values[a:b] for a, b in itertools.pairwise(outputs)],
                  private=source.private)
    return parts, values


def _release_group(machine: StreamMachine, data: np.ndarray, values: np.ndarray, starts: np.ndarray,
                   n: int) -> list[tuple[StreamMachine, int | None]]:
    """Release the partitions of length ``n`` starting at ``starts`` with the batchable
    ``machine`` (unfed), writing their values into ``values``; returns what describes each
    (see :class:`~dpsql.release.Descriptions`)."""
    if len(starts) == 1:
        span = slice(starts[0], starts[0] + n)
        run_machine(machine, chunks_of(data[span]), n, values[span])
        return [(machine, None)]
    if starts[-1] - starts[0] == (len(starts) - 1) * n:  # adjacent partitions: views, no copies
        span = slice(starts[0], starts[0] + len(starts) * n)
        batch = release_batched(machine, data[span].reshape(-1, n), values[span].reshape(-1, n))
    else:
        rows = starts[:, None] + np.arange(n)
        out = np.empty(rows.shape)
        batch = release_batched(machine, data[rows], out)
        values[rows] = out
    return [(batch, j) for j in range(len(starts))]


def _compose(costs: list[float], levels: list[int]) -> float:
    """Maximum within a level (disjoint partitions), sum across levels (sequential), added
    exactly and rounded up to a float, so the recorded charge is never below the cost."""
    per_level: dict[int, float] = {}
    for level, cost in zip(levels, costs):
        per_level[level] = max(per_level.get(level, 0.0), cost)
    exact = sum((Fraction(c) for c in per_level.values()), Fraction(0))
    rounded = float(exact)
    return rounded if Fraction(rounded) >= exact else math.nextafter(rounded, math.inf)


def _offsets(partition_offsets, n: int) -> np.ndarray:
    if partition_offsets is None:
        return np.array([0, n])
    offsets = np.asarray(partition_offsets, dtype=np.int64)
    if offsets.ndim != 1 or offsets.size < 2 or offsets[0] != 0 or offsets[-1] != n or np.any(np.diff(offsets) <= 0):
        raise InvalidParameter("partition_offsets must start at 0, end at the number of rows and strictly "
                               "increase (every partition non-empty)")
    return offsets


def laplace_stream(values, *, epsilon: float, upper: float, lower: float = 0.0,
                   budget: Budget | None = None, note: str | None = None) -> Release:
    """Per-value Laplace baseline: every value clipped to ``[lower, upper]`` plus
    Laplace noise of scale ``(upper - lower) / epsilon``.

    Cost: ``epsilon``-DP, replace-one-value neighbours. Values outside the public
    bounds are clipped to them; that is part of the mechanism, not an error.

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> budget = dpsql.Budget.in_memory(epsilon=1.0)
    >>> with dpsql.testing.seeded(0):
    ...     rel = dpsql.laplace_stream(np.full(1000, 5.0), epsilon=0.5, upper=10.0, budget=budget)
    >>> budget.spent
    (0.5, 0.0)
    >>> abs(rel.range_sum(0, 1000) - 5000.0) < 4 * rel.range_variance(0, 1000) ** 0.5
    True
    """
    return publish("laplace", values, budget=budget, note=note, epsilon=epsilon, upper=upper, lower=lower)


def binary_tree(values, *, epsilon: float, upper: float, lower: float = 0.0,
                budget: Budget | None = None, note: str | None = None) -> Release:
    """Binary-tree continual counter (Dwork et al. 2010, Chan et al. 2011) for real values.

    ``L = ceil(log2 n)`` levels of dyadic nodes, each with Laplace noise for
    sensitivity ``upper - lower`` at ``epsilon / L``; row ``i`` is released as the
    difference of consecutive noisy prefix sums, so ``range_sum(i, j)`` is the difference
    of two noisy prefixes (at most ``2 L`` nodes of noise).

    Cost: ``epsilon``-DP, replace-one-value neighbours (time order public). Values
    outside ``[lower, upper]`` are clipped to it; that is part of the mechanism.

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> budget = dpsql.Budget.in_memory(epsilon=1.0)
    >>> with dpsql.testing.seeded(0):
    ...     rel = dpsql.binary_tree(np.full(1024, 5.0), epsilon=0.5, upper=10.0, budget=budget)
    >>> budget.spent, rel.params["levels"]
    ((0.5, 0.0), 10)
    >>> abs(rel.range_sum(0, 1024) - 5120.0) < 5 * rel.range_variance(0, 1024) ** 0.5
    True
    """
    return publish("binary_tree", values, budget=budget, note=note, epsilon=epsilon, upper=upper, lower=lower)


def pak(values, *, epsilon: float, upper: float, delta: float | None = None, lower: float = 0.0,
        m: int | None = None, holdout_share: float = 0.15, tail_p: float = 0.005, lam: float = 0.85,
        beta_lt: float = 0.006, rho: float = 1.0, budget: Budget | None = None, note: str | None = None) -> Release:
    """PAK (Perrier, Asghar, Kaafar, NDSS 2019): a private threshold from the first ``m``
    rows by smooth sensitivity, then the binary-tree counter clipped at that threshold.

    The threshold is the hold-out's empirical ``1 - lam * tail_p`` quantile plus a
    smooth-sensitivity margin (PAK's ``kappa`` offset, NRS07 constant
    ``b = epsilon_1 / (2 ln(2 / delta))``, two-sided window), times ``rho``; it uses
    ``epsilon_1 = (1 - holdout_share) * epsilon`` and ``delta``. The hold-out rows are
    released as ``1/m`` each of their total clipped at the threshold plus Laplace noise
    at ``holdout_share * epsilon``. The other rows go through :func:`binary_tree` with
    bounds ``[lower, lower + threshold]`` at the full ``epsilon``.

    Cost: ``(epsilon, delta)``-DP, replace-one-value neighbours (time order public);
    ``delta`` defaults to ``1 / n**2`` and must be > 0. Values outside ``[lower, upper]``
    are clipped to it; that is part of the mechanism. Only Laplace noise is offered.
    ``m`` defaults to ``min(65536, n // 4)``.

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> budget = dpsql.Budget.in_memory(epsilon=2.0, delta=1e-6)
    >>> values = np.arange(200_000) % 20.0
    >>> with dpsql.testing.seeded(1):
    ...     rel = dpsql.pak(values, epsilon=1.0, upper=100.0, budget=budget)
    >>> budget.spent == (1.0, 1 / 200_000**2), 19.0 <= rel.threshold < 70.0
    (True, True)
    """
    return publish("pak", values, budget=budget, note=note, epsilon=epsilon, upper=upper, delta=delta, lower=lower,
                   m=m, holdout_share=holdout_share, tail_p=tail_p, lam=lam, beta_lt=beta_lt, rho=rho)


def tops(values, *, epsilon: float, upper: float, lower: float = 0.0, m: int | None = None, r: int | None = None,
         fanout: int = 16, smoother: str = "recent", window: int = 8, alpha: float = 0.6,
         holdout_share: float = 0.15, c: float = 60.0, step: float | None = None, levels_for_nm: str = "paper",
         budget: Budget | None = None, note: str | None = None) -> Release:
    """ToPS (Wang et al., CCS 2021): a Noisy-Max threshold from the first ``m`` rows, then an
    online consistent fanout-16 hierarchy over blocks clipped at that threshold, then a smoother.

    Threshold: Report-Noisy-Max over ToPS Eq. 6 at ``(1 - holdout_share) * epsilon`` (candidates
    ``step, 2 step, ..., upper - lower``; ``levels_for_nm`` chooses the paper's or the reference
    code's level count). Hold-out rows: each carries ``1/m`` of their total clipped at the
    threshold plus Laplace noise at ``holdout_share * epsilon``. Other rows: per chunk of ``r``
    rows, a forest whose leaves are blocks of ``g = fanout**s`` values (``s`` by Eq. 7), Laplace
    noise at ``epsilon / levels`` per level, consistency (Hay et al.) applied online, and the
    ``smoother`` (``recent``, ``mean``, ``median``, ``moving`` with ``window``, ``exponential``
    with ``alpha``, or ``none``) spreading each block sum over its rows causally.
    ``m`` defaults to ``min(65536, n // 4)`` and ``r`` to ``min(2**20, n - m)``.

    Cost: ``epsilon``-DP (delta = 0), replace-one-value neighbours (time order public). Values
    outside ``[lower, upper]`` are clipped to it, and stream values above the threshold to the
    threshold: that is part of the mechanism. ``range_ci`` covers the noise only, not this
    clipping bias or the smoother's prediction bias.

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> budget = dpsql.Budget.in_memory(epsilon=1.0)
    >>> values = np.arange(300_000) % 10.0
    >>> with dpsql.testing.seeded(2):
    ...     rel = dpsql.tops(values, epsilon=0.5, upper=1000.0, budget=budget)
    >>> budget.spent, rel.params["m"], rel.params["block"], 9.0 <= rel.threshold <= 10.0
    ((0.5, 0.0), 65536, 256, True)
    >>> low, high = rel.range_ci(100_000, 200_000)
    >>> bool(low <= values[100_000:200_000].sum() <= high)
    True
    """
    return publish("tops", values, budget=budget, note=note, epsilon=epsilon, upper=upper, lower=lower, m=m, r=r,
                   fanout=fanout, smoother=smoother, window=window, alpha=alpha, holdout_share=holdout_share, c=c,
                   step=step, levels_for_nm=levels_for_nm)


def hierarchy(values, *, epsilon: float, upper: float, lower: float = 0.0, r: int | None = None, fanout: int = 16,
              consistency: bool = True, smoother: str = "recent", window: int = 8, alpha: float = 0.6,
              depth: int | None = None, budget: Budget | None = None, note: str | None = None) -> Release:
    """The ToPS perturber and smoother with a known public bound (the paper's ``H^c_16``).

    Values are clipped to ``[lower, upper]``. Per chunk of ``r`` rows (default
    ``min(2**20, n)``) a forest of ``fanout``-ary trees over blocks of ``g = fanout**depth``
    values (``depth`` by ToPS Eq. 7 unless given) gets Laplace noise at ``epsilon / levels`` per
    level; ``consistency`` (Hay et al., applied online) makes it least-squares consistent; the
    ``smoother`` spreads each block's noisy sum over its rows (see :func:`tops`). With
    ``consistency=False`` each block keeps its own leaf noise (ablation).

    Cost: ``epsilon``-DP (delta = 0), replace-one-value neighbours (time order public). Values
    outside ``[lower, upper]`` are clipped to it: that is part of the mechanism.

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> with dpsql.testing.seeded(4):
    ...     rel = dpsql.hierarchy(np.full(2**16, 3.0), epsilon=1.0, upper=8.0, fanout=2, depth=0, smoother="none")
    >>> rel.params["levels"], rel.epsilon
    (16, 1.0)
    >>> bool(abs(rel.range_sum(0, 2**16) - 3.0 * 2**16) < 5 * rel.range_variance(0, 2**16) ** 0.5)
    True
    """
    return publish("hierarchy", values, budget=budget, note=note, epsilon=epsilon, upper=upper, lower=lower, r=r,
                   fanout=fanout, consistency=consistency, smoother=smoother, window=window, alpha=alpha,
                   depth=depth)


def threshold(values, *, epsilon: float, upper: float, lower: float = 0.0, method: str = "nm",
              budget: Budget | None = None, note: str | None = None, **params) -> Release:
    """A private clipping threshold for ``values`` in ``[lower, upper]``, released on its own.

    ``method="nm"``: the ToPS Noisy-Max optimizer, ``epsilon``-DP; options ``r`` (the query
    range the threshold is for, default 2**20), ``fanout`` (16), ``c`` (60), ``step``,
    ``levels_for_nm`` (``"paper"``/``"code"``), ``epsilon_perturber`` (the budget of the stream
    release it is for; default ``epsilon``). ``method="pak"``: PAK's smooth-sensitivity
    quantile, ``(epsilon, delta)``-DP; options ``delta`` (default ``1 / n**2``), ``tail_p``,
    ``lam``, ``beta_lt``, ``rho``.

    Replace-one-value neighbours. Values outside ``[lower, upper]`` are clipped to it (part of
    the mechanism). The release has one value, also in ``Release.threshold``; it has no range
    sums.

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> budget = dpsql.Budget.in_memory(epsilon=1.0)
    >>> values = np.r_[np.full(9_900, 20.0), np.full(100, 900.0)]
    >>> with dpsql.testing.seeded(5):
    ...     rel = dpsql.threshold(values, epsilon=0.5, upper=1000.0, r=4096, budget=budget)
    >>> rel.threshold, len(rel), budget.spent
    (20.0, 1, (0.5, 0.0))
    """
    return publish("threshold", values, budget=budget, note=note, epsilon=epsilon, upper=upper, lower=lower,
                   estimator=method, **params)
