"""Interop with NVIDIA Dynamo's own code (the `interop` extra: ai-dynamo-runtime).

Dynamo's KvEventPublisher publishes to a real nats-server and kvctl tap must decode exactly
what it sent; Dynamo's relay (KvEventPublisher with zmq_endpoint=) consumes a ZMQ engine
stream; Dynamo's standalone indexer consumes `kvctl simulate` and must end up holding exactly
the simulator's cache. Skipped, with the reason printed, only where the package cannot be
installed (it ships wheels for Linux only).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest
from conftest import Engine, finish, free_port, free_port_range, removed, start_kvctl, stored
from test_tap_nats import wait_ready

from kvctl.formats.dynamo import tokens_hash

pytest.importorskip("dynamo.llm", reason="ai-dynamo-runtime is not installable on this platform")


def dynamo_env(nats_url: str) -> dict[str, str]:
    return {
        **os.environ,
        "NATS_SERVER": nats_url,
        "DYN_EVENT_PLANE": "nats",
        "NATS_STARTUP_CONNECT_TIMEOUT_SECONDS": "10",
        "DYN_LOG": "warn",
    }


def run_dynamo(script: str, nats_url: str, timeout: float = 60) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script)],
        env=dynamo_env(nats_url),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def test_tap_decodes_what_dynamo_kv_event_publisher_sends(nats_server):
    tap = start_kvctl("tap", nats_server.url, "--json", "-c", "4")
    wait_ready(tap)
    publisher = run_dynamo(
        """
        import asyncio
        from dynamo.runtime import DistributedRuntime
        from dynamo.llm import KvEventPublisher

        async def main():
            rt = DistributedRuntime(asyncio.get_running_loop(), "mem", "tcp", event_plane="nats")
            pub = KvEventPublisher(rt.endpoint("kvctl.worker.generate"), worker_id=42,
                                   kv_block_size=4)
            await asyncio.sleep(1.0)  # Dynamo gives no readiness signal for its publisher
            pub.publish_stored(token_ids=list(range(8)), num_block_tokens=[4, 4],
                               block_hashes=[111, -5], parent_hash=None)
            pub.publish_stored(token_ids=[8, 9, 10, 11], num_block_tokens=[4],
                               block_hashes=[333], parent_hash=-5)
            pub.publish_removed(block_hashes=[333])
            pub.publish_removed(block_hashes=[111, -5])
            await asyncio.sleep(1.0)
            pub.shutdown()
            rt.shutdown()

        asyncio.run(main())
    """,
        nats_server.url,
    )
    rc, out, err = finish(tap, timeout=60)
    publisher.wait(30)
    assert rc == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["type"] for r in rows] == [
        "BlockStored",
        "BlockStored",
        "BlockRemoved",
        "BlockRemoved",
    ]
    assert {r["worker_id"] for r in rows} == {42}
    assert {r["format"] for r in rows} == {"dynamo-msgpack"}
    assert {r["topic"] for r in rows} == {
        "namespace.kvctl.component.worker.endpoint.generate.kv-events"
    }
    first, second, gone, gone2 = rows
    assert first["block_hashes"] == [111, 2**64 - 5] and first["parent_block_hash"] is None
    assert first["tokens_hashes"] == [tokens_hash(range(4)), tokens_hash(range(4, 8))]
    assert second["block_hashes"] == [333] and second["parent_block_hash"] == 2**64 - 5
    assert second["tokens_hashes"] == [tokens_hash([8, 9, 10, 11])]
    assert gone["block_hashes"] == [333] and gone2["block_hashes"] == [111, 2**64 - 5]
    assert [r["seq"] for r in rows] == [0, 1, 2, 3]
    assert "gaps 0" in err


def test_dynamo_relay_of_a_zmq_engine_stream(nats_server, endpoint):
    engine = Engine(endpoint)
    tap = start_kvctl("tap", nats_server.url, "--json", "-c", "4")
    wait_ready(tap)
    relay = run_dynamo(
        f"""
        import asyncio
        from dynamo.runtime import DistributedRuntime
        from dynamo.llm import KvEventPublisher

        async def main():
            rt = DistributedRuntime(asyncio.get_running_loop(), "mem", "tcp", event_plane="nats")
            pub = KvEventPublisher(rt.endpoint("kvctl.worker.generate"), worker_id=7,
                                   kv_block_size=4, zmq_endpoint="{engine.endpoint}")
            await asyncio.sleep(30)  # ended by the test once kvctl has seen the events

        asyncio.run(main())
    """,
        nats_server.url,
    )
    try:
        engine.wait_for()  # the relay's SUB joined our PUB
        engine.send([stored([1, 2], block_size=4)])
        engine.encoding = "vllm-array"
        engine.send([stored([3], parent=2, block_size=4), removed([1])])
        engine.send([{"type": "AllBlocksCleared"}])
        rc, out, err = finish(tap, timeout=60)
    finally:
        relay.kill()
        relay.wait(10)
        engine.close()
    assert rc == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r["type"], r.get("block_hashes")) for r in rows] == [
        ("BlockStored", [1, 2]),
        ("BlockStored", [3]),
        ("BlockRemoved", [1]),
        ("AllBlocksCleared", None),
    ]
    assert rows[0]["tokens_hashes"] == [tokens_hash(range(4)), tokens_hash(range(4, 8))]
    assert rows[1]["parent_block_hash"] == 2 and {r["worker_id"] for r in rows} == {7}


def http_json(url: str, body: dict | None = None):
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as response:
        return json.loads(response.read() or b"null")


def indexer_blocks(port: int) -> dict[int, set[int]]:
    dump = http_json(f"http://127.0.0.1:{port}/dump")
    blocks: dict[int, set[int]] = {}
    for model in dump.values():
        for ev in model["events"]:
            stored_data = ev["event"]["data"]["stored"]
            blocks.setdefault(ev["worker_id"], set()).update(
                b["block_hash"] for b in stored_data["blocks"]
            )
    return blocks


def test_dynamo_indexer_agrees_with_the_simulator(tmp_path):
    from kvctl.engine import Fleet

    workers, requests, seed, num_blocks = 4, 60, 3, 600
    base = free_port_range(workers)
    http_port = free_port()
    sim = start_kvctl(
        "simulate",
        "--workers",
        str(workers),
        "--base-port",
        str(base),
        "--requests",
        str(requests),
        "--seed",
        str(seed),
        "--num-blocks",
        str(num_blocks),
        "--topspeed",
        "--wait-subscribers",
        "1",
        "-q",
        "--json",
    )
    worker_list = ",".join(f"{i}=tcp://127.0.0.1:{base + i}" for i in range(workers))
    indexer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dynamo.indexer",
            "--block-size",
            "16",
            "--port",
            str(http_port),
            "--workers",
            worker_list,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "DYN_LOG": "warn"},
    )
    try:
        rc, out, err = finish(sim, timeout=120)
        assert rc == 0, err
        summary = json.loads(out)
        # the simulator's own cache at the end of the run (the engine is pure and seeded)
        fleet = Fleet(workers=workers, requests=requests, seed=seed, num_blocks=num_blocks)
        for _ in fleet.run():
            pass
        expected = {i: set(w.pool.refs) for i, w in enumerate(fleet.workers)}
        assert sum(map(len, expected.values())) == summary["total"]["blocks_cached"] > 0
        deadline = time.monotonic() + 30
        got: dict[int, set[int]] = {}
        while time.monotonic() < deadline:  # the indexer applies events asynchronously
            try:
                got = indexer_blocks(http_port)
            except OSError:
                got = {}
            if got == {i: s for i, s in expected.items() if s}:
                break
            time.sleep(0.2)
        assert got == {i: s for i, s in expected.items() if s}
    finally:
        indexer.terminate()
        indexer.wait(10)
