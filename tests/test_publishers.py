"""replay, simulate and bridge as publishers: NATS credentials and TLS options like tap's,
no password on screen, and reports that say who could have received what (ZMQ subscribers at
start and end, back-pressure from a slow one, JetStream acks)."""

from __future__ import annotations

import json

import pytest
import zmq
from conftest import NatsServer, finish, free_port, start_kvctl, stored
from inprocess import run_main
from test_cmd_replay import make_recording, rows_of
from test_tap_nats import wait_ready

from kvctl.formats import decode_zmq
from kvctl.formats.engine_zmq import encode_frames, encode_payload
from kvctl.recording.writer import RecordingWriter

USER, PASSWORD = "kv", "s3cret-pw"
CREDENTIALS = ("--nats-user", USER, "--nats-password", PASSWORD)


@pytest.fixture(scope="module")
def guarded_nats(tmp_path_factory: pytest.TempPathFactory):
    """A nats-server that accepts only USER/PASSWORD."""
    server = NatsServer(tmp_path_factory.mktemp("guarded"), "--user", USER, "--pass", PASSWORD)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("rec") / "run.parquet"
    return path, make_recording(path, batches=20)


def tap_with_credentials(url: str, count: int):
    tap = start_kvctl("tap", url, "--json", "-c", str(count), *CREDENTIALS)
    wait_ready(tap)
    return tap


def test_replay_publishes_with_the_same_credentials_as_tap(guarded_nats, recording):
    path, batches = recording
    events = sum(len(b.events) for b in batches)
    tap = tap_with_credentials(guarded_nats.url, events)
    result = run_main("replay", str(path), "--to", guarded_nats.url, "--topspeed", *CREDENTIALS)
    assert result.code == 0, result.err
    rc, out, err = finish(tap)
    assert rc == 0, err
    assert len(rows_of(out)) == events
    assert PASSWORD not in result.out + result.err + out + err


def test_simulate_takes_the_credentials_from_kvctl_nats_variables(guarded_nats):
    tap = start_kvctl(
        "tap",
        guarded_nats.url,
        "--json",
        "--idle-timeout",
        "2",
        env={"KVCTL_NATS_USER": USER, "KVCTL_NATS_PASSWORD": PASSWORD},
    )
    wait_ready(tap)
    result = run_main(
        "simulate",
        "--to",
        guarded_nats.url,
        "--workers",
        "2",
        "--requests",
        "5",
        "--topspeed",
        "--json",
        env={"KVCTL_NATS_USER": USER, "KVCTL_NATS_PASSWORD": PASSWORD},
    )
    assert result.code == 0, result.err
    report = json.loads(result.out)
    rc, out, err = finish(tap)
    assert rc == 0, err
    assert report["events"] > 0 and len(rows_of(out)) == report["events"]
    assert report["delivery"]["published"] == report["batches"]


@pytest.mark.parametrize(
    "command",
    [
        ("replay", "RECORDING", "--topspeed"),
        ("simulate", "--workers", "1", "--requests", "1", "--topspeed"),
    ],
)
@pytest.mark.parametrize("credentials", [(), ("--nats-user", USER, "--nats-password", "wrong")])
def test_without_the_credentials_one_line_and_exit_1(guarded_nats, recording, command, credentials):
    args = [str(recording[0]) if a == "RECORDING" else a for a in command]
    result = run_main(*args, "--to", guarded_nats.url, *credentials)
    assert result.code == 1, result.err
    assert result.err.count("\n") == 1, result.err
    assert "authorization violation (see --nats-user" in result.err
    assert "wrong" not in result.err


def test_a_password_in_the_url_is_never_shown(guarded_nats, recording):
    url = guarded_nats.url.replace("nats://", f"nats://{USER}:{PASSWORD}@")
    shown = url.replace(PASSWORD, "***")
    simulate = run_main("simulate", "--to", url, "--workers", "1", "--requests", "2", "--topspeed")
    assert simulate.code == 0, simulate.err
    assert shown in simulate.err and PASSWORD not in simulate.err + simulate.out
    replay = run_main("replay", str(recording[0]), "--to", url, "--topspeed", "--json")
    assert replay.code == 0, replay.err
    assert json.loads(replay.out)["delivery"]["server"] == shown
    assert PASSWORD not in replay.err + replay.out
    refused = run_main("replay", str(recording[0]), "--to", url.replace(PASSWORD, "nope"))
    assert refused.code == 1 and "nope" not in refused.err and "***" in refused.err


