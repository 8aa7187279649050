"""Partitioned private releases on Spark (``pip install 'dpsql[spark]'``, pyspark >= 4).

:func:`range_sum` and :func:`count_stream` release one private stream per partition, the
partitions being disjoint (one meter, one access point): the release costs the maximum over
partitions, which is every partition's cost. It is **charged once, on the driver, before any
value is released**; the partitions are then released by the same online machines as everywhere
in dpsql, on the executors, many whole partitions per Arrow batch. No data comes back to the
driver.

Before the charge, one job over the data (the rows shuffled by partition and sorted by order
key, as the release reads them) runs dpsql's code on the executors and reports per partition
its length, a keyed digest of exactly the rows its release will consume, and everything a
release refuses (NULL or NaN keys, an order key repeated within a partition, a NULL, NaN,
infinite or beyond-2**53 value, a length the method refuses, such as a partition's own hold-out
longer than the partition). A partitioned ToPS or PAK release learns one threshold for the
fleet by default (``threshold_by="fleet"``, :func:`dpsql.fleets.fleet_threshold`): from the
fleet's ``m`` earliest rows by order key, ties by partition address, as the local release does.
The same job offers each partition's first rows as candidates (:data:`OFFERED_ROWS`, then, if
the fleet's earliest partitions give the pool more, again with ``m``); the driver picks the pool
and charges, and only then the threshold is chosen (its noise drawn after the charge). If that
job fails, a tiny one (:func:`check_executors`) says whether the executors
are the cause (dpsql not importable, another version of it, no pandas or pyarrow), with a
:class:`dpsql.EnvironmentUnusable` naming what is missing. A refused call charges nothing; a
charged release never fails on its data or its executors' environment.

Noise comes from the release's secret key and each draw's address (the partition's key, the
level, the position), :mod:`dpsql.noise`: the key travels to the executors inside the tasks
(never logged) and every task recomputes its partitions' noise from it. A retried task, a lost
executor or a DataFrame collected twice therefore gives identical values and costs nothing
more. Spark re-reads a DataFrame's sources when it re-executes it: a task whose partition's
rows differ from those checked before the charge (the source changed since) releases nothing
of it and fails with :class:`dpsql.DataChanged` (release again: a new, charged release), so the
same noise never covers two versions of the data. With test noise (:func:`dpsql.testing.seeded`)
a Spark release equals the local ``partition_by`` release of the same table value for value
(blocks by row counts: locally, ``calendar="none"`` for time keys on a calendar grid).

Needs a classic Spark session (a SparkContext: the check's digests reach the executors as a
broadcast), not Spark Connect.
"""

from __future__ import annotations

import functools

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

import dpsql
from dpsql._frontend import COUNT_METHOD, RANGE_SUM_METHOD, refuse_renamed
from dpsql._spark_environment import check_executors
from dpsql._spark_tasks import (
    BUCKET,
    CHECKED,
    EVENTS,
    NAN_EVENTS,
    POOL_KEYS,
    POOL_VALUES,
    check_batches,
    read_counts,
    read_values,
    release_batches,
    released_counts,
    released_rows,
)
from dpsql.addresses import address_ranks, partition_addresses, refuse_repeated
from dpsql.budget import Budget
from dpsql.counts import check_count_method
from dpsql.errors import InvalidData, InvalidParameter
from dpsql.methods import COUNT_METHODS, check_method
from dpsql.ordering import refuse_duplicate_time, refuse_nan_key, refuse_null_event_times, refuse_null_keys
from dpsql.partition_digests import AdmittedPartitions
from dpsql.parts import Keys
from dpsql.publishing import DistributedRelease
from dpsql.streams.holdout import pooled_by_key
from dpsql.timegrid import time_domain

COUNT = "dp_count"
#: The rows each partition first offers a fleet's pooled hold-out (the check's candidates): enough when the
#: partitions start about together and are at least an eighth as many as the pool's rows (512 for the default
#: 4,096); else the check runs again, each partition offering as many rows as the pool holds.
OFFERED_ROWS = 8


