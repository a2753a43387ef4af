"""NVIDIA Dynamo's router-side formats.

- RouterEvent as JSON (Dynamo <= 0.9, NATS core or JetStream);
- the msgpack envelope of Dynamo >= 1.0 (NATS core), whose payload is an array of RouterEvents;
- the Dynamo ZMQ event plane (>= 1.0): 4 frames ``[topic, publisher_id, sequence, frame]``
  with ``frame = 0x01 || u32 BE length || envelope``; the topic is ``kv-events`` (direct mode)
  or the full subject (broker mode), so the message is recognised by its frames.

A RouterEvent becomes one canonical event: ``stored`` -> BlockStored (``block_hashes`` from the
blocks' ``block_hash``, ``tokens_hashes`` from their ``tokens_hash``), ``removed`` ->
BlockRemoved, ``"cleared"`` -> AllBlocksCleared; ``worker_id``, ``dp_rank``, ``event_id``,
``storage_tier`` and every key this module does not know are kept on the event.

:data:`CODEC` declares the three to the registry (:mod:`kvctl.formats`): ``--format dynamo``
writes the envelope, ``--format dynamo-json`` the JSON RouterEvents.
"""

from __future__ import annotations

import json
import reprlib
import struct
from collections.abc import Iterable, Sequence
from typing import Any

import msgpack
import xxhash

from ..errors import DecodeError
from ..events import (
    ALL_BLOCKS_CLEARED,
    BLOCK_REMOVED,
    BLOCK_STORED,
    MAX_DEPTH,
    TS_RANGE,
    Batch,
    Event,
    field_type_error,
    kind_of,
    unsigned_hash,
)
from .codec import Codec, NatsEncoding, NatsForm, ZmqForm
from .engine_zmq import unpack

TOKENS_HASH_SEED = 1337
EVENT_PLANE_TOPIC = b"kv-events"
EVENT_PLANE_VERSION = 1

JSON_FORM, ENVELOPE_FORM, EVENT_PLANE_FORM = "dynamo-json", "dynamo-msgpack", "dynamo-zmq"


def tokens_hash(tokens: Iterable[int], lora_name: str | None = None) -> int:
    """Dynamo's LocalBlockHash: xxh3_64 over u32-LE token ids, seed 1337 (+ LoRA name hash)."""
    seed = TOKENS_HASH_SEED
    if lora_name:
        seed = (seed + xxhash.xxh3_64_intdigest(lora_name.encode(), seed=0)) & ((1 << 64) - 1)
    tokens = list(tokens)
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(tokens)}I", *tokens), seed=seed)


# --- decoding ---------------------------------------------------------------------------------


