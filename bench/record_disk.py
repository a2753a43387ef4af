"""Benchmark the recording write path: bytes on disk vs raw msgpack, and rows/s.

    .venv/bin/python bench/record_disk.py [--events 200000] [--level 6] [--raw-frames auto]
                                          [--sweep] [--columns]
    .venv/bin/python bench/record_disk.py --tokens random [--batches 50000]

Workload: a vLLM-like engine with prefix caching. Requests are a shared system prompt + a
shared document + a fresh user turn (Zipf-distributed token ids over a 128k vocabulary),
hashed into 16-token blocks chained by parent hash (random-looking 64-bit hashes, as vLLM's
sha256-derived ones). Prefill stores the missing blocks in events of 1-8 blocks, decode
stores one block per 16 generated tokens, an LRU evicts with BlockRemoved events; events are
published in batches of 4-16 as vLLM map-form msgpack (what vLLM >= 0.24 sends), decoded by
kvctl's own decoder and handed to ``RecordingWriter`` exactly as ``kvctl record`` will.

``--tokens random`` records instead the stream of the throughput benchmarks
(``bench/_stream.py``: uniformly random token ids and hashes, incompressible; its entropy floor
is ~0.42 of the msgpack bytes).

Reported: bytes on disk / raw payload bytes (issue targets <= 0.30 Zipf, <= 0.44 random tokens),
with ``--columns`` the bytes of each column (from the file's Parquet metadata), and rows/s of the
writer
(write + raw journal + the converter process re-decoding to Parquet, until close returns) vs a
bare loop that only builds ``pa.RecordBatch``es of the core columns from the same events.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import random
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvctl.events import Batch  # noqa: E402
from kvctl.formats import decode_zmq  # noqa: E402
from kvctl.formats import engine_zmq as ez  # noqa: E402

BLOCK = 16
VOCAB = 128_000


class Workload:
    def __init__(self, seed: int = 7) -> None:
        self.rnd = random.Random(seed)
        weights = [1.0 / (r + 10) ** 1.1 for r in range(VOCAB)]  # Zipf-like token frequencies
        self.cum = list(itertools.accumulate(weights))
        self.perm = list(range(VOCAB))
        self.rnd.shuffle(self.perm)  # frequent tokens are not the small ids
        self.system = [self.tokens(self.rnd.randint(64, 512)) for _ in range(16)]
        self.docs = [self.tokens(self.rnd.randint(256, 2048)) for _ in range(400)]
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.capacity = 30_000  # blocks in the GPU cache

    def tokens(self, n: int) -> list[int]:
        total = self.cum[-1]
        rnd, cum, perm = self.rnd.random, self.cum, self.perm
        return [perm[bisect.bisect_left(cum, rnd() * total)] for _ in range(n)]

    def request_events(self) -> list[dict]:
        rnd = self.rnd
        doc = rnd.choice(self.docs)
        cut = rnd.randint(0, len(doc))
        prompt = rnd.choice(self.system) + doc[:cut] + self.tokens(rnd.randint(8, 200))
        out: list[dict] = []
        parent = None
        new: list[tuple[int, int | None, list[int]]] = []
        for i in range(len(prompt) // BLOCK):
            toks = prompt[i * BLOCK : (i + 1) * BLOCK]
            h = xxhash.xxh3_64_intdigest(repr((parent, toks)).encode())
            if h in self.cache:
                self.cache.move_to_end(h)
            else:
                new.append((h, parent, toks))
            parent = h
        # prefill: the missing blocks, stored in events of 1-8 chained blocks
        while new:
            k = rnd.randint(1, 8)
            chunk, new = new[:k], new[k:]
            out.append(self.stored(chunk))
        # decode: one block per 16 generated tokens
        tail = prompt[len(prompt) // BLOCK * BLOCK :]
        for _ in range(rnd.randint(0, 16)):
            toks = (tail + self.tokens(BLOCK))[:BLOCK]
            tail = []
            h = xxhash.xxh3_64_intdigest(repr((parent, toks)).encode())
            out.append(self.stored([(h, parent, toks)]))
            parent = h
        # evictions
        evicted = []
        while len(self.cache) > self.capacity:
            evicted.append(self.cache.popitem(last=False)[0])
        while evicted:
            k = rnd.randint(1, 8)
            out.append({"type": "BlockRemoved", "block_hashes": evicted[:k], "medium": "GPU"})
            evicted = evicted[k:]
        return out

    def stored(self, chunk: list[tuple[int, int | None, list[int]]]) -> dict:
        for h, _, _ in chunk:
            self.cache[h] = None
        return {
            "type": "BlockStored",
            "block_hashes": [h for h, _, _ in chunk],
            "parent_block_hash": chunk[0][1],
            "token_ids": [t for _, _, toks in chunk for t in toks],
            "block_size": BLOCK,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
        }

    def frames(self, n_events: int) -> list[list[bytes]]:
        events: list[dict] = []
        while len(events) < n_events:
            events.extend(self.request_events())
        del events[n_events:]
        out, i, seq, ts = [], 0, 0, 1_760_000_000.0
        while i < len(events):
            k = self.rnd.randint(4, 16)
            payload = ez.encode_payload(events[i : i + k], ts, 0, "vllm")
            out.append(ez.encode_frames(b"kv@pod-0@llama-3-8b", seq, payload))
            i, seq, ts = i + k, seq + 1, ts + self.rnd.random() * 0.02
        return out


def random_token_frames(batches: int) -> list[list[bytes]]:
    """The throughput benchmarks' stream, framed as their publisher sends it."""
    from _stream import realistic_payloads

    return [[b"", seq.to_bytes(8, "big"), p] for seq, p in enumerate(realistic_payloads(batches))]


