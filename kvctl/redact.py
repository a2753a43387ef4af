"""Credentials never written or shown: passwords, tokens and credential paths are replaced by
``***`` in URLs and command lines before they reach a file (Parquet footer, journal, manifest)
or a screen (``inspect``, stderr). Pure functions, no I/O."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

MASK = "***"

# scheme://userinfo@ -- greedy up to the last '@' before the path, so that an unencoded '@' in a
# password is masked too.
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/\s]*)@")
_SECRET_QUERY = re.compile(
    r"(?P<key>[?&;](?:[\w.-]*(?:pass(?:word)?|passwd|token|secret|creds|nkey|jwt|key))=)"
    r"(?P<value>[^&;#\s]*)",
    re.IGNORECASE,
)
# Options whose value is a secret or the path of one (NATS auth, TLS private key).
_SECRET_OPTION = re.compile(
    r"^--[\w-]*(?:password|passwd|token|secret|creds|nkey|jwt|tls-key)$", re.IGNORECASE
)


def _mask_userinfo(match: re.Match[str]) -> str:
    userinfo = match["userinfo"]
    user, sep, _ = userinfo.partition(":")
    # user:password -> user:***; a lone userinfo is a NATS token (nats://TOKEN@host) -> ***
    return f"{match['scheme']}{user}:{MASK}@" if sep else f"{match['scheme']}{MASK}@"


def redact_url(text: str) -> str:
    """``text`` (a URL, or any string holding URLs such as ``0=nats://u:p@h:4222``) with every
    password, URL token and secret query value replaced by ``***``."""
    if "@" not in text and "=" not in text:
        return text  # fast path: nothing a credential could hide in
    text = _USERINFO.sub(_mask_userinfo, text)
    return _SECRET_QUERY.sub(lambda m: m["key"] + MASK, text)


def redact_argv(argv: Iterable[str]) -> list[str]:
    """A command line with the values of secret options (``--nats-password X``,
    ``--nats-token=X``, ``--nats-creds FILE``, ``--tls-key FILE``) and URL credentials
    replaced by ``***``."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        arg = str(arg)
        if hide_next:
            out.append(MASK)
            hide_next = False
            continue
        name, eq, _ = arg.partition("=")
        if _SECRET_OPTION.match(name):
            if eq:
                out.append(f"{name}={MASK}")
            else:
                out.append(arg)
                hide_next = True
            continue
        out.append(redact_url(arg))
    return out


def redact_metadata(metadata: dict[str, Any]) -> dict[str, Any]:
    """A recording's metadata with ``sources`` and ``command`` redacted (other keys as is)."""
    out = dict(metadata)
    if isinstance(out.get("sources"), list):
        out["sources"] = [redact_url(s) if isinstance(s, str) else s for s in out["sources"]]
    if isinstance(out.get("command"), list):
        out["command"] = redact_argv(out["command"])
    return out


def shown_sources(sources: Iterable[str]) -> str:
    """Source arguments as a command shows them on stderr: comma-separated, redacted."""
    return ", ".join(redact_url(source) for source in sources)
