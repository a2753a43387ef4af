"""The sending side shared by replay, bridge and simulate: opening the target their options
name (:data:`kvctl.options.target_options`), lingering, and the tcpreplay-style report with
what the target could see of its receivers (ZMQ subscribers and back-pressure, NATS publishes
and JetStream acks)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .events import Batch
from .pipeline import Emptied, Gap, Item, Malformed, Narrowed
from .text import plural

if TYPE_CHECKING:
    from .output import Output
    from .targets import NatsTarget, Target, ZmqTarget
    from .transports.nats import NatsOptions


def open_target(to: Target, nats: NatsOptions, diagnostics: Any) -> ZmqTarget | NatsTarget:
    """The target of a sending command's options (``--to``, ``--format``, ...) with the NATS
    credentials. ``diagnostics`` hears of a subscriber holding the sends (once) and of NATS
    outages, as they happen."""
    from .targets import open_target as open_target_named  # the codecs: not for --help

    return open_target_named(
        to,
        nats,
        on_long_stall=stall_warning(diagnostics),
        notify=transport_notice(diagnostics),
    )


def transport_notice(diagnostics: Any) -> Callable[[str], None]:
    """Outages and reconnections of a NATS target, as they happen."""

    def say(line: str) -> None:
        diagnostics.say(line, "yellow")

    return say


def stall_warning(diagnostics: Any) -> Callable[[float], None]:
    """The line shown (once) when a subscriber that does not read holds the sends."""

    def say(seconds: float) -> None:
        diagnostics.say(
            f"kvctl: a subscriber has not taken anything for {seconds:.0f} s: "
            "sending waits for it (it must read, or disconnect)",
            "yellow",
        )

    return say


class Sending:
    """The pipeline consumer of replay and bridge: delivered batches go to the sender, and a
    malformed message is forwarded byte for byte when the target takes raw bytes.

    ``send_empty``: a batch without events is sent too (replay's ``--format raw``, which sends
    every recorded message; it takes no filters, so such a batch carried no events)."""

    def __init__(self, sender: Any, send_empty: bool = False) -> None:
        self.sender = sender
        self.send_empty = send_empty

    def handle(self, item: Item) -> None:
        if type(item) is Batch:
            self.sender.write(item, item.events)
        elif isinstance(item, Narrowed):
            self.sender.write(item.batch, item.events)
        elif isinstance(item, Malformed):
            self.sender.write_raw(item.batch)
        elif isinstance(item, Emptied) and self.send_empty:
            self.sender.write(item.batch, item.batch.events)


def wait_subscribers(target: Any, count: int | None, diagnostics: Any, where: str = "") -> None:
    """``--wait-subscribers``: downstream first, so that nothing is sent into the void.
    ``where`` ends the line that says so (simulate: `` on every worker``)."""
    if count:
        diagnostics.say(f"kvctl: waiting for {plural(count, 'subscriber')}{where}", "dim")
        while not target.wait_subscribers(count, 0.2):
            pass


def linger(target: Any, seconds: float) -> None:
    """Keep the target's sockets (and replay ROUTERs, still answering) open a while."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        target.service()
        time.sleep(0.01)


def make_report(sender: Any, elapsed: float, schedule: Any, cpu_s: float) -> dict[str, Any]:
    """The report of a run; call after the target is closed (its delivery counts are final
    only then)."""
    elapsed = max(elapsed, 1e-9)
    return {
        "batches": sender.batches,
        "events": sender.events,
        "bytes": sender.bytes,
        "skipped": sender.skipped,
        "elapsed_s": round(elapsed, 6),
        "batches_per_s": sender.batches / elapsed,
        "events_per_s": sender.events / elapsed,
        "mbps": sender.bytes * 8 / elapsed / 1e6,
        "lateness": schedule.report(),
        "cpu_s": round(cpu_s, 3),
        "cpu_percent": round(100 * cpu_s / elapsed, 1),
        "delivery": sender.target.delivery(),
    }


