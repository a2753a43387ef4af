"""NATS transport: bytes in and out. No decoding here.

nats-py is asyncio-only while kvctl's hot loop is a synchronous ZMQ poller, so the NATS client
runs its own event loop in a thread and forwards every message as ``[subject, data]`` over an
inproc ZMQ PUSH socket; the pipeline polls the matching PULL socket next to its ZMQ sources.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq

from ..errors import TransportError, UsageError
from ..redact import redact_url
from .zmq import DEFAULT_QUEUE_BYTES, context

if TYPE_CHECKING:
    from ..partitions import StreamLayout

# Subjects of every Dynamo era (see the wire-format reference, section 2).
DEFAULT_SUBJECTS = (
    "namespace.*.component.*.kv_events",  # <= 0.5, NATS core, JSON
    "namespace.*.component.*.kv-events",  # 0.7-0.9 local indexer (JSON), 1.0-1.1 (msgpack)
    "namespace.*.component.*.endpoint.*.kv-events",  # 1.2-1.6, msgpack envelope
    "*.kv-events",  # 0.7-0.9 JetStream stream subject, JSON
    "*.queue",  # 0.6 JetStream stream subject, JSON (filtered to *-kv-events streams)
)
KV_STREAM_SUFFIX = "-kv-events"
CONTROL = b"\x00kvctl-control"


@dataclass
class NatsOptions:
    user: str | None = None
    password: str | None = None
    token: str | None = None
    creds: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    connect_timeout: float = 5.0
    """Seconds one connection attempt may take (a publisher gives up after it)."""

    def connect_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "connect_timeout": self.connect_timeout,
            "allow_reconnect": True,
            "max_reconnect_attempts": 5,
            "reconnect_time_wait": 0.5,
        }
        if self.user is not None:
            kwargs["user"] = self.user
        if self.password is not None:
            kwargs["password"] = self.password
        if self.token is not None:
            kwargs["token"] = self.token
        if self.creds is not None:
            kwargs["user_credentials"] = self.creds
        if self.tls_ca or self.tls_cert:
            import ssl

            ctx = ssl.create_default_context(cafile=self.tls_ca)
            if self.tls_cert:
                ctx.load_cert_chain(self.tls_cert, self.tls_key)
            kwargs["tls"] = ctx
        return kwargs


def is_kv_subject(subject: str) -> bool:
    """`*.queue` also matches unrelated streams: keep only Dynamo's `...-kv-events.queue`."""
    if subject.endswith(".queue"):
        return subject.split(".", 1)[0].endswith(KV_STREAM_SUFFIX)
    return True


def describe(exc: BaseException) -> str:
    """One line for a connection error (nats-py's messages carry a "nats: " prefix)."""
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, asyncio.TimeoutError):
        return "no answer"
    text = str(exc).removeprefix("nats: ").strip().strip("'") or type(exc).__name__
    if "authorization violation" in text.lower():
        return (
            "authorization violation (see --nats-user/--nats-password, --nats-token, --nats-creds)"
        )
    return text[:1].lower() + text[1:]


def is_fatal(exc: BaseException) -> bool:
    """Errors that waiting will not cure: wrong credentials or TLS setup."""
    import ssl

    from nats import errors

    names = (
        "AuthorizationError",
        "InvalidUserCredentialsError",
        "SecureConnRequiredError",
        "SecureConnWantedError",
        "SecureConnFailedError",
    )  # not all in every nats-py 2.x
    fatal = tuple(getattr(errors, n) for n in names if hasattr(errors, n))
    if isinstance(exc, (*fatal, ssl.SSLError, FileNotFoundError)):
        return True
    text = str(exc).lower()
    return "authorization violation" in text or "authentication" in text


def is_connection_loss(exc: BaseException) -> bool:
    from nats import errors

    return isinstance(
        exc,
        (
            OSError,
            asyncio.TimeoutError,
            errors.StaleConnectionError,
            errors.ConnectionClosedError,
            errors.NoServersError,
        ),
    )


class History:
    """--from-start: an ordered JetStream consumer from the first message of every Dynamo
    KV-event stream. After a reconnect each consumer is created again from the stream
    sequence after the last message delivered: a restarted server has forgotten the
    ephemeral consumers, and nats-py would notice only after missing heartbeats for 10 s."""

    RETRY_S = 0.5  # JetStream needs a moment after a server restart
    RETRIES = 40

    def __init__(self, nc: Any, push: zmq.Socket, control: Any, hand_off: Any) -> None:
        self.js = nc.jetstream()
        self.push = push
        self.control = control
        self.hand_off = hand_off
        """``await hand_off(subject, data)``: queue a message for the main loop, waiting for
        room (history is never dropped: the ordered consumer's flow control holds the
        server back meanwhile)."""
        self.subjects: set[str] = set()
        self.next_seq: dict[str, int] = {}
        self.subscriptions: dict[str, Any] = {}

    async def start(self) -> None:
        for info in await self.js.streams_info():
            config = info.config
            if not (config.name or "").endswith(KV_STREAM_SUFFIX):
                continue
            for subject in config.subjects or ():
                self.subjects.add(subject)
                await self._subscribe(subject)

    async def _subscribe(self, subject: str) -> None:
        from nats.js.api import ConsumerConfig, DeliverPolicy

        hand_off, next_seq = self.hand_off, self.next_seq

        async def forward(msg: Any) -> None:
            await hand_off(msg.subject.encode(), msg.data)
            next_seq[subject] = msg.metadata.sequence.stream + 1

        start = next_seq.get(subject)
        config = (
            ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
            if start is None
            else ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start)
        )
        self.subscriptions[subject] = await self.js.subscribe(
            subject, cb=forward, ordered_consumer=True, config=config
        )

    async def resume(self, stop: asyncio.Event) -> None:
        for subject, old in list(self.subscriptions.items()):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(old.unsubscribe(), 2)
            for attempt in range(self.RETRIES):
                try:
                    await self._subscribe(subject)
                    break
                except Exception as exc:
                    if stop.is_set():
                        return
                    if attempt == self.RETRIES - 1:
                        self.control(
                            self.push,
                            "error",
                            f"JetStream history of {subject} not resumed: {describe(exc)}",
                        )
                    await asyncio.sleep(self.RETRY_S)

    async def close(self) -> None:
        for sub in self.subscriptions.values():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(sub.unsubscribe(), 2)


