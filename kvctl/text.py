"""Wording shared by every command's human-facing text: counted nouns. (The consoles that
print it are made by :class:`kvctl.output.Output`.)"""

from __future__ import annotations

import re

_IRREGULAR = {"reply": "replies", "is": "are", "was": "were"}

CLOSING_WORDS = "kvctl.closing_words"
"""Where a command leaves, in click's context ``meta``, what Ctrl-C (or SIGTERM) ends it with:
``(finish, quiet)``, set by ``session.on_interrupt`` and read by ``cli.py`` only."""


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


DURATION_UNITS: dict[str, float] = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """Seconds from ``90``, ``90s``, ``5m``, ``12h`` or ``7d`` (a fraction allowed: ``1.5h``);
    ValueError for anything else."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]?)\s*", text)
    if not match or match.group(2).lower() not in DURATION_UNITS:
        raise ValueError(f"{text!r} is not a duration (e.g. 90s, 5m, 12h, 7d)")
    return float(match.group(1)) * DURATION_UNITS[match.group(2).lower()]
