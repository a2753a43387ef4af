"""The converter's fast decoder (``Decoder.plain_items``, rows built ``typed_only``) writes
exactly the rows the tolerant path (every message through ``decode_zmq``) writes, on common
and on odd messages alike."""

from __future__ import annotations

import random
from typing import Any

import msgpack
import pyarrow as pa
import pytest

from kvctl.formats import decode_zmq
from kvctl.formats.engine_zmq import encode_frames, encode_payload
from kvctl.recording.convert import Decoder
from kvctl.recording.journal import JOURNAL_SCHEMA, RowBuffer, message_fields
from kvctl.recording.rows import batches_to_record_batch

ENCODINGS = ("vllm", "vllm-array", "sglang", "seed")


def _event(rng: random.Random) -> dict[str, Any]:
    r = rng.random()
    blocks = rng.randint(1, 3)
    if r < 0.6:
        return {
            "type": "BlockStored",
            "block_hashes": [rng.getrandbits(64) for _ in range(blocks)],
            "parent_block_hash": rng.choice([None, rng.getrandbits(64)]),
            "token_ids": [rng.randrange(150_000) for _ in range(4 * blocks)],
            "block_size": 4,
            "lora_id": rng.choice([None, 0, 3]),
            "medium": rng.choice([None, "GPU", "CPU_TIER1"]),
            "lora_name": rng.choice([None, "adapter"]),
        }
    if r < 0.9:
        hashes = [rng.getrandbits(64) for _ in range(blocks)]
        return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}
    return {"type": "AllBlocksCleared"}


# Payloads a tolerant decoder must see: each is malformed, or holds an event the typed columns
# cannot take as it is, or is encoded in a way no recipe rebuilds.
ODD_PAYLOADS = [
    msgpack.packb([1.7e9, [{"type": "BlockStored", "block_hashes": [-5, 2**63 + 1]}], 0]),
    msgpack.packb([1.7e9, [{"type": "BlockStored", "token_ids": [1, True, 2]}], 0]),
    msgpack.packb([1.7e9, [{"type": "BlockStored", "token_ids": [1, -1]}], 0]),
    msgpack.packb([1.7e9, [{"type": "BlockStored", "token_ids": [2**32]}], 0]),
    msgpack.packb([1.7e9, [{"type": "BlockStored", "token_ids": [[1, 2], [3, 4]]}], 0]),
    msgpack.packb([1.7e9, [{"type": "BlockStored", "block_hashes": [b"x" * 32]}], 0]),
    msgpack.packb([1.7e9, [{"type": "BlockStored", "block_size": 2**40}], 0]),
    msgpack.packb([1.7e9, [{"type": "BlockStored", "lora_name": 5}], 0]),
    msgpack.packb([1.7e9, [{"type": "BlockStored", "group_idx": 1, "x": {"a": [1]}}], 0]),
    msgpack.packb([1.7e9, [{"type": "BlockStored", "block_hashes": [-5, 6]}], 0]),
    msgpack.packb([1.7e9, [{"type": "BlockStored", "tokens_hashes": [1, None]}], 0]),
    msgpack.packb([1.7e9, [{"type": 7}], 0]),
    msgpack.packb([1.7e9, [["BlockRemoved", [1, 2], "GPU"]], 0]),
    msgpack.packb([1.7e9, [{"type": "AllBlocksCleared"}], True]),
    msgpack.packb([1.7e9, [{"type": "AllBlocksCleared"}], 2**63 + 5]),
    msgpack.packb([1_700_000_000, [{"type": "AllBlocksCleared"}], 0]),
    msgpack.packb([float("nan"), [], 0]),
    msgpack.packb([1.7e9, []]),
    msgpack.packb([1.7e9, [], None]),
    msgpack.packb([1.7e9, {}, 0]),
    msgpack.packb({"ts": 1.7e9}),
    b"\x93\xcb",
    msgpack.packb([1.7e9, [{"type": "AllBlocksCleared"}], 0]) + b"\x00",
]


