"""The sending side shared by replay, bridge and simulate: opening the target their options
name (:data:`kvctl.options.target_options`), lingering, and the tcpreplay-style report with
what the target could see of its receivers (ZMQ subscribers and back-pressure, NATS publishes
and JetStream acks)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .events import Batch
from .pipeline import Emptied, Item, Malformed, Narrowed
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
