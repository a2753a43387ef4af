"""The shape of the code, kept by tests: the import graph of ``kvctl/`` (function-level imports
included) has no cycle and never goes up a layer, mypy finds nothing, ruff format is applied."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvctl"

# Lower layers never import higher ones. Pure models and codecs know no sockets, files or
# clocks; transports move bytes only; recordings sit below the pipeline; commands are on top.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "pure",
        (
            "__init__",
            "errors",
            "events",
            "text",
            "redact",
            "selection",
            "sequence",
            "formats",
            "engine",
            "state",
            "checks",
            "stats",
            "routing",
            "partitions",
        ),
    ),
    ("transports", ("transports",)),
    ("recording", ("recording",)),
    ("pipeline", ("pipeline", "pacing")),
    (
        "sinks and options",
        ("targets", "publishing", "output", "options", "session", "help", "plots", "indexing"),
    ),
    ("commands", ("commands", "cli", "__main__")),
]
RANK = {top: rank for rank, (_, tops) in enumerate(LAYERS) for top in tops}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Every kvctl module ``name`` imports, anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "kvctl")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.split(".")[0] == "kvctl":
                target = node.module
            else:
                continue
            for alias in node.names:  # `from . import x` imports the module x
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in known else target)
    return {m for m in found if m in known and m != name}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


def top_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_no_import_goes_up_a_layer():
    wrong = set()
    for module, targets in graph().items():
        for target in targets:
            if RANK[top_of(target)] > RANK[top_of(module)]:
                wrong.add((module, target))
    assert not wrong, "\n".join(f"{a} imports {b}" for a, b in sorted(wrong))


def test_every_module_has_a_layer():
    assert {top_of(m) for m in modules()} <= set(RANK)


def test_the_import_graph_has_no_cycle():
    edges = graph()
    state: dict[str, int] = {}  # 1 visiting, 2 done
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt) :] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)


def test_a_command_imports_no_other_command():
    for module, targets in graph().items():
        if module.startswith("kvctl.commands."):
            others = {t for t in targets if t.startswith("kvctl.commands.")}
            assert not others, f"{module} imports {sorted(others)}"


def test_only_output_builds_consoles():
    """One Output per command run: widths, styles and quiet are decided in one module."""
    builders = [
        str(path.relative_to(ROOT))
        for path in PACKAGE.rglob("*.py")
        if path.name != "output.py" and "Console(" in path.read_text()
    ]
    assert not builders, builders


def test_mypy_finds_nothing():
    pytest.importorskip("mypy", reason="mypy comes with the test extra")
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "kvctl"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-4000:]


def test_ruff_format_is_applied():
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    result = subprocess.run(
        [ruff, "format", "--check", "."], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout[-4000:]
