"""A full disk never costs the user what was already written: record stops with one line that
says how much reached the journal, recover brings exactly that back (to another disk), and no
command leaves a temp file behind. Needs root to mount a small tmpfs; skipped otherwise."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from conftest import free_port, run_kvctl, start_kvctl
from inprocess import run_main

from kvctl.recording.reader import open_recording


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 1 MiB tmpfs, unmounted afterwards."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
        capture_output=True,
        timeout=10,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=10)


def test_record_on_a_full_disk_keeps_what_was_flushed(tmp_path, small_disk):
    port = free_port()  # a live engine fills the 1 MiB disk in a few seconds
    engine = start_kvctl(
        "simulate",
        "--workers",
        "1",
        "--base-port",
        str(port),
        "--wait-subscribers",
        "1",
        "--rate",
        "200",
        "--speedup",
        "5",
        "--duration",
        "300",
        "-q",
    )
    output = small_disk / "run.parquet"

    try:
        rec = run_kvctl("record", f"tcp://127.0.0.1:{port}", "-o", str(output), timeout=60)
    finally:
        engine.kill()
        engine.communicate(timeout=10)
    err = rec.stderr.decode()
    assert rec.returncode == 1, err
    assert "Traceback" not in err
    failure = [line for line in err.splitlines() if "cannot write" in line]
    assert len(failure) == 1 and "No space left on device" in failure[0], err
    assert f"kvctl recover {output}" in failure[0]
    journalled = int(failure[0].split(" of ")[0].rsplit(" ", 1)[1].replace(",", ""))
    assert journalled > 0

    # still full: recover refuses in one line, keeps the journal, leaves no temp file
    again = run_main("recover", str(output), timeout=60)
    assert again.code == 1 and "the journal is kept" in again.err
    assert "Traceback" not in again.err
    assert sorted(p.name for p in small_disk.iterdir()) == ["run.parquet.journal"]

    elsewhere = tmp_path / "recovered.parquet"
    saved = run_main("recover", str(output), "-o", str(elsewhere), timeout=60)
    assert saved.code == 0, saved.err
    batches = sum(1 for b in open_recording(str(elsewhere)) if b is not None)
    assert batches == journalled  # exactly what the error line promised
    assert list(small_disk.iterdir()) == []  # the journal went only once the copy was safe
