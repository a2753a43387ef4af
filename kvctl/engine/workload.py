"""Request sources for the fleet: a synthetic chat workload and Mooncake-style trace replay.

A workload is pulled by the fleet: :meth:`peek` gives the next arrival time (``None``: no more),
:meth:`take` builds that request, :meth:`finished` is told when a request completes (so a chat
session can send its next turn). Everything is drawn from ``random.Random`` streams derived
from ``seed``: the same seed gives the same requests.

Token ids are uniform in ``[0, 65536)`` (two random bytes each).
"""

from __future__ import annotations

import bisect
import json
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from random import Random

from .engine import Request

TRACE_BLOCK_TOKENS = 512
"""Tokens per ``hash_ids`` entry in Mooncake traces."""


def random_tokens(rng: Random, n: int) -> list[int]:
    """``n`` token ids in [0, 65536) from ``rng``."""
    if n <= 0:
        return []
    return list(struct.unpack(f"<{n}H", rng.randbytes(2 * n)))


@lru_cache(maxsize=2048)
def trace_block_tokens(hash_id: int, block_tokens: int = TRACE_BLOCK_TOKENS) -> tuple[int, ...]:
    """The tokens of one trace hash id: a pseudo-random sequence seeded by the id alone, so
    equal hash ids mean equal tokens in every request, run and worker."""
    return struct.unpack(f"<{block_tokens}H", Random(hash_id).randbytes(2 * block_tokens))


def expand_trace_tokens(
    hash_ids: list[int], input_length: int, block_tokens: int = TRACE_BLOCK_TOKENS
) -> list[int]:
    """Prompt tokens of a trace record: the hash ids' token blocks concatenated and cut to
    ``input_length`` (the last block is partial: its first tokens)."""
    out: list[int] = []
    for h in hash_ids:
        out += trace_block_tokens(h, block_tokens)
    if len(out) < input_length:
        raise ValueError(f"{len(hash_ids)} hash ids cannot cover {input_length} tokens")
    del out[input_length:]
    return out


def _lognormal(rng: Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return min(hi, max(lo, round(median * math.exp(rng.gauss(0.0, sigma)))))


@dataclass
class ChatParams:
    """Knobs of :class:`SyntheticWorkload` (token counts; lengths are log-normal, clipped)."""

    prefix_len: tuple[int, int] = (512, 2048)
    """System prompt k has a fixed length drawn uniformly from this range."""
    zipf_s: float = 1.0
    """Popularity of system prompt k (k = 0..K-1) is proportional to 1 / (k+1)**zipf_s."""
    first_user_median: int = 512
    """First user message: median tokens (sigma 1.0, clipped to 16..8192)."""
    followup_median: int = 128
    """Each later user message: median tokens (sigma 1.0, clipped to 4..4096)."""
    output_median: int = 192
    """Output tokens: median (sigma 0.8, clipped to 1..2048)."""
    mean_turns: float = 3.0
    """Turns per session are geometric with this mean; an arrival continues a session that has
    finished its previous turn with probability 1 - 1/mean_turns (when one is waiting)."""
    max_context: int = 16384
    """A session ends when its next turn (prompt + output) would exceed this many tokens."""
    max_idle_sessions: int = 1024
    """Sessions waiting for their next turn beyond this many: the oldest are dropped."""


class _Session:
    __slots__ = ("prev", "turns_left")

    def __init__(self, turns_left: int) -> None:
        self.prev: Request | None = None
        self.turns_left = turns_left


class SyntheticWorkload:
    """Poisson arrivals at ``rate`` requests/s; K shared system prompts with Zipf popularity;
    multi-turn sessions whose next prompt = previous prompt + previous output + new user
    tokens (and inherits the previous turn's block hashes)."""

    def __init__(
        self,
        rate: float = 10.0,
        prefixes: int = 8,
        seed: int = 0,
        requests: int | None = None,
        block_size: int = 16,
        params: ChatParams | None = None,
    ) -> None:
        if rate <= 0:
            raise ValueError("rate must be positive")
        if prefixes < 1:
            raise ValueError("need at least one prefix")
        self.rate = rate
        self.limit = requests
        self.block_size = block_size
        self.p = p = params or ChatParams()
        self._arrivals = Random(seed * 4 + 1)
        self._rng = Random(seed * 4 + 2)
        lo, hi = p.prefix_len
        self.system_prompts = [
            random_tokens(self._rng, self._rng.randint(lo, hi)) for _ in range(prefixes)
        ]
        weights = [1.0 / (k + 1) ** p.zipf_s for k in range(prefixes)]
        total = sum(weights)
        acc, self._cum = 0.0, []
        for w in weights:
            acc += w / total
            self._cum.append(acc)
        self._idle: list[_Session] = []
        self._next = self._arrivals.expovariate(rate)
        self.issued = 0
        self.sessions = 0

    def peek(self) -> float | None:
        if self.limit is not None and self.issued >= self.limit:
            return None
        return self._next

    def take(self) -> Request:
        t = self._next
        self._next = t + self._arrivals.expovariate(self.rate)
        rng, p = self._rng, self.p
        rid = self.issued
        self.issued += 1
        out_len = _lognormal(rng, p.output_median, 0.8, 1, 2048)
        session: _Session | None = None
        if self._idle and rng.random() < 1.0 - 1.0 / p.mean_turns:
            i = rng.randrange(len(self._idle))
            session = self._idle[i]
            self._idle[i] = self._idle[-1]
            self._idle.pop()
            prev = session.prev
            assert prev is not None
            user = _lognormal(rng, p.followup_median, 1.0, 4, 4096)
            if len(prev.tokens) + user + out_len > p.max_context:
                session = None  # context full: the user starts over
            else:
                tokens = prev.tokens + random_tokens(rng, user + out_len)
                prompt_len = len(prev.tokens) + user
                inherit: list[int] | None = prev.hashes[: len(prev.tokens) // self.block_size]
        if session is None:
            k = min(bisect.bisect_left(self._cum, rng.random()), len(self._cum) - 1)
            system = self.system_prompts[k]
            user = _lognormal(rng, p.first_user_median, 1.0, 16, 8192)
            user = max(1, min(user, p.max_context - len(system) - out_len))
            tokens = system + random_tokens(rng, user + out_len)
            prompt_len = len(system) + user
            inherit = None
            # turns: geometric with mean `mean_turns` (>= 1)
            q = 1.0 / p.mean_turns
            turns = 1 if q >= 1 else 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - q))
            session = _Session(turns)
            self.sessions += 1
        req = Request(rid, tokens, prompt_len, arrival=t, hashes=inherit, session=session)
        session.prev = req
        session.turns_left -= 1
        return req

    def finished(self, req: Request, now: float) -> None:
        session = req.session
        if session is not None and session.turns_left > 0 and session.prev is req:
            self._idle.append(session)
            if len(self._idle) > self.p.max_idle_sessions:
                del self._idle[0]


