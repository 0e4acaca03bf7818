"""An LM head's inference product on the CPU (fp32): nn.Linear (one BLAS call per product) against models.PackedLinear (a oneDNN copy of the weight packed once),
at the row counts a round brings — 1 (an autoregressive step), a tree's rows (tree 16: 17), a
drafter block's (15), a batch's. The two alternate call by call on the same inputs (the
machine's drift hits both alike); medians of each one's calls, and the largest |difference|.

  python bench/bench_lm_head.py [--shapes 256x4096 1024x32000] [--rows 1 2 4 8 15 17 32 64]
                                [--calls 200] [--json F]

256x4096 is the embedded pair's head (hidden 256, vocabulary 4096); 1024x32000 a larger one
(128 MB in fp32). Any linear's weight the same way (--shapes IN x OUT: the embedded pair's
projections are 256x768 and 768x256, bench/results/packed_linears_cpu.json).
"""
import argparse
import json
import platform
import statistics
import time

import torch

from ddtree import models
from timing import write_result  # noqa: E402


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(hidden: int, vocab: int, rows: int, calls: int) -> dict:
    torch.manual_seed(0)
    plain = torch.nn.Linear(hidden, vocab, bias=False)
    packed = models.PackedLinear(hidden, vocab, bias=False)
    packed.weight = plain.weight  # the same parameter
    x = torch.randn(rows, hidden)
    times = {"linear": [], "packed": []}
    with torch.no_grad():
        diff = (plain(x) - packed(x)).abs().max().item()
        for i in range(calls + 10):  # the first 10 pairs warm up
            order = (("linear", plain), ("packed", packed)) if i % 2 == 0 else \
                (("packed", packed), ("linear", plain))
            for name, module in order:
                seconds = timed(lambda: module(x))
                if i >= 10:
                    times[name].append(seconds)
    linear_ms, packed_ms = (1e3 * statistics.median(times[k]) for k in ("linear", "packed"))
    return dict(hidden=hidden, vocab=vocab, rows=rows, linear_ms=linear_ms, packed_ms=packed_ms,
                linear_over_packed=linear_ms / packed_ms, max_abs_difference=diff)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", default=["256x4096", "1024x32000"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 15, 17, 32, 64])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.backends.mkldnn.is_available():
        raise SystemExit("bench_lm_head: this torch has no oneDNN (PackedLinear would not pack)")
    results = []
    for shape in args.shapes:
        hidden, vocab = (int(v) for v in shape.split("x"))
        calls = args.calls if hidden * vocab <= 4 << 20 else max(20, args.calls // 10)
        for rows in args.rows:
            r = measure(hidden, vocab, rows, calls)
            results.append(r)
            print(f"{hidden}x{vocab}, {rows:3d} rows: linear {r['linear_ms']:.3f} ms, packed "
                  f"{r['packed_ms']:.3f} ms, {r['linear_over_packed']:.2f}x, max |diff| "
                  f"{r['max_abs_difference']:.1e}", flush=True)
    if args.json:
        write_result(args.json, dict(torch=torch.__version__, threads=torch.get_num_threads(),
                       machine=platform.machine(), results=results))


if __name__ == "__main__":
    main()