class Subscriber:
    """Subscribe to NATS subjects (and optionally JetStream history) in a background thread.

    The client waits for the server without limit and reconnects without limit, keeping its
    subscriptions; the caller decides when to give up. Messages arrive on :attr:`socket` as
    ``[subject, data]``; state changes as ``[CONTROL, kind, text]`` with ``kind`` one of
    ``up`` (subscribed), ``down`` (connection lost, reconnecting), ``error`` (a problem worth
    one line while connected) and ``fatal`` (waiting will not help: bad credentials, TLS, or
    a failed subscription). The thread never writes to stderr itself.
    """

    RECONNECT_WAIT_S = 0.5  # between attempts: a restarted server is found within ~0.5 s
    ROOM_WAIT_S = 0.005  # JetStream history waiting for the main loop to make room

    def __init__(
        self,
        server: str,
        subjects: list[str],
        options: NatsOptions | None = None,
        from_start: bool = False,
        queue_bytes: int = DEFAULT_QUEUE_BYTES,
    ) -> None:
        self.servers = servers_of(server)
        self.server = redact_url(server)
        """The URL as shown (every password replaced by ``***``)."""
        self.subjects = subjects or list(DEFAULT_SUBJECTS)
        self.options = options or NatsOptions()
        self.from_start = from_start
        self.queue_bytes = queue_bytes
        # The hand-off queue (the inproc socket) is bounded by bytes with two counter pairs,
        # each written by one thread only: pushed by the NATS thread, taken by the main loop.
        self.pushed = self.pushed_bytes = 0
        self.taken_messages = self.taken_bytes = 0
        self.dropped = 0
        """Messages dropped here (queue full, or nats-py's slow-consumer limit); NATS thread."""
        self._address = f"inproc://kvctl-nats-{id(self)}"
        self.socket = context().socket(zmq.PULL)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.bind(self._address)
        self.first_attempt_done = threading.Event()
        """Set once the first connection attempt succeeded (and subscribed) or failed."""
        self.last_error = ""
        """Why the latest connection attempt failed (read by the main thread)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvctl-nats", daemon=True)

    def start(self, first_attempt_s: float = 1.0) -> None:
        """Start the client; wait at most ``first_attempt_s`` for its first attempt, so that
        a reachable server is subscribed to before the caller says it is reading (nothing
        published after that line is missed), while a missing one does not block."""
        self._thread.start()
        self.first_attempt_done.wait(first_attempt_s)

    def _run(self) -> None:
        push = context().socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, 0)
        push.connect(self._address)
        try:
            # asyncio.run cancels and awaits every task left (nats-py's and JetStream's)
            # before closing the loop: no "Task was destroyed but it is pending" at exit
            asyncio.run(self._main(push))
        except Exception as exc:  # reported to the main thread, never a traceback
            self._control(push, "fatal", f"{type(exc).__name__}: {exc}")
        finally:
            self.first_attempt_done.set()
            push.close(0)

    def _control(self, push: zmq.Socket, kind: str, text: str) -> None:
        push.send_multipart([CONTROL, kind.encode(), text.encode()])

    async def _main(self, push: zmq.Socket) -> None:
        from nats.aio.client import Client

        self._loop = asyncio.get_running_loop()
        stop = self._stop = asyncio.Event()
        if self._stopping.is_set():  # closed before the loop existed
            return
        nc = Client()
        connected = False
        last_said = ""

        from nats.errors import SlowConsumerError

        async def on_error(exc: Exception) -> None:
            nonlocal last_said
            if isinstance(exc, SlowConsumerError):  # one per message nats-py dropped
                self.dropped += 1
                return
            reason = describe(exc)
            self.last_error = reason
            if is_fatal(exc):
                self._control(push, "fatal", f"cannot connect to NATS: {reason}")
                stop.set()
            elif not connected:
                self.first_attempt_done.set()  # not there (yet): the caller goes on waiting
            elif is_connection_loss(exc):
                pass  # the disconnected callback says it, with this reason
            elif reason != last_said:
                last_said = reason  # e.g. a slow consumer: said once, not per message
                self._control(push, "error", reason)

        async def on_disconnected() -> None:
            if connected and not self._stopping.is_set():
                self._control(push, "down", self.last_error or "connection lost")

        history: History | None = None
        resuming: list[asyncio.Future] = []

        async def on_reconnected() -> None:
            nonlocal last_said
            last_said = ""
            self._control(push, "up", "reconnected")
            if history is not None:  # in a task: this callback runs inside nats-py's reconnect
                resuming[:] = [asyncio.ensure_future(history.resume(stop))]

        connect = asyncio.ensure_future(
            nc.connect(
                servers=self.servers,
                error_cb=on_error,
                disconnected_cb=on_disconnected,
                reconnected_cb=on_reconnected,
                **self._connect_kwargs(),
            )
        )
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({connect, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not connect.done():
            await self._cancel(connect)
            await self._close(nc)
            return
        stopped.cancel()
        refused = connect.exception()
        if refused is not None:
            self._control(push, "fatal", f"cannot connect to NATS: {describe(refused)}")
            return
        connected = True
        self._control(push, "up", "connected")  # before the first message, never after it
        try:
            if self.from_start:
                history = History(nc, push, self._control, self._hand_off_waiting(push, stop))
                await history.start()
            await self._subscribe(nc, push, history.subjects if history else set())
        except Exception as exc:
            self._control(push, "fatal", f"subscribe failed: {describe(exc)}")
            await self._close(nc)
            return
        self.first_attempt_done.set()
        await stop.wait()
        for task in resuming:
            task.cancel()
        if history is not None:  # JetStream consumers first, while the connection is up
            await history.close()
        await self._close(nc)

    @staticmethod
    async def _cancel(task: asyncio.Future, tries: int = 50) -> None:
        """Cancel ``task`` until it ends: a cancellation that lands as an inner wait_for
        completes is swallowed (Python < 3.12), and nats-py's connect loop would go on."""
        for _ in range(tries):
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=0.1)
            if done:
                with contextlib.suppress(BaseException):
                    task.result()
                return

    def _connect_kwargs(self) -> dict[str, Any]:
        kwargs = self.options.connect_kwargs()
        kwargs.update(
            # the caller gives up (--connect-timeout) or not; the client never does
            max_reconnect_attempts=-1,
            reconnect_time_wait=self.RECONNECT_WAIT_S,
            connect_timeout=min(self.options.connect_timeout, 2.0),
        )
        return kwargs

    async def _subscribe(self, nc: Any, push: zmq.Socket, jetstream_subjects: set[str]) -> None:
        """Core subscriptions (nats-py renews them after a reconnect); what the JetStream
        consumers deliver is skipped here, or it would arrive twice."""

        async def forward(msg: Any) -> None:
            if msg.subject in jetstream_subjects or not is_kv_subject(msg.subject):
                return
            self._hand_off(push, msg.subject.encode(), msg.data)

        for subject in self.subjects:
            await nc.subscribe(subject, cb=forward, pending_bytes_limit=self.queue_bytes)
        await nc.flush(timeout=self.options.connect_timeout)

    def _hand_off(self, push: zmq.Socket, subject: bytes, data: bytes) -> bool:
        """Queue a message for the main loop, or drop and count it when the queue is full."""
        size = len(subject) + len(data)
        if (
            self.pushed_bytes - self.taken_bytes + size > self.queue_bytes
            and self.pushed != self.taken_messages
        ):  # one message always fits
            self.dropped += 1
            return False
        push.send_multipart([subject, data], copy=False)
        self.pushed_bytes += size
        self.pushed += 1
        return True

    def _hand_off_waiting(self, push: zmq.Socket, stop: asyncio.Event) -> Any:
        async def hand_off(subject: bytes, data: bytes) -> None:
            size = len(subject) + len(data)
            while (
                self.pushed_bytes - self.taken_bytes + size > self.queue_bytes
                and self.pushed != self.taken_messages
                and not stop.is_set()
            ):
                await asyncio.sleep(self.ROOM_WAIT_S)
            push.send_multipart([subject, data], copy=False)
            self.pushed_bytes += size
            self.pushed += 1

        return hand_off

    def taken(self, frames: list[bytes]) -> None:
        """The main loop took ``[subject, data]`` off :attr:`socket`."""
        self.taken_bytes += len(frames[0]) + len(frames[1])
        self.taken_messages += 1

    def queued_messages(self) -> int:
        """Messages handed off and not taken yet."""
        return max(self.pushed - self.taken_messages, 0)

    async def _close(self, nc: Any) -> None:
        if nc.is_closed:
            return
        with contextlib.suppress(Exception):
            await asyncio.wait_for(nc.close(), 5)

    def close(self) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            loop, stop = self._loop, self._stop
            if loop is not None and stop is not None:
                with contextlib.suppress(RuntimeError):  # the loop just ended
                    loop.call_soon_threadsafe(stop.set)
            self._thread.join(timeout=5)
        self.socket.close(0)


