"""A full-speed engine for overload tests, run as its own process (a publisher sharing the
test's interpreter would be slowed by it): ``python flood_publisher.py ENDPOINT SECONDS KB``.

Binds an XPUB like vLLM, waits for one subscriber, sends vLLM batches of about KB kilobytes
with consecutive seqs as fast as ZMQ takes them for SECONDS (the PUB drops what a slow
subscriber cannot take, as an engine does), then, once the subscriber has everything still
queued, one last batch, so that every earlier drop shows as a seq gap (Linux: it watches the
connection in /proc/net/tcp). Prints ``ready`` once bound
and ``sent N`` at the end, then delivers what is queued until its stdin closes."""

from __future__ import annotations

import sys
import time

import zmq

from kvctl.formats.engine_zmq import encode_frames, encode_payload


def events_of_about(kilobytes: int) -> list[dict]:
    event = {
        "type": "BlockStored",
        "block_hashes": list(range(2**40, 2**40 + 16)),
        "parent_block_hash": 2**41,
        "token_ids": list(range(30_000, 30_256)),
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    one = len(encode_payload([event], 1.0, 0, "vllm"))
    return [event] * max(1, kilobytes * 1024 // one)


def tcp_queued(port: int) -> int:
    """Bytes in the kernel's send and receive queues of the connections on ``port``."""
    total = 0
    with open("/proc/net/tcp") as table:
        for line in list(table)[1:]:
            fields = line.split()
            ports = {int(fields[1].rsplit(":", 1)[1], 16), int(fields[2].rsplit(":", 1)[1], 16)}
            if port in ports:
                tx, rx = fields[4].split(":")
                total += int(tx, 16) + int(rx, 16)
    return total


def wait_until_delivered(sock: zmq.Socket, port: int, timeout: float = 60) -> None:
    """Until the connection stays empty: then the PUB's queue is empty too (it would be
    writing) and the subscriber has everything. Reading the socket's events meanwhile
    lets the PUB see that its queue drained; a PUB that dropped for a full queue sends
    nothing more until it has seen that."""
    quiet = 0
    deadline = time.monotonic() + timeout
    while quiet < 5 and time.monotonic() < deadline:
        sock.getsockopt(zmq.EVENTS)
        quiet = quiet + 1 if tcp_queued(port) == 0 else 0
        time.sleep(0.05)
    sock.getsockopt(zmq.EVENTS)


def main(endpoint: str, seconds: float, kilobytes: int) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.XPUB)
    sock.bind(endpoint)
    print("ready", flush=True)
    if not sock.poll(30_000):
        sys.exit("no subscriber joined")
    sock.recv()
    payload = encode_payload(events_of_about(kilobytes), 1_700_000_000.0, 0, "vllm")
    seq = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for _ in range(100):
            sock.send_multipart(encode_frames(b"", seq, payload), copy=False)
            seq += 1
    wait_until_delivered(sock, int(endpoint.rsplit(":", 1)[1]))
    sock.send_multipart(encode_frames(b"", seq, payload))
    seq += 1
    print(f"sent {seq}", flush=True)
    sys.stdin.read()  # stay (and keep delivering what is queued) until the test is done
    sock.close(0)
    ctx.term()


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), int(sys.argv[3]))
