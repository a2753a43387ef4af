"""Commands never import each other: what two commands share lives in a non-command module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

COMMANDS = Path(__file__).resolve().parent.parent / "kvctl" / "commands"


@pytest.mark.parametrize("path", sorted(COMMANDS.glob("*.py")), ids=lambda p: p.name)
def test_a_command_imports_no_other_command(path):
    siblings = {p.stem for p in COMMANDS.glob("*.py")} - {"__init__"}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:  # from .x import y / from . import x
                names = [node.module] if node.module else [a.name for a in node.names]
            elif node.module and node.module.startswith("kvctl.commands."):
                names = [node.module.rsplit(".", 1)[1]]
            else:
                continue
            assert not set(names) & siblings, f"{path.name}:{node.lineno} imports {names}"