def _message(rng: random.Random, seq: int, odd: bool) -> list[bytes]:
    if odd and rng.random() < 0.25:
        payload = rng.choice(ODD_PAYLOADS)
    else:
        events = [_event(rng) for _ in range(rng.randint(0, 3))]
        payload = encode_payload(
            events, 1.7e9 + seq, rng.choice([0, 1, None]), rng.choice(ENCODINGS)
        )
        if rng.random() < 0.2:  # vLLM 0.9's [ts, events]
            payload = msgpack.packb(msgpack.unpackb(payload)[:2])
    topics = [b"kv@pod-1@m", b"", b"t\xff"] if odd else [b"kv@pod-1@m", b""]
    frames = encode_frames(rng.choice(topics), seq, payload)
    r = rng.random() if odd else 1.0
    if r < 0.03:
        return frames[:2]
    if r < 0.06:
        return [frames[0], b"\x01", frames[2]]
    return frames


def _journal_batch(rng: random.Random, n: int, odd: bool, cut: bool) -> pa.RecordBatch:
    buf = RowBuffer(labelled=True)
    for seq in range(n):
        batch = decode_zmq(
            _message(rng, seq, odd),
            rng.choice(["tcp://h:1", "tcp://h:2"]),
            10**18 + seq,
            rng.choice([None, "w1", 7]),
            rng.choice([None, 0, 2]),
        )
        batch.recovered = rng.random() < 0.1
        kept = len(batch.events)
        if cut and seq == n - 1 and kept:
            kept -= 1  # -c stopped in the middle of the last batch
        buf.rows.append(message_fields(batch))
        buf.events.append(kept)
        buf.frames.append(batch.frames)
    rb = buf.build().rb
    assert rb.schema.names == JOURNAL_SCHEMA.names
    return rb


def _tolerant(rb: pa.RecordBatch, raw_frames: str) -> pa.RecordBatch:
    decoder = Decoder({"raw_frames": raw_frames})
    rows = {name: rb.column(name).to_pylist() for name in JOURNAL_SCHEMA.names}
    return batches_to_record_batch(decoder.items(rows), 0, raw_frames)


@pytest.mark.parametrize("raw_frames", ["auto", "always"])
def test_fast_and_tolerant_decoders_write_the_same_rows(raw_frames):
    rng = random.Random(12)
    fast_slices = 0
    for round_ in range(300):
        odd = round_ % 3 != 0  # a third of the slices hold common messages only
        rb = _journal_batch(rng, rng.randint(1, 12), odd, cut=odd and rng.random() < 0.2)
        decoder = Decoder({"raw_frames": raw_frames})
        rows = {name: rb.column(name).to_pylist() for name in JOURNAL_SCHEMA.names}
        fast_slices += decoder.plain_items(rows) is not None
        got = decoder.convert(rb)
        want = _tolerant(rb, raw_frames)
        assert got.equals(want), (round_, got.to_pydict(), want.to_pydict())
    assert fast_slices > 20  # the fast decoder did take part


def test_common_engine_batches_take_the_fast_path():
    rng = random.Random(3)
    buf = RowBuffer(labelled=True)
    for seq in range(50):
        events = [_event(rng) for _ in range(3)]
        payload = encode_payload(events, 1.7e9 + seq, 0, "vllm")
        batch = decode_zmq(encode_frames(b"kv@pod-1@m", seq, payload), "tcp://h:1", seq)
        buf.rows.append(message_fields(batch))
        buf.events.append(len(batch.events))
        buf.frames.append(batch.frames)
    rb = buf.build().rb
    decoder = Decoder({})
    rows = {name: rb.column(name).to_pylist() for name in JOURNAL_SCHEMA.names}
    assert decoder.plain_items(rows) is not None
    out = decoder.convert(rb)
    assert out.equals(_tolerant(rb, "auto"))
    assert out.column("frames_codec").to_pylist()[0] == "zmq3"