def test_bridge_target_uses_the_credentials(guarded_nats, engine):
    tap = tap_with_credentials(guarded_nats.url, 3)
    bridge = start_kvctl(
        "bridge", engine.endpoint, "--to", guarded_nats.url, "-c", "3", "--json", *CREDENTIALS
    )
    engine.wait_for(1)
    for i in range(3):
        engine.send([stored([i + 1])])
    rc, report, err = finish(bridge)
    assert rc == 0, err
    assert json.loads(report)["delivery"]["published"] == 3
    rc, out, tap_err = finish(tap)
    assert rc == 0, tap_err
    assert [r["block_hashes"] for r in rows_of(out)] == [[1], [2], [3]]


# --- honest reports -------------------------------------------------------------------------


def test_replay_to_nobody_says_nothing_was_received(recording):
    result = run_main(
        "replay", str(recording[0]), "--to", f"tcp://127.0.0.1:{free_port()}", "--topspeed"
    )
    assert result.code == 0, result.err
    assert "sent to 0 subscribers: nothing was received" in result.err
    as_json = run_main(
        "replay",
        str(recording[0]),
        "--to",
        f"tcp://127.0.0.1:{free_port()}",
        "--topspeed",
        "--json",
    )
    delivery = json.loads(as_json.out)["delivery"]
    assert delivery["subscribers_peak"] == 0 and delivery["subscribers_at_start"] == 0


def test_simulate_to_nobody_says_nothing_was_received():
    from conftest import free_port_range

    result = run_main(
        "simulate",
        "--workers",
        "2",
        "--base-port",
        str(free_port_range(2)),
        "--requests",
        "3",
        "--topspeed",
    )
    assert result.code == 0, result.err
    assert "sent to 0 subscribers: nothing was received" in result.err


def test_report_gives_subscribers_at_start_and_end(recording):
    to = f"tcp://127.0.0.1:{free_port()}"
    replay = start_kvctl(
        "replay", str(recording[0]), "--to", to, "--wait-subscribers", "1", "--rate", "200"
    )
    tap = start_kvctl("tap", to, "--json", "--idle-timeout", "2", "--connect-timeout", "10")
    rc, _, err = finish(replay)
    assert rc == 0, err
    assert "Subscribers: 1 at start, 1 at end, 1 at most" in err
    assert "ZMQ PUB cannot tell whether subscribers kept up" in err
    finish(tap)


def test_a_subscriber_that_left_is_not_counted_at_the_end(recording):
    to = f"tcp://127.0.0.1:{free_port()}"
    replay = start_kvctl(
        "replay", str(recording[0]), "--to", to, "--wait-subscribers", "1", "--rate", "20", "--json"
    )
    tap = start_kvctl("tap", to, "--json", "-c", "2", "--connect-timeout", "10")
    rc, _, err = finish(tap)
    assert rc == 0, err
    rc, out, err = finish(replay)
    assert rc == 0, err
    delivery = json.loads(out)["delivery"]
    assert (
        delivery["subscribers_at_start"],
        delivery["subscribers_at_end"],
        delivery["subscribers_peak"],
    ) == (1, 0, 1)


def big_recording(path, batches: int, hashes: int) -> int:
    """``batches`` engine batches of one event with ``hashes`` block hashes (~9 bytes each)."""
    writer = RecordingWriter(path)
    t0 = 1_700_000_000_000_000_000
    for i in range(batches):
        events = [stored(range(i * hashes, (i + 1) * hashes), block_size=1)]
        frames = encode_frames(b"", i, encode_payload(events, t0 / 1e9, 0))
        writer.write(decode_zmq(frames, "tcp://w", t0 + i, worker_id=0))
    writer.close()
    return batches


def test_topspeed_into_a_slow_subscriber_waits_and_drops_nothing(tmp_path):
    """A subscriber that reads late: a plain PUB drops what overflows its queue and reports
    everything sent; kvctl waits (back-pressure), says so, and the subscriber gets it all."""
    path = tmp_path / "big.parquet"
    sent = big_recording(path, batches=600, hashes=500)  # ~4.5 KB each, ~2.7 MB in all
    to = f"tcp://127.0.0.1:{free_port()}"
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 5)
    sub.setsockopt(zmq.RCVBUF, 4096)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(to)
    replay = start_kvctl(
        "replay",
        str(path),
        "--to",
        to,
        "--format",
        "raw",
        "--topspeed",
        "--hwm",
        "5",
        "--wait-subscribers",
        "1",
        "--json",
    )
    received = 0
    try:
        assert sub.poll(15_000), "nothing arrived"
        import time

        time.sleep(1.0)  # the subscriber is busy: the publisher's queue fills up
        while received < sent and sub.poll(5_000):
            sub.recv_multipart()
            received += 1
    finally:
        sub.close(0)
    rc, out, err = finish(replay, timeout=30)
    assert rc == 0, err
    delivery = json.loads(out)["delivery"]
    assert received == sent
    assert delivery["stalls"] > 0 and delivery["stalled_s"] > 0
    assert delivery["subscribers_at_start"] == 1 and delivery["flushed"]


