"""Shared option groups: each concept is spelled once here and reused by every command, and
reaches the command as one typed object: the source arguments and options as ``sources``
(:class:`Sources` with its :class:`Connection`), the NATS credentials as ``nats``
(``NatsOptions``), ``--type``/``--worker`` as ``selection`` (``Filters``), the stop
conditions as ``limits`` (``Limits``), the output options as ``out`` (``Output``), where and how
replay and bridge send as ``to`` (``Target``).

Every option can also come from the environment: ``KVCTL_<COMMAND>_<OPTION>`` (click's
auto_envvar_prefix, e.g. ``KVCTL_TAP_COUNT=10``); NATS credentials have short names of their own
(``KVCTL_NATS_USER``, ``KVCTL_NATS_PASSWORD``, ``KVCTL_NATS_TOKEN``, ``KVCTL_NATS_CREDS``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import click

from .events import EVENT_TYPES, HASH_STYLES
from .help import ARRAY_LAYOUTS, DEFAULT_ARRAY_LAYOUT, NATS_FORMATS, ZMQ_FORMATS
from .selection import Filters, Limits, Until

if TYPE_CHECKING:
    from .output import Output
    from .targets import Target
    from .transports.nats import NatsOptions

F = Callable[..., Any]


def _stack(*decorators: F) -> Callable[[F], F]:
    def apply(func: F) -> F:
        for decorator in reversed(decorators):
            func = decorator(func)
        return func

    return apply


def _group(name: str, build: Callable[[dict[str, Any]], Any], *decorators: F) -> Callable[[F], F]:
    """Options that reach the command as one typed object, keyword argument ``name``:
    ``build`` takes (pops) the group's values out of the parsed parameters."""

    def apply(func: F) -> F:
        @functools.wraps(func)
        def command(**params: Any) -> Any:
            params[name] = build(params)
            return func(**params)

        return _stack(*decorators)(command)

    return apply


@dataclass(frozen=True)
class Connection:
    """How the live sources of a command are reached (its source options)."""

    nats: NatsOptions
    subjects: tuple[str, ...] = ()
    from_start: bool = False
    replay_endpoints: tuple[str, ...] = ()
    connect_timeout: float | None = None
    """None: wait without limit."""
    topic: bytes = b""
    max_queue: int | None = None


@dataclass(frozen=True)
class Sources:
    """The SOURCE arguments as given, and how the live ones are reached (None for commands
    that read recordings only)."""

    addresses: tuple[str, ...]
    connection: Connection | None = None
    stream: str | None = None
    """``--stream NAME``: the NATS source is this fleet stream (:data:`stream_options`)."""
    partition: str | None = None
    """``--partition`` as given (``I[,J...]/N``), checked by the command that reads it."""


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


def _nats_options(params: dict[str, Any]) -> NatsOptions:
    """The NATS credentials and TLS files (the values of :data:`nats_auth_options`, taken
    out of ``params``), with ``--connect-timeout`` where the command has it."""
    from .transports.nats import NatsOptions

    return NatsOptions(
        user=params.pop("nats_user"),
        password=params.pop("nats_password"),
        token=params.pop("nats_token"),
        creds=params.pop("nats_creds"),
        tls_ca=params.pop("tls_ca"),
        tls_cert=params.pop("tls_cert"),
        tls_key=params.pop("tls_key"),
        connect_timeout=params.get("connect_timeout") or 5.0,
    )


def _sources(params: dict[str, Any]) -> Sources:
    return Sources(
        addresses=tuple(params.pop("sources")),
        connection=Connection(
            nats=params.pop("nats"),
            subjects=tuple(params.pop("subjects")),
            from_start=params.pop("from_start"),
            replay_endpoints=tuple(params.pop("replay_endpoints")),
            connect_timeout=params.pop("connect_timeout") or None,  # 0: wait forever
            topic=params.pop("topic").encode(),
            max_queue=params.pop("max_queue"),
        ),
    )


