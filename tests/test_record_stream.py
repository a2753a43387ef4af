"""kvctl record nats://... --stream NAME --partition I/N -o DIR: partitioned recorders reading a
fleet stream (made by `kvctl stream init`, filled with the fleet messages a bridge publishes)
into one dataset of Parquet segments, against the session's real nats-server."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import duckdb
import nats
import pyarrow.parquet as pq
import pytest
from conftest import Engine, finish, read_until, removed, run_kvctl, start_kvctl, stored
from inprocess import run_main

from kvctl.formats.engine_zmq import encode_frames, encode_payload
from kvctl.partitions import (
    MSG_ID,
    FleetMessage,
    StreamLayout,
    message_id,
    partition_key,
    partition_of,
)
from kvctl.recording.dataset import Segment, list_segments, open_root

_names = (f"rec{n}-{os.getpid()}" for n in itertools.count())


def stream_name() -> str:
    return next(_names)


def init_stream(url: str, name: str, partitions: int) -> StreamLayout:
    result = run_main("stream", "init", url, "--name", name, "--partitions", str(partitions))
    assert result.code == 0, result.err
    return StreamLayout(name, partitions)


def fleet_message(worker: str, seq: int, recv_ns: int, dp_rank: int = 0) -> FleetMessage:
    """A vLLM map-form batch of one worker, as a bridge of its ZMQ socket publishes it."""
    events = [stored([seq * 10 + 1, seq * 10 + 2], parent=seq), removed([seq * 10 + 1])]
    frames = encode_frames(b"", seq, encode_payload(events, 1_700_000_000.5 + seq, dp_rank))
    return FleetMessage(
        recv_ns, f"tcp://{worker}:5557", "", frames, json.dumps(worker), json.dumps(dp_rank)
    )


async def _publish(url: str, layout: StreamLayout, items: list[tuple[str, Any]]) -> list[int]:
    """Publish (worker, FleetMessage or (headers, body)) into the stream; their stream seqs."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        seqs = []
        for worker, msg in items:
            if isinstance(msg, FleetMessage):
                headers, body = msg.headers(), msg.body()
                headers[MSG_ID] = message_id(
                    partition_key(msg.worker, msg.source), 0, None, body + str(msg.recv_ns).encode()
                )
            else:
                headers, body = msg
            ack = await js.publish(layout.publish_subject(worker), body, headers=headers)
            seqs.append(ack.seq)
        return seqs
    finally:
        await nc.close()


def publish(url: str, layout: StreamLayout, items: list[tuple[str, Any]]) -> dict[int, int]:
    """Stream seq -> partition of each message published."""
    seqs = asyncio.run(asyncio.wait_for(_publish(url, layout, items), 30))
    return {
        seq: partition_of(worker, layout.partitions)
        for seq, (worker, _) in zip(seqs, items, strict=True)
    }


def workload(workers: int, per_worker: int, start_seq: int = 0) -> list[tuple[str, FleetMessage]]:
    base = time.time_ns()
    return [
        (f"w{w}", fleet_message(f"w{w}", start_seq + s, base + s * 1000 + w))
        for s in range(per_worker)
        for w in range(workers)
    ]


def segments_of(directory: Path, stream: str) -> list[tuple[str, Segment]]:
    fs, root = open_root(str(directory))
    return [(p, s) for p, s in list_segments(fs, root) if s.stream == stream]


def footer(path: str) -> dict[str, Any]:
    return json.loads(pq.read_metadata(path).metadata[b"kvctl"])


def stream_seqs_on_disk(directory: Path, stream: str, published: dict[int, int]) -> list[int]:
    """Every stream seq the segments hold, each as often as a segment holds it. A segment
    FIRST-LAST of partition p holds the messages of p stored in that range: the footer
    counts them, and they must be all of them (``published``: stream seq -> partition)."""
    seqs: list[int] = []
    covered: dict[int, int] = {}  # partition -> last seq of its previous segment
    for path, seg in segments_of(directory, stream):
        meta = footer(path)
        assert (meta["first_stream_seq"], meta["last_stream_seq"]) == (seg.first, seg.last)
        # a partition's segments tile the seq line (inspect's holes mean lost data)
        assert seg.first == covered.get(seg.partition, 0) + 1, (seg, covered)
        covered[seg.partition] = seg.last
        assert meta["partitions"] >= 1
        held = [
            s for s, p in published.items() if p == seg.partition and seg.first <= s <= seg.last
        ]
        assert meta["messages"] == len(held), (seg, meta["messages"], len(held))
        seqs.extend(held)
    return seqs


