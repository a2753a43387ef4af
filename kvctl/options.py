"""Shared option groups: each concept is spelled once here and reused by every command.

Every option can also come from the environment: ``KVCTL_<COMMAND>_<OPTION>`` (click's
auto_envvar_prefix, e.g. ``KVCTL_TAP_COUNT=10``); NATS credentials have short names of their own
(``KVCTL_NATS_USER``, ``KVCTL_NATS_PASSWORD``, ``KVCTL_NATS_TOKEN``, ``KVCTL_NATS_CREDS``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click

from .events import EVENT_TYPES, HASH_STYLES

if TYPE_CHECKING:
    from .transports.nats import NatsOptions

F = Callable[..., Any]


def _stack(*decorators: F) -> Callable[[F], F]:
    def apply(func: F) -> F:
        for decorator in reversed(decorators):
            func = decorator(func)
        return func

    return apply


class ByteSize(click.ParamType):
    """A size in bytes: a number with an optional K, M or G suffix (decimal: 64M = 64e6)."""

    name = "size"
    UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}
    MINIMUM = 10**6

    def convert(self, value: Any, param: Any, ctx: Any) -> int:
        if isinstance(value, int):
            return value
        text = str(value).strip().lower().removesuffix("b")
        number, unit = (text[:-1], text[-1]) if text[-1:] in self.UNITS else (text, "")
        try:
            size = int(float(number) * self.UNITS[unit])
        except (ValueError, OverflowError):
            self.fail(f"{value!r} is not a size (e.g. 64M, 1G)", param, ctx)
        if size < self.MINIMUM:
            self.fail(f"{value!r} is below the minimum of 1M", param, ctx)
        return size


# NATS credentials and TLS: the same for every command that talks to NATS, reading (tap,
# record, check, ...) or publishing (replay, simulate, bridge's target)
nats_auth_options = _stack(
    click.option("--nats-user", envvar="KVCTL_NATS_USER", metavar="USER", help="NATS user."),
    click.option(
        "--nats-password", envvar="KVCTL_NATS_PASSWORD", metavar="PASSWORD", help="NATS password."
    ),
    click.option("--nats-token", envvar="KVCTL_NATS_TOKEN", metavar="TOKEN", help="NATS token."),
    click.option(
        "--nats-creds",
        envvar="KVCTL_NATS_CREDS",
        metavar="FILE",
        type=click.Path(dir_okay=False),
        help="NATS credentials file.",
    ),
    click.option(
        "--tls-ca",
        metavar="FILE",
        type=click.Path(dir_okay=False),
        help="CA certificate for a TLS NATS server.",
    ),
    click.option(
        "--tls-cert",
        metavar="FILE",
        type=click.Path(dir_okay=False),
        help="Client certificate for NATS mutual TLS.",
    ),
    click.option(
        "--tls-key",
        metavar="FILE",
        type=click.Path(dir_okay=False),
        help="Client key for NATS mutual TLS.",
    ),
)

source_arguments = _stack(
    click.argument("sources", nargs=-1, required=True, metavar="SOURCE..."),
    click.option(
        "--subject",
        "subjects",
        multiple=True,
        metavar="SUBJECT",
        help="NATS subject to subscribe (repeatable; wildcards allowed). Default: the "
        "KV-event subjects of every Dynamo era.",
    ),
    click.option(
        "--from-start",
        is_flag=True,
        help="NATS: read the history of Dynamo's JetStream KV-event streams first.",
    ),
    click.option(
        "--replay-endpoint",
        "replay_endpoints",
        multiple=True,
        metavar="ENDPOINT",
        help="Engine replay socket (tcp://HOST:5558) used to fetch missed batches; "
        "one per ZMQ source, in the order the sources are given.",
    ),
    click.option(
        "--topic",
        default="",
        show_default=False,
        metavar="PREFIX",
        help="ZMQ topic prefix to subscribe to (default: all topics).",
    ),
    click.option(
        "--connect-timeout",
        type=click.FloatRange(min=0),
        default=None,
        metavar="SECONDS",
        help="Give up (exit 1) when a source is not there within this time, or a NATS "
        "server is gone this long. Default: wait without limit, saying so on "
        "stderr after 3 s (0 also waits without limit).",
    ),
    click.option(
        "--max-queue",
        type=ByteSize(),
        default="64M",
        show_default=True,
        metavar="SIZE",
        help="Memory for messages received but not yet processed, shared by the "
        "live sources. When it is full, ZMQ stops reading (the engine's PUB "
        "drops: seq gaps) and NATS messages are dropped and counted; both show "
        "in the summary.",
    ),
    nats_auth_options,
)

filter_options = _stack(
    click.option(
        "--type",
        "types",
        multiple=True,
        type=click.Choice(EVENT_TYPES, case_sensitive=False),
        help="Only events of this type (repeatable).",
    ),
    click.option(
        "--worker",
        "workers",
        multiple=True,
        metavar="WORKER",
        help="Only events of this worker id or label (repeatable).",
    ),
)

limit_options = _stack(
    click.option(
        "-c",
        "--count",
        type=click.IntRange(min=1),
        metavar="N",
        help="Stop after N events (after filters).",
    ),
    click.option(
        "--duration",
        type=click.FloatRange(min=0, min_open=True),
        metavar="SECONDS",
        help="Stop after this many seconds.",
    ),
    click.option(
        "--idle-timeout",
        type=click.FloatRange(min=0, min_open=True),
        metavar="SECONDS",
        help="Stop when nothing arrived for this many seconds.",
    ),
)

output_options = _stack(
    click.option(
        "--json",
        "as_json",
        is_flag=True,
        help="JSON lines on stdout (one object per event); diagnostics stay on stderr.",
    ),
    click.option(
        "--hash-format",
        type=click.Choice(HASH_STYLES),
        default="unsigned",
        show_default=True,
        help="How 64-bit hashes (block, parent, Dynamo tokens_hash) are shown; "
        "'string' writes decimal text that jq and pandas keep exact (byte "
        "hashes are always hex).",
    ),
    click.option("-q", "--quiet", is_flag=True, help="No diagnostics or summary on stderr."),
)


report_options = _stack(
    click.option(
        "--json", "as_json", is_flag=True, help="The final report as one JSON object on stdout."
    ),
    click.option(
        "-q", "--quiet", is_flag=True, help="No progress, diagnostics or report on stderr."
    ),
)


def nats_options(params: dict[str, Any]) -> NatsOptions:
    """The NATS credentials, TLS files and connect timeout of a command's options (those of
    :data:`nats_auth_options`, and ``--connect-timeout`` where the command has it)."""
    from .transports.nats import NatsOptions

    return NatsOptions(
        user=params["nats_user"],
        password=params["nats_password"],
        token=params["nats_token"],
        creds=params["nats_creds"],
        tls_ca=params["tls_ca"],
        tls_cert=params["tls_cert"],
        tls_key=params["tls_key"],
        connect_timeout=params.get("connect_timeout") or 5.0,
    )


def connection_kwargs(params: dict[str, Any]) -> dict[str, Any]:
    """Turn the source options of a command into LiveSource keyword arguments (plus ``quiet``,
    which :func:`kvctl.session.open_source` turns into the notice channel)."""
    return {
        "nats_options": nats_options(params),
        "subjects": list(params["subjects"]),
        "from_start": params["from_start"],
        "replay_endpoints": list(params["replay_endpoints"]),
        "connect_timeout": params["connect_timeout"] or None,  # 0: wait forever, as before
        "topic": params["topic"].encode(),
        "max_queue": params.get("max_queue"),
        "quiet": bool(params.get("quiet", False)),
    }
