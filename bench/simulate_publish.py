"""CPU used by `kvctl simulate` publishing live at realistic rates (8 workers, ZMQ, a real
`kvctl tap` subscribed to every worker), from simulate's own --json summary.

    python bench/simulate_publish.py [--duration 20] [--rates 10 40]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from _stream import free_port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--rates", type=float, nargs="+", default=[10.0, 40.0])
    args = parser.parse_args()
    kvctl = [sys.executable, "-m", "kvctl"]
    for rate in args.rates:
        base = free_port()  # consecutive ports are almost always free above an ephemeral one
        endpoints = [f"tcp://127.0.0.1:{base + i}" for i in range(8)]
        sim = subprocess.Popen(
            [
                *kvctl,
                "simulate",
                "--workers",
                "8",
                "--base-port",
                str(base),
                "--rate",
                str(rate),
                "--duration",
                str(args.duration),
                "--wait-subscribers",
                "1",
                "--json",
                "-q",
            ],
            stdout=subprocess.PIPE,
        )
        tap = subprocess.Popen(
            [*kvctl, "tap", *endpoints, "--json", "--idle-timeout", "3", "-q"],
            stdout=subprocess.DEVNULL,
        )
        out, _ = sim.communicate(timeout=args.duration * 3 + 60)
        tap.wait(60)
        s = json.loads(out)
        print(
            f"rate {rate:5.1f} req/s: {s['batches'] / s['wall_s']:8,.0f} batches/s, "
            f"{s['total']['stored_blocks'] / s['wall_s']:8,.0f} blocks stored/s, "
            f"{s['total']['removed_blocks'] / s['wall_s']:7,.0f} evicted/s; simulate CPU "
            f"{s['cpu_s']:.2f} s in {s['wall_s']:.1f} s wall = "
            f"{100 * s['cpu_s'] / s['wall_s']:.1f}% of one core; hit rate "
            f"{s['total']['hit_rate']:.1%}"
        )


if __name__ == "__main__":
    main()
