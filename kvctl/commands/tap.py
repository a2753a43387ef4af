"""kvctl tap: subscribe to live KV-event streams and print every event."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from ..help import KvctlCommand
from ..options import (
    Sources,
    filter_options,
    limit_options,
    output_options,
    source_arguments,
    stream_options,
)
from ..selection import Filters, Limits

if TYPE_CHECKING:
    from ..output import Output


@click.command("tap", cls=KvctlCommand)
@source_arguments
@stream_options
@filter_options
@limit_options
@output_options
@click.option("--strict", is_flag=True, help="Exit 1 at the first malformed message.")
def command(
    sources: Sources,
    selection: Filters,
    limits: Limits,
    out: Output,
    strict: bool,
    **params: object,  # --stream, --partition: reach the source through ``sources``
) -> None:
    """Subscribe to KV-event streams and print every event.

    SOURCE is an engine's ZMQ PUB endpoint (tcp://HOST:PORT or ipc://PATH, optionally labelled
    WORKER[:DP]=tcp://...), a NATS server (nats://HOST:PORT[/SUBJECT]) where Dynamo relays
    events, or a recording; with --stream NAME, a NATS server holding a fleet stream (`kvctl
    bridge --stream`), read as the engines the bridges read. Every wire format is detected per
    message. Ends with a summary on stderr; the first Ctrl-C prints it and exits 130.

    \b
    Example:
      kvctl tap tcp://127.0.0.1:5557
      kvctl tap 0=tcp://10.0.0.1:5557 1=tcp://10.0.0.2:5557 --json | jq .type
      kvctl tap nats://127.0.0.1:4222 --from-start -c 100
      kvctl tap tcp://127.0.0.1:5557 --replay-endpoint tcp://127.0.0.1:5558 --duration 60
      kvctl tap nats://10.0.0.5:4222 --stream fleet --partition 2/8 --from-start -c 100 --json
    """
    from ..session import stream

    stream(sources, selection, limits, out, strict)