def range_sum(df, *, order_by: str, value: str, partition_by, method: str = RANGE_SUM_METHOD, epsilon: float,
              budget: Budget | None = None, note: str | None = None, **params):
    """Release ``value`` as one private stream per ``partition_by`` group, in ``order_by`` order.

    Returns a lazy Spark DataFrame: the partition columns, the order key and the private value
    (named like ``value``), one row per input row. Privacy cost: that of ``method`` with
    ``params`` (see :mod:`dpsql.methods`), replace-one-value neighbours, partitions in parallel:
    charged once to ``budget`` (default: :func:`dpsql.use_budget`'s) when this function is
    called, after the executors and the data were checked (a refusal charges nothing). The
    DataFrame releases only the rows checked then: collected again after its source changed, it
    fails with :class:`dpsql.DataChanged` instead of releasing new values with the same noise.
    ToPS (the default) and PAK learn one clipping threshold for the fleet from its ``m`` earliest
    rows (``threshold_by="fleet"``), so partitions of any length are released; with
    ``threshold_by="partition"`` each partition's own first ``m`` rows give its threshold.
    Parameters a one-shot release derives from a table's length are not known to the driver:
    PAK needs ``delta``.

    Examples
    --------
    On a Spark DataFrame ``readings`` (tests/spark runs this on ``local[2]``)::

        out = dpsql.spark.range_sum(readings, order_by="ts", value="kwh", partition_by="meter",
                                    epsilon=1.0, upper=50.0, budget=budget)
    """
    refuse_renamed("dpsql.spark.range_sum()", params)
    partition_by = _columns(partition_by)
    check_method(method, per_row=True)
    if method in COUNT_METHODS:
        raise InvalidParameter(f"method {method!r} releases counts of events: use dpsql.spark.count_stream")
    fields = _fields(df, [*partition_by, order_by, value])
    _require_numeric(fields[value], value)
    for column in [*partition_by, order_by]:
        _require_key_type(fields[column], column)
    release = DistributedRelease(method, {"epsilon": epsilon, **params}, budget=budget, note=note,
                                 source=f"Spark columns {', '.join([*partition_by, order_by, value])}")
    release.check()  # a budget too small is refused before any Spark job runs
    staged = _staged(df.select(*partition_by, order_by, value), partition_by, order_by)
    read = functools.partial(read_values, partition_by=partition_by, order_by=order_by, value=value)

    def checked(offered: int) -> tuple[pa.Table, pa.Array]:
        """The check job (each partition offering the pool its first ``offered`` rows), and what it refuses."""
        pool = None if release.holdout is None else (offered, release.holdout)
        found = _checked(staged, release, partition_by, read, order_by=order_by, value=value, pool=pool)
        if not found.num_rows:
            raise InvalidData(f"column {value!r} is empty: nothing to release")
        _refuse_found(found, partition_by, order_by, events=False)
        _refuse_values(found, value, fields[value].dataType)
        release.check(rows=pc.sum(found.column("rows")).as_py())  # a pool of all the rows, or more
        return found, _addresses(found, partition_by)

    found, addresses = checked(OFFERED_ROWS)
    pooled = pool = None
    if release.holdout is not None:
        pooled, pool, decided = _fleet_pool(found, address_ranks(addresses), release.holdout, OFFERED_ROWS)
        if not decided:  # a partition may give the pool more rows than it offered
            found, addresses = checked(release.holdout)
            pooled, pool, _ = _fleet_pool(found, address_ranks(addresses), release.holdout, release.holdout)
    schema = ", ".join(f"`{c}` {fields[c].dataType.simpleString()}" for c in [*partition_by, order_by]) \
        + f", `{value}` double"
    output = functools.partial(released_rows, partition_by=partition_by, order_by=order_by, value=value)
    return _charged(staged, release, found, found.column("rows").to_numpy(), partition_by=partition_by, read=read,
                    output=output, schema=schema, pooled=pooled, pool=pool)