def record(url: str, stream: str, out: Path, *extra: str) -> Any:
    return run_main(
        "record", url, "--stream", stream, "-o", str(out), "--idle-timeout", "1.5", *extra
    )


# --- (a) two recorders, four partitions, one hive dataset -----------------------------------


def test_two_recorders_share_one_hive_dataset(nats_server, tmp_path):
    name = stream_name()
    layout = init_stream(nats_server.url, name, 4)
    items = workload(workers=8, per_worker=25)
    seqs = publish(nats_server.url, layout, items)
    out = tmp_path / "ds"
    for spec in ("0,1/4", "2,3/4"):
        result = record(nats_server.url, name, out, "--partition", spec, "--layout", "hive")
        assert result.code == 0, result.err
        assert "stopped by idle timeout" in result.err

    segments = segments_of(out, name)
    assert segments and all(not Path(p).name.startswith(".") for p, _ in segments)
    for path, seg in segments:
        rel = Path(path).relative_to(out).parts
        assert rel[0].startswith("dt=") and rel[1].startswith("hour=")
        assert rel[2] == f"part={seg.partition:02d}"
        assert Path(path).name == seg.file_name
        table = pq.read_table(path)
        keys = list(
            zip(
                table.column("worker_id").to_pylist(),
                table.column("dp_rank").to_pylist(),
                table.column("seq").to_pylist(),
                strict=True,
            )
        )
        assert keys == sorted(keys)  # sorted by (worker_id, dp_rank, seq)
        # each worker's rows are in the partition its subject maps to
        workers = {w for w in table.column("worker_id").to_pylist()}
        assert {layout.stored_subject(w).split(".")[2] for w in workers} == {str(seg.partition)}
    assert sorted(stream_seqs_on_disk(out, name, seqs)) == sorted(seqs)  # each in one segment

    con = duckdb.connect()
    n, parts = con.execute(
        f"SELECT count(DISTINCT (worker_id, seq)), count(DISTINCT part) FROM "
        f"read_parquet('{out}/**/*.parquet', hive_partitioning=true)"
    ).fetchone()
    assert (n, parts) == (len(items), 4)


def test_rows_equal_what_record_writes_from_the_live_source(nats_server, tmp_path, endpoint):
    """The same engine messages, recorded live by `kvctl record` and through a fleet stream
    by a partitioned recorder: the same rows, column by column (as sets; batch_index numbers
    messages per file)."""
    engine = Engine(endpoint)
    live = tmp_path / "live.parquet"
    proc = start_kvctl("record", endpoint, "-o", str(live), "-c", "60", "--idle-timeout", "10")
    try:
        engine.wait_for()
        for seq in range(30):
            engine.send([stored([seq * 3 + 1, seq * 3 + 2], parent=seq), removed([seq * 3 + 1])])
        rc, _, err = finish(proc)
    finally:
        engine.close()
    assert rc == 0, err
    live_table = pq.read_table(live)
    # what a bridge of that socket would publish: each message's frames and labels
    from kvctl.recording.reader import open_recording

    name = stream_name()
    layout = init_stream(nats_server.url, name, 2)
    items = []
    for batch in open_recording(str(live)):
        fm = FleetMessage(batch.recv_ns, batch.source, batch.topic, list(batch.frames))
        items.append((batch.source, fm))
    publish(nats_server.url, layout, items)
    out = tmp_path / "ds"
    result = record(nats_server.url, name, out)
    assert result.code == 0, result.err
    fleet = [pq.read_table(path).to_pydict() for path, _ in segments_of(out, name)]
    assert sum(len(t["seq"]) for t in fleet) == live_table.num_rows
    for column in live_table.column_names:
        if column == "batch_index":
            continue
        left = live_table.column(column).to_pylist()
        right = [v for t in fleet for v in t[column]]
        assert sorted(map(repr, left)) == sorted(map(repr, right)), column


