"""Where replay, bridge and simulate send batches: engine-style ZMQ publishers or Dynamo on
NATS, in any producer's format. Encoding happens here, through the pure codecs; the transports
only move the bytes. Which formats exist, and their encoders, come from the codec registry
(:mod:`kvctl.formats`)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack

from .errors import UsageError
from .events import U64_MASK, Batch, Event, bytes_hash_to_int
from .formats import dynamo, encoding_named, engine_zmq, format_names
from .formats.codec import ZMQ, NatsEncoding, ZmqEncoding
from .help import NATS_FORMATS, ZMQ_FORMATS

if TYPE_CHECKING:
    from .transports.nats import NatsOptions


@dataclass(frozen=True)
class Target:
    """Where and how a sending command sends (its target options): the ``--to`` URL, the
    format, the ZMQ socket layout and the Dynamo subject parts. The NATS credentials travel
    apart (``NatsOptions``), as every command that talks to NATS has them."""

    url: str
    encoding: str | None = None
    """None: the transport's default, ``vllm`` on ZMQ, ``dynamo`` on NATS (replay and bridge
    then send recorded engine bytes as they are, see :class:`Sender`)."""
    per_worker: bool = False
    """One PUB per worker on consecutive ports (``--port-per-worker``)."""
    keep_seq: bool = False
    worker_topics: str | None = None
    """The MODEL of topic ``kv@<worker>@MODEL``: every worker on one socket."""
    replay_port: int | None = None
    array_layout: str = engine_zmq.DEFAULT_ARRAY_LAYOUT
    hwm: int = 100_000
    namespace: str = "dynamo"
    component: str = "backend"
    dynamo_endpoint: str = "generate"
    wait_subscribers: int = 0
    """Hold the first batch until this many subscribers joined (ZMQ)."""
    linger: float = 0.0
    """Seconds the sockets (and replay ROUTERs) stay open after the end."""


def zmq_encoding(name: str) -> ZmqEncoding:
    found = encoding_named(name)
    assert isinstance(found, ZmqEncoding)  # the targets check the name against ZMQ_FORMATS
    return found


def nats_encoding(name: str) -> NatsEncoding:
    found = encoding_named(name)
    assert isinstance(found, NatsEncoding)  # NatsTarget checks the name against NATS_FORMATS
    return found


def subject_token(name: str) -> str:
    """Dynamo percent-encodes subject segments outside [A-Za-z0-9_-]."""
    return re.sub(
        r"[^A-Za-z0-9_-]", lambda m: "".join(f"%{b:02X}" for b in m.group().encode()), name
    )


def dynamo_subjects(namespace: str, component: str, endpoint: str) -> dict[str, str]:
    ns, comp, ep = map(subject_token, (namespace, component, endpoint))
    stream = f"namespace-{ns}-component-{comp}-kv-events".replace("_", "-")
    return {
        "dynamo": f"namespace.{ns}.component.{comp}.endpoint.{ep}.kv-events",  # >= 1.2
        "dynamo-json": f"{stream}.kv-events",  # 0.7-0.9 JetStream
        "stream": stream,
    }


def split_endpoint(endpoint: str) -> tuple[str, int | None]:
    """``tcp://HOST:PORT`` -> (``tcp://HOST``, PORT); other transports have no port."""
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint.rpartition(":")
        if sep and port.isdigit() and "//" in host:
            return host, int(port)
        raise UsageError(f"{endpoint}: expected tcp://HOST:PORT")
    return endpoint, None


def slot_key(batch: Batch) -> Any:
    """What tells the workers of a recording apart for ``--port-per-worker``."""
    return (batch.worker_id, batch.dp_rank) if batch.worker_id is not None else batch.source


