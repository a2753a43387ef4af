"""Exit codes (one enum) and the exceptions that map onto them in ``cli.main``."""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    OK = 0
    ERROR = 1
    """Runtime error: unreachable endpoint, unreadable file, malformed input under --strict."""
    USAGE = 2
    """Bad options or arguments."""
    FINDINGS = 3
    """`check` found errors in the stream."""
    INTERRUPTED = 130


class KvctlError(Exception):
    """An error with a one-line message for stderr and an exit code; no traceback shown."""

    exit_code = ExitCode.ERROR


class UsageError(KvctlError):
    exit_code = ExitCode.USAGE


class TransportError(KvctlError):
    """A socket, server or file could not be reached, opened or read."""


class DecodeError(ValueError):
    """A message is not any known KV-event format. Counted, shown and kept; never fatal by
    itself (only ``--strict`` turns it into exit code 1)."""


class StrictModeError(KvctlError):
    """--strict was given and malformed input was seen."""
