"""replay: --topspeed vs a bare send_multipart loop, and --rate accuracy, in the same run.

A recording of realistic vLLM batches is replayed by `kvctl replay` (a subprocess, exactly as
users run it) into a SUB draining in another process; its own report gives the send time. The
bare limit is a plain pyzmq PUB sending the same frames in a loop to the same kind of drain.

    python bench/replay_throughput.py [--batches 50000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import zmq
from _stream import free_port, realistic_payloads


def drain(endpoint: str, expected: int, ready) -> None:
    sock = zmq.Context().socket(zmq.SUB)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    ready.set()
    got = 0
    while got < expected and sock.poll(10_000):
        sock.recv_multipart()
        got += 1
    sock.close(0)


def bare(frames: list[list[bytes]]) -> float:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    sock = zmq.Context.instance().socket(zmq.XPUB)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.bind(endpoint)
    ready = mp.Event()
    proc = mp.Process(target=drain, args=(endpoint, len(frames), ready))
    proc.start()
    sock.recv()  # the drain subscribed
    send = sock.send_multipart
    start = time.perf_counter()
    for f in frames:
        send(f, copy=False)
    elapsed = time.perf_counter() - start
    proc.join(60)
    sock.close(0)
    return len(frames) / elapsed


def kvctl(path: Path, batches: int, *args: str) -> dict:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    ready = mp.Event()
    proc = mp.Process(target=drain, args=(endpoint, batches, ready))
    replay = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvctl",
            "replay",
            str(path),
            "--to",
            endpoint,
            "--wait-subscribers",
            "1",
            "--json",
            "-q",
            *args,
        ],
        stdout=subprocess.PIPE,
    )
    proc.start()
    out, _ = replay.communicate(timeout=600)
    proc.join(60)
    return json.loads(out)


def main() -> None:
    from kvctl.formats import decode_zmq
    from kvctl.recording.writer import RecordingWriter

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    payloads = realistic_payloads(args.batches)
    frames = [[b"", i.to_bytes(8, "big"), p] for i, p in enumerate(payloads)]
    with tempfile.TemporaryDirectory(prefix="kvctl-bench-") as tmp:
        paths = {}
        for n in (args.batches, 5_000):  # 5 s at --rate 1000 (and 10000 with the default)
            paths[n] = path = Path(tmp) / f"run-{n}.parquet"
            writer = RecordingWriter(path)
            for i, f in enumerate(frames[:n]):
                writer.write(decode_zmq(f, "tcp://bench", 1_700_000_000_000_000_000 + i * 100_000))
            writer.close()
        path = paths[args.batches]
        rates = {"bare": [], "kvctl": []}
        for _ in range(args.rounds):
            rates["bare"].append(bare(frames))
            rates["kvctl"].append(kvctl(path, args.batches, "--topspeed")["batches_per_s"])
        b, k = statistics.median(rates["bare"]), statistics.median(rates["kvctl"])
        print(f"{args.batches} batches, {args.rounds} rounds, medians")
        print(f"bare send_multipart loop : {b:12,.0f} batches/s")
        print(
            f"kvctl replay --topspeed  : {k:12,.0f} batches/s   ratio {k / b:.2f} (rounds: "
            + ", ".join(f"{x / y:.2f}" for x, y in zip(rates["kvctl"], rates["bare"], strict=True))
            + ")"
        )
        for rate, n in ((1_000, 5_000), (10_000, args.batches)):
            report = kvctl(paths[n], n, "--rate", str(rate))
            sent = report["batches"]
            achieved = sent / report["elapsed_s"]
            late = report["lateness"]
            print(
                f"--rate {rate:>6}: {sent} batches, achieved {achieved:,.1f}/s "
                f"(error {abs(achieved - rate) / rate:.3%}), lateness median "
                f"{late['median_ms']:.3f} ms, p99 {late['p99_ms']:.3f} ms, max "
                f"{late['max_ms']:.3f} ms, CPU {report['cpu_percent']:.0f}%"
            )


if __name__ == "__main__":
    main()