def zmq_message(
    encoding: str,
    batch: Batch,
    events: list[Event],
    worker_topics: str | None,
    array_layout: str,
) -> tuple[bytes, bytes]:
    """The topic and payload frames of ``events`` of ``batch`` sent in ``encoding`` by an
    engine-style socket (the seq frame between them is the socket's). ``raw`` sends the
    recorded payload of an engine batch, or an engine payload relayed on NATS."""
    if worker_topics and batch.worker_id is not None:
        # llm-d's convention: consumers (kvctl tap too) read the worker from the topic
        topic = f"kv@{batch.worker_id}@{worker_topics}".encode()
    elif batch.topic and batch.format.startswith("engine"):
        topic = batch.topic.encode()
    else:
        topic = b""
    if encoding == "raw":
        if len(batch.frames) == 3 and batch.format.startswith("engine"):
            return (topic if worker_topics else batch.frames[0]), batch.frames[2]
        if len(batch.frames) == 1:  # an engine payload relayed on NATS
            return topic, batch.frames[0]
        raise UsageError(
            f"--format raw: a {batch.format} message from {batch.source} with"
            f" {len(batch.frames)} frames has no recorded payload to send"
        )
    ts = batch.ts if batch.ts is not None else time.time()
    return topic, zmq_encoding(encoding).payload(events, ts, batch.dp_rank, array_layout)


class ZmqTarget:
    """Engine-style PUB sockets that bind: one socket, or one per worker on consecutive ports
    (``port + i``, as vLLM does per DP rank). Each socket has its own seq from 0 unless
    ``keep_seq``; an optional replay ROUTER per socket on ``replay_port + i``. With
    ``worker_topics=MODEL`` every message carries the topic ``kv@<worker>@MODEL``, so several
    workers can share one socket and stay apart."""

    def __init__(
        self,
        endpoint: str,
        encoding: str = "vllm",
        per_worker: bool = False,
        keep_seq: bool = False,
        replay_port: int | None = None,
        array_layout: str = engine_zmq.DEFAULT_ARRAY_LAYOUT,
        buffer_steps: int = 10_000,
        worker_topics: str | None = None,
        flush_timeout: float = 5.0,
        hwm: int = 100_000,
        on_long_stall: Callable[[float], None] | None = None,
    ) -> None:
        if encoding not in ZMQ_FORMATS:
            raise UsageError(f"--format {encoding} is not a ZMQ format: {', '.join(ZMQ_FORMATS)}")
        self.base, self.port = split_endpoint(endpoint)
        if per_worker and self.port is None:
            raise UsageError("one socket per worker needs a tcp://HOST:PORT endpoint")
        self.endpoint = endpoint
        self.encoding = encoding
        self.per_worker = per_worker
        self.keep_seq = keep_seq
        self.replay_port = replay_port
        self.array_layout = array_layout
        self.buffer_steps = buffer_steps
        self.worker_topics = worker_topics
        self.flush_timeout = flush_timeout
        self.hwm = hwm
        self.on_long_stall = on_long_stall
        self.slots: dict[Any, int] = {}
        self.sockets: list[Any] = []
        self.seqs: list[int] = []
        self.replays: list[Any] = []
        self.bytes_sent = 0
        if not per_worker:
            self.socket(0)  # bind now: consumers may connect before the first batch

    def open_slots(self, count: int) -> list[str]:
        """Bind ``count`` sockets now (simulate knows its workers up front)."""
        return [self.socket(i).endpoint for i in range(count)]

    def socket(self, slot: int) -> Any:
        from .transports.zmq import Publisher, ReplayServer

        while len(self.sockets) <= slot:
            i = len(self.sockets)
            endpoint = self.endpoint if self.port is None else f"{self.base}:{self.port + i}"
            publisher = Publisher(endpoint, self.hwm, self.flush_timeout)
            publisher.on_long_stall = self.on_long_stall
            self.sockets.append(publisher)
            self.seqs.append(0)
            if self.replay_port is not None:
                host = self.base if self.port is not None else "tcp://127.0.0.1"
                self.replays.append(
                    ReplayServer(f"{host}:{self.replay_port + i}", self.buffer_steps)
                )
        return self.sockets[slot]

    def slot_for(self, batch: Batch) -> int:
        return self.slot_of(slot_key(batch)) if self.per_worker else 0

    def slot_of(self, key: Any) -> int:
        """The socket of a worker (:func:`slot_key`), the next one for a worker not seen yet."""
        slot = self.slots.get(key)
        if slot is None:
            slot = self.slots[key] = len(self.slots)
        return slot

    def open_for(self, batches: Any) -> None:
        """Bind the socket of every worker in ``batches`` up front (in order of appearance),
        so that subscribers can join before anything is sent."""
        for batch in batches:
            self.socket(self.slot_for(batch))

    def frames(self, batch: Batch, events: list[Event], slot: int) -> list[bytes]:
        if self.encoding == "raw" and not batch.format.startswith("engine"):
            return recorded_zmq_frames(batch)  # e.g. Dynamo's event plane: its seq is inside
        seq = self.next_seq(slot, batch.seq)
        topic, payload = zmq_message(
            self.encoding, batch, events, self.worker_topics, self.array_layout
        )
        return [topic, seq, payload]

    def next_seq(self, slot: int, recorded: int | None) -> bytes:
        """The seq frame of the socket's next message: its own count, or the recorded seq
        (``keep_seq``), which the count then follows."""
        seq = recorded if self.keep_seq and recorded is not None else self.seqs[slot]
        self.seqs[slot] = seq + 1
        return seq.to_bytes(8, "big")

    def write(self, batch: Batch, events: list[Event], slot: int | None = None) -> int:
        slot = self.slot_for(batch) if slot is None else slot
        sock = self.socket(slot)
        frames = self.frames(batch, events, slot)
        sock.send(frames)
        if self.replays and len(frames) == 3:  # the engine's ring holds engine batches only
            self.replays[slot].remember(int.from_bytes(frames[1], "big"), frames[0], frames[2])
        size = sum(map(len, frames))
        self.bytes_sent += size
        return size

    def wait_subscribers(self, count: int, timeout: float) -> bool:
        return all(s.wait_subscribers(count, timeout) for s in self.sockets)

    def service(self) -> None:
        """Answer pending replay requests (call between sends)."""
        for replay in self.replays:
            replay.serve_pending()

    def close(self) -> None:
        for s in self.sockets:
            s.close()
        for r in self.replays:
            r.close()

    def delivery(self) -> dict[str, Any]:
        """What the sockets saw of their subscribers (read after ``close``): counts at the
        first send, at the end and at the peak (summed over sockets), sockets that sent to
        nobody, back-pressure stalls, and whether the last queued batches were taken."""
        used = [s for s in self.sockets if s.subscribers_at_start is not None]
        return {
            "transport": "zmq",
            "sockets": len(self.sockets),
            "subscribers_at_start": sum(s.subscribers_at_start or 0 for s in used),
            "subscribers_at_end": sum(s.subscribers for s in self.sockets),
            "subscribers_peak": sum(s.peak_subscribers for s in self.sockets),
            "sockets_without_subscribers": sum(1 for s in used if s.peak_subscribers == 0),
            "stalls": sum(s.stalls for s in self.sockets),
            "stalled_s": round(sum(s.stalled_s for s in self.sockets), 3),
            "flushed": all(s.flushed is not False for s in self.sockets),
            "flush_timeout_s": self.flush_timeout,
        }


