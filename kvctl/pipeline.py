"""Where the layers meet: sources (transports + decoding) -> sequence tracking -> filters and
stop conditions -> consumers, each handed every typed item through ``handle(item)``. Commands
only wire these pieces together."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from .errors import StrictModeError, TransportError, UsageError
from .events import Batch, Event
from .selection import Filters, Limits
from .sequence import GAP, SequenceTracker
from .text import plural

DRAIN_LIMIT = 512  # messages taken from one socket before the others get their turn


@dataclass
class SourceSpec:
    """One source argument: ``[WORKER[:DP]=]tcp://...|ipc://...``,
    ``nats://HOST:PORT[,nats://HOST:PORT...][/SUBJECT]`` (several servers of one cluster: the
    client fails over between them) or a recording path."""

    kind: str  # "zmq" | "nats" | "file"
    address: str
    worker_id: Any = None
    dp_rank: int | None = None
    subjects: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, text: str) -> SourceSpec:
        label, sep, rest = text.partition("=")
        if sep and "://" not in label:
            worker, _, dp = label.partition(":")
            if not worker:
                raise UsageError(f"{text}: empty worker label before '='")
            try:
                dp_rank = int(dp) if dp else None
            except ValueError:
                raise UsageError(f"{text}: dp rank {dp!r} is not an integer") from None
            spec = cls.parse(rest)
            spec.worker_id = int(worker) if worker.isdigit() else worker
            spec.dp_rank = dp_rank
            return spec
        if text.startswith(("tcp://", "ipc://", "inproc://")):
            return cls("zmq", text)
        if text.startswith(("nats://", "tls://")):
            from .transports.nats import servers_of, split_nats_url

            servers, subject = split_nats_url(text)  # the subject after the last server
            servers_of(servers)  # one usage line for a list that is not all NATS URLs
            return cls("nats", servers, subjects=[subject] if subject else [])
        if text.startswith("s3://"):  # a dataset in S3
            return cls("file", text)
        if "://" in text:
            raise UsageError(f"{text}: unknown scheme (use tcp://, ipc://, nats:// or a path)")
        return cls("file", text)


@dataclass(frozen=True)
class StreamRead:
    """``--stream NAME [--partition I[,J...]/N]``: which partitions of a fleet stream a
    live source reads, as the subjects their readers filter on."""

    name: str
    partitions: tuple[int, ...]
    total: int

    @property
    def subjects(self) -> list[str]:
        from .partitions import StreamLayout

        layout = StreamLayout(self.name, self.total)
        return [layout.partition_subject(p) for p in self.partitions]


def decode_fleet(headers: bytes, body: bytes, address: str, typed: bool = False) -> Any:
    """One message of a fleet stream (its headers as JSON, its body) as the :class:`Batch`
    the bridge's source gave, decoded from the raw frames with the labels, receive time and
    recovered flag the envelope carries (as a recorder of the stream decodes them: see
    ``kvctl.recording.convert.Decoder.items``); a gap marker as its fields (a dict); anything
    that is no fleet message as a malformed batch from ``address`` (counted, never dropped)."""
    import json

    from .formats import decode_nats, decode_zmq
    from .partitions import FleetMessage
    from .recording.tagged_json import from_json_value

    try:
        fields = json.loads(headers)
        if not isinstance(fields, dict):
            raise ValueError("headers that are not name: value pairs")
        message = FleetMessage.parse(fields, body)
        if message.gap is not None:
            return message.gap
        worker = None if message.worker is None else from_json_value(json.loads(message.worker))
        dp = None if message.dp_rank is None else from_json_value(json.loads(message.dp_rank))
    except (ValueError, TypeError, KeyError) as exc:  # json's errors are ValueErrors too
        return Batch(
            source=address,
            events=[],
            format="unknown",
            frames=[body],
            error=f"not a fleet stream message: {exc}",
            publisher=(address, "fleet stream"),
            recv_ns=time.time_ns(),
        )
    source, frames = message.source, message.frames
    if source.startswith(("nats://", "tls://")) and len(frames) == 1:
        batch = decode_nats(message.topic, frames[0], source, message.recv_ns)
    else:
        batch = decode_zmq(frames, source, message.recv_ns, worker, dp, typed)
    if message.recovered:
        batch.recovered = True
    return batch


@dataclass
class Summary:
    events: Counter = field(default_factory=Counter)
    batches: int = 0
    malformed: int = 0
    gaps: int = 0
    missing: int = 0
    recovered: int = 0
    duplicates: int = 0
    reorders: int = 0
    restarts: int = 0
    dropped: int = 0
    """Received but dropped here, a receive queue being full (--max-queue)."""
    unprocessed: int = 0
    """Received but still queued when the run was interrupted."""
    publishers: set = field(default_factory=set)
    started: float = field(default_factory=time.monotonic)
    stopped_by: str = "end of input"

    @property
    def total_events(self) -> int:
        return sum(self.events.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "events": self.total_events,
            "events_by_type": dict(self.events),
            "batches": self.batches,
            "publishers": len(self.publishers),
            "malformed": self.malformed,
            "gaps": self.gaps,
            "missing_batches": self.missing,
            "recovered_batches": self.recovered,
            "duplicates": self.duplicates,
            "reorders": self.reorders,
            "restarts": self.restarts,
            "dropped_batches": self.dropped,
            "unprocessed_batches": self.unprocessed,
            "elapsed_s": round(time.monotonic() - self.started, 3),
            "stopped_by": self.stopped_by,
        }

    def line(self) -> str:
        by_type = ", ".join(f"{k} {v}" for k, v in sorted(self.events.items())) or "none"
        text = (
            f"{plural(self.total_events, 'event')} ({by_type}) in "
            f"{plural(self.batches, 'batch')} from "
            f"{plural(len(self.publishers), 'publisher')}; gaps {self.gaps} "
            f"({plural(self.missing, 'batch')} missing, {self.recovered} recovered), "
            f"duplicates {self.duplicates}, reorders {self.reorders}, "
            f"malformed {self.malformed}"
        )
        if self.dropped:
            text += f", dropped {self.dropped:,} (receive queue full, see --max-queue)"
        text += f"; stopped by {self.stopped_by}"
        if self.unprocessed:
            text += (
                f", {plural(self.unprocessed, 'received batch', thousands=True)} not "
                "processed (queued at exit)"
            )
        return text


@dataclass(slots=True)
class Narrowed:
    """A delivered batch of which the filters or ``--count`` kept only ``events``. A batch
    delivered whole is handed over as the :class:`Batch` itself (no object per batch on the
    hot path); ``events is not batch.events`` here, which tells a sender that the recorded
    bytes no longer match."""

    batch: Batch
    events: list[Event]


@dataclass(slots=True)
class Emptied:
    """A batch that reached the pipeline but has no event to deliver: the filters removed
    them all, or it carried none. Its seq still counts (a recorder keeps it, a checker sees
    it arrive)."""

    batch: Batch


@dataclass(slots=True)
class Malformed:
    """A message that could not be decoded (``batch.error`` says why; ``batch.frames`` holds
    the bytes as received)."""

    batch: Batch


@dataclass(slots=True)
class Gap:
    """Seqs ``first..end-1`` of ``publisher`` were skipped; ``recovered`` lists those the
    replay socket filled (delivered right after this item)."""

    publisher: Any
    first: int
    end: int
    recovered: list[int]


@dataclass(slots=True)
class SequenceIrregularity:
    """A seq that is neither the next one nor a forward gap: ``kind`` is one of
    :mod:`kvctl.sequence`'s verdicts other than a gap (reorder, recovered, duplicate,
    restart)."""

    kind: str
    publisher: Any
    expected: int
    got: int


@dataclass(slots=True)
class Idle:
    """Nothing arrived for a poll interval (a live source, ~0.1 s): a consumer that holds
    output back to write it in large pieces writes it now."""


IDLE = Idle()

Item = Batch | Narrowed | Emptied | Malformed | Gap | SequenceIrregularity | Idle
"""What the pipeline hands its consumers, in stream order. A :class:`Batch` or a
:class:`Narrowed` is a delivered batch; every batch received is exactly one of Batch,
Narrowed, Emptied or Malformed."""


class Consumer(Protocol):
    """Everything downstream of the pipeline (sinks, checkers, stderr diagnostics): one
    method, every item; a consumer ignores the kinds it has no use for."""

    def handle(self, item: Item) -> None: ...


Notify = Callable[[str, str], None]
"""Says one line on stderr: ``(text, style)``, style a rich style name such as "yellow"."""


class LiveSource:
    """Every ZMQ and NATS source of one command, polled together in one loop.

    Opening never blocks on a missing peer: ZMQ connects before the engine binds and the NATS
    client keeps trying, so recorders and routers can start first. While a source is not
    there yet, :meth:`batches` yields ``None`` (idle) so the caller's stop conditions and
    Ctrl-C keep working; after ``NOTICE_AFTER_S`` one notice says what is awaited, and with
    ``connect_timeout`` (seconds) a source still missing then is a :class:`TransportError`.
    """

    NOTICE_AFTER_S = 3.0

    def __init__(
        self,
        specs: list[SourceSpec],
        nats_options: Any = None,
        subjects: list[str] | None = None,
        from_start: bool = False,
        replay_endpoints: list[str] | None = None,
        connect_timeout: float | None = None,
        topic: bytes = b"",
        notify: Notify | None = None,
        max_queue: int | None = None,
        typed: bool = False,
        stream: StreamRead | None = None,
    ) -> None:
        """``max_queue``: bytes received but not yet processed that may be held in memory,
        shared evenly by the live sources (``--max-queue``). ``typed``: every consumer reads
        :class:`~kvctl.formats.engine_zmq.TypedEvent` events as well as event dicts, so plain
        vLLM batches may take the typed fast path (see :func:`~kvctl.formats.decode_zmq`).
        ``stream``: the NATS source is a fleet stream, of which only these partitions are read
        (:class:`StreamRead`)."""
        import zmq

        from .transports import zmq as zmq_transport

        self.zmq = zmq
        self.poller = zmq.Poller()
        self.by_socket: dict[Any, tuple[str, Any]] = {}
        self.subscribers: list[Any] = []
        self.nats: list[Any] = []
        self.nats_by_socket: dict[Any, Any] = {}
        self.zmq_by_socket: dict[Any, Any] = {}
        self.replay_for: dict[str, str] = {}
        self.replay_silent_until: dict[str, float] = {}  # endpoint -> monotonic time
        self.replay_warned: set[str] = set()
        self.connect_timeout = connect_timeout or None  # 0 is "wait forever", as before
        self.typed = typed
        self.notify = notify
        self.stream = stream
        self.gap_markers = 0
        """Gap markers a bridge published into the fleet stream (said, not handed on: the
        seqs skip there too, and the sequence tracker reports that gap as for the engine)."""
        self.opened = time.monotonic()
        self.waiting: dict[Any, str] = {}
        """Source not connected yet -> its address; ZMQ subscribers and NATS clients alike."""
        self.down_since: dict[Any, float] = {}
        """NATS clients that lost their server -> since when (monotonic)."""
        self.noticed = False
        self._closed = False
        self._failed = False
        zmq_specs = [s for s in specs if s.kind == "zmq"]
        live = sum(1 for s in specs if s.kind in ("zmq", "nats"))
        self.queue_bytes = (max_queue or zmq_transport.DEFAULT_QUEUE_BYTES) // max(live, 1)
        self.drops_said = False
        if replay_endpoints and len(replay_endpoints) > len(zmq_specs):
            raise UsageError(
                f"{len(replay_endpoints)} --replay-endpoint for "
                f"{len(zmq_specs)} ZMQ sources; give at most one per ZMQ source"
            )
        try:
            for i, spec in enumerate(zmq_specs):
                sub = zmq_transport.Subscriber(spec.address, topic, self.queue_bytes)
                self.subscribers.append(sub)
                self.by_socket[sub.socket] = ("zmq", spec)
                self.zmq_by_socket[sub.socket] = sub
                self.poller.register(sub.socket, zmq.POLLIN)
                if sub.endpoint.startswith("inproc://"):
                    sub.stop_monitor()  # no connection events in-process: nothing to wait for
                else:
                    self.waiting[sub] = sub.endpoint
                    self.by_socket[sub.monitor] = ("monitor", sub)
                    self.poller.register(sub.monitor, zmq.POLLIN)
                if replay_endpoints and i < len(replay_endpoints):
                    self.replay_for[spec.address] = replay_endpoints[i]
            for spec in specs:
                if spec.kind == "nats":
                    self._open_nats(spec, nats_options, subjects, from_start)
            for sub in self.nats:
                sub.start()
        except BaseException:
            self._failed = True
            self.close()
            raise

    def _open_nats(
        self, spec: SourceSpec, options: Any, subjects: list[str] | None, from_start: bool
    ) -> None:
        from .transports import nats as nats_transport

        kind = "nats"
        sub: nats_transport.Subscriber
        if self.stream is not None:
            from .transports.jetstream import StreamSubscriber

            kind = "stream"
            sub = StreamSubscriber(
                spec.address,
                self.stream.name,
                list(self.stream.subjects),
                options,
                from_start,
                self.queue_bytes,
            )
        else:
            sub = nats_transport.Subscriber(
                spec.address,
                spec.subjects + list(subjects or []),
                options,
                from_start,
                self.queue_bytes,
            )
        self.nats.append(sub)
        self.waiting[sub] = sub.server
        self.by_socket[sub.socket] = (kind, spec)
        self.nats_by_socket[sub.socket] = sub
        self.poller.register(sub.socket, self.zmq.POLLIN)

    def _say(self, text: str, style: str = "yellow") -> None:
        if self.notify is not None:
            self.notify(text, style)

    def _zmq_event(self, sub: Any, data: bool = False) -> None:
        """A monitor event, or ``data`` arrived (so the subscriber is connected)."""
        if sub.monitor.closed:
            return
        sub.poll_connection()
        if sub.connected or data:
            # Nobody reads the monitor once connected (see Subscriber.stop_monitor).
            self.poller.unregister(sub.monitor)
            del self.by_socket[sub.monitor]
            sub.stop_monitor()
            self._connected(sub, "connected to")

    def _connected(self, sub: Any, what: str) -> None:
        address = self.waiting.pop(sub, None)
        if address is not None and self.noticed:
            waited = time.monotonic() - self.opened
            self._say(f"kvctl: {what} {address} after {waited:.0f} s", "dim")

    def _nats_control(self, sub: Any, kind: bytes, text: str) -> None:
        now = time.monotonic()
        if kind == b"fatal":
            self._failed = True
            raise TransportError(f"{sub.server}: {text}")
        if kind == b"up":
            if sub in self.waiting:
                self._connected(sub, "connected to NATS at")
            elif sub in self.down_since:
                outage = now - self.down_since.pop(sub)
                missed = (
                    "reading the stream on from the message after the last one read"
                    if self.stream is not None
                    else "messages published meanwhile are missed; gaps in Dynamo sequence "
                    "numbers show how many"
                )
                self._say(
                    f"kvctl: {sub.server}: reconnected after {outage:.1f} s ({missed})",
                    "yellow",
                )
        elif kind == b"down":
            self.down_since[sub] = now
            self._say(f"kvctl: {sub.server}: disconnected ({text}); reconnecting", "yellow")
        else:
            self._say(f"kvctl: {sub.server}: {text}", "yellow")

    def _check_waiting(self) -> None:
        """The notice after a few seconds, and --connect-timeout."""
        now = time.monotonic()
        waited = now - self.opened
        timeout = self.connect_timeout
        if self.waiting and timeout is not None and waited >= timeout:
            self._failed = True
            sub, address = next(iter(self.waiting.items()))
            if address.startswith(("nats://", "tls://")):
                why = sub.last_error or "no answer"
                raise TransportError(
                    f"{address}: cannot connect to NATS after {timeout:g} s "
                    f"({why}): is the server running there?"
                )
            why = "connection refused" if sub.refused else "no connection"
            raise TransportError(
                f"{address}: {why} after {timeout:g} s: is the engine publishing there?"
            )
        if self.waiting and not self.noticed and waited >= self.NOTICE_AFTER_S:
            self.noticed = True
            self._say(
                f"kvctl: nothing at {', '.join(self.waiting.values())} yet, waiting; "
                "--connect-timeout S to give up",
                "yellow",
            )
        if timeout is not None:
            for sub, since in self.down_since.items():
                if now - since >= timeout:
                    self._failed = True
                    raise TransportError(
                        f"{sub.server}: disconnected for {timeout:g} s "
                        f"({sub.last_error or 'no answer'}); giving up "
                        "(--connect-timeout)"
                    )

    def batches(self, poll_ms: int = 100) -> Iterator[Batch | None]:
        from zmq import NOBLOCK, Again

        from .formats import decode_nats, decode_zmq
        from .transports.nats import CONTROL
        from .transports.zmq import receive_all

        poll = self.poller.poll
        time_ns = time.time_ns
        typed = self.typed
        while True:
            if self.waiting or self.down_since:
                self._check_waiting()
            ready = poll(poll_ms)
            produced = False
            for sock, _ in ready:
                entry = self.by_socket.get(sock)
                if entry is None:  # a monitor stopped earlier in this round
                    continue
                kind, spec = entry
                if kind == "zmq":
                    address, worker, dp = spec.address, spec.worker_id, spec.dp_rank
                    # Frame by frame, reading the more-flag off each frame: recv_multipart
                    # asks the socket for it, which costs more than the whole receive.
                    recv = sock.recv
                    sub = self.zmq_by_socket[sock]
                    messages = size = 0
                    sample = sub.sample_due()  # the first message's size is known at once
                    for _ in range(DRAIN_LIMIT):
                        try:
                            frame = recv(NOBLOCK, copy=False)
                        except Again:
                            break
                        frames = [frame.bytes]
                        while frame.more:  # a message arrives whole: its other frames are here
                            frame = recv(NOBLOCK, copy=False)
                            frames.append(frame.bytes)
                        if not produced and self.waiting:  # data before the monitor's word
                            self._zmq_event(sub, data=True)
                        produced = True
                        messages += 1
                        size += sum(map(len, frames))
                        if messages >= sample:
                            sub.received(messages, size)
                            messages = size = 0
                            sample = sub.sample_due()
                        yield decode_zmq(frames, address, time_ns(), worker, dp, typed)
                    if messages:
                        sub.received(messages, size)
                    continue
                if kind == "monitor":
                    self._zmq_event(spec)
                    continue
                nats_sub = self.nats_by_socket[sock]
                fleet = kind == "stream"
                for frames in receive_all(sock, DRAIN_LIMIT):
                    if frames[0] == CONTROL:
                        self._nats_control(nats_sub, frames[1], frames[2].decode())
                        continue
                    nats_sub.taken(frames)
                    produced = True
                    if fleet:
                        batch = decode_fleet(frames[0], frames[1], spec.address, typed)
                        if type(batch) is Batch:
                            yield batch
                        else:
                            self._gap_marker(batch)
                        continue
                    yield decode_nats(frames[0].decode(), frames[1], spec.address, time_ns())
                if nats_sub.dropped and not self.drops_said:
                    self.drops_said = True
                    self._say(
                        f"kvctl: {nats_sub.server}: receive queue full (--max-queue "
                        f"{self.queue_bytes / 1e6:g} MB per source): dropping "
                        "messages, counted in the summary",
                        "yellow",
                    )
            if not produced:
                yield None  # idle, or only connection events: the caller checks its timers

    def _gap_marker(self, gap: dict[str, Any]) -> None:
        self.gap_markers += 1
        self._say(
            f"kvctl: fleet stream {self.stream.name if self.stream else ''}: the bridge marked "
            f"seqs {gap.get('from_seq')}..{gap.get('to_seq')} of {gap.get('publisher')} "
            "missing",
            "dim",
        )

    REPLAY_FIRST_REPLY_S = 0.5
    """How long the receive loop waits for a replay socket's first reply (an engine answers
    within milliseconds); meanwhile messages queue up, within --max-queue."""
    REPLAY_BACKOFF_S = 30.0
    """A replay socket that did not answer is not asked again for this long."""

    def recover(self, batch: Batch, first: int, end: int) -> list[Batch]:
        """Fetch batches ``first..end-1`` from the source's replay socket, if it has one."""
        endpoint = self.replay_for.get(batch.source)
        if endpoint is None:
            return []
        now = time.monotonic()
        if now < self.replay_silent_until.get(endpoint, 0.0):
            return []
        from .formats import decode_zmq
        from .transports.zmq import fetch_replay

        replies, complete = fetch_replay(
            endpoint,
            first,
            timeout=1.0,
            stop_seq=end - 1,
            first_reply_timeout=self.REPLAY_FIRST_REPLY_S,
        )
        if not replies and not complete:  # no answer at all
            self.replay_silent_until[endpoint] = now + self.REPLAY_BACKOFF_S
            if endpoint not in self.replay_warned:
                self.replay_warned.add(endpoint)
                self._say(
                    f"kvctl: replay endpoint {endpoint} does not answer; gaps are not "
                    f"recovered from it (asked again every {self.REPLAY_BACKOFF_S:.0f} "
                    "s, without a further word)",
                    "yellow",
                )
            return []
        out = []
        spec = next(
            s for k, s in self.by_socket.values() if k == "zmq" and s.address == batch.source
        )
        for topic, seq_frame, payload in replies:
            seq = int.from_bytes(seq_frame, "big")
            if first <= seq < end:
                rb = decode_zmq(
                    [topic, seq_frame, payload],
                    batch.source,
                    time.time_ns(),
                    spec.worker_id,
                    spec.dp_rank,
                )
                rb.recovered = True
                out.append(rb)
        return out

    def dropped(self) -> int:
        """Messages dropped by this process because a receive queue was full."""
        return sum(sub.dropped for sub in self.nats)

    def unprocessed(self) -> int:
        """Messages received but not processed yet (at exit: discards them while counting)."""
        return sum(sub.drain() for sub in self.subscribers) + sum(
            sub.queued_messages() for sub in self.nats
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for sub in self.subscribers:
            sub.close()
        for sub in self.nats:
            sub.close()
        if self.waiting and not self._failed:  # stopped (--duration, Ctrl-C) while waiting
            self._say(f"kvctl: never connected to {', '.join(self.waiting.values())}", "yellow")


def run(
    source: Any,
    consumers: list[Consumer],
    limits: Limits,
    filters: Filters | None = None,
    strict: bool = False,
    summary: Summary | None = None,
) -> Summary:
    """Drive ``source`` until input ends or a stop condition holds, handing every item to
    every consumer in order (malformed and emptied batches included, so that recorders and
    checkers lose nothing to a filter)."""
    summary = summary or Summary()
    try:
        return _run(source, consumers, limits, filters, strict, summary)
    except KeyboardInterrupt:
        unprocessed = getattr(source, "unprocessed", None)
        if unprocessed is not None:
            summary.unprocessed = unprocessed()
        raise
    finally:
        dropped = getattr(source, "dropped", None)
        if dropped is not None:
            summary.dropped = dropped()


def _run(
    source: Any,
    consumers: list[Consumer],
    limits: Limits,
    filters: Filters | None,
    strict: bool,
    summary: Summary,
) -> Summary:
    filter_events = filters.apply if filters and (filters.types or filters.workers) else None
    counts = summary.events
    handlers = [consumer.handle for consumer in consumers]

    def hand_over(item: Item) -> None:
        for handle in handlers:
            handle(item)

    tracker = SequenceTracker()
    remaining = limits.count
    start = time.monotonic()
    deadline = start + limits.duration if limits.duration is not None else None
    idle = limits.idle_timeout
    last_activity = start
    recover = getattr(source, "recover", None)
    for batch in source.batches():
        now = time.monotonic()
        if batch is None:
            hand_over(IDLE)
            if deadline is not None and now >= deadline:
                summary.stopped_by = "--duration"
                break
            if idle is not None and now - last_activity >= idle:
                summary.stopped_by = "--idle-timeout"
                break
            continue
        last_activity = now
        pending: tuple | list = (batch,)
        irregularity = tracker.observe(batch)
        if irregularity is not None:
            if irregularity.kind == GAP:
                first, end = irregularity.expected, irregularity.got
                recovered = recover(batch, first, end) if recover else []
                for item in recovered:
                    tracker.fill(irregularity.publisher, item.seq)
                _count_sequence(summary, tracker)
                hand_over(Gap(irregularity.publisher, first, end, [b.seq for b in recovered]))
                pending = [*recovered, batch]
            else:
                _count_sequence(summary, tracker)
                hand_over(
                    SequenceIrregularity(
                        irregularity.kind,
                        irregularity.publisher,
                        irregularity.expected,
                        irregularity.got,
                    )
                )
        elif batch.error is not None:
            _count_sequence(summary, tracker)  # its seq may have filled a gap
        for item in pending:
            summary.batches += 1
            summary.publishers.add(item.publisher)
            if item.error is not None:
                summary.malformed += 1
                hand_over(Malformed(item))
                if strict:
                    summary.stopped_by = "--strict"
                    raise StrictModeError(f"malformed message from {item.source}: {item.error}")
                continue
            events = filter_events(item) if filter_events else item.events
            if not events:
                hand_over(Emptied(item))
                continue
            if remaining is not None:
                if len(events) > remaining:
                    events = events[:remaining]
                remaining -= len(events)
            if type(events[0]) is dict:
                for event in events:
                    counts[event["type"]] += 1
            else:  # TypedEvents (see LiveSource's typed) carry their type as a class attribute
                typed_events: list[Any] = events
                for typed_event in typed_events:
                    counts[typed_event.TYPE] += 1
            delivered = item if events is item.events else Narrowed(item, events)
            for handle in handlers:
                handle(delivered)
            if remaining == 0:
                summary.stopped_by = "--count"
                return summary
        if deadline is not None and now >= deadline:
            summary.stopped_by = "--duration"
            break
    return summary


def _count_sequence(summary: Summary, tracker: SequenceTracker) -> None:
    """The summary's sequence counts are the tracker's (updated off the hot path only: a
    batch in order changes none of them)."""
    summary.gaps = tracker.gaps
    summary.missing = tracker.missing
    summary.recovered = tracker.recovered
    summary.reorders = tracker.reorders
    summary.duplicates = tracker.duplicates
    summary.restarts = tracker.restarts