def count_stream(df, *, order_by: str | None = None, every, start, stop, partition_by, method: str = COUNT_METHOD,
                 epsilon: float, budget: Budget | None = None, note: str | None = None, **params):
    """Private counts of the events of ``df`` per bucket of the public time domain ``[start,
    stop)`` cut every ``every`` (never read from the data), one stream per ``partition_by``
    group: PeGaSus (``method="pegasus"``), per-bucket Laplace (``"count_laplace"``) or
    per-bucket Laplace then the adaptive smoother (``"count_smoothed"``).

    Returns a lazy Spark DataFrame: the partition columns, the bucket start (named like ``order_by``)
    and ``dp_count``, every bucket of the domain (empty ones too) for every partition with an
    event in the domain. Events outside the domain are counted nowhere. Privacy cost:
    ``epsilon`` for add/remove-one-event neighbours, partitions in parallel, charged once on the
    driver after the same checks as :func:`range_sum` (a refusal charges nothing; the DataFrame
    releases only the counts checked then).
    """
    refuse_renamed("dpsql.spark.count_stream()", params)
    if order_by is None:
        raise InvalidParameter("dpsql.spark.count_stream() needs order_by, the event time column")
    check_count_method(method)
    partition_by = _columns(partition_by)
    fields = _fields(df, [*partition_by, order_by])
    for column in partition_by:
        _require_key_type(fields[column], column)
    domain = time_domain(start=start, stop=stop, every=every)
    from pyspark.sql import functions as F

    ticks = _spark_ticks(F.col(order_by), fields[order_by], domain.datetime, order_by)
    release = DistributedRelease(method, {"epsilon": epsilon, **params}, budget=budget, note=note,
                                 source=f"Spark events, columns {', '.join([*partition_by, order_by])}")
    release.check()  # a budget too small is refused before any Spark job runs
    at_nan = F.isnan(ticks) if not domain.datetime else F.lit(False)
    bucket = F.when(at_nan, None).otherwise(F.floor((ticks - F.lit(domain.start)) / F.lit(domain.every)))
    counted = (df.select(*partition_by, bucket.cast("long").alias(BUCKET),
                         at_nan.cast("long").alias(NAN_EVENTS))
               .groupBy(*partition_by, BUCKET).agg(F.count(F.lit(1)).alias(EVENTS), F.sum(NAN_EVENTS).alias(
                   NAN_EVENTS)))
    staged = _staged(counted, partition_by, BUCKET)
    read = functools.partial(read_counts, partition_by=partition_by, domain=domain)
    found = _checked(staged, release, partition_by, read)
    _refuse_found(found, partition_by, order_by, events=True)
    released = found.filter(pc.is_valid(found.column("digest")))
    if not released.num_rows:
        raise InvalidData(f"no event of column {order_by!r} falls in the domain [{start!s}, {stop!s}): nothing to "
                          "release")
    _addresses(released, partition_by)
    time_type = "timestamp_ntz" if domain.datetime else "double"
    schema = ", ".join(f"`{c}` {fields[c].dataType.simpleString()}" for c in partition_by) \
        + f", `{order_by}` {time_type}, `{COUNT}` double"
    output = functools.partial(released_counts, partition_by=partition_by, order_by=order_by, count=COUNT,
                               domain=domain)
    return _charged(staged, release, released, np.full(released.num_rows, domain.n_buckets),
                    partition_by=partition_by, read=read, output=output, schema=schema)


def _task(function, **arguments):
    """The function Spark runs per task over its Arrow batches (``mapInArrow``)."""
    def task(batches):
        return function(batches, **arguments)

    return task


def _staged(df, partition_by: list[str], order_by: str):
    """The rows as both jobs read them: shuffled by partition key and sorted by partition, then
    order key, so that a task's batches hold whole partitions' rows adjacent and in order (Spark
    hashes and orders -0.0 as 0.0, as :func:`dpsql.noise.partition_address` does)."""
    return df.repartition(*partition_by).sortWithinPartitions(*partition_by, order_by)


def _checked(staged, release: DistributedRelease, partition_by: list[str], read, *, order_by: str | None = None,
             value: str | None = None, pool: tuple[int, int] | None = None) -> pa.Table:
    """The check job: one row per partition (:data:`CHECKED`, and with ``pool`` its candidates
    for the fleet's pooled hold-out). It runs dpsql's code on the executors as the release will
    (its tasks also compare their dpsql's version with the driver's), so when it fails,
    :func:`check_executors` says whether their environment is why."""
    fields = {f.name: f.dataType.simpleString() for f in staged.schema.fields}
    columns = [*(f"`{c}` {fields[c]}" for c in partition_by), *(f"`{c}` {t}" for c, t in CHECKED.items())]
    if pool is not None:
        columns += [f"`{POOL_KEYS}` array<{fields[order_by]}>", f"`{POOL_VALUES}` array<double>"]
    task = _task(check_batches, fingerprint=release.fingerprint, partition_by=partition_by, read=read,
                 order_by=order_by, value=value, version=dpsql.__version__, pool=pool)
    try:
        return staged.mapInArrow(task, ", ".join(columns)).toArrow()
    except Exception:
        check_executors(staged.sparkSession)  # refuses, naming what is missing, if the environment is the cause
        raise


