"""The single charging path of one-shot releases.

:func:`publish` is the only function in dpsql that hands private values of a one-shot
release to a caller. It validates everything, gives the release a fresh secret key
(:class:`dpsql.noise.Keystream`), runs the pure algorithm, charges the ledger once (one
transaction, durable, recording the release's public description and, for identical repeats,
its answer) and only then returns the release. Python functions, the DuckDB and Polars front
ends all call it; Spark, whose partitions are released on other machines, plans and charges its
release through :class:`DistributedRelease`. No front end charges or draws noise by itself.

Identical repeats by the same principal cost nothing: the fingerprint of the request (method,
parameters, scope, principal, private or seeded, and the exact data consumed,
:mod:`dpsql._fingerprint`) finds the cached answer of their earlier identical release. The
ledger keeps that release's secret key, not its values: the release is recomputed from the key
over the same data, checked against the digest of the values released, returned again and
recorded as a free cache hit; it publishes nothing new. ``fresh=True`` makes a new, charged
release instead; so does another principal's identical call (a free answer would confirm their
guess of the data), a seeded call after a private release and the reverse.

A refused or failed call leaves nothing noisy behind: everything drawn lives in one inner
call whose frames are dropped, and the caller gets a fresh exception of the same type and
message, with no traceback into them, no ``__context__`` and no ``__cause__``.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import overload

import numpy as np
import pyarrow as pa

from dpsql import _progress, _validate
from dpsql._fingerprint import fingerprint, values_digest
from dpsql._groups import group_codes, unique
from dpsql._memory import pooled_array
from dpsql.accounting import Charge, Neighbour, Notion, compose
from dpsql.addresses import partition_address, partition_addresses, refuse_repeated
from dpsql.budget import Budget, default_budget
from dpsql.errors import InvalidParameter, scrubbed
from dpsql.fleets import fleet_holdout, fleet_machine, fleet_params, fleet_threshold, pooled_params
from dpsql.ledger import CachedAnswer
from dpsql.mechanisms.calendar import calendar_by_default
from dpsql.methods import GRID_METHODS, machine_for, pools_fleet, unsized_charge
from dpsql.noise import DrawsBatch, Keystream
from dpsql.partition_digests import DigestLookup, PartitionFingerprint, changed_data, fingerprint_key
from dpsql.parts import Descriptions, Keys, Parts
from dpsql.records import describe
from dpsql.release import (
    BATCHED_CHUNK,
    PartitionedRelease,
    Release,
    StreamMachine,
    chunks_of,
    release_batched,
    run_machine,
)
from dpsql.timegrid import RowGrid, partition_grids


@overload
def publish(method: str, values, *, budget: Budget | None = ..., column: str = ..., partition_offsets: None = ...,
            partition_keys: None = ..., partition_levels: None = ..., order_keys: Sequence = ...,
            order_values=..., fresh: bool = ..., note: str | None = ..., source: str | None = ...,
            progress: bool = ..., **params) -> Release: ...


@overload
def publish(method: str, values, *, budget: Budget | None = ..., column: str = ...,
            partition_offsets: Sequence[int], partition_keys: Sequence | None = ...,
            partition_levels: Sequence[int] | None = ..., order_keys: Sequence = ..., order_values=...,
            fresh: bool = ..., note: str | None = ..., source: str | None = ..., progress: bool = ...,
            **params) -> Release | PartitionedRelease: ...


def publish(method: str, values, *, budget: Budget | None = None, column: str = "values",
            partition_offsets: Sequence[int] | None = None, partition_keys: Sequence | None = None,
            partition_levels: Sequence[int] | None = None, order_keys: Sequence = (), order_values=None,
            fresh: bool = False, note: str | None = None, source: str | None = None, progress: bool = True,
            **params) -> Release | PartitionedRelease:
    """Release ``values`` privately with ``method`` and charge ``budget`` once.

    Parameters
    ----------
    method : str
        A registered method name (:data:`dpsql.methods.METHODS`).
    values : array-like
        One numeric value per row, in time order. Errors name ``column``.
    budget : Budget, optional
        Charged once, atomically, before anything is returned; default: the budget set with
        :func:`dpsql.use_budget`. A private release with neither is refused.
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
    order_keys : sequence of arrays
        The public order (and partition) key columns in stream order, as the front end read
        them: part of what identifies the data for the answer cache.
    order_values : array-like, optional
        Each row's order key, in stream order: a partitioned ToPS or PAK release pools the
        fleet's earliest rows to choose its threshold (``threshold_by="fleet"``, the default), as
        a continual stream appended in time order does; without them, the first rows of every
        partition by row number.
    fresh : bool
        Release anew (and charge) even if an identical release's answer is recorded.
    note : str, optional
        Recorded in the ledger with the release.
    source : str, optional
        What the release read, recorded in the ledger beside ``note`` (a front end describes
        its table, column or expression); default ``"array of <n> values"``.
    progress : bool, default True
        Show a progress bar (:mod:`dpsql._progress`) for work expected to take more than two
        seconds; ``False`` silences it.
    **params
        The method's parameters (``epsilon``, ``upper``, ...).
    """
    budget = _budget_or_default(budget)
    data = _validate.values(values, column)
    offsets = _offsets(partition_offsets, len(data))
    addresses, keys = _addresses(partition_offsets, partition_keys, len(offsets) - 1)
    if order_values is not None and len(order_values) != len(data):
        raise InvalidParameter(f"order_values must give one order key per row ({len(data)}), got {len(order_values)}")
    request = _Request(method, data, offsets, addresses, partition_offsets is not None, keys,
                       partition_levels, list(order_keys), params, note,
                       f"array of {len(data)} values" if source is None else source, order_values)
    failure = None
    try:
        with _progress.shown(progress):
            return request.release(budget, fresh=fresh)
    except BaseException as error:
        failure = scrubbed(error)
    raise failure


class _Request:
    """One release request: everything :func:`publish` validated. :meth:`release` holds every
    noisy value and key in its own frames, so that they die with a failure."""

    def __init__(self, method, data, offsets, addresses, partitioned, keys, levels, order_keys, params, note,
                 source, order_values=None):
        self.method, self.data, self.offsets, self.addresses = method, data, offsets, addresses
        self.partitioned, self.keys, self.levels, self.order_keys = partitioned, keys, levels, order_keys
        self.params, self.note, self.source, self.order_values = params, note, source, order_values
        self.lengths = np.diff(offsets)

    def release(self, budget: Budget | None, *, fresh: bool) -> Release | PartitionedRelease:
        keystream = Keystream.fresh()
        plan = self._plan(keystream)
        # the cost of each (level, group) pair present: machines of one group cost the same
        if self.levels is None:  # level 0, and every group is some partition's
            present = list(range(len(plan.templates)))
        else:
            present = unique(_levels(self.levels, len(self.lengths)) * len(plan.templates) + plan.groups).tolist()
        costs = [plan.templates[p % len(plan.templates)].cost for p in present]
        pairs = [(p // len(plan.templates), p % len(plan.templates)) for p in present]
        first = plan.templates[int(plan.groups[0])]
        charge = Charge(method=self.method, epsilon=compose([c[0] for c in costs], [lv for lv, _ in pairs]),
                        delta=compose([c[1] for c in costs], [lv for lv, _ in pairs]),
                        neighbour=Neighbour(first.neighbour), notion=Notion(first.notion), w=first.w,
                        rows=len(self.data), partitions=len(self.lengths), private=keystream.private, note=self.note,
                        source=self.source)
        if budget is None:
            _refuse_private_without_budget(keystream)
            parts, values = _run_partitions(self.method, plan, self.data, self.offsets, keystream, self.addresses)
            return self._assemble(parts, values, charge, release_id=None, first_handle=None)
        digest = self._fingerprint(budget, charge) if budget.caches else None
        if digest is not None and not fresh:
            answered = self._answered(budget, digest, private=keystream.private)
            if answered is not None:
                return answered
        budget.check(charge)
        parts, values = _run_partitions(self.method, plan, self.data, self.offsets, keystream, self.addresses)
        release = self._assemble(parts, values, charge, release_id=None, first_handle=None)
        charge = Charge(**{**charge.__dict__, "method": parts[0].method, "params": _public(parts[0].params)})
        answer = None if digest is None else CachedAnswer(digest, keystream.private, keystream.key,
                                                          values_digest(values))
        receipt = budget.charge(charge, handles=len(values), description=describe(release), answer=answer)
        return self._assemble(parts, values, charge, release_id=receipt.release_id, first_handle=receipt.first_handle)

    def _plan(self, keystream: Keystream) -> _Plan:
        """The machines' parameters per partition, and one unfed machine per group of partitions
        with one length and the same parameters (drawing from the group's first partition):
        machines of one group are identical until fed, and cost the same. A partitioned ToPS or
        PAK release with ``threshold_by="fleet"`` (the default) and no threshold given first
        chooses the fleet's threshold from its pooled hold-out (:mod:`dpsql.fleets`); a
        hierarchy or ToPS release whose partitions' order keys lie on a time grid (hourly, daily,
        ...: :func:`~dpsql.timegrid.partition_grids`) gives each its ``grid``, so its blocks and
        levels follow the calendar (unless ``calendar="none"``)."""
        params = [self.params]
        which = np.zeros(len(self.lengths), np.int64)
        if self.partitioned and pools_fleet(self.method, self.params):
            params, which = fleet_threshold(self.method, self.data, self.lengths, self.addresses, keystream,
                                            self.params, self.order_values)
        if self.method in GRID_METHODS and self.order_values is not None and calendar_by_default(self.params):
            grids = partition_grids(self.order_values, self.offsets)  # each partition's time grid (public keys)
            if grids is not None and grids[1].any():
                params, which = _with_grids(params, which, *grids)
        return _planned(self.method, self.lengths, self.addresses, keystream, params, which)

    def _answered(self, budget: Budget, digest: str, *, private: bool) -> Release | PartitionedRelease | None:
        """The budget's principal's identical earlier release, recomputed from its key over these
        (fingerprinted, so identical) data and recorded as a free cache hit; None when there is
        none, or when the recomputation is not exactly the values released (another version of
        an algorithm): that would be a second release of the data, so the call is charged anew."""
        stored = budget.stored_answer(digest, private=private)
        if stored is None:
            return None
        record, answer = stored
        keystream = Keystream(answer.key, private=answer.private)
        _, values = _run_partitions(self.method, self._plan(keystream), self.data, self.offsets, keystream,
                                    self.addresses)
        if values_digest(values) != answer.digest:
            return None
        budget.record_hit(record, rows=len(self.data), note=self.note, source=self.source)
        return record.with_values(values)

    def _assemble(self, parts: Parts, values: np.ndarray, charge: Charge, *, release_id, first_handle):
        if release_id is not None:
            parts = parts.with_id(release_id, first_handle)
        if not self.partitioned:
            return parts[0]
        return PartitionedRelease(values=values, offsets=self.offsets, parts=parts, method=parts[0].method,
                                  epsilon=charge.epsilon, delta=charge.delta, private=charge.private,
                                  release_id=release_id, keys=self.keys, first_handle=first_handle)

    def _fingerprint(self, budget: Budget, charge: Charge) -> str:
        header = {"version": 2, "scope": budget.scope, "principal": budget.principal, "private": charge.private,
                  "notion": charge.notion.value, "method": self.method, "params": _canonical(self.params),
                  "levels": _exact(self.levels), "partitioned": self.partitioned}
        data = self.addresses.buffers()[2]  # the addresses' bytes, and where each one ends
        addresses = np.frombuffer(data, dtype=np.uint8) if data is not None else np.empty(0, np.uint8)
        ends = np.frombuffer(self.addresses.buffers()[1], dtype=np.int64)
        order = [] if self.order_values is None else [np.asarray(self.order_values)]
        return fingerprint(header, [self.data, self.offsets, ends, addresses, *self.order_keys, *order])


class DistributedRelease:
    """A partitioned release whose partitions are released elsewhere, one task per batch of whole
    partitions (Spark's executors): the core's side of it, so that a front end that ships work to
    other machines still never charges or draws noise by itself.

    Construction validates the method's parameters (drawing nothing) and gives the release a
    fresh secret key. Before the charge the front end digests each partition's rows with
    :attr:`fingerprint` (keyed from the release's key: it can neither draw noise nor be computed
    without it) and gathers the fleet's earliest rows when the release pools a hold-out (:attr:`holdout`).
    :meth:`charge` refuses what the method's machines refuse of the partitions, charges the
    ledger once for all partitions (disjoint: the cost is one partition's, the maximum; the
    pool is one mechanism, each row in it once), only then chooses the fleet's threshold (its
    noise is drawn after the charge) and hands out the :class:`PartitionTask`, which releases
    a partition only when its rows have a digest checked before the charge. Privacy cost: that
    of ``method`` with ``params`` (see :mod:`dpsql.methods`). ``note`` and ``source`` (what the
    release reads) are recorded with the charge.
    """

    def __init__(self, method: str, params: dict, *, budget: Budget | None, note: str | None = None,
                 source: str | None = None):
        budget = _budget_or_default(budget)
        keystream = Keystream.fresh()
        if budget is None:
            _refuse_private_without_budget(keystream)
        self._charge = unsized_charge(method, params, keystream, public_params=_public(params), note=note,
                                      source=source)
        self._budget = budget
        self._method, self._params, self._keystream = method, dict(params), keystream
        self.fingerprint = PartitionFingerprint(fingerprint_key(keystream.key))
        #: The rows of the fleet's pooled hold-out (``m``) when the release chooses one threshold for all its
        #: partitions (:func:`~dpsql.fleets.fleet_threshold`: ToPS or PAK, ``threshold_by="fleet"``, no threshold
        #: given), else None.
        self.holdout = fleet_holdout(params) if pools_fleet(method, params) else None

    def check(self, *, rows: int | None = None) -> None:
        """Refuse now (:class:`dpsql.BudgetExhausted`) what :meth:`charge` would refuse of the
        budget and, given the release's ``rows`` in all, a pooled hold-out that is not shorter."""
        if rows is not None and self.holdout is not None:
            fleet_holdout(self._params, rows)
        if self._budget is not None:
            self._budget.check(self._charge)

    def charge(self, *, shapes: Mapping[tuple[int, int], object], admitted: DigestLookup, rows: int = 0,
               pool: np.ndarray | None = None) -> PartitionTask:
        """Charge the release (once, durably) and return the task that releases its partitions.

        ``shapes`` maps each (partition length, its pooled rows: 0 without a pool) to a partition
        of that shape (its key), refused by name, uncharged, if the method's machine refuses it.
        ``admitted``: the digests (:attr:`fingerprint`) checked before the charge, the only
        partitions the task releases, with their pooled rows. With a pool (:attr:`holdout`): the
        release's ``rows`` in all and the ``pool``'s values, which choose the threshold after the
        charge."""
        shared, fleet, pooled_values = self._params, None, np.asarray([] if pool is None else pool, np.float64)
        if self.holdout is not None:
            if len(pooled_values) != self.holdout:
                raise InvalidParameter(f"the fleet's pool holds m={self.holdout} values, got {len(pooled_values)}")
            fleet = fleet_machine(self._method, self._params, rows, self._keystream)
            # every threshold the pool can give lies in (lower, upper]: validated with the bound's
            shared = fleet_params(self._method, self._params, fleet, None, rows)
        draws = self._keystream.partition(b"")
        for (n, pooled), partition in shapes.items():
            try:
                machine_for(self._method, n, draws, {**shared, "pooled_rows": pooled} if fleet else shared)
            except InvalidParameter as error:  # validation only: no machine drew anything
                raise type(error)(f"partition {partition!r} has {n} row(s): {error}") from None
        if self._budget is not None:
            self._budget.charge(self._charge)
        if fleet is not None:
            # for ranges in the longest partition, as the local release (fleets.fleet_threshold)
            shared = fleet_params(self._method, self._params, fleet, pooled_values, max(n for n, _ in shapes))
        return PartitionTask(method=self._method, params=shared, private=self._keystream.private,
                             key=self._keystream.key, admitted=admitted, pooled=fleet is not None)