# --- (c) a malformed envelope -----------------------------------------------------------------


def test_a_malformed_envelope_is_a_counted_malformed_row(nats_server, tmp_path):
    name = stream_name()
    layout = init_stream(nats_server.url, name, 1)
    good = workload(workers=1, per_worker=3)
    bad = ("w0", ({"Kvctl-Source": "tcp://w0:5557"}, b"not a fleet message"))
    publish(nats_server.url, layout, [good[0], bad, good[1], bad, good[2]])
    out = tmp_path / "ds"
    result = record(nats_server.url, name, out, "--json")
    assert result.code == 0, result.err
    summary = json.loads(result.out)["summary"]
    assert summary["malformed_envelopes"] == 2 and summary["messages"] == 5
    assert result.err.count("malformed fleet message") == 1  # once per kind
    assert "Kvctl-Recv-Ns" in result.err
    table = pq.read_table(str(out))
    malformed = [r for r in table.to_pylist() if r["type"] == "Malformed"]
    assert len(malformed) == 2
    assert all(r["frames"] == [b"not a fleet message"] for r in malformed)
    assert all("not a kvctl fleet message" in r["error"] for r in malformed)
    assert sum(1 for r in table.to_pylist() if r["type"] == "BlockStored") == 3


# --- (b) kill -9 mid-run, restart: zero loss, zero duplicates ----------------------------------


