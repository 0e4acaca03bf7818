"""DDTree inside vLLM, measured through the OpenAI-compatible server: vLLM autoregressive, vLLM's
own `dflash` (chain), ddtree trees of 16 / 64 nodes and ddtree `auto`, at concurrency 1 / 4 / 16 /
32. One server per mode, all started first and left running; the measurements interleave the
modes (every round visits every concurrency and every mode in turn), so drift on the machine
falls on all modes alike; before every timed load it waits until the CPUs are idle. Prompts:
snippets of third-party Python (packages the embedded pair was not trained on: click, jinja2,
requests, rich, from the vLLM venv's site-packages), greedy, ignore_eos, `--tokens` each.
Reported: output tokens/s of the whole load (median over rounds) and
the mean inter-token latency seen by a streaming client ((last - first token time) / (tokens - 1)).

    make bench-vllm            (writes bench/results/vllm_serving_cpu.json and .png)
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "integrations" / "vllm" / "tests"))

from conftest import EMBEDDED, Server, ddtree_config  # noqa: E402
from timing import write_result  # noqa: E402

THIRD_PARTY = ("click", "jinja2", "requests", "rich")


def third_party_prompts(count: int, seed: int = 0, chars: int = 320):
    import importlib

    rng = random.Random(seed)
    files = []
    for name in THIRD_PARTY:
        root = Path(importlib.import_module(name).__file__).parent
        files += sorted(p for p in root.rglob("*.py") if p.stat().st_size > 4 * chars)
    prompts = []
    while len(prompts) < count:
        text = rng.choice(files).read_text(errors="replace")
        start = rng.randrange(0, len(text) - chars)
        start = text.rfind("\n", 0, start) + 1
        prompts.append(text[start:start + chars])
    return prompts


def stream_one(url: str, model: str, prompt: str, tokens: int):
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    count, first, last = 0, None, None
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ids = json.loads(line[6:])["choices"][0].get("token_ids") or []
        if ids:
            now = time.perf_counter()
            first = now if first is None else first
            last = now
            count += len(ids)
    conn.close()
    itl = (last - first) / (count - 1) if count > 1 else None
    return count, itl


def wait_idle(limit: float = 8.0, busy: float = 0.15, window: float = 0.25) -> float:
    """Until the machine's CPUs are idle (under `busy` for one window): a server that has just
    served a load keeps its cores busy for a moment, and the next mode's load would share them
    (the mode measured first in a round was up to 25% faster without this). Returns the wait."""
    def ticks():
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
        return values[3] + values[4], sum(values)   # idle + iowait, total
    start = time.perf_counter()
    try:
        idle0, total0 = ticks()
    except OSError:          # no /proc/stat (not Linux): no wait
        return 0.0
    while time.perf_counter() < start + limit:
        time.sleep(window)
        idle1, total1 = ticks()
        if total1 > total0 and 1.0 - (idle1 - idle0) / (total1 - total0) < busy:
            break
        idle0, total0 = idle1, total1
    return time.perf_counter() - start


def load(url: str, model: str, prompts, concurrency: int, tokens: int):
    waited = wait_idle()
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: stream_one(url, model, p, tokens), prompts))
    seconds = time.perf_counter() - start
    total = sum(c for c, _ in results)
    itls = [i for _, i in results if i is not None]
    return total / seconds, statistics.mean(itls) if itls else None, waited


def modes(drafter: Path, block: int):
    return {
        "autoregressive": [],
        "vllm dflash": ["--speculative-config", json.dumps(
            {"method": "dflash", "model": str(drafter), "num_speculative_tokens": block})],
        "ddtree 16": ["--speculative-config", ddtree_config(drafter, budget=16)],
        "ddtree 64": ["--speculative-config", ddtree_config(drafter, budget=64)],
        "ddtree auto": ["--speculative-config", ddtree_config(drafter, budget="auto")],
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, rows in result["modes"].items():
        cs = [r["concurrency"] for r in rows]
        a.plot(cs, [r["tokens_per_s"] for r in rows], marker="o", label=mode)
        b.plot(cs, [1000 * r["itl_s"] for r in rows], marker="o", label=mode)
    for ax, label in ((a, "output tokens/s"), (b, "inter-token latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    a.legend()
    fig.suptitle("vLLM CPU backend, embedded pair (bf16): " + result["machine"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--modes", nargs="+", default=None)
    p.add_argument("--out", default=str(HERE / "results" / "vllm_serving_cpu.json"))
    args = p.parse_args(argv)
    target, drafter = EMBEDDED / "target", EMBEDDED / "drafter"
    block = json.loads((drafter / "config.json").read_text())["block_size"] - 1
    chosen = {k: v for k, v in modes(drafter, block).items()
              if args.modes is None or k in args.modes}
    import tempfile

    logs = Path(tempfile.mkdtemp(prefix="bench-vllm-"))   # one server log per mode
    servers = {}
    try:
        print(f"server logs: {logs}", flush=True)
        for mode, extra in chosen.items():   # one at a time: start-up compiles and loads
            servers[mode] = Server(target, "--dtype", "bfloat16", "--no-enable-prefix-caching",
                                   "--max-num-seqs", str(max(args.concurrency)), *extra,
                                   log=logs / (mode.replace(" ", "_") + ".log")).wait_ready()
        prompts = third_party_prompts(2 * max(args.concurrency))
        model = target.as_posix()
        for server in servers.values():      # warm-up, untimed: "auto" fits its costs here
            load(server.url, model, prompts[:8], 4, 64)
        samples = {(m, c): [] for m in servers for c in args.concurrency}
        for r in range(args.rounds):
            for c in args.concurrency:
                batch = prompts[:max(8, 2 * c)]   # at least two waves of requests
                order = list(servers) if r % 2 == 0 else list(reversed(servers))
                for mode in order:
                    tps, itl, waited = load(servers[mode].url, model, batch, c, args.tokens)
                    samples[mode, c].append((tps, itl))
                    print(f"round {r} c={c:>2} {mode:<15} {tps:8.1f} tok/s  itl "
                          f"{1000 * itl:6.1f} ms  (waited {waited:.1f} s for idle CPUs)", flush=True)
    finally:
        for server in servers.values():
            server.stop()
    result = {"machine": f"{os.cpu_count()} CPU cores", "tokens": args.tokens,
              "rounds": args.rounds, "prompts": "third-party Python: " + ", ".join(THIRD_PARTY),
              "modes": {m: [{"concurrency": c,
                             "tokens_per_s": statistics.median(t for t, _ in samples[m, c]),
                             "itl_s": statistics.median(i for _, i in samples[m, c]),
                             "tokens_per_s_rounds": [t for t, _ in samples[m, c]]}
                            for c in args.concurrency] for m in servers}}
    write_result(args.out, result)
    plot(result, Path(args.out).with_suffix(".png"))
    print("| concurrency | " + " | ".join(servers) + " |")
    print("|---|" + "---|" * len(servers))
    for i, c in enumerate(args.concurrency):
        print(f"| {c} | " + " | ".join(f"{result['modes'][m][i]['tokens_per_s']:.0f}"
                                        for m in servers) + " |")


if __name__ == "__main__":
    main()
