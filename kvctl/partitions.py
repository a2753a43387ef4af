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
from dataclasses import dataclass, fields
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


# --- the fleet message: one engine message inside a stream ------------------------------------
#
# A bridge publishes each message it receives, and each gap it could not repair, as one
# JetStream message; a partitioned recorder turns it back into the journal row the bridge
# would have written itself. Nothing is decoded on the way: the body is the message's raw
# transport frames, byte for byte, so a recording made downstream is byte-exact.

MSG_ID = "Nats-Msg-Id"
"""JetStream drops a message whose id it stored within the stream's duplicate window."""
HEADER_RECV_NS = "Kvctl-Recv-Ns"
HEADER_SOURCE = "Kvctl-Source"
HEADER_TOPIC = "Kvctl-Topic"
HEADER_WORKER = "Kvctl-Worker"
"""The source's worker label (tagged JSON, as the journal keeps it); absent: none."""
HEADER_DP_RANK = "Kvctl-Dp-Rank"
HEADER_RECOVERED = "Kvctl-Recovered"
HEADER_EVENTS = "Kvctl-Events"
"""How many events the bridge's decoder found in the message (the journal's ``events``
column when the recorder applies no filter); absent: not said (a gap marker)."""
HEADER_GAP = "Kvctl-Gap"
"""On a gap marker (empty body): JSON ``{"publisher": P, "from_seq": N, "to_seq": M}``, the
fields of the Gap row ``kvctl record`` writes (``RecordingWriter.write_gap``); ``P`` is the
publisher as a tagged JSON value (``to_json_value``: a string stays a string, redacted; a
tuple is ``{"$t": [...]}``), so ``from_json_value(P)`` gives the publisher back."""
HEADER_BRIDGE = "Kvctl-Bridge"
"""Which bridge published it (host:pid), for the people reading ``nats stream view``."""

_HEADER_SAFE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) not in "%")


def header_text(value: str) -> str:
    """A header value: printable ASCII but space as is, the rest %-escaped (reversible; NATS
    trims the whitespace around a header value)."""
    from urllib.parse import quote

    return quote(value, safe=_HEADER_SAFE)


def header_value(text: str) -> str:
    # most values hold nothing escaped: unquote's own checks cost a recorder ~1 us a header
    return unquote(text) if "%" in text else text


def partition_key(worker_id: object, source: str) -> str:
    """What a message is partitioned by: the worker its batch names (a source label, a
    Dynamo ``worker_id``), else the source it came from (one unlabelled engine socket is one
    worker). All of one worker's messages, over every dp rank, land in one partition."""
    return source if worker_id is None else str(worker_id)


def message_id(key: str, dp_rank: int | None, seq: int | None, body: bytes) -> str:
    """``{publisher}:{seq}:{digest}``: the same engine message re-sent (a bridge restarted and
    fetched it again from the engine's replay socket) has the same id and is stored once; an
    engine that restarted and counts its seqs from 0 again sends other bytes, so its messages
    are not mistaken for re-sends within the duplicate window."""
    import xxhash

    publisher = worker_token(key) + ("" if dp_rank is None else f"/{dp_rank}")
    return f"{publisher}:{'-' if seq is None else seq}:{xxhash.xxh3_64_hexdigest(body)}"


