"""The router index: block events applied per second, and /query latency over HTTP.

Usage: python bench/index.py [--requests 3000] [--rounds 5] [--workers 8] [--blocks 100000]
                             [--prompt-tokens 32768] [--queries 300] [--dynamo]

1. **Apply**: a recording of the simulator (``kvctl simulate -o``: 8 workers whose caches evict,
   vLLM batches with token ids) read into memory, then :class:`kvctl.state.RouterIndex` built
   from its batches, timed against a bare loop that only iterates the same batches' events;
   block events (hashes stored or removed) per second, median of ``--rounds``, and the ratio.
2. **Query**: an index of ``--workers`` workers x ``--blocks`` blocks (prompts of
   ``--prompt-tokens`` tokens of a 128k vocabulary, some sharing system prompts or whole
   documents across workers), served by kvctl's HTTP server in a child process;
   ``--queries`` prompts of that length (cached whole, diverging midway, new after a shared
   prefix) posted to ``/query`` one at a time on fresh connections, bodies encoded
   beforehand; round-trip p50/p99, and where the server's time goes (in-process medians).
3. ``--dynamo``: the same two streams fed to Dynamo's standalone indexer (``python -m
   dynamo.indexer``, the ``interop`` extra) over ZMQ, one socket per worker, and to ``kvctl
   index`` the same way: seconds until each has applied every event (its
   ``dynamo_kvrouter_kv_cache_events_applied`` counters), and Dynamo's /query latency on the
   same prompts. Skipped, with the reason, when Dynamo is not importable.

The machine may be shared: compare figures within one run (the ratio), not across runs.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing as mp
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _stream import engine_sockets

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvctl.state import RouterIndex, dynamo_block_hashes  # noqa: E402

BLOCK_SIZE = 16
U63 = (1 << 63) - 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- 1. apply --------------------------------------------------------------------------------


def simulated_batches(workers: int, requests: int, seed: int = 0) -> list[Any]:
    """The batches of a ``kvctl simulate`` recording, decoded once (reading is not timed)."""
    from kvctl.recording.source import RecordingSource

    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "fleet.parquet")
        args = ["--workers", str(workers), "--requests", str(requests), "--seed", str(seed)]
        args += ["--num-blocks", "4096", "--epoch", "1700000000", "--topspeed", "-q", "-o", path]
        subprocess.run([sys.executable, "-m", "kvctl", "simulate", *args], check=True, cwd=ROOT)
        return list(RecordingSource([path]).batches())


def block_events(batches: list[Any]) -> int:
    return sum(len(ev.get("block_hashes") or ()) for b in batches for ev in b.events)


def bare_loop(batches: list[Any]) -> int:
    """The floor: every event of every batch looked at once, nothing applied."""
    n = 0
    for batch in batches:
        for ev in batch.events:
            n += len(ev.get("block_hashes") or ())
    return n


def bench_apply(batches: list[Any], rounds: int) -> None:
    blocks = block_events(batches)
    events = sum(len(b.events) for b in batches)
    kvctl_s, bare_s = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        bare_loop(batches)
        bare_s.append(time.perf_counter() - t0)
        index = RouterIndex(BLOCK_SIZE)
        t0 = time.perf_counter()
        for batch in batches:
            index.apply(batch)
        kvctl_s.append(time.perf_counter() - t0)
    kvctl_rate, bare_rate = blocks / statistics.median(kvctl_s), blocks / statistics.median(bare_s)
    print(
        f"apply: {len(batches):,} batches, {events:,} events, {blocks:,} block events; "
        f"{rounds} rounds, medians"
    )
    print(
        f"  RouterIndex.apply   {kvctl_rate:>12,.0f} block events/s  (rounds "
        f"{blocks / max(kvctl_s):,.0f}-{blocks / min(kvctl_s):,.0f}; target 300,000)"
    )
    print(f"  bare event loop     {bare_rate:>12,.0f} block events/s")
    print(f"  ratio               {kvctl_rate / bare_rate:>12.4f}")


# --- 2. query --------------------------------------------------------------------------------


class Fleet:
    """Synthetic caches: each worker holds prompts of ``prompt_blocks`` blocks up to ``blocks``
    blocks; a prompt is one of 4 system prompts (64-512 blocks) and a body of its own, and a
    quarter of the prompts are another worker's document (a popular one, shared whole)."""

    def __init__(self, workers: int, blocks: int, prompt_tokens: int, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.rng = rng
        self.prompt_blocks = prompt_tokens // BLOCK_SIZE
        self.systems = [self.tokens(n * BLOCK_SIZE) for n in (64, 128, 256, 512)]
        self.prompts: list[list[array]] = []  # per worker, its prompts' tokens
        self.hashes: list[list[tuple[list[int], list[int]]]] = []  # (tokens_hash, engine hash)
        for w in range(workers):
            mine: list[array] = []
            hashes: list[tuple[list[int], list[int]]] = []
            held: set[int] = set()
            while len(held) < blocks:
                if w and rng.random() < 0.25:
                    doc = rng.choice(self.prompts[rng.randrange(w)])
                else:
                    doc = self.fresh(self.prompt_blocks * BLOCK_SIZE)
                local = dynamo_block_hashes(list(doc), BLOCK_SIZE)
                engine, parent = [], 0
                for h in local:
                    parent = hash((parent, h)) & U63
                    engine.append(parent)
                new = [i for i, h in enumerate(engine) if h not in held]
                if len(new) > blocks - len(held):  # the last prompt fills the cache exactly
                    end = new[blocks - len(held)]
                    doc, local, engine = doc[: end * BLOCK_SIZE], local[:end], engine[:end]
                held.update(engine)
                mine.append(doc)
                hashes.append((local, engine))
            self.prompts.append(mine)
            self.hashes.append(hashes)

    def tokens(self, n: int) -> array:
        """``n`` token ids of a 128k vocabulary (Llama 3's size)."""
        return array("I", (t & 0x1FFFF for t in array("I", self.rng.randbytes(4 * n))))

    def fresh(self, n: int) -> array:
        system = self.rng.choice(self.systems)
        return (system + self.tokens(max(0, n - len(system))))[:n]

    def stores(self, with_tokens: bool) -> list[tuple[int, dict[str, Any]]]:
        """(worker, BlockStored event) per prompt: engine hashes chained over the blocks' own
        hashes (the same tokens, the same engine hash, as vLLM hashes), ``tokens_hashes``
        given (the index skips hashing) or ``token_ids`` (as engines send them)."""
        out = []
        for w, prompts in enumerate(self.prompts):
            for doc, (local, engine) in zip(prompts, self.hashes[w], strict=True):
                ev: dict[str, Any] = {
                    "type": "BlockStored",
                    "block_hashes": engine,
                    "parent_block_hash": None,
                    "block_size": BLOCK_SIZE,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                }
                if with_tokens:
                    ev["token_ids"] = list(doc)
                else:
                    ev["tokens_hashes"] = local
                out.append((w, ev))
        return out

    def queries(self, n: int) -> list[bytes]:
        """``/query`` bodies: a cached prompt whole, one diverging at a random block, and a new
        prompt after a shared system prompt, in turn."""
        size = self.prompt_blocks * BLOCK_SIZE
        bodies = []
        for i in range(n):
            cached = self.rng.choice(self.rng.choice(self.prompts))
            if i % 3 == 0:
                tokens = list(cached) + list(self.tokens(size - len(cached)))
            elif i % 3 == 1:
                cut = self.rng.randrange(len(cached) // BLOCK_SIZE) * BLOCK_SIZE
                tokens = list(cached[:cut]) + list(self.tokens(size - cut))
            else:
                tokens = list(self.fresh(size))
            bodies.append(json.dumps({"token_ids": tokens, "model_name": "default"}).encode())
        return bodies


def serve_index(index: RouterIndex, ready: Any, port: Any) -> None:
    """The child process: kvctl's HTTP server (``kvctl index``'s) over the built index."""
    from kvctl.indexing import Served, start_server

    server = start_server(Served(index, "bench"), "127.0.0.1", 0)
    port.value = server.server_address[1]
    ready.set()
    while True:  # until the parent terminates it
        time.sleep(3600)


def latencies(port: int, bodies: list[bytes]) -> list[float]:
    """Round-trip seconds of each ``/query``, a fresh connection each (kvctl's server speaks
    HTTP/1.0), after a few unmeasured warm-up requests."""
    out = []
    for i, body in enumerate(bodies[:5] + bodies):
        t0 = time.perf_counter()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", "/query", body, {"content-type": "application/json"})
        response = conn.getresponse()
        answer = response.read()
        conn.close()
        elapsed = time.perf_counter() - t0
        if response.status != 200:
            raise SystemExit(f"/query: HTTP {response.status}: {answer[:200]!r}")
        if i >= 5:
            out.append(elapsed)
    return out


def percentiles(name: str, seconds: list[float]) -> None:
    ordered = sorted(seconds)
    p50 = statistics.median(ordered) * 1e3
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e3
    print(f"  {name:<22} p50 {p50:7.2f} ms   p99 {p99:7.2f} ms   ({len(ordered)} queries)")


def bench_query(fleet: Fleet, bodies: list[bytes]) -> None:
    index = RouterIndex(BLOCK_SIZE)
    t0 = time.perf_counter()
    for w, ev in fleet.stores(with_tokens=False):
        index.apply_event(ev, (w, 0))
    built = time.perf_counter() - t0
    held = sum(index.blocks_per_worker().values())
    print(
        f"query: {len(fleet.prompts)} workers, {held:,} blocks held "
        f"({index.live_blocks:,} in the tree; built in {built:.1f} s), "
        f"prompts of {fleet.prompt_blocks * BLOCK_SIZE:,} tokens"
    )
    ctx = mp.get_context("fork")  # the child inherits the built index
    ready, port = ctx.Event(), ctx.Value("i", 0)
    child = ctx.Process(target=serve_index, args=(index, ready, port), daemon=True)
    child.start()
    try:
        if not ready.wait(60):
            raise SystemExit("the index server did not start")
        percentiles("kvctl /query (HTTP)", latencies(port.value, bodies))
    finally:
        child.terminate()
        child.join(10)
    # where the time goes, in-process: parsing the body, hashing, walking the tree
    from kvctl.indexing import query_request

    parse, hashing, walk = [], [], []
    for body in bodies:
        t0 = time.perf_counter()
        _, _, req = query_request(body)
        t1 = time.perf_counter()
        hashes = dynamo_block_hashes(req["token_ids"], BLOCK_SIZE)
        t2 = time.perf_counter()
        index.response(index.query_hashes(hashes))
        t3 = time.perf_counter()
        parse.append(t1 - t0)
        hashing.append(t2 - t1)
        walk.append(t3 - t2)
    print(
        "  in-process medians: "
        f"body parse+validate {statistics.median(parse) * 1e3:.2f} ms, "
        f"hashing {statistics.median(hashing) * 1e3:.2f} ms, "
        f"tree walk+answer {statistics.median(walk) * 1e3:.2f} ms"
    )


# --- 3. Dynamo's indexer, over ZMQ ----------------------------------------------------------


def applied(port: int) -> int:
    """Events an index has applied: the sum of its ``dynamo_kvrouter_kv_cache_events_applied``
    counters (Dynamo's own, and kvctl index's copy of it)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    except OSError:
        return -1
    finally:
        conn.close()
    return sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in text.splitlines()
        if line.startswith("dynamo_kvrouter_kv_cache_events_applied{")
    )


def publish(endpoints: list[str], payloads: list[tuple[int, bytes]], ready: Any, go: Any) -> None:
    """One XPUB per worker; waits for a subscriber on each, then sends everything at once."""
    ctx, socks = engine_sockets(endpoints, ready, go)
    seqs = [0] * len(socks)
    for worker, payload in payloads:
        socks[worker].send_multipart([b"", seqs[worker].to_bytes(8, "big"), payload])
        seqs[worker] += 1
    for sock in socks:
        sock.close(linger=-1)  # every message leaves before the process does
    ctx.term()


def ingest(
    name: str,
    command: Callable[[list[str], int], list[str]],
    port: int,
    payloads: list[tuple[int, bytes]],
    events: int,
    workers: int,
) -> tuple[float, subprocess.Popen] | None:
    """Start an index subscribed to ``workers`` sockets, publish the payloads, and time until it
    has applied every event; the index keeps running (for queries)."""
    ports = {port}
    while len(ports) <= workers:  # distinct from each other and from the HTTP port
        ports.add(free_port())
    endpoints = [f"tcp://127.0.0.1:{p}" for p in sorted(ports - {port})]
    ctx = mp.get_context("spawn")
    ready, go = ctx.Event(), ctx.Event()
    publisher = ctx.Process(target=publish, args=(endpoints, payloads, ready, go))
    publisher.start()
    if not ready.wait(30):
        publisher.kill()
        print(f"  {name}: the publisher did not start")
        return None
    proc = subprocess.Popen(
        command([f"{i}={e}" for i, e in enumerate(endpoints)], port),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
        env={**os.environ, "DYN_LOG": "error"},
    )
    deadline = time.monotonic() + 60
    while applied(port) < 0:  # the HTTP server is up
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            print(f"  {name}: did not start")
            return None
        time.sleep(0.1)
    t0 = time.perf_counter()
    go.set()
    deadline = time.monotonic() + 600
    while (done := applied(port)) < events:
        if time.monotonic() > deadline:
            print(f"  {name}: applied {done} of {events} events in 600 s")
            break
        time.sleep(0.02)
    elapsed = time.perf_counter() - t0
    publisher.join(30)
    if publisher.is_alive():
        publisher.kill()
    return elapsed, proc


def bench_dynamo(batches: list[Any], fleet: Fleet, bodies: list[bytes], workers: int) -> None:
    try:
        import dynamo.llm  # noqa: F401
    except ImportError as exc:
        print(f"dynamo: skipped: ai-dynamo-runtime is not importable ({exc})")
        return
    from kvctl.formats.engine_zmq import encode_payload

    now = time.time()
    apply_payloads = [(b.worker_id, encode_payload(b.events, now, b.dp_rank or 0)) for b in batches]
    fleet_stores = fleet.stores(with_tokens=True)
    streams = {  # payloads, events, block events
        "apply stream": (
            apply_payloads,
            sum(len(b.events) for b in batches),
            block_events(batches),
        ),
        "query fleet": (
            [(w, encode_payload([ev], now, 0)) for w, ev in fleet_stores],
            len(fleet_stores),
            sum(len(ev["block_hashes"]) for _, ev in fleet_stores),
        ),
    }
    print("over ZMQ, one socket per worker, each index alone (seconds until all applied):")
    for stream, (payloads, events, blocks) in streams.items():
        for name, command in (
            (
                "dynamo.indexer",
                lambda labels, port: (
                    [sys.executable, "-m", "dynamo.indexer", "--block-size", "16"]
                    + ["--port", str(port), "--workers", ",".join(labels)]
                ),
            ),
            (
                "kvctl index",
                lambda labels, port: (
                    [sys.executable, "-m", "kvctl", "index", *labels]
                    + ["--port", str(port), "--max-queue", "4G", "-q"]
                ),
            ),
        ):
            port = free_port()
            result = ingest(name, command, port, payloads, events, workers)
            if result is None:
                continue
            elapsed, proc = result
            print(
                f"  {stream:<13} {name:<15} {elapsed:7.2f} s  {blocks / elapsed:>12,.0f} "
                "block events/s"
            )
            try:
                if stream == "query fleet":
                    percentiles(f"{name} /query", latencies(port, bodies))
            finally:
                proc.terminate()
                proc.wait(10)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--requests", type=int, default=3000, help="simulated requests (apply)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--blocks", type=int, default=100_000, help="blocks per worker (query)")
    ap.add_argument("--prompt-tokens", type=int, default=32_768)
    ap.add_argument("--queries", type=int, default=300)
    ap.add_argument("--dynamo", action="store_true", help="also Dynamo's standalone indexer")
    args = ap.parse_args(argv)
    batches = simulated_batches(args.workers, args.requests)
    bench_apply(batches, args.rounds)
    fleet = Fleet(args.workers, args.blocks, args.prompt_tokens)
    bodies = fleet.queries(args.queries)
    bench_query(fleet, bodies)
    if args.dynamo:
        bench_dynamo(batches, fleet, bodies, args.workers)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
