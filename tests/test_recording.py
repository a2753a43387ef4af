"""Recording library layer: schema round trip, crash-safe writer, recover, rotation, readers."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvctl.events import Batch
from kvctl.formats import decode_nats, decode_zmq, dynamo
from kvctl.formats import engine_zmq as ez
from kvctl.recording.info import recording_info
from kvctl.recording.journal import read_journal
from kvctl.recording.layout import MANIFEST_NAME
from kvctl.recording.reader import open_recording
from kvctl.recording.rebuild import record_batch_to_batches
from kvctl.recording.recover import recover
from kvctl.recording.rows import batches_to_record_batch
from kvctl.recording.schema import SCHEMA, SCHEMA_VERSION, Gap
from kvctl.recording.writer import RecordingWriter

REPO = Path(__file__).resolve().parents[1]


def canonical_events(rnd: random.Random, n: int = 6) -> list[dict]:
    events = []
    for _ in range(n):
        k = rnd.randint(1, 4)
        events.append(
            {
                "type": "BlockStored",
                "block_hashes": [rnd.getrandbits(64) for _ in range(k)],
                "parent_block_hash": rnd.choice([None, rnd.getrandbits(64)]),
                "token_ids": [rnd.randrange(150_000) for _ in range(16 * k)],
                "block_size": 16,
                "lora_id": rnd.choice([None, 3]),
                "medium": "GPU",
                "lora_name": rnd.choice([None, "ad"]),
            }
        )
    events.append(
        {"type": "BlockRemoved", "block_hashes": [rnd.getrandbits(64), rnd.getrandbits(64)]}
    )
    events.append({"type": "AllBlocksCleared"})
    return events


def all_format_batches(seed: int = 1) -> list[Batch]:
    """One or more batches of every shape the decoders produce, incl. malformed ones."""
    rnd = random.Random(seed)
    evs = canonical_events(rnd)
    out = []
    for seq, enc in enumerate(ez.ENGINE_ENCODINGS):
        payload = ez.encode_payload(evs, 1700000000.25 + seq, seq % 2, enc)
        out.append(
            decode_zmq(
                ez.encode_frames(b"kv@pod-1@llama", seq, payload),
                "tcp://127.0.0.1:5557",
                recv_ns=1_000 + seq,
            )
        )
        out.append(decode_nats("kv.events", payload, "nats://127.0.0.1:4222", recv_ns=7))
    for seq, layout in enumerate(ez.ARRAY_LAYOUTS):
        payload = ez.encode_payload(evs, 1.5, 0, "vllm-array", layout)
        out.append(
            decode_zmq(
                ez.encode_frames(b"t", 100 + seq, payload),
                "tcp://h:1",
                recv_ns=2_000,
                worker_id="w1",
                dp_rank=1,
            )
        )
    # EAGLE-style token pairs, bytes hashes, extra fields, a mixed map/array batch
    eagle = dict(evs[0], token_ids=[[1, 2], [3, 4]], extra_keys=[["img", 3]], group_idx=1)
    byte_ev = dict(
        evs[1], block_hashes=[b"\x01" * 32, b"\x02" * 32], parent_block_hash=b"\x00" * 32
    )
    payload = ez.encode_payload([eagle, byte_ev], 2.0, 0, "vllm")
    out.append(decode_zmq(ez.encode_frames(b"t", 200, payload), "tcp://h:1"))
    import msgpack

    mixed = msgpack.packb([3.0, [ez.vllm_map_event(evs[0]), ez.vllm_array_event(evs[1])], 0])
    out.append(decode_zmq(ez.encode_frames(b"t", 201, mixed), "tcp://h:1"))
    # Dynamo: JSON, msgpack envelope over NATS, ZMQ event plane
    routers = [dynamo.router_event(e, 77, i) for i, e in enumerate(evs)]
    out.append(decode_nats("kv", dynamo.encode_json(routers[0]), "nats://n"))
    out.append(decode_nats("kv", dynamo.encode_json(routers[-1]), "nats://n"))
    env = dynamo.encode_envelope(routers, 42, 9, 1_700_000_000_000)
    out.append(decode_nats("kv", env, "nats://n"))
    out.append(decode_zmq(dynamo.encode_event_plane(env, 42, 10), "tcp://d:1"))
    # malformed and empty
    out.append(decode_zmq([b"only-one-frame"], "tcp://bad"))
    out.append(decode_zmq([b"t", (5).to_bytes(8, "big"), b"\xc1garbage"], "tcp://bad"))
    out.append(decode_nats("kv", b"\xc1\x00", "nats://n"))
    out.append(decode_zmq(ez.encode_frames(b"t", 300, msgpack.packb([1.0, [], 0])), "tcp://h:1"))
    return out


def test_decoders_cover_every_format() -> None:
    formats = {b.format for b in all_format_batches()}
    assert {
        "engine-map",
        "engine-array",
        "engine-mixed",
        "dynamo-json",
        "dynamo-msgpack",
        "dynamo-zmq",
        "unknown",
    } <= formats
    assert sum(b.malformed for b in all_format_batches()) == 3


def test_schema_round_trip_every_format() -> None:
    batches = all_format_batches()
    rb = batches_to_record_batch(batches)
    assert rb.schema.equals(SCHEMA)
    back = record_batch_to_batches(rb)
    assert back == batches
    for a, b in zip(batches, back, strict=True):
        assert [list(e) for e in a.events] == [list(e) for e in b.events]  # key order too
        assert a.frames == b.frames


def test_raw_frames_always_kept_when_asked() -> None:
    batches = all_format_batches()
    auto = batches_to_record_batch(batches)
    always = batches_to_record_batch(batches, raw_frames="always")
    assert auto.column("frames_codec").null_count < auto.num_rows  # some rebuilt
    assert always.column("frames_codec").null_count == always.num_rows
    first_rows = [f for f in always.column("frames").to_pylist() if f is not None]
    assert first_rows == [b.frames for b in batches]
    assert record_batch_to_batches(always) == batches


def test_signed_hashes_and_gap_rows() -> None:
    ev = {
        "type": "BlockStored",
        "block_hashes": [-5, 3, -(1 << 63)],
        "parent_block_hash": -1,
        "token_ids": [1] * 48,
        "block_size": 16,
        "lora_id": None,
    }
    conflict = {"type": "BlockRemoved", "block_hashes": [-1, (1 << 64) - 1, 1 << 70]}
    b = Batch(source="s", events=[ev, conflict], format="engine-map", seq=1, ts=1.0)
    rb = batches_to_record_batch([b, Gap(("s", 7), 2, 4, 5, "s")])
    assert rb.column("block_hashes")[0].as_py() == [(1 << 64) - 5, 3, 1 << 63]
    assert rb.column("hash_signed")[0].as_py() is True
    assert rb.column("type").to_pylist()[-1] == "Gap"
    back = record_batch_to_batches(rb, include_gaps=True)
    assert back[0] == b
    assert back[1] == Gap(("s", 7), 2, 4, 5, "s") and back[1].missing == 3


# Two write paths: "raw" journals the message (frames + labels) and the converter decodes it
# again (what `kvctl record` does with live sources); "exact" journals the batch as given.
MODES = ["raw", "exact"]


def put(w: RecordingWriter, batches: Batch | list[Batch], mode: str = "raw") -> None:
    for b in [batches] if isinstance(batches, Batch) else batches:
        if mode == "raw":
            w.write_message(b)
        else:
            w.write(b)


def write_all(path: Path, batches: list[Batch], mode: str = "raw", **kw) -> dict:
    w = RecordingWriter(path, metadata={"sources": ["tcp://x"], "argv": ["kvctl", "record"]}, **kw)
    put(w, batches, mode)
    return w.close()


@pytest.mark.parametrize("mode", MODES)
def test_writer_reader_round_trip(tmp_path: Path, mode: str) -> None:
    batches = all_format_batches() * 3
    out = tmp_path / "run.parquet"
    summary = write_all(out, batches, mode)
    assert out.exists() and not (tmp_path / "run.parquet.journal").exists()
    assert summary["batches"] == len(batches) and summary["malformed"] == 9
    assert summary["events"] == sum(len(b.events) for b in batches)
    # small chunks: batches straddle chunk boundaries and must be reassembled
    back = list(open_recording(out, batch_size=5))
    assert back == batches
    assert [b.frames for b in back] == [b.frames for b in batches]
    meta = json.loads(pq.ParquetFile(out).metadata.metadata[b"kvctl"])
    assert meta["schema_version"] == SCHEMA_VERSION
    assert meta["metadata"]["sources"] == ["tcp://x"]
    assert meta["counts"]["malformed"] == 9 and meta["counts"]["batches"] == len(batches)
    assert pq.ParquetFile(out).metadata.row_group(0).column(0).compression == "ZSTD"


@pytest.mark.parametrize("mode", MODES)
def test_info_and_gaps(tmp_path: Path, mode: str) -> None:
    out = tmp_path / "run.parquet"
    batches = all_format_batches()
    w = RecordingWriter(out, background=False)
    put(w, batches[:5], mode)
    w.write_gap("tcp://127.0.0.1:5557", 3, 9, recv_ns=5)
    put(w, batches[5:], mode)
    summary = w.close()
    assert summary["gaps"] == 1 and summary["missing"] == 7
    info = recording_info(out)
    assert info["schema_version"] == SCHEMA_VERSION
    assert info["gaps"] == 1 and info["missing"] == 7
    assert info["gap_list"][0]["from_seq"] == 3
    assert info["malformed"] == 3 and "Malformed" not in info["by_type"]
    assert info["events"] == sum(len(b.events) for b in batches)
    assert info["by_type"]["BlockStored"] > 0 and info["by_worker"]["77"] > 0
    assert info["publishers"]["tcp://127.0.0.1:5557"]["min_seq"] == 0
    assert 0 < info["ratio"] < 10 and info["bytes"] == out.stat().st_size
    items = list(open_recording(out, include_gaps=True))
    assert items[5] == Gap("tcp://127.0.0.1:5557", 3, 9, 5, "")
    assert [b for b in items if not isinstance(b, Gap)] == batches


def test_empty_recording(tmp_path: Path) -> None:
    out = tmp_path / "empty.parquet"
    RecordingWriter(out).close()
    assert list(open_recording(out)) == []
    assert recording_info(out)["rows"] == 0


KILL_SCRIPT = """
import sys, time
sys.path.insert(0, {tests!r})
from test_recording import all_format_batches
from kvctl.recording.journal import read_journal
from kvctl.recording.writer import RecordingWriter
from test_recording import put
w = RecordingWriter({out!r}, flush_interval=0.2)
batches = all_format_batches()
put(w, batches, {mode!r})
w.flush()                      # explicit flush
journal = {out!r} + ".journal"
flushed = sum(rb.num_rows for rb in read_journal(journal))
put(w, batches, {mode!r})      # left to the background flusher (<= flush_interval)
started = time.monotonic()
deadline = started + 15
while sum(rb.num_rows for rb in read_journal(journal)) < 2 * flushed:  # on disk: flushed
    assert time.monotonic() < deadline, "the background flusher did not flush within 15 s"
    time.sleep(0.02)           # a file has no push signal
