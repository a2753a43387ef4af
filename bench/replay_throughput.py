"""replay: --topspeed vs a bare send_multipart loop, in the same run; from the frames cache
(prepared, the default) and decoding the recording while sending (--no-cache).

A recording of realistic vLLM batches is replayed by `kvctl replay` (a subprocess, exactly as
users run it) into a SUB draining in another process; its own report gives the send time. The
bare limit is a plain pyzmq PUB sending the same frames in a loop to the same kind of drain.
The frames cache is built once first (`kvctl replay --prepare`, timed apart). Pacing accuracy
is `bench/pacing.py`.

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


def bare(frames: list[list[bytes]]) -> tuple[float, float]:
    """Batches per second, and CPU seconds per batch."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    sock = zmq.Context.instance().socket(zmq.XPUB)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.bind(endpoint)
    ready = mp.Event()
    proc = mp.Process(target=drain, args=(endpoint, len(frames), ready))
    proc.start()
    sock.recv()  # the drain subscribed
    send = sock.send_multipart
    cpu = time.process_time()
    start = time.perf_counter()
    for f in frames:
        send(f, copy=False)
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu
    proc.join(60)
    sock.close(0)
    return len(frames) / elapsed, cpu / len(frames)


def kvctl(path: Path, batches: int, *args: str) -> dict:
    """`kvctl replay PATH ARGS` into a draining SUB in another process: its JSON report."""
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


def prepare(path: Path) -> float:
    """Build the frames cache of ``path`` (`kvctl replay --prepare`); seconds it took."""
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "kvctl", "replay", "--prepare", str(path), "-q"], check=True
    )
    return time.perf_counter() - started


def bench_frames(batches: int) -> list[list[bytes]]:
    return [[b"", i.to_bytes(8, "big"), p] for i, p in enumerate(realistic_payloads(batches))]


def write_recording(path: Path, frames: list[list[bytes]], step_ns: int = 100_000) -> None:
    """The frames as a recording, received ``step_ns`` apart."""
    from kvctl.formats import decode_zmq
    from kvctl.recording.writer import RecordingWriter

    writer = RecordingWriter(path)
    for i, f in enumerate(frames):
        writer.write(decode_zmq(f, "tcp://bench", 1_700_000_000_000_000_000 + i * step_ns))
    writer.close()


def ratios(values: list[float], reference: list[float]) -> str:
    return ", ".join(f"{x / y:.2f}" for x, y in zip(values, reference, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    frames = bench_frames(args.batches)
    with tempfile.TemporaryDirectory(prefix="kvctl-bench-") as tmp:
        path = Path(tmp) / "run.parquet"
        write_recording(path, frames)
        prepared_s = prepare(path)
        rates: dict[str, list[float]] = {"bare": [], "prepared": [], "decoding": []}
        cpu: dict[str, list[float]] = {name: [] for name in rates}
        for _ in range(args.rounds):
            rate, per_batch = bare(frames)
            rates["bare"].append(rate)
            cpu["bare"].append(per_batch)
            for name, extra in (("prepared", ()), ("decoding", ("--no-cache",))):
                report = kvctl(path, args.batches, "--topspeed", *extra)
                rates[name].append(report["batches_per_s"])
                cpu[name].append(report["cpu_s"] / report["batches"])
        b = statistics.median(rates["bare"])
        print(f"{args.batches} batches, {args.rounds} rounds, medians")
        print(
            f"kvctl replay --prepare                : {prepared_s:9.2f} s "
            f"({args.batches / prepared_s:,.0f} batches/s; once per recording and format)"
        )
        print(
            f"bare send_multipart loop              : {b:12,.0f} batches/s   "
            f"CPU {statistics.median(cpu['bare']) * 1e6:5.1f} µs/batch"
        )
        for name, label in (
            ("prepared", "kvctl replay --topspeed (prepared)   "),
            ("decoding", "kvctl replay --topspeed --no-cache   "),
        ):
            k = statistics.median(rates[name])
            print(
                f"{label} : {k:12,.0f} batches/s   "
                f"CPU {statistics.median(cpu[name]) * 1e6:5.1f} µs/batch   ratio {k / b:.2f} "
                f"(rounds: {ratios(rates[name], rates['bare'])})"
            )


if __name__ == "__main__":
    main()
