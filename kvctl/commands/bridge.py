"""kvctl bridge: forward live KV-event streams into another format or transport."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

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


@click.command("bridge", cls=KvctlCommand)
@source_arguments
@target_options
@filter_options
@limit_options
@report_options
def command(sources: Sources, to: Target, selection: Filters, limits: Limits, out: Output) -> None:
    """Forward live streams to a target as they arrive: engine ZMQ -> Dynamo on NATS (what
    Dynamo's ZMQ relay does in-process), old vLLM arrays -> the new map form, NATS -> ZMQ.

    \b
    Example:
      kvctl bridge tcp://127.0.0.1:5557 --to nats://127.0.0.1:4222 --namespace dyn
      kvctl bridge 0=tcp://10.0.0.1:5557 --to tcp://127.0.0.1:6557 --format vllm
      kvctl bridge nats://127.0.0.1:4222 --to tcp://127.0.0.1:5557 --port-per-worker
    """
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
