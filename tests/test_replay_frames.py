"""kvctl replay's frames cache (tcpprep): a replay from the cache sends exactly the bytes a
replay that decodes the recording sends, in every ZMQ format and socket layout; a changed
recording, other format options or a damaged cache are never used as they are. Real sockets:
a plain pyzmq SUB receives what the in-process replay sends."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest
import zmq
from conftest import free_port, stored
from inprocess import Live, run_main
from test_cmd_replay import _event_plane_message, make_recording

from kvctl.formats import decode_zmq
from kvctl.formats.engine_zmq import encode_frames, encode_payload
from kvctl.recording.writer import RecordingWriter


def caches_of(directory: Path) -> list[Path]:
    return sorted(directory.glob(".*.kvctl-frames"))


def collector(to: str) -> tuple[list[list[bytes]], Callable[[Live], None]]:
    """A plain pyzmq SUB connected to ``to`` now, and what receives into the returned list
    until the command has ended and nothing more came for 0.5 s (60 s at most)."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(to)
    got: list[list[bytes]] = []

    def receive(live: Live) -> None:
        deadline = time.monotonic() + 60
        try:
            while time.monotonic() < deadline:
                if sub.poll(500):
                    got.append(sub.recv_multipart())
                elif live.ended.is_set():
                    break
        finally:
            sub.close(0)

    return got, receive


def received(path: Path, *args: str) -> tuple[list[list[bytes]], dict]:
    """What a SUB on the replay's socket receives, and the replay's report."""
    to = f"tcp://127.0.0.1:{free_port()}"
    messages, receive = collector(to)
    replay = run_main(
        "replay",
        str(path),
        "--to",
        to,
        "--wait-subscribers",
        "1",
        "--topspeed",
        "--json",
        *args,
        alongside=receive,
    )
    assert replay.code == 0, replay.err
    return messages, json.loads(replay.out)


def assert_same_from_cache_and_recording(path: Path, *args: str) -> list:
    """Decoding the recording, building the cache and reading the cache send the same."""
    before = len(caches_of(path.parent))
    decoded, report = received(path, "--no-cache", *args)
    assert len(caches_of(path.parent)) == before  # --no-cache writes none
    building, _ = received(path, *args)
    assert len(caches_of(path.parent)) == before + 1
    cached, cached_report = received(path, *args)
    assert decoded, "nothing received"
    assert len(decoded) == report["batches"]
    assert building == decoded and cached == decoded
    for field in ("batches", "events", "bytes", "skipped"):
        assert cached_report[field] == report[field], field
    return decoded


@pytest.mark.parametrize(
    "args",
    [
        (),
        ("--format", "vllm"),
        ("--format", "vllm-array"),
        ("--format", "vllm-array", "--array-layout", "0.10.2"),
        ("--format", "sglang"),
        ("--format", "seed"),
        ("--worker-topics", "llama"),
        ("--keep-seq",),
        ("--loop", "3", "--unique-hashes"),  # loop 1 prepared, the salted ones encoded
        ("--start", "seq:5", "--end", "seq:20"),
        ("--start", "0.2", "--end", "0.6"),
    ],
)
def test_every_format_sends_the_same_bytes_from_the_cache(tmp_path, args):
    path = tmp_path / "run.parquet"
    make_recording(path)
    decoded = assert_same_from_cache_and_recording(path, *args)
    if "--unique-hashes" in args:
        payloads = [m[2] for m in decoded if len(m) == 3 and m[2] != b"\xc1"]
        assert len(set(payloads)) == len(payloads)  # every loop's hashes salted apart


def test_raw_replay_of_every_kind_of_message_is_the_same_from_the_cache(tmp_path):
    """Engine batches, Dynamo event-plane messages, a step without events and malformed
    messages, with the default format (the event plane re-encoded) and with ``raw``."""
    messages = [
        encode_frames(b"kv@w0@m", 5, encode_payload([stored([1])], 1.0, 0)),
        _event_plane_message(b"kv-events", 0),
        [b"", (6).to_bytes(8, "big"), b"\xc1"],
        encode_frames(b"", 8, encode_payload([], 3.0, 0)),
        encode_frames(b"", 9, encode_payload([stored([2], parent=1)], 4.0, 0)),
    ]
    path = tmp_path / "mixed.parquet"
    writer = RecordingWriter(path)
    for i, frames in enumerate(messages):
        writer.write(decode_zmq(frames, "tcp://127.0.0.1:1", 1_700_000_000_000_000_000 + i))
    writer.close()
    raw = assert_same_from_cache_and_recording(path, "--format", "raw", "--keep-seq")
    assert raw == messages
    default = assert_same_from_cache_and_recording(path)
    assert len(default) == len(messages) - 1  # the step without events is not sent
    assert [m[2] for m in default if len(m) == 3][:1] == [messages[0][2]]


def test_one_socket_per_worker_from_the_cache(tmp_path):
    path = tmp_path / "run.parquet"
    make_recording(path)
    base = free_port()
    results = []
    for extra in (("--no-cache",), (), ()):
        subs = [collector(f"tcp://127.0.0.1:{base + i}") for i in (0, 1)]

        def receive(live, subs=subs) -> None:
            for _, take in subs:  # the first ends after the replay, the second at once
                take(live)

        replay = run_main(
            "replay",
            str(path),
            "--to",
            f"tcp://127.0.0.1:{base}",
            "--port-per-worker",
            "--wait-subscribers",
            "1",
            "--topspeed",
            "--json",
            *extra,
            alongside=receive,
        )
        assert replay.code == 0, replay.err
        results.append([got for got, _ in subs])
    assert results[0][0] and results[0][1]
    assert results[1] == results[0] and results[2] == results[0]


