"""kvctl replay and bridge: recordings and live streams into every target format, on real
sockets and a real nats-server, read back by a kvctl tap process or plain pyzmq (replay and
bridge in-process, what they talk to in a thread or another process)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import msgpack
import pytest
import zmq
from conftest import Engine, finish, free_port, removed, start_draining, start_kvctl, stored
from inprocess import Live, run_main
from test_tap_nats import wait_ready

from kvctl.formats import decode_zmq
from kvctl.formats.engine_zmq import encode_frames, encode_payload
from kvctl.recording.reader import open_recording
from kvctl.recording.writer import RecordingWriter
from kvctl.transports.zmq import fetch_replay

STEP_NS = 20_000_000  # 20 ms between recorded batches


def make_recording(path, batches: int = 50) -> list:
    """``batches`` vLLM batches 20 ms apart from two workers, chained stores and removals,
    plus one malformed message."""
    writer = RecordingWriter(path)
    t0 = 1_700_000_000_000_000_000
    for i in range(batches):
        worker = i % 2
        events = [stored([1000 * worker + i], parent=None if i < 2 else 1000 * worker + i - 2)]
        if i % 5 == 4:
            events.append(removed([1000 * worker + i - 4]))
        frames = encode_frames(b"", i // 2, encode_payload(events, t0 / 1e9 + i * 0.02, 0))
        writer.write(decode_zmq(frames, f"tcp://w{worker}", t0 + i * STEP_NS, worker_id=worker))
        if i == 10:
            writer.write(
                decode_zmq(
                    [b"", (99).to_bytes(8, "big"), b"\xc1"],
                    "tcp://w0",
                    t0 + i * STEP_NS + 1,
                    worker_id=0,
                )
            )
    writer.close()
    return [b for b in open_recording(path) if b.error is None]


@pytest.fixture
def recording(tmp_path):
    path = tmp_path / "run.parquet"
    return path, make_recording(path)


def rows_of(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def replay_into_tap(path, *replay_args: str, tap_args: tuple = ()) -> tuple[list[dict], dict]:
    """A kvctl tap process reads what an in-process replay sends."""
    port = free_port()
    to = f"tcp://127.0.0.1:{port}"
    tap = start_kvctl(
        "tap",
        to,
        "--json",
        "--idle-timeout",
        "1.5",
        "--connect-timeout",
        "10",
        *tap_args,
        drain=True,
    )
    replay = run_main(
        "replay", str(path), "--to", to, "--wait-subscribers", "1", "--json", *replay_args
    )
    rc_tap, out, err = finish(tap, timeout=60)
    assert replay.code == 0, replay.err
    assert rc_tap == 0, err
    return rows_of(out), json.loads(replay.out)


def subscriber(to: str, count: int) -> tuple[list[list[bytes]], Callable[[Live], None]]:
    """A plain pyzmq SUB connected to ``to`` now, and what receives up to ``count`` messages
    into the returned list (15 s at most between two) while kvctl runs."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(to)
    received: list[list[bytes]] = []

    def receive(_: Live) -> None:
        try:
            while len(received) < count and sub.poll(15_000):
                received.append(sub.recv_multipart())
        finally:
            sub.close(0)

    return received, receive


def test_raw_replay_sends_the_recorded_bytes_in_order(recording):
    path, batches = recording
    to = f"tcp://127.0.0.1:{free_port()}"
    received, receive = subscriber(to, len(batches) + 1)
    replay = run_main(
        "replay",
        str(path),
        "--to",
        to,
        "--wait-subscribers",
        "1",
        "--topspeed",
        "--json",
        alongside=receive,
    )
    assert replay.code == 0, replay.err
    good = [f for f in received if len(f) == 3 and f[2] != b"\xc1"]
    assert [f[2] for f in good] == [b.frames[2] for b in batches]  # payloads byte for byte
    assert [int.from_bytes(f[1], "big") for f in good] == list(range(len(good)))  # fresh seq
    # bad input replays too, exactly as recorded (its frames are not renumbered)
    assert [f for f in received if f not in good] == [[b"", (99).to_bytes(8, "big"), b"\xc1"]]
    assert json.loads(replay.out)["batches"] == len(batches) + 1


def test_replay_into_tap_yields_the_recording(recording):
    path, batches = recording
    rows, report = replay_into_tap(path, "--topspeed")
    assert [(r["type"], r["block_hashes"]) for r in rows] == [
        (e["type"], e["block_hashes"]) for b in batches for e in b.events
    ]
    assert report["events"] == len(rows)