@dataclasses.dataclass(frozen=True)
class PartitionTask:
    """What a task needs to release partitions of a charged :class:`DistributedRelease`: the
    method, its parameters (with a fleet's threshold when ``pooled``), the release's secret key
    (never shown in a repr) and the digests of the partitions checked before the charge (with
    their pooled rows). Every draw is addressed by the partition's key, so a retried or
    re-executed task releases the same values of the same rows, and refuses rows that differ
    from those checked (:class:`dpsql.errors.DataChanged`), releasing nothing."""

    method: str
    params: dict
    private: bool
    key: bytes = dataclasses.field(repr=False)
    admitted: DigestLookup = dataclasses.field(repr=False)
    pooled: bool = False

    @property
    def fingerprint(self) -> PartitionFingerprint:
        return PartitionFingerprint(fingerprint_key(self.key))

    def release(self, partitions: Sequence[pa.Array], values: np.ndarray, offsets: np.ndarray,
                order_keys: Sequence[Sequence]) -> np.ndarray:
        """The private values of the partitions whose keys are the rows of ``partitions`` (the
        partition key columns, one row per partition; no NULL or NaN key), partition ``k`` having
        the rows ``values[offsets[k]:offsets[k + 1]]`` (float64, in order) whose order keys'
        canonical bytes are ``order_keys[k]`` (as the front end gave them to the check).

        Privacy contract: releases only partitions whose rows are exactly those checked and
        charged for; if any of them differs, raises :class:`dpsql.errors.DataChanged` before
        drawing anything."""
        addresses = partition_addresses(partitions)
        pooled = self.admitted.lookup(self.fingerprint.digests(addresses, values, offsets, order_keys))
        missing = np.flatnonzero(pooled < 0)
        if missing.size:
            raise changed_data(Keys(partitions)[int(missing[0])])
        keystream = Keystream(self.key, private=self.private)
        offsets = np.asarray(offsets)
        params, which = pooled_params(self.params, pooled) if self.pooled else \
            ([self.params], np.zeros(len(offsets) - 1, np.int64))
        plan = _planned(self.method, np.diff(offsets), addresses, keystream, params, which)
        return _run_partitions(self.method, plan, values, offsets, keystream, addresses)[1]


