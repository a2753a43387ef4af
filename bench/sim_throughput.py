"""Throughput of the pure simulator: KV events generated per second of CPU, no encoding.

Usage: python bench/sim_throughput.py [--workers 8] [--requests 4000] [--rate 40] [--router kv]

Runs :class:`kvctl.engine.Fleet` as fast as possible (no pacing, no sockets, no encoding) on one
core and counts what it yields: batches (one per worker step with events), events
(``BlockStored`` / ``BlockRemoved`` dicts) and block events (block hashes inside them: one per
block stored or removed). The default workload keeps 8 workers of 4096 16-token blocks busy
and evicting (chat sessions over 8 shared system prompts).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvctl.engine import Fleet, FleetConfig  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--num-blocks", type=int, default=4096)
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--rate", type=float, default=40.0)
    ap.add_argument("--router", default="kv", choices=("random", "round-robin", "kv"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=3, help="runs; the best is reported")
    args = ap.parse_args(argv)
    best = None
    for _ in range(args.repeat):
        fleet = Fleet(
            FleetConfig(
                workers=args.workers,
                num_blocks=args.num_blocks,
                requests=args.requests,
                rate=args.rate,
                router=args.router,
                seed=args.seed,
            )
        )
        batches = events = blocks = 0
        t0 = time.process_time()
        for _t, _i, evs in fleet.run():
            batches += 1
            events += len(evs)
            for e in evs:
                blocks += len(e["block_hashes"])
        cpu = time.process_time() - t0
        if best is None or cpu < best[0]:
            best = (cpu, batches, events, blocks, fleet)
    cpu, batches, events, blocks, fleet = best
    total = fleet.stats()["total"]
    print(
        f"workers={args.workers} router={args.router} requests={args.requests} "
        f"rate={args.rate}/s simulated={fleet.now:.1f} s cpu={cpu:.2f} s"
    )
    print(f"  block events/s: {blocks / cpu:>10,.0f}   ({blocks:,} blocks stored+removed)")
    print(f"  events/s:       {events / cpu:>10,.0f}   ({events:,} event dicts)")
    print(f"  batches/s:      {batches / cpu:>10,.0f}   ({batches:,} worker steps with events)")
    print(
        f"  simulated/cpu:  {fleet.now / cpu:>10,.1f}x  hit rate {total['hit_rate']:.1%}, "
        f"evictions {total['removed_blocks']:,}, preemptions {total['preemptions']:,}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
