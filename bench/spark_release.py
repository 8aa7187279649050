"""Spark (issue 15 item 4): ``dpsql.spark.range_sum`` on 10^7 rows in 10^4 partitions on
``local[2]``, against a plain Spark job doing the least any per-partition release must do, and
against the DuckDB front end on the same machine.

    python bench/spark_release.py [--rows 10000000] [--partitions 10000] [--repeat 2]

The table: ``--partitions`` meters with ``rows / partitions`` readings each (integer time keys,
values from the traffic volumes tiled), built once in Spark from ``spark.range`` and cached in
memory (``df.cache()``, counted before timing), and built identically in DuckDB. Timed, taking
turns in every round (best and median of ``--repeat`` rounds after a warm-up round):

* plain: ``df.groupBy("g").applyInArrow(f)`` where ``f`` sorts its group by time and returns its
  rows with the cumulative sum of the values (the same rows out as the release);
* dpsql: ``dpsql.spark.range_sum(df, order_by="ts", value="v", partition_by="g", ...)``;
* the same release in DuckDB: ``SELECT * FROM dp_range_sum('t', 'ts', 'v', partition_by := 'g',
  ..., fresh := true)`` fetched as Arrow.

Every Spark job runs to the end with the ``noop`` sink (``df.write.format("noop")``): all
partitions computed, nothing collected on the driver. Each dpsql call charges an in-memory
budget once (the small null-key check is part of it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

sys.path.insert(0, str(Path(__file__).parent))
from _report import interleaved, markdown_table, write_section

import dpsql
import dpsql.duckdb
import dpsql.spark

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "traffic_volume_hourly.csv"
UPPER = 8000.0


def sorted_sums(table: pa.Table) -> pa.Table:
    """The plain job's work per group: sort by time, cumulative sum of the values."""
    table = table.sort_by("ts")
    return pa.table({"g": table["g"], "ts": table["ts"], "v": pc.cumulative_sum(table["v"])})


