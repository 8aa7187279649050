"""Private count streams from event tables (PeGaSus, Chen et al., CCS 2017; docs/algorithms.md,
"Counts of events").

Users hold *events* (one row per login, connection, trip); the streams to release are
counts per time bucket. This module does the bucketing over a **public, gap-free time
domain** ``[start, stop)`` cut into buckets of width ``every`` (the last bucket ends at
``stop`` and may be shorter). The domain is never read from the data: ``start``,
``stop`` and ``every`` are required parameters, empty buckets are released like any
other, and events outside the domain are dropped and counted nowhere.

Privacy unit and sensitivity
----------------------------
Without a privacy unit each event adds 1 to exactly one bucket of one partition, so a
count stream has sensitivity 1 under add/remove-one-event neighbours (event-level DP).
With ``units`` (a privacy-unit column) and ``cap = k``, at most ``k`` events of one
unit are counted per bucket, across all partitions (the earliest ``k``; the rest are
dropped), and the noise is calibrated to sensitivity ``k``: the release protects
adding or removing all of one unit's events within one bucket. This is the PeGaSus
remark (§2.3) on users present in several states, in its "scale the noise" form;
weighting each counted event by ``1/k`` instead would release the same stream divided
by ``k``.

Partitions are disjoint (one event, one partition), so their streams compose in
parallel: a partitioned release costs ``epsilon`` once. A unit's capped events may fall
in several partitions of one bucket; the changes of those counts add up to at most
``k``, and both the Laplace Perturber and the sparse-vector Grouper lose privacy in
proportion to the change they see (the SVT proof shifts the threshold by the actual
query change), so the partitions together still cost ``epsilon``. Partition keys are treated as
public: the set of keys released is the set present in the events.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from dpsql import _validate, methods
from dpsql._groups import group_codes
from dpsql._names import checked_call
from dpsql.accounting import largest_share
from dpsql.budget import Budget
from dpsql.errors import InvalidData, InvalidParameter, RenamedParameter
from dpsql.ordering import refuse_nan_key, refuse_null_keys
from dpsql.publishing import publish
from dpsql.release import PartitionedRelease, Release
from dpsql.streams.windows import WINDOW_SMOOTHERS, window_sums
from dpsql.timegrid import TimeDomain, ticks, time_domain

#: Old names of count methods -> their registered names (:data:`dpsql.methods.COUNT_METHODS`, the
#: one name every front end uses); refused with a :class:`~dpsql.RenamedParameter` naming the new one.
RENAMED_METHODS = {"laplace": "count_laplace", "smoothed": "count_smoothed"}


@checked_call()
def pegasus(counts, *, epsilon: float, grouper_share: float | None = None, theta: float | None = None,
            smoother: str | None = None, sensitivity: float = 1.0, budget: Budget | None = None,
            note: str | None = None) -> Release:
    """Release a count stream with PeGaSus (perturb, group, smooth), online.

    Privacy cost: ``epsilon``-DP (pure) for add/remove-one-event neighbours in which one
    count changes by at most ``sensitivity`` (1 for event counts): the Perturber spends
    ``eps_p = (1 - grouper_share) * epsilon``, the Grouper ``eps_g = grouper_share *
    epsilon`` (``Release.components``); the Smoother is post-processing. Negative counts
    are clipped to 0 (the public lower bound of a count), which is part of the mechanism.

    Parameters
    ----------
    counts : array-like
        One count per time step, in time order.
    epsilon : float
        Total budget.
    grouper_share : float, optional
        Share of ``epsilon`` for the Grouper, in (0, 1); default 0.004 with the adaptive
        smoothers (derived in :mod:`dpsql.streams.pegasus`: 0.8 % over per-step Laplace where
        nothing smooths), 0.2 with the paper's smoothers.
    theta : float, optional
        Grouper deviation threshold; default with the adaptive smoothers: a constant stream's
        groups last 4096 steps on average (:func:`dpsql.streams.pegasus.default_theta`); with
        the paper's smoothers ``5 * sensitivity / eps_g``.
    smoother : {"adaptive", "grouped", "median", "average", "js"}, optional
        Estimate from the noisy counts released up to now; default ``"adaptive"``: per
        bucket, the adaptive smoother (:mod:`dpsql.streams.smoothing`) restarted at the
        current group or run over the whole stream, whichever has the lower risk on the
        buckets before (:class:`dpsql.streams.group_smoothing.GroupedOrWhole`, post-processing);
        ``"grouped"`` always the restarted one; ``"median"`` is the paper's.
    sensitivity : float
        The most one neighbour changes one count.
    budget : dpsql.Budget, optional
        Charged ``epsilon`` once, through :func:`dpsql.publish`.

    Returns
    -------
    dpsql.Release
        ``values`` are the estimates; ``error.range_variance`` is exact for ``average``
        and ``js``, an upper bound for ``median`` (see
        :class:`dpsql.streams.group_smoothing.GroupPrefixNoise`) and exact given the smoother's
        choices for ``adaptive`` and ``grouped`` (:class:`dpsql.streams.smoothing.AdaptiveNoise`); ``reports``
        are the Perturber's noisy counts (public), from which window sums are re-smoothed.

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> budget = dpsql.Budget.in_memory(epsilon=1.0)
    >>> with dpsql.testing.seeded(0):
    ...     rel = dpsql.pegasus(np.full(200, 12.0), epsilon=1.0, budget=budget)
    >>> budget.spent, dict(rel.components)["perturber"][0] + dict(rel.components)["grouper"][0]
    ((1.0, 0.0), 1.0)
    >>> bool(abs(rel.values[100:].mean() - 12.0) < 1.0)
    True
    """
    return publish("pegasus", counts, budget=budget, column="counts", note=note, epsilon=epsilon,
                   grouper_share=grouper_share, theta=theta, smoother=smoother, sensitivity=sensitivity)


# -- bucketing --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Buckets:
    """Counts per (partition, bucket): ``counts[p, i]``; ``keys[name][p]`` is partition
    ``p``'s value of key column ``name``."""

    counts: np.ndarray
    keys: dict[str, np.ndarray]
    domain: TimeDomain


