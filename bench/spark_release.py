"""Spark (issues 21 and 23): ``dpsql.spark.range_sum`` on fleets of partitions on ``local[2]``,
against a plain Spark job doing the least any per-partition release must do, in the same run.

    python bench/spark_release.py [--shapes 10000x100,1000x1000] [--repeat 3]

Each shape ``PxN``: ``P`` partitions (meters) of ``N`` rows (integer time keys, values from the
traffic volumes tiled), built in Spark from ``spark.range`` and cached in memory (``df.cache()``,
counted before timing). Timed, taking turns in every round (best and median of ``--repeat``
rounds after a warm-up round):

* plain: ``df.groupBy("g").applyInArrow(f)`` where ``f`` sorts its group by time and returns its
  rows with the cumulative sum of the values (the same rows out as the release);
* dpsql: ``dpsql.spark.range_sum(df, order_by="ts", value="v", partition_by="g", ...)`` with
  ``laplace``; the default ``tops``, which learns one threshold for the fleet from its 4,096
  earliest rows (the check job gathers them, the driver chooses the threshold after the charge);
  and ``tops`` with ``threshold_by="partition"``, each partition's own hold-out (``m`` a quarter
  of the partition), the cost a fleet threshold removes.

A dpsql release is the call (the check job over the data, then the charge of an in-memory
budget) plus the release job; both are timed, and reported apart. Every Spark job runs to the
end with the ``noop`` sink (``df.write.format("noop")``): all partitions computed, nothing
collected on the driver.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

sys.path.insert(0, str(Path(__file__).parent))
from _report import interleaved, markdown_table, write_section

import dpsql
import dpsql.spark

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "traffic_volume_hourly.csv"
UPPER = 8000.0
#: Issue 21's target: a fleet (10^4 partitions of 100 rows) released within 2x the plain job.
TARGET, TARGET_SHAPE = 2.0, "10000x100"
FLEET, OWN = "tops (default: the fleet's threshold)", "tops, threshold_by=\"partition\""


def sorted_sums(table: pa.Table) -> pa.Table:
    """The plain job's work per group: sort by time, cumulative sum of the values."""
    table = table.sort_by("ts")
    return pa.table({"g": table["g"], "ts": table["ts"], "v": pc.cumulative_sum(table["v"])})


def fleet(spark, partitions: int, per: int, volume: np.ndarray):
    """``partitions`` meters of ``per`` readings, cached in memory."""
    from pyspark.sql import functions as F

    volumes = spark.createDataFrame([(i, float(x)) for i, x in enumerate(volume)], "k long, v double")
    df = (spark.range(partitions * per).select((F.col("id") % partitions).alias("g"),
                                               (F.col("id") / partitions).cast("long").alias("ts"),
                                               (F.col("id") % len(volume)).alias("k"))
          .join(F.broadcast(volumes), "k").select("g", "ts", "v").repartition(8).cache())
    assert df.count() == partitions * per
    return df


