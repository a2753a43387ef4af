"""The converter's typed decoder (``Decoder.typed_items``: vLLM map-form payloads decoded by
msgspec into Structs, rows built from their columns) writes exactly the rows the tolerant path
(every message through ``decode_zmq``) writes, and the recording gives back the bytes received.
Hypothesis drives it with payloads at and across every edge the Structs check: near-vLLM shapes,
values one past each column's range, keys missing, added, repeated or reordered, odd
timestamps and dp ranks, labels standing in for them."""

from __future__ import annotations

import random
from typing import Any

import msgpack
import pyarrow as pa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvctl.formats import decode_zmq
from kvctl.formats.engine_zmq import encode_frames, encode_payload
from kvctl.recording.convert import Decoder
from kvctl.recording.journal import JOURNAL_SCHEMA, RowBuffer, message_fields
from kvctl.recording.rebuild import record_batch_to_batches
from kvctl.recording.rows import batches_to_record_batch

VLLM_STORED = (
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
)

# Values at and just past the edges of the typed columns (and of what msgpack can carry).
hashes = st.one_of(
    st.integers(0, 2**64 - 1),
    st.sampled_from([0, 2**63 - 1, 2**63, 2**64 - 1, -1, -(2**63)]),
    st.booleans(),
    st.binary(max_size=3),
    st.none(),
)
token = st.one_of(st.integers(0, 200_000), st.sampled_from([0, 2**32 - 1, 2**32, -1, True]))
small_int = st.one_of(
    st.integers(-5, 40), st.sampled_from([-(2**31) - 1, -(2**31), 2**31 - 1, 2**31])
)
long_int = st.one_of(
    st.none(), st.integers(-3, 3), st.sampled_from([-(2**63), 2**63 - 1, 2**63, 2**64 - 1])
)
LABELS = [(None, None), ("w1", 2), (7, None)]  # the recorder's worker and dp rank labels
text = st.one_of(st.none(), st.sampled_from(["GPU", "CPU_TIER1", "", "é"]), st.integers(0, 2))


@st.composite
def stored(draw: Any) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": draw(st.lists(st.integers(0, 2**64 - 1), max_size=4)),
        "parent_block_hash": draw(st.one_of(st.none(), st.integers(0, 2**64 - 1))),
        "token_ids": draw(st.lists(st.integers(0, 150_000), max_size=8)),
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


@st.composite
def event(draw: Any) -> Any:
    kind = draw(st.sampled_from(["stored", "removed", "cleared", "odd"]))
    if kind == "removed":
        ev: Any = {"type": "BlockRemoved", "block_hashes": draw(st.lists(hashes, max_size=3))}
        ev["medium"] = draw(text)
    elif kind == "cleared":
        ev = {"type": "AllBlocksCleared"}
    else:
        ev = draw(stored())
    if kind == "odd":  # one thing changed, at an edge
        change = draw(st.sampled_from(["value", "drop", "add", "swap", "type", "array"]))
        if change == "value":
            key = draw(st.sampled_from(VLLM_STORED[1:]))
            ev[key] = draw(
                {
                    "block_hashes": st.lists(hashes, max_size=3),
                    "parent_block_hash": hashes,
                    "token_ids": st.one_of(st.lists(token, max_size=3), st.none()),
                    "block_size": small_int,
                    "lora_id": long_int,
                    "medium": text,
                    "lora_name": text,
                }[key]
            )
        elif change == "drop":
            del ev[draw(st.sampled_from(VLLM_STORED))]
        elif change == "add":
            ev[draw(st.sampled_from(["group_idx", "extra_keys", "tokens_hashes", "x"]))] = 1
        elif change == "swap":
            ev = dict(reversed(ev.items()))
        elif change == "type":
            ev["type"] = draw(st.sampled_from(["BlockRemoved", "Other", 7]))
        else:
            ev = list(ev.values())
    return ev


