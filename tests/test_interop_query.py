"""kvctl query against NVIDIA Dynamo's own standalone indexer (the `interop` extra), fed by
real vLLM-format ZMQ publishers: the tiers Dynamo reports, and each policy's decision on them.
Skipped, with the reason printed, only where ai-dynamo-runtime cannot be installed."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
from conftest import Engine, free_port, start_dynamo_indexer, stored
from inprocess import run_main
from test_cmd_query import one_line_error, tiny_tokenizer

import kvctl.cli

pytest.importorskip("dynamo.llm", reason="ai-dynamo-runtime is not installable on this platform")

BLOCK = 4
PROMPT = list(range(1, 21))  # 5 blocks of 4


@pytest.fixture(autouse=True)
def query_is_a_command(monkeypatch):
    summary = kvctl.cli.COMMANDS.get("query", "Ask a prefix index.")
    monkeypatch.setitem(kvctl.cli.COMMANDS, "query", summary)


def blocks(hashes, parent, first, medium="GPU"):
    """BlockStored of the prompt's blocks from index ``first``; engine hashes follow the
    content, as engines publish them (the same block has the same hash on every worker)."""
    start = first * BLOCK
    return {
        **stored(hashes, parent, BLOCK),
        "token_ids": PROMPT[start : start + BLOCK * len(hashes)],
        "medium": medium,
    }


def post_query(url: str, token_ids: list[int]) -> dict:
    body = json.dumps({"token_ids": token_ids, "model_name": "default"}).encode()
    request = urllib.request.Request(f"{url}/query", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def index_url():
    """Dynamo's indexer over three workers: 1 holds the prompt's first 2 blocks on GPU and the
    next 2 in CPU memory, 2 holds the first 3 on GPU, 3 holds nothing."""
    ports = [free_port() for _ in range(3)]
    engines = [Engine(f"tcp://127.0.0.1:{port}") for port in ports]
    workers = [f"{i + 1}=tcp://127.0.0.1:{port}" for i, port in enumerate(ports)]
    indexer, url = start_dynamo_indexer(workers, BLOCK)
    try:
        for engine in engines:
            engine.wait_for(1, timeout=60)
        engines[0].send([blocks([11, 12], None, 0), blocks([13, 14], 12, 2, "CPU")])
        engines[1].send([blocks([11, 12, 13], None, 0)])
        expected = {
            "1": {"longest_matched": 16, "gpu": 8, "dp": {"0": 8}, "cpu": 16, "disk": 16},
            "2": {"longest_matched": 12, "gpu": 12, "dp": {"0": 12}, "cpu": 12, "disk": 12},
        }
        deadline = time.monotonic() + 30
        seen: dict = {}
        while seen != expected:  # the indexer applies events asynchronously: poll, bounded
            assert time.monotonic() < deadline, f"Dynamo's indexer answered {seen}"
            try:
                seen = post_query(url, PROMPT)["instances"]
            except OSError:
                seen = {}
            time.sleep(0.1)
        yield url
    finally:
        indexer.terminate()
        indexer.wait(10)
        for engine in engines:
            engine.close()


def query(index_url: str, *args: str):
    result = run_main("query", "--index", index_url, *args)
    assert result.code == 0, result
    return result


def tokens(ids: list[int]) -> str:
    return ",".join(map(str, ids))


def test_each_policy_explained_on_dynamo_s_tiers(index_url):
    out = query(index_url, "--tokens", tokens(PROMPT), "--explain").out
    assert "20 tokens, 5 blocks of 4 (model default)" in out
    assert "load: zero on every worker" in out
    # worker 1: 2 GPU + 2 CPU blocks, 16 tokens; worker 2: 3 GPU blocks; worker 3: nothing
    rows = [line.replace("│", " ").split() for line in out.splitlines() if line[:1] == "│"]
    assert rows == [
        ["1:0", "2", "2", "0", "16", "6.5*", "4*", "1*"],
        ["2:0", "3", "0", "0", "12", "7", "3", "0"],
        ["3:0", "0", "0", "0", "0", "10", "0", "0"],
    ]
    assert "dynamo: 1:0 (cost 6.5; next best 7)" in out
    assert "longest-prefix: 1:0 (score 4; next best 3)" in out
    assert "llm-d: 1:0 (score 1; next best 0)" in out
    # the formula with worker 1's numbers: CPU blocks credited at 0.75
    assert (
        "1:0: 1 x max(0, (0 + 20) / 4 - (1 x 1 x 2 + 0.75 x 2 + 0.25 x 0)) + (0 + 5) + 0 x 0 "
        "= 1.5 + 5 + 0 = 6.5"
    ) in out
    assert "1:0: 1 x 2 + 0.8 x 2 + 0.3 x 0 = 3.6; normalised (3.6 - 3) / (3.6 - 3) = 1" in out


def test_load_turns_dynamo_away_from_the_longest_prefix(index_url):
    result = query(index_url, "--tokens", tokens(PROMPT), "--decode-blocks", "1=1", "--json")
    answer = json.loads(result.out)
    assert answer["load"] == "given" and answer["block_size"] == BLOCK
    chosen = {p["policy"]: p["chosen"] for p in answer["policies"]}
    assert chosen == {
        "dynamo": [{"worker_id": 2, "dp_rank": 0}],  # 7 < 6.5 + 1
        "longest-prefix": [{"worker_id": 1, "dp_rank": 0}],
        "llm-d": [{"worker_id": 1, "dp_rank": 0}],
    }
    first = answer["workers"][0]
    assert first["blocks_by_tier"] == {"gpu": 2, "cpu": 2, "disk": 0}
    assert first["load"] == {
        "active_prefill_tokens": 0,
        "active_decode_blocks": 1,
        "active_requests": 0,
    }


def test_a_tie_is_shown_as_a_tie(index_url):
    out = query(index_url, "--tokens", tokens(PROMPT[:8]), "--policy", "dynamo").out
    assert "dynamo: tie between 1:0, 2:0 (cost 2 each): Dynamo picks one of them at random" in out
    answer = json.loads(query(index_url, "--tokens", tokens(PROMPT[:8]), "--json").out)
    for policy in answer["policies"]:
        assert policy["tie"] and [c["worker_id"] for c in policy["chosen"]] == [1, 2]
        assert [s["probability"] for s in policy["scores"]] == [0.5, 0.5, 0.0]


def test_tokens_from_a_file_or_text_ask_the_same(index_url, tmp_path):
    expected = json.loads(query(index_url, "--tokens", tokens(PROMPT), "--json").out)
    listed = tmp_path / "prompt.json"
    listed.write_text(json.dumps(PROMPT))
    assert json.loads(query(index_url, "--tokens-file", str(listed), "--json").out) == expected
    path = tiny_tokenizer(tmp_path / "tokenizer.json")  # word wN is token N + 1
    text = " ".join(f"w{token - 1}" for token in PROMPT)
    args = ("--text", text, "--tokenizer", str(path), "--json")
    assert json.loads(query(index_url, *args).out) == expected


def test_an_unknown_model_is_the_index_s_own_words_and_exit_1(index_url):
    result = run_main("query", "--index", index_url, "--tokens", "1,2", "--model-name", "other")
    one_line_error(result, 1, "/query: HTTP 404", "no indexer for model=other")


def test_a_lora_prompt_does_not_match_blocks_stored_without_it(index_url):
    args = ("--tokens", tokens(PROMPT), "--lora-name", "x", "--json")
    answer = json.loads(query(index_url, *args).out)
    assert answer["lora_name"] == "x"
    assert [w["matched_blocks"] for w in answer["workers"]] == [0, 0, 0]