def from_nats(batch: Batch) -> bool:
    """The message came from a NATS subscription (one frame: the message data)."""
    return batch.source.startswith(("nats://", "tls://")) and len(batch.frames) == 1


def recorded_zmq_frames(batch: Batch) -> list[bytes]:
    """The frames of a ZMQ message exactly as they arrived (``--format raw``), or a usage
    error for a NATS message: it arrived as a subject and data, not as ZMQ frames, and
    inventing a framing for it would not be a replay of what was recorded."""
    if from_nats(batch):
        raise UsageError(
            f"--format raw replays ZMQ messages as they arrived; this recording holds NATS"
            f" messages ({batch.format} on {batch.topic or batch.source}): replay them --to"
            " nats://HOST:PORT, or re-encode for ZMQ with --format vllm"
        )
    if not batch.frames:
        raise UsageError(
            f"--format raw: a {batch.format} message from {batch.source} was"
            " recorded without its frames"
        )
    return batch.frames


class NatsTarget:
    """Dynamo on NATS: the >= 1.2 msgpack envelope on the core endpoint subject (``dynamo``), or
    0.7-0.9 JSON RouterEvents on the JetStream subject, stream created if needed
    (``dynamo-json``). Worker ids come from the batch (an int label) or are assigned per
    source in order of appearance."""

    def __init__(
        self,
        url: str,
        encoding: str = "dynamo",
        namespace: str = "dynamo",
        component: str = "backend",
        endpoint: str = "generate",
        subject: str | None = None,
        options: Any = None,
        notify: Callable[[str], None] | None = None,
    ) -> None:
        from .transports.nats import Publisher, split_nats_url

        if encoding not in NATS_FORMATS:
            raise UsageError(f"--format {encoding} is not a NATS format: {', '.join(NATS_FORMATS)}")
        servers, url_subject = split_nats_url(url)  # one server or a comma list
        subjects = dynamo_subjects(namespace, component, endpoint)
        self.subject = subject or url_subject or subjects[encoding]
        self.encoding = encoding
        self.encoder = nats_encoding(encoding)
        self.publisher = Publisher(servers, options, notify=notify)
        self.jetstream = self.encoder.jetstream
        self.stream = subjects["stream"] if self.jetstream else None
        if self.stream:
            self.publisher.ensure_stream(self.stream, [self.subject])
        self.worker_ids: dict[Any, int] = {}
        self.event_ids: dict[int, int] = {}
        self.sequences: dict[int, int] = {}
        self.bytes_sent = 0

    def worker_for(self, batch: Batch) -> int:
        wid = batch.worker_id
        if isinstance(wid, int) and not isinstance(wid, bool) and wid >= 0:
            return wid
        if isinstance(wid, str) and wid.isdigit():
            return int(wid)
        key = wid if wid is not None else batch.source
        return self.worker_ids.setdefault(key, len(self.worker_ids))

    def write(self, batch: Batch, events: list[Event], slot: int | None = None) -> int:
        worker = slot if slot is not None else self.worker_for(batch)
        dp_rank = batch.dp_rank or 0
        first_id = self.event_ids.get(worker, 0)
        self.event_ids[worker] = first_id + len(events)
        seq = self.sequences.get(worker, 0)
        self.sequences[worker] = seq + 1
        published = int((batch.ts if batch.ts is not None else time.time()) * 1000)
        size = 0
        for data in self.encoder.messages(events, worker, first_id, dp_rank, seq, published):
            self.publisher.publish(self.subject, data, jetstream=self.jetstream)
            size += len(data)
        self.bytes_sent += size
        return size

    def wait_subscribers(self, count: int, timeout: float) -> bool:
        return True  # NATS has no subscriber count for a publisher; JetStream keeps history

    def service(self) -> None:
        pass

    def close(self) -> None:
        self.publisher.close()

    def delivery(self) -> dict[str, Any]:
        """What the server took (read after ``close``): messages published, and with
        JetStream the acks of the stream and the publishes it refused."""
        from .redact import redact_url

        return {
            "transport": "nats",
            "server": redact_url(self.publisher.server),
            "subject": self.subject,
            "stream": self.stream,
            **self.publisher.counts(),
        }


