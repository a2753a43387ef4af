"""Secrets never shown: the password or token inside a URL is replaced by ``***`` before the
URL is printed, stored or put in an error message."""

from __future__ import annotations

import re

MASK = "***"

# scheme://USERINFO@rest: userinfo is everything up to the last "@" before the first "/"
_USERINFO = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/?#]*)@")


def redact_url(url: str) -> str:
    """``nats://user:secret@host:4222`` -> ``nats://user:***@host:4222``; a lone token
    (``nats://TOKEN@host``) becomes ``nats://***@host``; URLs without credentials are
    returned unchanged."""
    match = _USERINFO.match(url)
    if match is None:
        return url
    user, sep, _secret = match["userinfo"].partition(":")
    shown = f"{user}:{MASK}" if sep else MASK
    return f"{match['scheme']}{shown}@{url[match.end():]}"


def redact_urls(text: str) -> str:
    """Every URL with credentials inside a longer text (an error message, a command line)."""
    return re.sub(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s/?#]*@\S*",
                  lambda m: redact_url(m.group()), text)


SECRET_OPTIONS = ("--nats-password", "--nats-token", "--nats-creds")
"""Options whose value is a secret (a credentials file's path included: it says where the
keys are)."""


def redact_command(argv: list[str]) -> list[str]:
    """A command line fit to store or show: values of :data:`SECRET_OPTIONS` (``--opt VALUE``
    or ``--opt=VALUE``) and passwords inside URLs become ``***``."""
    shown: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            shown.append(MASK)
            hide_next = False
            continue
        name, sep, _ = arg.partition("=")
        if name in SECRET_OPTIONS:
            shown.append(f"{name}={MASK}" if sep else arg)
            hide_next = not sep
            continue
        shown.append(redact_urls(arg))
    return shown
