"""Run ``kvctl`` in-process exactly as the console script does (``kvctl.cli.main``: the one
place exceptions become exit codes), with stdout and stderr captured and not a terminal.

A run takes a fraction of a subprocess's time, so every test where no process boundary is
under test runs kvctl this way. Live tests give ``alongside`` a function that plays the other
side (an engine publishing, a subscriber reading) in a thread, while kvctl runs in the main
thread: ``kvctl.cli.main`` installs a signal handler, which only the main thread may do.
stdout and stderr are process-wide, so one in-process kvctl runs at a time; the command must
end by itself (``-c``, ``--idle-timeout``, ``--duration``), and a watchdog interrupts it (as
Ctrl-C would) and fails the test when it overstays."""

from __future__ import annotations

import io
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from io import BytesIO
from typing import Any

from click import formatting
from click.testing import CliRunner

from kvctl.cli import main


@dataclass
class Run:
    code: int
    out: str
    err: str


class Live:
    """What the ``alongside`` thread sees of the running command: its output so far."""

    def __init__(self, out: BytesIO, err: BytesIO) -> None:
        self._out = out
        self._err = err
        self.ended = threading.Event()
        """Set when the command has returned."""

    def stdout(self) -> str:
        return self._out.getvalue().decode(errors="replace")

    def stderr(self) -> str:
        return self._err.getvalue().decode(errors="replace")

    def wait_for_stderr(self, text: str, timeout: float = 15) -> str:
        """Polls the captured stderr (a bounded wait) until ``text`` appears; returns it all."""
        return self._wait_for(self.stderr, text, timeout, "stderr")

    def wait_for_stdout(self, text: str, timeout: float = 15) -> str:
        return self._wait_for(self.stdout, text, timeout, "stdout")

    @staticmethod
    def _wait_for(read: Callable[[], str], text: str, timeout: float, name: str) -> str:
        deadline = time.monotonic() + timeout
        while text not in (seen := read()):
            assert time.monotonic() < deadline, f"no {text!r} on {name} within {timeout}s: {seen}"
            time.sleep(0.01)  # a captured stream has no readiness signal of its own
        return seen


class _Interrupter:
    """Stops the command in the main thread, as Ctrl-C would, when the watchdog fires or the
    ``alongside`` thread fails; only while the command runs, never the test after it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = True
        self._main = threading.main_thread().ident
        self.reason: str | None = None

    def interrupt(self, reason: str) -> None:
        with self._lock:
            if self._running and self.reason is None:
                self.reason = reason
                assert self._main is not None
                signal.pthread_kill(self._main, signal.SIGINT)

    def stop(self) -> None:
        with self._lock:
            self._running = False


def run_main(
    *args: str,
    env: dict[str, str] | None = None,
    timeout: float = 30,
    alongside: Callable[[Live], object] | None = None,
) -> Run:
    """kvctl ``args`` to completion (bounded by ``timeout``); ``alongside`` runs in a thread
    meanwhile, and an exception there fails the test (after stopping the command)."""
    assert threading.current_thread() is threading.main_thread(), "kvctl runs in the main thread"
    runner = CliRunner()
    previous = signal.getsignal(signal.SIGTERM)  # main() installs its own handler
    argv = sys.argv
    sys.argv = ["kvctl", *args]  # record and simulate keep the command line in the recording
    interrupter = _Interrupter()
    side_error: list[BaseException] = []
    side: threading.Thread | None = None
    try:
        with runner.isolation(env=env) as (out, err, _):
            formatting.FORCED_WIDTH = None  # help as wide as when piped, not CliRunner's 80
            assert isinstance(sys.stderr, io.TextIOWrapper)
            sys.stderr.reconfigure(line_buffering=True)  # as Python's own stderr
            live = Live(out, err)
            if alongside is not None:

                def play() -> None:
                    try:
                        alongside(live)
                    except BaseException as exc:
                        side_error.append(exc)
                        interrupter.interrupt(f"the other side failed: {exc!r}")

                side = threading.Thread(target=play, name="alongside kvctl", daemon=True)
                side.start()
            watchdog = threading.Timer(
                timeout, interrupter.interrupt, (f"kvctl did not stop within {timeout}s",)
            )
            watchdog.start()
            code = -1
            try:
                try:
                    main(list(args))
                    code = 0
                except SystemExit as exc:
                    code = int(exc.code or 0)
                finally:
                    watchdog.cancel()
                    interrupter.stop()
                    live.ended.set()
            except KeyboardInterrupt:
                if interrupter.reason is None:
                    raise  # a real Ctrl-C of the test run
            sys.stdout.flush()
            sys.stderr.flush()
            result = Run(code, out.getvalue().decode(), err.getvalue().decode())
            if side is not None:
                side.join(timeout)
                assert not side.is_alive(), f"the other side did not end; stderr: {result.err}"
    finally:
        signal.signal(signal.SIGTERM, previous)
        sys.argv = argv
    if side_error:
        failure = f"the other side failed; kvctl stderr: {result.err}"
        raise AssertionError(failure) from side_error[0]
    assert interrupter.reason is None, f"{interrupter.reason}; stderr: {result.err}"
    return result


def run_while(send: Callable[[], object], *args: str, **options: Any) -> tuple[int, str, str]:
    """kvctl ``args`` in-process while ``send`` (say, an engine waiting for kvctl to subscribe,
    then publishing) runs alongside: ``(exit code, stdout, stderr)``, as ``finish`` returns."""
    result = run_main(*args, alongside=lambda _: send(), **options)
    return result.code, result.out, result.err