def bucket_events(times, *, domain: TimeDomain, keys: Mapping[str, object] | None = None, units=None,
                  cap: int | None = None, order_by: str = "time") -> Buckets:
    """Count events per bucket of ``domain`` and per combination of ``keys`` columns.

    Events outside ``[start, stop)`` are dropped. With ``units`` and ``cap``, at most
    ``cap`` events of one unit are counted per bucket (the earliest, across partitions).

    Examples
    --------
    >>> d = time_domain(start=0, stop=10, every=5)
    >>> b = bucket_events([0, 1, 7, 12, -1], domain=d)
    >>> b.counts.tolist()
    [[2, 1]]
    >>> b = bucket_events([0, 1, 2, 7], domain=d, units=["u", "u", "v", "u"], cap=1)
    >>> b.counts.tolist()
    [[2, 1]]
    """
    times = ticks(times, order_by, domain.datetime)
    bucket = domain.buckets(times)
    keys = dict(keys or {})
    columns = {name: _key_column(values, name, len(times), partition=True) for name, values in keys.items()}
    keep = bucket >= 0
    if units is not None:
        if cap is None:
            raise InvalidParameter("cap (events counted per privacy unit and bucket) is required with a privacy "
                                   "unit column")
        unit_codes = _codes(_key_column(units, "privacy unit", len(times)))
        keep &= _within_cap(unit_codes, bucket, times, _validate.integer(cap, "cap", minimum=1))
    elif cap is not None:
        raise InvalidParameter("cap needs a privacy unit column (without one, each event counts once)")
    bucket = bucket[keep]
    if columns:
        partition = group_codes(*(_codes(c[keep]) for c in columns.values()))
        partitions = int(partition.max(initial=-1)) + 1
        first = np.flatnonzero(keep)[_first_index(partition, partitions)]
        key_values = {name: c[first] for name, c in columns.items()}
    else:
        partitions, partition, key_values = 1, np.zeros(bucket.size, dtype=np.int64), {}
    n_buckets = domain.n_buckets
    counts = np.bincount(partition * n_buckets + bucket, minlength=partitions * n_buckets)
    return Buckets(counts.reshape(partitions, n_buckets), key_values, domain)