def print_report(report: dict[str, Any], out: Output) -> None:
    if out.as_json:
        out.json(report)
        return
    late = report["lateness"]
    lines = [
        f"Actual: {plural(report['batches'], 'batch')} ({plural(report['events'], 'event')}, "
        f"{plural(report['bytes'], 'byte', thousands=True)}) sent in "
        f"{report['elapsed_s']:.3f} s",
        f"Rated: {report['batches_per_s']:,.1f} batches/s, {report['events_per_s']:,.1f} "
        f"events/s, {report['mbps']:.3f} Mbps",
    ]
    if late:
        lines.append(
            f"Timing: lateness median {late['median_ms']:.3f} ms, p99 "
            f"{late['p99_ms']:.3f} ms, max {late['max_ms']:.3f} ms, "
            f"{plural(late['late_over_1ms'], 'send')} later than 1 ms"
        )
    lines.append(f"CPU: {report['cpu_s']:.2f} s ({report['cpu_percent']:.0f}% of one core)")
    if report.get("skipped"):
        lines.append(
            f"Skipped: {plural(report['skipped'], 'malformed message')} (sent only with raw)"
        )
    for line in lines:
        out.say(line)
    say_delivery(report.get("delivery"), report["batches"], out)


def say_delivery(delivery: dict[str, Any] | None, batches: int, diagnostics: Any) -> None:
    """What the target could see of who received the batches, in plain words."""
    for line, style in delivery_lines(delivery, batches):
        diagnostics.say(line, style)


def delivery_lines(delivery: dict[str, Any] | None, batches: int) -> list[tuple[str, str]]:
    if not delivery or not batches:
        return []
    if delivery["transport"] == "zmq":
        return _zmq_lines(delivery)
    return _nats_lines(delivery)


def _zmq_lines(d: dict[str, Any]) -> list[tuple[str, str]]:
    warn = "yellow"
    if d["subscribers_peak"] == 0:
        return [
            (
                "kvctl: warning: sent to 0 subscribers: nothing was received "
                "(--wait-subscribers N holds the first batch until N joined)",
                warn,
            )
        ]
    sockets = f" over {d['sockets']} sockets" if d["sockets"] > 1 else ""
    lines = [
        (
            f"Subscribers: {d['subscribers_at_start']} at start, {d['subscribers_at_end']} at "
            f"end, {d['subscribers_peak']} at most{sockets}",
            "",
        )
    ]
    late = d["subscribers_peak"] - d["subscribers_at_start"]
    if late > 0:
        lines.append(
            (
                f"kvctl: warning: {plural(late, 'subscriber')} joined after the first "
                "batch and missed what was sent before",
                warn,
            )
        )
    if d["sockets_without_subscribers"]:
        lines.append(
            (
                f"kvctl: warning: {d['sockets_without_subscribers']} of {d['sockets']} "
                "sockets had no subscriber: their batches were received by nobody",
                warn,
            )
        )
    if d["stalls"]:
        lines.append(
            (
                f"Back-pressure: a subscriber's queue was full (high-water mark) "
                f"{plural(d['stalls'], 'time')}; sending waited {d['stalled_s']:.3f} s "
                "in all and dropped nothing",
                warn,
            )
        )
    if not d["flushed"]:
        lines.append(
            (
                f"kvctl: warning: a subscriber had not taken the last queued batches "
                f"{d['flush_timeout_s']:g} s after the end: they may not have been "
                "received",
                warn,
            )
        )
    lines.append(
        (
            "Note: a ZMQ PUB cannot tell whether subscribers kept up: it sees them join "
            "and leave and when their queue is full, not what they processed",
            "dim",
        )
    )
    return lines


def _nats_lines(d: dict[str, Any]) -> list[tuple[str, str]]:
    warn = "yellow"
    if d.get("stream"):
        lines = [
            (
                f"JetStream: {d['acked']:,} of {d['acked'] + d['failed'] + d['dropped']:,} "
                f"messages acked by stream {d['stream']} ({d['subject']})",
                warn if d["failed"] or d["dropped"] else "",
            )
        ]
    else:
        lines = [
            (
                f"Published: {plural(d['published'], 'message', thousands=True)} to "
                f"{d['server']} ({d['subject']})",
                "",
            )
        ]
    if d["outages"]:
        lines.append(
            (
                f"Outages: the server was away {plural(d['outages'], 'time')}, "
                f"{d['outage_s']:.1f} s in all; messages waited in kvctl's queue and were "
                "published on reconnection",
                warn,
            )
        )
    if d["failed"]:
        lines.append(
            (
                f"kvctl: warning: {plural(d['failed'], 'message')} not published: {d['failure']}",
                warn,
            )
        )
    if d["dropped"]:
        lines.append(
            (f"kvctl: warning: {plural(d['dropped'], 'message')} dropped: {d['drop_reason']}", warn)
        )
    if not d.get("stream"):
        lost = (
            " and those in flight when a connection broke are lost unseen" if d["outages"] else ""
        )
        lines.append(
            (
                "Note: NATS core delivers only to subscribers present at that moment, "
                f"has no acks{lost}: a publisher cannot see its subscribers, check what "
                "they counted",
                "dim",
            )
        )
    return lines


