"""PeGaSus vs per-step Laplace on real counts, and the cost of releasing 10^7 events.

Accuracy: the hourly I-94 traffic volume (48,204 hours) treated as an hourly count
stream, and a per-second event table generated from its first hours (each hourly count
becomes that many events at uniformly random seconds of the hour), bucketed every 5
minutes. MSE per step and of 24-hour window sums, averaged over runs with fresh
CSPRNG noise, PeGaSus (each smoother, default parameters) against per-step Laplace at
the same epsilon.

A third table uses a synthetic low-count, locally stable stream (the regime PeGaSus
targets), clearly labelled as synthetic.

Speed: 10^7 events into 10^6 one-second buckets (event table -> counts -> PeGaSus),
with the share of each stage (bucketing, perturber noise, grouper, smoother, error
model). Run: ``python bench/pegasus.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _report import markdown_table, write_section

sys.path.insert(0, str(Path(__file__).parent.parent))
from dpsql.budget import Budget
from dpsql.counts import bucket_events, release_event_counts, time_domain
from dpsql.mechanisms import LaplaceLattice
from dpsql.mechanisms.svt import AboveThreshold
from dpsql.methods import run
from dpsql.noise import Keystream
from dpsql.streams.count_laplace import perturb_units
from dpsql.streams.group_smoothing import GroupPrefixNoise, smooth
from dpsql.streams.pegasus import _first_above_short, group_start_per_row, partition
from dpsql.streams.windows import window_sums

DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "traffic_volume_hourly.csv"
if not DATA.exists():
    DATA = Path("/work/shared/data/traffic_volume_hourly.csv")
EPSILONS = (0.1, 0.5, 1.0)
METHODS = (("count_laplace", {}), ("pegasus", {"smoother": "median"}), ("pegasus", {"smoother": "average"}),
           ("pegasus", {"smoother": "js"}), ("pegasus", {"smoother": "adaptive"}), ("count_smoothed", {}))
WINDOW_HOURS = 24
SPEED_REPEATS = 5  # best of, per stage: the machine is shared


def label(method, params):
    if method != "pegasus":
        return "per-step Laplace" if method == "count_laplace" else "per-step Laplace + adaptive smoother"
    return f"PeGaSus {params['smoother']}"


def true_windows(counts, window):
    cumulative = np.concatenate([[0.0], np.cumsum(counts)])
    return cumulative[window:] - cumulative[:-window]


def accuracy(counts, window, runs):
    """rows: (method, epsilon, per-step MSE, window MSE, mean estimated per-step variance)."""
    truth_windows = true_windows(counts, window)
    rows = []
    for epsilon in EPSILONS:
        for method, params in METHODS:
            step, win = [], []
            for _ in range(runs):
                rel = run(method, counts, noise=Keystream.fresh(), epsilon=epsilon, **params)
                step.append(np.mean((rel.values - counts) ** 2))
                sums = window_sums(rel, window=window)[0][window - 1:]
                win.append(np.mean((sums - truth_windows) ** 2))
            rows.append((label(method, params), epsilon, float(np.mean(step)), float(np.mean(win))))
    return rows


def ratio_table(rows):
    baseline = {(eps): (s, w) for name, eps, s, w in rows if name == "per-step Laplace"}
    return markdown_table(
        ["method", "epsilon", "MSE per step", "vs Laplace", "MSE window sum", "vs Laplace"],
        [[name, eps, s, f"{s / baseline[eps][0]:.3f}", w, f"{w / baseline[eps][1]:.3f}"]
         for name, eps, s, w in rows])


def event_table(hourly, hours, seed=0):
    rng = np.random.default_rng(seed)  # synthetic data, not privacy noise
    counts = hourly[:hours].astype(np.int64)
    hour_of_event = np.repeat(np.arange(hours), counts)
    seconds = hour_of_event * 3600 + rng.integers(0, 3600, hour_of_event.size)
    return np.datetime64("2012-10-02T09:00", "ns") + seconds.astype("timedelta64[s]").astype("timedelta64[ns]")


def stages(n_events, n_buckets, smoother, seed=1):
    """Seconds per stage of releasing ``n_events`` events into ``n_buckets`` 1 s buckets."""
    rng = np.random.default_rng(seed)
    start = np.datetime64("2024-01-01T00:00", "ns")
    times = start + rng.integers(0, n_buckets, n_events).astype("timedelta64[s]").astype("timedelta64[ns]")
    stop = start + np.timedelta64(n_buckets, "s")
    source = Keystream.fresh().partition()
    epsilon = 1.0
    timing = {}
    t0 = time.perf_counter()
    counts = bucket_events(times, domain=time_domain(start=start, stop=stop, every="1s")).counts[0].astype(float)
    timing["bucketing"] = time.perf_counter() - t0
    eps_g = 0.2 * epsilon
    perturber = LaplaceLattice(1.0, epsilon - eps_g)
    svt = AboveThreshold(2.0, eps_g)
    t0 = time.perf_counter()
    units = perturb_units(counts, perturber, source, 0)
    thresholds = svt.thresholds(5 / eps_g, source, 0, n_buckets)
    query_units = svt.query_noise_units(source, 0, n_buckets)
    timing["noise (perturber + grouper draws)"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    _first_above_short(counts, thresholds, query_units, svt)
    search = time.perf_counter() - t0
    t0 = time.perf_counter()
    starts, _ = partition(counts, thresholds, query_units, svt)
    grouper = time.perf_counter() - t0
    timing["grouper: vectorised first-above search"] = search
    timing["grouper: sequential walk over groups (+ long groups)"] = max(grouper - search, 0.0)
    t0 = time.perf_counter()
    smooth(units, perturber.granularity, group_start_per_row(starts, n_buckets), smoother)
    timing["smoother"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    GroupPrefixNoise(starts, n_buckets, perturber.variance, smoother).range_variance(
        np.arange(n_buckets), np.arange(1, n_buckets + 1))
    timing["error model (all per-step variances)"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    release_event_counts(times, start=start, stop=stop, every="1s", epsilon=epsilon, smoother=smoother,
                         budget=Budget.in_memory(epsilon=epsilon))
    end_to_end = time.perf_counter() - t0
    return timing, end_to_end, len(starts)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    runs = 2 if args.quick else 5
    hourly = np.loadtxt(DATA, delimiter=",", skiprows=1, usecols=1)
    body = [f"Data: `traffic_volume_hourly.csv` ({len(hourly):,} hourly counts, mean {hourly.mean():.0f}). "
            f"Each figure is the mean over {runs} runs with fresh OS-CSPRNG noise; PeGaSus at its defaults for "
            "each smoother (median, average, js: grouper share 0.2, theta = 5 / eps_g; adaptive: share 0.004, "
            "theta for 4096-step groups, the grouped or whole-stream estimate by risk). Window sums as "
            "`window_sums` forms them by default (re-smoothed from the noisy counts known at the window's end, "
            "except per-step Laplace's). Window MSE is over all complete windows.\n",
            f"### Hourly counts, {len(hourly):,} steps, {WINDOW_HOURS} h windows\n",
            ratio_table(accuracy(hourly, WINDOW_HOURS, runs))]

    hours = 500 if args.quick else 3000
    times = event_table(hourly, hours)
    start = np.datetime64("2012-10-02T09:00", "ns")
    stop = start + np.timedelta64(hours, "h")
    counts = bucket_events(times, domain=time_domain(start=start, stop=stop, every="5m")).counts[0].astype(float)
    body += [f"\n### Per-second event table: first {hours:,} hours, {len(times):,} events, 5-minute buckets "
             f"({len(counts):,} steps), {WINDOW_HOURS} h windows ({WINDOW_HOURS * 12} buckets)\n",
             ratio_table(accuracy(counts, WINDOW_HOURS * 12, runs))]

    rng = np.random.default_rng(2)  # synthetic data, not privacy noise
    rates = np.repeat(rng.choice([1.0, 2.0, 5.0, 10.0], 400), rng.integers(20, 400, 400))
    synthetic = rng.poisson(rates).astype(float)
    body += [f"\n### Synthetic low counts: Poisson with piecewise-constant rates in {{1, 2, 5, 10}}, segments of "
             f"20-400 steps ({len(synthetic):,} steps), {WINDOW_HOURS}-step windows\n",
             ratio_table(accuracy(synthetic, WINDOW_HOURS, runs))]

    n_events, n_buckets = (10**6, 10**5) if args.quick else (10**7, 10**6)
    speed_rows = []
    for smoother in ("median", "average"):
        repeats = [stages(n_events, n_buckets, smoother) for _ in range(SPEED_REPEATS)]
        timing = {stage: min(r[0][stage] for r in repeats) for stage in repeats[0][0]}
        end_to_end, groups = min(r[1] for r in repeats), repeats[0][2]
        total = sum(timing.values())
        speed_rows += [[smoother, stage, seconds, f"{100 * seconds / total:.0f} %"]
                       for stage, seconds in timing.items()]
        speed_rows.append([smoother, "**end to end** (`release_event_counts`)", end_to_end, ""])
    body += [f"\n### Speed: {n_events:,} events into {n_buckets:,} one-second buckets, epsilon = 1 "
             f"({groups:,} groups), best of {SPEED_REPEATS} per stage\n",
             markdown_table(["smoother", "stage", "seconds", "share of stages"], speed_rows)]
    body.append(
        "\nReading: with the paper's smoothers and their defaults (theta = 5 / eps_g) the grouper's query noise "
        "(scale 8 / eps_g) exceeds theta, so even a constant stream closes its group at roughly a quarter of the "
        "steps and groups stay short; averaging over them beats per-step Laplace only where the Laplace noise "
        "dominates the step-to-step variation, and on hourly traffic volumes (thousands per hour, strongly "
        "periodic) the grouping bias dominates. The adaptive smoother (PeGaSus's default, and count_smoothed) "
        "chooses how far back to average from the noisy counts themselves and falls back to the noisy count where "
        "nothing smooths; window sums re-smoothed at the window's end improve with it. See 'PeGaSus and count "
        "smoothing' (bench/pegasus_utility.py) for medians over seeded runs. The speed stages are timed separately "
        "(best of several runs on a shared 2-core machine, so shares move by about 10 points between runs); the "
        "grouper is the only sequential stage.")
    write_section("pegasus", "PeGaSus count streams vs per-step Laplace", "\n".join(body))
    print("\n".join(body))


if __name__ == "__main__":
    main()
