"""What a dataset looks like: the segments partitioned recorders write (``kvctl record
nats://... --stream NAME --partition I/N -o DIR``), their names, directories and where they
live (a local directory or ``s3://bucket/prefix``). Shared by the writer, which names segments,
and the readers, which find and select them; no segment is read or written here.

Layouts of ``DIR``::

    flat: DIR/STREAM.pPP.FIRST-LAST.parquet
    hive: DIR/dt=YYYY-MM-DD/hour=HH/part=PP/STREAM.pPP.FIRST-LAST.parquet

``FIRST``-``LAST`` is the range of stream sequence numbers the segment accounts for
(JetStream's, of the stream ``STREAM``), ``PP`` the partition: it holds every message of its
partition stored in that range (the seqs between that it does not hold are other partitions').
A partition's segments tile the seq line: each ``FIRST`` is the previous ``LAST`` + 1, so a
range no segment covers was lost (a recorder's messages expired from the stream before they
were recorded), which ``kvctl inspect`` shows as a hole. Each segment's kvctl footer metadata
says ``stream``, ``partition``, ``partitions`` (N: readers skip whole partitions for a
worker selection), ``first_stream_seq``, ``last_stream_seq`` and ``messages``. A segment is
written to a hidden temp name and renamed into place once complete (on S3, where there is no
rename, the whole file is made in memory and uploaded to its final key: an object appears only
when its upload completes, whole), and only then are its messages acknowledged: the highest
``LAST`` of a partition is where its recorder resumes. Several recorders may share one
``DIR``: their names never collide. ``dt``/``hour`` are the UTC receive time of the segment's
messages (a recorder cuts its segments at hour boundaries). Readers skip every name starting
with ``.`` or ``_``, as Hive, Spark, DuckDB and pyarrow do.

pyarrow is imported at module level: import this module only from code that reads or writes
recordings.
"""

from __future__ import annotations

import datetime
import os
import re
from dataclasses import dataclass

import pyarrow.fs as pafs

LAYOUTS = ("flat", "hive")
SEGMENT_NAME = re.compile(
    r"^(?P<stream>[A-Za-z0-9_-]{1,64})\.p(?P<partition>\d+)\.(?P<first>\d+)-(?P<last>\d+)\.parquet$"
)
_SEQ_DIGITS = 12
"""Sequence numbers are zero-padded so that names sort in stream order (longer still parse)."""


@dataclass(frozen=True, order=True)
class Segment:
    """One segment's name, parsed: stream, partition, and the stream seqs it holds."""

    stream: str
    partition: int
    first: int
    last: int

    @property
    def file_name(self) -> str:
        return (
            f"{self.stream}.p{self.partition:02d}."
            f"{self.first:0{_SEQ_DIGITS}d}-{self.last:0{_SEQ_DIGITS}d}.parquet"
        )

    @classmethod
    def parse(cls, name: str) -> Segment | None:
        match = SEGMENT_NAME.match(name)
        if match is None:
            return None
        first, last = int(match["first"]), int(match["last"])
        if first > last:
            return None
        return cls(match["stream"], int(match["partition"]), first, last)


def segment_path(layout: str, segment: Segment, recv_ns: int) -> str:
    """The segment's path relative to the dataset root (``/``-separated)."""
    if layout == "flat":
        return segment.file_name
    if layout != "hive":
        raise ValueError(f"unknown layout {layout!r} (one of {', '.join(LAYOUTS)})")
    when = datetime.datetime.fromtimestamp(recv_ns / 1e9, tz=datetime.timezone.utc)
    return f"dt={when:%Y-%m-%d}/hour={when:%H}/part={segment.partition:02d}/{segment.file_name}"


def hour_of(recv_ns: int) -> int:
    """The UTC hour (since the epoch) a receive time falls in: segments do not span two."""
    return recv_ns // 3_600_000_000_000