@pytest.mark.parametrize("encoding", ["vllm", "vllm-array", "sglang", "seed"])
def test_every_engine_format_decodes_back(recording, encoding):
    path, batches = recording
    rows, _ = replay_into_tap(path, "--topspeed", "--format", encoding)
    expected = []
    for b in batches:
        for e in b.events:
            if encoding == "sglang" and e["type"] == "BlockStored":
                expected += [("BlockStored", [h]) for h in e["block_hashes"]]
            else:
                expected.append((e["type"], e["block_hashes"]))
    assert [(r["type"], r["block_hashes"]) for r in rows] == expected
    shape = "engine-array" if encoding == "vllm-array" else "engine-map"
    assert {r["format"] for r in rows} == {shape}


def test_speed_scales_the_recorded_timing(recording):
    path, _ = recording
    result1 = run_main("replay", str(path), "--to", f"tcp://127.0.0.1:{free_port()}", "--json")
    result2 = run_main(
        "replay", str(path), "--to", f"tcp://127.0.0.1:{free_port()}", "--json", "--speed", "2"
    )
    recorded = 49 * STEP_NS / 1e9 + 1e-9  # span of the recording (0.98 s)
    t1 = json.loads(result1.out)["elapsed_s"]
    t2 = json.loads(result2.out)["elapsed_s"]
    assert recorded * 0.95 < t1 < recorded * 1.5
    assert recorded / 2 * 0.95 < t2 < recorded / 2 * 1.5
    rated = run_main(
        "replay", str(path), "--to", f"tcp://127.0.0.1:{free_port()}", "--json", "--rate", "200"
    )
    assert 50 / 200 * 0.95 < json.loads(rated.out)["elapsed_s"] < 50 / 200 * 1.8


def test_loop_with_unique_hashes_gives_new_but_chained_blocks(recording):
    path, batches = recording
    rows, report = replay_into_tap(path, "--topspeed", "--loop", "2", "--unique-hashes")
    n = sum(len(b.events) for b in batches)
    assert len(rows) == 2 * n
    first, second = rows[:n], rows[n:]
    assert [r["block_hashes"] for r in first] == [
        e["block_hashes"] for b in batches for e in b.events
    ]
    hashes1 = {h for r in first for h in r["block_hashes"]}
    hashes2 = {h for r in second for h in r["block_hashes"]}
    assert not hashes1 & hashes2
    stored2 = {h for r in second if r["type"] == "BlockStored" for h in r["block_hashes"]}
    assert all(
        r["parent_block_hash"] in stored2
        for r in second
        if r["type"] == "BlockStored" and r["parent_block_hash"] is not None
    )


def test_several_workers_on_one_socket_with_topics(recording):
    path, batches = recording
    rows, _ = replay_into_tap(path, "--topspeed", "--worker-topics", "llama")
    assert {(r["topic"], r["worker_id"]) for r in rows} == {
        ("kv@0@llama", "0"),
        ("kv@1@llama", "1"),
    }
    assert [r["block_hashes"] for r in rows if r["worker_id"] == "1"] == [
        e["block_hashes"] for b in batches if str(b.worker_id) == "1" for e in b.events
    ]


def test_replay_router_serves_buffered_batches_and_the_end_marker(recording):
    path, batches = recording
    replay_port = free_port()
    replay = start_kvctl(
        "replay",
        str(path),
        "--to",
        f"tcp://127.0.0.1:{free_port()}",
        "--topspeed",
        "--replay-port",
        str(replay_port),
        "--linger",
        "5",
    )
    deadline = time.monotonic() + 15
    replies, complete = [], False
    while time.monotonic() < deadline:  # until the replay has sent everything
        replies, complete = fetch_replay(f"tcp://127.0.0.1:{replay_port}", 40, timeout=1.0)
        if complete and replies and int.from_bytes(replies[-1][1], "big") >= 49:
            break
    replay.terminate()
    finish(replay)
    assert complete, "no end marker"
    seqs = [int.from_bytes(seq, "big") for _, seq, _ in replies]
    assert seqs == list(range(40, 50))  # the 50 good batches were numbered 0..49


