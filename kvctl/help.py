"""``--help`` for every command: options in sections (sources, connection, target, filters,
stop conditions, output; the rest under "Options"), each with the environment variable that
sets it. Commands declare ``@click.command(NAME, cls=KvctlCommand)``; the sections are decided
here, once, by each option's long name, so shared options land in the same section in every
command."""

from __future__ import annotations

import os
from typing import Any

import click

OPTIONS = "Options"
"""The section of everything specific to one command (listed first: what the command is for)."""

SECTIONS: dict[str, tuple[str, ...]] = {
    "Sources": ("--subject", "--from-start", "--replay-endpoint", "--topic"),
    "Connection / NATS auth": (
        "--connect-timeout",
        "--max-queue",
        "--nats-user",
        "--nats-password",
        "--nats-token",
        "--nats-creds",
        "--tls-ca",
        "--tls-cert",
        "--tls-key",
    ),
    "Target": (
        "--to",
        "--format",
        "--array-layout",
        "--port-per-worker",
        "--keep-seq",
        "--worker-topics",
        "--replay-port",
        "--wait-subscribers",
        "--linger",
        "--namespace",
        "--component",
        "--endpoint",
        "--host",
        "--port",
        "--base-port",
        "--replay-base-port",
        "--start-delay",
        "--hwm",
    ),
    "Filters": ("--type", "--worker"),
    "Stop conditions": ("--count", "--duration", "--idle-timeout", "--requests", "--until"),
    "Output": (
        "--json",
        "--hash-format",
        "--quiet",
        "--output",
        "--overwrite",
        "--append",
        "--rotate-size",
        "--rotate-every",
        "--fsync",
        "--plot",
    ),
}
"""Section title -> the long option names it holds, in display order after ``Options``."""

_SECTION_OF = {flag: title for title, flags in SECTIONS.items() for flag in flags}

# The ``--format`` names, written out rather than asked of the codec registry (kvctl.formats):
# a command's --help shows them as choices, and importing the codecs (msgspec, msgpack) takes
# as long as importing click. tests/test_formats_registry.py keeps them equal to the registry.
ZMQ_ENCODINGS: tuple[str, ...] = ("vllm", "vllm-array", "sglang", "seed")
"""The codecs' encodings sent on ZMQ, in registry order (``format_names(ZMQ)``)."""
NATS_FORMATS: tuple[str, ...] = ("dynamo", "dynamo-json")
"""The codecs' encodings sent on NATS, in registry order (``format_names(NATS)``)."""
ZMQ_FORMATS: tuple[str, ...] = ("raw", *ZMQ_ENCODINGS)
"""``--format`` names a ZMQ target sends: the recorded bytes (``raw``) or a codec's encoding."""
ARRAY_LAYOUTS: tuple[str, ...] = ("0.9", "0.10.2", "0.14", "0.17", "0.20", "0.22")
"""The vLLM array layouts ``--array-layout`` offers (``engine_zmq.ARRAY_LAYOUTS``)."""
DEFAULT_ARRAY_LAYOUT = "0.22"
"""``engine_zmq.DEFAULT_ARRAY_LAYOUT``."""


def section_of(param: click.Parameter) -> str:
    for flag in param.opts:
        if flag in _SECTION_OF:
            return _SECTION_OF[flag]
    return OPTIONS


def envvar_of(param: click.Parameter, ctx: click.Context, set_only: bool = False) -> str | None:
    """The environment variable that sets ``param``: its own (``KVCTL_NATS_USER``) or the one
    click derives from ``auto_envvar_prefix`` (``KVCTL_TAP_COUNT``). ``set_only``: among
    several own names, the one that is set (the one a bad value came from)."""
    names = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar or ())
    for name in names:
        if not set_only or os.environ.get(name):
            return name
    if (
        isinstance(param, click.Option)
        and param.allow_from_autoenv
        and param.name
        and ctx.auto_envvar_prefix
    ):
        return f"{ctx.auto_envvar_prefix}_{param.name.upper()}"
    return None


class KvctlCommand(click.Command):
    """A command whose help groups its options into sections and names their variables."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:
            if isinstance(param, click.Option):
                param.show_envvar = True

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        sections: dict[str, list[tuple[str, str]]] = {OPTIONS: [], **{t: [] for t in SECTIONS}}
        for param in self.get_params(ctx):
            if not isinstance(param, click.Option):
                continue  # arguments are in the usage line and described in the text
            record = param.get_help_record(ctx)
            if record is not None:
                sections[section_of(param)].append(record)
        for title, rows in sections.items():
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)
