"""Reading recordings back: a file, a segment directory or a journal (decoded on the fly), in
recorded order, as batches (:func:`open_recording`) or as rows of the schema
(:func:`record_batches`). Anything kvctl did not write is refused with :class:`NotARecording`
(one clear line rather than a traceback or "0 events")."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from itertools import chain
from pathlib import Path
from typing import Any, Literal, overload

import pyarrow as pa
import pyarrow.parquet as pq

from ..events import Batch
from .convert import event_batches
from .journal import NotAJournal, journal_header
from .layout import JOURNAL_SUFFIX, MANIFEST_NAME, SEGMENT_JOURNAL_RE, SEGMENT_RE, NotARecording
from .rebuild import columns_to_pylists, rows_to_batches
from .schema import METADATA_KEY, SCHEMA, SCHEMA_VERSION, Gap


def recording_sources(path: Path) -> list[tuple[str, Path]]:
    """(kind, path) of everything that holds rows, in recorded order; each one checked to be
    a kvctl recording or journal whose columns have the schema's types (else
    :class:`NotARecording`: one clear line rather than a traceback or "0 events")."""
    found = _find_sources(path)
    for kind, p in found:
        label = "" if p == path else f"{p.name}: "
        if kind == "parquet":
            _check_parquet(p, label)
        else:
            try:
                journal_header(p)
            except NotAJournal:
                raise NotARecording(f"{label}not a kvctl recording (not a kvctl journal)") from None
    return found


def _type_fits(actual: pa.DataType, expected: pa.DataType) -> bool:
    """``actual`` reads back as ``expected`` (dictionary or plain strings, list field names
    and 32/64-bit offsets aside)."""
    if actual.equals(expected):
        return True
    if pa.types.is_dictionary(expected):
        value = actual.value_type if pa.types.is_dictionary(actual) else actual
        return pa.types.is_string(value) or pa.types.is_large_string(value)
    if pa.types.is_list(expected) or pa.types.is_large_list(expected):
        return (pa.types.is_list(actual) or pa.types.is_large_list(actual)) and _type_fits(
            actual.value_type, expected.value_type
        )
    if pa.types.is_binary(expected):
        return pa.types.is_large_binary(actual)
    if pa.types.is_string(expected):
        return pa.types.is_large_string(actual)
    return False


def _check_parquet(p: Path, label: str) -> None:
    pf = pq.ParquetFile(p)
    raw = (pf.metadata.metadata or {}).get(METADATA_KEY.encode())
    if raw is None:
        raise NotARecording(f"{label}not a kvctl recording (no kvctl metadata)")
    try:
        version = json.loads(raw).get("schema_version")
    except (ValueError, AttributeError):
        raise NotARecording(f"{label}damaged kvctl metadata (not a JSON object)") from None
    if type(version) is not int or version > SCHEMA_VERSION:
        raise NotARecording(
            f"{label}recording schema version {version!r}; this kvctl reads "
            f"version {SCHEMA_VERSION} (upgrade kvctl)"
        )
    schema = pf.schema_arrow
    for name, expected in zip(SCHEMA.names, SCHEMA.types, strict=True):
        index = schema.get_field_index(name)
        if index < 0:
            raise NotARecording(
                f"{label}column {name} is missing (a kvctl recording of "
                f"schema {SCHEMA_VERSION} has it)"
            )
        actual = schema.field(index).type
        if not _type_fits(actual, expected):
            raise NotARecording(f"{label}column {name} has type {actual}, expected {expected}")


def _find_sources(path: Path) -> list[tuple[str, Path]]:
    if path.is_dir():
        items: list[tuple[int, str, Path]] = []
        for e in path.iterdir():
            if m := SEGMENT_RE.match(e.name):
                items.append((int(m.group(1)), "parquet", e))
            elif (m := SEGMENT_JOURNAL_RE.match(e.name)) and not (
                path / e.name[1 : -len(JOURNAL_SUFFIX)]
            ).exists():
                items.append((int(m.group(1)), "journal", e))
        if not items and not (path / MANIFEST_NAME).exists():
            raise FileNotFoundError(f"no recording in {path} (no segments, no manifest)")
        return [(kind, p) for _, kind, p in sorted(items)]
    if path.name.endswith(JOURNAL_SUFFIX):
        return [("journal", path)]
    if path.exists():
        return [("parquet", path)]
    journal = path.with_name(path.name + JOURNAL_SUFFIX)
    if journal.exists():
        return [("journal", journal)]
    raise FileNotFoundError(f"no recording at {path}")


def record_batches(
    path: Path, columns: list[str] | None = None, batch_size: int = 16 * 1024
) -> Iterator[pa.RecordBatch]:
    """Rows of the schema (only ``columns`` if given), source after source, in recorded order."""
    for kind, p in recording_sources(path):
        if kind == "parquet":
            yield from pq.ParquetFile(p).iter_batches(batch_size=batch_size, columns=columns)
        else:
            for rb in event_batches(p):
                yield rb.select(columns) if columns else rb


@overload
def open_recording(
    path: str | os.PathLike[str],
    include_gaps: Literal[False] = False,
    batch_size: int = 16 * 1024,
) -> Iterator[Batch]: ...


@overload
def open_recording(
    path: str | os.PathLike[str], include_gaps: bool, batch_size: int = 16 * 1024
) -> Iterator[Batch | Gap]: ...


def open_recording(
    path: str | os.PathLike[str], include_gaps: bool = False, batch_size: int = 16 * 1024
) -> Iterator[Batch | Gap]:
    """Iterate the batches of a recording (file, segment directory or journal), in recorded
    order, with their events and raw frames. ``include_gaps`` also yields :class:`Gap`.

    A batch's rows may straddle many chunks (a million-event batch spans dozens): its pieces
    are held and joined once, when the batch is complete, so reading stays linear. Rows no
    kvctl writer produces (a damaged or doctored file) raise :class:`NotARecording`."""
    try:
        yield from _read_batches(Path(path), include_gaps, batch_size)
    except DAMAGE as exc:
        raise NotARecording(f"damaged recording ({type(exc).__name__}: {exc})") from None


# What rows that passed the schema check can still raise when a file was damaged or doctored.
DAMAGE = (RecursionError, KeyError, TypeError, IndexError, AttributeError, OverflowError)


def _read_batches(path: Path, include_gaps: bool, batch_size: int) -> Iterator[Batch | Gap]:
    held: list[dict[str, list[Any]]] = []  # pieces of the batch that straddles chunks
    held_index: Any = None
    for rb in record_batches(path, batch_size=batch_size):
        cols = columns_to_pylists(rb)
        bi = cols["batch_index"]
        n = len(bi)
        start = 0
        if held:
            while start < n and bi[start] == held_index:
                start += 1
            if start:
                held.append({k: v[:start] for k, v in cols.items()})
            if start == n:
                continue
            yield from _joined_batches(held, include_gaps)
            held = []
        # Hold the last group back: its rows may go on in the next chunk.
        cut = n
        if n > start and bi[-1] is not None:
            cut = n - 1
            while cut > start and bi[cut - 1] == bi[-1]:
                cut -= 1
        yield from rows_to_batches(cols, start, cut, include_gaps)
        if cut < n:
            held = [{k: v[cut:] for k, v in cols.items()}]
            held_index = bi[-1]
    if held:
        yield from _joined_batches(held, include_gaps)


def _joined_batches(pieces: list[dict[str, list[Any]]], include_gaps: bool) -> list[Batch | Gap]:
    if len(pieces) == 1:
        cols = pieces[0]
    else:
        cols = {k: list(chain.from_iterable(p[k] for p in pieces)) for k in pieces[0]}
    return rows_to_batches(cols, 0, len(cols["batch_index"]), include_gaps)


def file_metadata(path: Path) -> dict[str, Any]:
    """The kvctl metadata in a Parquet file's footer ({} if none)."""
    kv = pq.ParquetFile(path).metadata.metadata or {}
    raw = kv.get(METADATA_KEY.encode())
    return json.loads(raw) if raw else {}