def jobs(df, per: int, budget: dpsql.Budget, split: dict[str, list[float]]) -> dict:
    """The timed runs on ``df``; each dpsql run also records its check (the call) in ``split``."""
    def plain():
        df.groupBy("g").applyInArrow(sorted_sums, "g long, ts long, v double").write.format("noop") \
            .mode("overwrite").save()

    def release(name, params):
        def run():
            start = time.perf_counter()
            out = dpsql.spark.range_sum(df, order_by="ts", value="v", partition_by="g", budget=budget, **params)
            split[name].append(time.perf_counter() - start)
            out.write.format("noop").mode("overwrite").save()
        return run

    base = {"epsilon": 1.0, "upper": UPPER}
    return {"plain": plain, "laplace": release("laplace", {"method": "laplace", **base}),
            FLEET: release(FLEET, {"method": "tops", **base}),
            OWN: release(OWN, {"method": "tops", "threshold_by": "partition", "m": per // 4, **base})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="10000x100,1000x1000", help="partitions x rows, comma separated")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--shuffle-partitions", type=int, default=8)
    args = parser.parse_args()
    if shutil.which("java") is None:
        sys.exit("no Java runtime on PATH: Spark cannot start")
    os.environ["PYSPARK_PYTHON"] = sys.executable  # the executors run this interpreter (and its dpsql)
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[2]").appName("dpsql-bench")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.driver.memory", "4g")
             .config("spark.sql.shuffle.partitions", str(args.shuffle_partitions))
             # every job gets all its shuffle partitions (no coalescing into fewer, unbalanced tasks)
             .config("spark.sql.adaptive.coalescePartitions.enabled", "false").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    volume = pacsv.read_csv(DATA).column("volume").to_numpy().astype(np.float64)
    budget = dpsql.Budget.in_memory(epsilon=1e9)
    sections, verdicts = [], []
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    for shape in args.shapes.split(","):
        partitions, per = map(int, shape.lower().split("x"))
        df = fleet(spark, partitions, per, volume)
        split: dict[str, list[float]] = {"laplace": [], FLEET: [], OWN: []}
        times = interleaved(jobs(df, per, budget, split), args.repeat, warm_up=True)
        df.unpersist()
        best = {k: min(v) for k, v in times.items()}
        median = {k: float(np.median(v)) for k, v in times.items()}
        rows = [["plain Spark: `groupBy(g).applyInArrow` sort by time + cumulative sum", best["plain"],
                 median["plain"], 1.0, 1.0, "", ""]]
        for name, checks in split.items():
            checks = checks[1:]  # the warm-up round's call is not timed
            rows.append([f"`dpsql.spark.range_sum`, {name}", best[name], median[name], best[name] / best["plain"],
                         median[name] / median["plain"], float(np.median(checks)),
                         float(np.median(checks)) / median["plain"]])
        header = ["job", "best s", "median s", "x plain (best)", "x plain (median)",
                  "of which check + charge, median s", "check / plain (median)"]
        sections.append(f"**{partitions:,} partitions x {per:,} rows** ({partitions * per:,} rows)\n\n"
                        + markdown_table(header, rows))
        if shape == TARGET_SHAPE:
            verdicts += [(name, median[name] / median["plain"]) for name in ("laplace", FLEET)]
    elapsed = time.perf_counter() - start
    load_after = os.getloadavg()[0]
    met = bool(verdicts) and all(ratio <= TARGET for _, ratio in verdicts)
    body = (f"Spark `local[2]` with {args.shuffle_partitions} shuffle partitions, each DataFrame cached in memory, "
            f"integer time keys (every partition starting at 0), traffic volumes tiled, epsilon 1, upper {UPPER:g}; "
            "the default `tops` learns one threshold for the fleet from its 4,096 earliest rows (gathered by the "
            "check job, chosen on the driver after the charge), `threshold_by=\"partition\"` holds out a quarter "
            f"of each partition (`m`) for its own threshold. {args.repeat} interleaved rounds after a warm-up round "
            f"({elapsed:.0f} s in all); ratios are best over best and median over median. A dpsql release is two "
            "jobs: the check before the charge (shuffled by partition and sorted by time as the release reads "
            "them, the rows are digested and every refusal made) and the release itself, which releases many "
            "whole partitions per Arrow batch.\n\n" + "\n\n".join(sections)
            + f"\n\nTarget (issue 21): on {TARGET_SHAPE.replace('x', ' partitions x ')} rows, laplace and the default "
              f"tops (the fleet's threshold) within {TARGET:g}x the plain job (medians): "
              f"**{'met' if met else 'NOT met' if verdicts else 'not measured'}** ("
            + ", ".join(f"{name} {ratio:.2f}x" for name, ratio in verdicts)
            + "). The plain job pays Spark's per-group cost of `applyInArrow` (one Python call and one Arrow "
              "stream per group), which dpsql's jobs avoid by handing many whole partitions to each call; with "
              "fewer, longer partitions that cost shrinks and each of dpsql's two passes over the data (the check, "
              "then the release: two shuffles) costs about one plain job. A per-partition hold-out adds ToPS's "
              "Noisy Max over the threshold candidates to every partition, the cost a fleet-wide threshold removes. "
              f"Load average (1 min) before / after: {load_before:.2f} / {load_after:.2f} on {os.cpu_count()} "
              "cores (other work shared the machine: medians over interleaved rounds are the figures to compare).")
    spark.stop()
    write_section("spark_release", "Spark: range_sum on fleets of partitions", body)
    print(body)


if __name__ == "__main__":
    main()
