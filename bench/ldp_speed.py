"""Throughput of every local-DP method, this checkout against an older one.

Two workloads per method, through the public release path (``dpsql.publish``, which the
Python functions and the SQL/Polars front ends call): one user's stream of ``--slots``
values (10^6), and ``--users`` users of ``--user-slots`` values each (1,000 x 1,000) released
as one partitioned release. Values are uniform on [0, 100] (public bounds [0, 100]); the
methods run with epsilon = 1, w = 10 and their defaults, ToPL with r = 2^20 and a hold-out
of m = 4096 rows (one stream) or a quarter of each user's rows, given explicitly (older
checkouts derived both from the length). Each figure is the best of ``--repeat`` runs, in
slots (rows) per second.

``--before DIR`` runs the same workload, in a separate process, on the dpsql package of
``DIR`` (a checkout of an older commit, e.g. ``git worktree add --detach DIR 6643f54``) and
reports both; each side runs in its own process, one after the other. The old code takes
about a minute per method and workload: ``--before-results FILE`` reads instead the JSON that
``PYTHONPATH=DIR python bench/ldp_speed.py --measure > FILE`` printed (same workload).

Usage: python bench/ldp_speed.py [--before DIR | --before-results FILE] [--slots 1000000]
       [--users 1000] [--user-slots 1000] [--repeat 1] [--methods ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

METHODS = ["sw_direct", "sampling", "ba_sw", "ipp", "app", "capp", "pp_s", "pm_direct", "topl"]
DU_PARAMS = dict(epsilon=1.0, w=10, lower=0.0, upper=100.0)


def parameters(method: str, stream_length: int) -> dict:
    if method == "topl":
        return dict(epsilon=1.0, upper=100.0, m=min(4096, stream_length // 4), r=1 << 20)
    return DU_PARAMS


def release_seconds(method: str, values: np.ndarray, offsets, repeat: int) -> float:
    import dpsql

    params = parameters(method, len(values) if offsets is None else int(offsets[1]))
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        if offsets is None:
            dpsql.publish(method, values, **params)
        else:
            dpsql.publish(method, values, partition_offsets=offsets, **params)
        best = min(best, time.perf_counter() - start)
    return best


def measure(args) -> dict:
    """Seconds per method and workload, with the dpsql that this interpreter imports."""
    import dpsql

    rng = np.random.default_rng(0)  # the data are public test values, not noise
    single = rng.uniform(0.0, 100.0, args.slots)
    users = rng.uniform(0.0, 100.0, args.users * args.user_slots)
    offsets = np.arange(args.users + 1) * args.user_slots
    out = {"dpsql": str(Path(dpsql.__file__).parent), "single": {}, "users": {}}
    for method in args.methods:
        out["single"][method] = release_seconds(method, single, None, args.repeat)
        out["users"][method] = release_seconds(method, users, offsets, args.repeat)
        print(method, out["single"][method], out["users"][method], file=sys.stderr, flush=True)
    return out


def measure_in(directory: Path | None, args) -> dict:
    """:func:`measure` in a fresh interpreter importing dpsql from ``directory`` (None: this checkout)."""
    root = Path(__file__).resolve().parent.parent if directory is None else directory.resolve()
    command = [sys.executable, __file__, "--measure", "--slots", str(args.slots), "--users", str(args.users),
               "--user-slots", str(args.user_slots), "--repeat", str(args.repeat), "--methods", *args.methods]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(command, env=env, cwd="/", check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", type=Path, help="a checkout of an older commit to compare with")
    parser.add_argument("--before-results", type=Path, help="that checkout's --measure output, measured earlier")
    parser.add_argument("--slots", type=int, default=1_000_000)
    parser.add_argument("--users", type=int, default=1000)
    parser.add_argument("--user-slots", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args)))
        return

    sys.path.insert(0, str(Path(__file__).parent))
    from _report import markdown_table, write_section

    load_before = os.getloadavg()[0]
    if args.before_results:
        before = json.loads(args.before_results.read_text())
    else:
        before = measure_in(args.before, args) if args.before else None
    after = measure_in(None, args)
    load_after = os.getloadavg()[0]
    many = args.users * args.user_slots
    rows = []
    for method in args.methods:
        row = [method]
        for workload, slots in (("single", args.slots), ("users", many)):
            now = slots / after[workload][method]
            if before is not None:
                then = slots / before[workload][method]
                row += [then / 1e3, now / 1e3, now / then]
            else:
                row += [now / 1e3]
        rows.append(row)
    single = f"{args.slots:,} slots, one user"
    batch = f"{args.users:,} users x {args.user_slots:,} slots"
    if before is not None:
        header = ["method", f"{single}: before (k slots/s)", "after", "speed-up",
                  f"{batch}: before (k slots/s)", "after", "speed-up"]
        compared = f"Before: the dpsql package of `{args.before or before['dpsql']}`; after: this checkout. "
    else:
        header = ["method", f"{single} (k slots/s)", f"{batch} (k slots/s)"]
        compared = ""
    body = (f"Releases through `dpsql.publish` (values uniform on [0, 100], epsilon = 1, w = 10, method defaults; "
            f"ToPL with r = 2^20 and m = 4096 or a quarter of a user's rows), best of {args.repeat}, each side in "
            f"its own process. {compared}Seconds per release are slots divided by the figures.\n\n"
            + markdown_table(header, rows)
            + f"\n\n1-minute load average {load_before:.1f} before and {load_after:.1f} after the runs on "
            f"{os.cpu_count()} cores (other work shares the machine)."
            + (" The old code's figures come from an earlier run of the same workload (`--before-results`), "
               "under a load this run did not see; a loaded machine slows the old code's per-slot Python "
               "loops by up to about 1.5x." if args.before_results else ""))
    checkout = args.before or (Path(before["dpsql"]).parent if before else None)
    command = "python bench/ldp_speed.py" + (f" --before {checkout}" if checkout else "")
    write_section("ldp_speed", "Local-DP release speed (slots per second)", body, command=command)
    print(body)


if __name__ == "__main__":
    main()