def task_costs(table: pa.Table, per: int, params: dict) -> tuple[list, int]:
    """Milliseconds of one group's Python work: the plain job's function and dpsql's task
    (tops, laplace), on up to 300 groups taken from ``table``, outside Spark; and the number of groups."""
    from dpsql.noise import Keystream
    from dpsql.publishing import PartitionTask

    groups = [table.slice(k * per, per) for k in range(min(300, table.num_rows // per))]
    key = Keystream.fresh().key
    tops = {k: v for k, v in params.items() if k != "method"}

    def run(work):
        return lambda: [work(g) for g in groups]

    def release(method, extra):
        task = PartitionTask(method=method, params=extra, private=True, key=key)
        return run(lambda g: dpsql.spark._release_partition(g, release=task, partition_by=["g"], order_by="ts",
                                                             value="v"))

    times = interleaved({"plain: sort by time, cumulative sum": run(sorted_sums),
                         "dpsql task, tops": release("tops", tops),
                         "dpsql task, laplace": release("laplace", {"epsilon": 1.0, "upper": UPPER})}, 5,
                        warm_up=True)
    return [[name, min(t) / len(groups) * 1e3] for name, t in times.items()], len(groups)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--partitions", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--shuffle-partitions", type=int, default=8)
    args = parser.parse_args()
    if shutil.which("java") is None:
        sys.exit("no Java runtime on PATH: Spark cannot start")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # the workers run this interpreter (and its dpsql)
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    spark = (SparkSession.builder.master("local[2]").appName("dpsql-bench")
             .config("spark.ui.enabled", "false").config("spark.driver.memory", "6g")
             .config("spark.sql.shuffle.partitions", str(args.shuffle_partitions))
             # every job gets all its shuffle partitions (no coalescing into fewer, unbalanced tasks)
             .config("spark.sql.adaptive.coalescePartitions.enabled", "false")
             .config("spark.sql.execution.arrow.pyspark.enabled", "true").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    per = args.rows // args.partitions
    rows = per * args.partitions
    volume = pacsv.read_csv(DATA).column("volume").to_numpy().astype(np.float64)
    table = pa.table({"g": np.arange(rows, dtype=np.int64) % args.partitions,
                      "ts": np.arange(rows, dtype=np.int64) // args.partitions,
                      "v": np.resize(volume, rows)})
    # the same rows in Spark, computed from the row id (no data shipped from the driver)
    n_volume = len(volume)
    volumes = spark.createDataFrame([(i, float(x)) for i, x in enumerate(volume)], "k long, v double")
    df = (spark.range(rows).select((F.col("id") % args.partitions).alias("g"),
                                   (F.col("id") / args.partitions).cast("long").alias("ts"),
                                   (F.col("id") % n_volume).alias("k"))
          .join(F.broadcast(volumes), "k").select("g", "ts", "v").repartition(8).cache())
    assert df.count() == rows

    params = dict(method="tops", epsilon=1.0, upper=UPPER, m=256)
    budget = dpsql.Budget.in_memory(epsilon=1e9)
    con = duckdb.connect()
    con.from_arrow(table).create("t")
    dpsql.duckdb.register(con, budget=budget)
    query = (f"SELECT * FROM dp_range_sum('t', 'ts', 'v', partition_by := 'g', method := 'tops', epsilon := 1, "
             f"upper := {UPPER}, m := 256, fresh := true)")

    def plain():
        df.groupBy("g").applyInArrow(sorted_sums, "g long, ts long, v double").write.format("noop") \
            .mode("overwrite").save()

    def release(method):
        def run():
            extra = params if method == "tops" else dict(method=method, epsilon=1.0, upper=UPPER)
            dpsql.spark.range_sum(df, order_by="ts", value="v", partition_by="g", budget=budget, **extra) \
                .write.format("noop").mode("overwrite").save()
        return run

    def in_duckdb():
        con.sql(query).to_arrow_table()

    def check_alone():
        from pyspark.sql import types as T

        dpsql.spark._refuse_bad_rows(df, ["g"], "ts", "v", T.DoubleType())

    per_group, timed_groups = task_costs(table.sort_by([("g", "ascending"), ("ts", "descending")]), per, params)
    from dpsql.mechanisms.noisy_max import candidate_grid, default_step

    candidates = len(candidate_grid(UPPER, default_step(UPPER)))
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    times = interleaved({"plain": plain, "dpsql": release("tops"), "dpsql_laplace": release("laplace"),
                         "duckdb": in_duckdb, "check": check_alone}, args.repeat, warm_up=True)
    elapsed = time.perf_counter() - start
    load_after = os.getloadavg()[0]
    best = {k: min(v) for k, v in times.items()}
    median = {k: float(np.median(v)) for k, v in times.items()}
    ratio = best["dpsql"] / best["plain"]
    table_rows = [
        ["plain Spark: `groupBy(g).applyInArrow` sort by time + cumulative sum", best["plain"], 1.0, 1.0],
        ["`dpsql.spark.range_sum` (tops)", best["dpsql"], ratio, median["dpsql"] / median["plain"]],
        ["`dpsql.spark.range_sum` (laplace)", best["dpsql_laplace"], best["dpsql_laplace"] / best["plain"],
         median["dpsql_laplace"] / median["plain"]],
        ["of which: the pre-charge check of keys and values alone (one aggregate job)", best["check"],
         best["check"] / best["plain"], median["check"] / median["plain"]],
        ["DuckDB `dp_range_sum(..., partition_by := 'g')` (tops, fresh)", best["duckdb"],
         best["duckdb"] / best["plain"], median["duckdb"] / median["plain"]],
    ]
    cause = ""
    if ratio > 1.5:
        cost = dict(per_group)
        extra = cost["dpsql task, tops"] - cost["plain: sort by time, cumulative sum"]
        cause = (f" Likely cause: the ToPS task's own work, {extra:.2f} ms more per group than the plain function "
                 f"(about {extra * args.partitions / 2e3:.1f} s over {args.partitions:,} groups on 2 workers, "
                 f"against {best['dpsql'] - best['plain']:.1f} s measured between the two jobs), and the "
                 f"pre-charge check ({best['check']:.1f} s alone): a time key repeated within a partition must be "
                 "refused before the charge, and finding one needs the keys grouped, a shuffle as large as the "
                 "plain job's.")
    body = (f"{rows:,} rows in {args.partitions:,} partitions of {per:,} (integer time keys; traffic volumes "
            f"tiled), Spark `local[2]` with {args.shuffle_partitions} shuffle partitions, the DataFrame cached in "
            f"memory; method `tops` with epsilon 1, upper {UPPER:g}, m 256 (a partition of {per:,} rows cannot "
            f"hold the default 4,096-row hold-out). Best of {args.repeat} interleaved rounds after a warm-up "
            f"round ({elapsed:.0f} s in all); ratios are best over best and median over median.\n\n"
            + markdown_table(["job", "best s", "x plain (best)", "x plain (median)"], table_rows)
            + f"\n\nTarget: dpsql at most 1.5x the plain job: **{'met' if ratio <= 1.5 else 'NOT met'}** with the "
              f"default method tops ({ratio:.2f}x); with laplace {best['dpsql_laplace'] / best['plain']:.2f}x. "
              f"The Python work per group, timed outside Spark on {timed_groups} groups of the same shape (best of 5, "
              "interleaved), shows where the difference comes from:\n\n"
            + markdown_table(["work per group of " + f"{per:,} rows", "ms"], per_group)
            + f"\n\nA ToPS partition chooses its threshold by Report-Noisy-Max over {candidates:,} candidates "
              "(upper / step), each scored and given a Laplace draw: the mechanism's own cost, the same per "
              "partition in every front end." + cause + " Load average (1 min) before / after: "
              f"{load_before:.2f} / {load_after:.2f} on {os.cpu_count()} cores.")
    spark.stop()
    write_section("spark_release", f"Spark: range_sum on {args.partitions:,} partitions", body)
    print(body)


if __name__ == "__main__":
    main()
