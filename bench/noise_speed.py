"""Throughput of dpsql's Laplace sampler (a fresh key from the OS CSPRNG, AES-256-CTR keystream
by address), beside numpy's (non-secure) and OpenDP's.

Run: python bench/noise_speed.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _report import markdown_table, write_section

from dpsql.mechanisms import LaplaceLattice
from dpsql.noise import Keystream, Lane

N = 10_000_000


def rate(fn, n: int, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(n)
        best = min(best, time.perf_counter() - start)
    return n / best / 1e6


def opendp_rate() -> float | None:
    try:
        import opendp.prelude as dp
    except ImportError:
        return None
    dp.enable_features("contrib")
    space = dp.atom_domain(T=float, nan=False), dp.absolute_distance(T=float)
    measurement = space >> dp.m.then_laplace(scale=1.0)
    return rate(lambda n: [measurement(0.0) for _ in range(n)], 20_000, repeats=1)


def main() -> None:
    draws = Keystream.fresh().partition(b"bench").lane(Lane.ROWS)
    lap = LaplaceLattice(sensitivity=1.0, epsilon=1.0)
    values = np.random.default_rng(0).uniform(0, 100, N)
    scattered = np.random.default_rng(1).permutation(N)
    rows = [
        ["dpsql discrete Laplace draws at consecutive addresses (lattice units)",
         rate(lambda n: lap.noise_units(draws, 0, n), N)],
        ["dpsql discrete Laplace draws at scattered addresses",
         rate(lambda n: draws.discrete_laplace_at(lap.scale_units, scattered[:n]), N)],
        ["dpsql LaplaceLattice.release (snap input + noise, float64 out)", rate(lambda n: lap.release(values, draws),
                                                                                 N)],
        ["numpy Generator.laplace (PCG64, not cryptographic, not float-safe)",
         rate(lambda n: np.random.default_rng().laplace(size=n), N)],
    ]
    opendp = opendp_rate()
    if opendp is not None:
        rows.append(["OpenDP then_laplace, one call per sample", opendp])
    body = markdown_table(["sampler", "M samples / s"], [[name, round(r, 3)] for name, r in rows])
    body += (f"\n\n{N:,} samples per run, best of 3. Target: dpsql >= 20 M/s. Every draw is a function of the "
             "release's secret key and its address (partition, lane, level, index), so a re-run or a retried "
             "task draws the same noise.")
    write_section("noise_speed", "Laplace sampler throughput", body)
    print(body)


if __name__ == "__main__":
    main()
