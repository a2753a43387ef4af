"""How a fleet stream on NATS JetStream is laid out: subjects, partitions, and the partition
each worker lands on. Pure: no sockets, no NATS client; the transport and ``kvctl stream`` use
it, and so will the bridge (which publishes) and the partitioned recorders (which read).

Layout of a stream ``NAME`` with ``N`` partitions:

- publishers send each worker's messages to ``kvctl.NAME.events.<worker>``: one subject token
  per worker (:func:`worker_token`), so a worker's messages all land in one partition;
- the stream listens on ``kvctl.NAME.events.*`` and stores each message, through its subject
  transform ``kvctl.NAME.{{partition(N,1)}}.{{wildcard(1)}}``, as ``kvctl.NAME.<p>.<worker>``;
- a reader of partition ``p`` filters on ``kvctl.NAME.<p>.*``.

nats-server computes ``{{partition(N,1)}}`` as FNV-1a (32 bit) of the token's bytes, mod N
(``getHashPartition`` in its ``subject_transform.go``): :func:`partition_of` is the same
function, checked against a real server by tests/test_cmd_stream.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import unquote

from .text import parse_duration

PREFIX = "kvctl"
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_FNV32_OFFSET = 0x811C9DC5
_FNV32_PRIME = 0x01000193
_TOKEN_SAFE = frozenset(chr(c) for c in range(0x21, 0x7F)) - set(".*>%")
"""Printable ASCII that a NATS subject token may hold as is; the rest is %-escaped."""
_PARTITION_DEST = re.compile(r"\{\{\s*partition\s*\(\s*(\d+)\s*,\s*1\s*\)\s*\}\}", re.I)


def fnv1a_32(data: bytes) -> int:
    value = _FNV32_OFFSET
    for byte in data:
        value = ((value ^ byte) * _FNV32_PRIME) & 0xFFFFFFFF
    return value


def worker_token(worker: str) -> str:
    """The subject token of a worker label: the label itself when it is a valid token, else
    with ``.``, ``*``, ``>``, ``%``, whitespace and non-ASCII %-escaped (reversible:
    :func:`worker_label`)."""
    if not worker:
        raise ValueError("empty worker label")
    return "".join(
        ch if ch in _TOKEN_SAFE else "".join(f"%{b:02X}" for b in ch.encode()) for ch in worker
    )


def worker_label(token: str) -> str:
    return unquote(token)


def partition_of(worker: str, partitions: int) -> int:
    """The partition the stream's subject transform gives ``worker``'s subject."""
    if partitions < 1:
        raise ValueError(f"partitions must be at least 1, not {partitions}")
    return fnv1a_32(worker_token(worker).encode()) % partitions


def check_name(name: str) -> str | None:
    """Why ``name`` cannot name a kvctl stream (it is a stream name and a subject token), or
    None when it can."""
    if _NAME.fullmatch(name):
        return None
    return f"stream name {name!r}: use 1-64 letters, digits, '-' or '_'"


@dataclass(frozen=True)
class StreamLayout:
    name: str
    partitions: int

    @property
    def listen_subject(self) -> str:
        """What the stream listens on (and publishers send to, one token per worker)."""
        return f"{PREFIX}.{self.name}.events.*"

    @property
    def transform_dest(self) -> str:
        return f"{PREFIX}.{self.name}.{{{{partition({self.partitions},1)}}}}.{{{{wildcard(1)}}}}"

    def publish_subject(self, worker: str) -> str:
        return f"{PREFIX}.{self.name}.events.{worker_token(worker)}"

    def partition_subject(self, partition: int) -> str:
        """What a reader of one partition filters on."""
        return f"{PREFIX}.{self.name}.{partition}.*"

    def stored_subject(self, worker: str) -> str:
        token = worker_token(worker)
        return f"{PREFIX}.{self.name}.{partition_of(worker, self.partitions)}.{token}"

    def parse_stored(self, subject: str) -> tuple[int, str] | None:
        """``(partition, worker label)`` of a stored subject, or None for any other subject."""
        parts = subject.split(".")
        if len(parts) != 4 or parts[:2] != [PREFIX, self.name] or not parts[2].isdigit():
            return None
        return int(parts[2]), worker_label(parts[3])

    @classmethod
    def of_stream(
        cls, name: str, subjects: list[str], transform_src: str | None, transform_dest: str | None
    ) -> StreamLayout | None:
        """The layout of an existing stream's configuration, or None when it is not one
        ``kvctl stream init`` makes."""
        match = _PARTITION_DEST.search(transform_dest or "")
        if match is None or int(match.group(1)) < 1:
            return None
        layout = cls(name, int(match.group(1)))
        same = (
            subjects == [layout.listen_subject]
            and transform_src == layout.listen_subject
            and transform_dest == layout.transform_dest
        )
        return layout if same else None


@dataclass(frozen=True)
class StreamSettings:
    """What ``kvctl stream init`` asks of a stream, compared with what a stream has."""

    layout: StreamLayout
    replicas: int
    max_age_s: float
    """0: no age limit."""

    def differences(self, existing: StreamSettings) -> list[str]:
        """What differs, each as ``what HAS (asked ASKED)``, in a fixed order."""
        pairs = (
            ("partitions", existing.layout.partitions, self.layout.partitions),
            ("replicas", existing.replicas, self.replicas),
            ("max age", describe_age(existing.max_age_s), describe_age(self.max_age_s)),
        )
        return [f"{what} {has} (asked {asked})" for what, has, asked in pairs if has != asked]


def parse_age(text: str) -> float:
    """``--max-age``: a duration (:func:`~kvctl.text.parse_duration`); 0 for no limit."""
    try:
        return parse_duration(text)
    except ValueError:
        example = "e.g. 30d, 12h, 90m, 0 for no limit"
        raise ValueError(f"{text!r} is not a duration ({example})") from None


def describe_age(seconds: float) -> str:
    if seconds <= 0:
        return "unlimited"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"
