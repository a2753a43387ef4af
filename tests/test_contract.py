"""Every command keeps the conventions: documented, an Example in its help, --json, usage
errors exit 2; the README documents every command; codecs stay pure."""

from __future__ import annotations

import ast
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

import kvctl.cli
from kvctl import commands
from kvctl.cli import cli

REPO = Path(__file__).resolve().parent.parent
COMMANDS = cli.list_commands(None)  # type: ignore[arg-type]


def test_commands_exist():
    assert "tap" in COMMANDS


@pytest.mark.parametrize("name", COMMANDS)
def test_help_has_an_example_and_json(name):
    result = CliRunner().invoke(cli, [name, "--help"])
    assert result.exit_code == 0
    assert "Example:" in result.output, f"`kvctl {name} --help` has no Example: block"
    assert "--json" in result.output, f"`kvctl {name}` has no --json"


@pytest.mark.parametrize("name", COMMANDS)
def test_readme_documents_every_command(name):
    readme = (REPO / "README.md").read_text()
    assert re.search(rf"^### `kvctl {name}\b", readme, re.M), f"README lacks `kvctl {name}`"


@pytest.mark.parametrize("name", COMMANDS)
def test_unknown_option_is_a_usage_error(name):
    result = subprocess.run(
        [sys.executable, "-m", "kvctl", name, "--no-such-option"], capture_output=True, timeout=30
    )
    assert result.returncode == 2 and b"Traceback" not in result.stderr


def test_the_help_lists_every_command_module():
    """``kvctl --help`` lists the commands from kvctl.cli.COMMANDS: every module is there."""
    modules = {
        m.name.replace("_", "-")
        for m in pkgutil.iter_modules(commands.__path__)
        if not m.name.startswith("_")
    }
    assert set(kvctl.cli.COMMANDS) == modules
    for name in COMMANDS:
        assert cli.get_command(None, name).name == name  # type: ignore[arg-type]


@pytest.mark.parametrize("name", COMMANDS)
def test_the_help_lists_each_command_s_own_summary(name):
    """The summary in kvctl.cli.COMMANDS is the command's own, shortened alike at any width."""
    command = cli.get_command(None, name)  # type: ignore[arg-type]
    assert command is not None and not command.hidden
    listed = click.Command(name, help=kvctl.cli.COMMANDS[name])
    fix = f"in kvctl/cli.py COMMANDS: {name!r}: {command.get_short_help_str(10**6)!r}"
    for limit in range(1, 200):
        assert listed.get_short_help_str(limit) == command.get_short_help_str(limit), fix


@pytest.mark.parametrize("width", [40, 60, 80, 100, 200])
def test_the_command_list_is_click_s_own(width):
    """Byte for byte what click lists when it imports every command to ask its help."""
    ctx = click.Context(cli, info_name="kvctl", max_content_width=100, terminal_width=width)
    static, imported = ctx.make_formatter(), ctx.make_formatter()
    cli.format_commands(ctx, static)
    click.Group.format_commands(cli, ctx, imported)
    assert static.getvalue() == imported.getvalue()


HEAVY_KVCTL = (
    "kvctl.formats",
    "kvctl.recording",
    "kvctl.engine",
    "kvctl.transports",
    "kvctl.output",
    "kvctl.session",
    "kvctl.targets",
    "kvctl.plots",
    "kvctl.stats",
)
"""What decodes or encodes wire formats (msgpack, msgspec), reads or writes recordings
(pyarrow), simulates, opens sockets (zmq, nats) or prints through rich: a command imports them
when it runs, never for its --help."""

_LOADED_BY_HELP = """
import sys
before = set(sys.modules)
import kvctl.cli
try:
    kvctl.cli.main(sys.argv[1:])
except SystemExit:
    pass
print(" ".join(sorted(set(sys.modules) - before)), file=sys.stderr)  # stdout has the help
"""


