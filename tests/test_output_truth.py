"""Output that never lies: pretty output shows every value literally (rich markup escaped),
64-bit hashes survive readers that parse JSON numbers as doubles (``--hash-format string``),
and events whose known fields carry types no producer sends are malformed everywhere."""

from __future__ import annotations

import io
import json

import msgpack
import pytest
from conftest import stored
from hypothesis import given, settings
from hypothesis import strategies as st
from inprocess import run_main, run_while

from kvctl.events import Batch
from kvctl.formats import decode_zmq
from kvctl.formats.dynamo import encode_envelope, encode_event_plane, router_event
from kvctl.formats.engine_zmq import encode_frames, encode_payload
from kvctl.output import Output, PrettySink
from kvctl.recording.reader import open_recording
from kvctl.recording.writer import RecordingWriter

T0_NS = 1_700_000_000_000_000_000
HEX_HASH = 0xD0326374B3AA55EE  # shown as "d0326374b3…": a rich tag unless escaped
BIG = 2**64 - 12_345  # above 2^53: a double cannot hold it


def write_recording(path, frames_list: list[list[bytes]]) -> None:
    writer = RecordingWriter(path)
    for i, frames in enumerate(frames_list):
        writer.write(decode_zmq(frames, "tcp://127.0.0.1:5557", T0_NS + i))
    writer.close()


def kvctl_in_process(*args: str) -> tuple[int, str]:
    """Exit code and stdout of one in-process kvctl run (stderr apart)."""
    result = run_main(*args)
    return result.code, result.out


# --- pretty output escapes markup ------------------------------------------------------------


def test_cat_pretty_hex_hashes_appear(tmp_path):
    path = tmp_path / "run.parquet"
    write_recording(
        path,
        [
            encode_frames(
                b"",
                0,
                encode_payload(
                    [
                        stored(
                            [HEX_HASH, 0xABCDEF0123456789],
                            parent=0xFEEDFACE00000001,
                            lora_name="[bold]x",
                            lora_id=1,
                        )
                    ],
                    1.0,
                    0,
                ),
            )
        ],
    )
    code, out = kvctl_in_process("cat", str(path), "--hash-format", "hex")
    assert code == 0, out
    assert "2 blocks [d0326374b3… abcdef0123…]" in out
    assert "parent=feedface00…" in out and "lora=[bold]x" in out
    assert "· 1 event\n" in out  # the batch header counts in English


@pytest.mark.parametrize("command", ["stats", "top", "check"])
def test_a_producers_type_that_looks_like_markup_is_shown_literally(tmp_path, command):
    """Event types are the producer's text: on stderr (summary, findings) they are shown as
    sent, never parsed as rich markup (a stray closing tag crashed the summary line)."""
    path = tmp_path / "run.parquet"
    write_recording(
        path,
        [encode_frames(b"", 0, encode_payload([{"type": "[/oops]", "block_hashes": [1]}], 1.0, 0))],
    )
    result = run_main(command, str(path))
    assert result.code == 0, result.err
    assert "Traceback" not in result.err and "([/oops] 1)" in result.err, result.err


def test_tap_pretty_hex_hashes_appear(engine):
    def send() -> None:
        engine.wait_for()
        engine.send([stored([HEX_HASH], parent=None)], topic=b"[red]topic[/]")

    rc, out, err = run_while(send, "tap", engine.endpoint, "-c", "1", "--hash-format", "hex")
    assert rc == 0, err
    assert "1 block [d0326374b3…]" in out and "topic=[red]topic[/]" in out


printable = st.text(alphabet="ab[]/\\:=#@ bold", min_size=1, max_size=20)
field_values = st.one_of(
    printable,
    st.sampled_from(["[bold]", "[/]", "\\", "[/bold]x\\", ":thumbs_up:", "[link=x]y[/link]"]),
)


@settings(max_examples=150, deadline=None)
@given(
    lora=field_values,
    medium=field_values,
    extra=field_values,
    source=field_values,
    topic=field_values,
    worker=field_values,
    error=field_values,
)
def test_any_text_value_is_shown_literally(lora, medium, extra, source, topic, worker, error):
    event = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": [1],
        "block_size": 1,
        "lora_id": None,
        "lora_name": lora,
        "medium": medium,
        "note": extra,
    }
    batch = Batch(
        source=source, events=[event], format="engine-map", topic=topic, seq=1, worker_id=worker
    )
    sink = Output().events_sink()
    assert isinstance(sink, PrettySink)
    sink.console.file = out = io.StringIO()
    sink.write(batch, batch.events)
    text = out.getvalue()
    for value in (lora, medium, f"note={extra}", source, f"topic={topic}", f"worker={worker}"):
        assert value in text, (value, text)
    diagnostics = Output()
    diagnostics.console.file = err = io.StringIO()
    diagnostics.malformed(
        Batch(source=source, events=[], format="unknown", error=error, frames=[b"x"])
    )
    assert f"from {source}: {error} [1 bytes" in err.getvalue()


def test_malformed_error_text_is_shown_literally(engine):
    """A Dynamo RouterEvent whose data is "[bold]x": the decoder's error quotes it."""
    env = encode_envelope([{"worker_id": 1, "event": {"event_id": 0, "data": "[bold]x"}}], 1, 0, 0)

    def send() -> None:
        engine.wait_for()
        engine.send_raw(encode_event_plane(env, 1, 0))

    rc, out, err = run_while(send, "tap", engine.endpoint, "--idle-timeout", "1")
    assert rc == 0, err
    assert "not stored/removed/cleared: [bold]x" in err


# --- 64-bit hashes as decimal strings ----------------------------------------------------------


