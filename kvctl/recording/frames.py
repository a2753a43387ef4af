"""The frames cache of ``kvctl replay`` (tcpreplay's ``tcpprep``): per recorded message, the
bytes replay sends and what its schedule and report need, prepared once so that the sender
never decodes. One Arrow IPC file per recording and target variant, memory-mapped when read.

The file is disposable: it is keyed by the recording's files (name, size, mtime), this
module's format version, kvctl's version and the variant (the options that change the bytes);
a file whose key differs, or that is not a complete and valid IPC file, is never used (the
caller rebuilds it). It is written to a temporary file and renamed into place, so a reader
sees a whole file or none. What the bytes are is the sending layer's business: here rows are
stored and handed back.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.compute as pc

from .. import __version__
from .dataset import display_location, is_remote
from .layout import SEGMENT_RE

CACHE_VERSION = 1
METADATA_KEY = b"kvctl-frames"
SUFFIX = ".kvctl-frames"
CHUNK_ROWS = 4096
"""Rows per record batch of the file."""

SCHEMA = pa.schema(
    [
        ("when", pa.float64()),  # the pacing time of the message, seconds
        ("seq", pa.int64()),  # the recorded seq (windows, --keep-seq)
        ("kind", pa.int8()),  # how the sender takes the row (kvctl.targets)
        ("malformed", pa.bool_()),
        ("events", pa.int32()),
        ("key", pa.string()),  # which worker (JSON), for one socket per worker
        ("topic", pa.binary()),
        ("payload", pa.large_binary()),
        ("frames", pa.list_(pa.binary())),  # sent as recorded (rare rows)
        ("error", pa.string()),  # what refuses the row when it is reached (rare rows)
    ]
)
Row = tuple[Any, ...]
"""A row as the preparer gives it: a value per column of :data:`SCHEMA`, in order."""


class CacheUnusable(Exception):
    """The cache cannot be written here (the caller replays without it)."""


def recording_key(path: Path | str) -> list[list[Any]]:
    """What identifies the content of a recording: name, size and mtime of its file, or of
    every file under its directory, at any depth (segments, journals, manifest; a hive
    dataset's segments are three directories down), or of every object under an
    ``s3://bucket/prefix`` (their sizes and last-modified times, from one listing)."""
    if is_remote(str(path)):
        return _remote_key(str(path))
    path = Path(path)
    if not path.is_dir():
        st = path.stat()
        return [[path.name, st.st_size, st.st_mtime_ns]]
    files = sorted(f for f in path.rglob("*") if f.is_file() and SUFFIX not in f.name)
    key = []
    for f in files:
        st = f.stat()
        key.append([f.relative_to(path).as_posix(), st.st_size, st.st_mtime_ns])
    return key


def _remote_key(location: str) -> list[list[Any]]:
    import pyarrow.fs as pafs

    from .dataset import open_root, s3_error

    try:
        fs, root = open_root(location)
        infos = fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
    except OSError as exc:
        raise OSError(s3_error(exc, location)) from None
    return sorted(
        [info.path[len(root) :].lstrip("/"), info.size, info.mtime_ns]
        for info in infos
        if info.type == pafs.FileType.File
    )


def _identity(recording: Path | str) -> str:
    """The recording's absolute path, or its ``s3://`` location (credentials masked: the
    key is written into the cache file)."""
    text = str(recording)
    return display_location(text) if is_remote(text) else str(Path(recording).resolve())


def cache_key(path: Path | str, variant: dict[str, Any]) -> dict[str, Any]:
    return {
        "cache_version": CACHE_VERSION,
        "kvctl": __version__,
        "recording": _identity(path),
        "files": recording_key(path),
        "variant": variant,
    }


def user_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvctl" / "frames"


def cache_path(recording: Path | str, variant: dict[str, Any], cache_dir: Path | None) -> Path:
    """Where the cache of ``recording`` for ``variant`` lives: in ``cache_dir`` if given,
    else beside the recording (a hidden file), else, when that directory is not writable, in
    the per-user cache directory. Outside the recording's directory the name carries a
    digest of the recording's absolute path, so that two ``run.parquet`` do not meet. A
    segment replayed alone is not cached beside it: its directory holds a recording, which
    kvctl keeps to its own files. A dataset on S3 is cached in ``cache_dir`` or the per-user
    cache directory (never in the bucket)."""
    tag = hashlib.sha256(json.dumps(variant, sort_keys=True).encode()).hexdigest()[:12]
    identity = _identity(recording)
    digest = hashlib.sha256(identity.encode()).hexdigest()[:12]
    if is_remote(identity):
        base = identity.split("?")[0].rstrip("/").rpartition("/")[2] or "s3"
        return (cache_dir or user_cache_dir()) / f"{digest}-{base}.{tag}{SUFFIX}"
    recording = Path(recording)
    name = f"{recording.name}.{tag}{SUFFIX}"
    beside = recording.resolve().parent
    segment = SEGMENT_RE.match(recording.name) is not None
    if cache_dir is None and not segment and os.access(beside, os.W_OK | os.X_OK):
        return beside / f".{name}"
    where = cache_dir if cache_dir is not None else user_cache_dir()
    return where / f"{digest}-{name}"


class FramesFile:
    """A valid cache file, memory-mapped: its metadata, and its rows chunk by chunk."""

    def __init__(self, path: Path) -> None:
        self.source = pa.memory_map(str(path))
        try:
            self.reader = pa.ipc.open_file(self.source)
            raw = (self.reader.schema.metadata or {}).get(METADATA_KEY)
            self.metadata: dict[str, Any] = json.loads(raw) if raw else {}
            if not self.reader.schema.equals(SCHEMA, check_metadata=False):
                raise ValueError("not the frames schema")
            for i in range(self.reader.num_record_batches):
                self.reader.get_batch(i).validate(full=True)
        except BaseException:
            self.source.close()
            raise

    @property
    def unpreparable(self) -> str | None:
        """Why the recording cannot be prepared for this variant (replay decodes it then)."""
        return self.metadata.get("unpreparable")

    @property
    def rows(self) -> int:
        return sum(self.reader.get_batch(i).num_rows for i in range(self.reader.num_record_batches))

    def open_keys(self) -> list[str]:
        """The workers of well-formed messages in order of first appearance (the sockets of
        ``--port-per-worker`` are bound in this order before anything is sent)."""
        keys: list[str] = []
        for i in range(self.reader.num_record_batches):
            rb = self.reader.get_batch(i)
            well_formed = pc.filter(rb.column("key"), pc.invert(rb.column("malformed")))
            keys.extend(pc.unique(well_formed).to_pylist())
        return list(dict.fromkeys(keys))

    def chunks(self, with_keys: bool, rows: int = CHUNK_ROWS) -> Iterator[list[tuple[Any, ...]]]:
        """The rows, ``rows`` at a time, as tuples ``(when, seq, kind, events, key, topic,
        payload, extra)``: ``payload`` a zero-copy view of the mapped file, ``key`` the
        worker's JSON only ``with_keys`` (else None), ``extra`` the recorded frames or the
        error text of the rare rows that have one. Turning a chunk into Python values holds
        the sender (~0.25 µs a row): a paced sender takes small chunks."""
        for i in range(self.reader.num_record_batches):
            whole = self.reader.get_batch(i)
            for start in range(0, whole.num_rows, rows):
                yield self._rows(whole.slice(start, rows), with_keys)

    @staticmethod
    def _rows(rb: pa.RecordBatch, with_keys: bool) -> list[tuple[Any, ...]]:
        n = rb.num_rows
        payload = rb.column("payload")
        offsets = _numbers(payload, "q", n + 1)  # large_binary: int64 offsets
        data = payload.buffers()[2]
        view = memoryview(data) if data is not None else memoryview(b"")
        payloads = [view[a:b] for a, b in zip(offsets, offsets[1:], strict=False)]
        topic = rb.column("topic").dictionary_encode()
        table = topic.dictionary.to_pylist()
        topics = [table[k] for k in _numbers(topic.indices, "i", n)]
        keys = rb.column("key").to_pylist() if with_keys else [None] * n
        extra: list[Any] = [None] * n
        for name in ("frames", "error"):
            column = rb.column(name)
            if column.null_count < n:
                for k, valid in enumerate(column.is_valid().to_pylist()):
                    if valid:
                        extra[k] = column[k].as_py()
        return list(
            zip(
                _numbers(rb.column("when"), "d", n),
                rb.column("seq").to_pylist(),
                _numbers(rb.column("kind"), "b", n),
                _numbers(rb.column("events"), "i", n),
                keys,
                topics,
                payloads,
                extra,
                strict=True,
            )
        )

    def close(self) -> None:
        self.source.close()


def _numbers(column: pa.Array, code: Literal["b", "i", "q", "d"], count: int) -> list[Any]:
    """``count`` values of a null-free fixed-width column (or the offsets of a binary one)
    read off its data buffer with the struct ``code``: as fast as numpy's ``tolist``, without
    numpy (not a dependency)."""
    width = struct.calcsize(code)
    data = column.buffers()[1].slice(column.offset * width, count * width)
    return memoryview(data).cast(code).tolist()


def open_cache(path: Path, key: dict[str, Any]) -> FramesFile | None:
    """The cache at ``path`` if it is whole, valid and made for ``key``; else None."""
    try:
        frames = FramesFile(path)
    except (OSError, ValueError, pa.ArrowException):  # missing, partial, not ours
        return None
    if frames.metadata.get("key") != key:
        frames.close()
        return None
    return frames


def write_cache(
    path: Path, key: dict[str, Any], rows: Iterable[Row], unpreparable: str | None = None
) -> None:
    """Write the rows under ``key`` to a temporary file beside ``path``, then rename it into
    place. ``unpreparable``: instead of rows, why the recording cannot be prepared.
    :class:`CacheUnusable` when the directory cannot hold it."""
    metadata = {"key": key, "unpreparable": unpreparable}
    schema = SCHEMA.with_metadata({METADATA_KEY: json.dumps(metadata)})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise CacheUnusable(f"{path.parent}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
            chunk: list[Row] = []
            for row in [] if unpreparable else rows:
                chunk.append(row)
                if len(chunk) == CHUNK_ROWS:
                    writer.write_batch(_record_batch(chunk))
                    chunk = []
            if chunk:
                writer.write_batch(_record_batch(chunk))
        os.replace(temporary, path)
    except OSError as exc:
        raise CacheUnusable(f"{path}: {exc.strerror or exc}") from None
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def _record_batch(rows: list[Row]) -> pa.RecordBatch:
    columns = list(zip(*rows, strict=True))
    return pa.RecordBatch.from_arrays(
        [pa.array(values, type=field.type) for values, field in zip(columns, SCHEMA, strict=True)],
        schema=SCHEMA,
    )