@st.composite
def message(draw: Any, seq: int) -> tuple[list[bytes], Any, Any]:
    events = draw(st.lists(event(), max_size=3))
    ts = draw(
        st.one_of(
            st.just(1.7e9 + seq),
            st.sampled_from([1_700_000_000, float("nan"), float("inf"), 1e15, -1.0]),
        )
    )
    dp = draw(st.one_of(st.sampled_from([0, 1, None]), st.sampled_from([True, 2**63, -1])))
    body: list[Any] = [ts, events, dp] if draw(st.booleans()) else [ts, events]
    payload = msgpack.packb(body, use_single_float=draw(st.integers(0, 9)) == 0)
    topic = draw(st.sampled_from([b"kv@pod-1@m", b"", b"t\xff"]))
    labels = draw(st.sampled_from(LABELS))
    return encode_frames(topic, seq, payload), *labels


def _journal(messages: list[tuple[list[bytes], Any, Any]]) -> pa.RecordBatch:
    buf = RowBuffer(labelled=True)
    for seq, (frames, worker, dp) in enumerate(messages):
        batch = decode_zmq(frames, "tcp://h:1", 10**18 + seq, worker, dp)
        buf.rows.append(message_fields(batch))
        buf.events.append(len(batch.events))
        buf.frames.append(batch.frames)
    return buf.build().rb


def _rows(rb: pa.RecordBatch) -> dict[str, list[Any]]:
    return {name: rb.column(name).to_pylist() for name in JOURNAL_SCHEMA.names}


def _tolerant(rb: pa.RecordBatch, raw_frames: str) -> pa.RecordBatch:
    decoder = Decoder({"raw_frames": raw_frames})
    return batches_to_record_batch(decoder.items(_rows(rb)), 0, raw_frames)


def _same_rows_and_bytes(rb: pa.RecordBatch, raw_frames: str) -> pa.RecordBatch:
    got = Decoder({"raw_frames": raw_frames}).convert(rb)
    want = _tolerant(rb, raw_frames)
    assert got.equals(want), (got.to_pydict(), want.to_pydict())
    rebuilt = [b.frames for b in record_batch_to_batches(got)]
    assert rebuilt == rb.column("frames").to_pylist()  # what cat and replay give back
    return got


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), st.sampled_from(["auto", "always"]))
def test_typed_and_tolerant_decoders_write_the_same_rows(data, raw_frames):
    n = data.draw(st.integers(1, 6))
    odd = data.draw(st.booleans())  # else every event a plain vLLM one: the typed path's
    messages = []
    for seq in range(n):
        if odd:
            messages.append(data.draw(message(seq)))
        else:
            events = data.draw(st.lists(stored(), max_size=3))
            payload = msgpack.packb([1.7e9 + seq, events, 0])
            messages.append((encode_frames(b"kv@pod-1@m", seq, payload), None, None))
    rb = _journal(messages)
    if not odd:
        assert Decoder({"raw_frames": raw_frames}).typed_items(_rows(rb)) is not None
    _same_rows_and_bytes(rb, raw_frames)


def test_vllm_batches_take_the_typed_path():
    rng = random.Random(5)
    messages = []
    for seq in range(300):
        events: list[dict[str, Any]] = []
        for _ in range(rng.randint(0, 4)):
            blocks = rng.randint(1, 4)
            hashes = [rng.getrandbits(64) for _ in range(blocks)]
            if rng.random() < 0.3:
                events.append({"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"})
            else:
                events.append(
                    {
                        "type": "BlockStored",
                        "block_hashes": hashes,
                        "parent_block_hash": rng.choice([None, rng.getrandbits(64)]),
                        "token_ids": [rng.randrange(150_000) for _ in range(16 * blocks)],
                        "block_size": 16,
                        "lora_id": rng.choice([None, 3]),
                        "medium": "GPU",
                        "lora_name": rng.choice([None, "adapter"]),
                    }
                )
        payload = encode_payload(events, 1.7e9 + seq, rng.choice([0, 1, None]))
        if rng.random() < 0.2:  # vLLM 0.9's [ts, events]
            payload = msgpack.packb(msgpack.unpackb(payload)[:2])
        messages.append((encode_frames(b"kv@pod-1@m", seq, payload), *rng.choice(LABELS)))
    rb = _journal(messages)
    assert Decoder({}).typed_items(_rows(rb)) is not None
    out = _same_rows_and_bytes(rb, "auto")
    codecs = out.column("frames_codec").to_pylist()
    assert {"zmq3", "zmq2"} <= set(codecs)  # frames left to their recipes: half the bytes
    assert None in codecs  # a label standing in for a null dp_rank: the frames are kept
    _same_rows_and_bytes(rb, "always")