def test_kill_9_mid_run_and_restart_loses_and_duplicates_nothing(nats_server, tmp_path):
    name = stream_name()
    layout = init_stream(nats_server.url, name, 2)
    out = tmp_path / "ds"
    seqs = publish(nats_server.url, layout, workload(workers=4, per_worker=200))
    more: dict[int, int] = {}
    stop = threading.Event()

    def keep_publishing() -> None:  # messages keep arriving while the recorder dies
        for round_ in range(200):
            if stop.is_set():
                return
            more.update(publish(nats_server.url, layout, workload(4, 5, 1000 + round_ * 5)))

    proc = subprocess.Popen(
        [
            *_kvctl("record", nats_server.url, "--stream", name, "-o", str(out)),
            "--rotate-size",
            "20K",
            "--idle-timeout",
            "20",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    publisher = threading.Thread(target=keep_publishing)
    try:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and len(segments_of(out, name)) < 3:
            time.sleep(0.05)  # no other signal: segments appearing on disk is the progress
        assert len(segments_of(out, name)) >= 3, "no segments were written"
        publisher.start()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and len(segments_of(out, name)) < 8:
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        stop.set()
        if publisher.is_alive() or publisher.ident is not None:
            publisher.join(20)
    seqs |= more
    # what a recorder killed while writing leaves: a hidden, incomplete segment
    leftover = out / f".{name}.p00.{10**6:012d}-{10**6 + 5:012d}.parquet.tmp-99999"
    leftover.write_bytes(b"PAR1 half a segment")
    seqs |= publish(nats_server.url, layout, workload(4, 50, start_seq=5000))
    result = record(nats_server.url, name, out, "--json")
    assert result.code == 0, result.err
    assert f"removed {leftover}: an incomplete segment" in result.err
    on_disk = stream_seqs_on_disk(out, name, seqs)
    assert len(on_disk) == len(set(on_disk))  # zero duplicates
    assert sorted(on_disk) == sorted(seqs)  # zero loss
    assert not list(out.rglob(".*"))  # temp files gone


def _kvctl(*args: str) -> list[str]:
    import sys

    return [sys.executable, "-m", "kvctl", *args]


# --- (d) segments committed, acks lost ---------------------------------------------------------


def test_resume_when_a_segment_was_committed_but_not_acked(nats_server, tmp_path):
    """A recorder killed after a segment was renamed into place and before its ack: its
    consumer's ack floor is behind the dataset. The next run skips what it redelivers."""
    name = stream_name()
    layout = init_stream(nats_server.url, name, 1)
    first = publish(nats_server.url, layout, workload(workers=2, per_worker=10))
    out = tmp_path / "ds"
    assert record(nats_server.url, name, out).code == 0
    committed = stream_seqs_on_disk(out, name, first)
    assert sorted(committed) == sorted(first)
    # lose the acks: the consumer starts again from the beginning of the stream
    from kvctl.transports.jetstream import consumer_name

    async def rewind() -> None:
        nc = await nats.connect(nats_server.url)
        try:
            js = nc.jetstream()
            await js.delete_consumer(name, consumer_name(name, 0))
            await js.add_consumer(
                name,
                durable_name=consumer_name(name, 0),
                filter_subject=layout.partition_subject(0),
                ack_policy="all",
                ack_wait=300,
            )
        finally:
            await nc.close()

    asyncio.run(asyncio.wait_for(rewind(), 10))
    second = publish(nats_server.url, layout, workload(workers=2, per_worker=5, start_seq=50))
    result = record(nats_server.url, name, out, "--json")
    assert result.code == 0, result.err
    assert "acks up to stream seq" in result.err
    on_disk = stream_seqs_on_disk(out, name, first | second)
    assert sorted(on_disk) == sorted(first | second) and len(on_disk) == len(set(on_disk))


# --- (e) bad options ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--partition", "0/4"), "--partition applies to a fleet stream: give --stream NAME"),
        (("--layout", "hive"), "--layout applies to a fleet stream"),
        (("--stream", "s", "--append"), "--append does not apply to --stream"),
        (("--stream", "s", "--overwrite"), "--overwrite does not apply to --stream"),
        (("--stream", "s", "--partition", "4/4"), "partition 4 is not in 0..3"),
        (("--stream", "s", "--partition", "0,x/4"), "expected I[,J...]/N"),
        (("--stream", "s", "--partition", "1,1/4"), "a partition is named twice"),
        (("--stream", "s", "--type", "BlockStored"), "--type/--worker do not apply"),
        (("--stream", "bad name"), "stream name 'bad name'"),
    ],
)
def test_bad_options(nats_server, tmp_path, args, message):
    result = run_main("record", nats_server.url, "-o", str(tmp_path / "ds"), *args)
    assert result.code == 2, result.err
    assert message in result.err and len(result.err.strip().splitlines()) == 1


def test_stream_from_a_zmq_source_is_refused(tmp_path):
    result = run_kvctl("record", "tcp://127.0.0.1:5557", "--stream", "s", "-o", str(tmp_path))
    assert result.returncode == 2
    assert "--stream reads a NATS JetStream stream" in result.stderr.decode()


def test_an_unreachable_server_is_one_line_at_once(tmp_path):
    """The first connection is bounded (nats-py would retry an unreachable server forever
    with the unlimited reconnects a running recorder uses)."""
    from conftest import free_port

    started = time.monotonic()
    result = run_kvctl(
        "record", f"nats://127.0.0.1:{free_port()}", "--stream", "s", "-o", str(tmp_path / "ds"),
        timeout=30,
    )  # fmt: skip
    assert result.returncode == 1
    err = result.stderr.decode().strip()
    assert "cannot connect to NATS" in err and len(err.splitlines()) == 1, err
    assert time.monotonic() - started < 20


def test_partition_count_must_be_the_stream_s(nats_server, tmp_path):
    name = stream_name()
    init_stream(nats_server.url, name, 4)
    result = record(nats_server.url, name, tmp_path, "--partition", "0/8")
    assert result.code == 2 and "has 4 partitions, not 8" in result.err


# --- Ctrl-C commits what is open, acks it, exits 130 ------------------------------------------