def column_bytes(path: Path) -> dict[str, int]:
    """Compressed bytes of each column over all row groups (nested columns by leaf path)."""
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path).metadata
    sizes: dict[str, int] = {}
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        for c in range(group.num_columns):
            column = group.column(c)
            sizes[column.path_in_schema] = (
                sizes.get(column.path_in_schema, 0) + column.total_compressed_size
            )
    return sizes


def bare_loop(batches: list[Batch], chunk: int = 16 * 1024) -> float:
    """Seconds to turn the events into core-column RecordBatches, nothing else."""
    import pyarrow as pa

    t0 = time.perf_counter()
    cols: dict[str, list] = {
        k: []
        for k in ("recv_ns", "type", "block_hashes", "parent_block_hash", "token_ids", "block_size")
    }
    types = {
        "recv_ns": pa.int64(),
        "type": pa.string(),
        "block_hashes": pa.list_(pa.uint64()),
        "parent_block_hash": pa.uint64(),
        "token_ids": pa.list_(pa.uint32()),
        "block_size": pa.int32(),
    }

    def emit() -> None:
        pa.RecordBatch.from_arrays(
            [pa.array(v, type=types[k]) for k, v in cols.items()], names=list(cols)
        )
        for v in cols.values():
            v.clear()

    for b in batches:
        for ev in b.events:
            cols["recv_ns"].append(b.recv_ns)
            cols["type"].append(ev["type"])
            cols["block_hashes"].append(ev.get("block_hashes"))
            cols["parent_block_hash"].append(ev.get("parent_block_hash"))
            cols["token_ids"].append(ev.get("token_ids"))
            cols["block_size"].append(ev.get("block_size"))
        if len(cols["type"]) >= chunk:
            emit()
    emit()
    return time.perf_counter() - t0