def test_dynamo_targets_decode_with_correct_tokens_hash(nats_server, tmp_path):
    path = tmp_path / "toks.parquet"
    writer = RecordingWriter(path)
    ev = {
        "type": "BlockStored",
        "block_hashes": [7, 8],
        "parent_block_hash": None,
        "token_ids": [0, 1, 2, 3, 4, 5, 6, 7],
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    writer.write(
        decode_zmq(
            encode_frames(b"", 0, encode_payload([ev, removed([8])], 1.0)),
            "tcp://w",
            1,
            worker_id=3,
        )
    )
    writer.close()
    tap = start_kvctl("tap", nats_server.url, "--json", "-c", "2")
    wait_ready(tap)
    start_draining(tap)  # while kvctl runs in-process
    result = run_main(
        "replay",
        str(path),
        "--to",
        nats_server.url,
        "--format",
        "dynamo",
        "--namespace",
        "rp",
        "--json",
    )
    assert result.code == 0, result.err
    rc, out, err = finish(tap)
    rows = rows_of(out)
    assert rows[0]["tokens_hashes"][0] == 9143094415614847814  # tokens [0,1,2,3]
    assert rows[0]["worker_id"] == 3 and rows[0]["format"] == "dynamo-msgpack"
    assert rows[0]["topic"] == "namespace.rp.component.backend.endpoint.generate.kv-events"
    assert rows[1]["type"] == "BlockRemoved" and rows[1]["block_hashes"] == [8]
    # 0.7-0.9 era: JSON on the JetStream subject, read back from history
    result = run_main(
        "replay",
        str(path),
        "--to",
        nats_server.url,
        "--format",
        "dynamo-json",
        "--namespace",
        "old",
    )
    assert result.code == 0, result.err
    history = run_main(
        "tap", nats_server.url, "--from-start", "--json", "-c", "2", "--subject", "nothing.here"
    )
    rows = [r for r in rows_of(history.out) if r["format"] == "dynamo-json"]
    assert [r["type"] for r in rows] == ["BlockStored", "BlockRemoved"]
    assert rows[0]["topic"] == "namespace-old-component-backend-kv-events.kv-events"


def test_start_end_seq_window_and_count(recording):
    path, batches = recording
    rows, _ = replay_into_tap(
        path, "--topspeed", "--start", "seq:5", "--end", "seq:6", "--worker", "1"
    )
    expected = [
        e["block_hashes"] for b in batches if b.worker_id == 1 and 5 <= b.seq <= 6 for e in b.events
    ]
    assert [r["block_hashes"] for r in rows] == expected and expected
    rows, report = replay_into_tap(path, "--topspeed", "-c", "3")
    assert len(rows) == 3 and report["events"] == 3


def test_bridge_array_engine_to_map_form(endpoint):
    engine = Engine(endpoint, encoding="vllm-array")
    out_port = free_port()
    tap = start_kvctl(
        "tap",
        f"tcp://127.0.0.1:{out_port}",
        "--json",
        "-c",
        "3",
        "--connect-timeout",
        "10",
        drain=True,
    )

    def publish(_: Live) -> None:
        engine.wait_for()  # the bridge subscribes upstream only once tap joined downstream
        engine.send([stored([1, 2], block_size=4), removed([1])])
        engine.send([{"type": "AllBlocksCleared"}])

    try:
        bridge = run_main(
            "bridge",
            engine.endpoint,
            "--to",
            f"tcp://127.0.0.1:{out_port}",
            "--format",
            "vllm",
            "-c",
            "3",
            "--wait-subscribers",
            "1",
            alongside=publish,
        )
        rc, out, err = finish(tap)
    finally:
        engine.close()
    assert rc == 0 and bridge.code == 0, (err, bridge.err)
    rows = rows_of(out)
    assert [(r["type"], r["format"]) for r in rows] == [
        ("BlockStored", "engine-map"),
        ("BlockRemoved", "engine-map"),
        ("AllBlocksCleared", "engine-map"),
    ]


def test_bridge_engine_to_dynamo_on_nats(endpoint, nats_server):
    engine = Engine(endpoint)
    tap = start_kvctl("tap", nats_server.url, "--json", "-c", "2")
    wait_ready(tap)
    start_draining(tap)  # while kvctl runs in-process

    def publish(_: Live) -> None:
        engine.wait_for()
        engine.send([stored([0xFFFF_FFFF_FFFF_FFF0], block_size=4), removed([-16])])

    try:
        bridge = run_main(
            "bridge",
            f"5={engine.endpoint}",
            "--to",
            nats_server.url,
            "--namespace",
            "br",
            "-c",
            "2",
            alongside=publish,
        )
        rc, out, err = finish(tap)
    finally:
        engine.close()
    assert rc == 0 and bridge.code == 0, (err, bridge.err)
    rows = rows_of(out)
    assert [(r["type"], r["worker_id"], r["block_hashes"]) for r in rows] == [
        ("BlockStored", 5, [2**64 - 16]),
        ("BlockRemoved", 5, [2**64 - 16]),
    ]
    assert rows[0]["tokens_hashes"] == [9143094415614847814]  # tokens [0, 1, 2, 3]


@pytest.mark.parametrize(
    "args", [["--format", "raw", "--unique-hashes"], ["--format", "dynamo"], ["--start", "soon"]]
)
def test_replay_usage_errors(recording, args):
    path, _ = recording
    result = run_main("replay", str(path), "--to", f"tcp://127.0.0.1:{free_port()}", *args)
    assert result.code == 2, result.err
    assert "Traceback" not in result.err


def _event_plane_message(topic: bytes, sequence: int) -> list[bytes]:
    from kvctl.formats.dynamo import encode_envelope, encode_event_plane, router_event

    maps = [router_event(stored([2**63 + sequence], parent=None), 7, sequence)]
    return encode_event_plane(
        encode_envelope(maps, 42, sequence, 1_700_000_000_000), 42, sequence, topic
    )


def test_raw_replay_sends_every_zmq_message_as_it_arrived(tmp_path):
    """Engine batches, Dynamo event-plane messages (direct and broker topics), a batch without
    events and malformed messages: ``--format raw`` sends each one's frames byte for byte, in
    recorded order (``--keep-seq``: the engine seq frame as recorded too)."""
    broker_topic = b"namespace.dynamo.component.backend.endpoint.generate.kv-events"
    messages = [
        encode_frames(b"kv@w0@m", 5, encode_payload([stored([1])], 1.0, 0)),
        _event_plane_message(b"kv-events", 0),
        _event_plane_message(broker_topic, 1),
        [b"", (6).to_bytes(8, "big"), b"\xc1"],  # not msgpack
        encode_frames(
            b"", 7, msgpack.packb([2.0, [{"type": "BlockStored", "block_hashes": "1234"}], 0])
        ),
        encode_frames(b"", 8, encode_payload([], 3.0, 0)),  # a step without events
        [b"one frame"],
    ]
    path = tmp_path / "mixed.parquet"
    writer = RecordingWriter(path)
    for i, frames in enumerate(messages):
        writer.write(decode_zmq(frames, "tcp://127.0.0.1:1", 1_700_000_000_000_000_000 + i))
    writer.close()
    kinds = [(b.format, b.error is None) for b in open_recording(path)]
    assert kinds[1:3] == [("dynamo-zmq", True)] * 2 and not kinds[3][1] and not kinds[4][1]

    to = f"tcp://127.0.0.1:{free_port()}"
    received, receive = subscriber(to, len(messages))
    replay = run_main(
        "replay",
        str(path),
        "--to",
        to,
        "--format",
        "raw",
        "--keep-seq",
        "--wait-subscribers",
        "1",
        "--topspeed",
        "--json",
        alongside=receive,
    )
    assert replay.code == 0, replay.err
    assert received == messages
    assert json.loads(replay.out)["batches"] == len(messages)


def test_raw_replay_refuses_nats_messages_in_one_line(tmp_path):
    from kvctl.formats import decode_nats
    from kvctl.formats.dynamo import encode_envelope, router_event

    path = tmp_path / "nats.parquet"
    writer = RecordingWriter(path)
    data = encode_envelope([router_event(stored([5]), 7, 0)], 42, 0, 1_700_000_000_000)
    writer.write(
        decode_nats(
            "namespace.d.component.b.endpoint.g.kv-events",
            data,
            "nats://127.0.0.1:4222",
            1_700_000_000_000_000_000,
        )
    )
    writer.write(
        decode_nats(
            "namespace.d.component.b.endpoint.g.kv-events",
            b"\xc1",
            "nats://127.0.0.1:4222",
            1_700_000_000_000_000_001,
        )
    )
    writer.close()
    result = run_main(
        "replay",
        str(path),
        "--to",
        f"tcp://127.0.0.1:{free_port()}",
        "--format",
        "raw",
        "--topspeed",
    )
    err = result.err
    assert result.code == 2, err
    assert "NATS messages" in err and "--to nats://" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    # without --format: Dynamo events re-encoded for vLLM, the malformed NATS message skipped
    result = run_main(
        "replay", str(path), "--to", f"tcp://127.0.0.1:{free_port()}", "--topspeed", "--json"
    )
    report = json.loads(result.out)
    assert result.code == 0 and (report["batches"], report["skipped"]) == (1, 1)