def engine_payload(
    encoding: str, events: list[Event], ts: float | None, dp_rank: int | None, array_layout: str
) -> bytes:
    """The payload frame an engine's PUB socket sends for ``events`` in ``encoding``: vLLM's
    map form is packed directly when every event is already sent as it is (byte-identical to
    the encoder, without rebuilding each event)."""
    if encoding == "vllm" and all(map(engine_zmq.sent_as_vllm_sends_it, events)):
        return msgpack.packb([ts, events, dp_rank])
    return zmq_encoding(encoding).payload(events, ts, dp_rank, array_layout)


class RecordingTarget:
    """Engine batches written straight into a recording (no sockets): each worker's messages
    are encoded exactly as its PUB socket would send them, seq per worker from 0."""

    def __init__(
        self,
        path: str,
        encoding: str | None = None,
        array_layout: str = engine_zmq.DEFAULT_ARRAY_LAYOUT,
        metadata: dict[str, Any] | None = None,
        overwrite: bool = False,
    ) -> None:
        from .recording.writer import RecordingWriter

        encoding = encoding or "vllm"
        if encoding not in format_names(ZMQ):
            raise UsageError(
                f"--format {encoding} cannot be recorded directly; choose one of "
                f"{', '.join(format_names(ZMQ))}"
            )
        self.encoding = encoding
        self.array_layout = array_layout
        self.writer = RecordingWriter(path, metadata=metadata, overwrite=overwrite)
        self.seqs: dict[int, int] = {}
        self.bytes_sent = 0

    def write(self, batch: Batch, events: list[Event], slot: int = 0) -> int:
        seq = self.seqs.get(slot, 0)
        self.seqs[slot] = seq + 1
        payload = engine_payload(self.encoding, events, batch.ts, batch.dp_rank, self.array_layout)
        batch.frames = engine_zmq.encode_frames(b"", seq, payload)
        batch.seq = seq
        self.writer.write_message(batch, events)
        size = 8 + len(payload)
        self.bytes_sent += size
        return size

    def wait_subscribers(self, count: int, timeout: float) -> bool:
        return True

    def service(self) -> None:
        pass

    def close(self) -> dict[str, Any]:
        return self.writer.close()

    def delivery(self) -> None:
        return None  # a file: everything written is there


