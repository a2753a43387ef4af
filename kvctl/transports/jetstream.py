"""JetStream pull consumers for the partitioned recorders: bytes and headers in, acks out.
No decoding here.

nats-py is asyncio-only; the recorder's loop is synchronous (it builds and writes Parquet
segments between receives). So, as in :mod:`kvctl.transports.nats`, the client runs its own
event loop in a thread: one fetch task per partition pulls batches from that partition's
durable consumer and hands them over through a bounded queue; acks go the other way and are
awaited (double acks: the server says it took them) before the recorder counts them.

A consumer is positioned by :meth:`PartitionReader.position`, from what the dataset on disk
holds (the disk is the truth, see :mod:`kvctl.recording.partition_writer`).

Receiving is the recorder's hot path, and nats-py's ``fetch`` costs ~25 us a message in the
client thread (a task, a ``wait_for`` and a uuid per ``next_msg``, a header parser, a ``Msg``
object), which the receive loop then waits for on the GIL. So each partition's task asks for
messages itself (the JetStream pull request ``$JS.API.CONSUMER.MSG.NEXT``, as ``fetch`` sends
it) on an inbox of its own whose messages nats-py hands over as bytes
(:func:`_raw_client_class`): no per-message task or object but the :class:`Delivered`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import TransportError
from ..redact import redact_url
from ..text import plural
from .nats import NatsOptions, Subscriber, describe, servers_of

FETCH_BATCH = 1000
"""Messages asked for in one pull request (and at most this many wait beside the queue)."""
FETCH_WAIT_S = 1.0
"""How long one pull request waits on the server for messages (then it is asked again)."""
LOST_REQUEST_S = 2.0
"""A pull request that neither delivered nor expired (408) this long after it was sent was
lost (a reconnect): it is sent again."""
API_PREFIX = "$JS.API"
"""The JetStream API prefix of ``nc.jetstream()`` (no domain)."""
MAX_ACK_PENDING = 1_000_000
"""Messages delivered and not yet acked, per consumer: a segment's worth, and more."""
CONSUMER_INACTIVE_S = 10.0
"""A live reader's ephemeral consumer without interest (the reader was killed) is deleted by
the server after this long."""
QUEUE_BATCHES = 8
"""Fetched batches waiting for the recorder (bounded: the fetch tasks wait when it is full)."""


@dataclass(slots=True)
class Delivered:
    """One stored message as the consumer delivered it."""

    partition: int
    stream_seq: int
    subject: str
    headers: dict[str, str] | None
    data: bytes
    handle: Any
    """What :meth:`PartitionReader.ack` takes (the message's ack subject)."""


@dataclass(frozen=True)
class Positioned:
    """What :meth:`PartitionReader.position` did with a partition's consumer."""

    partition: int
    consumer: str
    action: str
    """``kept`` (it resumes right after ``committed``), ``created`` or ``recreated``."""
    reason: str = ""
    ack_floor: int = 0


def stream_seq(msg: Any) -> int:
    """The stream seq of a delivered message, read off its ack subject
    (``$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>...``, or with domain and account
    hash after ``ACK``): nats-py's ``metadata`` parses every field, at a cost per message
    that is a tenth of the receive loop's."""
    tokens = msg.reply.split(".")
    if len(tokens) == 9:
        return int(tokens[5])
    if len(tokens) >= 11:
        return int(tokens[7])
    return int(msg.metadata.sequence.stream)


def parse_headers(raw: bytes | None) -> dict[str, str] | None:
    """A message's header block (``NATS/1.0\\r\\nName: value\\r\\n...``) as nats-py gives it:
    names and values stripped of the whitespace around them, lines without a colon left out
    (a third of the cost of nats-py's parser: the lines are split once, not decoded one by
    one)."""
    if raw is None:
        return None
    out = {}
    for line in raw.decode("utf-8", "replace").split("\r\n")[1:]:
        name, colon, value = line.partition(":")
        if colon:
            out[name.strip()] = value.strip()
    return out or None