def _key_column(values, name: str, n: int, *, partition: bool = False) -> np.ndarray:
    """``values``, one per event, without nulls: a partition key in the words every front end
    uses, a privacy unit in its own."""
    arr = np.asarray(values, dtype=object if not isinstance(values, np.ndarray) else None)
    if arr.shape != (n,):
        raise InvalidData(f"column {name!r} must have one value per event ({n}), got shape {arr.shape}")
    nulls = sum(v is None for v in arr) if arr.dtype == object else int(np.isnat(arr).sum()) if arr.dtype.kind in "mM" \
        else 0
    nans = int(np.isnan(arr).sum()) if arr.dtype.kind == "f" else 0
    if partition:  # the front ends refuse NULL keys before their columns become numpy (where NULL may be NaN)
        refuse_null_keys({name: nulls}, order_label=None, partition_labels=[name])
        if nans:
            refuse_nan_key(name, partition=True)
    nulls += nans
    if nulls:
        raise InvalidData(f"column {name!r} contains {nulls} null value(s); a key must be known for every event")
    return arr


def _codes(column: np.ndarray) -> np.ndarray:
    return np.unique(column, return_inverse=True)[1].ravel()


def _first_index(codes: np.ndarray, k: int) -> np.ndarray:
    first = np.full(k, len(codes), dtype=np.int64)
    np.minimum.at(first, codes, np.arange(len(codes)))
    return first


def _within_cap(unit: np.ndarray, bucket: np.ndarray, ticks: np.ndarray, cap: int) -> np.ndarray:
    """True for the first ``cap`` events (by time) of every (unit, bucket)."""
    order = np.lexsort((ticks, bucket, unit))
    u, b = unit[order], bucket[order]
    new_run = np.ones(len(order), dtype=bool)
    new_run[1:] = (u[1:] != u[:-1]) | (b[1:] != b[:-1])
    run_start = np.maximum.accumulate(np.where(new_run, np.arange(len(order)), 0))
    keep = np.empty(len(order), dtype=bool)
    keep[order] = np.arange(len(order)) - run_start < cap
    return keep


# -- release -------------------------------------------------------------------------------------


#: Output columns added to the bucket start and the key columns.
ROW, PART, LEVEL, COUNT, STD_ERROR = "dp_row", "dp_part", "dp_level", "dp_count", "dp_std_error"
WINDOW_SUM, WINDOW_STD_ERROR, ALARM = "dp_window_sum", "dp_window_std_error", "dp_alarm"


@dataclass(frozen=True)
class CountRelease:
    """A released set of count streams, one row per (level, partition, bucket).

    :meth:`columns` gives the table the front ends return; ``release`` is the
    underlying :class:`dpsql.Release` or :class:`dpsql.PartitionedRelease` (error bars
    per part). Window sums and alarms are post-processing of ``release``.
    """

    release: Release | PartitionedRelease
    domain: TimeDomain
    keys: dict[str, np.ndarray]
    levels: np.ndarray | None
    order_by: str
    window: int | None = None
    alarm_threshold: float | None = None
    window_smoother: str | None = None

    def parts(self) -> list[Release]:
        return list(self.release.parts) if isinstance(self.release, PartitionedRelease) else [self.release]

    def columns(self) -> dict[str, np.ndarray]:
        """The bucket start (named like the time column), the key columns (``None`` above
        a row's level), ``dp_level`` (hierarchies only), ``dp_count`` (the estimate),
        ``dp_std_error`` (its noise standard deviation), ``dp_row`` (bucket index) and
        ``dp_part`` (stream index); with ``window``, ``dp_window_sum`` (sum of the last
        ``window`` buckets, fewer at the start, formed as ``window_smoother`` says:
        :func:`dpsql.streams.windows.window_sums`) and ``dp_window_std_error``; with
        ``alarm_threshold``, ``dp_alarm`` (window sum >= threshold)."""
        n_buckets = self.domain.n_buckets
        parts = self.parts()
        rows = np.arange(n_buckets)
        out: dict[str, np.ndarray] = {self.order_by: np.tile(self.domain.bucket_starts(), len(parts))}
        for name, values in self.keys.items():
            out[name] = np.repeat(values, n_buckets)
        if self.levels is not None:
            out[LEVEL] = np.repeat(self.levels, n_buckets)
        out[COUNT] = np.concatenate([p.values for p in parts])
        out[STD_ERROR] = np.sqrt(np.concatenate([p.range_variance(rows, rows + 1) for p in parts]))
        out[ROW] = np.tile(rows, len(parts))
        out[PART] = np.repeat(np.arange(len(parts)), n_buckets)
        if self.window is not None:
            sums = [window_sums(p, window=self.window, smoother=self.window_smoother) for p in parts]
            out[WINDOW_SUM] = np.concatenate([total for total, _ in sums])
            out[WINDOW_STD_ERROR] = np.sqrt(np.concatenate([variance for _, variance in sums]))
            if self.alarm_threshold is not None:
                out[ALARM] = out[WINDOW_SUM] >= self.alarm_threshold
        return out