def _budget_or_default(budget: Budget | None) -> Budget | None:
    """``budget``, or the default one (:func:`dpsql.use_budget`) when None; refuses anything else."""
    if budget is None:
        return default_budget()
    if not isinstance(budget, Budget):
        raise InvalidParameter(f"budget must be a dpsql.Budget, got {type(budget).__name__}")
    return budget


def _refuse_private_without_budget(keystream: Keystream) -> None:
    """A release with no budget to charge is allowed only with test noise."""
    if keystream.private:
        raise InvalidParameter("a private release needs a budget to be charged to: pass budget=dpsql.Budget."
                               "open(...) (or Budget.in_memory(...)), or set a default with "
                               "dpsql.use_budget(budget)")


def _canonical(params: Mapping) -> dict:
    """Parameters as the answer cache compares them: a parameter left at its default (None) is
    the same as one not given; values compare by :func:`_exact`."""
    return {k: _exact(v) for k, v in params.items() if v is not None}


def _exact(value):
    """``value`` as the answer cache compares it, exactly: an integer is itself, whatever its
    size (``2**53 + 1`` is not ``2**53``); a float is its exact value, and a float that is an
    integer equals that integer (SQL's ``upper := 8000`` and Python's ``upper=8000.0`` ask for
    one release), never a neighbour; a bool is a bool, never 1 or 0; numpy scalars are the
    Python number they hold; sequences and arrays compare element by element."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, (list, tuple, np.ndarray)):
        return [_exact(v) for v in value]
    return value


def _public(params: Mapping) -> dict:
    """Parameters as plain JSON-able values (numpy scalars as Python numbers)."""
    return {k: (v.item() if isinstance(v, np.generic) else v) for k, v in params.items()}


@dataclasses.dataclass
class _Plan:
    """Partition ``k`` is released by a machine like ``templates[groups[k]]`` (built with
    ``params[groups[k]]``): one length, one set of parameters per group."""

    groups: np.ndarray
    templates: dict[int, StreamMachine]
    params: list[dict]


def _planned(method: str, lengths: np.ndarray, addresses: pa.Array, keystream: Keystream, params: list[dict],
             which: np.ndarray) -> _Plan:
    """The :class:`_Plan` of partitions of ``lengths`` (addresses ``addresses``), partition ``k``
    released with ``params[which[k]]``: one unfed machine per group of partitions with one length
    and one set of parameters, drawing from the group's first partition."""
    _, first, inverse = unique(lengths * len(params) + which, return_index=True, return_inverse=True)
    templates = {g: machine_for(method, int(lengths[k]), keystream.partition(addresses[k].as_py()),
                                params[int(which[k])]) for g, k in enumerate(first.tolist())}
    return _Plan(inverse.reshape(-1), templates, [params[int(which[k])] for k in first.tolist()])


