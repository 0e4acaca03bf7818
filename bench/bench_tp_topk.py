"""The draft top-k of a tensor-parallel round, two ways, same logits, same run (every rank):

  sharded : tree_topk_shard on this rank's V / S columns -> all-gather of (k + 1) int64 words per
            row -> tree_topk_merge                       (ddtree.parallel.VocabShard.tree_topk)
  gathered: all-gather of the V / S logits per row -> tree_topk on all V columns
            (what a "colwise_gather_output" LM head does before any top-k)

Checks that both give the same ids, then times them (medians) and reports the bytes each rank
receives per draft step. Run under torchrun (gloo on CPU, NCCL on GPUs):

  torchrun --standalone --nproc-per-node 2 bench/bench_tp_topk.py [--vocab 151936] [--k 64]
           [--batch 1] [--json FILE]
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import ddtree
from ddtree import parallel
from timing import write_result  # noqa: E402

L = 15


def median_time(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--k", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda" if cuda else "cpu")
    V, k = args.vocab, args.k
    size = -(-V // world)  # torch.chunk's split, as DTensor's Shard(0)
    offset = min(rank * size, V)
    width = min(V, offset + size) - offset
    g = torch.Generator().manual_seed(0)
    full = (torch.randn(args.batch, L, V, generator=g) * 4).to(device)  # same on every rank
    local = full[..., offset:offset + width].contiguous()
    group = dist.group.WORLD
    shard = parallel.VocabShard(torch.empty(width, 1, device=device), None, offset, V, group,
                                   world)

    def gathered():
        parts = [torch.empty(args.batch, L, min(V, j * size + size) - min(V, j * size),
                             device=device) for j in range(world)]
        dist.all_gather(parts, local)
        return ddtree.tree_topk(torch.cat(parts, -1), k)

    lp_s, ids_s = shard.tree_topk(local, k)
    lp_g, ids_g = gathered()
    assert torch.equal(ids_s, ids_g), "sharded and gathered top-k differ"
    t_sharded = median_time(lambda: shard.tree_topk(local, k), args.repeats)
    t_gathered = median_time(gathered, args.repeats)
    rows = args.batch * L
    row = dict(world=world, vocab=V, k=k, batch=args.batch, device=str(device),
               threads=torch.get_num_threads(), sharded_ms=1e3 * t_sharded,
               gathered_ms=1e3 * t_gathered, speedup=t_gathered / t_sharded,
               sharded_bytes_received=rows * (k + 1) * 8 * (world - 1),
               gathered_bytes_received=rows * 4 * (V - width),
               max_logprob_diff=float((lp_s - lp_g).abs().max()))
    if rank == 0:
        print(f"world {world}, V {V}, k {k}, B {args.batch}, L {L}, {device}, "
              f"{row['threads']} threads/rank")
        print(f"sharded : {row['sharded_ms']:.3f} ms, receives {row['sharded_bytes_received']} B")
        print(f"gathered: {row['gathered_ms']:.3f} ms, receives {row['gathered_bytes_received']} B")
        print(f"speed-up {row['speedup']:.2f}x; ids identical; max |logprob diff| "
              f"{row['max_logprob_diff']:.2e}")
        if args.json:
            write_result(args.json, row)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