def _addresses(found: pa.Table, partition_by: list[str]) -> pa.Array:
    """The noise addresses of the partitions the check found, each one once: Spark grouped the
    rows by its own equality, and a key that Spark tells apart from another but dpsql does not
    would give two partitions one noise (refused before the charge)."""
    addresses = partition_addresses(found.select(partition_by).columns)
    refuse_repeated(addresses, Keys(found.select(partition_by).columns))
    return addresses


def _fleet_pool(found: pa.Table, ranks: np.ndarray, holdout: int, offered: int
                ) -> tuple[np.ndarray, np.ndarray, bool]:
    """The fleet's pooled hold-out (:func:`dpsql.streams.holdout.pooled_by_key`: its ``holdout``
    earliest rows, ties by partition address, ``ranks``) among the check's candidates (each
    partition's first ``offered`` rows at most): each partition's pooled rows, the pooled values,
    and whether the candidates decide it. They do unless a partition that offered ``offered``
    rows, all pooled, has more whose next one may come before the pool's latest order key."""
    keys = found.column(POOL_KEYS).combine_chunks()
    counts = pc.list_value_length(keys).to_numpy(zero_copy_only=False).astype(np.int64)
    keys = keys.flatten()
    owner = np.repeat(np.arange(len(counts)), counts)
    starts = np.cumsum(counts) - counts
    pooled = pooled_by_key(keys, owner, ranks, holdout, len(counts))
    pool = found.column(POOL_VALUES).combine_chunks().flatten().to_numpy()[
        np.arange(len(keys)) - starts[owner] < pooled[owner]]
    cut = (pooled == offered) & (found.column("rows").to_numpy() > offered)
    if not cut.any():
        return pooled, pool, True
    if pooled.sum() < holdout:
        return pooled, pool, False
    latest = pc.max(keys.take(starts[pooled > 0] + pooled[pooled > 0] - 1))
    return pooled, pool, not pc.any(pc.not_equal(keys.take(starts[cut] + offered - 1), latest)).as_py()


def _charged(staged, release: DistributedRelease, found: pa.Table, lengths: np.ndarray, *, partition_by, read,
             output, schema: str, pooled: np.ndarray | None = None, pool: np.ndarray | None = None):
    """Charge the checked release and return its lazy DataFrame: the digests of the partitions
    checked (``found``, all with a digest; their machines' ``lengths``) and their rows in the
    fleet's pooled hold-out (``pooled``, whose values are ``pool``) go to the executors once (a
    broadcast), and each task releases only those partitions."""
    digests = pc.cast(found.column("digest").combine_chunks(), pa.binary(16))
    admitted = AdmittedPartitions(np.frombuffer(digests.buffers()[1], dtype="S16", count=len(digests),
                                                offset=digests.offset * 16), pooled)
    pooled_rows = np.zeros(len(lengths), np.int64) if pooled is None else pooled
    _, first = np.unique(np.stack([lengths, pooled_rows], axis=1), axis=0, return_index=True)
    keys = Keys(found.select(partition_by).columns)
    shapes = {(int(lengths[k]), int(pooled_rows[k])): keys[int(k)] for k in first.tolist()}
    shipped = staged.sparkSession.sparkContext.broadcast(admitted)
    try:
        task = release.charge(shapes=shapes, admitted=_Broadcast(shipped), rows=int(lengths.sum()), pool=pool)
    except BaseException:
        shipped.destroy()
        raise
    return staged.mapInArrow(_task(release_batches, task=task, partition_by=partition_by, read=read, output=output,
                                   version=dpsql.__version__), schema)


class _Broadcast:
    """The admitted digests as the executors read them (a broadcast: shipped once, not with each task)."""

    def __init__(self, broadcast):
        self._broadcast = broadcast

    def lookup(self, digests) -> np.ndarray:
        return self._broadcast.value.lookup(digests)


def _refuse_found(found: pa.Table, partition_by: list[str], order_by: str, *, events: bool) -> None:
    """Refuse what the check found of the keys (in every front end's words): NULL or NaN partition
    keys, NULL or NaN order keys (event times), order keys repeated within a partition."""
    rows = found.column("rows")
    nulls = {c: pc.sum(pc.filter(rows, pc.is_null(found.column(c)))).as_py() or 0 for c in partition_by}
    null_order = pc.sum(found.column("null_keys")).as_py() or 0
    if events:
        refuse_null_keys(nulls, order_label=None, partition_labels=partition_by)
        refuse_null_event_times(order_by, null_order)
    else:
        refuse_null_keys({**nulls, order_by: null_order}, order_label=order_by, partition_labels=partition_by)
    for column in partition_by:
        if pa.types.is_floating(found.schema.field(column).type) and pc.any(pc.is_nan(found.column(column))).as_py():
            refuse_nan_key(column, partition=True)
    if pc.sum(found.column("nan_keys")).as_py():
        refuse_nan_key(order_by, events=events)
    repeated = pc.filter(found.column("repeated_key"), pc.is_valid(found.column("repeated_key")))
    if len(repeated):
        refuse_duplicate_time(order_by, repeated[0].as_py(), partition_by)