class Publisher:
    """A NATS publisher usable from synchronous code: messages are queued from the caller's
    thread and published, in order, by a client running in a background event loop.

    It survives server outages: the client reconnects without limit, and while it is away the
    messages wait in kvctl's queue, bounded by ``buffer_bytes``; when that is full, ``publish``
    waits (back-pressure: nothing is dropped for lack of room). JetStream publishes carry a
    ``Nats-Msg-Id``, so one retried after a lost ack is stored once.

    It counts what happened: ``published`` (handed to a live connection; with JetStream: acked
    by the stream, ``acked``), ``failed`` with the last ``failure`` (refused, or unanswered
    after retries), ``dropped`` with ``drop_reason`` (still queued when the server stayed away
    at the end), ``outages`` and ``outage_s``. Error messages never show a password from the
    URL; ``notify`` (if given) hears of each outage and reconnection, as one line."""

    BUFFER_BYTES = 64 * 1024 * 1024
    END_WAIT_S = 10.0
    """How long ``close`` waits for an absent server before counting the rest as dropped."""
    RETRIES = 10
    """Attempts of one JetStream publish on a live connection (no ack, no responder yet)."""

    def __init__(
        self,
        server: str,
        options: NatsOptions | None = None,
        buffer_bytes: int = BUFFER_BYTES,
        notify: Callable[[str], None] | None = None,
    ) -> None:
        self.servers = servers_of(server)
        self.server = server
        self.shown = redact_url(server)
        self.options = options or NatsOptions()
        self.buffer_bytes = buffer_bytes
        self.notify = notify
        self._queue: deque[tuple[str, bytes, bool]] = deque()
        self._queued_bytes = 0
        self._room = threading.Condition()
        self._ready = threading.Event()
        self._done = threading.Event()
        self._error: str | None = None
        # asyncio events bind to the loop that first waits on them (Python >= 3.10): the
        # publisher thread's, created later
        self._wake = asyncio.Event()
        self._connected = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        self._disconnecting = False
        self._end_deadline: float | None = None
        self._streams: set[str] = set()
        self._msg_prefix = f"kvctl-{os.getpid()}-{time.time_ns()}-"
        self._msg_number = 0
        self._lost_at: float | None = None
        self._connect_errors: list[str] = []
        self.published = 0
        self.acked = 0
        self.failed = 0
        self.failure: str | None = None
        self.dropped = 0
        self.drop_reason: str | None = None
        self.outages = 0
        self.outage_s = 0.0
        self._thread = threading.Thread(target=self._run, name="kvctl-nats-pub", daemon=True)
        self._thread.start()
        if not self._ready.wait(self.options.connect_timeout + 5) or self._error:
            heard = f": {self._connect_errors[0]}" if self._connect_errors else ""
            raise TransportError(
                self._error or self._fail(f"no answer from the NATS server{heard}")
            )

    def counts(self) -> dict[str, Any]:
        return {
            "published": self.published,
            "acked": self.acked,
            "failed": self.failed,
            "failure": self.failure,
            "dropped": self.dropped,
            "drop_reason": self.drop_reason,
            "outages": self.outages,
            "outage_s": round(self.outage_s, 3),
        }

    def ensure_stream(self, name: str, subjects: list[str]) -> None:
        """Create (or extend) a JetStream stream, as Dynamo 0.6-0.9 did for its KV events."""
        if self._loop is None:
            raise TransportError(f"{self.shown}: the publisher is not started")
        future = asyncio.run_coroutine_threadsafe(self._ensure_stream(name, subjects), self._loop)
        future.result(timeout=self.options.connect_timeout + 5)
        self._raise_if_failed()

    async def _ensure_stream(self, name: str, subjects: list[str]) -> None:
        js = self._nc.jetstream()
        try:
            await js.add_stream(name=name, subjects=subjects)
        except Exception:
            info = await js.stream_info(name)
            merged = sorted(set(info.config.subjects or ()) | set(subjects))
            await js.update_stream(name=name, subjects=merged)
        self._streams.add(name)

    def publish(self, subject: str, data: bytes, jetstream: bool = False) -> None:
        self._raise_if_failed()
        with self._room:
            # back-pressure: wait for room (short waits keep Ctrl-C responsive)
            while self._queued_bytes and self._queued_bytes + len(data) > self.buffer_bytes:
                self._room.wait(0.2)
                self._raise_if_failed()
            self._queue.append((subject, data, jetstream))
            self._queued_bytes += len(data)
            wake = len(self._queue) == 1
        if wake and self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    def _take(self) -> tuple[str, bytes, bool] | None:
        with self._room:
            if not self._queue:
                return None
            item = self._queue.popleft()
            self._queued_bytes -= len(item[1])
            self._room.notify()
            return item

    def _raise_if_failed(self) -> None:
        if self._error:
            raise TransportError(self._error)

    def _fail(self, reason: str) -> str:
        return f"{self.shown}: {redact_url(reason)}"

    def _say(self, line: str) -> None:
        if self.notify is not None:
            self.notify(line)

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._main())
        except Exception as exc:
            self._error = self._error or self._fail(f"{type(exc).__name__}: {exc}")
        finally:
            self._ready.set()
            self._done.set()
            with self._room:
                self._room.notify_all()
            loop.close()

    async def _main(self) -> None:
        import nats

        errors = self._connect_errors
        # asyncio logs "returning true from eof_received() has no effect when using ssl" when a
        # TLS server is reached without TLS: the error line says it better, once
        logging.getLogger("asyncio").setLevel(logging.ERROR)

        async def on_error(exc: Exception) -> None:
            errors.append(describe(exc))

        async def on_disconnected() -> None:
            if self._disconnecting:
                return  # our own close
            self._connected.clear()
            if self._lost_at is None:
                self._lost_at = time.monotonic()
                self._say(
                    f"kvctl: {self.shown}: NATS connection lost; reconnecting, sends wait "
                    f"(up to {self.buffer_bytes // 2**20} MB queued)"
                )

        async def on_reconnected() -> None:
            if self._lost_at is not None:
                away = time.monotonic() - self._lost_at
                self.outages += 1
                self.outage_s += away
                self._lost_at = None
                self._say(f"kvctl: {self.shown}: reconnected to NATS after {away:.1f} s")
            self._connected.set()

        try:
            self._nc = await nats.connect(
                servers=self.servers,
                error_cb=on_error,
                disconnected_cb=on_disconnected,
                reconnected_cb=on_reconnected,
                **self.options.connect_kwargs(),
            )
            # the first connection tries as --connect-timeout says (a refused login is an
            # error); once connected, an outage is waited out without limit
            self._nc.options["max_reconnect_attempts"] = -1
        except Exception as exc:
            # nats-py's own exception after a refused login is a bare "no servers available":
            # the error callback heard the reason (authorization violation, TLS, ...)
            reason = errors[0] if errors else describe(exc)
            self._error = self._fail(f"cannot connect to NATS: {reason}")
            return
        self._connected.set()
        js = self._nc.jetstream()
        self._ready.set()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while (item := self._take()) is not None:
                await self._send(js, *item)
            if self._closing and not self._queue:
                break
        if self._connected.is_set():
            try:
                await self._nc.flush(timeout=10)
            except Exception as exc:
                self.failure = f"final flush: {str(exc) or type(exc).__name__}"
        self._disconnecting = True
        await self._nc.close()

    async def _send(self, js: Any, subject: str, data: bytes, jetstream: bool) -> None:
        """Publish one message, waiting through outages; count how it ended."""
        from nats.errors import MaxPayloadError

        msg_id = f"{self._msg_prefix}{self._msg_number}"
        self._msg_number += 1
        attempts = 0
        while True:
            if not self._connected.is_set() and not await self._wait_connected():
                self.dropped += 1
                self.drop_reason = (
                    f"the NATS server was unreachable when the run ended "
                    f"(waited {self.END_WAIT_S:g} s)"
                )
                return
            try:
                if jetstream:
                    await js.publish(subject, data, headers={"Nats-Msg-Id": msg_id})
                    self.acked += 1
                else:
                    await self._nc.publish(subject, data)
                self.published += 1
                return
            except MaxPayloadError as exc:
                self.failed += 1
                self.failure = f"{str(exc) or type(exc).__name__} ({len(data):,} bytes)"
                return
            except Exception as exc:  # no ack, no responder yet, connection lost: retry
                if self._connected.is_set():
                    attempts += 1
                    if attempts >= self.RETRIES:
                        self.failed += 1
                        kind = "JetStream publish" if jetstream else "publish"
                        self.failure = (
                            f"{kind}: {str(exc) or type(exc).__name__} ({attempts} attempts)"
                        )
                        return
                    await asyncio.sleep(min(0.05 * 2**attempts, 1.0))

    async def _wait_connected(self) -> bool:
        """Wait for the connection to come back: without limit while running, up to
        ``END_WAIT_S`` once closing. False when that time ran out."""
        while not self._connected.is_set():
            if self._closing:
                if self._end_deadline is None:
                    self._end_deadline = time.monotonic() + self.END_WAIT_S
                remaining = self._end_deadline - time.monotonic()
                if remaining <= 0:
                    return False
            else:
                remaining = 0.5  # look again: close may begin meanwhile
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._connected.wait(), min(remaining, 0.5))
        return True

    def close(self) -> None:
        """Publish everything queued (waiting up to ``END_WAIT_S`` for an absent server),
        flush, disconnect."""
        if self._loop is not None and not self._done.is_set():
            self._closing = True
            self._loop.call_soon_threadsafe(self._wake.set)
            self._done.wait(self.END_WAIT_S + 60)
        self._raise_if_failed()


