"""A pure, deterministic synthetic LLM engine fleet that produces KV-cache events.

No sockets, no clocks, no printing: :class:`Fleet` yields ``(time_s, worker, events)`` with
events in the canonical dict form of :mod:`kvctl.events`; transports and pacing live elsewhere.
"""

from .cache import BlockPool, block_hash, chain_hashes, extend_hashes, make_hasher
from .engine import Request, Worker
from .fleet import ROUTERS, Fleet, FleetConfig
from .workload import (
    ChatParams,
    SyntheticWorkload,
    TraceWorkload,
    expand_trace_tokens,
    read_trace,
    trace_block_tokens,
)

__all__ = [
    "ROUTERS",
    "BlockPool",
    "ChatParams",
    "Fleet",
    "FleetConfig",
    "Request",
    "SyntheticWorkload",
    "TraceWorkload",
    "Worker",
    "block_hash",
    "chain_hashes",
    "expand_trace_tokens",
    "extend_hashes",
    "make_hasher",
    "read_trace",
    "trace_block_tokens",
]
