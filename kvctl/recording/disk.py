"""Files that appear whole or not at all: temp names per process, atomic publishing that never
replaces what someone else wrote, directory fsync, and whether a journal's writer still runs."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (best effort: not every file system can)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def temp_path(target: Path) -> Path:
    """A temp name unique to this process (a dying converter never unlinks another's file)."""
    return target.with_name(f".{target.name}.{os.getpid()}.tmp")


def remove_stale_temps(target: Path) -> None:
    """Remove temp files of ``target`` left by processes that no longer run."""
    with contextlib.suppress(OSError):
        for entry in target.parent.glob(f".{target.name}.*.tmp"):
            pid = entry.name[len(target.name) + 2 : -4]
            if pid.isdigit() and int(pid) != os.getpid() and _alive(int(pid)):
                continue
            entry.unlink(missing_ok=True)


def writer_running(info: dict[str, Any]) -> int | None:
    """The pid of the kvctl process still writing the journal with header ``info``, if any
    (a pid reused by another program does not count)."""
    pid = info.get("writer_pid")
    if type(pid) is not int or pid == os.getpid() or not _alive(pid):
        return None
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return pid if b"kvctl" in f.read() else None
    except OSError:
        return pid  # no /proc: trust the pid


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


class OutputExists(FileExistsError):
    """The output path holds a file this run did not write."""


def publish(tmp: Path, target: Path, overwrite: bool) -> None:
    """Move a complete ``tmp`` to ``target`` atomically. Without ``overwrite`` an existing
    target is never replaced: a hard link fails if the name is taken (no check-then-rename
    race); file systems without hard links fall back to a checked rename."""
    if overwrite:
        os.replace(tmp, target)
        return
    try:
        os.link(tmp, target)
    except FileExistsError:
        raise OutputExists(f"{target} exists (written by someone else); not replaced") from None
    except OSError:
        if target.exists():
            raise OutputExists(f"{target} exists (written by someone else); not replaced") from None
        os.rename(tmp, target)
        return
    tmp.unlink()
