"""Partitioned private releases on Spark (``pip install 'dpsql[spark]'``, pyspark >= 4).

:func:`range_sum` and :func:`count_stream` release one private stream per partition, the
partitions being disjoint (one meter, one access point): the release costs the maximum over
partitions, which is every partition's cost. It is **charged once, on the driver, before any
task runs**; each partition is then released by the same online machines as everywhere in
dpsql, inside ``groupBy(partition).applyInArrow``, on the executors. No data comes back to the
driver (one aggregate job checks the keys and values first, so that a refused call charges
nothing and a charged release never fails on its data; finding a time key repeated within a
partition needs the keys grouped, a shuffle of the key columns about as costly as the release's).

Noise comes from the release's secret key and each draw's address (the partition's key,
the level, the position), :mod:`dpsql.noise`: the key travels to the executors inside the
tasks (never logged) and every task recomputes its partition's noise from it. A retried task,
a lost executor or a DataFrame collected twice therefore gives identical values and costs
nothing more. With test noise (:func:`dpsql.testing.seeded`) a Spark release equals the local
``partition_by`` release of the same table value for value.

Identical noise on re-execution assumes identical input: Spark re-reads a DataFrame's sources
when it re-executes it, and two executions over *different* data with the same noise would
reveal their difference. Release from a fixed snapshot (a Parquet/Delta version, or
``df.checkpoint()``) when the source can change.

Executors need dpsql installed (the same version as the driver).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from dpsql import _validate
from dpsql._frontend import COUNT_METHOD, RANGE_SUM_METHOD, refuse_renamed
from dpsql.budget import Budget
from dpsql.counts import check_count_method
from dpsql.errors import InvalidData, InvalidParameter, InvalidTimeKey
from dpsql.methods import COUNT_METHODS, check_method
from dpsql.ordering import refuse_null_event_times, refuse_null_keys
from dpsql.publishing import DistributedRelease, PartitionTask
from dpsql.timegrid import time_domain

COUNT = "dp_count"


def range_sum(df, *, order_by: str, value: str, partition_by, method: str = RANGE_SUM_METHOD, epsilon: float,
              budget: Budget | None = None, note: str | None = None, **params):
    """Release ``value`` as one private stream per ``partition_by`` group, in ``order_by`` order.

    Returns a lazy Spark DataFrame: the partition columns, the order key and the private value
    (named like ``value``), one row per input row. Privacy cost: that of ``method`` with
    ``params`` (see :mod:`dpsql.methods`), replace-one-value neighbours, partitions in parallel:
    charged once to ``budget`` (default: :func:`dpsql.use_budget`'s) when this function is
    called. Parameters a one-shot release derives from a table's length are not known to the
    driver: PAK needs ``delta``.

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
    _refuse_bad_rows(df, partition_by, order_by, value, fields[value].dataType)
    partition_task = release.charge()
    schema = ", ".join(f"`{c}` {fields[c].dataType.simpleString()}" for c in [*partition_by, order_by]) \
        + f", `{value}` double"
    task = _task(_release_partition, release=partition_task, partition_by=partition_by, order_by=order_by,
                 value=value)
    return df.select(*partition_by, order_by, value).groupBy(*partition_by).applyInArrow(task, schema)


def count_stream(df, *, order_by: str | None = None, every, start, stop, partition_by, method: str = COUNT_METHOD,
                 epsilon: float, budget: Budget | None = None, note: str | None = None, **params):
    """Private counts of the events of ``df`` per bucket of the public time domain ``[start,
    stop)`` cut every ``every`` (never read from the data), one stream per ``partition_by``
    group: PeGaSus (``method="pegasus"``), per-bucket Laplace (``"count_laplace"``) or
    per-bucket Laplace then the adaptive smoother (``"count_smoothed"``).

    Returns a lazy Spark DataFrame: the partition columns, the bucket start (named like ``order_by``)
    and ``dp_count``, every bucket of the domain (empty ones too). Events outside the domain
    are counted nowhere. Privacy cost: ``epsilon`` for add/remove-one-event neighbours,
    partitions in parallel, charged once on the driver.
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
    nulls = _null_counts(df, [*partition_by, order_by])
    refuse_null_keys(nulls, order_label=None, partition_labels=partition_by)
    refuse_null_event_times(order_by, nulls[order_by])
    partition_task = release.charge()
    bucket = F.floor((ticks - F.lit(domain.start)) / F.lit(domain.every)).cast("long")
    counted = (df.select(*partition_by, bucket.alias("__bucket"))
               .where((F.col("__bucket") >= 0) & (F.col("__bucket") < domain.n_buckets))
               .groupBy(*partition_by, "__bucket").count())
    time_type = "timestamp_ntz" if domain.datetime else "double"
    schema = ", ".join(f"`{c}` {fields[c].dataType.simpleString()}" for c in partition_by) \
        + f", `{order_by}` {time_type}, `{COUNT}` double"
    task = _task(_release_counts, release=partition_task, partition_by=partition_by, order_by=order_by,
                 domain=domain)
    return counted.groupBy(*partition_by).applyInArrow(task, schema)


def _task(function, **arguments):
    """The function Spark runs per group (``pyarrow.Table`` in and out, as its type hints say)."""
    def task(table: pa.Table) -> pa.Table:
        return function(table, **arguments)

    return task


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


def _null_counts(df, columns: list[str]) -> dict[str, int]:
    """The NULL values of each key column, in one small aggregate job (a NULL key is refused before
    anything is charged, with every front end's message)."""
    from pyspark.sql import functions as F

    nulls = df.select([F.sum(F.col(c).isNull().cast("long")).alias(c) for c in columns]).first()
    return {column: nulls[column] or 0 for column in columns}


def _refuse_bad_rows(df, partition_by: list[str], order_by: str, value: str, value_type) -> None:
    """One aggregate job over the keys and the value, before the charge: every refusal a task
    would make (a null key, an order key repeated within a partition, a value that is null,
    NaN, infinite or an integer float64 cannot hold) is made here, so a refused call charges
    nothing and a charged release never fails on its data."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    keys = [*partition_by, order_by]
    v = F.col(value)
    if isinstance(value_type, (T.FloatType, T.DoubleType)):
        non_finite = F.isnan(v) | (F.abs(v) == F.lit(float("inf")))
    elif isinstance(value_type, T.IntegralType):
        non_finite = (v > F.lit(_validate._EXACT_INTEGERS)) | (v < F.lit(-_validate._EXACT_INTEGERS))
    else:
        non_finite = F.lit(False)
    per_key = df.groupBy(*keys).agg(F.count(F.lit(1)).alias("rows"),
                                    F.sum(v.isNull().cast("long")).alias("nulls"),
                                    F.sum(F.coalesce(non_finite, F.lit(False)).cast("long")).alias("non_finite"))
    any_null_key = F.lit(False)
    for column in keys:
        any_null_key = any_null_key | F.col(column).isNull()
    found = per_key.agg(*[F.sum(F.when(F.col(c).isNull(), F.col("rows"))).alias(f"null_{k}")
                          for k, c in enumerate(keys)],
                        F.sum(F.when(~any_null_key & (F.col("rows") > 1), 1)).alias("repeated"),
                        F.sum("nulls").alias("nulls"), F.sum("non_finite").alias("non_finite")).first()
    refuse_null_keys({column: found[f"null_{k}"] or 0 for k, column in enumerate(keys)}, order_label=order_by,
                     partition_labels=partition_by)
    if found["repeated"]:
        raise InvalidTimeKey(f"order column {order_by!r} has a duplicate value within a partition "
                             f"({found['repeated']} repeated key(s)); time keys must be unique within a partition")
    if found["nulls"]:
        raise InvalidData(f"column {value!r} contains {found['nulls']} null value(s); drop or impute them before a "
                          "private release")
    if found["non_finite"]:
        what = "NaN or infinite" if isinstance(value_type, (T.FloatType, T.DoubleType)) else "integers beyond 2**53"
        raise InvalidData(f"column {value!r} contains {found['non_finite']} {what} value(s); clean them before a "
                          "private release")


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


# -- on the executors ------------------------------------------------------------------------------

def _partition_key(table: pa.Table, partition_by: list[str]):
    values = [table.column(c)[0].as_py() for c in partition_by]
    return values[0] if len(values) == 1 else tuple(values)


def _release_partition(table: pa.Table, *, release: PartitionTask, partition_by: list[str], order_by: str,
                       value: str) -> pa.Table:
    """One partition's release (a task): in time order, from the partition's addressed draws."""
    table = table.sort_by(order_by)
    times = table.column(order_by)
    if len(times) > 1 and pa.compute.any(pa.compute.equal(times.slice(1), times.slice(0, len(times) - 1))).as_py():
        raise InvalidTimeKey(f"order column {order_by!r} has a duplicate value within a partition; time keys must "
                             "be unique within a partition")
    values = _validate.values(table.column(value), value)
    released = release.release(_partition_key(table, partition_by), values)
    return pa.table({**{c: table.column(c) for c in partition_by}, order_by: times,
                     value: pa.array(released, pa.float64())})


def _release_counts(table: pa.Table, *, release: PartitionTask, partition_by: list[str], order_by: str,
                    domain) -> pa.Table:
    """One partition's count stream: every bucket of the domain (empty ones count 0)."""
    counts = np.zeros(domain.n_buckets)
    counts[table.column("__bucket").to_numpy()] = table.column("count").to_numpy()
    released = release.release(_partition_key(table, partition_by), counts)
    starts = pa.array(domain.bucket_starts()).cast(pa.timestamp("us")) if domain.datetime else pa.array(
        domain.bucket_starts(), pa.float64())
    return pa.table({**{c: pa.repeat(table.column(c)[0], len(counts)) for c in partition_by},
                     order_by: starts, COUNT: pa.array(released, pa.float64())})
