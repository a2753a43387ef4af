"""Partitioned recorder (and bridge) throughput vs bare nats-py loops: the capacity figures.

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

``--cluster`` runs a 3-node nats-server cluster (tests/nats_cluster.py) instead of one server,
``--replicas R`` makes the stream R-fold, ``--recorders K`` runs K recorders at once (the
partitions dealt among them, one ``-o``). ``--bridge`` also times the edge: ``kvctl bridge`` of
8 engine sockets (messages queued by a ZMQ publisher process, the bridge subscribed before)
until a fresh stream holds them all, against nats-py's ``publish_async`` filling the stream
(window 4000). The last line is the figures as JSON: the README's capacity table is computed
from them.

    python bench/record_stream.py [--messages 100000] [--rounds 3] [--profile FILE]
    python bench/record_stream.py --cluster --replicas 3 --recorders 2 --bridge
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
from typing import Any

from _stream import engine_sockets, free_port, realistic_payloads

PARTITIONS = 4
WORKERS = 64
ROOT = Path(__file__).resolve().parent.parent


def kvctl(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-m", "kvctl", *args], cwd=ROOT, capture_output=True, text=True
    )
    if check and result.returncode != 0:
        raise SystemExit(f"kvctl {' '.join(args)}: {result.stderr.strip()}")
    return result


def engine_messages(n: int, workers: int = WORKERS) -> list[tuple[int, int, list[bytes], int]]:
    """(worker, seq, raw frames, events) of ``n`` realistic vLLM messages, round-robin over
    ``workers`` engines, each counting its own seqs."""
    import msgpack

    from kvctl.formats.engine_zmq import encode_frames

    distinct = realistic_payloads(min(n, 5000))
    counts = [len(msgpack.unpackb(p)[1]) for p in distinct]
    return [
        (i % workers, i // workers, encode_frames(b"", i // workers, distinct[j]), counts[j])
        for i in range(n)
        for j in [i % len(distinct)]
    ]


def fleet_messages(n: int) -> tuple[list[tuple[str, dict[str, str], bytes]], int]:
    """(publish subject, headers, body) of ``n`` fleet messages, and their event count: the
    engine messages as a bridge wraps them."""
    from kvctl.partitions import MSG_ID, FleetMessage, StreamLayout, message_id

    layout = StreamLayout("bench", PARTITIONS)  # subjects only; the name is replaced below
    out, events = [], 0
    base = time.time_ns()
    for i, (worker, seq, frames, count) in enumerate(engine_messages(n)):
        events += count
        fm = FleetMessage(
            base + i * 1000,
            f"tcp://10.0.{worker // 16}.{worker % 16}:5557",
            "",
            frames,
            json.dumps(str(worker)),
            "0",
            events=count,
        )
        headers, body = fm.headers(), fm.body()
        headers[MSG_ID] = message_id(str(worker), 0, seq, body)
        out.append((layout.publish_subject(str(worker)), headers, body))
    return out, events


async def fill(
    url: str,
    stream: str,
    messages: list[tuple[str, dict[str, str], bytes]],
    create: int | None = None,
) -> None:
    """Publish ``messages`` into ``stream`` (first made with ``create`` replicas if given)
    as fast as nats-py's publish_async goes: the limit a bridge is compared with."""
    import nats

    if create is not None:
        kvctl("stream", "init", url, "--name", stream, "--partitions", str(PARTITIONS),
              "--replicas", str(create))  # fmt: skip

    nc = await nats.connect(servers=url.split(","))
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

    nc = await nats.connect(servers=url.split(","))
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


