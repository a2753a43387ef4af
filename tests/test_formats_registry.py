"""The codec registry: every format is declared once, and detection, the ``--format`` choices,
the targets' encoders, check's known fields and the recording's frames recipes come from it."""

from __future__ import annotations

import dataclasses

import click
import msgpack
import pytest
from conftest import removed, stored

from kvctl import targets
from kvctl.checks import Checker
from kvctl.commands import simulate
from kvctl.events import REMOVED_ARRAY_FIELDS, STORED_ARRAY_FIELDS
from kvctl.formats import (
    CODECS,
    KNOWN_FIELDS,
    build_registry,
    codec_named,
    decode_nats,
    decode_zmq,
    dynamo,
    encoding_named,
    engine_zmq,
    format_names,
    frames_recipe,
    rebuild_frames,
)
from kvctl.formats.codec import NATS, ZMQ, NatsForm, ZmqEncoding, ZmqForm
from kvctl.options import target_options

EVENTS = [stored([11, 12], parent=10), removed([12]), {"type": "AllBlocksCleared"}]


def test_format_names_are_the_ones_users_type_in_help_order() -> None:
    assert format_names() == ("vllm", "vllm-array", "sglang", "seed", "dynamo", "dynamo-json")
    assert format_names(ZMQ) == ("vllm", "vllm-array", "sglang", "seed")
    assert format_names(NATS) == ("dynamo", "dynamo-json")
    assert ("raw", *format_names(ZMQ)) == targets.ZMQ_FORMATS
    assert format_names(NATS) == targets.NATS_FORMATS


def test_commands_offer_the_registry_formats() -> None:
    simulate_format = next(p for p in simulate.command.params if p.name == "encoding")
    assert tuple(simulate_format.type.choices) == format_names()

    sending = click.command()(target_options(lambda **options: None))
    replay_format = next(p for p in sending.params if p.name == "encoding")
    assert tuple(replay_format.type.choices) == ("raw", *format_names())
    layout = next(p for p in sending.params if p.name == "array_layout")
    assert tuple(layout.type.choices) == tuple(engine_zmq.ARRAY_LAYOUTS)
    assert layout.default == engine_zmq.DEFAULT_ARRAY_LAYOUT


def test_codecs_are_found_by_name_format_or_shape() -> None:
    assert codec_named("engine") is codec_named("sglang") is codec_named("engine-mixed")
    assert codec_named("dynamo") is codec_named("dynamo-json") is codec_named("dynamo-zmq")
    assert codec_named("dynamo") is dynamo.CODEC and codec_named("vllm") is engine_zmq.CODEC
    with pytest.raises(KeyError):
        codec_named("raw")  # sends recorded bytes: a target mode, not a format


def test_check_knows_the_fields_every_codec_declares() -> None:
    assert Checker().known_fields is KNOWN_FIELDS
    assert KNOWN_FIELDS == engine_zmq.KNOWN_FIELDS | dynamo.KNOWN_FIELDS
    assert {  # the list check kept before the registry: KV004 is unchanged
        "type",
        *STORED_ARRAY_FIELDS,
        *REMOVED_ARRAY_FIELDS,
        "locality",
        "ownership",
        "session_id",
        "lookahead_token_ids",
        "cache_salt",
        "worker_id",
        "dp_rank",
        "event_id",
        "tokens_hashes",
        "mm_extra_info",
        "storage_tier",
        "residency_domain",
        "start_position",
    } == KNOWN_FIELDS


@pytest.mark.parametrize("name", format_names())
def test_every_encoding_decodes_back_to_its_codec(name: str) -> None:
    enc = encoding_named(name)
    codec = codec_named(name)
    if isinstance(enc, ZmqEncoding):
        payload = enc.payload(EVENTS, 5.0, 1, "0.22")
        batches = [decode_zmq(engine_zmq.encode_frames(b"t", 3, payload), "tcp://x")]
        batches.append(decode_nats("relayed", payload, "nats://x"))
    else:
        batches = [decode_nats("s", m, "nats://x") for m in enc.messages(EVENTS, 7, 0, 1, 0, 5)]
    for batch in batches:
        assert batch.error is None, batch.error
        assert batch.format in codec.shapes
        assert {e["type"] for e in batch.events} <= {e["type"] for e in EVENTS}
        assert all(e.keys() <= codec.known_fields for e in batch.events)


def test_detection_names_every_shape_when_none_fits() -> None:
    assert decode_zmq([b"x"], "tcp://x").error == (
        "1 frames, expected 3 [topic, seq, payload] or 4 (Dynamo event plane)"
    )
    for data in (b"", b"\x00", b"x"):
        assert decode_nats("s", data, "nats://x").error == (
            "neither JSON, a Dynamo envelope nor an engine batch"
        )


def test_the_registry_refuses_a_second_claim() -> None:
    with pytest.raises(ValueError, match="two codecs claim the name 'engine'"):
        build_registry((engine_zmq.CODEC, engine_zmq.CODEC))

    def nothing(batch: object, data: object) -> None: ...

    grabs_four_frames = dataclasses.replace(
        dynamo.CODEC, name="other", shapes=(), encodings=(), nats=(), zmq=(ZmqForm(4, "", nothing),)
    )
    with pytest.raises(ValueError, match="ZMQ frame count 4"):
        build_registry((dynamo.CODEC, grabs_four_frames))
    grabs_arrays = dataclasses.replace(
        grabs_four_frames, zmq=(), nats=(NatsForm(frozenset({0x91}), "", nothing),)
    )
    with pytest.raises(ValueError, match="NATS data starting with 0x91"):
        build_registry((engine_zmq.CODEC, grabs_arrays))
    assert build_registry(CODECS).by_name.keys() == {"engine", "dynamo"}


# --- frames recipes: what a recording stores instead of frames it can rebuild -----------------


@pytest.mark.parametrize(
    ("name", "layout", "recipe"),
    [("vllm", "0.22", "zmq3"), ("vllm-array", "0.22", "zmq3"), ("vllm-array", "0.9", "zmq2")],
)
def test_canonical_engine_batches_rebuild_byte_for_byte(name: str, layout: str, recipe: str):
    payload = engine_zmq.encode_payload(EVENTS, 5.0, 1, name, layout)
    batch = decode_zmq(engine_zmq.encode_frames(b"kv@w@m", 9, payload), "tcp://x")
    assert frames_recipe(batch) == recipe
    assert rebuild_frames(recipe, batch) == batch.frames
    relayed = decode_nats("s", payload, "nats://x")
    assert frames_recipe(relayed) == "n" + recipe.replace("zmq", "ats")
    assert rebuild_frames(frames_recipe(relayed), relayed) == [payload]


def test_frames_no_recipe_rebuilds_are_kept() -> None:
    odd = msgpack.packb([5.0, [stored([1])], 0], use_single_float=True)  # float32 ts
    mixed = msgpack.packb([5.0, [stored([1]), ["BlockRemoved", [1]]], 0])
    envelope = dynamo.encode_envelope([dynamo.router_event(EVENTS[0], 1, 0)], 1, 0, 5)
    kept = [
        decode_zmq(engine_zmq.encode_frames(b"", 0, odd), "tcp://x"),
        decode_zmq(engine_zmq.encode_frames(b"", 0, mixed), "tcp://x"),
        decode_zmq([b"", b"\x00" * 8, b"\xc1"], "tcp://x"),  # malformed
        decode_nats("s", envelope, "nats://x"),
        decode_zmq(dynamo.encode_event_plane(envelope, 1, 0), "tcp://x"),
    ]
    assert [frames_recipe(batch) for batch in kept] == [None] * len(kept)