def _with_grids(params: list[dict], which: np.ndarray, first: np.ndarray, step: np.ndarray
                ) -> tuple[list[dict], np.ndarray]:
    """``params`` (each partition's entry ``which``) with each partition's time grid (``first``
    and ``step``; step 0: none): the distinct parameter sets and each partition's entry."""
    first = np.where(step > 0, first, 0)
    _, chosen, entry = np.unique(group_codes(which, first, step), return_index=True, return_inverse=True)
    grids = [{**params[int(which[k])], **({"grid": RowGrid(int(first[k]), int(step[k])).plain()} if step[k] else {})}
             for k in chosen.tolist()]
    return grids, entry.reshape(-1)


def _run_partitions(method: str, plan: _Plan, data: np.ndarray, offsets: np.ndarray, keystream: Keystream,
                    addresses: pa.Array) -> tuple[Parts, np.ndarray]:
    """The partitions' :class:`~dpsql.parts.Parts` (made when looked at), and all their values in one array.

    ``plan`` holds one unfed machine per group of partitions (one length, one set of parameters).
    Batchable machines release each group in one run over a ``(k, n)`` view of its rows, each
    partition drawing from its own address (all partitions' masks computed in one pass; a group
    of one is the ordinary single stream); the others run partition by partition.
    """
    lengths = np.diff(offsets)
    groups: list[tuple[int, np.ndarray]] = []  # (group, its partitions)
    if len(plan.templates) == 1:
        groups.append((int(plan.groups[0]), np.arange(len(lengths))))
    else:
        order = np.argsort(plan.groups, kind="stable")
        for members in np.split(order, np.flatnonzero(np.diff(plan.groups[order])) + 1):
            groups.append((int(plan.groups[members[0]]), members))
    kinds = np.empty(len(lengths), dtype=np.int64)
    makers: list = []
    templates = plan.templates
    if next(iter(templates.values())).batchable and len(lengths) > 1:
        values = pooled_array(len(data))
        draws = keystream.partitions(addresses)
        for g, members in groups:
            template, n = templates[g], int(lengths[members[0]])
            if len(members) == 1:
                span = slice(int(offsets[members[0]]), int(offsets[members[0]]) + n)
                run_machine(template, chunks_of(data[span]), n, values[span])
                kinds[members] = len(makers)
                makers.append((template, None))
                continue
            per_batch = max(2, BATCHED_CHUNK // n)  # many short partitions: batches of whole rows
            for batched in (members[at:at + per_batch] for at in range(0, len(members), per_batch)):
                batch = _release_group(template, data, values, offsets[batched], n, draws.take(batched))
                group_kinds = batch.partition_kinds()
                if group_kinds is None:
                    kinds[batched] = len(makers) + np.arange(len(batched))
                    makers += [(batch, j) for j in range(len(batched))]
                else:
                    _, first, inverse = unique(group_kinds, return_index=True, return_inverse=True)
                    kinds[batched] = len(makers) + inverse
                    makers += [(batch, int(j)) for j in first]
    else:
        spans = list(itertools.pairwise(offsets.tolist()))
        first_of_group = {g: int(members[0]) for g, members in groups}
        machines = [templates[int(plan.groups[k])] if first_of_group[int(plan.groups[k])] == k
                    else machine_for(method, b - a, keystream.partition(addresses[k].as_py()),
                                     plan.params[int(plan.groups[k])])
                    for k, (a, b) in enumerate(spans)]
        pieces = [run_machine(m, chunks_of(data[a:b]), b - a) for m, (a, b) in zip(machines, spans)]
        values = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        kinds[:] = np.arange(len(machines))
        makers = [(m, None) for m in machines]
    # a partition's outputs: one per row, or the machine's fixed number (a threshold: one)
    per_partition = np.array([templates[int(g)].n_outputs or int(n) for g, n in zip(plan.groups, lengths)]) if \
        any(t.n_outputs for t in templates.values()) else lengths
    outputs = np.concatenate([[0], np.cumsum(per_partition)])
    return Parts(Descriptions(kinds, makers), values, outputs, private=keystream.private), values


def _release_group(machine: StreamMachine, data: np.ndarray, values: np.ndarray, starts: np.ndarray,
                   n: int, draws: DrawsBatch) -> StreamMachine:
    """Release the partitions of length ``n`` starting at ``starts`` (two or more) with the
    batchable ``machine`` (unfed) and their ``draws``, writing their values into ``values``;
    returns the driven batch machine, which describes them (``describe_partition``)."""
    if starts[-1] - starts[0] == (len(starts) - 1) * n:  # adjacent partitions: views, no copies
        span = slice(starts[0], starts[0] + len(starts) * n)
        return release_batched(machine, data[span].reshape(-1, n), values[span].reshape(-1, n), draws)
    rows = starts[:, None] + np.arange(n)
    out = np.empty(rows.shape)
    batch = release_batched(machine, data[rows], out, draws)
    values[rows] = out
    return batch


def _addresses(partition_offsets, partition_keys, count: int) -> tuple[pa.Array, Keys | list | None]:
    """The partitions' canonical addresses (:mod:`dpsql.addresses`) and keys; a key given twice
    is refused (two partitions would draw the same noise)."""
    if partition_offsets is None:
        return pa.array([b""], pa.large_binary()), None
    if partition_keys is None:
        return partition_addresses([pa.array(np.arange(count))]), None
    if isinstance(partition_keys, (pa.Table, pa.RecordBatch)):
        keys: Keys | list = Keys(partition_keys.columns)
        addresses = partition_addresses(partition_keys.columns)
    elif isinstance(partition_keys, (pa.Array, pa.ChunkedArray)):
        keys, addresses = Keys([partition_keys]), partition_addresses([partition_keys])
    else:
        keys = list(partition_keys)
        addresses = pa.array([partition_address(key) for key in keys], pa.large_binary())
    if len(keys) != count:
        raise InvalidParameter(f"partition_keys must give one key per partition ({count}), got {len(keys)}")
    refuse_repeated(addresses, keys)
    return addresses, keys


def _levels(levels, count: int) -> np.ndarray:
    """Each partition's level among the distinct ``partition_levels`` (0, 1, ... in their order:
    levels are only told apart), which must be one whole number per partition, else
    InvalidParameter (a level truncated to another would be charged as the other's)."""
    try:
        given = np.asarray(levels)
    except (ValueError, TypeError):  # ragged
        raise InvalidParameter(f"partition_levels must give one whole number per partition, got {levels!r}") from None
    if given.ndim != 1 or len(given) != count:
        raise InvalidParameter(f"partition_levels must give one level per partition ({count}), got "
                               f"{len(given) if given.ndim == 1 else repr(levels)}")
    whole = given.dtype.kind in "iu" or (given.dtype.kind == "f" and bool(
        np.all(np.isfinite(given) & (given == np.trunc(given)) & (np.abs(given) < 2.0**63))))
    if not whole:
        raise InvalidParameter(f"partition_levels must be whole numbers, got {levels!r}")
    # numbered, so that level * groups + group cannot overflow (levels 2**63 apart would meet)
    return np.unique(given, return_inverse=True)[1].reshape(-1).astype(np.int64)


def _offsets(partition_offsets, n: int) -> np.ndarray:
    if partition_offsets is None:
        return np.array([0, n])
    offsets = np.asarray(partition_offsets, dtype=np.int64)
    if offsets.ndim != 1 or offsets.size < 2 or offsets[0] != 0 or offsets[-1] != n or np.any(np.diff(offsets) <= 0):
        raise InvalidParameter("partition_offsets must start at 0, end at the number of rows and strictly "
                               "increase (every partition non-empty)")
    return offsets