# --- JetStream stream management (kvctl stream) ---


def servers_of(url: str) -> list[str]:
    """``nats://a:4222,nats://b:4222`` as the list of servers nats-py connects to (it picks
    one and fails over to the others)."""
    servers = [part.strip() for part in url.split(",") if part.strip()]
    if not servers:
        raise UsageError(
            f"{redact_url(url)!r}: no NATS server (nats://HOST:PORT[,nats://HOST:PORT...])"
        )
    for server in servers:
        if not server.startswith(("nats://", "tls://")):
            raise UsageError(f"{redact_url(server)}: not a NATS URL (nats://HOST:PORT)")
    return servers


def split_nats_url(text: str) -> tuple[str, str]:
    """``nats://a:4222,nats://b:4222/SUBJECT`` -> (the servers, ``SUBJECT`` or ""): the subject
    follows the first ``/`` after the last server's host (a subject has no ``/``, a host
    neither)."""
    last = text.rfind("://")
    slash = text.find("/", last + 3) if last >= 0 else -1
    if slash < 0:
        return text, ""
    return text[:slash], text[slash + 1 :]


def run_jetstream(url: str, options: NatsOptions, work: Callable[[Any], Any]) -> Any:
    """Connect to ``url`` (one server or a comma list), run ``await work(js)`` with its
    JetStream context, disconnect; the result of ``work``. Every failure becomes one line
    (:class:`TransportError`, or ``work``'s own :class:`KvctlError`), never a traceback."""
    servers = servers_of(url)
    shown = redact_url(url)

    async def main() -> Any:
        import nats
        from nats.js import errors as js_errors

        heard: list[str] = []

        async def on_error(exc: Exception) -> None:  # nats-py would log a traceback
            heard.append(describe(exc))

        logging.getLogger("asyncio").setLevel(logging.ERROR)  # see Publisher._main
        kwargs = options.connect_kwargs()
        kwargs["allow_reconnect"] = False  # a short conversation: fail, do not wait
        try:
            nc = await nats.connect(servers=servers, error_cb=on_error, **kwargs)
        except Exception as exc:
            reason = heard[0] if heard else describe(exc)
            raise TransportError(f"{shown}: cannot connect to NATS: {reason}") from None
        try:
            return await work(nc.jetstream(timeout=options.connect_timeout))
        except js_errors.ServiceUnavailableError:
            raise TransportError(
                f"{shown}: JetStream is not enabled on this server or account "
                "(nats-server -js, or the account's jetstream setting)"
            ) from None
        except js_errors.APIError as exc:
            raise TransportError(f"{shown}: JetStream: {exc.description or exc}") from None
        except asyncio.TimeoutError:
            raise TransportError(
                f"{shown}: JetStream did not answer within {options.connect_timeout:g} s"
            ) from None
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), 5)

    return asyncio.run(main())