def temp_path(path: str) -> str:
    """Where a segment is written before it is renamed to ``path`` (hidden: no reader sees
    it; one per process, so two writers never share one)."""
    head, _, name = path.rpartition("/")
    return f"{head}/.{name}.tmp-{os.getpid()}" if head else f".{name}.tmp-{os.getpid()}"


def is_remote(location: str) -> bool:
    return location.startswith("s3://")


S3_CONNECT_TIMEOUT = 5.0
"""Seconds to open a connection to an S3 endpoint (pyarrow's default is the AWS SDK's)."""
S3_REQUEST_TIMEOUT = 15.0
"""Seconds an S3 request may go without receiving a byte before it fails (a stalled endpoint
must not hang a command: the AWS SDK's own default lets a request wait much longer)."""
S3_MAX_ATTEMPTS = 3
"""Tries of one S3 request (pyarrow retries throttling and dropped connections)."""


def open_root(location: str) -> tuple[pafs.FileSystem, str]:
    """The file system and root path of a dataset location: a local directory, or
    ``s3://bucket/prefix`` (pyarrow's S3 file system: credentials, region and endpoint from
    the usual AWS environment variables and files, or ``?endpoint_override=...`` in the
    URL). A missing bucket or an unreachable endpoint shows at the first request (see
    :func:`s3_error`); the one request made here is pyarrow's lookup of the bucket's region
    when neither the URL (``?region=``), ``AWS_REGION``/``AWS_DEFAULT_REGION`` nor an
    endpoint says it (OSError). S3 requests are bounded (:data:`S3_CONNECT_TIMEOUT`,
    :data:`S3_REQUEST_TIMEOUT`, :data:`S3_MAX_ATTEMPTS`), and objects are written with a
    single request when they fit one part (``allow_delayed_open``), so that a writer killed
    halfway leaves no multipart upload behind either."""
    if is_remote(location):
        fs, root = pafs.FileSystem.from_uri(_with_region(location))
        return _bounded(fs), root.rstrip("/")
    return pafs.LocalFileSystem(), os.path.abspath(location)


def _with_region(location: str) -> str:
    """``location`` with ``?region=`` from the environment when it names none: pyarrow
    would otherwise ask S3 for the bucket's region (a request, before any other)."""
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    _, _, query = location.partition("?")
    if not region or any(p.startswith("region=") for p in query.split("&")):
        return location
    return f"{location}{'&' if query else '?'}region={region}"


def _bounded(fs: pafs.FileSystem) -> pafs.FileSystem:
    """The S3 file system ``from_uri`` made (its credentials, region, endpoint and URL
    options), again with kvctl's timeouts and retry limit; as made when that is not
    possible (a pyarrow whose pickled options differ)."""
    try:
        options = dict(fs.__reduce__()[1][0])  # the options pyarrow pickles it with
        if not (options.get("proxy_options") or {}).get("host"):
            options.pop("proxy_options", None)
        if options.get("connect_timeout", -1) <= 0:
            options["connect_timeout"] = S3_CONNECT_TIMEOUT
        if options.get("request_timeout", -1) <= 0:
            options["request_timeout"] = S3_REQUEST_TIMEOUT
        options["allow_delayed_open"] = True
        options["retry_strategy"] = pafs.AwsStandardS3RetryStrategy(max_attempts=S3_MAX_ATTEMPTS)
        return pafs.S3FileSystem(**options)
    except (TypeError, ValueError, IndexError, KeyError, AttributeError):
        return fs


def display_location(location: str) -> str:
    """``location`` as shown in messages: credentials in an ``s3://KEY:SECRET@`` URL and
    secret query values masked."""
    from ..redact import redact_url

    return redact_url(location)


_AWS_ERROR = re.compile(r"AWS Error (?P<kind>[A-Z_]+)(?: \(HTTP status (?P<status>\d+)\))?")