print("ready", round(time.monotonic() - started, 3), flush=True)
put(w, batches, {mode!r})      # never flushed: lost with the process
time.sleep(60)                 # until the test kills it
"""


@pytest.mark.parametrize("mode", MODES)
def test_kill_9_then_recover(tmp_path: Path, mode: str) -> None:
    out = tmp_path / "run.parquet"
    script = KILL_SCRIPT.format(tests=str(REPO / "tests"), out=str(out), mode=mode)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script)], stdout=subprocess.PIPE, env=env
    )
    try:
        ready, waited = proc.stdout.readline().split()
        assert ready == b"ready"
        # the 0.2 s flush interval, with slack for a loaded machine
        assert float(waited) < 2.0, f"the background flush took {float(waited)} s"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    journal = tmp_path / "run.parquet.journal"
    assert journal.exists() and not out.exists()
    expected = all_format_batches() * 2
    assert list(open_recording(journal)) == expected  # readable before recovery too
    # a torn tail (killed mid-write) costs only the incomplete record batch
    torn = tmp_path / "torn.parquet.journal"
    data = journal.read_bytes()
    torn.write_bytes(data[: len(data) - 100])
    assert list(open_recording(torn)) == all_format_batches()
    assert recover(journal) == out
    assert not journal.exists()
    assert list(open_recording(out)) == expected
    meta = json.loads(pq.ParquetFile(out).metadata.metadata[b"kvctl"])
    assert meta["recovered"] is True and meta["counts"]["batches"] == len(expected)
    assert recover(torn) == tmp_path / "torn.parquet"


@pytest.mark.parametrize("mode", MODES)
def test_rotation_by_size(tmp_path: Path, mode: str) -> None:
    out = tmp_path / "run"
    batches = all_format_batches() * 8
    summary = write_all(out, batches, mode, rotate_size=20_000, flush_rows=20, background=False)
    parts = sorted(p.name for p in out.glob("part-*.parquet"))
    assert len(parts) > 2 and len(summary["files"]) == len(parts)
    assert not list(out.glob(".*"))  # no journal or temp left
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["complete"] and [s["file"] for s in manifest["segments"]] == parts
    assert manifest["counts"]["batches"] == len(batches)
    assert sum(s["rows"] for s in manifest["segments"]) == ds.dataset(out).count_rows()
    assert list(open_recording(out)) == batches
    assert recording_info(out)["batches"] == len(batches)
    # batch_index keeps counting across segments
    table = ds.dataset(out).to_table(columns=["batch_index"])
    idx = [i for i in table.column("batch_index").to_pylist() if i is not None]
    assert sorted(set(idx)) == list(range(len(batches)))


def test_rotation_by_time(tmp_path: Path) -> None:
    out = tmp_path / "run"
    every = 0.25
    w = RecordingWriter(out, rotate_every=every, flush_interval=0.05)
    batches = all_format_batches()
    deadline = time.time() + 0.9
    written = []
    while time.time() < deadline:
        w.write_message(batches[len(written) % len(batches)])
        written.append(batches[(len(written)) % len(batches)])
        time.sleep(0.02)
    w.close()
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert len(manifest["segments"]) >= 3
    for seg in manifest["segments"]:
        start = seg["window_start_ns"] / 1e9
        assert abs(start / every - round(start / every)) < 1e-6  # aligned to the clock
    assert ds.dataset(out, format="parquet").count_rows() == manifest["counts"]["rows"]
    assert list(open_recording(out)) == written


def test_recover_segment_directory(tmp_path: Path) -> None:
    out = tmp_path / "run"
    w = RecordingWriter(out, rotate_size=10_000, flush_rows=10, background=False)
    batches = all_format_batches() * 4
    put(w, batches)
    w.write_message(batches[-1])  # one row, well below the rotation size: it stays open
    w.flush()
    batches.append(batches[-1])
    # simulate a crash once the finished segments are converted: the converter process is
    # killed and the writer abandoned (the journal of the open segment stays behind)
    deadline = time.monotonic() + 30
    while any(s.sealed_info is not None for s in w._open) and time.monotonic() < deadline:
        w.flush()
        time.sleep(0.02)
    assert list(out.glob("part-*.parquet"))
    w._converter.kill()
    assert list(out.glob(".part-*.journal"))
    assert list(open_recording(out)) == batches  # finished segments + live journal
    assert recover(out) == out
    assert not list(out.glob(".part-*"))
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["counts"]["batches"] == len(batches)
    assert list(open_recording(out)) == batches


def test_journal_is_ipc_stream(tmp_path: Path) -> None:
    out = tmp_path / "r.parquet"
    w = RecordingWriter(out, background=False)
    put(w, all_format_batches())
    w.flush()
    rbs = list(read_journal(tmp_path / "r.parquet.journal"))
    assert sum(rb.num_rows for rb in rbs) > 0
    w.close()


# --- property test: random events with int / bytes hashes survive the schema -----------------

_u64 = st.integers(0, (1 << 64) - 1)
_i64 = st.integers(-(1 << 63), (1 << 63) - 1)
_hash = st.one_of(_u64, _i64, st.binary(min_size=1, max_size=32))
_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(1 << 70), 1 << 70),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.binary(max_size=8),
)
_any = st.recursive(
    _scalar,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.one_of(st.text(max_size=4), st.integers(0, 9)), inner, max_size=3),
    ),
    max_leaves=6,
)


@st.composite
def events(draw: st.DrawFn) -> dict:
    kind = draw(st.sampled_from(["u", "s", "b", "mixed"]))
    base = {"u": _u64, "s": _i64, "b": st.binary(min_size=32, max_size=32), "mixed": _hash}
    ev: dict = {"type": draw(st.sampled_from(["BlockStored", "BlockRemoved", "X", 5]))}
    fields = {
        "block_hashes": st.one_of(st.none(), st.lists(base[kind], max_size=5)),
        "parent_block_hash": st.one_of(st.none(), base[kind]),
        "token_ids": st.one_of(
            st.none(),
            st.lists(st.integers(0, (1 << 32) - 1), max_size=20),
            st.lists(st.lists(st.integers(0, 99), max_size=2), max_size=3),
        ),
        "block_size": st.one_of(st.none(), st.integers(0, 1 << 40)),
        "lora_id": st.one_of(st.none(), st.integers(-(1 << 65), 1 << 65)),
        "lora_name": st.one_of(st.none(), st.text(max_size=5), st.integers()),
        "medium": st.one_of(st.none(), st.sampled_from(["GPU", "CPU"])),
        "tokens_hashes": st.lists(st.one_of(_u64, _i64), max_size=3),
        "event_id": st.one_of(_u64, _i64),
        "storage_tier": st.one_of(st.none(), st.text(max_size=4)),
        "worker_id": st.one_of(st.integers(0, 3), st.text(max_size=3)),
        "dp_rank": st.one_of(st.none(), st.integers(0, 2)),
        "extra_keys": _any,
        "weird$": _any,
    }
    for name in draw(st.permutations(list(fields))):
        if draw(st.booleans()):
            ev[name] = draw(fields[name])
    if draw(st.integers(0, 20)) == 0:
        ev[7] = "non-string key"
    return ev


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.lists(events(), max_size=4), min_size=1, max_size=4),
    st.one_of(st.none(), st.integers(0, 3), st.text(max_size=3)),
    st.one_of(st.none(), st.integers(0, (1 << 64) - 1)),
)
def test_schema_round_trip_property(groups: list[list[dict]], worker, seq) -> None:
    batches = [
        Batch(
            source="tcp://h:1",
            events=evs,
            format="engine-map",
            topic="t",
            seq=seq,
            ts=1.5,
            recv_ns=i,
            worker_id=worker,
            dp_rank=0,
            frames=[b"raw", bytes([i])],
            publisher=("tcp://h:1", worker),
        )
        for i, evs in enumerate(groups)
    ]
    back = record_batch_to_batches(batches_to_record_batch(batches))
    assert back == batches
    for a, b in zip(batches, back, strict=True):
        for ea, eb in zip(a.events, b.events, strict=True):
            assert list(ea) == list(eb)
            assert [type(v) for v in ea.values()] == [type(v) for v in eb.values()]


@pytest.mark.parametrize("n", [0, 1])
def test_batch_without_events_keeps_frames(n: int) -> None:
    b = Batch(
        source="s",
        events=[],
        format="unknown",
        frames=[b"\xc1"] * n,
        error="not msgpack" if n else None,
    )
    rb = batches_to_record_batch([b])
    assert rb.num_rows == 1
    assert rb.column("type")[0].as_py() == ("Malformed" if n else None)
    assert record_batch_to_batches(rb) == [b]


# --- the converter process ----------------------------------------------------------------------


def _wait(cond, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.mark.parametrize("restarts", [3, 0])
def test_converter_death_loses_nothing(tmp_path: Path, monkeypatch, restarts: int) -> None:
    """kill -9 of the converter mid-recording: recording goes on, and the next converter (or,
    when none may be started, close itself) converts everything from the journals."""
    from kvctl.recording import writer

    monkeypatch.setattr(writer, "CONVERTER_RESTARTS", restarts)
    out = tmp_path / "run"
    w = RecordingWriter(out, rotate_size=15_000, flush_interval=0.05)
    assert w.converter_ready()
    batches = all_format_batches() * 6
    put(w, batches[:60])
    w.flush()
    first = w._converter.pid
    os.kill(first, signal.SIGKILL)
    put(w, batches[60:])
    w.flush()
    if restarts:
        _wait(lambda: w._converter is not None and w._converter.pid != first)
    summary = w.close()
    assert summary["converter"]["restarts"] == (1 if restarts else 0)
    assert (summary["converter"]["inline_conversions"] > 0) == (not restarts)
    assert not list(out.glob(".*"))  # no journal or temp file of the dead converter left
    assert list(open_recording(out)) == batches
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["complete"] and manifest["counts"]["batches"] == len(batches)


def test_lagging_converter_still_closes_complete(tmp_path: Path) -> None:
    """A burst while the converter cannot keep up (here: stopped) is held on disk, not in
    memory; close waits for the converter to catch up and the file is complete."""
    out = tmp_path / "burst.parquet"
    w = RecordingWriter(out, flush_rows=64)
    assert w.converter_ready()
    os.kill(w._converter.pid, signal.SIGSTOP)
    try:
        batches = all_format_batches() * 40
        put(w, batches)
        w.flush()
        journal = tmp_path / "burst.parquet.journal"
        assert sum(rb.num_rows for rb in read_journal(journal)) == len(batches)
        assert not out.exists()  # nothing converted yet: the journal is the buffer
    finally:
        os.kill(w._converter.pid, signal.SIGCONT)
    summary = w.close()
    assert summary["converter"]["inline_conversions"] == 0  # the converter did the work
    assert summary["batches"] == len(batches)
    assert list(open_recording(out)) == batches
    assert not (tmp_path / "burst.parquet.journal").exists()


def test_parent_death_leaves_the_journal_to_recover(tmp_path: Path) -> None:
    """The converter notices its recorder died (end of stdin), removes its temp file and
    leaves the journal alone: `recover` then converts it."""
    out = tmp_path / "run.parquet"
    script = KILL_SCRIPT.format(tests=str(REPO / "tests"), out=str(out), mode="raw")
    script = script.replace('print("ready", ', 'print("ready", w._converter.pid, ')
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script)], stdout=subprocess.PIPE, env=env
    )
    try:
        line = proc.stdout.readline().split()
        assert line[0] == b"ready"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    converter = int(line[1])
    _wait(lambda: not _running(converter))
    assert not list(tmp_path.glob(".*.tmp")) and not out.exists()
    assert recover(out) == out
    assert list(open_recording(out)) == all_format_batches() * 2


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (not yet reaped by init) is gone too
        return f.read().split(")")[-1].split()[0] != "Z"


def test_filters_and_cut_are_reproduced(tmp_path: Path) -> None:
    """What the pipeline kept (filters, then -c on the last batch) is what the file holds,
    with labels from the journal header (as `kvctl record` writes them)."""
    from kvctl.selection import Filters

    filters = Filters(types=frozenset({"BlockStored"}))
    src = "tcp://127.0.0.1:5557"
    batches = [b for b in all_format_batches() if b.source == src]
    out = tmp_path / "f.parquet"
    w = RecordingWriter(out, filters=filters, labels={src: (None, None)})
    kept = []
    for b in batches:
        events = filters.apply(b)
        if b is batches[-1]:
            events = events[:2]
        w.write_message(b, events)
        kept.append(Batch(**{**{f: getattr(b, f) for f in b.__slots__}, "events": events}))
    w.close()
    assert list(open_recording(out)) == kept
    assert json.loads(pq.ParquetFile(out).metadata.metadata[b"kvctl"]).get("mismatches") is None


def test_dictionary_columns_read_back_across_chunks_with_nulls():
    import pyarrow as pa

    from kvctl.recording.rebuild import _to_pylist

    first = pa.array(["GPU", "CPU", None, "GPU"]).dictionary_encode()
    second = pa.array(["DISK", None]).dictionary_encode()  # another dictionary
    assert _to_pylist(pa.chunked_array([first, second])) == [
        "GPU",
        "CPU",
        None,
        "GPU",
        "DISK",
        None,
    ]


def test_a_converter_whose_recorder_stops_reading_leaves_no_temp_file(tmp_path: Path) -> None:
    """A recorder killed while its converter reports progress: the converter's next word
    meets a closed pipe. It removes its temp file and exits; the journal stays for
    `kvctl recover`."""
    out = tmp_path / "run.parquet"
    writer = RecordingWriter(out, converter=False, background=False, flush_rows=8)
    put(writer, all_format_batches() * 4)
    writer.flush()
    journal = tmp_path / "run.parquet.journal"
    committed = journal.stat().st_size
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvctl.recording.converter"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )
    try:
        commands = [
            {"op": "config", "compression_level": 1},
            {"op": "open", "journal": str(journal), "target": str(out), "offset": 0},
        ]
        proc.stdin.write("".join(json.dumps(c) + "\n" for c in commands).encode())
        proc.stdin.flush()
        assert json.loads(proc.stdout.readline())["op"] == "ready"
        proc.stdout.close()  # the recorder is gone: nobody reads the converter any more
        commit = {"op": "commit", "journal": str(journal), "offset": committed}
        proc.stdin.write((json.dumps(commit) + "\n").encode())
        proc.stdin.flush()  # its stdin stays open: only the broken pipe tells
        assert proc.wait(timeout=20) != 0
    finally:
        proc.kill()
        proc.wait()
    assert not list(tmp_path.glob(".*.tmp")) and not out.exists()
    assert journal.stat().st_size == committed