def fleet_layout(info: Any) -> StreamLayout | None:
    """The fleet layout of a stream (nats-py's ``StreamInfo``), or None when it is not a
    stream ``kvctl stream init`` made."""
    from ..partitions import StreamLayout

    config = info.config
    transform = config.subject_transform
    return StreamLayout.of_stream(
        config.name,
        list(config.subjects or ()),
        transform.src if transform else None,
        transform.dest if transform else None,
    )


async def stream_info_or_none(js: Any, name: str, subjects_filter: str | None = None) -> Any:
    """The stream's ``StreamInfo``, or None when there is no such stream."""
    from nats.js.errors import NotFoundError

    try:
        return await js.stream_info(name, subjects_filter=subjects_filter)
    except NotFoundError:
        return None


async def all_consumers(js: Any, stream: str) -> list[Any]:
    """Every consumer of ``stream`` (the server answers 256 at a time)."""
    found: list[Any] = []
    while True:
        page = await js.consumers_info(stream, offset=len(found))
        found.extend(page)
        if not page:
            return found


# --- JetStream publishing, pipelined (kvctl bridge --stream) ---


class _Message:
    """One message handed to :class:`StreamPublisher`, until the stream stored it or it was
    given up."""

    __slots__ = ("number", "subject", "payload", "headers", "size", "sent_at", "future")

    def __init__(self, number: int, subject: str, payload: bytes, headers: dict[str, str]):
        self.number = number
        self.subject = subject
        self.payload = payload
        self.headers = headers
        self.size = len(payload) + sum(len(k) + len(v) + 4 for k, v in headers.items())
        self.sent_at = 0.0
        self.future: Any = None


