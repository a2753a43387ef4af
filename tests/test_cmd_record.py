"""kvctl record / cat / inspect / recover against real publishers and a real nats-server
(in-process, the publisher in a thread; kill -9 and SIGTERM in a subprocess)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import (
    finish,
    read_line,
    removed,
    serve_replays_until,
    start_kvctl,
    stored,
)
from inprocess import Live, run_main
from test_tap_nats import publish

from kvctl.formats.dynamo import encode_envelope, encode_json, router_event
from kvctl.recording.journal import read_journal
from kvctl.recording.reader import open_recording


def rows_of(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def record_until(engine, path: Path, send, *extra: str) -> tuple[int, str, str]:
    def publish(_: Live) -> None:
        engine.wait_for()
        send()

    result = run_main(
        "record",
        engine.endpoint,
        "-o",
        str(path),
        "--idle-timeout",
        "1.5",
        *extra,
        timeout=60,
        alongside=publish,
    )
    return result.code, result.out, result.err


def test_record_then_cat_round_trips_every_engine_shape(engine, tmp_path):
    path = tmp_path / "run.parquet"
    h32 = bytes(range(32))

    def send():
        engine.send([stored([1, 2], extra_keys=[["img", 1]], group_idx=0), removed([-3])])
        engine.encoding = "vllm-array"
        engine.send([stored([5], parent=2)])
        engine.encoding = "sglang"
        engine.send([stored([7, 8], parent=5)])
        engine.encoding = "vllm"
        engine.send(
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [h32],
                    "parent_block_hash": None,
                    "token_ids": [[1, 2], [3, 4]],
                    "block_size": 2,
                    "lora_id": 3,
                    "medium": "CPU",
                    "lora_name": "ad",
                },
                {"type": "AllBlocksCleared"},
            ]
        )
        engine.send_raw([b"", (5).to_bytes(8, "big"), b"\xc1garbage"])
        engine.send([removed([9])], seq=9)  # seq 5 was malformed, 6..8 never sent: a gap

    rc, out, err = record_until(engine, path, send)
    assert rc == 0, err
    assert path.exists() and not Path(str(path) + ".journal").exists()
    tapped = run_main("cat", str(path), "--json")
    assert tapped.code == 0, tapped.err
    rows = rows_of(tapped.out)
    assert [r["type"] for r in rows] == [
        "BlockStored",
        "BlockRemoved",
        "BlockStored",
        "BlockStored",
        "BlockStored",
        "BlockStored",
        "AllBlocksCleared",
        "BlockRemoved",
    ]
    assert rows[0]["extra_keys"] == [["img", 1]] and rows[0]["group_idx"] == 0
    assert rows[1]["block_hashes"] == [2**64 - 3]
    assert rows[2]["format"] == "engine-array" and rows[2]["parent_block_hash"] == 2
    assert [r["block_hashes"] for r in rows[3:5]] == [[7], [8]]  # SGLang: one page each
    assert rows[5]["block_hashes"] == [h32.hex()] and rows[5]["token_ids"] == [[1, 2], [3, 4]]
    assert "malformed message" in tapped.err  # cat shows what tap showed
    # raw bytes: what the recorder received, exactly
    recorded = [b for b in open_recording(path)]
    sent = engine.sent
    assert [b.frames for b in recorded if b.error is None] == sent
    bad = [b for b in recorded if b.error is not None]
    assert len(bad) == 1 and bad[0].frames[2] == b"\xc1garbage"
    info = json.loads(run_main("inspect", str(path), "--json").out)
    # seqs 4 and 6..8 missing; 5 arrived (malformed: its row says so, not a Gap row)
    assert (info["malformed"], info["gaps"], info["missing"]) == (1, 2, 4)
    assert info["events"] == 8 and info["by_type"]["BlockStored"] == 5


def test_tap_reads_a_recording_like_a_live_source(engine, tmp_path):
    path = tmp_path / "r.parquet"
    rc, _, err = record_until(engine, path, lambda: engine.send([removed([1]), removed([2])]))
    assert rc == 0, err
    result = run_main("tap", str(path), "--json", "-c", "1")
    assert result.code == 0
    assert [r["block_hashes"] for r in rows_of(result.out)] == [[1]]


def test_record_nats_dynamo_formats(nats_server, tmp_path):
    path = tmp_path / "dyn.parquet"
    ev = {
        "type": "BlockStored",
        "block_hashes": [2**64 - 1],
        "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4],
        "block_size": 4,
    }
    messages = [
        (
            "namespace.n.component.c.endpoint.e.kv-events",
            encode_envelope([router_event(ev, 5, 0)], 5, 0, 1000),
        ),
        (
            "namespace-n-component-c-kv-events.kv-events",
            encode_json(router_event({"type": "BlockRemoved", "block_hashes": [2**64 - 1]}, 5, 1)),
        ),
        (
            "namespace.n.component.c.kv_events",
            encode_json(router_event({"type": "AllBlocksCleared"}, 6, 2)),
        ),
    ]

    def send(live: Live) -> None:
        wait_ready_record(live)
        publish(nats_server.url, messages)

    result = run_main("record", nats_server.url, "-o", str(path), "-c", "3", alongside=send)
    assert result.code == 0, result.err
    rows = rows_of(run_main("cat", str(path), "--json").out)
    assert [(r["type"], r["worker_id"], r["format"]) for r in rows] == [
        ("BlockStored", 5, "dynamo-msgpack"),
        ("BlockRemoved", 5, "dynamo-json"),
        ("AllBlocksCleared", 6, "dynamo-json"),
    ]
    assert rows[0]["block_hashes"] == [2**64 - 1] and rows[0]["tokens_hashes"]


def wait_ready_record(proc: subprocess.Popen | Live) -> None:
    """record has subscribed: its first stderr line says what it is recording."""
    if isinstance(proc, Live):
        line = proc.wait_for_stderr("\n").partition("\n")[0]
    else:
        line = read_line(proc.stderr)
    assert line.startswith("kvctl: recording"), line


def test_kill_9_loses_at_most_the_last_second(engine, tmp_path):
    path = tmp_path / "crash.parquet"
    journal = Path(str(path) + ".journal")
    proc = start_kvctl("record", engine.endpoint, "-o", str(path), "-q")
    engine.wait_for()
    for i in range(50):
        engine.send([removed([i])])
    sent = time.monotonic()
    flushed = 0
    while time.monotonic() < sent + 15 and flushed < 50:  # the journal is the readiness signal
        if journal.exists():
            flushed = sum(rb.num_rows for rb in read_journal(journal))
        time.sleep(0.05)
    # 1 s promise, plus slack for a loaded 2-core machine (delivery, scheduling)
    assert flushed == 50 and time.monotonic() - sent < 3.0, "no flush within the 1 s promise"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    assert not path.exists() and journal.exists()
    result = run_main("recover", str(path))
    assert result.code == 0, result.err
    rows = rows_of(run_main("cat", str(path), "--json").out)
    assert [r["block_hashes"][0] for r in rows] == list(range(50))


def wait_recorded(path: Path, rows: int, timeout: float = 15) -> None:
    """Until ``rows`` messages of a segmented recording are on disk: in its open journals or
    in converted segments (a segment is renamed into place before its journal goes)."""
    import pyarrow.parquet as pq

    deadline = time.monotonic() + timeout
    while True:
        journals = sum(rb.num_rows for j in path.glob(".part-*.journal") for rb in read_journal(j))
        parts = sum(pq.read_metadata(p).num_rows for p in path.glob("part-*.parquet"))
        if journals + parts >= rows:
            return
        assert time.monotonic() < deadline, f"{journals + parts} of {rows} rows after {timeout}s"
        time.sleep(0.05)  # files have no push signal


def test_sigterm_closes_the_recording_cleanly(engine, tmp_path):
    path = tmp_path / "term.parquet"
    proc = start_kvctl("record", engine.endpoint, "-o", str(path))
    engine.wait_for()
    engine.send([removed([1])])
    wait_ready_record(proc)
    proc.send_signal(signal.SIGTERM)
    rc, out, err = finish(proc)
    assert rc == 130 and path.exists(), err
    assert "recorded" in err


def test_rotation_writes_a_readable_dataset(engine, tmp_path):
    import pyarrow.dataset as ds

    path = tmp_path / "segments"

    def send():
        for i in range(400):
            engine.send([stored([i, i + 10_000], block_size=16)])
            if i % 100 == 99:  # a flush between hundreds, so that a size rotation can trigger
                wait_recorded(path, i + 1)

    rc, out, err = record_until(engine, path, send, "--rotate-size", "4k")
    assert rc == 0, err
    parts = sorted(p.name for p in path.glob("part-*.parquet"))
    assert len(parts) >= 2, parts
    manifest = json.loads((path / "_manifest.json").read_text())
    assert len(manifest["segments"]) == len(parts)
    table = ds.dataset(path, format="parquet").to_table(columns=["type", "block_hashes"])
    assert table.num_rows == 400
    rows = rows_of(run_main("cat", str(path), "--json").out)
    assert [r["block_hashes"][0] for r in rows] == list(range(400))


@pytest.mark.parametrize("args", [["--rotate-size", "lots"], ["--rotate-every", "-1"]])
def test_record_usage_errors(engine, tmp_path, args):
    result = run_main("record", engine.endpoint, "-o", str(tmp_path / "x.parquet"), *args)
    assert result.code == 2 and "Traceback" not in result.err


def test_unreadable_recording_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet at all")
    for cmd in (["cat", str(bad)], ["inspect", str(bad)]):
        result = run_main(*cmd)
        assert result.code == 1, cmd
        assert "cannot read recording" in result.err and "Traceback" not in result.err
    empty = tmp_path / "not-a-recording"
    empty.mkdir()
    for cmd in (["cat", str(empty)], ["inspect", str(empty)]):
        result = run_main(*cmd)
        assert result.code == 1 and "no recording in" in result.err, cmd
    missing = run_main("recover", str(tmp_path / "none.parquet"))
    assert missing.code == 1 and "no journal" in missing.err


def test_filtered_recording_keeps_every_seq(engine, tmp_path):
    """Batches the filters empty are recorded without events: reading back shows no gaps."""
    path = tmp_path / "removed-only.parquet"

    def send():
        for i in range(6):
            engine.send([stored([i])] if i % 2 == 0 else [removed([i - 1])])

    rc, _, err = record_until(engine, path, send, "--type", "BlockRemoved")
    assert rc == 0, err
    result = run_main("cat", str(path), "--json")
    assert [r["block_hashes"] for r in rows_of(result.out)] == [[0], [2], [4]]
    assert "gaps 0" in result.err and "in 6 batches" in result.err


def test_partly_recovered_gap_records_only_what_stayed_missing(engine, tmp_path):
    from conftest import free_port

    from kvctl.transports.zmq import ReplayServer

    path = tmp_path / "gap.parquet"
    replay = ReplayServer(f"tcp://127.0.0.1:{free_port()}")

    def publish(live: Live) -> None:
        engine.wait_for()
        for seq in range(6):
            frames = engine.batch([removed([seq])], seq=seq)
            if seq != 4:
                replay.remember(seq, frames[0], frames[2])  # seq 4 is lost for good
            if seq not in (3, 4):
                engine.send_raw(frames)  # 3 and 4 never arrive live
        serve_replays_until(replay, live.ended.is_set)

    try:
        result = run_main(
            "record",
            f"w0={engine.endpoint}",
            "--replay-endpoint",
            replay.endpoint,
            "-o",
            str(path),
            "-c",
            "4",
            "-q",
            alongside=publish,
        )
    finally:
        replay.close()
    assert result.code == 0, result.err
    info = json.loads(run_main("inspect", str(path), "--json").out)
    assert (info["gaps"], info["missing"]) == (1, 1)
    assert [(g["from_seq"], g["to_seq"]) for g in info["gap_list"]] == [(4, 4)]
    # the rows journalled beside the Gap row keep their source's worker label
    table = pq.read_table(path, columns=["type", "worker_id"])
    labels = {w for t, w in zip(*table.to_pydict().values(), strict=True) if t != "Gap"}
    assert labels == {"w0"}


def test_unwritable_output_is_a_clear_error(tmp_path):
    recording = tmp_path / "in.parquet"
    simulated = run_main(
        "simulate", "-o", str(recording), "--workers", "1", "--requests", "3", "-q"
    )
    assert simulated.code == 0, simulated.err
    for target in (tmp_path / "missing-dir" / "x.parquet", "/proc/x.parquet"):
        result = run_main("record", str(recording), "-o", str(target), "-q")
        assert result.code == 1, result.err
        assert "cannot write" in result.err and "Traceback" not in result.err
