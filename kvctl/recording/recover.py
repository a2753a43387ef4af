"""``kvctl recover``: turn what a crashed recorder left (a journal, or a segment directory
with journals) into Parquet, never replacing or removing what this call did not write."""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

from .convert import journal_to_parquet
from .disk import OutputExists, remove_stale_temps, writer_running
from .journal import NotAJournal, journal_header, read_journal
from .layout import (
    JOURNAL_SUFFIX,
    MANIFEST_NAME,
    SEGMENT_JOURNAL_RE,
    NotARecording,
    is_kvctl_entry,
    journal_of,
    leftover_journals,
    segment_files,
    write_manifest,
)
from .reader import file_metadata


class RecorderRunning(ValueError):
    """The journal belongs to a recorder that is still running: not ours to convert."""


# --- recover ------------------------------------------------------------------------------------


def recover(
    journal_path: str | os.PathLike[str], output: str | os.PathLike[str] | None = None
) -> Path:
    """Turn what a crashed recorder left into Parquet; returns the recording's path.

    Accepts a journal (``run.parquet.journal``), the recording path whose journal exists
    (``run.parquet``), or a segment directory (every leftover segment journal is converted
    and the manifest rebuilt). Every complete record batch in the journal is kept.

    Nothing that this call did not write is replaced or removed: a file that is not a kvctl
    journal raises :class:`NotAJournal`; an existing output that is not this journal's
    conversion raises :class:`OutputExists` (recover to ``output`` instead); the journal is
    removed only once a complete output holding all of it is in place.
    """
    path = Path(journal_path)
    if path.is_dir():
        if output is not None:
            raise NotARecording(f"{path}: a segment directory is recovered in place (no -o)")
        return _recover_directory(path)
    if not path.name.endswith(JOURNAL_SUFFIX):
        candidate = journal_of(path)
        if not candidate.exists():
            raise FileNotFoundError(f"no journal to recover at {candidate}")
        path = candidate
    if SEGMENT_JOURNAL_RE.match(path.name) and output is None:
        return _recover_directory(path.parent)
    target = (
        Path(output) if output is not None else path.with_name(path.name[: -len(JOURNAL_SUFFIX)])
    )
    _recover_one(path, target, explicit=output is not None)
    return target


def _recover_one(journal: Path, target: Path, explicit: bool = False) -> dict[str, Any]:
    info = journal_header(journal)
    pid = writer_running(info)
    if pid is not None:
        raise RecorderRunning(
            f"{journal} is being written by a running recorder (pid {pid}); "
            "stop it instead (Ctrl-C or SIGTERM converts it)"
        )
    remove_stale_temps(target)
    if target.exists():
        if not explicit and _converted_from(target, journal, info):
            # A crash between the rename and the unlink: the Parquet file is already complete.
            journal.unlink()
            return file_metadata(target)
        hint = "" if explicit else " with -o NEW.parquet"
        raise OutputExists(
            f"{target} exists and is not this journal's recording; recover "
            f"to a new path{hint} ({journal} is kept)"
        )
    info.update(recovered=True, recovered_ns=time.time_ns())
    return journal_to_parquet(journal, target, info, overwrite=False)


def _converted_from(target: Path, journal: Path, info: dict[str, Any]) -> bool:
    """``target`` is the complete conversion of ``journal``: the same recorder segment (start
    and open times) and at least as many batches and gaps as the journal holds."""
    try:
        meta = file_metadata(target)
    except (OSError, ValueError):
        return False
    if not meta or (meta.get("start_ns"), meta.get("opened_ns")) != (
        info.get("start_ns"),
        info.get("opened_ns"),
    ):
        return False
    counts = meta.get("counts") or {}
    journalled = sum(rb.num_rows for rb in read_journal(journal))
    return int(counts.get("batches", 0)) + int(counts.get("gaps", 0)) >= journalled


def _recover_directory(directory: Path) -> Path:
    names = [e.name for e in directory.iterdir()]
    if not any(is_kvctl_entry(n) for n in names):
        raise NotARecording(
            f"{directory}: no kvctl recording here (no segments, journals or "
            "manifest); nothing changed"
        )
    old_manifest: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        old_manifest = json.loads((directory / MANIFEST_NAME).read_text())
    if not leftover_journals(directory) and old_manifest.get("complete"):
        raise FileNotFoundError(
            f"no journal to recover in {directory} (its recording is complete); nothing changed"
        )
    for entry in sorted(directory.iterdir()):  # a live recorder's directory is its own
        if SEGMENT_JOURNAL_RE.match(entry.name):
            with contextlib.suppress(NotAJournal):
                pid = writer_running(journal_header(entry))
                if pid is not None:
                    raise RecorderRunning(
                        f"{directory} is being written by a running recorder (pid {pid}); "
                        "stop it instead (Ctrl-C or SIGTERM converts it); nothing changed"
                    )
    refused: list[str] = []
    for entry in sorted(directory.iterdir()):
        m = SEGMENT_JOURNAL_RE.match(entry.name)
        if m:
            try:
                _recover_one(entry, directory / entry.name[1 : -len(JOURNAL_SUFFIX)])
            except (NotAJournal, OutputExists, RecorderRunning) as exc:
                refused.append(str(exc))
    for entry in list(directory.glob(".part-*.tmp")):
        remove_stale_temps(directory / (entry.name[1:].split(".parquet.")[0] + ".parquet"))
    segments = []
    metadata: dict[str, Any] = {}
    for number, entry in segment_files(directory):
        meta = file_metadata(entry)
        meta["file"] = entry.name
        meta["bytes"] = entry.stat().st_size
        meta.setdefault("segment", number)
        metadata = meta.get("metadata", metadata)
        segments.append(meta)
    old: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        old = json.loads((directory / MANIFEST_NAME).read_text())
    extra = {k: old.get(k) for k in ("start_ns", "rotate_size", "rotate_every")}
    extra.update(end_ns=None, recovered=True)
    write_manifest(directory, segments, old.get("metadata", metadata), not refused, extra)
    if refused:
        raise OutputExists(
            refused[0] + (f" (and {len(refused) - 1} more)" if len(refused) > 1 else "")
        )
    return directory


# --- reading ------------------------------------------------------------------------------------