def test_hash_format_string_round_trips_above_2_53(tmp_path):
    path = tmp_path / "run.parquet"
    dynamo_event = router_event(stored([BIG - 1], parent=BIG - 2), 7, 0)
    dynamo_event["event"]["data"]["stored"]["blocks"][0]["tokens_hash"] = BIG - 3
    write_recording(
        path,
        [
            encode_frames(b"", 0, encode_payload([stored([BIG, -2], parent=BIG - 4)], 1.0, 0)),
            encode_event_plane(encode_envelope([dynamo_event], 42, 0, 1_000), 42, 0),
        ],
    )
    code, out = kvctl_in_process("cat", str(path), "--json", "--hash-format", "string")
    assert code == 0, out
    engine_row, dynamo_row = (json.loads(line) for line in out.splitlines())
    assert engine_row["block_hashes"] == [str(BIG), str(2**64 - 2)]  # -2 sent signed: u64
    assert engine_row["parent_block_hash"] == str(BIG - 4)
    assert dynamo_row["block_hashes"] == [str(BIG - 1)]
    assert dynamo_row["parent_block_hash"] == str(BIG - 2)
    assert dynamo_row["tokens_hashes"] == [str(BIG - 3)]
    assert int(engine_row["block_hashes"][0]) == BIG  # exact, whatever parses the JSON
    # The default (unsigned JSON numbers) is exact JSON too, but a reader that holds numbers
    # as IEEE doubles (jq, JavaScript) turns it into another hash:
    code, out = kvctl_in_process("cat", str(path), "--json")
    default = json.loads(out.splitlines()[0])["block_hashes"][0]
    assert default == BIG and int(float(default)) != BIG
    # pretty output takes the style too, harmlessly
    code, out = kvctl_in_process("cat", str(path), "--hash-format", "string")
    assert code == 0 and "1844674407…" in out


# --- types no producer sends are malformed in tap, record and check ---------------------------


def bad_batch(seq: int) -> list[bytes]:
    return [
        b"",
        seq.to_bytes(8, "big"),
        msgpack.packb(
            [
                1.0,
                [
                    {
                        "type": "BlockStored",
                        "block_hashes": "d0326374",
                        "parent_block_hash": None,
                        "token_ids": [1, 2],
                        "block_size": 2,
                    }
                ],
                0,
            ]
        ),
    ]


WHY = "event 0 (BlockStored): block_hashes is a str, expected an array of int or bytes"


def test_tap_shows_a_wrong_typed_event_as_malformed(engine):
    def send() -> None:
        engine.wait_for()
        engine.send_raw(bad_batch(0))
        engine.send([stored([5])], seq=1)

    rc, out, err = run_while(send, "tap", engine.endpoint, "--json", "--idle-timeout", "1")
    assert rc == 0, err
    assert [json.loads(line)["block_hashes"] for line in out.splitlines()] == [[5]]
    assert WHY in err and "malformed 1" in err


def test_record_keeps_it_malformed_and_check_reports_kv001(engine, tmp_path):
    path = tmp_path / "run.parquet"

    def send() -> None:
        engine.wait_for()
        engine.send([stored([5])], seq=0)
        engine.send_raw(bad_batch(1))

    rc, _, err = run_while(
        send, "record", engine.endpoint, "-o", str(path), "--idle-timeout", "1.5", timeout=60
    )
    assert rc == 0, err
    batches = list(open_recording(path))
    assert [b.error for b in batches] == [None, WHY]
    assert batches[1].frames == bad_batch(1) and batches[1].events == []  # raw frames kept
    result = run_main("check", str(path), "--json")
    report = json.loads(result.out)
    rules = {r["id"]: r for r in report["rules"]}
    assert result.code == 3 and set(rules) == {"KV001"}, rules
    assert WHY in rules["KV001"]["examples"][0]["message"]


# --- Dynamo's event plane behind the broker -----------------------------------------------------


def test_tap_reads_the_event_plane_behind_a_broker(engine):
    """Through DYN_ZMQ_BROKER_URL the topic frame is the full subject; tap keeps it."""
    subject = b"namespace.dynamo.component.backend.endpoint.generate.kv-events"
    env = encode_envelope([router_event(stored([BIG]), 7, 0)], 42, 3, 1_700_000_000_000)

    def send() -> None:
        engine.wait_for()
        engine.send_raw(encode_event_plane(env, 42, 3, subject))

    rc, out, err = run_while(
        send, "tap", engine.endpoint, "--json", "-c", "1", "--hash-format", "string"
    )
    assert rc == 0, err
    (row,) = (json.loads(line) for line in out.splitlines())
    assert (row["format"], row["topic"], row["seq"]) == ("dynamo-zmq", subject.decode(), 3)
    assert row["block_hashes"] == [str(BIG)] and row["worker_id"] == 7


def test_older_recordings_with_wrong_types_still_read_and_check(tmp_path):
    """Recordings of kvctl versions before the decoders checked types may hold such events:
    cat shows them (literally) and check reports them under KV002/KV206."""
    path = tmp_path / "old.parquet"
    writer = RecordingWriter(path)
    event = {
        "type": "BlockStored",
        "block_hashes": "[bold]d03",
        "parent_block_hash": 1.5,
        "token_ids": {"a": 1},
        "block_size": 2,
    }
    writer.write(
        Batch(
            source="tcp://old:5557",
            events=[event],
            format="engine-map",
            seq=0,
            ts=1.0,
            recv_ns=T0_NS,
            frames=[b"", bytes(8), b"\x93"],
        )
    )
    writer.close()
    code, out = kvctl_in_process("cat", str(path))
    assert code == 0 and "blocks=[bold]d03" in out and "tokens={'a': 1}" in out, out
    result = run_main("check", str(path), "--json")
    rules = {r["id"] for r in json.loads(result.out)["rules"]}
    assert {"KV002", "KV206"} <= rules and "KV001" not in rules, rules
