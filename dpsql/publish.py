"""The single charging path.

:func:`publish` is the only function in dpsql that hands private values of a one-shot
release to a caller. It validates everything, gives the release a fresh secret key
(:class:`dpsql.noise.Keystream`), runs the pure algorithm, charges the ledger once (one
transaction, durable) and only then returns the release. Python functions, the DuckDB,
Polars and Spark front ends all call it; none of them charges or draws noise by itself.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from dpsql import _progress, _validate
from dpsql._memory import pooled_array
from dpsql.accountant import Budget
from dpsql.errors import InvalidParameter
from dpsql.methods import machine_for
from dpsql.noise import DrawsBatch, Keystream, partition_address
from dpsql.release import Descriptions, Parts, Release, StreamMachine, chunks_of, release_batched, run_machine


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


def publish(method: str, values, *, budget: Budget | None = None, column: str = "values",
            partition_offsets: Sequence[int] | None = None, partition_keys: Sequence | None = None,
            partition_levels: Sequence[int] | None = None, note: str | None = None, progress: bool = True,
            **params) -> Release | PartitionedRelease:
    """Release ``values`` privately with ``method`` and charge ``budget`` (if given) once.

    Parameters
    ----------
    method : str
        A registered method name (:data:`dpsql.methods.METHODS`).
    values : array-like
        One numeric value per row, in time order. Errors name ``column``.
    budget : Budget, optional
        Charged once, atomically, before anything is returned. Without a budget the
        caller is responsible for accounting (the release still states its cost).
    partition_offsets : sequence of int, optional
        ``[0, o_1, ..., n]``: rows ``o_k:o_{k+1}`` form partition ``k`` (disjoint, rows
        grouped by partition, each in time order). Each partition is released
        independently; the charge is the maximum over partitions.
    partition_keys : sequence, optional
        The (public) key of each partition; a partition's noise is addressed by its key, so
        the same partition gets the same draws whatever else is released with it (a
        continual stream's appends, a Spark task). Default: the partitions' positions.
    partition_levels : sequence of int, optional
        One level per partition, for releases in which every event is counted once per
        level (a hierarchy of aggregations): partitions of one level are disjoint
        (parallel composition, maximum) and levels compose sequentially (their maxima
        add up, exactly). Default: all partitions in one level.
    note : str, optional
        Recorded in the ledger with the release.
    progress : bool, default True
        Show a progress bar (:mod:`dpsql._progress`) for work expected to take more than two
        seconds; ``False`` silences it.
    **params
        The method's parameters (``epsilon``, ``upper``, ...).
    """
    if budget is not None and not isinstance(budget, Budget):
        raise InvalidParameter(f"budget must be a dpsql.Budget, got {type(budget).__name__}")
    data = _validate.values(values, column)
    offsets = _offsets(partition_offsets, len(data))
    addresses = _addresses(partition_offsets, partition_keys, len(offsets) - 1)
    keystream = Keystream.fresh()
    # One template machine per partition length: machines of one length (and these parameters)
    # are identical until fed, and cost the same.
    lengths = np.diff(offsets).tolist()
    templates: dict[int, StreamMachine] = {}
    for k, n in enumerate(lengths):
        if n not in templates:
            templates[n] = machine_for(method, n, keystream.partition(addresses[k]), params)
    machines = [templates[n] for n in lengths]
    levels = [0] * len(machines) if partition_levels is None else list(partition_levels)
    if len(levels) != len(machines):
        raise InvalidParameter(f"partition_levels must give one level per partition ({len(machines)}), "
                               f"got {len(levels)}")
    epsilon = _compose([m.cost[0] for m in machines], levels)
    delta = _compose([m.cost[1] for m in machines], levels)
    first = machines[0]
    if budget is not None:
        budget.check(epsilon=epsilon, delta=delta, notion=first.notion, w=first.w, private=keystream.private)
    with _progress.shown(progress):
        parts, values = _run_partitions(method, templates, data, offsets, keystream, addresses, params)
    release_id = None
    if budget is not None:
        release_id = budget.charge(method=parts[0].method, epsilon=epsilon, delta=delta, rows=len(data),
                                   partitions=len(parts), params=dict(parts[0].params), neighbour=first.neighbour,
                                   notion=first.notion, w=first.w, private=keystream.private, note=note)
    if partition_offsets is None:
        return parts[0].with_id(release_id) if release_id else parts[0]
    parts = parts.with_id(release_id) if release_id else parts
    return PartitionedRelease(values=values, offsets=offsets, parts=parts,
                              method=parts[0].method, epsilon=epsilon, delta=delta, private=keystream.private,
                              release_id=release_id)


def _addresses(partition_offsets, partition_keys, count: int) -> list[bytes]:
    if partition_offsets is None:
        return [b""]
    keys = range(count) if partition_keys is None else list(partition_keys)
    if len(keys) != count:
        raise InvalidParameter(f"partition_keys must give one key per partition ({count}), got {len(keys)}")
    return [partition_address(key) for key in keys]


def _run_partitions(method: str, templates: dict[int, StreamMachine], data: np.ndarray, offsets: np.ndarray,
                    keystream: Keystream, addresses: list[bytes], params: dict) -> tuple[Parts, np.ndarray]:
    """One :class:`Release` per partition (made when looked at), and all their values in one array.

    ``templates`` holds one unfed machine per partition length (built with the draws of the
    first partition of that length). Batchable machines release each group of equal-length
    partitions in one run over a ``(k, n)`` view of their rows, each partition drawing from
    its own address (a group of one is the ordinary single stream); the others run partition
    by partition.
    """
    lengths = np.diff(offsets)
    spans = list(itertools.pairwise(offsets.tolist()))
    first_of_length = {}
    for k, n in enumerate(lengths.tolist()):
        first_of_length.setdefault(n, k)
    if next(iter(templates.values())).batchable and len(lengths) > 1:
        values = pooled_array(len(data))
        sources: list = [None] * len(lengths)
        for n, template in templates.items():
            group = np.flatnonzero(lengths == n)
            if len(group) == 1:
                span = slice(int(offsets[group[0]]), int(offsets[group[0]]) + n)
                run_machine(template, chunks_of(data[span]), n, values[span])
                sources[group[0]] = (template, None)
                continue
            draws = DrawsBatch([keystream.partition(addresses[j]) for j in group.tolist()])
            for j, released in zip(group.tolist(), _release_group(template, data, values, offsets[group], n, draws)):
                sources[j] = released
    else:
        machines = [templates[b - a] if first_of_length[b - a] == k
                    else machine_for(method, b - a, keystream.partition(addresses[k]), params)
                    for k, (a, b) in enumerate(spans)]
        pieces = [run_machine(m, chunks_of(data[a:b]), b - a) for m, (a, b) in zip(machines, spans)]
        values = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        sources = [(m, None) for m in machines]
    # a partition's outputs: one per row, or the machine's fixed number (a threshold: one)
    outputs = np.cumsum([0] + [templates[b - a].n_outputs or b - a for a, b in spans]).tolist()
    parts = Parts(Descriptions(sources), [values[a:b] for a, b in itertools.pairwise(outputs)],
                  private=keystream.private)
    return parts, values


def _release_group(machine: StreamMachine, data: np.ndarray, values: np.ndarray, starts: np.ndarray,
                   n: int, draws: DrawsBatch) -> list[tuple[StreamMachine, int]]:
    """Release the partitions of length ``n`` starting at ``starts`` (two or more) with the
    batchable ``machine`` (unfed) and their ``draws``, writing their values into ``values``;
    returns what describes each (see :class:`~dpsql.release.Descriptions`)."""
    if starts[-1] - starts[0] == (len(starts) - 1) * n:  # adjacent partitions: views, no copies
        span = slice(starts[0], starts[0] + len(starts) * n)
        batch = release_batched(machine, data[span].reshape(-1, n), values[span].reshape(-1, n), draws)
    else:
        rows = starts[:, None] + np.arange(n)
        out = np.empty(rows.shape)
        batch = release_batched(machine, data[rows], out, draws)
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


