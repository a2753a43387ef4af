"""Run ``kvctl`` in-process exactly as the console script does (``kvctl.cli.main``: the one
place exceptions become exit codes), with stdout and stderr captured and not a terminal."""

from __future__ import annotations

import signal
import sys
from dataclasses import dataclass

from click.testing import CliRunner

from kvctl.cli import main


@dataclass
class Run:
    code: int
    out: str
    err: str


def run_main(*args: str, env: dict[str, str] | None = None) -> Run:
    runner = CliRunner()
    previous = signal.getsignal(signal.SIGTERM)  # main() installs its own handler
    try:
        with runner.isolation(env=env) as (out, err, _):
            try:
                main(list(args))
                code = 0
            except SystemExit as exc:
                code = int(exc.code or 0)
            sys.stdout.flush()
            sys.stderr.flush()
            return Run(code, out.getvalue().decode(), err.getvalue().decode())
    finally:
        signal.signal(signal.SIGTERM, previous)
