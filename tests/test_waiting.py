"""Live sources that are not there yet are waited for, like a ZMQ consumer waits: recorders and
routers start before the engines. Stop conditions, Ctrl-C and --connect-timeout still end the
wait. Real ZMQ sockets and a real nats-server; kvctl runs as a subprocess because the point is
what a user sees on stderr and how the process ends."""

from __future__ import annotations

import json
import signal
import time

import pytest
from conftest import (
    Engine,
    NatsServer,
    finish,
    free_port,
    read_line,
    read_until,
    removed,
    rest_of,
    run_kvctl,
    start_kvctl,
)

NOTICE = "yet, waiting; --connect-timeout S to give up"


def dead_zmq() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def dead_nats() -> str:
    return f"nats://127.0.0.1:{free_port()}"


def test_tap_waits_for_a_publisher_that_binds_later():
    endpoint = dead_zmq()
    proc = start_kvctl("tap", endpoint, "--json", "-c", "3")
    # the notice comes ~3 s after the start: the engine binds well after tap connected
    lines = read_until(proc.stderr, NOTICE)
    assert lines[-1].strip() == f"kvctl: nothing at {endpoint} {NOTICE}"
    engine = Engine(endpoint)
    try:
        engine.wait_for()
        for i in range(3):
            engine.send([removed([i])])
        rc, out, err = rest_of(proc)
    finally:
        engine.close()
    assert rc == 0, err
    assert [json.loads(line)["block_hashes"] for line in out.splitlines()] == [[0], [1], [2]]
    assert f"kvctl: connected to {endpoint} after" in err
    assert NOTICE not in err  # exactly once: the one already read
    assert "never connected" not in err and "gaps 0" in err


@pytest.mark.parametrize(
    "make_source,error",
    [
        (dead_zmq, "connection refused after 1 s: is the engine publishing there?"),
        (
            dead_nats,
            "cannot connect to NATS after 1 s (connection refused): is the server running there?",
        ),
    ],
)
def test_connect_timeout_gives_up_with_one_line(make_source, error):
    source = make_source()
    started = time.monotonic()
    result = run_kvctl("tap", source, "--connect-timeout", "1", "-q")
    elapsed = time.monotonic() - started
    err = result.stderr.decode()
    assert result.returncode == 1
    assert err == f"kvctl: {source}: {error}\n"  # -q: only the error, one line
    assert elapsed < 6


def test_connect_timeout_from_the_environment():
    result = run_kvctl("tap", dead_zmq(), env={"KVCTL_TAP_CONNECT_TIMEOUT": "0.5"})
    assert result.returncode == 1 and b"connection refused after 0.5 s" in result.stderr


@pytest.mark.parametrize("make_source", [dead_zmq, dead_nats])
def test_duration_ends_the_wait(make_source):
    source = make_source()
    started = time.monotonic()
    result = run_kvctl("tap", source, "--duration", "2", timeout=20)
    elapsed = time.monotonic() - started
    err = result.stderr.decode()
    assert result.returncode == 0, err
    assert elapsed < 6, f"took {elapsed:.1f} s"
    assert f"kvctl: never connected to {source}" in err
    assert "0 events" in err and "stopped by --duration" in err and "Traceback" not in err


@pytest.mark.parametrize("make_source", [dead_zmq, dead_nats])
def test_idle_timeout_counts_from_the_start_while_waiting(make_source):
    started = time.monotonic()
    result = run_kvctl("tap", make_source(), "--idle-timeout", "1", timeout=20)
    assert result.returncode == 0
    assert b"stopped by --idle-timeout" in result.stderr
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("make_source", [dead_zmq, dead_nats])
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_while_waiting_exits_130(make_source, signum):
    source = make_source()
    proc = start_kvctl("tap", source)
    assert read_line(proc.stderr).startswith("kvctl: reading")  # the source is open
    proc.send_signal(signum)
    started = time.monotonic()
    rc, _, err = finish(proc, timeout=10)
    assert rc == 130, err
    assert time.monotonic() - started < 3
    assert f"never connected to {source}" in err and "stopped by interrupt" in err
    assert "Traceback" not in err


