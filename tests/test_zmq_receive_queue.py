"""The receive queue of a ZMQ source (``--max-queue``): sized from the messages seen, and never
stalled by its own resizing."""

from __future__ import annotations

import zmq
from conftest import free_port

from kvctl.transports.zmq import Subscriber

MESSAGE = [b"kv@0@model", (0).to_bytes(8, "big"), b"\x93" + b"x" * 300]


def test_a_queue_full_before_its_first_read_delivers_every_message():
    """A publisher floods before the subscriber reads anything, so the pipe is full when the
    first message's size is seen (smaller than assumed: a larger queue would fit). Raising
    libzmq's high-water mark on that full pipe stalled it after the first queue-full of
    messages, with no gap to show for it; every message must arrive."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.SNDHWM, 0)  # the publisher keeps what the subscriber cannot take yet
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(endpoint)
    # a budget of 50 messages at the assumed size: the flood below fills it many times over
    queue_bytes = 50 * (Subscriber.ASSUMED_MESSAGE_BYTES + Subscriber.MESSAGE_OVERHEAD)
    sub = Subscriber(endpoint, queue_bytes=queue_bytes)
    try:
        assert sub.hwm == 50
        assert pub.poll(10_000), "no subscription"
        pub.recv()  # the subscription: messages sent from now on are delivered
        sent = 5_000
        for seq in range(sent):
            pub.send_multipart([MESSAGE[0], seq.to_bytes(8, "big"), MESSAGE[2]])
        received = []
        while len(received) < sent and sub.socket.poll(5_000):
            frames = sub.socket.recv_multipart(zmq.NOBLOCK)
            sub.received(1, sum(map(len, frames)))
            received.append(int.from_bytes(frames[1], "big"))
        assert received == list(range(sent))
        assert sub.hwm == 50  # small messages never raise the mark
    finally:
        sub.close()
        pub.close(0)


def test_large_messages_lower_the_queue_to_the_budget():
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(endpoint)
    sub = Subscriber(endpoint, queue_bytes=64_000_000)
    try:
        before = sub.hwm
        assert pub.poll(10_000) and pub.recv()
        pub.send_multipart([b"t", (0).to_bytes(8, "big"), b"x" * 64_000])
        assert sub.socket.poll(5_000)
        frames = sub.socket.recv_multipart()
        sub.received(1, sum(map(len, frames)))
        assert sub.hwm == 64_000_000 // (64_013 + Subscriber.MESSAGE_OVERHEAD) < before
    finally:
        sub.close()
        pub.close(0)
