"""ToPL threshold quality (SW-W vs plain SW vs no threshold) on real streams, and ToPL speed.

Quality: for each data set the first m values are reported by Square Wave at the
threshold epsilon (the device side, ToplDevice); each method picks its threshold from the
same reports. For the stream after the hold-out the expected squared error of a range sum
is exact given the threshold: ``(sum of clipping bias)^2 + length * (theta/2)^2 * Var_HM``
(HM's variance does not depend on the value at eps = 1), so no stream noise is sampled;
the reported MSE is averaged over random ranges and over repetitions of the hold-out.
One end-to-end ``dpsql.ldp.topl`` run per data set checks that the empirical error agrees.

Run: python bench/topl.py [--reps 4]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _report import markdown_table, write_section

import dpsql
from dpsql.ldp import ToplDevice, estimate_threshold
from dpsql.mechanisms.ldp import (
    HYBRID,
    SQUARE_WAVE,
    SWKernel,
    report_uniforms,
    sw_em,
    sw_histogram,
    sw_transition_matrix,
)
from dpsql.noise import Keystream
from dpsql.testing import keys

DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data"
# Public bounds: a power of two above any plausible value, chosen without looking at the maxima's digits.
SETS = {"retail": ("retail_basket_sizes.csv", 128.0), "traffic": ("traffic_volume_hourly.csv", 8192.0)}
METHODS = {"ToPL (SW-W, paper rule)": "paper", "SW-W, code rule": "code", "SW (no pruning)": "none"}
STREAM_EPS = 1.0
N_RANGES = 200


def holdout_length(n: int) -> int:
    """The paper's hold-out, 65536 values, or a quarter of a shorter stream."""
    return min(65536, n // 4)


def load(name: str) -> np.ndarray:
    path = DATA / SETS[name][0]
    return np.loadtxt(path, delimiter=",", skiprows=1, usecols=1, dtype=np.float64)


def expected_range_mse(stream: np.ndarray, theta: float, starts: np.ndarray, stops: np.ndarray) -> float:
    bias = np.concatenate([[0.0], np.cumsum(np.minimum(stream, theta) - stream)])
    variance = (stops - starts) * (theta / 2.0) ** 2 * HYBRID.worst_variance(STREAM_EPS)
    return float(np.mean((bias[stops] - bias[starts]) ** 2 + variance))


def quality(reps: int) -> tuple[str, list[str]]:
    rows, notes = [], []
    for name in SETS:
        values = load(name)
        upper = SETS[name][1]
        n = len(values)
        m = holdout_length(n)
        stream = np.clip(values[m:], 0.0, upper)
        r = n - m
        ranges = np.random.default_rng(0)  # public query workload, not privacy noise
        lengths = ranges.integers(1, r + 1, N_RANGES)
        starts = ranges.integers(0, r - lengths + 1)
        stops = starts + lengths
        grid = upper * np.arange(1, 1025) / 1024
        best = min(expected_range_mse(stream, t, starts, stops) for t in grid[::8])
        no_threshold = expected_range_mse(stream, upper, starts, stops)
        for eps_thr in (0.5, 1.0, 2.0):
            mse = {label: [] for label in METHODS}
            thetas = {label: [] for label in METHODS}
            for rep in range(reps):
                device = ToplDevice(upper=upper, epsilon=STREAM_EPS, threshold_epsilon=eps_thr,
                                    noise=keys(1000 * rep + int(10 * eps_thr)).partition())
                reports = device.report(values[:m])
                for label, rule in METHODS.items():
                    theta = estimate_threshold(reports, bound=upper, threshold_epsilon=eps_thr, epsilon=STREAM_EPS,
                                               r=r, pruning=rule)
                    thetas[label].append(theta)
                    mse[label].append(expected_range_mse(stream, theta, starts, stops))
            sw_plain = np.mean(mse["SW (no pruning)"])
            for label in METHODS:
                rows.append([name, eps_thr, label, float(np.median(thetas[label])), float(np.mean(mse[label])),
                             float(np.mean(mse[label]) / sw_plain)])
            rows.append([name, eps_thr, "no threshold (theta = upper)", upper, no_threshold, no_threshold / sw_plain])
            rows.append([name, eps_thr, "best theta in hindsight (not private)", float("nan"), best, best / sw_plain])
        notes.append(f"{name}: n = {n}, m = {m}, r = n - m = {r}, upper = {upper:g}, "
                     f"true p95 / p99.5 / max = {np.percentile(values, 95):g} / {np.percentile(values, 99.5):g} / "
                     f"{values.max():g}")
    table = markdown_table(["data", "threshold eps", "method", "median theta", "range-sum MSE", "MSE / SW"], rows)
    return table, notes


def end_to_end_check() -> list[list]:
    rows = []
    for name in SETS:
        values = load(name)
        upper = SETS[name][1]
        n = len(values)
        m = holdout_length(n)
        with dpsql.testing.seeded(5):
            rel = dpsql.ldp.topl(values, epsilon=STREAM_EPS, threshold_epsilon=1.0, upper=upper, m=m, r=n - m)
        starts = np.arange(m, n - 1000, 1000)
        stops = starts + 1000
        truth = np.concatenate([[0.0], np.cumsum(np.clip(values, 0.0, upper))])
        empirical = np.mean((rel.range_sum(starts, stops) - (truth[stops] - truth[starts])) ** 2)
        expected = expected_range_mse(np.clip(values[m:], 0, upper), rel.threshold, starts - m, stops - m)
        rows.append([name, rel.threshold, float(empirical), expected, float(empirical / expected)])
    return rows


def em_iteration_seconds(reports: np.ndarray, eps: float, iterations: int = 100) -> tuple[float, float]:
    """Seconds per EM iteration with the dense 1024 x 1024 matrix and with the fast exact kernel."""
    hist = sw_histogram(reports, eps)
    dense, fast = sw_transition_matrix(eps), SWKernel(eps)
    timings = []
    for forward, adjoint in ((lambda t: dense @ t, lambda y: dense.T @ y), (fast.forward, fast.adjoint)):
        theta = np.full(1024, 1 / 1024)
        start = time.perf_counter()
        for _ in range(iterations):
            theta = theta * adjoint(hist / forward(theta))
            theta /= theta.sum()
            float(hist @ np.log(forward(theta)))
        timings.append((time.perf_counter() - start) / iterations)
    return timings[0], timings[1]


def em_seconds(reports: np.ndarray, eps: float) -> float:
    start = time.perf_counter()
    sw_em(reports, eps)
    return time.perf_counter() - start


def speed() -> tuple[str, str]:
    n, m = 1_000_000, 65_536
    values = np.floor(-8.0 * np.log(np.random.default_rng(0).uniform(size=n)))  # test data, not noise
    start = time.perf_counter()
    rel = dpsql.publish("topl", values, epsilon=1.0, upper=128.0, m=m)
    topl_seconds = time.perf_counter() - start
    start = time.perf_counter()
    dpsql.laplace(values, epsilon=1.0, upper=128.0)
    laplace_seconds = time.perf_counter() - start
    reports = SQUARE_WAVE.perturb(values[:m] / 128.0, 1.0, report_uniforms(Keystream.fresh().partition(), 0, m,
                                                                            uniforms=1))
    em = em_seconds(reports, 1.0)
    dense, fast = em_iteration_seconds(reports, 1.0)
    load = os.getloadavg()[0]
    rows = [
        ["ToPL end to end (CSPRNG), 10^6 rows, m = 65536", topl_seconds, n / topl_seconds / 1e6, ""],
        ["per-value Laplace baseline, same rows", laplace_seconds, n / laplace_seconds / 1e6,
         f"ToPL / Laplace time = {topl_seconds / laplace_seconds:.3g}"],
        ["EM to convergence on 65536 SW reports (fast exact kernel)", em, float("nan"), ""],
        ["one EM iteration, dense 1024 x 1024 matrix (BLAS)", dense, float("nan"), ""],
        ["one EM iteration, fast exact kernel", fast, float("nan"), f"dense / fast = {dense / fast:.3g}"],
    ]
    table = markdown_table(["operation", "seconds", "M rows/s", "ratio (same run)"], rows)
    return table, (f"Load average at the end of the speed run: {load:.2f} on {os.cpu_count()} cores "
                   f"(other engineers share the machine). Threshold chosen: {rel.threshold:g}.")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=4)
    args = parser.parse_args()
    table, notes = quality(args.reps)
    check = markdown_table(["data", "theta", "empirical MSE (1000-row ranges)", "expected", "ratio"],
                           end_to_end_check())
    speed_table, load = speed()
    body = f"""
Threshold quality: the stream after the hold-out is released with HM at eps = {STREAM_EPS:g}; the threshold is
chosen from the first m values' Square Wave reports at the threshold eps. MSE of {N_RANGES} random range sums
(lengths uniform in [1, n - m], fixed workload) is exact given the threshold (bias^2 + HM variance, see the
script); averaged over {args.reps} repetitions of the hold-out reports (seeded, non-private test noise). The data are
used as they are (not extended to 2^20 + m as in the paper). "MSE / SW" is relative to plain SW in the same run.

{table}

{chr(10).join('- ' + note for note in notes)}

Reading the table: EM without a smoothing step (as SW-W prescribes, ToPL §5) returns a spiky
density with long runs of bins below 0.01 %, even inside the data's support (integer-valued data put mass on
every eighth bin for retail's 1024 bins over [0, 128]). Wherever SW-W loses to plain SW above, its run-of-5 rule
has fired at the first such run after the median (dpsql's reading of "first", see `sw_w_prune`) and clipped the
stream far below its upper quantiles; the paper's advantage for SW-W (POS/Kosarak, m = 65536, values up to B on a
unit grid) is not reproduced on these streams. `pruning="none"` (plain SW) is available on every ToPL call.

End-to-end check (one `dpsql.ldp.topl` run per data set, threshold eps = 1, non-overlapping 1000-row ranges):
the empirical squared error of range sums against the exact expectation for the chosen threshold.

{check}

Speed:

{speed_table}

{load}
"""
    write_section("topl", "ToPL: SW-W threshold vs plain SW, and speed", body,
                  command="python bench/topl.py" + ("" if args.reps == 4 else f" --reps {args.reps}"))


if __name__ == "__main__":
    main()
