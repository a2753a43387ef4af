"""Recordings as a pipeline source: files, segment directories or journals, read back in
recorded order, and datasets (partitioned segments in a directory or ``s3://bucket/prefix``),
read back in receive-time order.

Apart from :mod:`kvctl.recording.reader` so that building the source (every command that
takes a source does, before knowing its kind) does not import pyarrow.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import TransportError, UsageError
from ..events import Batch


class RecordingSource:
    """Recordings (files, segment directories or journals) read back in recorded order, and
    datasets in receive-time order."""

    def __init__(self, paths: list[str], chunk_rows: int = 4096, selection: Any = None) -> None:
        """``chunk_rows``: rows decoded at a time. Reading a chunk holds the GIL, so a paced
        replay reads small chunks (short stalls); throughput wants large ones. ``selection``
        (:class:`~kvctl.selection.Filters`): what a dataset need not read (the pipeline
        still applies the filters)."""
        for path in paths:
            if not path.startswith("s3://") and not Path(path).exists():
                raise UsageError(
                    f"{path}: no such recording (sources are tcp://, ipc://, "
                    "nats:// or a recording path)"
                )
        self.paths = paths
        self.chunk_rows = chunk_rows
        self.selection = selection

    def batches(self) -> Iterator[Batch]:
        """Every batch of every recording, in order (a recording has no idle ticks: no None)."""
        from .reader import open_recording  # pyarrow: only once a recording is read

        for path in self.paths:
            try:
                batches = open_recording(path, batch_size=self.chunk_rows, selection=self.selection)
                if getattr(self.selection, "partition", None) is None:
                    yield from batches
                else:  # a recording that is no dataset holds every partition's workers
                    yield from (b for b in batches if self.selection.keeps_batch(b))
            except (OSError, ValueError) as exc:  # pyarrow's errors derive from these
                raise TransportError(f"{path}: cannot read recording: {exc}") from None

    def close(self) -> None:
        pass
