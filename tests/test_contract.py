"""Every command keeps the conventions: documented, an Example in its help, --json, usage
errors exit 2; the README documents every command; codecs stay pure."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

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


def test_help_is_fast_and_imports_nothing_heavy():
    code = (
        "import sys, kvctl.cli as c; from click.testing import CliRunner; "
        "CliRunner().invoke(c.cli, ['--help']); "
        "print(sorted(m for m in ('pyarrow', 'nats', 'rich', 'zmq', 'matplotlib') "
        "if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, timeout=30, check=True
    ).stdout.decode()
    assert out.strip() == "[]"


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


def test_exit_codes_are_documented():
    readme = (REPO / "README.md").read_text()
    for code in ("0", "1", "2", "3", "130"):
        assert re.search(rf"^\| `?{code}`? \|", readme, re.M), f"exit code {code} not in README"


def test_readme_rule_table_is_the_checker_s():
    from kvctl.checks import rules_markdown

    assert rules_markdown().strip() in (REPO / "README.md").read_text()


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
