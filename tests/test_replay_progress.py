"""kvctl replay's progress bar on a real terminal (a pseudo-terminal as stderr): the process
boundary is the point, since the bar is drawn only when stderr is a terminal."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import termios
import time

from conftest import REPO, free_port, kvctl_cmd
from inprocess import run_main


def test_progress_shows_done_total_percent_and_eta(tmp_path):
    recording = tmp_path / "sim.parquet"
    made = run_main(
        "simulate", "-o", str(recording), "--workers", "2", "--requests", "30", "--json", "-q"
    )
    assert made.code == 0, made.err
    total = int(re.search(r'"batches":(\d+)', made.out).group(1))
    loops = 2
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    proc = subprocess.Popen(
        kvctl_cmd(
            "replay",
            str(recording),
            "--to",
            f"tcp://127.0.0.1:{free_port()}",
            "--rate",
            str(total),
            "--loop",
            str(loops),
        ),  # ~2 s: several redraws
        stdout=subprocess.DEVNULL,
        stderr=slave,
        cwd=REPO,
        env={**os.environ, "TERM": "xterm", "COLUMNS": "160"},
    )
    os.close(slave)
    screen = b""
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # the child closed the terminal
                    break
                if not chunk:
                    break
                screen += chunk
            elif proc.poll() is not None:
                break
        assert proc.wait(timeout=10) == 0, screen.decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen.decode(errors="replace"))
    shown = re.findall(rf"replaying.*?(\d+)/{total * loops}\s+(\d+)%\s+ETA\s+\d+:\d\d:\d\d", text)
    assert shown, text  # done/total over both loops, percent and ETA
    assert all(abs(int(pct) - 100 * int(done) / (total * loops)) <= 1 for done, pct in shown), shown
    assert "batches/s sent" in text
