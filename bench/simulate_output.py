"""`kvctl simulate -o`: block events written per second for 8 workers, pinned to one core
(`taskset -c 0`: simulator, recorder and converter share it) and on every core.

    python bench/simulate_output.py [--requests 3000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run(requests: int, pin: bool) -> float:
    with tempfile.TemporaryDirectory(prefix="kvctl-bench-") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "kvctl",
            "simulate",
            "-o",
            str(Path(tmp) / "sim.parquet"),
            "--workers",
            "8",
            "--requests",
            str(requests),
            "--rate",
            "40",
            "--json",
            "-q",
        ]
        if pin:
            cmd = ["taskset", "-c", "0", *cmd]
        s = json.loads(subprocess.run(cmd, capture_output=True, check=True).stdout)
    blocks = s["total"]["stored_blocks"] + s["total"]["removed_blocks"]
    return blocks / s["wall_s"]  # wall_s includes closing the recording


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    modes = [("one core (taskset -c 0)", True)] if shutil.which("taskset") else []
    for name, pin in [*modes, ("all cores", False)]:
        rates = [run(args.requests, pin) for _ in range(args.rounds)]
        print(
            f"simulate -o, 8 workers, {name}: {statistics.median(rates):,.0f} block events/s "
            f"(median of {args.rounds}: {', '.join(f'{r:,.0f}' for r in rates)})"
        )


if __name__ == "__main__":
    main()