@dataclass(frozen=True)
class FleetMessage:
    """One message of a fleet stream, as the journal row it stands for."""

    recv_ns: int
    source: str
    topic: str
    frames: list[bytes]
    worker: str | None = None
    """The batch's worker (``Batch.worker_id``: the source's label, else what the decoder
    found, an llm-d topic's pod or a Dynamo worker id) as tagged JSON (``0``, ``"w1"``), as a
    labelled journal row holds it; None: none (the row's tagged JSON ``null``)."""
    dp_rank: str | None = None
    """The batch's dp rank (``Batch.dp_rank``: the payload's, else the source's label),
    tagged JSON; None: none."""
    recovered: bool = False
    gap: dict | None = None
    """A gap marker's fields (publisher, from_seq, to_seq); then ``frames`` is empty."""
    events: int | None = None
    """How many events the bridge decoded from the frames (0: malformed or none); None:
    not said."""

    def headers(self) -> dict[str, str]:
        headers = {
            HEADER_RECV_NS: str(self.recv_ns),
            HEADER_SOURCE: header_text(self.source),
            HEADER_TOPIC: header_text(self.topic),
        }
        if self.worker is not None:
            headers[HEADER_WORKER] = header_text(self.worker)
        if self.dp_rank is not None:
            headers[HEADER_DP_RANK] = header_text(self.dp_rank)
        if self.recovered:
            headers[HEADER_RECOVERED] = "1"
        if self.events is not None:
            headers[HEADER_EVENTS] = str(self.events)
        if self.gap is not None:
            import json

            headers[HEADER_GAP] = header_text(json.dumps(self.gap, separators=(",", ":")))
        return headers

    def body(self) -> bytes:
        """The raw frames as one msgpack array of binaries (empty for a gap marker)."""
        import msgpack

        return b"" if self.gap is not None else msgpack.packb([bytes(f) for f in self.frames])

    @classmethod
    def parse(cls, headers: dict[str, str] | None, body: bytes) -> FleetMessage:
        """The message a bridge published; ValueError (saying why) for anything else.

        The receive loop of a partitioned recorder runs this once a message: the common
        case (no gap, headers with nothing %-escaped, frames of bytes) takes no function
        call per header or per frame."""
        headers = headers or {}
        get = headers.get
        try:
            recv_ns = int(headers[HEADER_RECV_NS])
            source = headers[HEADER_SOURCE]
        except (KeyError, ValueError) as exc:
            raise ValueError(f"not a kvctl fleet message (header {exc})") from None
        topic = get(HEADER_TOPIC, "")
        if "%" in source:
            source = unquote(source)
        if "%" in topic:
            topic = unquote(topic)
        if HEADER_GAP in headers:
            return cls._gap(headers, recv_ns, source, topic)
        worker = get(HEADER_WORKER)
        if worker is not None and "%" in worker:
            worker = unquote(worker)
        dp_rank = get(HEADER_DP_RANK)
        if dp_rank is not None and "%" in dp_rank:
            dp_rank = unquote(dp_rank)
        said = get(HEADER_EVENTS)
        events = None
        if said is not None:
            try:
                events = int(said)
            except ValueError:
                raise ValueError("a Kvctl-Events header that is not a number") from None
        try:
            frames = _unpackb(body, use_list=True, raw=True)
        except Exception:
            raise ValueError("a body that is not a msgpack array of frames") from None
        # raw=True: bin and str both come as bytes; anything else (ints, maps, nested
        # arrays) is no frame. One C-level pass over the types, not a Python loop.
        if type(frames) is not list or (frames and {*map(type, frames)} != _BYTES_ONLY):
            raise ValueError("a body that is not a msgpack array of frames")
        # A frozen dataclass's __init__ sets each field through object.__setattr__: 2 us a
        # message, 4x what filling the instance's dict at once costs (the fields are checked
        # against this list at import, below the class)
        message = _new(cls)
        _set(
            message,
            "__dict__",
            {
                "recv_ns": recv_ns,
                "source": source,
                "topic": topic,
                "frames": frames,
                "worker": worker,
                "dp_rank": dp_rank,
                "recovered": get(HEADER_RECOVERED) == "1",
                "gap": None,
                "events": events,
            },
        )
        return message

    @classmethod
    def _gap(cls, headers: dict[str, str], recv_ns: int, source: str, topic: str) -> FleetMessage:
        import json

        if HEADER_EVENTS in headers:  # checked as for any message
            try:
                int(headers[HEADER_EVENTS])
            except ValueError:
                raise ValueError("a Kvctl-Events header that is not a number") from None
        try:
            gap = json.loads(header_value(headers[HEADER_GAP]))
        except ValueError:
            raise ValueError("a gap marker whose Kvctl-Gap header is not JSON") from None
        if not isinstance(gap, dict) or not {"from_seq", "to_seq"} <= gap.keys():
            raise ValueError("a gap marker without from_seq/to_seq")
        return cls(recv_ns, source, topic, [], None, None, False, gap)


_BYTES_ONLY = {bytes}
_new = object.__new__
_set = object.__setattr__
if [f.name for f in fields(FleetMessage)] != [
    *("recv_ns", "source", "topic", "frames", "worker", "dp_rank", "recovered", "gap", "events")
]:  # FleetMessage.parse fills an instance's dict with these names
    raise ImportError("FleetMessage's fields changed: update FleetMessage.parse")


def _unpackb(body: bytes, **kwargs: object) -> object:
    """msgpack.unpackb, imported on first use (``kvctl --help`` does not load msgpack), then
    bound in this module's globals: no import statement a message."""
    global _unpackb
    from msgpack import unpackb

    _unpackb = unpackb
    return unpackb(body, **kwargs)


def parse_partitions(spec: str) -> tuple[list[int], int]:
    """``--partition I[,J...]/N`` -> (sorted partitions, N); ValueError saying why."""
    chosen, slash, total = spec.partition("/")
    example = "e.g. 0,1/4: partitions 0 and 1 of 4"
    try:
        n = int(total)
        parts = [int(p) for p in chosen.split(",")]
    except ValueError:
        raise ValueError(f"--partition {spec!r}: expected I[,J...]/N ({example})") from None
    if not slash or n < 1:
        raise ValueError(f"--partition {spec!r}: expected I[,J...]/N ({example})")
    bad = [p for p in parts if not 0 <= p < n]
    if bad:
        raise ValueError(f"--partition {spec!r}: partition {bad[0]} is not in 0..{n - 1}")
    if len(set(parts)) != len(parts):
        raise ValueError(f"--partition {spec!r}: a partition is named twice")
    return sorted(parts), n