async def watch(url: str, stream: str, procs: list[subprocess.Popen]) -> dict[str, float]:
    """Poll the recorders' consumers every 10 ms: when they all exist (the recorders are up:
    imported, connected, positioned; their CPU seconds then), when the server has delivered
    everything (num_pending == 0) and when everything is acked (num_ack_pending == 0 too)."""
    import nats

    from kvctl.transports.jetstream import consumer_name

    nc = await nats.connect(servers=url.split(","))
    js = nc.jetstream()
    seen: dict[str, float] = {}
    latest: dict[int, Any] = {}
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            for proc in procs:
                if proc.poll() is not None:
                    raise SystemExit(f"a recorder exited early: {proc.stderr.read()}")
            for p in range(PARTITIONS):
                # a cluster may not answer one of them in time: its last answer stands
                with contextlib.suppress(Exception):
                    latest[p] = await js.consumer_info(stream, consumer_name(stream, p))
            now = time.perf_counter()
            infos = list(latest.values())
            if len(infos) == PARTITIONS:
                if "up" not in seen:
                    seen["up"], seen["up_cpu"] = now, sum(_cpu_of(p.pid) for p in procs)
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
    url: str,
    stream: str,
    total: int,
    out: Path,
    extra: list[str],
    profile: str | None = None,
    recorders: int = 1,
) -> dict:
    """``recorders`` recorders at once, each of its share of the partitions, one ``-o``."""
    shutil.rmtree(out, ignore_errors=True)  # every round records the whole stream again
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    groups = [list(range(PARTITIONS))[i::recorders] for i in range(recorders)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "kvctl", "record", url, "--stream", stream]
            + ["--partition", ",".join(map(str, group)) + f"/{PARTITIONS}"]
            + ["-o", str(out), "--json", *extra],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for group in groups
    ]
    spy = None
    if profile:  # py-spy attached to the (first) recorder (collapsed stacks, for flamegraph.pl)
        spy = subprocess.Popen(
            [str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(procs[0].pid)]
            + ["--format", "raw", "-o", profile, "--nonblocking", "--rate", "200"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    seen = asyncio.run(watch(url, stream, procs))
    own_cpu = sum(_cpu_of(p.pid) for p in procs)  # before SIGINT: the receive loops'
    summaries = []
    for proc in procs:
        proc.send_signal(signal.SIGINT)
    for proc in procs:
        stdout, stderr = proc.communicate(60)
        summaries.append(json.loads(stdout)["summary"] if stdout.strip() else {})
    if spy is not None:
        spy.wait(30)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    recorded = sum(x.get("messages", 0) for x in summaries)
    if recorded != total:
        raise SystemExit(f"the recorders recorded {recorded} of {total}: {stderr}")
    if seen["acked"] <= seen["up"]:
        # a stream recorded before the consumers were first seen (a tiny run, or a cluster
        # slow to answer): when it was up is unknown, the start is the conservative bound
        seen["up"] = start
    return {
        "elapsed": seen["acked"] - start,
        "steady": seen["acked"] - seen["up"],
        "delivered": seen["delivered"] - seen["up"],
        "cpu": own_cpu,
        "steady_cpu": own_cpu - seen["up_cpu"],
        "writer_cpu": (after.ru_utime + after.ru_stime)
        - (before.ru_utime + before.ru_stime)
        - own_cpu,
        "rss_kb": max(x.get("peak_rss_kb", 0) for x in summaries),
        "writer_rss_kb": max(x.get("writer_peak_rss_kb", 0) for x in summaries),
        "events": sum(x.get("events", 0) for x in summaries),
    }


BRIDGE_SOURCES = 8
"""Engine sockets one bridge reads in the edge round: a node's engines."""


def _engines(endpoints: list[str], messages: list[list[list[bytes]]], ready, go) -> None:
    """One XPUB per engine, its messages queued whole once the bridge subscribed and ``go``
    is set (the bridge then drains queues, as from engines publishing faster than it)."""
    ctx, socks = engine_sockets(endpoints, ready, go)
    for sock, frames_list in zip(socks, messages, strict=True):
        for frames in frames_list:
            sock.send_multipart(frames)
    for sock in socks:
        sock.recv()  # the unsubscription: the bridge has closed, everything was delivered
        sock.close(linger=0)
    ctx.term()


async def _stored(url: str, stream: str) -> int:
    import nats

    nc = await nats.connect(servers=url.split(","))
    try:
        return (await nc.jetstream().stream_info(stream)).state.messages
    finally:
        await nc.close()


def bridge_round(url: str, stream: str, n: int) -> float:
    """Seconds ``kvctl bridge`` of BRIDGE_SOURCES engine sockets takes from the engines'
    first send until the stream holds all ``n`` messages (the bridge started and subscribed
    before: its start-up is not part of it)."""
    import multiprocessing as mp

    engine = engine_messages(n, BRIDGE_SOURCES)
    per_socket: list[list[list[bytes]]] = [[] for _ in range(BRIDGE_SOURCES)]
    for worker, _, frames, _ in engine:
        per_socket[worker].append(frames)
    endpoints = [f"tcp://127.0.0.1:{free_port()}" for _ in range(BRIDGE_SOURCES)]
    ready, go = mp.Event(), mp.Event()
    engines = mp.Process(target=_engines, args=(endpoints, per_socket, ready, go))
    engines.start()
    ready.wait(30)
    before = asyncio.run(_stored(url, stream))
    bridge = subprocess.Popen(
        [sys.executable, "-m", "kvctl", "bridge"]
        + [f"{i}={e}" for i, e in enumerate(endpoints)]
        + ["--to", url, "--stream", stream, "--idle-timeout", "2", "--max-queue", "4G", "-q"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(2.0)  # the bridge's start-up and subscriptions (not timed)
        start = time.perf_counter()
        go.set()
        deadline = time.monotonic() + 600
        while asyncio.run(_stored(url, stream)) - before < n:
            if bridge.poll() is not None:
                raise SystemExit(f"kvctl bridge ended early: {bridge.stderr.read()[-2000:]}")
            if time.monotonic() > deadline:
                raise SystemExit("kvctl bridge did not store everything within 600 s")
            time.sleep(0.02)
        elapsed = time.perf_counter() - start
    finally:
        bridge.wait(60)
        engines.join(30)
    return elapsed


def _cpu_of(pid: int) -> float:
    """User + system CPU seconds of a live process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def delete_consumers(url: str, stream: str) -> None:
    import nats

    from kvctl.transports.jetstream import consumer_name

    nc = await nats.connect(servers=url.split(","))
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
    parser.add_argument(
        "--cluster", action="store_true", help="a 3-node cluster (tests/nats_cluster.py)"
    )
    parser.add_argument("--replicas", type=int, default=1, help="R of the stream")
    parser.add_argument("--recorders", type=int, default=1, help="recorders at once")
    parser.add_argument(
        "--bridge", action="store_true", help="also time kvctl bridge against the bare publisher"
    )
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvctl-bench-stream-"))
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, tmp, ignore_errors=True)
        # the servers the tests start: nats-server from the test extra, on free ports
        sys.path.insert(0, str(ROOT / "tests"))
        if args.cluster:
            from nats_cluster import NatsCluster

            (tmp / "cluster").mkdir()
            url = stack.enter_context(NatsCluster(tmp / "cluster")).url
        else:
            from conftest import NatsServer

            server = NatsServer(tmp / "js")
            stack.callback(server.stop)
            url = server.url
        run(args, url, tmp)


def run(args: argparse.Namespace, url: str, tmp: Path) -> None:
    stream = "bench"
    kvctl("stream", "init", url, "--name", stream, "--partitions", str(PARTITIONS),
          "--replicas", str(args.replicas))  # fmt: skip
    messages, events = fleet_messages(args.messages)
    n = args.messages
    raw = sum(len(b) for _, _, b in messages)
    started = time.perf_counter()
    asyncio.run(fill(url, stream, messages))
    filled = n / (time.perf_counter() - started)
    print(
        f"stream: {n:,} fleet messages of {WORKERS} workers in {PARTITIONS} partitions, "
        f"R{args.replicas} on {'a 3-node cluster' if args.cluster else 'one server'}, "
        f"{events:,} events, {raw / n:.0f} B/message body; {args.recorders} recorder(s); "
        f"{args.rounds} rounds, medians"
    )
    per_event = events / n
    bare: list[float] = []
    bare_cpu: list[float] = []
    rec: list[dict] = []
    publish: list[float] = [filled]
    bridged: list[float] = []
    for round_ in range(args.rounds):
        elapsed, cpu = asyncio.run(bare_round(url, stream, n))
        bare.append(n / elapsed)
        bare_cpu.append(cpu)
        asyncio.run(delete_consumers(url, stream))
        rec.append(
            record_round(
                url,
                stream,
                n,
                tmp / "ds",
                args.record_args.split(),
                args.profile,
                args.recorders,
            )
        )
        asyncio.run(delete_consumers(url, stream))
        if args.bridge:
            edge = f"edge{round_}"
            kvctl("stream", "init", url, "--name", edge, "--partitions", str(PARTITIONS),
                  "--replicas", str(args.replicas))  # fmt: skip
            bridged.append(n / bridge_round(url, edge, n))
            if round_:  # the first fill is the one above
                started = time.perf_counter()
                asyncio.run(fill(url, f"fill{round_}", messages, create=args.replicas))
                publish.append(n / (time.perf_counter() - started))
    b = statistics.median(bare)

    def line(name: str, rates: list[float], base: list[float]) -> str:
        r = statistics.median(rates)
        per_round = ", ".join(f"{x / y:.2f}" for x, y in zip(rates, base, strict=False))
        return (
            f"{name:40s} {r:8,.0f} msg/s {r * per_event:9,.0f} events/s"
            f"   ratio {r / statistics.median(base):.2f} (rounds: {per_round})"
        )

    def median(key: str) -> float:
        return statistics.median(x[key] for x in rec)

    print(
        f"{'bare nats-py fetch+ack (the limit)':40s} {b:8,.0f} msg/s {b * per_event:9,.0f}"
        f" events/s   CPU {statistics.median(bare_cpu) * 1e6 / n:.0f} us/message"
    )
    recorded = [n / x["elapsed"] for x in rec]
    steady = [n / x["steady"] for x in rec]
    print(line("kvctl record: start to all acked", recorded, bare))
    print(line("kvctl record: up to all acked", steady, bare))
    print(line("kvctl record: up to all delivered", [n / x["delivered"] for x in rec], bare))
    print(
        f"recorder CPU {median('cpu'):.2f} s, {median('steady_cpu') * 1e6 / n:.0f} us/message "
        f"once up; segment writer CPU {median('writer_cpu'):.2f} s "
        f"({median('writer_cpu') * 1e6 / n:.0f} us/message); peak RSS recorder "
        f"{max(x['rss_kb'] for x in rec) / 1024:.0f} MB, writer "
        f"{max(x['writer_rss_kb'] for x in rec) / 1024:.0f} MB"
    )
    figures = {
        "replicas": args.replicas,
        "cluster": args.cluster,
        "recorders": args.recorders,
        "events_per_message": round(per_event, 2),
        "bare_fetch_ack": round(b),
        "record_up_to_acked": round(statistics.median(steady)),
        "record_start_to_acked": round(statistics.median(recorded)),
    }
    if args.bridge:
        print(
            f"{'bare nats-py publish_async (the limit)':40s} "
            f"{statistics.median(publish):8,.0f} msg/s"
        )
        print(line(f"kvctl bridge of {BRIDGE_SOURCES} engines", bridged, publish))
        figures["bare_publish"] = round(statistics.median(publish))
        figures["bridge"] = round(statistics.median(bridged))
    print(json.dumps(figures))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
