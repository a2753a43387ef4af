"""The converter subprocess behind ``kvctl record``, and the recorder's handle on it.

The conversion (:mod:`kvctl.recording.convert`) runs in a separate process (:func:`main`,
driven by :class:`Converter`), so it never competes with the receive loop for the GIL. It
follows the journal while recording: the recorder sends the byte offset up to which the journal
holds complete record batches after each flush; the converter reads up to there (one record
batch at a time: disk is the buffer), appends Parquet row groups to a temp file, and when the
recorder seals the journal (rotation or close) finishes the file (metadata, fsync, atomic
rename, journal removed). Its stdin is its lifeline: end of input without an ``exit`` command
means the recorder died, and the converter removes its temp file and leaves the journal for
``kvctl recover``.

Protocol (JSON lines): recorder -> converter ``config`` (first line), ``open``, ``commit``,
``seal``, ``exit``; converter -> recorder ``ready``, ``progress``, ``done``, ``failed``,
``bye``.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

from .convert import DEFAULT_ZSTD_LEVEL, Decoder, ParquetOutput
from .schema import METADATA_KEY


class _Task:
    """One journal being converted: how far it is committed, read, and sealed."""

    def __init__(self, msg: dict[str, Any], level: int) -> None:
        self.journal = Path(msg["journal"])
        self.target = Path(msg["target"])
        self.committed = int(msg.get("offset", 0))
        self.overwrite = bool(msg.get("overwrite", False))
        self.sealed: dict[str, Any] | None = None
        self.level = level
        self.file: Any = None
        self.schema: pa.Schema | None = None
        self.pos = 0
        self.decoder: Decoder | None = None
        self.out: ParquetOutput | None = None

    def step(self) -> bool:
        """Convert the next committed record batch; False when there is none yet."""
        if self.pos >= self.committed:
            return False
        if self.file is None:
            self.file = pa.OSFile(str(self.journal), "rb")
            message = pa.ipc.read_message(self.file)
            self.schema = pa.ipc.read_schema(message)
            info = json.loads((self.schema.metadata or {}).get(METADATA_KEY.encode(), b"{}"))
            self.decoder = Decoder(info)
            self.out = ParquetOutput(self.target, self.level)
            self.pos = self.file.tell()
            if self.pos >= self.committed:
                return True
        self.file.seek(self.pos)
        message = pa.ipc.read_message(self.file)
        rb = pa.ipc.read_record_batch(message, self.schema)
        self.pos = self.file.tell()
        assert self.decoder is not None and self.out is not None
        for part in self.decoder.convert_parts(rb):
            self.out.add(part)
        return True

    def finish(self) -> dict[str, Any]:
        assert self.sealed is not None
        if self.file is None:  # nothing was committed: an empty, valid file
            self.decoder = Decoder(self.sealed)
            self.out = ParquetOutput(self.target, self.level)
        else:
            self.file.close()
        assert self.out is not None and self.decoder is not None
        info = dict(self.sealed)
        if self.decoder.mismatches:
            info["mismatches"] = self.decoder.mismatches
        return self.out.finish(info, self.journal, self.overwrite)

    def abort(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.out is not None:
            self.out.abort()


def _emit(msg: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


def main() -> int:
    """The converter process: ``python -m kvctl.recording.converter`` (driven by the recorder
    through stdin/stdout; see the module docstring)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the recorder decides when we stop
    tasks: list[_Task] = []
    try:
        return _serve(tasks)
    except BrokenPipeError:  # the recorder stopped reading us: it died, as at end of input
        for t in tasks:
            t.abort()
        raise


