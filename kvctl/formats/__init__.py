"""The codec registry: every wire format kvctl reads and writes, and detection built from it.

Each wire format is one module of this package that declares a :class:`~.codec.Codec`: its
name, the ``Batch.format`` shapes it decodes to, how a message of it is recognised (a ZMQ frame
count, the first bytes of NATS data) and decoded, the ``--format`` names it encodes for and the
event fields it knows. :data:`CODECS` lists them; everything else is derived from it:
:func:`decode_zmq` and :func:`decode_nats` (detection, per message, so a source may switch
formats or mix producers at any time), the ``--format`` names of ``replay``, ``bridge`` and
``simulate`` (:func:`format_names`; ``kvctl/help.py`` writes them out so that ``--help``
imports no codec, and tests/test_formats_registry.py keeps the two equal), the targets'
encoders (:func:`encoding_named`), ``check``'s known fields (:data:`KNOWN_FIELDS`) and the
recipes a recording uses to rebuild frames it did not keep (:func:`frames_recipe`,
:func:`rebuild_frames`).

Adding a format:

1. Write ``kvctl/formats/<name>.py``: pure functions (bytes in, events out, and back) and a
   ``CODEC = Codec(...)`` naming them. A decoder fills the :class:`~kvctl.events.Batch` it is
   handed (events, ``format``, seq, ts, worker...) and raises :class:`~kvctl.errors.DecodeError`
   on a message it cannot read; an encoder is a :class:`~.codec.ZmqEncoding` (events -> the
   payload of ``[topic, seq, payload]``) or a :class:`~.codec.NatsEncoding` (events -> NATS
   messages).
2. Add the codec to :data:`CODECS`. The registry refuses, at import, a name, ``--format``,
   shape, frame count or first byte that another codec already claims.
3. Add ``tests/test_formats_<name>.py``: real messages of the producer decode to the canonical
   events, and what the encoders write decodes back to the same events.

Then add the new ``--format`` names to ``kvctl/help.py`` (the registry test says so if you
forget); the sentence of ``--help`` that describes each name in words (``target_options`` in
``kvctl/options.py``, ``kvctl/commands/simulate.py``) is prose to extend by hand.

Undecodable input never raises: the batch comes back with ``error`` set and the raw frames kept.
That includes values nested beyond :data:`~kvctl.events.MAX_DEPTH` (the bound the recording
layer applies too), and every publisher key a decoder sets is hashable (sequence tracking keys
on it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import DecodeError
from ..events import MAX_DEPTH, Batch
from . import dynamo, engine_zmq
from .codec import NATS, ZMQ, Codec, Encoding, NatsEncoding, NatsForm, ZmqEncoding, ZmqForm

__all__ = [
    "CODECS",
    "KNOWN_FIELDS",
    "REGISTRY",
    "Registry",
    "build_registry",
    "codec_named",
    "decode_nats",
    "decode_zmq",
    "encoding_named",
    "format_names",
    "frames_recipe",
    "rebuild_frames",
]

CODECS: tuple[Codec, ...] = (engine_zmq.CODEC, dynamo.CODEC)
"""Every wire format, in the order ``--help`` lists their ``--format`` names."""


@dataclass(frozen=True, slots=True)
class Registry:
    """The lookup tables detection and the commands use, built once from the codecs."""

    by_name: dict[str, Codec]
    encodings: dict[str, Encoding]
    """``--format`` name -> its encoder, in registry order."""
    by_format: dict[str, Codec]
    by_shape: dict[str, Codec]
    zmq_forms: dict[int, ZmqForm]
    """Frame count -> the ZMQ shape with that many frames."""
    nats_forms: list[NatsForm | None]
    """First byte of the data (0-255) -> the NATS shape that starts with it."""
    by_recipe: dict[str, Codec]


def build_registry(codecs: tuple[Codec, ...]) -> Registry:
    """Index ``codecs``; a second claim on any name, shape, frame count, first byte or recipe is
    a programming error, refused here rather than resolved by order at run time."""
    registry = Registry({}, {}, {}, {}, {}, [None] * 256, {})

    def claim(table: dict[Any, Any], key: object, value: object, what: str) -> None:
        if key in table:
            raise ValueError(f"two codecs claim the {what} {key!r}")
        table[key] = value

    for codec in codecs:
        claim(registry.by_name, codec.name, codec, "name")
        for enc in codec.encodings:
            claim(registry.encodings, enc.name, enc, "--format")
            registry.by_format[enc.name] = codec
        for shape in codec.shapes:
            claim(registry.by_shape, shape, codec, "batch format")
        for zmq_form in codec.zmq:
            claim(registry.zmq_forms, zmq_form.frames, zmq_form, "ZMQ frame count")
        for nats_form in codec.nats:
            for byte in nats_form.first_bytes:
                if registry.nats_forms[byte] is not None:
                    raise ValueError(f"two codecs claim NATS data starting with {byte:#04x}")
                registry.nats_forms[byte] = nats_form
        for recipe in codec.recipes:
            claim(registry.by_recipe, recipe, codec, "frames recipe")
    return registry


REGISTRY = build_registry(CODECS)
_ZMQ_FORMS = REGISTRY.zmq_forms
_NATS_FORMS = REGISTRY.nats_forms

KNOWN_FIELDS = frozenset().union(*(codec.known_fields for codec in CODECS))
"""Every event field some producer of some format sends: ``check`` reports any other (KV004)."""


def codec_named(name: str) -> Codec:
    """The codec called ``name``, or the one that writes ``--format name`` or decodes to the
    batch format ``name`` (``KeyError`` when none does)."""
    codec = (
        REGISTRY.by_name.get(name) or REGISTRY.by_format.get(name) or REGISTRY.by_shape.get(name)
    )
    if codec is None:
        raise KeyError(name)
    return codec


def encoding_named(name: str) -> Encoding:
    """The encoder behind ``--format name`` (``KeyError`` when no codec writes it)."""
    return REGISTRY.encodings[name]


def format_names(transport: str | None = None) -> tuple[str, ...]:
    """The ``--format`` names the codecs write (for click choices), all of them or those of
    one transport (:data:`~.codec.ZMQ` or :data:`~.codec.NATS`), in registry order."""
    kinds = {ZMQ: ZmqEncoding, NATS: NatsEncoding}
    wanted = kinds[transport] if transport is not None else (ZmqEncoding, NatsEncoding)
    return tuple(name for name, enc in REGISTRY.encodings.items() if isinstance(enc, wanted))


def frames_recipe(batch: Batch) -> str | None:
    """The recipe that rebuilds ``batch.frames`` byte for byte from its decoded values (a
    recording stores its name instead of the frames), or ``None``: keep the frames."""
    codec = REGISTRY.by_shape.get(batch.format)
    if codec is None or codec.frames_recipe is None:
        return None
    return codec.frames_recipe(batch)


def rebuild_frames(recipe: str, batch: Batch) -> list[bytes]:
    """The frames of a batch read back from a recording that stored ``recipe`` (a name
    :func:`frames_recipe` gave) instead of them."""
    rebuild = REGISTRY.by_recipe[recipe].rebuild_frames
    assert rebuild is not None  # a codec that names recipes rebuilds them
    return rebuild(recipe, batch)


_ZMQ_EXPECTED = " or ".join(_ZMQ_FORMS[n].expected for n in sorted(_ZMQ_FORMS))


def _nats_expected() -> str:
    """``neither A, B nor C``: the NATS shapes in the order of their first bytes."""
    forms = {id(f): f for f in _NATS_FORMS if f is not None}.values()
    whats = [f.what for f in sorted(forms, key=lambda f: min(f.first_bytes))]
    if len(whats) == 1:
        return f"not {whats[0]}"
    return f"neither {', '.join(whats[:-1])} nor {whats[-1]}"


_NATS_EXPECTED = _nats_expected()

# The engine codec's 3-frame batch is what nearly every message is: decode_zmq decodes it
# inline, with these bound once, and asks the registry only about any other message.
_decode_engine_payload = engine_zmq.decode_payload
_decode_typed = engine_zmq.decode_typed
_parse_seq = engine_zmq.parse_seq
_worker_from_topic = engine_zmq.worker_from_topic


def decode_zmq(
    frames: list[bytes],
    source: str,
    recv_ns: int = 0,
    worker_id: object = None,
    dp_rank: int | None = None,
    typed: bool = False,
) -> Batch:
    """Decode a ZMQ message: the codec that claims its frame count decodes it (an engine batch:
    3 frames, a Dynamo event-plane message: 4).

    ``typed``: the caller's consumers read :class:`~.engine_zmq.TypedEvent` events as well as
    event dicts (tap's JSON lines, the recorder's raw journal): a plain vLLM batch then takes
    the typed fast path (:func:`~.engine_zmq.decode_typed`), everything else is decoded as
    without it."""
    if len(frames) == 3:  # the hot path: a well-formed engine batch, built in one go
        topic_frame, seq_frame, payload = frames
        try:
            decoded = _decode_typed(payload) if typed else None
            ts, events, payload_dp, shape = decoded or _decode_engine_payload(payload)
            seq = _parse_seq(seq_frame)
        except DecodeError:
            pass  # the slow path below builds the error batch
        else:
            topic = topic_frame.decode("utf-8", "replace") if topic_frame else ""
            if worker_id is None and topic:
                worker_id = _worker_from_topic(topic)
            return Batch(
                source,
                events,
                shape,
                topic,
                seq,
                ts,
                recv_ns,
                worker_id,
                dp_rank if payload_dp is None else payload_dp,
                frames,
                None,
                False,
                source,
            )
    batch = Batch(
        source=source,
        events=[],
        format="unknown",
        recv_ns=recv_ns,
        worker_id=worker_id,
        dp_rank=dp_rank,
        frames=frames,
        publisher=source,
    )
    form = _ZMQ_FORMS.get(len(frames))
    try:
        if form is None:
            raise DecodeError(f"{len(frames)} frames, expected {_ZMQ_EXPECTED}")
        form.decode(batch, frames)
    except DecodeError as exc:
        batch.error = str(exc)
        batch.events = []
    except RecursionError:  # any step that recursed to Python's limit met nesting far too deep
        batch.error = f"a value nests deeper than {MAX_DEPTH} levels"
        batch.events = []
    return batch


def decode_nats(subject: str, data: bytes, source: str, recv_ns: int = 0) -> Batch:
    """Decode a NATS message: the codec that claims its first byte decodes it (Dynamo JSON
    RouterEvents, a Dynamo >= 1.0 envelope, or an engine batch payload relayed as is)."""
    batch = Batch(
        source=source,
        events=[],
        format="unknown",
        topic=subject,
        recv_ns=recv_ns,
        frames=[data],
        publisher=(source, subject),
    )
    form = _NATS_FORMS[data[0]] if data else None
    try:
        if form is None:
            raise DecodeError(_NATS_EXPECTED)
        form.decode(batch, data)
    except DecodeError as exc:
        batch.error = str(exc)
        batch.events = []
    except RecursionError:  # any step that recursed to Python's limit met nesting far too deep
        batch.error = f"a value nests deeper than {MAX_DEPTH} levels"
        batch.events = []
    return batch