def _raw_client_class() -> type:
    """nats-py's client, where the messages of the subscriptions in ``raw_sinks`` (sid ->
    sink) skip its per-message work and go to their sink as ``(subject, reply, data, raw
    headers)``: the recorder's pull inboxes. Every other subscription (API replies, acks'
    replies) is nats-py's own. Made on first use: nats-py is imported only by commands that
    use NATS."""
    global _RAW_CLIENT
    if _RAW_CLIENT is None:
        from nats.aio.client import Client

        class RawClient(Client):
            def __init__(self) -> None:
                super().__init__()
                self.raw_sinks: dict[int, Callable[[bytes, bytes, bytes, bytes | None], None]]
                self.raw_sinks = {}

            async def _process_msg(
                self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: Any
            ) -> None:
                sink = self.raw_sinks.get(sid)
                if sink is None:
                    await super()._process_msg(sid, subject, reply, data, headers)
                else:
                    sink(subject, reply, data, headers)

        _RAW_CLIENT = RawClient
    return _RAW_CLIENT


_RAW_CLIENT: type | None = None


def consumer_name(stream: str, partition: int) -> str:
    return f"kvctl-record-{stream}-p{partition:02d}"


class PartitionReader:
    """Pull consumers of some partitions of one stream, read from a thread of their own."""

    def __init__(
        self,
        url: str,
        options: NatsOptions,
        stream: str,
        subjects: dict[int, str],
        ack_wait_s: float,
        notify: Callable[[str], None] | None = None,
    ) -> None:
        self.servers = servers_of(url)
        self.shown = redact_url(url)
        self.options = options
        self.stream = stream
        self.subjects = subjects
        self.ack_wait_s = ack_wait_s
        self.notify = notify or (lambda line: None)
        self.queue: queue.Queue[list[Delivered] | BaseException] = queue.Queue(QUEUE_BATCHES)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.nc: Any = None
        self.js: Any = None
        self.stop = threading.Event()
        self.tasks: list[concurrent.futures.Future[Any]] = []
        self.fetch_errors = 0
        self.last_error = ""
        self.failed_at = 0.0
        """When a pull last failed (time.monotonic): an outage is not idleness."""
        self.first_seq = 0
        self.received: dict[int, int] = {}
        """Per partition, the last stream seq delivered to the recorder (or it resumes
        after: :meth:`position`)."""
        self.delivery_seqs: dict[int, int] = {}
        """Per partition, the consumer's delivery seq of the last message taken (0: none
        yet from this consumer)."""
        self.lost: dict[int, int] = {}
        """Partitions whose consumer's deliveries were lost: how many (:meth:`_recover_lost`)."""
        """The stream's first seq, as :meth:`stream_partitions` found it."""

    def _call(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    # --- connecting and positioning ----------------------------------------------------------

    def connect(self) -> None:
        self._call(self._connect())

    async def _connect(self) -> None:
        logging.getLogger("asyncio").setLevel(logging.ERROR)
        heard: list[str] = []

        async def on_error(exc: Exception) -> None:  # nats-py would log a traceback
            heard.append(describe(exc))
            self.last_error = describe(exc)

        async def on_disconnect() -> None:
            if not self.stop.is_set():  # not our own close
                self.notify(f"kvctl: {self.shown}: disconnected from NATS, reconnecting")

        async def on_reconnect() -> None:
            if not self.stop.is_set():
                self.notify(f"kvctl: {self.shown}: reconnected")

        kwargs = self.options.connect_kwargs()
        try:
            self.nc = _raw_client_class()()
            await self.nc.connect(
                servers=self.servers,
                error_cb=on_error,
                disconnected_cb=on_disconnect,
                reconnected_cb=on_reconnect,
                **kwargs,
            )
        except Exception as exc:
            reason = heard[0] if heard else describe(exc)
            raise TransportError(f"{self.shown}: cannot connect to NATS: {reason}") from None
        # The first connection tries as --connect-timeout says (nats-py would retry an
        # unreachable server forever with unlimited attempts); once connected, a recorder
        # outlives server restarts and leader elections: it reconnects without end
        # (--idle-timeout bounds how long it waits for messages)
        self.nc.options["max_reconnect_attempts"] = -1
        self.js = self.nc.jetstream(timeout=self.options.connect_timeout)

    def stream_partitions(self) -> int | None:
        """The number of partitions of the stream (None: no such stream, or not a kvctl
        stream)."""
        return self._call(self._stream_partitions())

    async def _stream_partitions(self) -> int | None:
        from .nats import fleet_layout, stream_info_or_none

        info = await self._api(stream_info_or_none(self.js, self.stream))
        if info is None:
            raise TransportError(
                f"{self.shown}: no stream {self.stream} (create it with `kvctl stream init`)"
            )
        # the oldest message the stream still holds: what a recorder can no longer get
        # (expired, purged) is not claimed as recorded
        self.first_seq = info.state.first_seq or 0
        layout = fleet_layout(info)
        return None if layout is None else layout.partitions

    async def _api(self, coro: Any, missing_ok: bool = False) -> Any:
        """A JetStream API call, its failures as one line (``missing_ok``: None for a
        consumer or stream that is not there)."""
        from nats.js import errors as js_errors

        try:
            return await coro
        except js_errors.NotFoundError:
            if missing_ok:
                return None
            raise TransportError(f"{self.shown}: JetStream: not found") from None
        except js_errors.ServiceUnavailableError:
            raise TransportError(f"{self.shown}: JetStream is not enabled on this server") from None
        except js_errors.APIError as exc:
            raise TransportError(f"{self.shown}: JetStream: {exc.description or exc}") from None
        except (asyncio.TimeoutError, TimeoutError):
            raise TransportError(
                f"{self.shown}: JetStream did not answer within {self.options.connect_timeout:g} s"
            ) from None

    def position(self, partition: int, committed: int) -> Positioned:
        """Make ``partition``'s durable consumer deliver from stream seq ``committed + 1``
        (0: from the first message the stream holds): kept as it is when its ack floor is
        ``committed`` and nothing is delivered-but-unacked, else deleted and made again
        (acks lost after a segment was committed, a consumer that acked past what the
        dataset holds, another filter)."""
        placed = self._call(self._position(partition, committed))
        self.received[partition] = committed
        return placed

    async def _position(self, partition: int, committed: int, lost: bool = False) -> Positioned:
        """``lost``: made again whatever it holds (its pull requests waiting are this
        reader's own)."""
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

        name = consumer_name(self.stream, partition)
        subject = self.subjects[partition]
        info = await self._api(self.js.consumer_info(self.stream, name), missing_ok=True)
        reason = ""
        if info is not None:
            floor = info.ack_floor.stream_seq if info.ack_floor else 0
            if info.num_waiting and not lost:  # another reader's pull requests, or a dead one's
                await asyncio.sleep(FETCH_WAIT_S * 2)  # a dead one's expire by then
                info = await self._api(self.js.consumer_info(self.stream, name))
                if info.num_waiting:
                    raise TransportError(
                        f"{self.shown}: consumer {name} has other readers: is another "
                        f"recorder reading partition {partition}? (one recorder per partition)"
                    )
            same = (
                info.config.filter_subject == subject
                and info.config.ack_policy == AckPolicy.ALL
                and info.config.ack_wait is not None
                and info.config.ack_wait >= self.ack_wait_s
            )
            if same and floor == committed and not info.num_ack_pending and not lost:
                return Positioned(partition, name, "kept", ack_floor=floor)
            if not same:
                reason = "its settings differ"
            elif floor < committed:
                reason = f"acks up to stream seq {committed} were lost (ack floor {floor})"
            elif floor > committed:
                reason = (
                    f"it acked up to stream seq {floor} but the dataset holds partition "
                    f"{partition} up to {committed}: recording from {committed + 1} again"
                )
            else:
                reason = f"{info.num_ack_pending} messages were delivered and not acked"
            await self._api(self.js.delete_consumer(self.stream, name))
        config = ConsumerConfig(
            durable_name=name,
            filter_subject=subject,
            ack_policy=AckPolicy.ALL,
            ack_wait=self.ack_wait_s,
            max_ack_pending=MAX_ACK_PENDING,
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE if committed else DeliverPolicy.ALL,
            opt_start_seq=committed + 1 if committed else None,
            description=f"kvctl record of {self.stream} partition {partition}",
        )
        await self._api(self.js.add_consumer(self.stream, config=config))
        return Positioned(
            partition, name, "recreated" if info is not None else "created", reason=reason
        )

    # --- receiving ---------------------------------------------------------------------------

    def start(self) -> None:
        for partition in self.subjects:
            self.tasks.append(asyncio.run_coroutine_threadsafe(self._fetch(partition), self.loop))

    async def _fetch(self, partition: int) -> None:
        """Pull messages until stopped: one pull request of ``FETCH_BATCH`` at a time, sent
        again once it is delivered, expired or lost. Everything that arrived is handed to the
        recorder at each wakeup (a batch per socket read, not per message); while the queue
        is full the request's messages wait here and no new request is sent (bounded).
        Failures (a server restarting, a leader election) are counted and retried, bounded by
        the recorder's own stop conditions; deliveries lost on the way, see
        :meth:`_recover_lost`."""
        nc = self.nc
        loop = asyncio.get_running_loop()
        consumer = consumer_name(self.stream, partition)
        pull = f"{API_PREFIX}.CONSUMER.MSG.NEXT.{self.stream}.{consumer}"
        request = json.dumps({"batch": FETCH_BATCH, "expires": int(FETCH_WAIT_S * 1e9)}).encode()
        arrived: list[tuple[bytes, bytes, bytes, bytes | None]] = []
        wake = asyncio.Event()

        def sink(subject: bytes, reply: bytes, data: bytes, headers: bytes | None) -> None:
            arrived.append((subject, reply, data, headers))
            wake.set()

        sub = None
        waiting: list[Delivered] = []  # taken, not yet in the queue
        while not self.stop.is_set():
            try:
                if partition in self.lost:  # nothing from the old inbox is taken any more
                    if sub is not None:
                        nc.raw_sinks.pop(sub._id, None)
                        with contextlib.suppress(Exception):
                            await sub.unsubscribe()
                        sub = None
                    arrived.clear()
                    await self._recover_lost(partition)
                if sub is None:
                    sub = await nc.subscribe(nc.new_inbox())
                    nc.raw_sinks[sub._id] = sink
                await nc.publish(pull, request, reply=sub.subject)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                await self._failed(partition, describe(exc))
                continue
            owed = FETCH_BATCH
            lost_at = loop.time() + LOST_REQUEST_S
            failure = ""
            while (owed > 0 or waiting) and not self.stop.is_set():
                if arrived:
                    taken = arrived[:]
                    arrived.clear()
                    owed, failure = self._take(partition, taken, waiting, owed, failure)
                if waiting and self._hand_over(waiting):
                    waiting = []
                if owed <= 0:  # the request is over; its messages wait for room in the queue
                    if waiting:
                        await asyncio.sleep(0.005)
                    continue
                wake.clear()
                now = loop.time()
                if now >= lost_at:
                    self.failed_at = time.monotonic()  # no answer at all: not idleness
                    break  # lost with a connection: asked again
                # while some wait for room in the queue, it is tried again every 5 ms
                with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
                    await asyncio.wait_for(wake.wait(), 0.005 if waiting else lost_at - now)
            if failure:
                await self._failed(partition, failure)

    async def _recover_lost(self, partition: int) -> None:
        """Deliveries were lost (the consumer's delivery seq jumped: messages in flight on a
        dead connection, or on a route to a node that died). The server would deliver them
        again only after the ack wait, and the next segment's ack (AckPolicy all) would ack
        them unrecorded; the messages after them were not taken. So the consumer is made
        again to deliver right after the last message taken (the caller reads a new inbox:
        what the old consumer still had on the way is not taken). What the recorder holds
        unwritten is at or below that message: a recorder killed before writing it resumes
        from the disk (:meth:`_position`)."""
        received = self.received.get(partition, 0)
        placed = await self._position(partition, received, lost=True)
        missed = self.lost.pop(partition)
        self.delivery_seqs[partition] = 0
        missing = plural(missed, "delivery", "deliveries", thousands=True)
        self.notify(
            f"kvctl: partition {partition}: {missing} "
            f"did not arrive; consumer {placed.consumer} made again, delivering from stream "
            f"seq {received + 1}"
        )

    def _take(
        self,
        partition: int,
        taken: list[tuple[bytes, bytes, bytes, bytes | None]],
        into: list[Delivered],
        owed: int,
        failure: str,
    ) -> tuple[int, str]:
        """Stored messages into ``into``, up to a lost delivery (then the request is over and
        :attr:`lost` says so); what the request still owes, and why it failed (a status
        other than "no messages" / "request timeout")."""
        append = into.append
        last = self.received.get(partition, 0)
        last_delivery = self.delivery_seqs.get(partition, 0)
        for subject, reply, data, headers in taken:
            if reply[:8] == b"$JS.ACK.":
                owed -= 1
                # $JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<delivery seq>.<ts>.<pending>
                # (or with domain and account hash after ACK: two more tokens)
                tokens = reply.split(b".")
                at = 5 if len(tokens) == 9 else 7
                seq, delivery = int(tokens[at]), int(tokens[at + 1])
                # a consumer numbers every delivery; a new leader may deliver again from
                # where its replica was (lower: duplicates, skipped by the recorder)
                if last_delivery and delivery > last_delivery + 1:
                    self.lost[partition] = delivery - last_delivery - 1
                    owed = 0
                    break
                last_delivery = delivery
                if seq > last:
                    last = seq
                append(
                    Delivered(
                        partition,
                        seq,
                        subject.decode(),
                        parse_headers(headers),
                        data,
                        reply.decode(),
                    )
                )
            elif headers is not None and headers[8:9] == b" ":  # NATS/1.0 408 Request Timeout
                code = headers[9:12]
                if code == b"100":  # an idle heartbeat
                    continue
                owed = 0  # the request is over (expired, or ended by the server: 409 ...)
                if code not in (b"404", b"408"):
                    failure = headers[9:].split(b"\r\n")[0].decode(errors="replace").strip()
        self.received[partition] = last
        self.delivery_seqs[partition] = last_delivery
        return owed, failure

    def _hand_over(self, delivered: list[Delivered]) -> bool:
        try:
            self.queue.put_nowait(delivered)
            return True
        except queue.Full:  # the recorder is busy: these wait, and no more are asked for
            return False

    async def _failed(self, partition: int, text: str) -> None:
        self.fetch_errors += 1
        self.failed_at = time.monotonic()
        if text != self.last_error:  # said once per kind, not twice a second
            self.notify(f"kvctl: partition {partition}: pull failed ({text}); retrying")
        self.last_error = text
        await asyncio.sleep(0.5)

    def receive(self, timeout: float) -> list[Delivered]:
        """The next fetched batch ([] when none came within ``timeout``)."""
        try:
            got = self.queue.get(timeout=timeout)
        except queue.Empty:
            return []
        if isinstance(got, BaseException):
            raise got
        return got

    def drain(self) -> list[Delivered]:
        """Stop fetching; every batch fetched already, at once."""
        self.stop.set()
        out: list[Delivered] = []
        while True:
            try:
                got = self.queue.get_nowait()
            except queue.Empty:
                return out
            if not isinstance(got, BaseException):
                out.extend(got)

    def ack(self, handle: Any, tries_for_s: float = 30.0) -> bool:
        """Ack everything of one consumer up to the message ``handle`` (AckPolicy ALL), and
        wait for the server to confirm; retried (a server restarting) for ``tries_for_s``.
        False: not confirmed (the recorder resumes right anyway: see ``position``)."""
        deadline = time.monotonic() + tries_for_s
        while True:
            try:
                # an empty message to the ack subject is an ack; the reply confirms it
                timeout = self.options.connect_timeout
                self._call(self.nc.request(handle, b"", timeout=timeout), timeout=30)
                return True
            except Exception as exc:
                text = describe(exc)
                if "already acknowledged" in text.lower():
                    return True
                self.last_error = text
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.5)

    def close(self) -> None:
        self.stop.set()

        async def shut() -> None:
            fetching = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in fetching:
                task.cancel()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.gather(*fetching, return_exceptions=True), 5)
            if self.nc is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.nc.close(), 5)

        with contextlib.suppress(Exception):
            self._call(shut(), timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


# --- a read-only live source of a fleet stream (tap, check, stats, top, index --stream) -------


class StreamSubscriber(Subscriber):
    """Some partitions of a fleet stream, read without a trace on the server: one ephemeral
    ordered push consumer per partition's subject (no durable state, no acks; nats-py makes
    one again after a reconnect, from the message after the last one handed over). New
    messages by default; everything the stream holds with ``from_start``.

    The client, its reconnection and the hand-over are :class:`~.nats.Subscriber`'s: messages
    arrive on :attr:`socket` as ``[headers as JSON, body]`` (undecoded: the pipeline turns
    them into batches), state changes as its control messages. A stream's history is never
    dropped for lack of room: the consumer's flow control holds the server back instead."""

    def __init__(
        self,
        server: str,
        stream: str,
        subjects: list[str],
        options: NatsOptions | None = None,
        from_start: bool = False,
        queue_bytes: int | None = None,
    ) -> None:
        from .zmq import DEFAULT_QUEUE_BYTES

        # the parent's own from_start reads Dynamo's streams: never here
        super().__init__(server, subjects, options, False, queue_bytes or DEFAULT_QUEUE_BYTES)
        self.stream = stream
        self.stream_from_start = from_start
        self.consumers: dict[str, Any] = {}
        """Subject -> nats-py's push subscription (``_consumer``: the consumer's name,
        renewed when nats-py makes it again); deleted at close."""
        self.next_seq: dict[str, int] = {}
        """Subject -> the stream seq after the last message handed over (where a consumer
        made again starts)."""
        self.resumer: asyncio.Future[Any] | None = None

    RESUME_RETRIES = 40
    RESUME_RETRY_S = 0.5  # JetStream needs a moment after a server restart

    async def _subscribe(self, nc: Any, push: Any, jetstream_subjects: set[str]) -> None:
        js = nc.jetstream(timeout=self.options.connect_timeout)
        stop = self._stop
        assert stop is not None
        if not self.stream_from_start:
            # new messages: from the seq after the stream's last, so that a consumer made
            # again after a reconnect knows where new began (DeliverPolicy.NEW would not)
            info = await js.stream_info(self.stream)
            for subject in self.subjects:
                self.next_seq[subject] = info.state.last_seq + 1
        for subject in self.subjects:
            await self._consume(js, push, subject)
        await nc.flush(timeout=self.options.connect_timeout)
        self.resumer = asyncio.ensure_future(self._resume_on_reconnect(nc, js, push, stop))

    async def _consume(self, js: Any, push: Any, subject: str) -> None:
        """One ordered consumer of ``subject``, from :attr:`next_seq` (all when unknown)."""
        from nats.js.api import ConsumerConfig, DeliverPolicy

        stop = self._stop
        assert stop is not None
        next_seq = self.next_seq

        async def forward(msg: Any) -> None:
            seq = stream_seq(msg)
            if seq < next_seq.get(subject, 0):  # a replaced consumer's, handed over already
                return
            headers = json.dumps(msg.headers or {}, separators=(",", ":")).encode()
            data = msg.data
            size = len(headers) + len(data)
            while (
                self.pushed_bytes - self.taken_bytes + size > self.queue_bytes
                and self.pushed != self.taken_messages
                and not stop.is_set()
            ):
                await asyncio.sleep(self.ROOM_WAIT_S)
            push.send_multipart([headers, data], copy=False)
            self.pushed_bytes += size
            self.pushed += 1
            next_seq[subject] = seq + 1

        start = next_seq.get(subject)
        config = (
            ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
            if start is None
            else ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start)
        )
        # a reader killed without closing leaves its consumers this long at most
        config.inactive_threshold = CONSUMER_INACTIVE_S
        self.consumers[subject] = await js.subscribe(
            subject, stream=self.stream, cb=forward, ordered_consumer=True, config=config
        )

    async def _resume_on_reconnect(self, nc: Any, js: Any, push: Any, stop: Any) -> None:
        """After each reconnect, every consumer made again from the message after the last
        one handed over: a restarted server has forgotten them (in memory), and nats-py would
        notice only after missing heartbeats, ~20 s later."""
        seen = nc.stats["reconnects"]
        while not stop.is_set():
            await asyncio.sleep(0.1)
            if nc.stats["reconnects"] == seen or not nc.is_connected:
                continue
            seen = nc.stats["reconnects"]
            for subject, old in list(self.consumers.items()):
                await self._drop(js, old)
                for attempt in range(self.RESUME_RETRIES):
                    try:
                        await self._consume(js, push, subject)
                        break
                    except Exception as exc:
                        if stop.is_set():
                            return
                        if attempt == self.RESUME_RETRIES - 1:
                            self._control(push, "error", f"{subject} not resumed: {describe(exc)}")
                        await asyncio.sleep(self.RESUME_RETRY_S)

    async def _drop(self, js: Any, sub: Any) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(sub.unsubscribe(), 2)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(js.delete_consumer(self.stream, sub._consumer), 2)

    async def _close(self, nc: Any) -> None:
        """The consumers are deleted (read-only: nothing of this reader stays on the server),
        then the connection closed."""
        if self.resumer is not None:
            self.resumer.cancel()
        if not nc.is_closed and self.consumers:
            js = nc.jetstream(timeout=2)
            for sub in self.consumers.values():
                await self._drop(js, sub)
        await super()._close(nc)


def stream_partitions(url: str, options: NatsOptions, stream: str) -> int | None:
    """How many partitions the fleet stream ``stream`` has (None: no such stream, or not one
    ``kvctl stream init`` made); a short conversation, each failure one line."""
    from .nats import fleet_layout, run_jetstream, stream_info_or_none

    async def work(js: Any) -> int | None:
        info = await stream_info_or_none(js, stream)
        layout = None if info is None else fleet_layout(info)
        return None if layout is None else layout.partitions

    result: int | None = run_jetstream(url, options, work)
    return result