def _serve(tasks: list[_Task]) -> int:
    """Follow the recorder's commands until ``exit`` (0) or the end of its input (1)."""
    fd = sys.stdin.fileno()
    buf = b""
    config: dict[str, Any] | None = None
    exiting = False
    ready = False
    while True:
        busy = bool(tasks) and (tasks[0].pos < tasks[0].committed or tasks[0].sealed is not None)
        r, _, _ = select.select([fd], [], [], 0 if busy else 0.05)
        if r:
            chunk = os.read(fd, 65536)
            if not chunk:  # the recorder died: leave its journals for `kvctl recover`
                for t in tasks:
                    t.abort()
                return 1
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                msg = json.loads(line)
                op = msg["op"]
                if op == "config":
                    config = msg
                    with contextlib.suppress(OSError):
                        os.nice(int(msg.get("nice", 0)))
                elif op == "open":
                    assert config is not None
                    tasks.append(
                        _Task(msg, int(config.get("compression_level", DEFAULT_ZSTD_LEVEL)))
                    )
                elif op == "commit":
                    for t in tasks:
                        if str(t.journal) == msg["journal"]:
                            t.committed = max(t.committed, int(msg["offset"]))
                elif op == "seal":
                    for t in tasks:
                        if str(t.journal) == msg["journal"]:
                            t.committed = max(t.committed, int(msg["offset"]))
                            t.sealed = msg["info"]
                elif op == "exit":
                    exiting = True
        if config is not None and not ready:
            ready = True
            _emit({"op": "ready", "pid": os.getpid()})
        if tasks:
            task = tasks[0]
            try:
                stepped = task.step()
            except Exception as exc:  # never a traceback, never a stray temp file: the
                tasks.pop(0)  # journal stays, and the recorder converts it or says why
                task.abort()
                _emit({"op": "failed", "journal": str(task.journal), "error": str(exc)})
                continue
            if stepped:
                _emit({"op": "progress", "journal": str(task.journal), "pos": task.pos})
            elif task.sealed is not None:
                tasks.pop(0)
                try:
                    meta = task.finish()
                except Exception as exc:  # e.g. the target appeared: the journal stays
                    task.abort()
                    _emit({"op": "failed", "journal": str(task.journal), "error": str(exc)})
                    continue
                _emit(
                    {
                        "op": "done",
                        "journal": str(task.journal),
                        "meta": meta,
                        "journal_bytes": task.committed,
                    }
                )
        elif exiting:
            _emit({"op": "bye", "peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss})
            return 0


class Converter:
    """The recorder's handle on a converter process: non-blocking both ways, so a stalled or
    dead converter never holds up the recorder (commits are coalesced, never queued without
    bound; essential commands wait in a small buffer)."""

    def __init__(self, config: dict[str, Any]) -> None:
        pkg_root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = pkg_root + (
            os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""
        )
        # The system allocator hands freed row-group buffers back to the OS: flat RSS.
        env.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")
        # ... when they are mmapped: glibc raises its mmap threshold to the size of the first
        # big buffer freed, and later ones come from heaps it keeps. Fixed, the peak of a
        # conversion (a row group being written while the next is built) is ~30 MB lower.
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvctl.recording.converter"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.out_fd = self.proc.stdin.fileno()
        self.in_fd = self.proc.stdout.fileno()
        os.set_blocking(self.out_fd, False)
        os.set_blocking(self.in_fd, False)
        self.outbox = bytearray()
        self.inbox = b""
        self.last_heard = time.monotonic()
        self.ready = False
        self.finished = False  # "bye" received
        self.peak_rss_kb: int | None = None
        self.send({"op": "config", **config})

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, msg: dict[str, Any]) -> None:
        self.outbox += (json.dumps(msg) + "\n").encode()
        self.pump()

    def commit(self, journal: Path, offset: int) -> None:
        """Coalesced: when earlier commands are still waiting, the next seal/commit tells."""
        if not self.outbox:
            self.send({"op": "commit", "journal": str(journal), "offset": offset})

    def pump(self) -> list[dict[str, Any]]:
        """Write what we can, read what there is; returns the converter's messages."""
        if self.outbox:
            try:
                n = os.write(self.out_fd, self.outbox)
                del self.outbox[:n]
            except BlockingIOError:
                pass
            except OSError:  # broken pipe: the converter died
                self.outbox.clear()
        msgs = []
        while True:
            try:
                chunk = os.read(self.in_fd, 65536)
            except BlockingIOError:
                break
            except OSError:
                break
            if not chunk:
                break
            self.inbox += chunk
        if b"\n" in self.inbox:
            *lines, self.inbox = self.inbox.split(b"\n")
            for line in lines:
                with contextlib.suppress(ValueError):
                    msg = json.loads(line)
                    msgs.append(msg)
                    if msg.get("op") == "ready":
                        self.ready = True
                    elif msg.get("op") == "bye":
                        self.finished = True
                        self.peak_rss_kb = msg.get("peak_rss_kb")
            self.last_heard = time.monotonic()
        return msgs

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.kill()
        self.proc.wait()
        self.close_pipes()

    def close_pipes(self) -> None:
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # the recorder is gone; its journal stays for `kvctl recover`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
