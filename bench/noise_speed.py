"""Throughput of dpsql's Laplace sampler (a fresh key from the OS CSPRNG, AES-256-CTR keystream
by address), beside numpy's (non-secure) and OpenDP's.

Run: python bench/noise_speed.py
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _report import markdown_table, write_section

from dpsql.mechanisms import LaplaceLattice
from dpsql.noise import Keystream, Lane

N = 10_000_000
PIECE = 1 << 14


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
    load_before = os.getloadavg()[0]
    draws = Keystream.fresh().partition(b"bench").lane(Lane.ROWS)
    lap = LaplaceLattice(sensitivity=1.0, epsilon=1.0)
    values = np.random.default_rng(0).uniform(0, 100, N)
    scattered = np.random.default_rng(1).permutation(N)
    rows = [
        ["dpsql discrete Laplace draws at consecutive addresses (lattice units)",
         rate(lambda n: lap.noise_units(draws, 0, n), N)],
        ["dpsql discrete Laplace draws at scattered addresses",
         rate(lambda n: draws.discrete_laplace_at(lap.scale_units, scattered[:n]), N)],
        ["dpsql discrete Laplace draws at scattered addresses, 2^14 indices per call",
         rate(lambda n: [draws.discrete_laplace_at(lap.scale_units, scattered[a:a + PIECE])
                         for a in range(0, n, PIECE)], N)],
        ["dpsql LaplaceLattice.release (snap input + noise, float64 out)", rate(lambda n: lap.release(values, draws),
                                                                                 N)],
        ["numpy Generator.laplace (PCG64, not cryptographic, not float-safe)",
         rate(lambda n: np.random.default_rng().laplace(size=n), N)],
    ]
    opendp = opendp_rate()
    if opendp is not None:
        rows.append(["OpenDP then_laplace, one call per sample", opendp])
    load_after = os.getloadavg()[0]
    body = markdown_table(["sampler", "M samples / s"], [[name, round(r, 3)] for name, r in rows])
    body += (f"\n\n{N:,} samples per run, best of 3. Target: dpsql >= 20 M/s. Every draw is a function of the "
             "release's secret key and its address (partition, lane, level, index), so a re-run or a retried "
             "task draws the same noise.")
    scattered_rate, pieces_rate = rows[1][1], rows[2][1]
    if scattered_rate < 20 <= pieces_rate:
        body += (f" The scattered path misses the target in one 10^7-index call ({scattered_rate:.1f} M/s) but not in "
                 f"2^14-index calls ({pieces_rate:.1f} M/s): `discrete_laplace_at` builds and encrypts all the "
                 "counter blocks at once, so its 10^7-row temporaries leave the cache (the consecutive path "
                 "works in 2^14-draw pieces).")
    body += (f" 1-minute load average {load_before:.1f} before and {load_after:.1f} after the runs on "
             f"{os.cpu_count()} shared cores.")
    write_section("noise_speed", "Laplace sampler throughput", body)
    print(body)


if __name__ == "__main__":
    main()