def router_event_to_event(obj: Any) -> Event:
    if not isinstance(obj, dict) or not isinstance(obj.get("event"), dict):
        raise DecodeError("RouterEvent must be a map with an 'event' map")
    inner = obj["event"]
    data = inner.get("data")
    event: Event
    if data == "cleared" or (isinstance(data, dict) and "cleared" in data):
        event = {"type": ALL_BLOCKS_CLEARED}
    elif isinstance(data, dict) and isinstance(data.get("stored"), dict):
        stored = data["stored"]
        blocks = stored.get("blocks")
        if not isinstance(blocks, list) or not all(isinstance(b, dict) for b in blocks):
            raise DecodeError("stored event without a 'blocks' array of maps")
        event = {
            "type": BLOCK_STORED,
            "block_hashes": [b.get("block_hash") for b in blocks],
            "parent_block_hash": stored.get("parent_hash"),
            "token_ids": None,
            "block_size": None,
            "lora_id": None,
            "lora_name": stored.get("lora_name"),
            "medium": None,
            "tokens_hashes": [b.get("tokens_hash") for b in blocks],
        }
        mm = [b.get("mm_extra_info") for b in blocks]
        if any(m is not None for m in mm):
            event["mm_extra_info"] = mm
        _add_extras(event, stored, ("blocks", "parent_hash", "lora_name"), "stored")
        per_block: dict[str, list[Any]] = {}
        for block in blocks:
            for key in block:  # in the order sent, so every run names fields alike
                if key in _BLOCK_FIELDS:
                    continue
                if type(key) is not str:
                    raise DecodeError(
                        f"stored block has a {type(key).__name__} key, expected field names"
                    )
                values = per_block.get(key)
                if values is None:
                    values = per_block[key] = []
                    if "block_" + key in event:
                        raise DecodeError(
                            f"stored block field {_short(key)} collides with"
                            f" the stored field {_short('block_' + key)}"
                        )
                    event["block_" + key] = values
                values.append(block[key])
    elif isinstance(data, dict) and isinstance(data.get("removed"), dict):
        removed = data["removed"]
        hashes = removed.get("block_hashes")
        if not isinstance(hashes, list):
            raise DecodeError("removed event without a 'block_hashes' array")
        event = {"type": BLOCK_REMOVED, "block_hashes": hashes, "medium": None}
        _add_extras(event, removed, ("block_hashes",), "removed")
    else:
        # text as sent; anything else through reprlib: bounded in length and depth
        shown = data[:60] if type(data) is str else _short(data)
        raise DecodeError(f"RouterEvent data is not stored/removed/cleared: {shown}")
    event["event_id"] = inner.get("event_id")
    event["worker_id"] = obj.get("worker_id")
    event["dp_rank"] = inner.get("dp_rank")
    _add_extras(event, inner, ("data", "event_id", "dp_rank"), "event")
    _add_extras(event, obj, ("event", "worker_id"), "RouterEvent")
    return event


_BLOCK_FIELDS = frozenset({"block_hash", "tokens_hash", "mm_extra_info"})
_DERIVED = frozenset(
    {
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "lora_name",
        "medium",
        "tokens_hashes",
        "mm_extra_info",
        "event_id",
        "worker_id",
        "dp_rank",
    }
)
"""Fields of the canonical event that kvctl derives from a RouterEvent's own structure."""


def _add_extras(event: Event, source: dict[Any, Any], skip: tuple[str, ...], where: str) -> None:
    """Keep every field of ``source`` kvctl does not translate on ``event``. A field named like
    one kvctl derives (``type``, ``block_hashes``, ...) or one kept from another level would
    silently replace it (a stored event turned into a ``Gap``): the message is malformed."""
    for key, value in source.items():
        if key in skip:
            continue
        if key in _DERIVED or key in event:
            raise DecodeError(
                f"{where} field {_short(key)} collides with a field kvctl"
                " derives or keeps from another level"
            )
        event[key] = value


_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxlevel, _SHORT_REPR.maxstring, _SHORT_REPR.maxother = 3, 40, 40
_short = _SHORT_REPR.repr

TOO_DEEP = f"nests deeper than {MAX_DEPTH} levels"


