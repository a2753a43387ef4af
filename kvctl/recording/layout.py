"""What a recording looks like on disk: file and journal names, segment directories and their
manifest, and whether an output path may be written.

Layouts::

    run.parquet                       one file (run.parquet.journal while recording)
    run/part-00000.parquet ...        with --rotate-size / --rotate-every: segments,
    run/_manifest.json                a manifest, and .part-NNNNN.parquet.journal while open

Segment journals and temp files are dot-files and the manifest starts with ``_`` so that
``pyarrow.dataset.dataset("run")`` and DuckDB's ``'run/*.parquet'`` read the directory as one
dataset without options (the same convention as Hive/Spark's ``_SUCCESS``).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from .. import __version__
from .counts import Counts
from .schema import SCHEMA_VERSION

JOURNAL_SUFFIX = ".journal"
MANIFEST_NAME = "_manifest.json"
SEGMENT_RE = re.compile(r"^part-(\d{5,})\.parquet$")
SEGMENT_JOURNAL_RE = re.compile(r"^\.part-(\d{5,})\.parquet\.journal$")


class NotARecording(ValueError):
    """A file or directory that kvctl did not write (or not in a shape it can read)."""


def journal_of(path: Path) -> Path:
    """Where the journal of the recording file ``path`` is while it is written."""
    return path.with_name(path.name + JOURNAL_SUFFIX)


def leftover_journals(path: str | os.PathLike[str]) -> list[Path]:
    """Journals a killed recorder left at ``path`` (a recording file or segment directory)."""
    path = Path(path)
    if path.is_dir():
        return sorted(e for e in path.iterdir() if SEGMENT_JOURNAL_RE.match(e.name))
    journal = journal_of(path)
    return [journal] if journal.exists() else []


def is_kvctl_entry(name: str) -> bool:
    """A name kvctl writes in a segment directory."""
    return bool(
        SEGMENT_RE.match(name)
        or SEGMENT_JOURNAL_RE.match(name)
        or name == MANIFEST_NAME
        or name.startswith((".part-", f".{MANIFEST_NAME}"))
    )


def output_conflict(
    path: str | os.PathLike[str],
    segmented: bool,
    overwrite: bool = False,
    append: bool = False,
    options: bool = True,
) -> str | None:
    """Why recording to ``path`` would destroy or mix in data this run did not write, with
    the remedy; None when it is safe. A recording file is replaced only with ``overwrite``;
    a segment directory must be new or empty, or, with ``append``, hold a kvctl recording
    (new segments are numbered after its last). An unconverted journal is never touched.
    ``options``: name record's ``--overwrite``/``--append`` in the remedy."""
    path = Path(path)
    journals = leftover_journals(path) if path.exists() or journal_of(path).exists() else []
    if journals:
        return (
            f"{journals[0]} is the journal of a recording that was never converted; run "
            f"`kvctl recover {path}` first (or move it away)"
        )
    if not segmented:
        if path.is_dir():
            return (
                f"{path} is a directory; give a file path (run.parquet), or write "
                "segments into a directory with --rotate-size/--rotate-every"
            )
        if path.exists() and not overwrite:
            how = ", or --overwrite to replace it" if options else " (or remove it first)"
            return f"{path} exists; give a new path{how}"
        return None
    if not path.exists():
        return None
    if not path.is_dir():
        return f"{path} is a file; rotation writes a directory of segments"
    names = [e.name for e in path.iterdir()]
    if not names:
        return None
    if not append:
        how = ", or --append to add segments to the recording in it" if options else ""
        return f"{path} is not empty; give a new or empty directory{how}"
    if not any(is_kvctl_entry(n) for n in names):
        return f"{path} holds no kvctl recording; --append adds segments to one"
    return None


def _segment_entry(meta: dict[str, Any]) -> dict[str, Any]:
    entry = {
        k: meta.get(k)
        for k in (
            "file",
            "segment",
            "bytes",
            "opened_ns",
            "closed_ns",
            "window_start_ns",
            "window_end_ns",
            "recovered",
        )
        if meta.get(k) is not None
    }
    entry.update(meta.get("counts", {}))
    return entry


def write_manifest(
    directory: Path,
    segments: list[dict[str, Any]],
    metadata: dict[str, Any],
    complete: bool,
    extra: dict[str, Any],
) -> None:
    """Write ``_manifest.json`` atomically: the segments (in order) with their counts, and
    the totals; ``complete`` is false while recording and after an incomplete recovery."""
    totals = Counts()
    for seg in segments:
        c = Counts()
        for k, v in seg.get("counts", {}).items():
            setattr(c, k, v)
        totals.merge(c)
    manifest = {
        "format": "kvctl-recording",
        "kvctl_version": __version__,
        "schema_version": SCHEMA_VERSION,
        "complete": complete,
        "metadata": metadata,
        **extra,
        "counts": totals.as_dict(),
        "bytes": sum(s.get("bytes", 0) for s in segments),
        "segments": [_segment_entry(s) for s in segments],
    }
    tmp = directory / f".{MANIFEST_NAME}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, directory / MANIFEST_NAME)


def segment_files(directory: Path) -> list[tuple[int, Path]]:
    """(number, path) of the Parquet segments of a directory, in segment order."""
    return sorted(
        (int(m.group(1)), e) for e in directory.iterdir() if (m := SEGMENT_RE.match(e.name))
    )