class StreamPublisher:
    """JetStream publishes from synchronous code, pipelined: up to ``window`` messages (and
    ``window_bytes``) are out at once, their acks awaited together, instead of one publish,
    one ack, one round trip at a time.

    Nothing is dropped: a full window makes :meth:`publish` wait (back-pressure on the
    source). A publish the stream refuses (503 / no responders while a stream leader is
    elected), leaves unanswered for ``ACK_TIMEOUT_S`` or that a lost connection cut off is
    retried, with back-off, while the trouble lasts at most ``publish_timeout`` seconds
    (counted from the first failure since the last stored message); then everything not
    stored is counted as failed and :meth:`publish`/:meth:`close` raise one line
    (:class:`TransportError`). Each message carries its ``Nats-Msg-Id`` (the caller's): a
    retry of one that was stored after all is dropped by the server and counted as a
    duplicate.

    Order: on a failure no new message is sent until every failed one is stored again, one
    at a time, oldest first. Messages already in flight behind a failed one may be stored
    before its retry is: counted as ``reordered`` (by subject), never hidden.

    The client fails over between the servers of a comma list, and reconnects without limit
    while the outage clock runs. ``notify`` hears of trouble and recovery, one line each."""

    WINDOW = 4096
    WINDOW_BYTES = 32 * 2**20
    ACK_TIMEOUT_S = 5.0
    """A publish unanswered this long is sent again (the server drops it if it was stored)."""
    PUBLISH_TIMEOUT_S = 60.0
    BACKOFF_S = (0.05, 1.0)
    """The first and the longest wait between two attempts of a refused publish."""

    def __init__(
        self,
        url: str,
        options: NatsOptions | None = None,
        window: int = WINDOW,
        window_bytes: int = WINDOW_BYTES,
        publish_timeout: float = PUBLISH_TIMEOUT_S,
        notify: Callable[[str], None] | None = None,
    ) -> None:
        self.servers = servers_of(url)
        self.shown = redact_url(url)
        self.options = options or NatsOptions()
        self.window = max(1, window)
        self.window_bytes = window_bytes
        self.publish_timeout = publish_timeout
        self.notify = notify
        # caller -> loop: the queue; loop -> caller: the outstanding count, under _room
        self._queue: deque[_Message] = deque()
        self._outstanding = 0
        self._outstanding_bytes = 0
        self._room = threading.Condition()
        self._number = 0
        self._inflight: dict[int, _Message] = {}  # send order
        self._retry: list[_Message] = []
        self._highest_stored: dict[str, int] = {}  # subject -> highest message number stored
        self._ready = threading.Event()
        self._done = threading.Event()
        self._error: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._connected: asyncio.Event | None = None
        self._closing = False
        self._trouble_since: float | None = None
        self._trouble_reason = ""
        self._connect_errors: list[str] = []
        self._nc: Any = None
        self.published = 0
        """Messages handed to :meth:`publish`."""
        self.acked = 0
        """Stored by the stream (acked, not as a duplicate)."""
        self.duplicates = 0
        """Acked as a duplicate: stored before (an earlier attempt, or another bridge)."""
        self.failed = 0
        self.failure: str | None = None
        self.retried = 0
        """Publishes sent again after a refusal, a missing ack or a lost connection."""
        self.reordered = 0
        self.outages = 0
        self.outage_s = 0.0
        self.longest_outage_s = 0.0
        self.peak_in_flight = 0
        self._thread = threading.Thread(target=self._run, name="kvctl-js-pub", daemon=True)
        self._thread.start()
        if not self._ready.wait(self.options.connect_timeout + 5) or self._error:
            heard = f": {self._connect_errors[0]}" if self._connect_errors else ""
            raise TransportError(self._error or f"{self.shown}: no answer from NATS{heard}")

    # -- the caller's side ---------------------------------------------------------------------

    def publish(self, subject: str, payload: bytes, headers: dict[str, str]) -> None:
        """Queue one message; waits while the window is full (short waits: Ctrl-C works)."""
        message = _Message(0, subject, payload, headers)
        with self._room:
            while not self._error and (
                self._outstanding >= self.window
                or (
                    self._outstanding and self._outstanding_bytes + message.size > self.window_bytes
                )
            ):
                self._room.wait(0.2)
            if self._error:
                raise TransportError(self._error)
            message.number = self._number
            self._number += 1
            self.published += 1
            self._outstanding += 1
            self._outstanding_bytes += message.size
            self._queue.append(message)
            wake = len(self._queue) == 1
        if wake and self._loop is not None and self._wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop ended (an error, said above)
                self._loop.call_soon_threadsafe(self._wake.set)

    def close(self) -> None:
        """Wait until every message is stored or given up, then disconnect; one line
        (:class:`TransportError`) when some could not be published."""
        if self._loop is not None and not self._done.is_set():
            self._closing = True
            with contextlib.suppress(RuntimeError):
                assert self._wake is not None
                self._loop.call_soon_threadsafe(self._wake.set)
            bound = self.publish_timeout + 2 * self.ACK_TIMEOUT_S + 30
            deadline = time.monotonic() + bound
            while not self._done.wait(0.2):  # short waits: Ctrl-C works
                if time.monotonic() > deadline:  # cannot happen: the loop's clocks end it
                    self._give_up(f"the publisher did not finish within {bound:g} s")
                    break
        if self._error:
            raise TransportError(self._error)

    @property
    def error(self) -> str | None:
        """Why the publisher gave up (then every publish raises it), or None."""
        return self._error

    def counts(self) -> dict[str, Any]:
        return {
            "published": self.published,
            "acked": self.acked,
            "duplicates": self.duplicates,
            "failed": self.failed,
            "failure": self.failure,
            "retried": self.retried,
            "reordered": self.reordered,
            "outages": self.outages,
            "outage_s": round(self.outage_s, 3),
            "longest_outage_s": round(self.longest_outage_s, 3),
            "window": self.window,
            "peak_in_flight": self.peak_in_flight,
            "publish_timeout_s": self.publish_timeout,
        }

    # -- the loop's side -----------------------------------------------------------------------

    def _say(self, line: str) -> None:
        if self.notify is not None:
            self.notify(line)

    def _settle(self, message: _Message) -> None:
        """The message is stored or given up: its room in the window is free."""
        with self._room:
            self._outstanding -= 1
            self._outstanding_bytes -= message.size
            self._room.notify_all()

    def _give_up(self, reason: str) -> None:
        """Everything not stored is failed, from now on too: one line says so."""
        with self._room:
            lost = self._outstanding
            self.failed += lost
            self.failure = self.failure or reason
            self._outstanding = self._outstanding_bytes = 0
            self._queue.clear()
            self._inflight.clear()
            self._retry.clear()
            if self._error is None:
                self._error = (
                    f"{self.shown}: {reason}; {lost:,} message{'s' if lost != 1 else ''} "
                    "not published"
                )
            self._room.notify_all()

    def _trouble(self, reason: str) -> None:
        self._trouble_reason = reason
        if self._trouble_since is None:
            self._trouble_since = time.monotonic()
            self.outages += 1
            self._say(
                f"kvctl: {self.shown}: JetStream did not store a message ({reason}); "
                f"retrying for up to {self.publish_timeout:g} s, new messages wait"
            )

    def _stored(self, message: _Message, ack: Any) -> None:
        if getattr(ack, "duplicate", False):
            self.duplicates += 1
        else:
            self.acked += 1
            if self._highest_stored.get(message.subject, -1) > message.number:
                self.reordered += 1  # a later message of its worker was stored first
        if self._highest_stored.get(message.subject, -1) < message.number:
            self._highest_stored[message.subject] = message.number
        if self._trouble_since is not None:
            away = time.monotonic() - self._trouble_since
            self._trouble_since = None
            self.outage_s += away
            self.longest_outage_s = max(self.longest_outage_s, away)
            self._say(f"kvctl: {self.shown}: JetStream stores again after {away:.1f} s")
        self._settle(message)

    def _refused(self, message: _Message, exc: BaseException) -> None:
        """A failed attempt: retried later, or failed at once when retrying cannot help."""
        reason = _publish_error(exc)
        if _is_permanent(exc):
            self.failed += 1
            self.failure = f"{reason} ({message.size:,} bytes)"
            self._settle(message)
            return
        self._trouble(reason)
        self._retry.append(message)

    def _out_of_time(self) -> bool:
        since = self._trouble_since
        if since is None or time.monotonic() - since < self.publish_timeout:
            return False
        self._give_up(
            f"JetStream stored nothing for {self.publish_timeout:g} s "
            f"({self._trouble_reason}; see --publish-timeout)"
        )
        return True

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._main())
        except Exception as exc:  # one line, never a traceback
            self._give_up(f"{type(exc).__name__}: {exc}")
        finally:
            self._ready.set()
            self._done.set()
            with self._room:
                self._room.notify_all()
            with contextlib.suppress(Exception):
                loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _main(self) -> None:
        import nats

        self._wake = asyncio.Event()
        connected = self._connected = asyncio.Event()
        errors = self._connect_errors
        logging.getLogger("asyncio").setLevel(logging.ERROR)  # see Publisher._main
        disconnecting = False  # our own close: not an outage

        async def on_error(exc: Exception) -> None:
            errors.append(describe(exc))

        async def on_disconnected() -> None:
            if not disconnecting and connected.is_set():
                connected.clear()
                self._trouble(f"connection lost: {errors[-1] if errors else 'no answer'}")

        async def on_reconnected() -> None:
            connected.set()
            assert self._wake is not None
            self._wake.set()

        try:
            self._nc = await nats.connect(
                servers=self.servers,
                error_cb=on_error,
                disconnected_cb=on_disconnected,
                reconnected_cb=on_reconnected,
                **self.options.connect_kwargs(),
            )
        except Exception as exc:
            reason = errors[0] if errors else describe(exc)
            self._error = f"{self.shown}: cannot connect to NATS: {reason}"
            return
        # once connected, an outage is waited out (failing over between the servers) for as
        # long as the outage clock allows
        self._nc.options["max_reconnect_attempts"] = -1
        connected.set()
        # nats-py's own bound on pending async publishes stays above the window: a publish
        # that raised before its future was handed back keeps its slot
        js = self._nc.jetstream(
            timeout=self.ACK_TIMEOUT_S, publish_async_max_pending=4 * self.window + 64
        )
        self._ready.set()
        try:
            await self._pump(js)
        finally:
            disconnecting = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._nc.close(), 5)

    async def _pump(self, js: Any) -> None:
        wake, connected = self._wake, self._connected
        assert wake is not None and connected is not None
        max_payload = self._nc.max_payload
        next_look = 0.0
        sends = 0
        while self._error is None:
            now = time.monotonic()
            if now >= next_look:  # unanswered publishes, the outage clock
                next_look = now + 0.05
                self._expire(now)
                if self._out_of_time():
                    return
            if self._retry:
                await self._recover(js)
                continue
            if not connected.is_set():
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(connected.wait(), 0.1)
                continue
            with self._room:
                message = self._queue.popleft() if self._queue else None
            if message is None:
                if self._closing and not self._inflight:
                    return
                wake.clear()
                if not self._queue:  # (a publish between the look and the clear)
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(wake.wait(), 0.05)
                continue
            if len(message.payload) > max_payload:
                self._refused(message, _TooBig(len(message.payload), max_payload))
                continue
            await self._send(js, message)
            sends += 1
            if sends % 64 == 0:  # let the acks that came meanwhile in: the window moves on
                await asyncio.sleep(0)

    async def _send(self, js: Any, message: _Message) -> None:
        message.sent_at = time.monotonic()
        try:
            future = await js.publish_async(
                message.subject, message.payload, headers=message.headers
            )
        except Exception as exc:  # the connection broke just now: retried
            self._refused(message, exc)
            return
        message.future = future
        self._inflight[message.number] = message
        self.peak_in_flight = max(self.peak_in_flight, len(self._inflight))
        future.add_done_callback(lambda done, m=message: self._answered(m, done))

    def _answered(self, message: _Message, future: Any) -> None:
        if future.cancelled() or self._inflight.pop(message.number, None) is None:
            return  # timed out first (see _expire): already being retried
        exc = future.exception()
        if exc is None:
            self._stored(message, future.result())
        else:
            self._refused(message, exc)

    def _expire(self, now: float) -> None:
        """Publishes unanswered for ACK_TIMEOUT_S are failed attempts (oldest first)."""
        for number, message in list(self._inflight.items()):
            if now - message.sent_at < self.ACK_TIMEOUT_S:
                break
            del self._inflight[number]
            message.future.cancel()
            self._refused(message, asyncio.TimeoutError())

    async def _recover(self, js: Any) -> None:
        """Store the failed messages again, one at a time, oldest first, before anything
        newer is sent (what is in flight is answered or expires first)."""
        connected = self._connected
        assert connected is not None
        while self._inflight:
            await asyncio.sleep(0.01)
            self._expire(time.monotonic())
            if self._out_of_time():
                return
        self._retry.sort(key=lambda m: m.number)
        delay = self.BACKOFF_S[0]
        while self._retry and self._error is None:
            if self._out_of_time():
                return
            if not connected.is_set():
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(connected.wait(), 0.2)
                continue
            message = self._retry[0]
            self.retried += 1
            try:
                ack = await js.publish(
                    message.subject,
                    message.payload,
                    timeout=self.ACK_TIMEOUT_S,
                    headers=message.headers,
                )
            except Exception as exc:
                self._retry.pop(0)
                self._refused(message, exc)  # back at the end: sorted again below
                self._retry.sort(key=lambda m: m.number)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.BACKOFF_S[1])
                continue
            self._retry.pop(0)
            self._stored(message, ack)
            delay = self.BACKOFF_S[0]


class _TooBig(Exception):
    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"message of {size:,} bytes is over the server's limit of {limit:,}")


def _is_permanent(exc: BaseException) -> bool:
    """Publish failures that no retry cures: too big, or a request the stream refuses as
    wrong (not a 503, which an election or a restart answers for a while)."""
    from nats.errors import MaxPayloadError
    from nats.js.errors import APIError, NoStreamResponseError, ServiceUnavailableError

    if isinstance(exc, (_TooBig, MaxPayloadError)):
        return True
    if isinstance(exc, (NoStreamResponseError, ServiceUnavailableError)):
        return False
    return isinstance(exc, APIError) and exc.code == 400


def _publish_error(exc: BaseException) -> str:
    from nats.js.errors import APIError, NoStreamResponseError

    if isinstance(exc, asyncio.TimeoutError):
        return f"no ack within {StreamPublisher.ACK_TIMEOUT_S:g} s"
    if isinstance(exc, NoStreamResponseError):
        return "no responders (no stream leader)"
    if isinstance(exc, APIError):
        return f"JetStream: {exc.description or exc.code}"
    return describe(exc)