def open_target(
    to: Target,
    nats: NatsOptions | None = None,
    on_long_stall: Callable[[float], None] | None = None,
    notify: Callable[[str], None] | None = None,
) -> ZmqTarget | NatsTarget:
    """The target ``to`` names; the format defaults to ``vllm`` for ZMQ, ``dynamo`` for NATS.
    ``on_long_stall`` hears of a ZMQ subscriber holding the sends, ``notify`` of NATS outages."""
    if to.url.startswith(("nats://", "tls://")):
        return NatsTarget(
            to.url,
            to.encoding or "dynamo",
            namespace=to.namespace,
            component=to.component,
            endpoint=to.dynamo_endpoint,
            options=nats,
            notify=notify,
        )
    if to.url.startswith(("tcp://", "ipc://", "inproc://")):
        return ZmqTarget(
            to.url,
            to.encoding or "vllm",
            per_worker=to.per_worker,
            keep_seq=to.keep_seq,
            replay_port=to.replay_port,
            array_layout=to.array_layout,
            worker_topics=to.worker_topics,
            hwm=to.hwm,
            on_long_stall=on_long_stall,
        )
    from .redact import redact_url

    raise UsageError(
        f"--to {redact_url(to.url)}: expected tcp://HOST:PORT, ipc://PATH or "
        "nats://HOST:PORT[,nats://HOST:PORT...]"
    )


