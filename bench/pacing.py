"""replay pacing: how late each send is against its absolute schedule (p50/p99/max) at fixed
rates, kvctl replay from the frames cache and decoding while sending (--no-cache), next to a
bare paced sender (sleep until just before the due time, then spin, then send_multipart) in
the same run.

Every run sends a realistic vLLM recording into a SUB draining in another process for
`--seconds` at each rate; kvctl's lateness comes from its own report.

    python bench/pacing.py [--seconds 3] [--rates 1000,10000,50000] [--rounds 1]
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path

import zmq
from _stream import free_port
from replay_throughput import bench_frames, drain, kvctl, prepare, write_recording

SPIN_S = 0.0005  # what kvctl's schedule spins before a due time, too
STEP_NS = 100_000  # recorded batches 0.1 ms apart: any rate's window is a time window


def bare_paced(frames: list[list[bytes]], rate: float) -> dict[str, float]:
    """A bare paced sender: batch k due at start + k / rate."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    sock = zmq.Context.instance().socket(zmq.XPUB)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.bind(endpoint)
    ready = mp.Event()
    proc = mp.Process(target=drain, args=(endpoint, len(frames), ready))
    proc.start()
    sock.recv()  # the drain subscribed
    send, clock, sleep = sock.send_multipart, time.perf_counter, time.sleep
    lateness = []
    gc.freeze()  # as kvctl does: no full collection over the frames while sending
    start = clock()
    for k, f in enumerate(frames):
        due = start + k / rate
        now = clock()
        if due - now > SPIN_S:
            sleep(due - now - SPIN_S)
        while (now := clock()) < due:
            pass
        lateness.append(now - due)
        send(f, copy=False)
    elapsed = clock() - start
    gc.unfreeze()
    proc.join(60)
    sock.close(0)
    values = sorted(lateness)
    n = len(values)
    return {
        "median_ms": values[n // 2] * 1e3,
        "p99_ms": values[min(n - 1, int(n * 0.99))] * 1e3,
        "max_ms": values[-1] * 1e3,
        "achieved": (n - 1) / elapsed if n > 1 else 0.0,
    }


def kvctl_paced(path: Path, batches: int, rate: float, *args: str) -> dict[str, float]:
    # the recorded batches are STEP_NS apart: the first `batches` lie before this time
    end = (batches - 0.5) * STEP_NS / 1e9
    report = kvctl(path, batches, "--rate", str(rate), "--end", repr(end), *args)
    late = report["lateness"]
    return {
        "median_ms": late["median_ms"],
        "p99_ms": late["p99_ms"],
        "max_ms": late["max_ms"],
        "achieved": report["batches"] / report["elapsed_s"],
        "batches": report["batches"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rates", default="1000,10000,50000")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    counts = {rate: max(2, int(rate * args.seconds)) for rate in rates}
    frames = bench_frames(max(counts.values()))
    with tempfile.TemporaryDirectory(prefix="kvctl-bench-") as tmp:
        path = Path(tmp) / "run.parquet"
        write_recording(path, frames, STEP_NS)
        prepare(path)
        print(f"{args.seconds:g} s per rate, {args.rounds} round(s), medians; lateness in ms")
        print(f"{'rate':>8} {'sender':<24} {'p50':>7} {'p99':>7} {'max':>7} {'achieved/s':>12}")
        for rate in rates:
            n = counts[rate]
            runs: dict[str, list[dict[str, float]]] = {"bare": [], "prepared": [], "decoding": []}
            for _ in range(args.rounds):
                runs["bare"].append(bare_paced(frames[:n], rate))
                runs["prepared"].append(kvctl_paced(path, n, rate))
                runs["decoding"].append(kvctl_paced(path, n, rate, "--no-cache"))
            for name, label in (
                ("bare", "bare paced sender"),
                ("prepared", "kvctl replay (prepared)"),
                ("decoding", "kvctl replay --no-cache"),
            ):
                figures = {
                    key: statistics.median(r[key] for r in runs[name])
                    for key in ("median_ms", "p99_ms", "max_ms", "achieved")
                }
                print(
                    f"{rate:>8,.0f} {label:<24} {figures['median_ms']:7.3f} "
                    f"{figures['p99_ms']:7.3f} {figures['max_ms']:7.3f} "
                    f"{figures['achieved']:12,.1f}"
                )


if __name__ == "__main__":
    main()
