"""Write one benchmark's section into BENCHMARKS.md, replacing its previous version.

Each script owns the section between ``<!-- name:start -->`` and ``<!-- name:end -->``,
so scripts can be rerun in any order and the file always holds each one's latest run.
"""

from __future__ import annotations

import platform
import re
import sys
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "BENCHMARKS.md"
HEADER = ("# Benchmarks\n\nEvery section below is written by the script it names; rerun that command to "
          "refresh it. Ratios are measured within one process run, so they compare like with like on "
          "whatever machine ran them.\n")


def machine() -> str:
    import os

    import numpy as np

    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python "
            f"{platform.python_version()}, numpy {np.__version__}")


def run_options(default_reps: int) -> tuple[bool, int]:
    """From the command line: ``--quick`` (a smoke run of 2 runs that writes nothing) and the
    runs per figure (``--reps``, ``default_reps`` unless given)."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=default_reps)
    args = parser.parse_args()
    return args.quick, 2 if args.quick else args.reps


def report(name: str, title: str, parts: list[str], *, started: float, quick: bool, command: str) -> None:
    """Print ``parts`` (markdown) with the run's duration since ``started`` and, unless ``quick``,
    write them as section ``name`` of BENCHMARKS.md."""
    text = "\n".join([*parts, f"\nWhole run: {time.perf_counter() - started:.0f} s."])
    print(text)
    if not quick:
        write_section(name, title, text, command=command)


def write_section(name: str, title: str, body: str, command: str | None = None) -> None:
    """Replace section ``name`` of BENCHMARKS.md with ``body`` (markdown)."""
    command = command or "python " + " ".join(sys.argv)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    section = (f"<!-- {name}:start -->\n## {title}\n\nReproduce: `{command}`  \n"
               f"Measured {stamp} on {machine()}.\n\n{body.strip()}\n<!-- {name}:end -->")
    text = BENCHMARKS.read_text() if BENCHMARKS.exists() else HEADER
    pattern = re.compile(rf"<!-- {re.escape(name)}:start -->.*?<!-- {re.escape(name)}:end -->", re.S)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip() + "\n\n" + section + "\n"
    BENCHMARKS.write_text(text)


def interleaved(runs: dict, repeat: int, *, warm_up: bool = False) -> dict[str, list[float]]:
    """Seconds of ``repeat`` rounds of every run of ``runs`` (name -> callable), taking
    turns within each round so that a change in the machine's load hits them alike;
    ``warm_up`` runs each once first, untimed."""
    if warm_up:
        for run in runs.values():
            run()
    times = {name: [] for name in runs}
    for _ in range(repeat):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return times


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A GitHub markdown table; floats in compact scientific notation."""
    def fmt(x):
        return f"{x:.3g}" if isinstance(x, float) else str(x)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)