class TraceWorkload:
    """Replays a Mooncake-style JSONL trace (``timestamp`` ms, ``input_length``,
    ``output_length``, ``hash_ids`` of 512 tokens each). Arrival = timestamp / 1000 / speedup
    seconds; prompt tokens come from :func:`expand_trace_tokens`; output tokens are random
    (seeded). Records with ``output_length`` 0 get one output token. The whole file is
    checked when the workload is made: a bad line raises :class:`TraceError`."""

    def __init__(
        self,
        path: str | Path,
        speedup: float = 1.0,
        seed: int = 0,
        requests: int | None = None,
        block_tokens: int = TRACE_BLOCK_TOKENS,
    ) -> None:
        if speedup <= 0:
            raise ValueError("speedup must be positive")
        self.path = Path(path)
        self.speedup = speedup
        self.limit = requests
        self.block_tokens = block_tokens
        self._rng = Random(seed * 4 + 3)
        # Check every line before the first request: a bad line found mid-run would leave a
        # truncated recording (or a half-published stream) behind.
        self.total = sum(1 for _ in read_trace(self.path, block_tokens))
        self._records = read_trace(self.path, block_tokens)
        self._head = next(self._records, None)
        self.issued = 0

    def peek(self) -> float | None:
        if self._head is None or (self.limit is not None and self.issued >= self.limit):
            return None
        return self._head["timestamp"] / 1000.0 / self.speedup

    def take(self) -> Request:
        rec = self._head
        if rec is None:
            raise IndexError("trace exhausted")
        t = rec["timestamp"] / 1000.0 / self.speedup
        self._head = next(self._records, None)
        prompt = expand_trace_tokens(rec["hash_ids"], rec["input_length"], self.block_tokens)
        out = random_tokens(self._rng, max(1, rec["output_length"]))
        rid = self.issued
        self.issued += 1
        return Request(rid, prompt + out, len(prompt), arrival=t)

    def finished(self, req: Request, now: float) -> None:
        pass


class TraceError(ValueError):
    """A trace line that cannot be replayed; the message reads ``PATH:LINE: what is wrong``."""

    def __init__(self, path: str | Path, line: int, problem: str) -> None:
        super().__init__(f"{path}:{line}: {problem}")
        self.path = str(path)
        self.line = line
        self.problem = problem


_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _trace_problem(record: object, previous_ts: float, block_tokens: int) -> str | None:
    """What is wrong with one parsed trace line, or None."""
    if not isinstance(record, dict):
        return f"expected a JSON object with {', '.join(_FIELDS)}, got {type(record).__name__}"
    missing = [name for name in _FIELDS if name not in record]
    if missing:
        return f"missing {', '.join(missing)}"
    ts = record["timestamp"]
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not math.isfinite(ts) or ts < 0:
        return f"timestamp must be a number of milliseconds >= 0, got {ts!r}"
    if ts < previous_ts:
        return (
            f"timestamp {ts!r} is earlier than the previous line's {previous_ts!r} "
            "(a trace is replayed in time order)"
        )
    input_length, output_length = record["input_length"], record["output_length"]
    if not _is_int(input_length) or input_length < 1:
        return f"input_length must be an integer >= 1, got {input_length!r}"
    if not _is_int(output_length) or output_length < 0:
        return f"output_length must be an integer >= 0, got {output_length!r}"
    hash_ids = record["hash_ids"]
    if not isinstance(hash_ids, list) or not all(_is_int(h) for h in hash_ids):
        return f"hash_ids must be a list of integers, got {json.dumps(hash_ids)[:60]}"
    if len(hash_ids) * block_tokens < input_length:
        return (
            f"{len(hash_ids)} hash_ids of {block_tokens} tokens cannot cover "
            f"input_length {input_length}"
        )
    return None


def read_trace(path: str | Path, block_tokens: int = TRACE_BLOCK_TOKENS) -> Iterator[dict]:
    """Records of a JSONL trace, in file order (blank lines skipped); a line that is not a
    valid record raises :class:`TraceError` naming the file and line (1-based)."""
    previous_ts: float = 0.0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                raise TraceError(path, number, "not UTF-8 text") from None
            except json.JSONDecodeError as exc:
                raise TraceError(
                    path, number, f"not JSON ({exc.msg} at column {exc.colno})"
                ) from None
            problem = _trace_problem(record, previous_ts, block_tokens)
            if problem:
                raise TraceError(path, number, problem)
            previous_ts = record["timestamp"]
            yield record
