"""One bytes-hash rule: a bytes hash becomes the integer vLLM itself sends for it, and every
encoder that writes integers (SGLang, seed, Dynamo JSON, envelope and event plane) gives one
block the same id."""

from __future__ import annotations

import pytest
from conftest import removed, stored
from hypothesis import given
from hypothesis import strategies as st

from kvctl.events import U64_MASK, bytes_hash_to_int, signed_hash, unsigned_hash
from kvctl.formats import decode_nats, decode_zmq, encoding_named, format_names
from kvctl.formats.codec import NatsEncoding, ZmqEncoding
from kvctl.formats.dynamo import encode_event_plane
from kvctl.formats.engine_zmq import encode_frames, encode_payload
from kvctl.targets import ZmqTarget

I63, U64 = 1 << 63, 1 << 64
hash_bytes = st.binary(min_size=0, max_size=64)
hash_ints = st.integers(min_value=-I63, max_value=U64 - 1)


def vllm_int_hash(hash_bytes: bytes) -> int:
    """vLLM's maybe_convert_block_hash (vllm/v1/core/kv_cache_utils.py), verbatim."""
    return int.from_bytes(hash_bytes, byteorder="big") & ((1 << 64) - 1)


@given(hash_bytes)
def test_a_bytes_hash_becomes_vllms_int(value: bytes) -> None:
    assert bytes_hash_to_int(value) == unsigned_hash(value) == vllm_int_hash(value)
    assert unsigned_hash(bytearray(value)) == vllm_int_hash(value)


@given(hash_bytes)
def test_the_signed_view_of_a_bytes_hash_is_the_same_64_bits(value: bytes) -> None:
    signed = signed_hash(value)
    assert -I63 <= signed < I63
    assert signed & U64_MASK == unsigned_hash(value)


@given(hash_ints)
def test_int_hashes_keep_their_64_bits_in_both_views(value: int) -> None:
    unsigned, signed = unsigned_hash(value), signed_hash(value)
    assert 0 <= unsigned < U64 and -I63 <= signed < I63
    assert unsigned == value & U64_MASK == signed & U64_MASK
    assert unsigned_hash(signed) == unsigned and signed_hash(unsigned) == signed


@given(
    st.one_of(
        st.integers(min_value=U64),
        st.integers(max_value=-I63 - 1),
        st.booleans(),
        st.none(),
        st.floats(allow_nan=False),
        st.text(max_size=8),
    )
)
def test_what_is_no_64_bit_hash_is_left_for_check_to_flag(value: object) -> None:
    assert unsigned_hash(value) is value
    assert signed_hash(value) is value


def test_the_last_8_bytes_count_not_the_first() -> None:
    value = bytes(range(32))  # first and last 8 bytes differ
    assert unsigned_hash(value) == int.from_bytes(value[24:], "big")
    assert signed_hash(value) == int.from_bytes(value[24:], "big", signed=True)


def _decoded_events(name: str, events: list[dict]) -> list[dict]:
    """``events`` as a consumer reads them back from the bytes ``--format name`` writes
    (Dynamo's envelope also through the ZMQ event plane)."""
    enc = encoding_named(name)
    if isinstance(enc, ZmqEncoding):
        frames = encode_frames(b"", 0, enc.payload(events, 1.0, 0, "0.22"))
        batches = [decode_zmq(frames, "tcp://x")]
    else:
        assert isinstance(enc, NatsEncoding)
        messages = enc.messages(events, 7, 0, 0, 0, 1000)
        batches = [decode_nats("s.kv-events", data, "nats://x") for data in messages]
        if name == "dynamo":
            batches += [decode_zmq(encode_event_plane(data, 7, 0), "tcp://x") for data in messages]
    for batch in batches:
        assert batch.error is None, batch.error
    return [event for batch in batches for event in batch.events]


def test_one_bytes_hash_replays_to_one_id_in_every_format_that_carries_ints() -> None:
    parent, first, second = (bytes([n]) * 24 + bytes(range(n, n + 8)) for n in (1, 2, 3))
    events = [stored([first, second], parent=parent), removed([second])]
    carrying_ints = []
    for name in format_names():
        decoded = _decoded_events(name, events)
        head = decoded[0]  # the first block stored (SGLang stores one block per event)
        if type(head["block_hashes"][0]) is bytes:  # vLLM sends the bytes it was given
            assert (head["block_hashes"][0], head["parent_block_hash"]) == (first, parent)
            continue
        carrying_ints.append(name)
        assert unsigned_hash(head["block_hashes"][0]) == vllm_int_hash(first), name
        assert unsigned_hash(head["parent_block_hash"]) == vllm_int_hash(parent), name
        last = decoded[-1]  # the removal
        assert last["type"] == "BlockRemoved"
        assert [unsigned_hash(h) for h in last["block_hashes"]] == [vllm_int_hash(second)], name
    assert {"sglang", "seed", "dynamo", "dynamo-json"} <= set(carrying_ints)


@pytest.mark.parametrize("name", ["sglang", "seed"])
def test_a_zmq_target_sends_the_same_id_for_a_bytes_hash(name: str) -> None:
    block = bytes(range(32))
    batch = decode_zmq(encode_frames(b"", 0, encode_payload([stored([block])], 1.0)), "tcp://x")
    target = ZmqTarget(f"inproc://hash-{name}", name)
    try:
        sent = decode_zmq(target.frames(batch, batch.events, 0), "tcp://x")
    finally:
        target.close()
    assert sent.error is None
    assert [unsigned_hash(h) for h in sent.events[0]["block_hashes"]] == [vllm_int_hash(block)]