def run(
    batches: list[Batch], raw: int, level: int, raw_frames: str, out: Path, background: bool = True
) -> dict:
    from kvctl.recording.writer import RecordingWriter

    rows = sum(max(1, len(b.events)) for b in batches)
    t0 = time.perf_counter()
    w = RecordingWriter(
        out,
        compression_level=level,
        raw_frames=raw_frames,
        background=background,
        metadata={"bench": True},
        labels={"tcp://127.0.0.1:5557": (None, None)},
    )
    w.converter_ready()
    for b in batches:
        w.write_message(b)  # as `kvctl record` does: raw journal, converter subprocess
    write_s = time.perf_counter() - t0
    summary = w.close()
    total_s = time.perf_counter() - t0
    return {
        "columns": column_bytes(out),
        "level": level,
        "raw_frames": raw_frames,
        "bytes": summary["bytes"],
        "ratio": summary["bytes"] / raw,
        "rows": rows,
        "write_s": write_s,
        "total_s": total_s,
        "rows_per_s": rows / total_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="zipf", choices=["zipf", "random"], help="workload")
    ap.add_argument("--events", type=int, default=200_000, help="events of the Zipf workload")
    ap.add_argument("--batches", type=int, default=50_000, help="batches of the random one")
    ap.add_argument("--level", type=int, default=None, help="zstd level (default: kvctl's)")
    ap.add_argument("--raw-frames", default="auto", choices=["auto", "always"])
    ap.add_argument("--sweep", action="store_true", help="try zstd levels and raw_frames modes")
    ap.add_argument("--columns", action="store_true", help="bytes of each column")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from kvctl.recording.convert import DEFAULT_ZSTD_LEVEL

    t0 = time.perf_counter()
    if args.tokens == "zipf":
        frames = Workload().frames(args.events)
    else:
        frames = random_token_frames(args.batches)
    gen_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    batches = [
        decode_zmq(f, "tcp://127.0.0.1:5557", recv_ns=1_760_000_000_000_000_000 + i)
        for i, f in enumerate(frames)
    ]
    decode_s = time.perf_counter() - t0
    payload = sum(len(f[2]) for f in frames)
    all_frames = sum(len(x) for f in frames for x in f)
    events = sum(len(b.events) for b in batches)
    bare_s = bare_loop(batches)
    print(
        f"workload: {events} events in {len(batches)} batches, "
        f"{payload / events:.0f} B/event msgpack ({args.tokens} tokens), "
        f"generated in {gen_s:.1f}s, "
        f"decoded in {decode_s:.2f}s ({events / decode_s:,.0f} ev/s)",
        file=sys.stderr,
    )
    configs = [(args.level or DEFAULT_ZSTD_LEVEL, args.raw_frames)]
    if args.sweep:
        configs = [(lv, rf) for rf in ("auto", "always") for lv in (1, 3, 6, 9, 12)]
    results = []
    with tempfile.TemporaryDirectory(prefix="kvctl-bench-") as tmp:
        for i, (level, rf) in enumerate(configs):
            r = run(batches, payload, level, rf, Path(tmp) / f"run{i}.parquet")
            r["bare_rows_per_s"] = events / bare_s
            r["vs_bare"] = r["rows_per_s"] / r["bare_rows_per_s"]
            results.append(r)
    out = {
        "events": events,
        "batches": len(batches),
        "payload_bytes": payload,
        "frame_bytes": all_frames,
        "results": results,
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"raw msgpack payload: {payload:,} B ({all_frames:,} B with topic/seq frames)")
    print(f"bare RecordBatch loop: {events / bare_s:,.0f} rows/s")
    print(
        f"{'zstd':>4} {'frames':>6} {'on disk':>12} {'disk/raw':>8} {'rows/s':>10} "
        f"{'vs bare':>7} {'write()':>7}"
    )
    for r in results:
        print(
            f"{r['level']:>4} {r['raw_frames']:>6} {r['bytes']:>12,} {r['ratio']:>8.3f} "
            f"{r['rows_per_s']:>10,.0f} {r['vs_bare']:>7.2f} {r['write_s']:>6.2f}s"
        )
        if args.columns:
            for name, size in sorted(r["columns"].items(), key=lambda kv: -kv[1]):
                print(f"     {name:32} {size:>12,} {size / r['bytes']:>6.1%}")


if __name__ == "__main__":
    main()
