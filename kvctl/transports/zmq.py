"""ZeroMQ transport: bytes in and out. No decoding here.

- :class:`Subscriber` — a SUB socket that connects to an engine's PUB (engines bind).
- :func:`fetch_replay` — ask an engine's replay ROUTER for buffered batches (DEALER client).
- :class:`Publisher` — a PUB socket that binds as an engine does (replay, simulate, tests).
- :class:`ReplayServer` — a ROUTER serving buffered batches exactly as vLLM >= 0.26 does.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator

import zmq
import zmq.utils.monitor

from ..errors import TransportError, UsageError

END_SEQ = b"\xff" * 8
DEFAULT_QUEUE_BYTES = 64_000_000
"""What a receiving socket may hold in memory (``--max-queue``)."""


def context() -> zmq.Context:
    return zmq.Context.instance()


def check_endpoint(endpoint: str) -> None:
    if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise UsageError(f"{endpoint}: not a ZMQ endpoint (tcp://HOST:PORT or ipc://PATH)")


class Subscriber:
    """A SUB socket connected to one publisher. Until the first connection its state is
    watched on :attr:`monitor` (the caller polls it and calls :meth:`poll_connection`), so that
    a missing engine can be reported; then the monitor is stopped."""

    # ZMQ bounds a queue in messages, not bytes: the high-water mark is the byte budget over
    # a running estimate of the message size. When the queue is full libzmq stops reading
    # the connection, the engine's PUB queue fills and the PUB drops: a visible seq gap.
    #
    # The mark is only ever lowered. Raising the RCVHWM of a connected pipe that is full
    # stalls it for good: libzmq's reader wakes the stopped writer only each time it has read
    # a multiple of the new low-water mark, which the messages left in the full pipe never
    # reach (measured: a pipe full at 1,000 raised to 45,000 delivered those 1,000 and then
    # nothing while the publisher held 19,000 more; lowering is safe). So the mark starts
    # from a size above a typical KV-event batch (~1.2 KB) and comes down for larger ones.
    ASSUMED_MESSAGE_BYTES = 2 * 1024
    MIN_HWM, MAX_HWM = 4, 1_000_000
    ADAPT_EVERY = 1024  # messages between two estimates
    MESSAGE_OVERHEAD = 320  # bytes libzmq adds per queued message: 3 frames of 64 B, allocations

    def __init__(
        self, endpoint: str, topic: bytes = b"", queue_bytes: int = DEFAULT_QUEUE_BYTES
    ) -> None:
        check_endpoint(endpoint)
        self.endpoint = endpoint
        self.queue_bytes = queue_bytes
        self.socket = context().socket(zmq.SUB)
        self.hwm = self._hwm_for(self.ASSUMED_MESSAGE_BYTES)
        self.socket.setsockopt(zmq.RCVHWM, self.hwm)
        self._seen_messages = 0
        self._seen_bytes = 0
        self._adapt_at = 1  # the first message already tells its size
        self.socket.setsockopt(zmq.LINGER, 0)
        self.monitor = self.socket.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_DISCONNECTED
        )
        self.connected = False
        self.refused = False
        try:
            self.socket.connect(endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise UsageError(f"{endpoint}: {exc}") from None
        self.socket.setsockopt(zmq.SUBSCRIBE, topic)

    def _hwm_for(self, message_bytes: float) -> int:
        hwm = int(self.queue_bytes // (message_bytes + self.MESSAGE_OVERHEAD))
        return min(max(hwm, self.MIN_HWM), self.MAX_HWM)

    def received(self, messages: int, size: int) -> None:
        """Account ``messages`` of ``size`` bytes in all; now and then, lower the high-water
        mark to fit the average size (libzmq applies it to the connected pipe at once)."""
        self._seen_messages += messages
        self._seen_bytes += size
        if self._seen_messages < self._adapt_at:
            return
        hwm = self._hwm_for(self._seen_bytes / self._seen_messages)
        self._seen_messages = self._seen_bytes = 0
        self._adapt_at = self.ADAPT_EVERY
        if hwm < 0.8 * self.hwm:  # lower only (see above), and no churn on jitter
            self.hwm = hwm
            with contextlib.suppress(zmq.ZMQError):
                self.socket.setsockopt(zmq.RCVHWM, hwm)

    def sample_due(self) -> int:
        """Messages until the next estimate is due (:meth:`received` may wait until then)."""
        return max(self._adapt_at - self._seen_messages, 1)

    def drain(self) -> int:
        """Discard what is queued (at exit), bounded by the high-water mark; returns how many
        messages that was."""
        count = 0
        with contextlib.suppress(zmq.ZMQError):
            while count < 2 * self.hwm and self.socket.poll(0):
                self.socket.recv_multipart(zmq.NOBLOCK)
                count += 1
        return count

    def poll_connection(self) -> None:
        """Update ``connected``/``refused`` from the monitor socket (non-blocking)."""
        while self.monitor.poll(0):
            event = zmq.utils.monitor.recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_CONNECTED:
                self.connected, self.refused = True, False
            elif event == zmq.EVENT_CONNECT_RETRIED:
                self.refused = not self.connected
            elif event == zmq.EVENT_DISCONNECTED:
                self.connected = False

    def stop_monitor(self) -> None:
        """Stop watching once connected: an unread monitor (ten reconnect attempts a second
        while a publisher is gone) fills its queue and blocks libzmq's I/O thread, freezing
        the process."""
        if self.monitor.closed:
            return
        with contextlib.suppress(zmq.ZMQError):
            self.socket.disable_monitor()
        self.monitor.close(0)

    def close(self) -> None:
        self.stop_monitor()
        self.socket.close(0)


def fetch_replay(
    endpoint: str,
    start_seq: int,
    timeout: float = 2.0,
    max_batches: int = 1_000_000,
    first_reply_timeout: float | None = None,
    stop_seq: int | None = None,
) -> tuple[list[tuple[bytes, bytes, bytes]], bool]:
    """Ask a replay ROUTER for every buffered batch with seq >= ``start_seq``.

    Returns ``([(topic, seq_frame, payload), ...], complete)``; ``complete`` is False when the end
    marker did not arrive within ``timeout`` seconds of silence (``first_reply_timeout``, if
    given, for the first reply: ``([], False)`` then means "no answer"). With ``stop_seq`` it
    returns (complete) once a batch with seq >= ``stop_seq`` arrived, without reading the rest
    of the engine's buffer. Accepts both reply layouts: ``[b"", topic, seq, payload]``
    (vLLM >= 0.26) and ``[b"", seq, payload]`` (older).
    """
    sock = context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        out: list[tuple[bytes, bytes, bytes]] = []
        wait = timeout if first_reply_timeout is None else first_reply_timeout
        while len(out) < max_batches:
            if not sock.poll(int(wait * 1000)):
                return out, False
            wait = timeout
            frames = sock.recv_multipart()
            if frames and frames[0] == b"":
                frames = frames[1:]
            if len(frames) == 3:
                topic, seq, payload = frames
            elif len(frames) == 2:
                topic, (seq, payload) = b"", frames
            else:
                continue  # not a replay reply; ignore rather than misread it
            if seq == END_SEQ:
                return out, True
            out.append((topic, seq, payload))
            if stop_seq is not None and int.from_bytes(seq, "big") >= stop_seq:
                return out, True
        return out, False
    except zmq.ZMQError as exc:
        raise TransportError(f"{endpoint}: replay request failed: {exc}") from None
    finally:
        sock.close(0)


def bind(sock: zmq.Socket, endpoint: str) -> str:
    """Bind and return the resolved endpoint (port 0 / `*` resolved), with a clear error."""
    check_endpoint(endpoint)
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise TransportError(f"{endpoint}: cannot bind: {exc}") from None
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


class Publisher:
    """A PUB socket that binds like an engine; ``wait_subscribers`` holds the first send until
    consumers have joined (ZMQ drops what a PUB sends before a subscriber is connected).

    It is an XPUB, so it sees every subscription and unsubscription (a subscriber's
    disconnect included): ``subscribers`` now, ``subscribers_at_start`` (at the first send),
    ``peak_subscribers``. With ``XPUB_NODROP`` a send to a subscriber whose queue is full (the
    high-water mark) does not drop the message for it, as a plain PUB silently would: the send
    waits until there is room (back-pressure), counted in ``stalls`` and ``stalled_s``.
    ``close`` waits up to ``flush_timeout`` seconds for subscribers to take what is still queued;
    ``flushed`` says whether they did."""

    DRAIN_INTERVAL_S = 0.1
    """How often sends look for (un)subscriptions: often enough for the report, rarely enough
    to cost nothing at top speed."""

    def __init__(self, endpoint: str, hwm: int = 100_000, flush_timeout: float = 1.0) -> None:
        # its own context: closing it waits for the queued messages (up to the flush timeout)
        # without waiting on any other socket of the process; inproc:// peers must share
        # the process's context, so there the flush is not awaited
        self._own_context = not endpoint.startswith("inproc://")
        self._context = zmq.Context(io_threads=1) if self._own_context else context()
        self.socket = self._context.socket(zmq.XPUB)
        # report every subscription, not only the first per topic: several taps all
        # subscribe to "" and each must count
        self.socket.setsockopt(zmq.XPUB_VERBOSER, 1)
        self.socket.setsockopt(zmq.XPUB_NODROP, 1)
        self.socket.setsockopt(zmq.SNDHWM, hwm)
        self.flush_timeout = flush_timeout
        try:
            self.endpoint = bind(self.socket, endpoint)
        except TransportError:
            self.socket.close(0)
            if self._own_context:
                self._context.term()
            raise
        self.subscribers = 0
        self.peak_subscribers = 0
        self.subscribers_at_start: int | None = None
        self.stalls = 0
        self.stalled_s = 0.0
        self.flushed: bool | None = None
        self.on_long_stall: Callable[[float], None] | None = None
        """Called once when one send has waited over ``LONG_STALL_S`` (a stopped subscriber
        holds the sender until it reads or disconnects)."""
        self._warned_stall = False
        self._next_drain = 0.0

    LONG_STALL_S = 2.0

    def _drain_subscriptions(self, timeout_ms: int) -> int:
        """Count the (un)subscriptions that arrived; returns how many."""
        seen = 0
        while self.socket.poll(timeout_ms, zmq.POLLIN):
            seen += 1
            msg = self.socket.recv()
            if msg[:1] == b"\x01":
                self.subscribers += 1
                self.peak_subscribers = max(self.peak_subscribers, self.subscribers)
            elif msg[:1] == b"\x00":
                self.subscribers = max(0, self.subscribers - 1)
            timeout_ms = 0
        return seen

    def wait_subscribers(self, count: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.subscribers < count:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._drain_subscriptions(int(min(remaining, 0.1) * 1000) + 1)
        return True

    def send(self, frames: list[bytes]) -> None:
        now = time.monotonic()
        if now >= self._next_drain:
            self._next_drain = now + self.DRAIN_INTERVAL_S
            self._drain_subscriptions(0)
        if self.subscribers_at_start is None:
            # a zero-timeout poll may leave the latest subscriptions unprocessed: wait 1 ms
            while self._drain_subscriptions(1):
                pass
            self.subscribers_at_start = self.subscribers
        try:
            self._send(frames)
        except zmq.Again:  # a subscriber's queue is full: wait for room, drop nothing
            self._wait_and_send(frames, now)

    _MORE = int(zmq.NOBLOCK | zmq.SNDMORE)
    _LAST = int(zmq.NOBLOCK)

    def _send(self, frames: list[bytes]) -> None:
        """``send_multipart`` without its per-frame checks and flag enums (a third of the
        cost of a small message): the frames are bytes or buffers. Only the first frame can
        meet a full queue; the rest of a message is always taken."""
        send, more = self.socket.send, self._MORE
        for frame in frames[:-1]:
            send(frame, more, copy=False)
        send(frames[-1], self._LAST, copy=False)

    def _wait_and_send(self, frames: list[bytes], started: float) -> None:
        self.stalls += 1
        pause = 0.0001
        try:
            while True:
                time.sleep(pause)
                pause = min(pause * 2, 0.01)
                self._drain_subscriptions(0)  # a subscriber that leaves frees the send
                try:
                    self._send(frames)
                    return
                except zmq.Again:
                    waited = time.monotonic() - started
                    if (
                        waited > self.LONG_STALL_S
                        and not self._warned_stall
                        and self.on_long_stall is not None
                    ):
                        self._warned_stall = True
                        self.on_long_stall(waited)
        finally:
            self.stalled_s += time.monotonic() - started

    def close(self) -> None:
        """Count the subscribers still there, then close, waiting up to ``flush_timeout`` for
        them to take what is queued (``flushed`` is False when that time ran out)."""
        if self.socket.closed:
            return
        # a departed subscriber's unsubscription is processed only while the socket waits
        # (a zero-timeout poll may not see it): short waits until nothing more comes
        for _ in range(1000):
            if not self._drain_subscriptions(10):
                break
        self.socket.close(linger=int(self.flush_timeout * 1000))
        if not self._own_context:
            return
        started = time.monotonic()
        self._context.term()
        self.flushed = time.monotonic() - started < self.flush_timeout * 0.95


class ReplayServer:
    """A ROUTER that answers replay requests from a ring of the last ``buffer_steps`` batches."""

    def __init__(self, endpoint: str, buffer_steps: int = 10_000, with_topic: bool = True) -> None:
        self.socket = context().socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.endpoint = bind(self.socket, endpoint)
        self.ring: deque[tuple[int, bytes, bytes]] = deque(maxlen=buffer_steps)
        self.with_topic = with_topic

    def remember(self, seq: int, topic: bytes, payload: bytes) -> None:
        self.ring.append((seq, topic, payload))

    def serve_pending(self) -> int:
        """Answer the requests already queued; returns how many were served."""
        served = 0
        while self.socket.poll(0):
            frames = self.socket.recv_multipart()
            if len(frames) < 3 or len(frames[-1]) != 8:
                continue
            identity, start = frames[0], int.from_bytes(frames[-1], "big")
            for seq, topic, payload in list(self.ring):
                if seq >= start:
                    self.socket.send_multipart(self._reply(identity, topic, seq, payload))
            self.socket.send_multipart(self._reply(identity, b"", None, b""))
            served += 1
        return served

    def _reply(self, identity: bytes, topic: bytes, seq: int | None, payload: bytes) -> list:
        seq_frame = END_SEQ if seq is None else seq.to_bytes(8, "big")
        if self.with_topic:
            return [identity, b"", topic, seq_frame, payload]
        return [identity, b"", seq_frame, payload]

    def close(self) -> None:
        self.socket.close(0)


def receive_all(sock: zmq.Socket, limit: int) -> Iterator[list[bytes]]:
    """Drain up to ``limit`` messages already queued on ``sock`` without blocking."""
    recv = sock.recv_multipart
    for _ in range(limit):
        try:
            yield recv(zmq.NOBLOCK)
        except zmq.Again:
            return