_DENIED = ("ACCESS_DENIED", "INVALID_ACCESS_KEY_ID", "SIGNATURE_DOES_NOT_MATCH", "EXPIRED_TOKEN")


def s3_error(exc: OSError, location: str) -> str:
    """One line saying why an S3 request for ``location`` failed, what to check, and
    pyarrow's words (the AWS error never holds a secret)."""
    text = " ".join(str(exc).split())
    if isinstance(exc, MissingBucket):
        return text
    match = _AWS_ERROR.search(text)
    kind = match["kind"] if match else ""
    status = match["status"] if match else None
    bucket = location[len("s3://") :].split("/", 1)[0].rpartition("@")[2].split("?")[0]
    if kind == "NO_SUCH_BUCKET" or "NoSuchBucket" in text:
        why = f"bucket {bucket} does not exist"
    elif kind == "NETWORK_CONNECTION":
        why = "cannot reach the S3 endpoint (AWS_ENDPOINT_URL, ?endpoint_override=)"
    elif kind in _DENIED or status in ("401", "403"):
        why = "access denied (check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE)"
    else:
        why = "S3 request failed"
    detail = text.split("; Details: ")[-1] if "; Details: " in text else text
    return f"{why}: {detail}"


class MissingBucket(OSError):
    """An S3 dataset's bucket does not exist (the message says which)."""


def check_bucket(fs: pafs.FileSystem, root: str) -> None:
    """An S3 dataset's bucket exists and can be listed (OSError saying why not); nothing
    for a local directory. A listing with ``allow_not_found`` takes a missing bucket for an
    empty dataset: a recorder would find out at its first segment."""
    if isinstance(fs, pafs.LocalFileSystem):
        return
    bucket = root.split("/", 1)[0]
    info = fs.get_file_info(bucket)
    if info.type == pafs.FileType.NotFound:
        raise MissingBucket(f"bucket {bucket} does not exist")
    fs.get_file_info(pafs.FileSelector(root, recursive=False, allow_not_found=True))


def _hidden(relative: str) -> bool:
    return any(part.startswith((".", "_")) for part in relative.split("/"))


def list_segments(fs: pafs.FileSystem, root: str) -> list[tuple[str, Segment]]:
    """Every segment under ``root`` (any depth, either layout) as ``(path, Segment)``, in
    (stream, partition, first seq) order; hidden names and files of other names are skipped."""
    try:
        infos = fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
    except FileNotFoundError:
        return []
    found = []
    for info in infos:
        if info.type != pafs.FileType.File:
            continue
        relative = info.path[len(root) :].lstrip("/")
        if _hidden(relative):
            continue
        segment = Segment.parse(info.base_name)
        if segment is not None:
            found.append((info.path, segment))
    found.sort(key=lambda pair: pair[1])
    return found


def committed_through(segments: list[tuple[str, Segment]], stream: str, partition: int) -> int:
    """The last stream seq of ``stream``'s ``partition`` that a segment holds (0: none)."""
    return max(
        (s.last for _, s in segments if s.stream == stream and s.partition == partition),
        default=0,
    )


_TEMP_NAME = re.compile(r"^\.(?P<name>.+\.parquet)\.tmp-(?P<pid>\d+)$")


def leftover_temps(fs: pafs.FileSystem, root: str, stream: str, partitions: set[int]) -> list[str]:
    """Hidden temp segments (:func:`temp_path`) of ``stream``'s ``partitions`` under ``root``:
    what a killed recorder of those partitions left (one recorder per partition at a time,
    so none is being written)."""
    try:
        infos = fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
    except FileNotFoundError:
        return []
    found = []
    for info in infos:
        match = _TEMP_NAME.match(info.base_name)
        if info.type != pafs.FileType.File or match is None:
            continue
        segment = Segment.parse(match["name"])
        if segment is not None and segment.stream == stream and segment.partition in partitions:
            found.append(info.path)
    return sorted(found)
