"""Shared pieces of the throughput benchmarks: a realistic vLLM stream pre-queued by a real ZMQ
PUB in another process, and the bare-Python consumer every kvctl figure is compared with."""

from __future__ import annotations

import multiprocessing as mp
import random
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import zmq

# The kvctl of this checkout, not whichever one the environment has installed: a benchmark
# measures the code next to it.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def realistic_payloads(n: int, seed: int = 0) -> list[bytes]:
    """vLLM map-form batches: mostly 1-4 BlockStored events of 1-8 blocks of 16 tokens, some
    BlockRemoved, u64 hashes, as a busy decode/prefill step publishes them."""
    from kvctl.formats.engine_zmq import encode_payload

    rng = random.Random(seed)
    payloads = []
    for _ in range(n):
        events = []
        for _ in range(rng.randint(1, 4)):
            blocks = rng.randint(1, 8)
            events.append(
                {
                    "type": "BlockStored",
                    "block_hashes": [rng.getrandbits(64) for _ in range(blocks)],
                    "parent_block_hash": rng.getrandbits(64),
                    "block_size": 16,
                    "token_ids": [rng.randrange(150_000) for _ in range(16 * blocks)],
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                }
            )
        if rng.random() < 0.3:
            events.append(
                {
                    "type": "BlockRemoved",
                    "block_hashes": [rng.getrandbits(64) for _ in range(rng.randint(1, 8))],
                    "medium": "GPU",
                }
            )
        payloads.append(encode_payload(events, time.time(), 0))
    return payloads


def publisher(endpoint: str, payloads: list[bytes], ready, go, done) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.XPUB)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.bind(endpoint)
    ready.set()
    sock.recv()  # the subscription: a consumer is connected
    go.wait()
    for seq, payload in enumerate(payloads):
        sock.send_multipart([b"", seq.to_bytes(8, "big"), payload])
    done.set()
    sock.recv()  # the unsubscription (consumer closed): everything was delivered
    sock.close(linger=0)
    ctx.term()


def engine_sockets(endpoints: list[str], ready: Any, go: Any) -> tuple[zmq.Context, list[Any]]:
    """One XPUB per engine endpoint, unbounded send queues; ``ready`` is set once they are
    bound, and they are returned once each has a subscriber and ``go`` is set (a consumer
    connected to all of them, the timed part may start)."""
    ctx = zmq.Context()
    socks = []
    for endpoint in endpoints:
        sock = ctx.socket(zmq.XPUB)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.bind(endpoint)
        socks.append(sock)
    ready.set()
    for sock in socks:
        sock.recv()  # a subscription
    go.wait()
    return ctx, socks


PREQUEUED_QUEUE_BYTES = 4_000_000_000
"""``--max-queue`` for kvctl consumers of a pre-queued stream: the whole stream is queued
before the first read here (the default 64M holds ~27,000 messages of the assumed 2 KB), and
the bare loop's queue is unbounded too, so both drain the same stream."""


class Bare:
    """The bare-Python limit: recv_multipart + msgpack.unpackb, nothing else."""

    name = "bare recv_multipart+unpackb"

    def connect(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.connect(endpoint)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")

    def consume(self, batches: int) -> tuple[float, float, int]:
        events = 0
        recv, unpackb = self.sock.recv_multipart, msgpack.unpackb
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(batches):
            _topic, _seq, payload = recv()
            events += len(unpackb(payload)[1])
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        self.sock.close(0)
        return elapsed, cpu, events


def timed_round(consumer, payloads: list[bytes]) -> tuple[float, float, int]:
    """Queue the whole stream from a publisher process, then time ``consumer`` draining it:
    ``(wall seconds, CPU seconds of the consumer's process, events)``."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    ready, go, done = mp.Event(), mp.Event(), mp.Event()
    proc = mp.Process(target=publisher, args=(endpoint, payloads, ready, go, done))
    proc.start()
    ready.wait(10)
    consumer.connect(endpoint)
    time.sleep(0.3)  # subscription propagation (not timed; the publisher waits for it anyway)
    go.set()
    done.wait(120)
    result = consumer.consume(len(payloads))
    proc.join(10)
    return result


def compare(
    consumers: list, payloads: list[bytes], rounds: int, report: Callable[[str], None] = print
) -> dict[str, list[float]]:
    """Alternate the consumers for ``rounds`` rounds; print medians and the ratio to the first,
    of events per wall second and of events per CPU second of the consumer's process (on a
    shared machine the CPU figure is the steadier one: time the scheduler gave others is not
    in it)."""
    import statistics

    rates: dict[str, list[float]] = {c.name: [] for c in consumers}
    cpu_rates: dict[str, list[float]] = {c.name: [] for c in consumers}
    events = 0
    for _ in range(rounds):
        for make in consumers:
            elapsed, cpu, events = (
                timed_round(make.fresh(), payloads)
                if hasattr(make, "fresh")
                else timed_round(type(make)(), payloads)
            )
            rates[make.name].append(events / elapsed)
            cpu_rates[make.name].append(events / cpu)
    raw = sum(map(len, payloads))
    report(
        f"stream: {len(payloads)} batches, {events} events, {raw / len(payloads):.0f} B/batch;"
        f" {rounds} rounds, medians"
    )
    base = consumers[0].name
    for name, values in rates.items():
        med = statistics.median(values)
        ratio = med / statistics.median(rates[base])
        per_round = ", ".join(f"{v / b:.2f}" for v, b in zip(values, rates[base], strict=True))
        report(f"{name:34s} {med:12,.0f} events/s   ratio {ratio:.2f} (rounds: {per_round})")
    for name, values in cpu_rates.items():
        med = statistics.median(values)
        ratio = med / statistics.median(cpu_rates[base])
        per_round = ", ".join(f"{v / b:.2f}" for v, b in zip(values, cpu_rates[base], strict=True))
        report(f"{name:34s} {med:12,.0f} events/CPU-s ratio {ratio:.2f} (rounds: {per_round})")
    return rates