def _selection(params: dict[str, Any]) -> Filters:
    # click's Choice hands back the canonical name, whatever case was typed
    return Filters(
        types=frozenset(params.pop("types") or ()),
        workers=frozenset(params.pop("workers") or ()),
    )


# NATS credentials and TLS: the same for every command that talks to NATS, reading (tap,
# record, check, ...) or publishing (replay, simulate, bridge's target)
nats_auth_options = _group(
    "nats",
    _nats_options,
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

source_arguments = _group(
    "sources",
    _sources,
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


def _with_stream(func: F) -> F:
    """``--stream``/``--partition`` into ``sources`` (:class:`Sources`), left in the command's
    parameters too (``stream``, ``partition_spec``): record reads them there."""

    @functools.wraps(func)
    def command(**params: Any) -> Any:
        import dataclasses

        sources = params.get("sources")
        if isinstance(sources, Sources):
            params["sources"] = dataclasses.replace(
                sources, stream=params.get("stream"), partition=params.get("partition_spec")
            )
        return func(**params)

    return command


# A fleet stream (`kvctl stream init`) as a source: declared once for the commands that read
# one (record into a dataset; tap, check, stats, top, index live). Below source_arguments.
stream_options = _stack(
    _with_stream,
    click.option(
        "--stream",
        metavar="NAME",
        help="SOURCE nats://HOST:PORT[,nats://HOST:PORT...] is a fleet stream's JetStream "
        "server: read the fleet stream NAME (made by `kvctl stream init`) as the engines "
        "its bridges read (new messages; all it holds with --from-start). record writes it "
        "into a dataset of Parquet segments in the -o directory (or s3://bucket/prefix), "
        "resuming after the segments it holds.",
    ),
    click.option(
        "--partition",
        "partition_spec",
        metavar="I[,J...]/N",
        help="With --stream: read only these partitions of the stream's N (record: one "
        "recorder per partition set; several may share one -o). Default: all partitions. "
        "check takes I/N, also without --stream (see its help).",
    ),
)

filter_options = _group(
    "selection",
    _selection,
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

limit_options = _group(
    "limits",
    lambda params: Limits(
        count=params.pop("count"),
        duration=params.pop("duration"),
        idle_timeout=params.pop("idle_timeout"),
    ),
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


def _target(params: dict[str, Any]) -> Target:
    from .targets import Target  # the codecs behind it are not needed for --help

    return Target(
        url=params.pop("to"),
        encoding=params.pop("encoding"),
        array_layout=params.pop("array_layout"),
        per_worker=params.pop("port_per_worker"),
        keep_seq=params.pop("keep_seq"),
        worker_topics=params.pop("worker_topics"),
        replay_port=params.pop("replay_port"),
        hwm=params.pop("hwm"),
        wait_subscribers=params.pop("wait_subscribers"),
        linger=params.pop("linger"),
        namespace=params.pop("namespace"),
        component=params.pop("component"),
        dynamo_endpoint=params.pop("dynamo_endpoint"),
    )


# Where and how replay and bridge send. The NATS credentials are not here: replay adds
# nats_auth_options once, bridge has them with its sources already.
target_options = _group(
    "to",
    _target,
    click.option(
        "--to",
        required=True,
        metavar="URL",
        help="tcp://HOST:PORT or ipc://PATH (a PUB that binds, as an engine does) or "
        "nats://HOST:PORT[,nats://HOST:PORT...][/SUBJECT] (Dynamo; several servers of "
        "one cluster: the client fails over).",
    ),
    click.option(
        "--format",
        "encoding",
        type=click.Choice([*ZMQ_FORMATS, *NATS_FORMATS]),
        help="raw (recorded bytes; default for engine batches to ZMQ), vllm, "
        "vllm-array, sglang, seed; dynamo (default on NATS), dynamo-json.",
    ),
    click.option(
        "--array-layout",
        default=DEFAULT_ARRAY_LAYOUT,
        show_default=True,
        type=click.Choice(ARRAY_LAYOUTS),
        help="vLLM release whose array length --format vllm-array writes.",
    ),
    click.option(
        "--port-per-worker",
        is_flag=True,
        help="One PUB per worker on consecutive ports (port + i), like vLLM DP ranks.",
    ),
    click.option("--keep-seq", is_flag=True, help="Send the recorded seq instead of a fresh one."),
    click.option(
        "--worker-topics",
        metavar="MODEL",
        help="All workers on one socket, each message on topic kv@<worker>@MODEL "
        "(llm-d's convention; tap reads the worker back from it).",
    ),
    click.option(
        "--replay-port",
        type=click.IntRange(1, 65535),
        metavar="PORT",
        help="Serve a vLLM-style replay ROUTER on PORT (+ i per worker).",
    ),
    click.option(
        "--hwm",
        type=click.IntRange(min=1),
        default=100_000,
        show_default=True,
        metavar="MESSAGES",
        help="ZMQ send high-water mark per subscriber (vLLM's default); a subscriber "
        "this far behind makes sending wait (counted in the report).",
    ),
    click.option(
        "--wait-subscribers",
        type=click.IntRange(min=0),
        default=0,
        metavar="N",
        help="Hold the first batch until N subscribers joined (ZMQ).",
    ),
    click.option(
        "--linger",
        type=click.FloatRange(min=0),
        default=0.0,
        metavar="SECONDS",
        help="Keep sockets (and the replay ROUTER) open this long after the end.",
    ),
    click.option("--namespace", default="dynamo", show_default=True, help="Dynamo namespace."),
    click.option("--component", default="backend", show_default=True, help="Dynamo component."),
    click.option(
        "--endpoint",
        "dynamo_endpoint",
        default="generate",
        show_default=True,
        help="Dynamo endpoint.",
    ),
)

# --json, declared once per meaning: every command has it, and the same meaning reads the same
json_lines_option = click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="JSON lines on stdout (one object per event); diagnostics stay on stderr.",
)
json_report_option = click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="The report as one JSON object on stdout; diagnostics stay on stderr.",
)
json_snapshots_option = click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="One JSON snapshot per refresh on stdout instead of a screen.",
)


def _output(params: dict[str, Any]) -> Output:
    from .output import Output

    return Output(
        as_json=params.pop("as_json"),
        quiet=params.pop("quiet"),
        hash_style=params.pop("hash_format"),
    )


def _report_output(params: dict[str, Any]) -> Output:
    from .output import Output

    return Output(as_json=params.pop("as_json"), quiet=params.pop("quiet"))


output_options = _group(
    "out",
    _output,
    json_lines_option,
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


def reporting(quiet_help: str, json_option: F = json_report_option) -> Callable[[F], F]:
    """``--json`` and ``-q`` of a command that ends with a report, reaching it as one
    :class:`Output` (keyword ``out``); ``quiet_help`` says what that command's ``-q`` silences."""
    return _group(
        "out",
        _report_output,
        json_option,
        click.option("-q", "--quiet", is_flag=True, help=quiet_help),
    )


report_options = reporting("No progress, diagnostics or report on stderr.")


def index_timeout_option(url_option: str) -> Any:
    """How long a command waits on a router's index over HTTP (each request), named after the
    option that gives the index's URL: ``--index-timeout``, ``--against-timeout``."""
    return click.option(
        f"{url_option}-timeout",
        "index_timeout",
        type=click.FloatRange(min=0, min_open=True),
        default=10.0,
        show_default=True,
        metavar="SECONDS",
        help=f"With {url_option} URL: give up on the index after this long (exit 1).",
    )


def _until(ctx: click.Context, param: click.Parameter, value: str | None) -> Until | None:
    if value is None:
        return None
    try:
        return Until.parse(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


until_option = click.option(
    "--until",
    metavar="TIME|seq:N",
    callback=_until,
    help="Recordings: the index as it stood then: batches received at or before TIME "
    "(ISO-8601 or unix seconds), or numbered at most N by their own publisher.",
)
"""``--until`` of the commands that build a router's index (index, query)."""