def check_count_method(method) -> str:
    """``method``, a registered count method; an old name is a :class:`~dpsql.RenamedParameter`
    naming the new one.

    >>> check_count_method("laplace")
    Traceback (most recent call last):
    ...
    dpsql.errors.RenamedParameter: count method 'laplace' is now called 'count_laplace'
    """
    if method in RENAMED_METHODS:
        raise RenamedParameter(f"count method {method!r} is now called {RENAMED_METHODS[method]!r}")
    return _validate.choice(method, "method", methods.COUNT_METHODS)


def release_event_counts(times, *, start, stop, every, epsilon: float, method: str = "pegasus",
                         keys: Mapping[str, object] | None = None, hierarchy: bool = False, units=None,
                         cap: int | None = None, window: int | None = None, alarm_threshold: float | None = None,
                         window_smoother: str | None = None,
                         budget: Budget | None = None, note: str | None = None, order_by: str = "time",
                         source: str | None = None, **params) -> CountRelease:
    """Bucket events over the public domain and release every count stream.

    Privacy cost: ``epsilon``-DP (pure), charged once. Neighbours: add/remove one event
    (sensitivity 1), or with ``units``/``cap`` all of one unit's events in one bucket
    (sensitivity ``cap``). Partitions compose in parallel. With ``hierarchy=True`` the key
    columns are levels, coarsest first (e.g. building, floor, room, access point): level
    ``l`` partitions by the first ``l`` columns, every event is counted once per level,
    and each level gets ``epsilon / L`` (sequential across levels, parallel within),
    as in PeGaSus's hierarchical aggregation (Chen et al., CCS 2017); the ledger is charged
    their exact sum, ``epsilon``.

    Parameters
    ----------
    times : array-like
        Event times (datetimes, or numbers with a numeric domain).
    start, stop, every :
        The public time domain ``[start, stop)`` and bucket width (:func:`time_domain`).
    method : {"pegasus", "count_laplace", "count_smoothed"}
        PeGaSus, per-bucket Laplace (the baseline), or per-bucket Laplace then the adaptive
        smoother (post-processing, same cost). The old names ``"laplace"`` and ``"smoothed"``
        are refused (:data:`RENAMED_METHODS`).
    keys : mapping of column name to array, optional
        Partition columns (one value per event).
    units, cap : optional
        Privacy-unit column (one value per event) and the most events of one unit
        counted per bucket.
    window, alarm_threshold : optional
        Add sliding-window sums over ``window`` buckets and the event-monitoring alarm
        ``window sum >= alarm_threshold`` to :meth:`CountRelease.columns` (free).
    source : str, optional
        What the front end read (recorded in the ledger; default ``"<n> event times"``).
    window_smoother : {"adaptive", "group", "none"}, optional
        How window sums are formed (:func:`dpsql.streams.windows.window_sums`): by default
        re-smoothed from the noisy counts known at the window's end for ``pegasus`` and
        ``count_smoothed``, the sum of the released values for ``count_laplace``; ``"group"`` (PeGaSus
        only) is the paper's group re-smoothing.
    **params
        PeGaSus parameters (``grouper_share``, ``theta``, ``smoother``).

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> times = np.array(["2024-01-01T00:01", "2024-01-01T00:07", "2024-01-01T00:08"], dtype="datetime64[ns]")
    >>> budget = dpsql.Budget.in_memory(epsilon=1.0)
    >>> with dpsql.testing.seeded(0):
    ...     out = release_event_counts(times, start="2024-01-01", stop="2024-01-01T00:30", every="5m",
    ...                                epsilon=1.0, keys={"floor": np.array([1, 1, 1]),
    ...                                                   "room": np.array(["a", "b", "b"])},
    ...                                hierarchy=True, budget=budget)
    >>> cols = out.columns()
    >>> len(cols["dp_count"]), cols["dp_level"][::6].tolist(), cols["room"][::6].tolist(), budget.spent
    (18, [1, 2, 2], [None, 'a', 'b'], (1.0, 0.0))
    """
    method = check_count_method(method)
    epsilon = _validate.epsilon(epsilon)
    window = None if window is None else _validate.integer(window, "window", minimum=1)
    if window_smoother is not None:
        window_smoother = _validate.choice(window_smoother, "window_smoother", WINDOW_SMOOTHERS)
        if window is None:
            raise InvalidParameter("window_smoother needs window (the number of buckets summed)")
        if window_smoother == "group" and method != "pegasus":
            raise InvalidParameter(f"window_smoother='group' re-smooths with PeGaSus's groups; method "
                                   f"{method!r} has none (use 'adaptive' or 'none')")
    if alarm_threshold is not None:
        if window is None:
            raise InvalidParameter("alarm_threshold needs window (the number of buckets summed)")
        alarm_threshold = _validate.real(alarm_threshold, "alarm_threshold")
    domain = time_domain(start=start, stop=stop, every=every)
    keys = dict(keys or {})
    if hierarchy and not keys:
        raise InvalidParameter("hierarchy needs at least one key column (the levels, coarsest first)")
    names = list(keys)
    level_columns = [names[:level] for level in range(1, len(names) + 1)] if hierarchy else [names]
    level_epsilon = largest_share(epsilon, epsilon / len(level_columns), count=len(level_columns))
    sensitivity = 1.0 if cap is None else float(_validate.integer(cap, "cap", minimum=1))
    blocks, key_rows, levels = [], {name: [] for name in names}, []
    for level, columns in enumerate(level_columns, start=1):
        b = bucket_events(times, domain=domain, keys={c: keys[c] for c in columns}, units=units, cap=cap,
                          order_by=order_by)
        if b.counts.shape[0] == 0:
            raise InvalidData(f"no event falls in [{start}, {stop}) : the partition keys are taken from the events, "
                              "so there is no stream to release")
        blocks.append(b.counts)
        levels += [level] * b.counts.shape[0]
        for name in names:
            key_rows[name].append(b.keys[name] if name in b.keys else np.full(b.counts.shape[0], None))
    if hierarchy:
        levels_note = f"hierarchy of {len(level_columns)} levels at epsilon / {len(level_columns)} each"
        note = f"{note}; {levels_note}" if note else levels_note
    counts = np.concatenate(blocks).astype(np.float64)
    partitioned = bool(names)  # keyed streams are addressed by their keys, even a single one
    offsets = np.arange(counts.shape[0] + 1) * domain.n_buckets if partitioned else None
    key_values = {name: np.concatenate(rows) for name, rows in key_rows.items()}
    partition_keys = None
    if partitioned:  # a partition's noise is addressed by its keys (and level, in a hierarchy)
        columns = [key_values[name].tolist() for name in names]
        partition_keys = [((level,) if hierarchy else ()) + tuple(column[k] for column in columns)
                          for k, level in enumerate(levels)]
        if not hierarchy and len(columns) == 1:  # one key column: the key itself, as every front end gives it
            partition_keys = [key for (key,) in partition_keys]
    release = publish(method, counts.ravel(), budget=budget, column="counts",
                      partition_offsets=offsets, partition_keys=partition_keys,
                      partition_levels=levels if partitioned else None, note=note,
                      source=f"{len(times)} event times" if source is None else source,
                      epsilon=level_epsilon, sensitivity=sensitivity, **params)
    return CountRelease(release, domain, key_values, np.asarray(levels) if hierarchy else None, order_by,
                        window, alarm_threshold, window_smoother)
