"""The README's capacity table, computed from measured figures: the JSON lines that
``bench/record_stream.py`` prints last (one per run), read from stdin or files.

It takes the R3 figures of a 3-node cluster (the deployment the guide recommends): the
messages/s one ``kvctl bridge`` stored (``--bridge``) and one recorder committed and acked
(``record_up_to_acked``), and sizes a fleet of N workers each publishing ``--rate`` batches/s:
bridges (one per node of ``--workers-per-node`` engines, and what share of one that node uses),
recorders (each loaded to ``--headroom`` of what was measured, so that a recorder restarted
after a failure catches up at twice the stream's rate), partitions (a power of two, at least
twice the recorders: a group can double without re-partitioning) and the raw bytes per day.

    python bench/record_stream.py --cluster --replicas 3 --bridge | tail -1 > r3.json
    python bench/capacity.py r3.json [--rate 100] [--workers 100 1000 10000]
"""

from __future__ import annotations

import argparse
import fileinput
import json
import math


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", help="record_stream.py outputs (default: stdin)")
    parser.add_argument("--rate", type=float, default=100.0, help="batches/s per worker")
    parser.add_argument("--bytes", type=float, default=1190.0, help="bytes per batch")
    parser.add_argument("--workers", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--workers-per-node", type=int, default=8)
    parser.add_argument("--headroom", type=float, default=0.5)
    args = parser.parse_args()
    with fileinput.input(args.files) as lines:
        runs = [json.loads(line) for line in lines if line.startswith("{")]
    chosen = [r for r in runs if r.get("cluster") and r.get("replicas") == 3 and "bridge" in r]
    if not chosen:
        raise SystemExit("no R3 cluster run with --bridge among the figures")
    figures = chosen[-1]
    bridge, recorder = figures["bridge"], figures["record_up_to_acked"]
    print(
        f"measured (R3, 3-node cluster): bridge {bridge:,} msg/s, one recorder {recorder:,} "
        f"msg/s committed and acked; {args.rate:g} batches/s per worker of {args.bytes:,.0f} B, "
        f"recorders loaded to {args.headroom:.0%}"
    )
    print()
    print(
        "| workers | messages/s | MB/s | bridges (one per node) | load of one bridge "
        "| recorders | partitions | raw GB/day |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for workers in args.workers:
        rate = workers * args.rate
        nodes = math.ceil(workers / args.workers_per_node)
        node_share = args.workers_per_node * args.rate / bridge
        recorders = max(1, math.ceil(rate / (recorder * args.headroom)))
        partitions = 2 ** math.ceil(math.log2(2 * recorders))
        print(
            f"| {workers:,} | {rate:,.0f} | {rate * args.bytes / 1e6:,.0f} | {nodes:,} "
            f"| {node_share:.0%} | {recorders:,} | {partitions:,} "
            f"| {rate * args.bytes * 86400 / 1e9:,.0f} |"
        )


if __name__ == "__main__":
    main()
