"""Startup time of ``kvctl --help`` and of every ``kvctl CMD --help``, against ``python -c pass``.

Usage: python bench/startup.py [--rounds 20] [COMMAND ...]

Each round runs the bare interpreter and every help invocation once, in turn (alternating, so
that the load of a shared machine falls on all of them alike), each as a fresh process of this
interpreter (``python -m kvctl ...`` from the repository root). Reported per invocation: the
median wall time over the rounds, the ratio of that median to the bare interpreter's median, and
the range of the per-round ratios (25th–75th percentile) as a measure of the noise.

Bytecode is cached, as for an installed kvctl (pip compiles it): the runs write and read it in a
temporary directory (PYTHONPYCACHEPREFIX), also when PYTHONDONTWRITEBYTECODE is set, which
would otherwise make every run compile every module it imports, a cost users never pay.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvctl.cli import COMMANDS  # noqa: E402


def _wall_time(argv: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - started


def _quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q1, _median, q3 = statistics.quantiles(values, n=4)
    return q1, q3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("commands", nargs="*", help="commands to time (default: all)")
    args = ap.parse_args(argv)
    unknown = set(args.commands) - set(COMMANDS)
    if unknown:
        ap.error(f"unknown commands: {', '.join(sorted(unknown))}")
    python = [sys.executable]
    cases: dict[str, list[str]] = {"python -c pass": [*python, "-c", "pass"]}
    cases["kvctl --help"] = [*python, "-m", "kvctl", "--help"]
    for name in args.commands or COMMANDS:
        cases[f"kvctl {name} --help"] = [*python, "-m", "kvctl", name, "--help"]
    times: dict[str, list[float]] = {label: [] for label in cases}
    with tempfile.TemporaryDirectory(prefix="kvctl-bytecode-") as bytecode:
        env = {**os.environ, "PYTHONPYCACHEPREFIX": bytecode}
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        for argv_ in cases.values():  # compile and warm the file cache once, untimed
            _wall_time(argv_, env)
        for _ in range(args.rounds):
            for label, argv_ in cases.items():
                times[label].append(_wall_time(argv_, env))
    bare = times["python -c pass"]
    bare_median = statistics.median(bare)
    print(f"rounds={args.rounds} python={sys.version.split()[0]}")
    print(f"{'invocation':<28} {'median ms':>10} {'ratio':>6}  round ratios (25–75 %)")
    for label, samples in times.items():
        median = statistics.median(samples)
        low, high = _quartiles([t / b for t, b in zip(samples, bare, strict=True)])
        print(
            f"{label:<28} {median * 1000:>10.1f} {median / bare_median:>6.2f}  {low:.2f}–{high:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