@pytest.mark.parametrize("name", [None, *COMMANDS])
def test_help_is_fast_and_imports_nothing_heavy(name):
    """``kvctl --help`` and ``kvctl CMD --help`` import click and what the help text needs:
    no other third-party package, no asyncio, none of the kvctl modules above."""
    args = [name, "--help"] if name else ["--help"]
    result = subprocess.run(
        [sys.executable, "-c", _LOADED_BY_HELP, *args],
        cwd=REPO,
        capture_output=True,
        timeout=30,
        check=True,
    )
    loaded = result.stderr.decode().split()
    heavy = [
        m
        for m in loaded
        if m.startswith(HEAVY_KVCTL)
        or m.split(".")[0] == "asyncio"
        or m.split(".")[0] not in {*sys.stdlib_module_names, "click", "kvctl"}
    ]
    assert not heavy, f"`kvctl {' '.join(args)}` imports {heavy}"
    if name is None:  # the command list comes from kvctl.cli.COMMANDS, not from the commands
        assert not [m for m in loaded if m.startswith("kvctl.commands.")]


NOT_IN_ENGINE = {"zmq", "nats", "click", "rich", "socket", "asyncio", "threading", "time"}
NOT_IN_CODECS = NOT_IN_ENGINE | {"os", "pathlib", "io"}
PURE_MODULES = [(p, NOT_IN_CODECS) for p in sorted((REPO / "kvctl" / "formats").glob("*.py"))] + [
    (p, NOT_IN_ENGINE) for p in sorted((REPO / "kvctl" / "engine").glob("*.py"))
]


@pytest.mark.parametrize("path,forbidden", PURE_MODULES, ids=lambda p: getattr(p, "name", ""))
def test_codecs_and_engine_are_pure(path, forbidden):
    """Codecs take bytes and return events; the engine reads no clock and opens no socket (it
    may read a trace file)."""
    tree = ast.parse(path.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & forbidden, path.name


INSTALLED_WITH_KVCTL = {"click", "rich", "zmq", "msgpack", "nats", "pyarrow", "xxhash", "msgspec"}
"""What ``pip install kvctl`` brings ([project.dependencies], by import name)."""
EXTRAS_WHERE_USED = {"matplotlib": {"plots.py"}, "tokenizers": {"query.py"}}
"""An optional extra is imported by one module, which says how to install it when missing."""


def test_every_import_is_installed_with_kvctl_or_an_extra_where_it_is_used():
    """The plain install runs every command: kvctl imports nothing else (numpy included: it
    comes with the test extras, so only this test and CI's plain-install smoke would see it)."""
    outside = []
    for path in sorted((REPO / "kvctl").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for top in {name.split(".")[0] for name in names}:
                if top in sys.stdlib_module_names or top in INSTALLED_WITH_KVCTL | {"kvctl"}:
                    continue
                if path.name in EXTRAS_WHERE_USED.get(top, ()):
                    continue
                outside.append(f"{path.relative_to(REPO)}:{node.lineno} imports {top}")
    assert not outside, outside


def test_exit_codes_are_documented():
    readme = (REPO / "README.md").read_text()
    for code in ("0", "1", "2", "3", "130"):
        assert re.search(rf"^\| `?{code}`? \|", readme, re.M), f"exit code {code} not in README"


def test_readme_rule_table_is_the_checker_s():
    from kvctl.checks import rules_markdown

    assert rules_markdown().strip() in (REPO / "README.md").read_text()


def test_readme_schema_table_is_the_recording_s():
    from kvctl.recording.schema import schema_table

    assert schema_table() in (REPO / "README.md").read_text()


@pytest.mark.parametrize("name", COMMANDS)
def test_help_groups_options_and_names_their_environment_variables(name):
    """Shared options sit in the same section in every command, and every option's help names
    the variable that sets it (the one click reads, derived from auto_envvar_prefix)."""
    import click

    from kvctl.help import OPTIONS, SECTIONS, section_of

    command = cli.get_command(None, name)  # type: ignore[arg-type]
    result = CliRunner().invoke(cli, [name, "--help"], terminal_width=200)
    assert result.exit_code == 0
    help_text = " ".join(result.output.split())  # wrapped lines joined
    options = [p for p in command.params if isinstance(p, click.Option)]
    sections = {section_of(p) for p in options} | {OPTIONS}
    for title in sections:
        assert f"\n{title}:\n" in result.output, f"`kvctl {name} -h` lacks the {title} section"
    assert "Output" in sections  # --json everywhere
    for option in options:
        variable = option.envvar or f"KVCTL_{name.upper()}_{option.name.upper()}"
        assert f"env var: {variable}" in help_text, f"`kvctl {name} -h`: {option.opts}"
    if any("--subject" in p.opts for p in options):  # the commands reading live sources
        assert set(SECTIONS) - {"Target"} <= sections
