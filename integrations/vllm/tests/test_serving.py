"""The server under a ragged load with ddtree: concurrent streaming clients of different lengths
arriving at different times, clients that disconnect mid-stream, max_tokens reached inside an
accepted path, stop strings. The server keeps serving, streamed tokens equal the non-streamed
ones, and afterwards every KV block / state slot is free again (vLLM's kv_cache_usage_perc
returns to its idle value, no request left running)."""
from __future__ import annotations

import http.client
import json
import random
import threading
import time

import pytest
from conftest import Server, complete, ddtree_config, held_out_prompts

PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):\n",
           "for i in range(10):\n", "def read_file(path):\n    with open(path) as f:\n",
           "# parse the arguments\n", "if __name__ == '__main__':\n", "def merge(a, b):\n"]


def stream(url: str, body: dict, stop_after=None):
    """Streams one completion; returns (token ids, finish_reason). stop_after=k: the client closes
    the connection after k chunks (a disconnect mid-stream)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True,
                                                         "return_token_ids": True}),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200, response.read()
    tokens, finish, chunks = [], None, 0
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        choice = json.loads(line[6:])["choices"][0]
        tokens += choice.get("token_ids") or []
        finish = choice.get("finish_reason") or finish
        chunks += 1
        if stop_after is not None and chunks >= stop_after:
            conn.close()
            return tokens, "disconnected"
    conn.close()
    return tokens, finish


def wait_idle(server: Server, timeout: float = 60.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        running = server.metric("vllm:num_requests_running")
        waiting = server.metric("vllm:num_requests_waiting")
        usage = server.metric("vllm:kv_cache_usage_perc")
        if running == 0 and waiting == 0 and usage == 0.0:
            return usage
        time.sleep(0.5)
    raise AssertionError(f"not idle after {timeout} s: running {running}, waiting {waiting}, "
                         f"kv_cache_usage_perc {usage}")


@pytest.mark.parametrize("pair", ["embedded", "dense"])
def test_ragged_streaming_load_frees_every_block(embedded_pair, dense_pair, pair, tmp_path):
    # embedded: the hybrid pair as shipped (bf16, "auto" trees, text prompts and stop strings);
    # dense: fp32 trees of up to 64 nodes (token-id prompts, stop token ids)
    target, drafter = embedded_pair if pair == "embedded" else dense_pair
    prompts = PROMPTS if pair == "embedded" else held_out_prompts(8, seed=3)
    args = (["--dtype", "bfloat16", "--no-enable-prefix-caching"] if pair == "embedded"
            else ["--dtype", "float32"])
    rng = random.Random(0)
    with Server(target, *args, "--max-num-seqs", "16", "--speculative-config",
                ddtree_config(drafter, budget="auto" if pair == "embedded" else 64),
                log=tmp_path / "serve.log") as server:
        model = target.as_posix()
        idle_before = server.metric("vllm:kv_cache_usage_perc")
        jobs, results = [], {}
        for i in range(40):
            kind = ("plain", "disconnect", "short", "stop")[i % 4]
            body = {"model": model, "prompt": rng.choice(prompts), "temperature": 0.0,
                    "max_tokens": rng.randrange(8, 96), "ignore_eos": True}
            if kind == "short":
                body["max_tokens"] = rng.randrange(1, 4)   # ends inside an accepted path
            if kind == "stop" and pair == "embedded":
                body.update(stop=["\n\n", "return"], ignore_eos=False, max_tokens=96)
            elif kind == "stop":
                body.update(stop_token_ids=[rng.randrange(2, 64)], max_tokens=96)
            jobs.append((i, kind, body, rng.uniform(0.0, 6.0)))

        def client(i, kind, body, delay):
            time.sleep(delay)
            try:
                results[i] = stream(server.url, body,
                                    stop_after=rng.randrange(1, 4) if kind == "disconnect" else None)
            except Exception as e:   # recorded, asserted below
                results[i] = e

        threads = [threading.Thread(target=client, args=job) for job in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        errors = {i: r for i, r in results.items() if isinstance(r, Exception)}
        assert not errors, errors
        for i, kind, body, _ in jobs:
            tokens, finish = results[i]
            if kind in ("plain", "short"):
                assert finish == "length" and len(tokens) == body["max_tokens"], (i, kind)
            if kind == "stop":
                assert finish in ("stop", "length"), (i, finish)
        idle_after = wait_idle(server)
        print(f"serving: kv_cache_usage_perc before {idle_before}, after {idle_after}; "
              f"{len(jobs)} clients ({sum(k == 'disconnect' for _, k, _, _ in jobs)} disconnected)")
        assert idle_after == idle_before == 0.0
        # still serving, and a streamed completion equals the non-streamed one
        body = {"model": model, "prompt": prompts[0], "temperature": 0.0, "max_tokens": 40,
                "ignore_eos": True}
        streamed, _ = stream(server.url, body)
        whole = complete(server.url, prompts[0], 40, model=model, ignore_eos=True)
        assert streamed == whole["token_ids"]
        if pair == "embedded":
            stopped = complete(server.url, prompts[0], 96, model=model, stop=["\n\n"])
            assert "\n\n" not in stopped["text"]
        wait_idle(server)


def test_ddtree_engines_reserve_the_drafters_query_rows(monkeypatch):
    # vLLM's scheduler charges every scheduled request num_new_tokens + max_num_new_slots_for_drafting
    # of max_num_batched_tokens; a ddtree drafter queries draft_len rows, not the tree budget
    from vllm.config.speculative import SpeculativeConfig

    from ddtree.integrations.vllm import hooks
    from ddtree.integrations.vllm.options import ENV, DDTreeOptions

    class DFlashConfig:   # the attributes vLLM's property reads
        num_speculative_tokens = 64
        parallel_drafting = False

        def use_dflash(self):
            return True

        def uses_draft_model(self):
            return False

    hooks.hook_drafting_slots()
    hooks.hook_drafting_slots()   # installed once, whatever the number of calls
    slots = SpeculativeConfig.max_num_new_slots_for_drafting.fget
    monkeypatch.delenv(ENV, raising=False)
    assert slots(DFlashConfig()) == 64   # vLLM's own dflash: K query rows
    monkeypatch.setenv(ENV, DDTreeOptions(budget="auto", max_budget=64, draft_len=15).to_json())
    assert slots(DFlashConfig()) == 15
