"""kvctl bridge: forward live KV-event streams into another format or transport, or into a
kvctl fleet stream on NATS JetStream (``--stream``)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import click

from ..help import KvctlCommand
from ..options import (
    Sources,
    filter_options,
    limit_options,
    report_options,
    source_arguments,
    target_options,
)
from ..publishing import (
    Sending,
    linger,
    make_report,
    open_target,
    print_report,
    wait_subscribers,
)
from ..redact import redact_url, shown_sources
from ..selection import Filters, Limits

if TYPE_CHECKING:
    from ..output import Output
    from ..targets import Target

PUBLISH_TIMEOUT_S = 60.0


_LOOPBACK = ("tcp://127.", "tcp://localhost:", "tcp://[::1]", "ipc://", "inproc://")
"""Source addresses that name the same socket on every node."""


@click.command("bridge", cls=KvctlCommand)
@source_arguments
@target_options
@click.option(
    "--stream",
    metavar="NAME",
    help="Publish every message, raw, into the kvctl fleet stream NAME on the --to NATS "
    "servers (made by `kvctl stream init`), for partitioned recorders to read.",
)
@click.option(
    "--publish-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=PUBLISH_TIMEOUT_S,
    show_default=True,
    metavar="SECONDS",
    help="With --stream: how long JetStream may refuse or leave unanswered what the bridge "
    "publishes (a stream leader elected, a server restarted) before the bridge gives up "
    "(exit 1, the messages not stored counted).",
)
@filter_options
@limit_options
@report_options
def command(
    sources: Sources,
    to: Target,
    stream: str | None,
    publish_timeout: float,
    selection: Filters,
    limits: Limits,
    out: Output,
) -> None:
    """Forward live streams to a target as they arrive: engine ZMQ -> Dynamo on NATS (what
    Dynamo's ZMQ relay does in-process), old vLLM arrays -> the new map form, NATS -> ZMQ.

    With --stream NAME, every message as received (and every gap the replay socket could not
    fill, as a marker) goes into the kvctl fleet stream NAME on the --to NATS servers, one
    partition per worker, for partitioned recorders; the report counts what JetStream
    stored, refused and what was retried.

    \b
    Example:
      kvctl bridge tcp://127.0.0.1:5557 --to nats://127.0.0.1:4222 --namespace dyn
      kvctl bridge 0=tcp://10.0.0.1:5557 --to tcp://127.0.0.1:6557 --format vllm
      kvctl bridge nats://127.0.0.1:4222 --to tcp://127.0.0.1:5557 --port-per-worker
      kvctl bridge w0=tcp://127.0.0.1:5557 --replay-endpoint tcp://127.0.0.1:5558 \\
        --to nats://10.0.0.1:4222,nats://10.0.0.2:4222 --stream fleet
    """
    if stream is not None:
        _bridge_stream(sources, to, stream, publish_timeout, selection, limits, out)
        return
    from ..pacing import Schedule
    from ..pipeline import Summary, run
    from ..session import on_interrupt, open_source
    from ..targets import Sender

    assert sources.connection is not None  # live sources: the source options build it
    target = open_target(to, sources.connection.nats, out)
    source = None
    summary = Summary()
    sender = Sender(target, to.encoding)
    started, cpu_start = time.perf_counter(), time.process_time()

    def send_report() -> None:
        on_interrupt(None)
        elapsed = time.perf_counter() - started
        report = make_report(sender, elapsed, Schedule(None), time.process_time() - cpu_start)
        report["received"] = summary.to_json()
        print_report(report, out)
        out.say("kvctl: received " + summary.line(), "dim")

    def interrupted() -> str:
        send_report()
        return "interrupted"

    try:
        wait_subscribers(target, to.wait_subscribers, out)
        source = open_source(sources, out)
        out.say(
            f"kvctl: bridging {shown_sources(sources.addresses)} -> {redact_url(to.url)}",
            "dim",
        )
        run(
            source,
            [out, Sending(sender)],
            limits,
            selection,
            summary=summary,
        )
        linger(target, to.linger)
    finally:
        if source is not None:
            source.close()
        target.close()
        # Ctrl-C stopped the bridge (not its closing): the report of what was forwarded
        on_interrupt(interrupted, out.quiet)
    send_report()


def _refuse_with_stream(to: Target, selection: Filters) -> None:
    """Options that mean nothing for a fleet stream (it carries the messages as received)."""
    from ..errors import UsageError

    if not to.url.startswith(("nats://", "tls://")):
        raise UsageError(
            f"--stream: --to {redact_url(to.url)} is not a NATS URL (nats://HOST:PORT)"
        )
    given = [
        name
        for name, value in (
            ("--format", to.encoding),
            ("--port-per-worker", to.per_worker),
            ("--keep-seq", to.keep_seq),
            ("--worker-topics", to.worker_topics),
            ("--replay-port", to.replay_port),
            ("--wait-subscribers", to.wait_subscribers),
            ("--type", selection.types),
            ("--worker", selection.workers),
        )
        if value
    ]
    if given:
        raise UsageError(
            f"--stream forwards every message as received: {', '.join(given)} cannot be "
            "combined with it (recorders of the stream filter for themselves)"
        )


def _bridge_stream(
    sources: Sources,
    to: Target,
    name: str,
    publish_timeout: float,
    selection: Filters,
    limits: Limits,
    out: Output,
) -> None:
    import os
    import socket

    from ..errors import TransportError, UsageError
    from ..partitions import check_name
    from ..pipeline import Summary, run
    from ..publishing import StreamSending, fleet_stream, transport_notice
    from ..session import on_interrupt, open_source
    from ..transports.nats import StreamPublisher, split_nats_url

    assert sources.connection is not None  # live sources: the source options build it
    why = check_name(name)
    if why is not None:
        raise UsageError(f"--stream: {why}")
    _refuse_with_stream(to, selection)
    servers, subject = split_nats_url(to.url)
    if subject:
        raise UsageError(
            f"--stream: --to {redact_url(to.url)} names a subject; the stream decides the "
            "subjects (give the servers only)"
        )
    nats = sources.connection.nats
    layout = fleet_stream(servers, nats, name)  # before any source is opened
    for address in sources.addresses:
        if "=" not in address.partition("://")[0] and address.startswith(_LOOPBACK):
            # unlabelled, its worker is its address: the same on every node of a fleet
            out.say(
                f"kvctl: warning: {redact_url(address)} has no worker label: its messages are "
                "keyed by this address, which bridges on other nodes share; label each engine "
                "fleet-wide (NODE-GPU=tcp://...)",
                "yellow",
            )
    publisher = StreamPublisher(
        servers, nats, publish_timeout=publish_timeout, notify=transport_notice(out)
    )
    sending = StreamSending(publisher, layout, f"{socket.gethostname()}:{os.getpid()}")
    summary = Summary()
    source = None
    started, cpu_start = time.perf_counter(), time.process_time()
    shown = redact_url(servers)
    error: TransportError | None = None

    def report() -> dict[str, Any]:
        elapsed = max(time.perf_counter() - started, 1e-9)
        cpu_s = time.process_time() - cpu_start
        return {
            "stream": name,
            "partitions": layout.partitions,
            "servers": shown,
            "messages": sending.messages,
            "events": sending.events,
            "malformed": sending.malformed,
            "gap_markers": sending.gap_markers,
            "bytes": sending.bytes,
            "elapsed_s": round(elapsed, 6),
            "messages_per_s": sending.messages / elapsed,
            "cpu_s": round(cpu_s, 3),
            "cpu_percent": round(100 * cpu_s / elapsed, 1),
            "delivery": publisher.counts(),
            "received": summary.to_json(),
        }

    def send_report() -> None:
        on_interrupt(None)
        _print_stream_report(report(), out)
        out.say("kvctl: received " + summary.line(), "dim")

    def interrupted() -> str:
        summary.stopped_by = "interrupt"
        send_report()
        return "interrupted"

    try:
        source = open_source(sources, out)
        out.say(
            f"kvctl: bridging {shown_sources(sources.addresses)} -> stream {name} "
            f"({layout.partitions} partitions) on {shown}",
            "dim",
        )
        run(source, [out, sending], limits, summary=summary)
    except TransportError as exc:
        if publisher.error is None:
            raise  # a source's error, not the stream's: said as it is
        error = exc
    finally:
        if source is not None:
            source.close()
        try:
            publisher.close()  # every message stored, or counted as failed
        except TransportError as exc:
            error = error or exc
        on_interrupt(interrupted, out.quiet)
    send_report()
    if error is not None:
        raise error
    if publisher.failed:
        raise TransportError(
            f"{shown}: {publisher.failed:,} of {publisher.published:,} messages not stored "
            f"in stream {name}: {publisher.failure}"
        )


def _print_stream_report(report: dict[str, Any], out: Output) -> None:
    from ..text import plural

    if out.as_json:
        out.json(report)
        return
    d = report["delivery"]
    out.say(
        f"Actual: {plural(report['messages'], 'message', thousands=True)} "
        f"({plural(report['events'], 'event', thousands=True)}, "
        f"{plural(report['bytes'], 'byte', thousands=True)}) and "
        f"{plural(report['gap_markers'], 'gap marker')} published in "
        f"{report['elapsed_s']:.3f} s"
    )
    out.say(
        f"Rated: {report['messages_per_s']:,.1f} messages/s; CPU {report['cpu_s']:.2f} s "
        f"({report['cpu_percent']:.0f}% of one core)"
    )
    trouble = d["failed"] or d["reordered"]
    out.say(
        f"JetStream: {d['acked']:,} of {d['published']:,} messages stored in stream "
        f"{report['stream']} ({report['partitions']} partitions), "
        f"{d['duplicates']:,} already there (dropped by the server as duplicates), "
        f"{d['retried']:,} publishes retried, {d['failed']:,} failed",
        "yellow" if trouble else "",
    )
    if d["outages"]:
        out.say(
            f"Outages: JetStream refused or did not answer {plural(d['outages'], 'time')}, "
            f"{d['outage_s']:.1f} s in all (longest {d['longest_outage_s']:.1f} s); new "
            "messages waited meanwhile and were stored after",
            "yellow",
        )
    if d["reordered"]:
        out.say(
            f"kvctl: warning: {plural(d['reordered'], 'message')} stored after a later one "
            "of the same worker (it was retried while that one was in flight)",
            "yellow",
        )
    if d["failed"]:
        out.say(
            f"kvctl: warning: {plural(d['failed'], 'message')} not stored: {d['failure']}",
            "yellow",
        )
