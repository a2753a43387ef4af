"""The ``kvctl`` command group. Subcommands live one per module in ``kvctl/commands`` and are
imported only when used: ``kvctl --help`` lists them from :data:`COMMANDS` and imports none, so
it costs little more than importing click. ``main`` is the one place where exceptions become
exit codes."""

from __future__ import annotations

import importlib
import os
import signal
import sys
from collections.abc import Callable

import click

from . import __version__
from .errors import ExitCode, KvctlError
from .help import envvar_of
from .text import CLOSING_WORDS


class Interrupted(KvctlError):
    """Ctrl-C or SIGTERM: exit 130 after the command's closing line (empty with ``-q``)."""

    exit_code = ExitCode.INTERRUPTED


COMMANDS: dict[str, str] = {
    "bridge": "Forward live streams to a target as they arrive: engine ZMQ -> Dynamo on NATS "
    "(what Dynamo's ZMQ relay does in-process), old vLLM arrays -> the new map form, NATS -> ZMQ.",
    "cat": "Print the events of recordings (files, segment directories or journals) in recorded "
    "order, with tap's formatter, filters and stop conditions.",
    "check": "Check KV-event streams for what breaks KV-aware routing.",
    "index": "Build the prefix index a Dynamo KV router would hold and serve it over HTTP.",
    "inspect": "Show a recording's schema version, time range, seq range per publisher, counts "
    "by type and worker, gaps, malformed messages, size and compression ratio.",
    "query": "Ask a prefix index which workers hold a prompt, and explain where each routing "
    "policy would send it.",
    "record": "Record KV-event streams to Parquet, one row per event, raw bytes kept.",
    "recover": "Convert the journal of a recorder that was killed (kill -9, power loss) to "
    "Parquet.",
    "replay": "Replay recordings into an engine (ZMQ PUB that binds) or a router (Dynamo on "
    "NATS), in any producer's format, at the recorded pace, scaled, or at a fixed rate.",
    "simulate": "Run a synthetic engine fleet that publishes realistic KV-cache events.",
    "stats": "Summarise KV-event streams: per worker and overall.",
    "stream": "Set up a fleet stream on NATS JetStream split into partitions by worker (`init`), "
    "or show its partitions, consumers and their lag (`info`).",
    "tap": "Subscribe to KV-event streams and print every event.",
    "top": "Watch KV-event streams live: one row per worker, refreshed every second.",
}
"""Every command (a module of ``kvctl/commands``) and its summary, the first sentence of its
help: what ``kvctl --help`` lists, without importing a command module for it. A copy, kept equal
to the commands by tests/test_contract.py (which prints the entry to paste when they differ):
the commands' docstrings stay the one place the text is written."""


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """click's own listing, shortened by click as it shortens a command's help, from
        :data:`COMMANDS` instead of the imported commands."""
        limit = formatter.width - 6 - max(len(name) for name in COMMANDS)
        rows = [
            (name, click.Command(name, help=summary).get_short_help_str(limit))
            for name, summary in sorted(COMMANDS.items())
        ]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def invoke(self, ctx: click.Context) -> object:
        """Runs the command; the one place that handles Ctrl-C and SIGTERM: the command's
        closing work runs (see ``session.on_interrupt``), then exit 130 with its line."""
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            closing = ctx.meta.pop(CLOSING_WORDS, None)
            if closing is None:  # nothing read yet, or closing already: nothing to say
                raise
            finish, quiet = closing
            line = self._traced(ctx, finish)
            raise Interrupted("" if quiet else line) from None
        except KvctlError:
            self._show_traceback(ctx)
            raise
        except BrokenPipeError:
            # the reader went away (`kvctl tap --json | head`): quiet and successful, like
            # other Unix tools; caught here because click would turn it into exit 1
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise click.exceptions.Exit(0) from None

    def _traced(self, ctx: click.Context, finish: Callable[[], str]) -> str:
        try:
            return finish()
        except KvctlError:  # a recording that could not be finished, say
            self._show_traceback(ctx)
            raise

    @staticmethod
    def _show_traceback(ctx: click.Context) -> None:
        if ctx.params.get("traceback"):
            import traceback  # on an error only: not in the cost of every --help

            traceback.print_exc(file=sys.stderr)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        module = importlib.import_module(f"kvctl.commands.{cmd_name.replace('-', '_')}")
        return module.command


@click.group(
    cls=LazyGroup,
    context_settings={
        "help_option_names": ["-h", "--help"],
        "auto_envvar_prefix": "KVCTL",
        "max_content_width": 100,
    },
)
@click.version_option(__version__, prog_name="kvctl")
@click.option(
    "--traceback",
    is_flag=True,
    help="On an error, print the Python traceback too (for bug reports).",
)
def cli(traceback: bool) -> None:
    """kvctl: tap, record, replay, simulate and check the KV-cache event streams of LLM
    inference engines (vLLM, SGLang, TensorRT-LLM, NVIDIA Dynamo).

    Exit codes: 0 ok, 1 runtime error, 2 usage, 3 `check` found errors, 130 interrupted.
    For a bug report, run the command again with `kvctl --traceback COMMAND ...`.
    """


def _environment_variable(exc: click.ClickException) -> str | None:
    """The ``KVCTL_*`` variable a rejected value came from, when it came from the environment."""
    if (
        not isinstance(exc, click.BadParameter)
        or exc.ctx is None
        or exc.param is None
        or not exc.param.name
    ):
        return None
    source = exc.ctx.get_parameter_source(exc.param.name)
    if source is not click.core.ParameterSource.ENVIRONMENT:
        return None
    return envvar_of(exc.param, exc.ctx, set_only=True)


_HELP_ASKED = getattr(click.exceptions, "NoArgsIsHelpError", ())
"""click >= 8.2 raises this for a bare group: its message is the whole help."""


def _usage_line(exc: click.ClickException) -> str:
    """click's message on one line, pointing at the help of the command it is about."""
    message = " ".join(exc.format_message().split()).rstrip(".")
    command = exc.ctx.command_path if isinstance(exc, click.UsageError) and exc.ctx else None
    return f"{message} (see '{command} --help')" if command else message


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    signal.signal(signal.SIGTERM, _terminate)
    try:
        code = cli.main(args=argv, prog_name="kvctl", standalone_mode=False)
    except click.exceptions.Exit as exc:
        code = exc.exit_code
    except click.ClickException as exc:
        from .redact import redact_url  # on an error only: not in the cost of every --help

        # click declares message Final; redacted in place, every way of showing it is safe
        exc.message = redact_url(exc.message)  # type: ignore[misc]
        variable = _environment_variable(exc)
        if variable:  # the user typed no option: name the variable they set, on one line
            print(f"kvctl: {variable}: {exc.message.rstrip('.')}", file=sys.stderr)
        elif isinstance(exc, _HELP_ASKED):  # bare `kvctl`: the help is the answer
            exc.show()
        else:  # one line that says it is kvctl's, as every other diagnostic does
            print(f"kvctl: {_usage_line(exc)}", file=sys.stderr)
        code = ExitCode.USAGE if isinstance(exc, click.UsageError) else ExitCode.ERROR
    except click.exceptions.Abort:
        code = ExitCode.INTERRUPTED
    except KeyboardInterrupt:
        code = ExitCode.INTERRUPTED
    except KvctlError as exc:
        if str(exc):  # an empty message: already reported (e.g. a quiet interrupt)
            from .redact import redact_url

            # the one place every error passes: no password of a source URL reaches stderr
            print(f"kvctl: {redact_url(str(exc))}", file=sys.stderr)
        code = exc.exit_code
    sys.exit(int(code or 0))