def salt_hashes(event: Event, salt: int) -> Event:
    """A copy of ``event`` whose block hashes (and parent, and Dynamo tokens_hashes) are XORed
    with ``salt``: distinct per loop, yet chains stay chained. Token ids are unchanged, so
    tokens_hashes are computed first and salted too (Dynamo's index keys on them)."""
    if salt == 0 or event.get("type") not in ("BlockStored", "BlockRemoved"):
        return event

    def mix(h: Any) -> Any:
        if isinstance(h, int):
            return (h & U64_MASK) ^ salt
        if isinstance(h, (bytes, bytearray)):  # its integer (the bytes-hash rule) is salted
            tail = (bytes_hash_to_int(h) ^ salt).to_bytes(8, "big")
            return bytes(h[:-8]) + tail
        return h

    out = dict(event)
    out["block_hashes"] = [mix(h) for h in event.get("block_hashes") or ()]
    if event.get("parent_block_hash") is not None:
        out["parent_block_hash"] = mix(event["parent_block_hash"])
    if event["type"] == "BlockStored":
        given = event.get("tokens_hashes")
        if not given and event.get("token_ids"):
            hashes = event["block_hashes"] or ()
            tokens = event["token_ids"]
            size = event.get("block_size") or (len(tokens) // len(hashes) if hashes else 0)
            given = [
                dynamo.tokens_hash(tokens[i * size : (i + 1) * size], event.get("lora_name"))
                for i in range(len(hashes))
            ]
        if given:
            out["tokens_hashes"] = [mix(h) for h in given]
    return out


def zmq_format_for(encoding: str | None, batch: Batch, as_recorded: bool) -> str:
    """The format a ZMQ target sends ``batch`` in: the one asked for, else the recorded bytes
    of an engine batch whose events are sent ``as_recorded``, else vLLM's."""
    return encoding or ("raw" if as_recorded and batch.format.startswith("engine") else "vllm")


def forwards_malformed(encoding: str | None, batch: Batch) -> bool:
    """A ZMQ target sends this malformed message's recorded frames (raw replay only; the
    default format sends those of ZMQ messages and skips NATS ones, ``--format raw`` refuses
    NATS ones, see :func:`recorded_zmq_frames`)."""
    return (
        encoding in (None, "raw")
        and bool(batch.frames)
        and (encoding == "raw" or not from_nats(batch))
    )


class Sender:
    """The sink side of replay and bridge: picks raw bytes or an encoder per batch, applies
    per-loop hash salting, sends through a target and counts what went out."""

    def __init__(self, target: Any, encoding: str | None, salt: int = 0) -> None:
        self.target = target
        self.encoding = encoding
        self.salt = salt
        self.batches = self.events = self.bytes = self.skipped = 0

    def write(self, batch: Batch, events: list[Event]) -> None:
        if self.salt:
            events = [salt_hashes(e, self.salt) for e in events]
        if isinstance(self.target, ZmqTarget):
            raw_ok = events is batch.events and not self.salt
            wanted = zmq_format_for(self.encoding, batch, raw_ok)
            if wanted == "raw" and not raw_ok:
                raise UsageError(
                    "--format raw sends recorded bytes unchanged: it cannot be "
                    "combined with filters, -c or --unique-hashes"
                )
            self.target.encoding = wanted
        self.bytes += self.target.write(batch, events)
        self.batches += 1
        self.events += len(events)
        self.target.service()

    def write_raw(self, batch: Batch) -> bool:
        """Send a malformed message's frames exactly as recorded, where the target takes
        them (:func:`forwards_malformed`); else count it as skipped."""
        if isinstance(self.target, ZmqTarget) and forwards_malformed(self.encoding, batch):
            frames = recorded_zmq_frames(batch)
            self.target.socket(self.target.slot_for(batch)).send(frames)
            self.bytes += sum(map(len, frames))
            self.batches += 1
            return True
        self.skipped += 1
        return False

    def send_prepared(self, rows: Any) -> None:
        """Send rows of a frames cache (see :func:`prepared_rows`) through the ZMQ target,
        counting as :meth:`write` and :meth:`write_raw` do: ready bytes only, nothing is
        decoded or encoded here. The rows are ``(when, seq, kind, events, key, topic,
        payload, extra)``; ``key`` matters only with one socket per worker."""
        target = self.target
        sockets, seqs, replays = target.sockets, target.seqs, target.replays
        keep_seq, per_worker = target.keep_seq, target.per_worker
        workers: dict[str, Any] = {}
        slot = 0
        for _, seq, kind, events, key, topic, payload, extra in rows:
            if per_worker and key is not None:
                worker = workers.get(key)
                if worker is None:
                    worker = workers[key] = worker_key(key)
                slot = target.slot_of(worker)
                if slot >= len(sockets):
                    target.socket(slot)
            if kind == SEND:
                number = seq if keep_seq and seq is not None else seqs[slot]
                seqs[slot] = number + 1
                sockets[slot].send([topic, number.to_bytes(8, "big"), payload])
                if replays:
                    replays[slot].remember(number, topic, payload)
                    target.service()
                size = len(topic) + 8 + len(payload)
                target.bytes_sent += size
                self.bytes += size
                self.batches += 1
                self.events += events
            elif kind != NOTHING:
                self._send_rare(kind, slot, events, extra)

    def _send_rare(self, kind: int, slot: int, events: int, extra: Any) -> None:
        target = self.target
        if kind == DECODED:  # as the pipeline hands it to replay's Sending consumer
            if extra.error is not None:
                self.write_raw(extra)
            elif extra.events or self.encoding == "raw":
                self.write(extra, extra.events)
            return
        if kind == SKIP:
            self.skipped += 1
            return
        if kind == REFUSED:
            raise UsageError(extra)
        target.socket(slot).send(extra)
        size = sum(map(len, extra))
        self.bytes += size
        self.batches += 1
        if kind == FORWARD:  # as ZmqTarget.write does
            if target.replays and len(extra) == 3:
                target.replays[slot].remember(int.from_bytes(extra[1], "big"), extra[0], extra[2])
            target.bytes_sent += size
            self.events += events
            target.service()

    def close(self) -> None:
        pass


# How replay's sender takes a prepared message (the ``kind`` of a frames-cache row,
# :mod:`kvctl.recording.frames`): exactly as :class:`Sender` would take the batch.
SEND = 0
"""``[topic, the socket's next seq frame, payload]``."""
FORWARD = 1
"""Its frames as recorded, through the target (a Dynamo event-plane message, raw)."""
MALFORMED = 2
"""A malformed message's frames as recorded (:meth:`Sender.write_raw`)."""
SKIP = 3
"""A malformed message the target does not take (counted as skipped)."""
NOTHING = 4
"""A batch without events: nothing is sent (its place in the schedule stays)."""
REFUSED = 5
"""A usage error once it is reached (what ``--format raw`` cannot send)."""
DECODED = 6
"""Not prepared: a recorded batch (``extra``), encoded now (a salted loop of replay)."""


class NotPreparable(Exception):
    """A message whose bytes cannot be prepared ahead (they depend on the moment of sending)."""


def frames_variant(to: Target) -> dict[str, Any]:
    """The target options that change the bytes of a prepared message (the rest, such as the
    seq frame and the socket, are chosen when sending)."""
    return {
        "format": to.encoding,
        "array_layout": to.array_layout,
        "worker_topics": to.worker_topics,
    }


def prepared_rows(batches: Any, variant: dict[str, Any]) -> Any:
    """Frames-cache rows of recorded ``batches``: what a ZMQ target of ``variant`` sends of
    each when nothing filters or salts it (the same decisions as :class:`Sender`, through the
    same functions). :class:`NotPreparable` for a batch whose bytes depend on the clock."""
    import json

    from .pacing import batch_time

    encoding = variant["format"]
    worker_topics, array_layout = variant["worker_topics"], variant["array_layout"]
    for batch in batches:
        key = slot_key(batch)
        try:
            key_json = json.dumps(["w", *key] if isinstance(key, tuple) else ["s", key])
        except TypeError:
            raise NotPreparable(f"worker id {batch.worker_id!r} is not plain data") from None
        malformed = batch.error is not None
        topic = payload = b""
        frames: list[bytes] | None = None
        error: str | None = None
        events = 0
        try:
            if malformed:
                if forwards_malformed(encoding, batch):
                    kind, frames = MALFORMED, recorded_zmq_frames(batch)
                else:
                    kind = SKIP
            elif not batch.events and encoding != "raw":
                kind = NOTHING  # the pipeline hands it over as emptied: only raw sends it
            else:
                events = len(batch.events)
                wanted = zmq_format_for(encoding, batch, True)
                if wanted == "raw" and not batch.format.startswith("engine"):
                    kind, frames = FORWARD, recorded_zmq_frames(batch)
                else:
                    if wanted != "raw" and batch.ts is None:
                        raise NotPreparable("a batch without a time is sent with the clock's")
                    kind = SEND
                    topic, payload = zmq_message(
                        wanted, batch, batch.events, worker_topics, array_layout
                    )
        except UsageError as exc:
            kind, error = REFUSED, str(exc)
        yield (
            batch_time(batch),
            batch.seq,
            kind,
            malformed,
            events,
            key_json,
            topic,
            payload,
            frames,
            error,
        )


def worker_key(key_json: str) -> Any:
    """The :func:`slot_key` a prepared row names."""
    import json

    kind, *parts = json.loads(key_json)
    return tuple(parts) if kind == "w" else parts[0]


def bind_workers(target: ZmqTarget, keys_json: list[str]) -> None:
    """Bind the socket of every worker up front, as :meth:`ZmqTarget.open_for` does."""
    for key in keys_json:
        target.socket(target.slot_of(worker_key(key)))