def test_ctrl_c_commits_and_acks_what_is_open(nats_server, tmp_path):
    name = stream_name()
    layout = init_stream(nats_server.url, name, 2)
    seqs = publish(nats_server.url, layout, workload(workers=4, per_worker=20))
    out = tmp_path / "ds"
    proc = start_kvctl(
        "record", nats_server.url, "--stream", name, "-o", str(out), "--rotate-every", "1h"
    )
    read_until(proc.stderr, "recording stream")
    # what it received is only in memory (one segment an hour): Ctrl-C writes it
    wait_delivered(nats_server.url, name, [0, 1], len(seqs))
    proc.send_signal(signal.SIGINT)
    rc, _, err = finish(proc)
    assert rc == 130, err
    assert "stopped by interrupt" in err
    on_disk = stream_seqs_on_disk(out, name, seqs)
    assert sorted(on_disk) == sorted(seqs)
    # acked: a second run finds nothing new and skips nothing
    result = record(nats_server.url, name, out, "--json")
    assert result.code == 0, result.err
    summary = json.loads(result.out)["summary"]
    assert (summary["messages"], summary["skipped_already_recorded"]) == (0, 0)


def wait_delivered(url: str, stream: str, partitions: list[int], count: int) -> None:
    """Until the recorder's consumers delivered ``count`` messages and none is acked yet."""
    from kvctl.transports.jetstream import consumer_name

    async def pending() -> int:
        nc = await nats.connect(url)
        try:
            js = nc.jetstream()
            infos = [await js.consumer_info(stream, consumer_name(stream, p)) for p in partitions]
            return sum(i.num_ack_pending for i in infos)
        finally:
            await nc.close()

    deadline = time.monotonic() + 15
    while asyncio.run(asyncio.wait_for(pending(), 10)) < count:
        assert time.monotonic() < deadline, "the recorder did not receive the messages"
        time.sleep(0.05)


# --- a server restart mid-run --------------------------------------------------------------------


def test_a_server_restart_mid_run_loses_and_duplicates_nothing(tmp_path):
    from conftest import NatsServer, free_port

    port = free_port()
    store = tmp_path / "store"
    server = NatsServer(store, port=port)
    try:
        name = stream_name()
        layout = init_stream(server.url, name, 2)
        seqs = publish(server.url, layout, workload(workers=4, per_worker=20))
        out = tmp_path / "ds"
        dead = f"nats://127.0.0.1:{free_port()}"  # a server of the list that is down: failed over
        proc = start_kvctl(
            "record",
            f"{dead},{server.url}",
            "--stream",
            name,
            "-o",
            str(out),
            "--rotate-every",
            "1",
            "--idle-timeout",
            "25",
            drain=True,
        )
        wait_on_disk(out, name, seqs)
        server.stop()
        server = NatsServer(store, port=port)  # the same server back, its store kept
        seqs |= publish(server.url, layout, workload(workers=4, per_worker=20, start_seq=100))
        wait_on_disk(out, name, seqs)
        proc.send_signal(signal.SIGINT)
        rc, _, err = finish(proc)
        assert rc == 130, err
        assert "reconnect" in err
        on_disk = stream_seqs_on_disk(out, name, seqs)
        assert sorted(on_disk) == sorted(seqs) and len(on_disk) == len(set(on_disk))
    finally:
        server.stop()


def wait_on_disk(out: Path, stream: str, seqs: dict[int, int], timeout: float = 20) -> None:
    """Until the segments hold every message of ``seqs`` (segments appearing: no other sign)."""
    deadline = time.monotonic() + timeout
    while True:
        held = sum(footer(p)["messages"] for p, _ in segments_of(out, stream))
        if held >= len(seqs):
            return
        assert time.monotonic() < deadline, f"{held} of {len(seqs)} messages on disk"
        time.sleep(0.1)


