"""What a wire format declares to the registry (:mod:`kvctl.formats`): one :class:`Codec` per
format module, built from the plain data classes below so that the registry can index them once
at import and dispatch a message without asking every codec in turn.

A decoder *fills* a :class:`~kvctl.events.Batch` that the registry built with the transport's
metadata (source, topic, receive time, raw frames) and raises
:class:`~kvctl.errors.DecodeError` when the message is not what it claims to be; the registry
turns that into a malformed batch. Encoders are pure too: events in, bytes out; the targets
(:mod:`kvctl.targets`) keep the per-socket and per-worker counters and move the bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from ..events import Batch, Event

ZMQ, NATS = "zmq", "nats"
"""The transports an encoding writes for."""


@dataclass(frozen=True, slots=True)
class ZmqForm:
    """A ZMQ message shape, recognised by its number of frames (the only thing every ZMQ
    message has before anything is decoded)."""

    frames: int
    expected: str
    """How the error for a message with another frame count names this shape, e.g.
    ``3 [topic, seq, payload]``."""
    decode: Callable[[Batch, list[bytes]], None]


@dataclass(frozen=True, slots=True)
class NatsForm:
    """A NATS message shape, recognised by the first byte of its data (JSON text, a msgpack
    map, a msgpack array, ...)."""

    first_bytes: frozenset[int]
    what: str
    """How the error for unrecognised data names this shape, e.g. ``JSON``."""
    decode: Callable[[Batch, bytes], None]


@dataclass(frozen=True, slots=True)
class ZmqEncoding:
    """A ``--format`` that sends engine-style ZMQ batches ``[topic, seq, payload]``: the codec
    builds the payload, the target the topic and the seq."""

    name: str
    payload: Callable[[Iterable[Event], float | None, int | None, str], bytes]
    """``(events, ts, dp_rank, array_layout) -> payload``."""


@dataclass(frozen=True, slots=True)
class NatsEncoding:
    """A ``--format`` that publishes on NATS: one batch becomes one or more messages."""

    name: str
    messages: Callable[[Sequence[Event], int, int, int, int, int], list[bytes]]
    """``(events, worker_id, first_event_id, dp_rank, sequence, published_at_ms) -> data``
    of each message, in order."""
    jetstream: bool = False
    """Published into a JetStream stream (acked, kept) rather than on core NATS."""


Encoding = ZmqEncoding | NatsEncoding


@dataclass(frozen=True, slots=True)
class Codec:
    """One wire format: what users call it, what it recognises and decodes, what it writes and
    which event fields it knows."""

    name: str
    shapes: tuple[str, ...]
    """The ``Batch.format`` values its decoders produce (``engine-map``, ``dynamo-json``...)."""
    known_fields: frozenset[str]
    """Every event field its producers send: ``check`` reports any other (KV004)."""
    zmq: tuple[ZmqForm, ...] = ()
    nats: tuple[NatsForm, ...] = ()
    encodings: tuple[Encoding, ...] = ()
    """The ``--format`` names it writes, in the order ``--help`` lists them."""
    frames_recipe: Callable[[Batch], str | None] | None = None
    """The name of a recipe that rebuilds a decoded batch's frames byte for byte from its
    decoded values (so a recording need not keep the raw bytes), or ``None``."""
    rebuild_frames: Callable[[str, Batch], list[bytes]] | None = None
    """Runs a recipe :attr:`frames_recipe` named, on a batch read back from a recording."""
    recipes: tuple[str, ...] = ()
    """The recipe names :attr:`frames_recipe` gives (stored in recordings: never renamed)."""