# --- bridge --stream: every message into a kvctl fleet stream ---------------------------------


def fleet_stream(url: str, nats: NatsOptions, name: str) -> Any:
    """The :class:`~kvctl.partitions.StreamLayout` of stream ``name``, checked before anything
    is published: one line (:class:`TransportError`) when there is no such stream, or it is
    not one ``kvctl stream init`` made."""
    from .errors import TransportError
    from .redact import redact_url
    from .transports.nats import fleet_layout, run_jetstream, stream_info_or_none

    async def work(js: Any) -> Any:
        info = await stream_info_or_none(js, name)
        if info is None:
            raise TransportError(
                f"{redact_url(url)}: no stream {name} "
                f"(create it first: kvctl stream init {redact_url(url)} --name {name} "
                "--partitions N)"
            )
        layout = fleet_layout(info)
        if layout is None:
            raise TransportError(
                f"{redact_url(url)}: stream {name} is not a kvctl fleet stream (its subjects "
                "and transform are not those kvctl stream init makes)"
            )
        return layout

    return run_jetstream(url, nats, work)


def fleet_message(batch: Batch) -> Any:
    """The :class:`~kvctl.partitions.FleetMessage` of a received message: the fields of the
    raw journal row ``kvctl record`` writes for it (``RecordingWriter.write_message``:
    receive time, redacted source, topic, worker and dp rank labels as tagged JSON, the
    recovered flag, the frames as received) and how many events were decoded."""
    from .partitions import FleetMessage
    from .recording.tagged_json import dumps, to_json_value
    from .redact import redact_url

    source = batch.source
    return FleetMessage(
        recv_ns=batch.recv_ns,
        source=redact_url(source) if type(source) is str else str(source),
        topic=batch.topic or "",
        frames=[bytes(f) for f in batch.frames],
        worker=None if batch.worker_id is None else dumps(to_json_value(batch.worker_id)),
        dp_rank=None if batch.dp_rank is None else dumps(to_json_value(batch.dp_rank)),
        recovered=batch.recovered is True,
        events=len(batch.events) if batch.error is None else 0,
    )


def _packb(frames: list[bytes]) -> bytes:
    """:meth:`~kvctl.partitions.FleetMessage.body` of these frames (bytes frames as they are:
    msgpack packs bytes and bytearray alike, as bin)."""
    import msgpack

    if all(type(f) is bytes for f in frames):
        return msgpack.packb(frames)
    return msgpack.packb([bytes(f) for f in frames])