def decode_json(payload: bytes) -> list[Event]:
    """A JSON RouterEvent (or an array of them)."""
    try:
        obj = json.loads(payload)
    except RecursionError:  # the parser recursed to Python's limit: far beyond MAX_DEPTH
        raise DecodeError(f"JSON {TOO_DEEP}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise DecodeError(f"not JSON: {exc}") from None
    objs = obj if isinstance(obj, list) else [obj]
    return _router_events(objs)


_INT_OR_NIL = frozenset({int, type(None)})
_ROUTER_INTS = ("worker_id", "dp_rank", "event_id")
"""RouterEvent fields Dynamo sends as integers (u64 worker and event ids, u32 dp rank): they key
per-worker state, so a list or map there would be a key nobody can use."""


def _router_events(objs: list[Any]) -> list[Event]:
    """RouterEvents -> canonical events; a known field of a type Dynamo never sends, or a value
    nested beyond :data:`~kvctl.events.MAX_DEPTH`, makes the message undecodable, with the
    event and field named."""
    events = [router_event_to_event(o) for o in objs]
    for i, event in enumerate(events):
        problem = field_type_error(event)
        if problem is None and not (
            type(event["worker_id"]) in _INT_OR_NIL
            and type(event["dp_rank"]) in _INT_OR_NIL
            and type(event["event_id"]) in _INT_OR_NIL
        ):
            key = next(k for k in _ROUTER_INTS if type(event[k]) not in _INT_OR_NIL)
            problem = f"{key} is {kind_of(event[key])}, expected int or nil"
        if problem is not None:
            raise DecodeError(f"event {i} ({event['type']}): {problem}")
    return events


_NUMBER_OR_NIL = frozenset({int, float, type(None)})
_PUBLISHED_AT_MIN, _PUBLISHED_AT_MAX = (ts * 1000 for ts in TS_RANGE)
_ENVELOPE_HEADER = (
    ("publisher_id", _INT_OR_NIL, "int"),
    ("sequence", _INT_OR_NIL, "int"),
    ("published_at", _NUMBER_OR_NIL, "number"),
)
"""Envelope header fields kvctl reads, with the types Dynamo sends (nil: absent). The publisher
id keys sequence tracking, so it must be something a key can be made of."""


def _unpack(payload: bytes, what: str) -> Any:
    """The engine decoder's msgpack (msgspec): the same values for the same bytes on every
    path (extension values as maps, timestamps as datetimes), so a recording keeps them."""
    try:
        return unpack(payload)
    except DecodeError as exc:
        raise DecodeError(f"{what}: {exc}") from None


def decode_envelope(payload: bytes) -> tuple[dict[str, Any], list[Event]]:
    """A Dynamo >= 1.0 msgpack envelope; returns (envelope header, events)."""
    env = _unpack(payload, "envelope")
    if not isinstance(env, dict) or not isinstance(env.get("payload"), bytes):
        raise DecodeError("Dynamo envelope must be a map with a binary 'payload'")
    get = env.get
    if not (
        type(get("publisher_id")) in _INT_OR_NIL
        and type(get("sequence")) in _INT_OR_NIL
        and type(get("published_at")) in _NUMBER_OR_NIL
    ):
        for key, types, expected in _ENVELOPE_HEADER:
            value = get(key)
            if type(value) not in types:
                raise DecodeError(f"envelope {key} is {kind_of(value)}, expected {expected} or nil")
    published_at = get("published_at")
    if published_at is not None and not _PUBLISHED_AT_MIN <= published_at <= _PUBLISHED_AT_MAX:
        raise DecodeError(
            f"envelope published_at {published_at!r} is not a time (ms since the"
            " epoch, years 1-9999)"
        )  # the comparison is also false for NaN
    inner = _unpack(env["payload"], "envelope payload")
    objs = inner if isinstance(inner, list) else [inner]
    header = {k: v for k, v in env.items() if k != "payload"}
    return header, _router_events(objs)


def unwrap_event_plane(frames: list[bytes]) -> tuple[int, int, bytes]:
    """Split a 4-frame event-plane message into (publisher_id, sequence, envelope bytes).

    Recognised by its frames, whatever the topic: a publisher that binds its own PUB (direct
    mode) sends ``kv-events``, one behind the broker (``DYN_ZMQ_BROKER_URL``) the full subject
    ``namespace.{ns}.component.{comp}.endpoint.{ep}.kv-events`` (Dynamo's EventPublisher hands
    its ZMQ transport the topic in direct mode and the subject in broker mode)."""
    if len(frames) != 4:
        raise DecodeError(f"{len(frames)} frames, a Dynamo event-plane message has 4")
    if len(frames[1]) != 8 or len(frames[2]) != 8:
        raise DecodeError(
            f"4 frames, but publisher_id/sequence frames are {len(frames[1])}"
            f" and {len(frames[2])} bytes, expected 8 (Dynamo event plane)"
        )
    frame = frames[3]
    if len(frame) < 5 or frame[0] != EVENT_PLANE_VERSION:
        raise DecodeError(f"event-plane frame has unknown version byte {frame[:1].hex()}")
    (length,) = struct.unpack_from(">I", frame, 1)
    if length != len(frame) - 5:
        raise DecodeError(f"event-plane frame says {length} bytes, carries {len(frame) - 5}")
    return int.from_bytes(frames[1], "big"), int.from_bytes(frames[2], "big"), frame[5:]


def decode_json_message(batch: Batch, data: bytes) -> None:
    """Fill ``batch`` from a NATS message holding JSON RouterEvents."""
    batch.events = decode_json(data)
    batch.format = JSON_FORM
    _worker_from_events(batch)


def decode_envelope_message(batch: Batch, envelope: bytes) -> None:
    """Fill ``batch`` from a Dynamo >= 1.0 envelope: its events, and the publisher, sequence
    and publishing time its header gives."""
    header, batch.events = decode_envelope(envelope)
    batch.format = ENVELOPE_FORM
    publisher_id, sequence = header.get("publisher_id"), header.get("sequence")
    if isinstance(sequence, int):
        batch.seq = sequence
        batch.publisher = (batch.source, publisher_id)
    published_at = header.get("published_at")
    if isinstance(published_at, (int, float)):  # within TS_RANGE: decode_envelope checked
        batch.ts = published_at / 1000.0
    _worker_from_events(batch)


def decode_event_plane(batch: Batch, frames: list[bytes]) -> None:
    """Fill ``batch`` from a 4-frame event-plane message (whatever the topic: in broker mode it
    is the subject); its sequence counts within the publisher id of its frames."""
    batch.topic = frames[0].decode("utf-8", "replace")
    publisher_id, sequence, envelope = unwrap_event_plane(frames)
    decode_envelope_message(batch, envelope)
    batch.format = EVENT_PLANE_FORM
    batch.publisher = (batch.source, publisher_id)
    batch.seq = sequence


def _worker_from_events(batch: Batch) -> None:
    if batch.events:
        first = batch.events[0]
        batch.worker_id = first.get("worker_id")
        batch.dp_rank = first.get("dp_rank")


# --- encoding ---------------------------------------------------------------------------------


def router_event(
    event: Event,
    worker_id: int,
    event_id: int,
    dp_rank: int = 0,
    era: str = "1.6",
) -> dict[str, Any]:
    """Build a RouterEvent map from a canonical event, as Dynamo ``era`` shapes it:
    ``"1.6"`` (>= 1.2: ``storage_tier``, ``residency_domain``, ``start_position``,
    ``mm_extra_info``), ``"0.9"`` (0.6-0.9: ``dp_rank``, nothing newer) or ``"0.5"`` (no
    ``dp_rank``). ``tokens_hash`` is computed from ``token_ids`` unless the event carries
    ``tokens_hashes``."""
    modern = era == "1.6"
    etype = event["type"]
    if etype == BLOCK_STORED:
        hashes = [unsigned_hash(h) for h in event.get("block_hashes") or ()]
        tokens = event.get("token_ids") or []
        size = event.get("block_size") or (len(tokens) // len(hashes) if hashes else 0)
        lora = event.get("lora_name")
        given = event.get("tokens_hashes")
        blocks = []
        for i, h in enumerate(hashes):
            th = given[i] if given else tokens_hash(tokens[i * size : (i + 1) * size], lora)
            block: dict[str, Any] = {"block_hash": h, "tokens_hash": th}
            if modern:
                block["mm_extra_info"] = None
            blocks.append(block)
        parent = event.get("parent_block_hash")
        stored: dict[str, Any] = {
            "parent_hash": unsigned_hash(parent) if parent is not None else None
        }
        if modern:
            stored["start_position"] = event.get("start_position")
        stored["blocks"] = blocks
        data: Any = {"stored": stored}
    elif etype == BLOCK_REMOVED:
        data = {
            "removed": {"block_hashes": [unsigned_hash(h) for h in event.get("block_hashes") or ()]}
        }
    else:
        data = "cleared"
    out: dict[str, Any] = {"worker_id": worker_id}
    if modern:
        out["storage_tier"] = event.get("storage_tier") or "device"
        out["residency_domain"] = event.get("residency_domain") or "worker"
    out["event"] = {"event_id": event_id, "data": data}
    if era != "0.5":
        out["event"]["dp_rank"] = dp_rank
    return out


def encode_json(router_event_map: dict[str, Any]) -> bytes:
    """Dynamo 0.7-0.9: one JSON RouterEvent per NATS message."""
    return json.dumps(router_event_map, separators=(",", ":")).encode()


def encode_envelope(
    router_events: list[dict[str, Any]], publisher_id: int, sequence: int, published_at_ms: int
) -> bytes:
    """Dynamo >= 1.0: msgpack envelope holding a msgpack array of RouterEvents."""
    return msgpack.packb(
        {
            "publisher_id": publisher_id,
            "sequence": sequence,
            "published_at": published_at_ms,
            "topic": "kv-events",
            "payload": msgpack.packb(router_events),
        }
    )


def encode_event_plane(
    envelope: bytes, publisher_id: int, sequence: int, topic: bytes = EVENT_PLANE_TOPIC
) -> list[bytes]:
    """The 4 frames of an event-plane message; ``topic`` is ``kv-events`` in direct mode, the
    full subject through the broker."""
    frame = bytes([EVENT_PLANE_VERSION]) + struct.pack(">I", len(envelope)) + envelope
    return [topic, publisher_id.to_bytes(8, "big"), sequence.to_bytes(8, "big"), frame]


def _envelope_messages(
    events: Sequence[Event],
    worker_id: int,
    first_event_id: int,
    dp_rank: int,
    sequence: int,
    published_at_ms: int,
) -> list[bytes]:
    """Dynamo >= 1.2 on core NATS: one envelope per batch, RouterEvents shaped as 1.6's."""
    routers = [
        router_event(e, worker_id, first_event_id + i, dp_rank, "1.6") for i, e in enumerate(events)
    ]
    return [encode_envelope(routers, worker_id, sequence, published_at_ms)]


def _json_messages(
    events: Sequence[Event],
    worker_id: int,
    first_event_id: int,
    dp_rank: int,
    sequence: int,
    published_at_ms: int,
) -> list[bytes]:
    """Dynamo 0.7-0.9 on JetStream: one JSON RouterEvent (0.9's shape) per event."""
    return [
        encode_json(router_event(e, worker_id, first_event_id + i, dp_rank, "0.9"))
        for i, e in enumerate(events)
    ]


# --- the codec --------------------------------------------------------------------------------

KNOWN_FIELDS = _DERIVED | {"storage_tier", "residency_domain", "start_position"}
"""The fields a RouterEvent becomes, and the RouterEvent fields of Dynamo >= 1.2 kept as they
come (any other kept field is one kvctl does not know)."""

_JSON_START = frozenset(b"{[ \n\t\r")
_MSGPACK_MAP = frozenset({*range(0x80, 0x90), 0xDE, 0xDF})

CODEC = Codec(
    name="dynamo",
    shapes=(JSON_FORM, ENVELOPE_FORM, EVENT_PLANE_FORM),
    known_fields=KNOWN_FIELDS,
    zmq=(ZmqForm(4, "4 (Dynamo event plane)", decode_event_plane),),
    nats=(
        NatsForm(_JSON_START, "JSON", decode_json_message),
        NatsForm(_MSGPACK_MAP, "a Dynamo envelope", decode_envelope_message),
    ),
    encodings=(
        NatsEncoding("dynamo", _envelope_messages),
        NatsEncoding("dynamo-json", _json_messages, jetstream=True),
    ),
)
