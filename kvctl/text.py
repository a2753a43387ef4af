"""Wording and layout shared by every command's human-facing text: counted nouns and consoles
that do not cut tables to 80 columns when the output is piped."""

from __future__ import annotations

import os
from typing import Any

_IRREGULAR = {"reply": "replies", "is": "are", "was": "were"}

CLOSING_WORDS = "kvctl.closing_words"
"""Where a command leaves, in click's context ``meta``, what Ctrl-C (or SIGTERM) ends it with:
``(finish, quiet)``, set by ``session.on_interrupt`` and used by ``cli.py`` only."""

PIPED_WIDTH = 100_000
"""Console width when not writing to a terminal: wide enough that no table cell is folded or
ellipsised (rich assumes 80 columns otherwise), so piped output keeps every value whole."""


def plural(n: int, noun: str, many: str | None = None, thousands: bool = False) -> str:
    """``n`` and ``noun`` in the right number: ``1 event``, ``2 events``, ``1 batch``,
    ``0 batches``. ``many`` overrides the plural; ``thousands`` prints 12,345."""
    count = f"{n:,}" if thousands else str(n)
    return f"{count} {noun_for(n, noun, many)}"


def noun_for(n: int, noun: str, many: str | None = None) -> str:
    """The noun alone, singular for exactly one."""
    if n == 1:
        return noun
    if many or noun in _IRREGULAR:
        return many or _IRREGULAR[noun]
    return noun + ("es" if noun.endswith(("s", "sh", "ch", "x", "z")) else "s")


def console(stderr: bool = False, **options: Any) -> Any:
    """A rich Console for tables and reports: as wide as the terminal on a terminal, and
    unbounded when piped (unless COLUMNS says otherwise), so nothing is cut."""
    from rich.console import Console

    options.setdefault("highlight", False)
    out = Console(stderr=stderr, **options)
    if not out.is_terminal and "width" not in options and not os.environ.get("COLUMNS"):
        out.width = PIPED_WIDTH
    return out
