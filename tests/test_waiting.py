"""Live sources that are not there yet are waited for, like a ZMQ consumer waits: recorders and
routers start before the engines. Stop conditions, Ctrl-C and --connect-timeout still end the
wait. Real ZMQ sockets and a real nats-server; kvctl runs in-process as the console script
does (what a user sees on stderr, exit codes), and as a subprocess where signals end it."""

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
    removed,
    start_kvctl,
)
from inprocess import Live, run_main

NOTICE = "yet, waiting; --connect-timeout S to give up"


def dead_zmq() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def dead_nats() -> str:
    return f"nats://127.0.0.1:{free_port()}"


def test_tap_waits_for_a_publisher_that_binds_later():
    endpoint = dead_zmq()
    engines: list[Engine] = []

    def bind_later(live: Live) -> None:
        # the notice comes ~3 s after the start: the engine binds well after tap connected
        lines = live.wait_for_stderr(NOTICE).splitlines()
        assert lines[-1].strip() == f"kvctl: nothing at {endpoint} {NOTICE}"
        engines.append(Engine(endpoint))
        engines[0].wait_for()
        for i in range(3):
            engines[0].send([removed([i])])

    try:
        result = run_main("tap", endpoint, "--json", "-c", "3", alongside=bind_later)
    finally:
        for engine in engines:
            engine.close()
    rc, out, err = result.code, result.out, result.err
    assert rc == 0, err
    assert [json.loads(line)["block_hashes"] for line in out.splitlines()] == [[0], [1], [2]]
    assert f"kvctl: connected to {endpoint} after" in err
    assert err.count(NOTICE) == 1
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
    result = run_main("tap", source, "--connect-timeout", "1", "-q")
    elapsed = time.monotonic() - started
    err = result.err
    assert result.code == 1
    assert err == f"kvctl: {source}: {error}\n"  # -q: only the error, one line
    assert elapsed < 6


def test_connect_timeout_from_the_environment():
    result = run_main("tap", dead_zmq(), env={"KVCTL_TAP_CONNECT_TIMEOUT": "0.5"})
    assert result.code == 1 and "connection refused after 0.5 s" in result.err


@pytest.mark.parametrize("make_source", [dead_zmq, dead_nats])
def test_duration_ends_the_wait(make_source):
    source = make_source()
    started = time.monotonic()
    result = run_main("tap", source, "--duration", "2", timeout=20)
    elapsed = time.monotonic() - started
    err = result.err
    assert result.code == 0, err
    assert elapsed < 6, f"took {elapsed:.1f} s"
    assert f"kvctl: never connected to {source}" in err
    assert "0 events" in err and "stopped by --duration" in err and "Traceback" not in err


@pytest.mark.parametrize("make_source", [dead_zmq, dead_nats])
def test_idle_timeout_counts_from_the_start_while_waiting(make_source):
    started = time.monotonic()
    result = run_main("tap", make_source(), "--idle-timeout", "1", timeout=20)
    assert result.code == 0
    assert "stopped by --idle-timeout" in result.err
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
    result = run_main("tap", dead_nats(), dead_zmq(), "--duration", "3.5", "-q", timeout=20)
    assert result.code == 0 and result.err == ""


def test_one_notice_names_every_missing_source():
    zmq_source, nats_source = dead_zmq(), dead_nats()
    result = run_main("tap", zmq_source, nats_source, "--duration", "3.5", timeout=20)
    err = result.err
    assert err.count(NOTICE) == 1
    assert f"kvctl: nothing at {zmq_source}, {nats_source} {NOTICE}" in err


def test_nats_server_that_starts_later(tmp_path):
    from test_tap_nats import publish

    from kvctl.formats.dynamo import encode_json, router_event

    port = free_port()
    servers: list[NatsServer] = []

    def start_later(live: Live) -> None:
        live.wait_for_stderr(NOTICE)
        servers.append(NatsServer(tmp_path, port=port))
        live.wait_for_stderr(f"connected to NATS at {servers[0].url} after")
        publish(
            servers[0].url,
            [
                (
                    "namespace.a.component.b.kv_events",
                    encode_json(router_event({"type": "AllBlocksCleared"}, 1, 0)),
                )
            ],
        )

    try:
        result = run_main(
            "tap", f"nats://127.0.0.1:{port}", "--json", "-c", "1", alongside=start_later
        )
    finally:
        for server in servers:
            server.stop()
    rc, out, err = result.code, result.out, result.err
    assert rc == 0, err
    assert json.loads(out)["type"] == "AllBlocksCleared"
    assert "Traceback" not in err and "never connected" not in err


def test_record_waits_and_keeps_what_came(tmp_path):
    endpoint = dead_zmq()
    path = tmp_path / "late.parquet"
    engines: list[Engine] = []

    def bind_later(live: Live) -> None:
        live.wait_for_stderr(NOTICE)
        engines.append(Engine(endpoint))
        engines[0].wait_for()
        engines[0].send([removed([1]), removed([2])])

    try:
        result = run_main(
            "record", endpoint, "-o", str(path), "-c", "2", timeout=30, alongside=bind_later
        )
    finally:
        for engine in engines:
            engine.close()
    assert result.code == 0, result.err
    rows = run_main("cat", str(path), "--json").out.splitlines()
    assert [json.loads(r)["block_hashes"] for r in rows] == [[1], [2]]


def test_record_stopped_while_waiting_writes_an_empty_recording(tmp_path):
    path = tmp_path / "none.parquet"
    result = run_main("record", dead_nats(), "-o", str(path), "--duration", "1", timeout=20)
    err = result.err
    assert result.code == 0, err
    assert "never connected to" in err and "Traceback" not in err
    assert run_main("cat", str(path)).code == 0


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
