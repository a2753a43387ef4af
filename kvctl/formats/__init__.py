"""Format detection: one transport message in, one :class:`~kvctl.events.Batch` out.

Detection is per message, so a source may switch formats (or mix producers) at any time.
Undecodable input never raises: the batch comes back with ``error`` set and the raw frames kept.
That includes values nested beyond :data:`~kvctl.events.MAX_DEPTH` (the bound the recording
layer applies too), and every publisher key a decoder sets is hashable (sequence tracking keys
on it).
"""

from __future__ import annotations

from ..errors import DecodeError
from ..events import MAX_DEPTH, Batch
from . import dynamo, engine_zmq

__all__ = ["decode_zmq", "decode_nats", "worker_from_topic"]


def worker_from_topic(topic: str) -> str | None:
    """llm-d publishes on ``kv@<pod-id>@<model-name>``: the pod is the worker."""
    if topic.startswith("kv@"):
        parts = topic.split("@", 2)
        if len(parts) == 3 and parts[1]:
            return parts[1]
    return None


def decode_zmq(
    frames: list[bytes],
    source: str,
    recv_ns: int = 0,
    worker_id: object = None,
    dp_rank: int | None = None,
) -> Batch:
    """Decode a ZMQ message: an engine batch (3 frames) or a Dynamo event-plane message (4)."""
    if len(frames) == 3:  # the hot path: a well-formed engine batch, built in one go
        topic_frame, seq_frame, payload = frames
        try:
            ts, events, payload_dp, shape = engine_zmq.decode_payload(payload)
            seq = engine_zmq.parse_seq(seq_frame)
        except DecodeError:
            pass  # the slow path below builds the error batch
        else:
            topic = topic_frame.decode("utf-8", "replace") if topic_frame else ""
            if worker_id is None and topic:
                worker_id = worker_from_topic(topic)
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
    try:
        if len(frames) == 3:
            topic = frames[0].decode("utf-8", "replace")
            batch.topic = topic
            batch.seq = engine_zmq.parse_seq(frames[1])
            batch.ts, batch.events, payload_dp, batch.format = engine_zmq.decode_payload(frames[2])
            if payload_dp is not None:
                batch.dp_rank = payload_dp
            if worker_id is None:
                batch.worker_id = worker_from_topic(topic)
        elif len(frames) == 4:  # the event plane, whatever the topic (broker: the subject)
            batch.topic = frames[0].decode("utf-8", "replace")
            publisher_id, sequence, envelope = dynamo.unwrap_event_plane(frames)
            _fill_from_envelope(batch, envelope)
            batch.format = dynamo.EVENT_PLANE_FORM
            batch.publisher = (source, publisher_id)
            batch.seq = sequence
        else:
            raise DecodeError(
                f"{len(frames)} frames, expected 3 [topic, seq, payload] or 4 (Dynamo event plane)"
            )
    except DecodeError as exc:
        batch.error = str(exc)
        batch.events = []
    except RecursionError:  # any step that recursed to Python's limit met nesting far too deep
        batch.error = f"a value nests deeper than {MAX_DEPTH} levels"
        batch.events = []
    return batch


def decode_nats(subject: str, data: bytes, source: str, recv_ns: int = 0) -> Batch:
    """Decode a NATS message: Dynamo JSON RouterEvent, Dynamo >= 1.0 envelope, or an engine
    batch payload relayed as is."""
    batch = Batch(
        source=source,
        events=[],
        format="unknown",
        topic=subject,
        recv_ns=recv_ns,
        frames=[data],
        publisher=(source, subject),
    )
    try:
        first = data[:1]
        if first in (b"{", b"[", b" ", b"\n", b"\t", b"\r"):
            batch.events = dynamo.decode_json(data)
            batch.format = dynamo.JSON_FORM
            _worker_from_events(batch)
        elif first and (0x80 <= first[0] <= 0x8F or first[0] in (0xDE, 0xDF)):
            _fill_from_envelope(batch, data)
        elif first and (0x90 <= first[0] <= 0x9F or first[0] in (0xDC, 0xDD)):
            batch.ts, batch.events, batch.dp_rank, batch.format = engine_zmq.decode_payload(data)
        else:
            raise DecodeError("neither JSON, a Dynamo envelope nor an engine batch")
    except DecodeError as exc:
        batch.error = str(exc)
        batch.events = []
    except RecursionError:  # any step that recursed to Python's limit met nesting far too deep
        batch.error = f"a value nests deeper than {MAX_DEPTH} levels"
        batch.events = []
    return batch


def _fill_from_envelope(batch: Batch, envelope: bytes) -> None:
    header, batch.events = dynamo.decode_envelope(envelope)
    batch.format = dynamo.ENVELOPE_FORM
    publisher_id, sequence = header.get("publisher_id"), header.get("sequence")
    if isinstance(sequence, int):
        batch.seq = sequence
        batch.publisher = (batch.source, publisher_id)
    published_at = header.get("published_at")
    if isinstance(published_at, (int, float)):  # within TS_RANGE: decode_envelope checked
        batch.ts = published_at / 1000.0
    _worker_from_events(batch)


def _worker_from_events(batch: Batch) -> None:
    if batch.events:
        first = batch.events[0]
        batch.worker_id = first.get("worker_id")
        batch.dp_rank = first.get("dp_rank")