def test_a_message_delivered_again_is_skipped_and_acked_once_its_segment_is_in_place(tmp_path):
    """Redelivery during a run (an ack wait that ran out): what a segment holds, or one being
    written, is skipped; its ack waits for that segment to be in place (acking it acks every
    earlier message of the partition)."""
    from kvctl.recording.partition_writer import DatasetWriter

    writer = DatasetWriter(str(tmp_path), "s", [0], 1)
    try:
        assert writer.resume_points() == {0: 0}
        for seq, (_, fm) in enumerate(workload(workers=1, per_worker=3), start=1):
            assert writer.add(0, seq, "kvctl.s.0.w0", fm.headers(), fm.body(), f"h{seq}") is None
        writer.cut(0)
        _, fm = workload(workers=1, per_worker=1)[0]
        writer.add(0, 2, "kvctl.s.0.w0", fm.headers(), fm.body(), "again")
        assert writer.tally.skipped == 1
        in_place = writer.completed(wait=True)
        assert [(c.segment.first, c.segment.last, c.handle) for c in in_place] == [(1, 3, "h3")]
        assert writer.pending_acks() == {0: "again"}
        assert writer.pending_acks() == {}
    finally:
        writer.close()


def test_a_second_recorder_of_a_partition_is_refused(nats_server, tmp_path):
    name = stream_name()
    init_stream(nats_server.url, name, 2)
    first = start_kvctl(
        "record", nats_server.url, "--stream", name, "--partition", "0/2", "-o", str(tmp_path)
    )
    try:
        read_until(first.stderr, "recording stream")
        second = record(nats_server.url, name, tmp_path / "other", "--partition", "0,1/2")
        assert second.code == 1, second.err
        assert "is another recorder reading partition 0?" in second.err
    finally:
        first.send_signal(signal.SIGINT)
        rc, _, err = finish(first)
    assert rc == 130, err


def test_deliveries_lost_in_transit_are_delivered_again_not_acked_away(nats_server):
    """A node or connection that dies loses messages the server already sent; with AckPolicy
    all, the next segment's ack would ack them too and they would never be recorded. The
    reader sees the jump in the consumer's delivery count, takes nothing after it, and makes
    the consumer again right after the last message it took: every stream seq arrives."""
    from kvctl.partitions import StreamLayout
    from kvctl.transports.jetstream import PartitionReader, consumer_name
    from kvctl.transports.nats import NatsOptions

    name = stream_name()
    init_stream(nats_server.url, name, 1)
    layout = StreamLayout(name, 1)

    async def publish_range(first: int, end: int) -> None:
        nc = await nats.connect(nats_server.url)
        js = nc.jetstream()
        for i in range(first, end):
            await js.publish(layout.publish_subject("w"), f"m{i}".encode())
        await nc.close()

    async def delivered_through() -> int:
        nc = await nats.connect(nats_server.url)
        info = await nc.jetstream().consumer_info(name, consumer_name(name, 0))
        await nc.close()
        return info.delivered.stream_seq

    said: list[str] = []
    reader = PartitionReader(
        nats_server.url, NatsOptions(), name, {0: layout.partition_subject(0)}, 300, said.append
    )
    try:
        reader.connect()
        reader.position(0, 0)
        reader.start()
        asyncio.run(publish_range(0, 30))
        got: list[Any] = []
        deadline = time.monotonic() + 10
        while len(got) < 30 and time.monotonic() < deadline:
            got += reader.receive(0.2)
        assert [d.stream_seq for d in got] == list(range(1, 31))
        # ten deliveries never reach the reader: its inbox's sink is taken away meanwhile
        sid, sink = next(iter(reader.nc.raw_sinks.items()))
        reader.loop.call_soon_threadsafe(reader.nc.raw_sinks.pop, sid)
        asyncio.run(publish_range(30, 40))
        deadline = time.monotonic() + 10
        while asyncio.run(delivered_through()) < 40:
            assert time.monotonic() < deadline, "the server did not deliver"
            time.sleep(0.05)  # polling the consumer: no signal for "sent to a client"
        reader.loop.call_soon_threadsafe(reader.nc.raw_sinks.__setitem__, sid, sink)
        asyncio.run(publish_range(40, 50))
        deadline = time.monotonic() + 15
        while (not got or got[-1].stream_seq < 50) and time.monotonic() < deadline:
            got += reader.receive(0.2)
        assert sorted({d.stream_seq for d in got}) == list(range(1, 51)), said
        assert any("did not arrive" in line for line in said), said
        assert reader.ack(got[-1].handle)
    finally:
        reader.close()