def test_jetstream_acks_are_counted(guarded_nats, recording):
    # the guarded server, not the shared one: other tests read every stream's history there
    path, batches = recording
    events = sum(len(b.events) for b in batches)
    result = run_main(
        "replay",
        str(path),
        "--to",
        guarded_nats.url,
        "--format",
        "dynamo-json",
        "--namespace",
        "acks",
        "--topspeed",
        *CREDENTIALS,
    )
    assert result.code == 0, result.err
    stream = "namespace-acks-component-backend-kv-events"
    assert f"JetStream: {events} of {events} messages acked by stream {stream}" in result.err


def test_one_message_published_is_singular(guarded_nats, tmp_path):
    path = tmp_path / "one.parquet"
    make_recording(path, batches=1)
    result = run_main("replay", str(path), "--to", guarded_nats.url, "--topspeed", *CREDENTIALS)
    assert result.code == 0, result.err
    assert "Published: 1 message to nats://" in result.err, result.err


def test_simulate_recording_keeps_no_secret_from_its_command_line(tmp_path):
    import pyarrow.parquet as pq
    from conftest import run_kvctl

    out = tmp_path / "sim.parquet"
    result = run_kvctl(
        "simulate",
        "-o",
        str(out),
        "--workers",
        "1",
        "--requests",
        "2",
        "--nats-password",
        PASSWORD,
        "--nats-token=tok-secret",
    )
    assert result.returncode == 0, result.stderr
    footer = pq.ParquetFile(out).metadata.metadata[b"kvctl"].decode()
    assert PASSWORD not in footer and "tok-secret" not in footer
    assert "--nats-password" in footer and "***" in footer


@pytest.fixture(scope="module")
def tls_nats(tmp_path_factory: pytest.TempPathFactory):
    """A nats-server that requires TLS (certificate signed by a throwaway CA) and a login."""
    import shutil
    import subprocess

    if not shutil.which("openssl"):
        pytest.skip("openssl is needed to make the test certificates")
    folder = tmp_path_factory.mktemp("tls")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True, timeout=30)

    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "1",
        "-subj",
        "/CN=kvctl-test-ca",
    )
    openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=127.0.0.1",
    )
    (folder / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.pem",
        "-days",
        "1",
        "-extfile",
        "san.cnf",
    )
    server = NatsServer(
        folder / "store",
        "--tls",
        "--tlscert",
        str(folder / "server.pem"),
        "--tlskey",
        str(folder / "server.key"),
        "--user",
        USER,
        "--pass",
        PASSWORD,
    )
    yield server, str(folder / "ca.pem")
    server.stop()


def test_tls_options_reach_the_publisher(tls_nats):
    server, ca = tls_nats
    tap = start_kvctl(
        "tap", server.url, "--json", "--idle-timeout", "2", "--tls-ca", ca, *CREDENTIALS
    )
    wait_ready(tap)
    result = run_main(
        "simulate",
        "--to",
        server.url,
        "--workers",
        "1",
        "--requests",
        "3",
        "--topspeed",
        "--json",
        "--tls-ca",
        ca,
        *CREDENTIALS,
    )
    assert result.code == 0, result.err
    report = json.loads(result.out)
    rc, out, err = finish(tap)
    assert rc == 0, err
    assert report["events"] > 0 and len(rows_of(out)) == report["events"]
    untrusted = run_main(
        "simulate",
        "--to",
        server.url,
        "--workers",
        "1",
        "--requests",
        "1",
        "--topspeed",
        *CREDENTIALS,
    )
    assert untrusted.code == 1
    assert untrusted.err.count("\n") == 1 and "CERTIFICATE_VERIFY_FAILED" in untrusted.err


def test_simulate_interrupted_still_says_who_could_receive():
    """Ctrl-C: the report says what the sockets saw, here a worker nobody subscribed to."""
    from conftest import free_port_range, interrupt

    base = free_port_range(2)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{base}")  # worker 0 only
    simulate = start_kvctl(
        "simulate",
        "--workers",
        "2",
        "--base-port",
        str(base),
        "--speedup",
        "20",
        "--router",
        "round-robin",
    )
    try:
        for _ in range(5):  # by then worker 1 has published too (round-robin)
            assert sub.poll(15_000), "worker 0 published nothing"
            sub.recv_multipart()
    finally:
        sub.close(0)
    interrupt(simulate)
    rc, _, err = finish(simulate)
    assert rc == 130, err
    assert "1 of 2 sockets had no subscriber" in err
    assert ", 0 at end, 1 at most over 2 sockets" in err  # the subscriber left before the end