def test_a_changed_recording_is_prepared_again(tmp_path):
    path = tmp_path / "run.parquet"
    make_recording(path, batches=10)
    first, _ = received(path)
    (cache,) = caches_of(tmp_path)
    built = cache.stat().st_mtime_ns
    path.unlink()
    make_recording(path, batches=12)  # same name, other content
    second, report = received(path)
    assert report["batches"] == 13 and len(second) == 13
    assert second[:10] != first[:10] or len(second) != len(first)
    (again,) = caches_of(tmp_path)
    assert again.stat().st_mtime_ns != built
    decoded, _ = received(path, "--no-cache")
    assert second == decoded
    # the same size and content, a new modification time: prepared again too
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    prepared = run_main("replay", "--prepare", str(path), "--json")
    assert json.loads(prepared.out)["built"] is True


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_a_damaged_cache_is_rebuilt_never_trusted(tmp_path, damage):
    path = tmp_path / "run.parquet"
    make_recording(path)
    good, _ = received(path)
    (cache,) = caches_of(tmp_path)
    data = cache.read_bytes()
    cache.write_bytes(
        {"truncated": data[: len(data) // 2], "garbage": os.urandom(len(data)), "empty": b""}[
            damage
        ]
    )
    again, _ = received(path)
    assert again == good
    assert cache.read_bytes() == data  # rebuilt whole


def test_prepare_builds_ahead_and_options_that_change_bytes_have_their_own_cache(tmp_path):
    path = tmp_path / "run.parquet"
    make_recording(path)
    first = run_main("replay", "--prepare", str(path), "--format", "sglang", "--json")
    assert first.code == 0, first.err
    made = json.loads(first.out)
    assert (made["built"], made["messages"]) == (True, 51)
    assert Path(made["cache"]).exists() and Path(made["cache"]).parent == tmp_path
    again = json.loads(
        run_main("replay", "--prepare", str(path), "--format", "sglang", "--json").out
    )
    assert again["built"] is False and again["cache"] == made["cache"]
    other = json.loads(run_main("replay", "--prepare", str(path), "--format", "seed", "--json").out)
    assert other["built"] is True and other["cache"] != made["cache"]
    text = run_main("replay", "--prepare", str(path), "--format", "seed")
    assert text.code == 0 and "51 messages up to date" in text.err
    refused = run_main("replay", "--prepare", str(path), "--format", "dynamo")
    assert refused.code == 2 and "NATS" in refused.err and "Traceback" not in refused.err
    missing = run_main("replay", str(path))
    assert missing.code == 2 and "Missing option '--to'" in missing.err


def test_cache_dir_from_the_option_or_the_environment(tmp_path):
    path = tmp_path / "run.parquet"
    make_recording(path)
    chosen = tmp_path / "frames"
    made = run_main("replay", "--prepare", str(path), "--cache-dir", str(chosen), "--json")
    assert Path(json.loads(made.out)["cache"]).parent == chosen
    elsewhere = tmp_path / "env-frames"
    from_env = run_main(
        "replay", "--prepare", str(path), "--json", env={"KVCTL_CACHE_DIR": str(elsewhere)}
    )
    assert Path(json.loads(from_env.out)["cache"]).parent == elsewhere
    assert not caches_of(tmp_path)  # nothing beside the recording
    sent, _ = received(path, "--cache-dir", str(chosen))
    decoded, _ = received(path, "--no-cache")
    assert sent == decoded


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_recording_directory_uses_the_per_user_cache(tmp_path):
    folder = tmp_path / "readonly"
    folder.mkdir()
    path = folder / "run.parquet"
    make_recording(path)
    folder.chmod(0o555)
    try:
        made = run_main(
            "replay",
            "--prepare",
            str(path),
            "--json",
            env={"XDG_CACHE_HOME": str(tmp_path / "xdg")},
        )
        assert made.code == 0, made.err
        assert Path(json.loads(made.out)["cache"]).is_relative_to(tmp_path / "xdg" / "kvctl")
    finally:
        folder.chmod(0o755)


def test_a_batch_without_time_is_replayed_without_a_cache(tmp_path):
    """Re-encoding a batch that has no engine time stamps it with the clock when sent: such a
    recording is not prepared (the decision is kept), and replays as before."""
    from kvctl.formats import decode_nats
    from kvctl.formats.dynamo import router_event

    path = tmp_path / "json.parquet"
    writer = RecordingWriter(path)
    event = router_event(stored([5]), 7, 0)
    data = json.dumps(event).encode()
    writer.write(decode_nats("ns.kv-events", data, "nats://127.0.0.1:4222", 1))
    writer.close()
    made = run_main("replay", "--prepare", str(path), "--json")
    assert made.code == 0, made.err
    result = json.loads(made.out)
    if result["unpreparable"] is None:
        pytest.skip("this Dynamo JSON shape carries a time")
    sent, report = received(path)
    assert report["batches"] == 1 and msgpack.unpackb(sent[0][2])[1][0]["block_hashes"] == [5]


def test_several_recordings_play_in_order_from_their_caches(tmp_path):
    first, second = tmp_path / "a.parquet", tmp_path / "b.parquet"
    make_recording(first, batches=6)
    make_recording(second, batches=9)  # (the malformed message comes after batch 10)
    decoded, _ = received(first, str(second), "--no-cache")
    assert len(decoded) == 6 + 9
    cached, _ = received(first, str(second))
    assert len(caches_of(tmp_path)) == 2
    assert cached == decoded
    assert [int.from_bytes(m[1], "big") for m in cached] == list(range(15))  # one socket