class StreamSending:
    """The pipeline consumer of ``bridge --stream``: every message received (decoded,
    emptied, narrowed by ``-c``: whole, as received; malformed: its frames) becomes one
    JetStream message to its worker's subject, and every run of seqs the engine's replay
    socket could not fill becomes a gap marker, exactly as ``kvctl record`` would journal
    them (see :class:`~kvctl.partitions.FleetMessage`)."""

    def __init__(self, publisher: Any, layout: Any, bridge: str) -> None:
        self.publisher = publisher
        self.layout = layout
        self.bridge = bridge
        """The ``Kvctl-Bridge`` header: which bridge published (host:pid)."""
        self.messages = self.gap_markers = self.malformed = self.bytes = 0
        self.events = 0
        self._subjects: dict[tuple[Any, str], str] = {}
        self._seen: dict[Any, tuple[Any, str, Any]] = {}
        """publisher -> (worker id, source, dp rank) of its latest batch: a gap marker goes
        where that publisher's messages go."""
        self._malformed_seqs: dict[Any, set[int]] = {}  # since the publisher's last gap
        self._static_cache: dict[Any, tuple[dict[str, str], str, str, int | None, str]] = {}
        from .partitions import message_id

        self._message_id = message_id

    def handle(self, item: Item) -> None:
        if type(item) is Batch:
            self.send(item)
        elif isinstance(item, (Narrowed, Emptied, Malformed)):
            self.send(item.batch)
        elif isinstance(item, Gap):
            self.gap(item)

    def _subject(self, worker_id: Any, source: str) -> tuple[str, str]:
        from .partitions import partition_key

        key = partition_key(worker_id, source)
        subject = self._subjects.get((worker_id, source))
        if subject is None:
            subject = self._subjects[(worker_id, source)] = self.layout.publish_subject(key)
        return key, subject

    def _static(self, batch: Batch) -> tuple[dict[str, str], str, str, int | None, str]:
        """What the messages of one source, topic and labels share: the headers that do not
        change from message to message (those of :func:`fleet_message`, computed once), the
        subject, the partition key, the dp rank of the message id and the redacted source."""
        from .partitions import (
            HEADER_BRIDGE,
            HEADER_EVENTS,
            HEADER_RECOVERED,
            HEADER_RECV_NS,
        )

        try:
            cache_key = (batch.source, batch.topic, batch.worker_id, batch.dp_rank)
            found = self._static_cache.get(cache_key)
        except TypeError:  # an unhashable label: nothing cached
            cache_key, found = None, None
        if found is not None:
            return found
        message = fleet_message(batch)
        headers = message.headers()
        for varying in (HEADER_RECV_NS, HEADER_RECOVERED, HEADER_EVENTS):
            headers.pop(varying, None)
        headers[HEADER_BRIDGE] = self.bridge
        key, subject = self._subject(batch.worker_id, message.source)
        dp_rank = batch.dp_rank if type(batch.dp_rank) is int else None
        found = (headers, subject, key, dp_rank, message.source)
        if cache_key is not None and len(self._static_cache) < 4096:
            self._static_cache[cache_key] = found
        return found

    def send(self, batch: Batch) -> None:
        """The hot path: the headers of :func:`fleet_message` (equal, see the tests) from the
        per-source part computed once, the body, the message id."""
        from .partitions import HEADER_EVENTS, HEADER_RECOVERED, HEADER_RECV_NS, MSG_ID

        static, subject, key, dp_rank, source = self._static(batch)
        frames = batch.frames
        body = _packb(frames if type(frames) is list else list(frames))
        events = len(batch.events) if batch.error is None else 0
        headers = {HEADER_RECV_NS: str(batch.recv_ns), **static}
        if batch.recovered is True:
            headers[HEADER_RECOVERED] = "1"
        headers[HEADER_EVENTS] = str(events)
        seq = batch.seq if type(batch.seq) is int else None
        headers[MSG_ID] = self._message_id(key, dp_rank, seq, body)
        self.publisher.publish(subject, body, headers)
        self._seen[batch.publisher] = (batch.worker_id, source, dp_rank)
        self.messages += 1
        self.bytes += len(body)
        if batch.error is not None:
            self.malformed += 1
            if type(batch.seq) is int:  # its seq arrived: not part of a later gap marker
                seqs = self._malformed_seqs.setdefault(batch.publisher, set())
                seqs.add(batch.seq)
                if len(seqs) > 4096:  # nothing but malformed messages: stay bounded
                    keep = sorted(seqs)[-2048:]
                    seqs.clear()
                    seqs.update(keep)
        else:
            self.events += events

    def gap(self, gap: Gap) -> None:
        """The gap markers of a Gap item: one per run of seqs neither recovered nor arrived
        malformed (the rows ``kvctl record``'s sink writes, see ``RecordingSink.gap``)."""
        arrived = {s for s in gap.recovered if gap.first <= s < gap.end}
        malformed = self._malformed_seqs.pop(gap.publisher, set())
        arrived.update(s for s in malformed if gap.first <= s < gap.end)
        start = gap.first
        for seq in [*sorted(arrived), gap.end]:
            if seq > start:
                self._gap_marker(gap.publisher, start, seq - 1)
            start = seq + 1

    def _gap_marker(self, publisher: Any, from_seq: int, to_seq: int) -> None:
        import json
        import time

        from .partitions import HEADER_BRIDGE, MSG_ID, FleetMessage, message_id
        from .recording.tagged_json import to_json_value
        from .redact import redact_url

        shown = redact_url(publisher) if type(publisher) is str else publisher
        fields = {"publisher": to_json_value(shown), "from_seq": from_seq, "to_seq": to_seq}
        # the source column of a Gap row is the publisher, as RecordingSink.gap writes it
        gap_source = redact_url(str(publisher))
        worker_id, source, dp_rank = self._seen.get(publisher, (None, gap_source, None))
        key, subject = self._subject(worker_id, source)
        message = FleetMessage(time.time_ns(), gap_source, "", [], gap=fields)
        headers = message.headers()
        marker = json.dumps(fields, sort_keys=True).encode()
        headers[MSG_ID] = message_id(key, dp_rank, from_seq, b"gap:" + marker)
        headers[HEADER_BRIDGE] = self.bridge
        self.publisher.publish(subject, message.body(), headers)
        self.gap_markers += 1