def _refuse_values(found: pa.Table, value: str, value_type) -> None:
    from pyspark.sql import types as T

    nulls = pc.sum(found.column("null_values")).as_py()
    if nulls:
        raise InvalidData(f"column {value!r} contains {nulls} null value(s); drop or impute them before a private "
                          "release")
    bad = pc.sum(found.column("bad_values")).as_py()
    if bad:
        what = "NaN or infinite" if isinstance(value_type, (T.FloatType, T.DoubleType)) else "integers beyond 2**53"
        raise InvalidData(f"column {value!r} contains {bad} {what} value(s); clean them before a private release")


def _columns(partition_by) -> list[str]:
    if partition_by is None:
        raise InvalidParameter("partition_by is required on Spark: each partition is released by its own task")
    columns = [partition_by] if isinstance(partition_by, str) else list(partition_by)
    if not columns or not all(isinstance(c, str) and c for c in columns):
        raise InvalidParameter(f"partition_by must be a column name or a list of them, got {partition_by!r}")
    return columns


def _fields(df, columns: list[str]) -> dict:
    """The Spark fields of ``columns`` (the order key, value or time column last), each named once."""
    if not all(hasattr(df, a) for a in ("schema", "groupBy", "select")):
        raise InvalidParameter(f"df must be a pyspark.sql.DataFrame, got {type(df).__name__}")
    if not all(isinstance(c, str) and c for c in columns):
        raise InvalidParameter(f"column names must be non-empty strings, got {columns[-1]!r} / {columns!r}")
    if len(set(columns)) != len(columns):
        raise InvalidParameter(f"a column cannot play two roles (partition, order key, value): {columns!r}")
    present = {f.name: f for f in df.schema.fields}
    missing = [c for c in columns if c not in present]
    if missing:
        raise InvalidParameter(f"column(s) {', '.join(map(repr, missing))} not found in the DataFrame; it has "
                               f"{', '.join(map(repr, present))}")
    return {c: present[c] for c in columns}


def _require_numeric(field, column: str) -> None:
    from pyspark.sql import types as T

    if not isinstance(field.dataType, T.NumericType):
        raise InvalidData(f"column {column!r} must be numeric, got {field.dataType.simpleString()}")


def _require_key_type(field, column: str) -> None:
    from pyspark.sql import types as T

    usable = (T.NumericType, T.StringType, T.DateType, T.TimestampType, T.TimestampNTZType, T.BooleanType)
    if not isinstance(field.dataType, usable):
        raise InvalidData(f"key column {column!r} has type {field.dataType.simpleString()}, which dpsql cannot use "
                          "as a partition or order key (use numbers, strings, dates or timestamps)")
    collation = getattr(field.dataType, "collation", "UTF8_BINARY") if isinstance(field.dataType, T.StringType) \
        else "UTF8_BINARY"
    if collation != "UTF8_BINARY":
        raise InvalidData(f"key column {column!r} has collation {collation}, by which Spark groups and orders text "
                          "that dpsql tells apart by its bytes (keys equal to Spark would share noise, or be "
                          f"ordered at random): use its plain text, CAST({column} AS STRING COLLATE UTF8_BINARY)")


def _spark_ticks(column, field, datetime: bool, name: str):
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    if not datetime:
        if not isinstance(field.dataType, T.NumericType):
            raise InvalidData(f"the time column {name!r} must hold numbers for numeric bounds, got "
                              f"{field.dataType.simpleString()}")
        return column.cast("double")
    if isinstance(field.dataType, T.DateType):
        return F.unix_date(column).cast("long") * F.lit(86_400 * 10**9)
    if isinstance(field.dataType, (T.TimestampType, T.TimestampNTZType)):
        return F.unix_micros(column.cast("timestamp")) * F.lit(1000)
    raise InvalidData(f"the time column {name!r} must hold timestamps or dates for datetime bounds, got "
                      f"{field.dataType.simpleString()}")
