"""kvctl stream: set up and look at a fleet stream on NATS JetStream, split into partitions
that each hold whole workers (the layout is described in kvctl/partitions.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from ..errors import TransportError, UsageError
from ..help import KvctlCommand
from ..options import json_report_option, nats_auth_options

if TYPE_CHECKING:
    from rich.console import Console

    from ..partitions import StreamSettings
    from ..transports.nats import NatsOptions

ACTIONS = ("init", "info")
_INIT_ONLY = ("partitions", "replicas", "max_age", "update")


@click.command("stream", cls=KvctlCommand)
@click.argument("action", type=click.Choice(ACTIONS))
@click.argument("servers", metavar="nats://HOST:PORT[,nats://HOST:PORT...]")
@click.option("--name", required=True, metavar="NAME", help="The stream's name.")
@click.option(
    "--partitions",
    type=click.IntRange(min=1),
    metavar="N",
    help="init: split the stream into N partitions by worker (required for init).",
)
@click.option(
    "--replicas",
    type=click.IntRange(min=1),
    metavar="R",
    help="init: copies of each message on R servers of a cluster. Default: 1.",
)
@click.option(
    "--max-age",
    metavar="DURATION",
    help="init: drop messages older than this (e.g. 7d, 12h, 90m; 0 for no limit). "
    "Default: no limit.",
)
@click.option(
    "--update",
    is_flag=True,
    help="init: change an existing stream's partitions, replicas or max age, where the "
    "server allows it (new partitions apply to new messages only).",
)
@click.option(
    "--connect-timeout",
    type=click.FloatRange(min=0.1),
    default=5.0,
    show_default=True,
    metavar="SECONDS",
    help="How long to wait for the server and for each JetStream answer.",
)
@nats_auth_options
@json_report_option
def command(
    action: str,
    servers: str,
    name: str,
    as_json: bool,
    nats: NatsOptions,
    connect_timeout: float,
    **init_options: Any,
) -> None:
    """Set up a fleet stream on NATS JetStream split into partitions by worker
    (`init`), or show its partitions, consumers and their lag (`info`).

    Publishers send a worker's messages to kvctl.NAME.events.WORKER; the stream stores them
    as kvctl.NAME.P.WORKER, P being the worker's partition (FNV-1a of WORKER mod N, by the
    server's subject mapping), so one reader per partition sees whole workers. `init` is
    idempotent: run again with the same settings it says "exists, unchanged"; with others
    it exits 2 saying what differs (--update changes them). Several servers, comma
    separated, are tried in turn. --json prints the result as one JSON object.

    \b
    Example:
      kvctl stream init nats://127.0.0.1:4222 --name fleet --partitions 8 --replicas 3 --max-age 7d
      kvctl stream info nats://a:4222,nats://b:4222 --name fleet
      kvctl stream info nats://127.0.0.1:4222 --name fleet --json | jq .partitions
    """
    from ..output import Output
    from ..partitions import check_name

    problem = check_name(name)
    if problem is not None:
        raise UsageError(problem)
    out = Output(as_json=as_json)
    if action == "init":
        settings = _settings(
            name, init_options["partitions"], init_options["replicas"], init_options["max_age"]
        )
        report = _init(servers, nats, settings, init_options["update"])
    else:
        given = [f"--{k.replace('_', '-')}" for k in _INIT_ONLY if init_options.get(k)]
        if given:
            raise UsageError(f"{', '.join(given)}: for `kvctl stream init` only")
        report = _info(servers, nats, name)
    if out.as_json:
        out.json(report)
    elif action == "init":
        _print_init(report, out.stdout)
    else:
        _print_info(report, out.stdout)


def _settings(
    name: str, partitions: int | None, replicas: int | None, max_age: str | None
) -> StreamSettings:
    from ..partitions import StreamLayout, StreamSettings, parse_age

    if partitions is None:
        raise UsageError("stream init needs --partitions N")
    try:
        age = parse_age(max_age) if max_age is not None else 0.0
    except ValueError as exc:
        raise UsageError(f"--max-age: {exc}") from None
    return StreamSettings(StreamLayout(name, partitions), replicas or 1, age)


def _existing(info: Any) -> StreamSettings | None:
    from ..partitions import StreamSettings
    from ..transports.nats import fleet_layout

    layout = fleet_layout(info)
    if layout is None:
        return None
    return StreamSettings(layout, info.config.num_replicas or 1, info.config.max_age or 0.0)


def _init(servers: str, nats: NatsOptions, asked: StreamSettings, update: bool) -> dict[str, Any]:
    from ..partitions import describe_age
    from ..transports.nats import run_jetstream, stream_info_or_none

    name = asked.layout.name

    async def work(js: Any) -> dict[str, Any]:
        from nats.js.api import StorageType, StreamConfig, SubjectTransform
        from nats.js.errors import APIError

        layout = asked.layout
        changes: dict[str, Any] = {
            "subject_transform": SubjectTransform(
                src=layout.listen_subject, dest=layout.transform_dest
            ),
            "num_replicas": asked.replicas,
            "max_age": asked.max_age_s,
        }
        info = await stream_info_or_none(js, name)
        try:
            if info is None:
                config = StreamConfig(
                    name=name,
                    subjects=[layout.listen_subject],
                    storage=StorageType.FILE,
                    **changes,
                )
                await js.add_stream(config)
                status = "created"
            else:
                existing = _existing(info)
                if existing is None:
                    raise UsageError(
                        f"stream {name} exists and is not one kvctl stream init made "
                        f"(subjects {', '.join(info.config.subjects or ()) or 'none'})"
                    )
                differences = asked.differences(existing)
                if not differences:
                    status = "exists, unchanged"
                elif not update:
                    raise UsageError(
                        f"stream {name} exists with other settings: {'; '.join(differences)} "
                        "(--update to change them)"
                    )
                else:
                    # from the stream's own configuration: what kvctl does not set is kept
                    config = info.config.evolve(**changes)
                    await js.update_stream(config)
                    status = "updated"
        except APIError as exc:  # the server refused these settings (say, R3 on one server)
            raise UsageError(f"stream {name}: {exc.description or exc}") from None
        # asked again: the answer to a create or update has no cluster information
        return _init_report(status, await js.stream_info(name))

    def _init_report(status: str, info: Any) -> dict[str, Any]:
        config = info.config
        return {
            "stream": name,
            "status": status,
            "partitions": asked.layout.partitions,
            "replicas": config.num_replicas,
            "max_age_s": config.max_age or 0,
            "max_age": describe_age(config.max_age or 0),
            "storage": str(getattr(config.storage, "value", config.storage)),
            "duplicate_window_s": config.duplicate_window,
            "publish_subject": asked.layout.publish_subject("WORKER"),
            "subjects": list(config.subjects or ()),
            "transform": {
                "src": config.subject_transform.src,
                "dest": config.subject_transform.dest,
            },
            "partition_subjects": [
                asked.layout.partition_subject(p) for p in range(asked.layout.partitions)
            ],
            "cluster": _cluster(info.cluster),
        }

    return run_jetstream(servers, nats, work)


def _cluster(cluster: Any) -> dict[str, Any] | None:
    if cluster is None:
        return None
    return {
        "name": cluster.name,
        "leader": cluster.leader,
        "replicas": [
            {
                "name": peer.name,
                "current": bool(peer.current),
                "offline": bool(peer.offline),
                "lag": peer.lag or 0,
                "active_s": round((peer.active or 0) / 1e9, 3),
            }
            for peer in cluster.replicas or ()
        ],
    }


def _info(servers: str, nats: NatsOptions, name: str) -> dict[str, Any]:
    from ..partitions import describe_age
    from ..transports.nats import all_consumers, run_jetstream, stream_info_or_none

    async def work(js: Any) -> dict[str, Any]:
        # subjects_filter ">": the per-subject message counts (the server sends up to 100k
        # subjects; a kvctl stream has one per worker)
        info = await stream_info_or_none(js, name, subjects_filter=">")
        if info is None:
            raise TransportError(f"no stream {name} (kvctl stream init ... --name {name})")
        consumers = await all_consumers(js, name)
        return _info_report(info, consumers)

    def _info_report(info: Any, consumers: list[Any]) -> dict[str, Any]:
        config, state = info.config, info.state
        existing = _existing(info)
        layout = existing.layout if existing else None
        count = layout.partitions if layout else 0
        by_partition: list[dict[str, Any]] = [
            {"partition": p, "subject": layout.partition_subject(p), "messages": 0, "workers": 0}
            for p in range(count)
            if layout
        ]
        other = 0
        for subject, messages in (state.subjects or {}).items():
            place = layout.parse_stored(subject) if layout else None
            if place is None or place[0] >= count:
                other += messages
                continue
            by_partition[place[0]]["messages"] += messages
            by_partition[place[0]]["workers"] += 1
        return {
            "stream": name,
            "kvctl_layout": layout is not None,
            "partitions": by_partition,
            "other_subjects_messages": other,
            "messages": state.messages,
            "bytes": state.bytes,
            "first_seq": state.first_seq,
            "last_seq": state.last_seq,
            "replicas": config.num_replicas,
            "max_age": describe_age(config.max_age or 0),
            "subjects": list(config.subjects or ()),
            "consumers": [_consumer(c) for c in consumers],
            "cluster": _cluster(info.cluster),
        }

    return run_jetstream(servers, nats, work)


def _consumer(info: Any) -> dict[str, Any]:
    config = info.config
    filters = list(config.filter_subjects or ()) or (
        [config.filter_subject] if config.filter_subject else []
    )
    return {
        "name": info.name,
        "durable": bool(config.durable_name),
        "filter_subjects": filters,
        "num_pending": info.num_pending or 0,
        "num_ack_pending": info.num_ack_pending or 0,
        "num_redelivered": info.num_redelivered or 0,
        "num_waiting": info.num_waiting or 0,
        "delivered_stream_seq": info.delivered.stream_seq if info.delivered else 0,
        "ack_floor_stream_seq": info.ack_floor.stream_seq if info.ack_floor else 0,
    }


def _cluster_line(cluster: dict[str, Any] | None) -> str:
    if cluster is None:
        return "cluster: -"
    peers = ", ".join(
        f"{p['name']} ({'offline' if p['offline'] else 'current' if p['current'] else 'behind'}"
        f", lag {p['lag']})"
        for p in cluster["replicas"]
    )
    where = f"cluster {cluster['name']}" if cluster["name"] else "single server"
    return f"{where}: leader {cluster['leader']}" + (f"; replicas {peers}" if peers else "")


def _print_init(report: dict[str, Any], console: Console) -> None:
    from rich.markup import escape

    from ..text import plural

    lines = [
        f"[bold]stream {escape(report['stream'])}[/]: {report['status']}",
        f"{plural(report['partitions'], 'partition')}, {plural(report['replicas'], 'replica')}, "
        f"max age {report['max_age']}, {report['storage']} storage, "
        f"duplicate window {report['duplicate_window_s']:g} s",
        f"publish to:  {escape(report['publish_subject'])} (one token per worker)",
        f"stored as:   {escape(report['transform']['dest'])}",
        f"partition P: {escape(report['partition_subjects'][0].replace('.0.', '.P.'))}",
        escape(_cluster_line(report["cluster"])),
    ]
    console.print("\n".join(lines), soft_wrap=False)


def _print_info(report: dict[str, Any], console: Console) -> None:
    from rich.markup import escape
    from rich.table import Table

    from ..text import plural

    layout = (
        f"{plural(len(report['partitions']), 'partition')}"
        if report["kvctl_layout"]
        else "not a kvctl partitioned stream"
    )
    lines = [
        f"[bold]stream {escape(report['stream'])}[/]: {layout}, "
        f"{plural(report['replicas'], 'replica')}, max age {report['max_age']}",
        f"{plural(report['messages'], 'message', thousands=True)}, "
        f"{plural(report['bytes'], 'byte', thousands=True)}, "
        f"seq {report['first_seq']}..{report['last_seq']}",
        escape(_cluster_line(report["cluster"])),
    ]
    if report["other_subjects_messages"]:
        lines.append(f"{report['other_subjects_messages']:,} messages outside the partitions")
    console.print("\n".join(lines), soft_wrap=False)
    if report["partitions"]:
        table = Table(title="partitions", title_justify="left")
        for column in ("partition", "subject", "messages", "workers"):
            table.add_column(column, justify="left" if column == "subject" else "right")
        for row in report["partitions"]:
            table.add_row(
                str(row["partition"]),
                escape(row["subject"]),
                f"{row['messages']:,}",
                str(row["workers"]),
            )
        console.print(table, soft_wrap=False)
    if report["consumers"]:
        table = Table(title="consumers", title_justify="left")
        for column in ("consumer", "filter", "pending", "ack pending", "redelivered"):
            table.add_column(
                column, justify="left" if column in ("consumer", "filter") else "right"
            )
        for row in report["consumers"]:
            table.add_row(
                escape(row["name"]),
                escape(", ".join(row["filter_subjects"]) or "all"),
                f"{row['num_pending']:,}",
                f"{row['num_ack_pending']:,}",
                f"{row['num_redelivered']:,}",
            )
        console.print(table, soft_wrap=False)
    else:
        console.print("no consumers")