def test_quiet_silences_the_notice():
    result = run_kvctl("tap", dead_nats(), dead_zmq(), "--duration", "3.5", "-q", timeout=20)
    assert result.returncode == 0 and result.stderr == b""


def test_one_notice_names_every_missing_source():
    zmq_source, nats_source = dead_zmq(), dead_nats()
    result = run_kvctl("tap", zmq_source, nats_source, "--duration", "3.5", timeout=20)
    err = result.stderr.decode()
    assert err.count(NOTICE) == 1
    assert f"kvctl: nothing at {zmq_source}, {nats_source} {NOTICE}" in err


def test_nats_server_that_starts_later(tmp_path):
    port = free_port()
    proc = start_kvctl("tap", f"nats://127.0.0.1:{port}", "--json", "-c", "1")
    read_until(proc.stderr, NOTICE)
    server = NatsServer(tmp_path, port=port)
    try:
        read_until(proc.stderr, f"connected to NATS at {server.url} after")
        from test_tap_nats import publish

        from kvctl.formats.dynamo import encode_json, router_event

        publish(
            server.url,
            [
                (
                    "namespace.a.component.b.kv_events",
                    encode_json(router_event({"type": "AllBlocksCleared"}, 1, 0)),
                )
            ],
        )
        rc, out, err = rest_of(proc)
    finally:
        server.stop()
    assert rc == 0, err
    assert json.loads(out)["type"] == "AllBlocksCleared"
    assert "Traceback" not in err and "never connected" not in err


def test_record_waits_and_keeps_what_came(tmp_path):
    endpoint = dead_zmq()
    path = tmp_path / "late.parquet"
    proc = start_kvctl("record", endpoint, "-o", str(path), "-c", "2")
    read_until(proc.stderr, NOTICE)
    engine = Engine(endpoint)
    try:
        engine.wait_for()
        engine.send([removed([1]), removed([2])])
        rc, _, err = rest_of(proc, timeout=30)
    finally:
        engine.close()
    assert rc == 0, err
    rows = run_kvctl("cat", str(path), "--json").stdout.decode().splitlines()
    assert [json.loads(r)["block_hashes"] for r in rows] == [[1], [2]]


def test_record_stopped_while_waiting_writes_an_empty_recording(tmp_path):
    path = tmp_path / "none.parquet"
    result = run_kvctl("record", dead_nats(), "-o", str(path), "--duration", "1", timeout=20)
    err = result.stderr.decode()
    assert result.returncode == 0, err
    assert "never connected to" in err and "Traceback" not in err
    assert run_kvctl("cat", str(path)).returncode == 0


def invoke(*args: str):
    """kvctl in-process, as click runs it for a user (exceptions left for the caller)."""
    from click.testing import CliRunner

    from kvctl.cli import cli

    return CliRunner().invoke(cli, list(args), catch_exceptions=True)


@pytest.mark.parametrize("make_source", [dead_zmq, dead_nats])
def test_in_process_duration_while_waiting(make_source):
    source = make_source()
    started = time.monotonic()
    result = invoke("tap", source, "--duration", "1")
    assert result.exit_code == 0, result.output
    assert time.monotonic() - started < 4
    assert f"kvctl: never connected to {source}" in result.stderr
    assert "stopped by --duration" in result.stderr


def test_in_process_connect_timeout_is_a_transport_error():
    from kvctl.errors import ExitCode, TransportError

    source = dead_zmq()
    result = invoke("tap", source, "--connect-timeout", "0.5")
    assert isinstance(result.exception, TransportError)
    assert result.exception.exit_code == ExitCode.ERROR
    assert str(result.exception) == (
        f"{source}: connection refused after 0.5 s: is the engine publishing there?"
    )
    assert "never connected" not in result.stderr  # the error says it; nothing else does
