"""tap --json throughput vs the bare-Python limit, in the same run.

Both consumers read the same pre-queued stream of realistic vLLM batches from a real ZMQ PUB in
another process: the bare loop does ``recv_multipart`` + ``msgpack.unpackb`` and nothing else;
kvctl runs tap's code path (LiveSource -> decode -> seq tracking -> filters/limits ->
JsonLinesSink writing every event as a JSON line to /dev/null). The publisher queues the whole
stream before the consumer starts reading, so only the consumer is timed.

    python bench/tap_throughput.py [--batches 50000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import statistics
import time

import msgpack
import zmq


def free_port() -> int:
    import socket

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
            events.append({"type": "BlockStored",
                           "block_hashes": [rng.getrandbits(64) for _ in range(blocks)],
                           "parent_block_hash": rng.getrandbits(64), "block_size": 16,
                           "token_ids": [rng.randrange(150_000) for _ in range(16 * blocks)],
                           "lora_id": None, "medium": "GPU", "lora_name": None})
        if rng.random() < 0.3:
            events.append({"type": "BlockRemoved",
                           "block_hashes": [rng.getrandbits(64) for _ in range(rng.randint(1, 8))],
                           "medium": "GPU"})
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


def run_round(kind: str, payloads: list[bytes], port: int) -> tuple[float, int]:
    endpoint = f"tcp://127.0.0.1:{port}"
    ready, go, done = mp.Event(), mp.Event(), mp.Event()
    proc = mp.Process(target=publisher, args=(endpoint, payloads, ready, go, done))
    proc.start()
    ready.wait(10)
    n = len(payloads)
    if kind == "bare":
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.connect(endpoint)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        time.sleep(0.3)  # subscription propagation; not timed
        go.set()
        done.wait(60)
        events = 0
        start = time.perf_counter()
        recv, unpackb = sock.recv_multipart, msgpack.unpackb
        for _ in range(n):
            _topic, _seq, payload = recv()
            events += len(unpackb(payload)[1])
        elapsed = time.perf_counter() - start
        sock.close(0)
    else:
        from kvctl.output import JsonLinesSink
        from kvctl.pipeline import Limits, LiveSource, SourceSpec, run

        source = LiveSource([SourceSpec.parse(endpoint)])
        time.sleep(0.3)
        go.set()
        done.wait(60)
        with open("/dev/null", "wb") as devnull:
            sink = JsonLinesSink(devnull)
            start = time.perf_counter()
            summary = run(source, sink, Limits(idle_timeout=0.5))
            elapsed = time.perf_counter() - start - 0.5  # minus the idle wait that ended it
            sink.close()
        source.close()
        events = summary.total_events
        assert summary.batches == n, f"kvctl saw {summary.batches} of {n} batches"
    proc.join(10)
    return elapsed, events


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    payloads = realistic_payloads(args.batches)
    raw = sum(map(len, payloads))
    rates: dict[str, list[float]] = {"bare": [], "kvctl": []}
    for _ in range(args.rounds):
        for kind in ("bare", "kvctl"):
            elapsed, events = run_round(kind, payloads, free_port())
            rates[kind].append(events / elapsed)
    bare, kv = statistics.median(rates["bare"]), statistics.median(rates["kvctl"])
    print(f"stream: {args.batches} batches, {events} events, {raw / args.batches:.0f} B/batch")
    print(f"bare recv_multipart+unpackb : {bare:12,.0f} events/s (median of {args.rounds})")
    print(f"kvctl tap --json > /dev/null: {kv:12,.0f} events/s (median of {args.rounds})")
    per_round = ", ".join(f"{k / b:.2f}" for k, b in zip(rates["kvctl"], rates["bare"],
                                                           strict=True))
    print(f"ratio kvctl/bare: {kv / bare:.2f}  (per-round ratios: {per_round})")


if __name__ == "__main__":
    main()
