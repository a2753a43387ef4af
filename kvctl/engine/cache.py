"""Content-addressed block hashes and a ref-counted, prefix-caching KV block pool (vLLM-style).

Block hash
    ``hash(parent, tokens) = xxh3_64(parent as u64-LE || tokens as u32-LE)``, an unsigned 64-bit
    int; a first block (no parent) hashes its token bytes alone, so the two cases never share an
    input length. Hashes are chained, so one hash identifies its whole prefix and equal prefixes
    give equal hashes on every worker. (vLLM itself hashes a pickled tuple with sha256 or
    builtin ``hash``; only the chaining and the 64-bit width matter to consumers.)

Pool
    ``num_blocks`` physical blocks. A block is *empty*, *in use but not yet full* (no hash yet),
    or *cached* (full, hashed, ``refs[h]`` holders). Cached blocks with no holder sit in an LRU
    free list and are evicted, oldest first, only when no empty block is left. Requests release
    their chain tail first, so a block always leaves the free list before its parent does: the
    cached set stays prefix-closed (a parent is never evicted while a descendant is cached).
    A block that fills up with a hash that is already cached is deduplicated: the holder shares
    the cached block, the physical copy goes back to the empty pool and nothing is published.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Callable, Sequence

import xxhash

_xxh3 = xxhash.xxh3_64_intdigest

Hasher = Callable[[int | None, Sequence[int]], int]
Packer = Callable[..., bytes]
_PACKERS: dict[int, tuple[Packer, Packer]] = {}


def _packers(block_size: int) -> tuple[Packer, Packer]:
    """The bytes hashed for a block of ``block_size``: (first block's tokens, parent + tokens),
    each packed by one call."""
    packers = _PACKERS.get(block_size)
    if packers is None:
        packers = (
            struct.Struct(f"<{block_size}I").pack,
            struct.Struct(f"<Q{block_size}I").pack,
        )
        _PACKERS[block_size] = packers
    return packers


def make_hasher(block_size: int) -> Hasher:
    """A fast ``hash(parent_hash_or_None, block_tokens) -> u64`` for blocks of ``block_size``."""
    pack, pack_chained = _packers(block_size)

    def hasher(parent: int | None, tokens: Sequence[int]) -> int:
        if parent is None:
            return _xxh3(pack(*tokens))
        return _xxh3(pack_chained(parent, *tokens))

    return hasher


def block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """Hash of one full block (any length) chained onto ``parent``."""
    return make_hasher(len(tokens))(parent, tokens)


def extend_hashes(hashes: list[int], tokens: Sequence[int], upto: int, block_size: int) -> None:
    """Append chained hashes to ``hashes`` until it covers ``upto`` full blocks of ``tokens``.

    The hasher is inlined (no call per block): this runs for every block the fleet stores."""
    first = len(hashes)
    if first >= upto:
        return
    pack, pack_chained = _packers(block_size)
    append = hashes.append
    if first:
        parent = hashes[-1]
    else:
        parent = _xxh3(pack(*tokens[:block_size]))
        append(parent)
        first = 1
    for a in range(first * block_size, upto * block_size, block_size):
        parent = _xxh3(pack_chained(parent, *tokens[a : a + block_size]))
        append(parent)


def chain_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """Hashes of every full block of ``tokens`` (a trailing partial block has none)."""
    out: list[int] = []
    extend_hashes(out, tokens, len(tokens) // block_size, block_size)
    return out


class BlockPool:
    """``num_blocks`` KV blocks with prefix caching, ref counts and an LRU free list."""

    __slots__ = ("num_blocks", "block_size", "refs", "free", "empty")

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.refs: dict[int, int] = {}
        """hash -> number of holders, for every cached block (0: in the free list)."""
        self.free: OrderedDict[int, None] = OrderedDict()
        """Cached blocks nobody holds, least recently used first (evicted first)."""
        self.empty = num_blocks
        """Physical blocks holding nothing."""

    # -- queries ---------------------------------------------------------------------------
    @property
    def cached(self) -> int:
        """Blocks with a hash (what consumers of the event stream see as stored)."""
        return len(self.refs)

    @property
    def used(self) -> int:
        """Blocks held by requests (cached with holders, or being filled)."""
        return self.num_blocks - self.empty - len(self.free)

    @property
    def available(self) -> int:
        """Blocks an allocation could get (empty + evictable)."""
        return self.empty + len(self.free)

    def match(self, hashes: Sequence[int], limit: int | None = None) -> int:
        """Length of the longest cached prefix of ``hashes`` (at most ``limit`` blocks)."""
        refs = self.refs
        n = len(hashes) if limit is None else min(limit, len(hashes))
        m = 0
        while m < n and hashes[m] in refs:
            m += 1
        return m

    def match_sorted(self, hashes: Sequence[int], limit: int | None = None) -> int:
        """:meth:`match` by bisection; valid because the cached set is prefix-closed."""
        refs = self.refs
        lo, hi = 0, len(hashes) if limit is None else min(limit, len(hashes))
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            if hashes[mid - 1] in refs:
                lo = mid
            else:
                hi = mid - 1
        return lo

    # -- mutations -------------------------------------------------------------------------
    def touch(self, hashes: Sequence[int]) -> None:
        """Take a reference on cached blocks (a prefix hit); free ones leave the free list."""
        refs, free = self.refs, self.free
        for h in hashes:
            r = refs[h]
            if r == 0:
                del free[h]
            refs[h] = r + 1

    def allocate(self, n: int, removed: list[int]) -> bool:
        """Take ``n`` blocks to fill, evicting LRU free cached blocks (their hashes are appended
        to ``removed``) once no empty block is left. All or nothing: False if it cannot."""
        empty = self.empty
        if n <= empty:
            self.empty = empty - n
            return True
        free = self.free
        if n > empty + len(free):
            return False
        self.empty = 0
        refs = self.refs
        popitem = free.popitem
        for _ in range(n - empty):
            h = popitem(last=False)[0]
            del refs[h]
            removed.append(h)
        return True

    def commit(self, h: int) -> bool:
        """A block being filled became full with hash ``h``. True when it is newly cached (to be
        published); False when ``h`` was already cached (the block is shared, the copy freed)."""
        refs = self.refs
        r = refs.get(h)
        if r is None:
            refs[h] = 1
            return True
        if r == 0:
            del self.free[h]
        refs[h] = r + 1
        self.empty += 1
        return False

    def release(self, hashes: Sequence[int], unfilled: int = 0) -> None:
        """Drop one reference on each of ``hashes`` (a request's chain, root first) and give back
        ``unfilled`` blocks that never filled. Blocks whose count drops to zero join the free
        list tail first, so the tail of a chain is evicted before its parents."""
        refs, free = self.refs, self.free
        for h in reversed(hashes):
            r = refs[h] - 1
            refs[h] = r
            if r == 0:
                free[h] = None
        self.empty += unfilled

    def clear(self) -> list[int]:
        """Drop every unheld cached block (e.g. a cache reset); returns the removed hashes."""
        removed = list(self.free)
        for h in removed:
            del self.refs[h]
        self.empty += len(removed)
        self.free.clear()
        return removed
