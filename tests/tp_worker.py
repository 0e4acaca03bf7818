"""One rank of the tensor-parallel test job (tests/test_parallel_tensor_parallel.py starts it under torchrun
with 2 processes, gloo on CPU, DDTREE_TP_CHECK=1): loads the targets with tp_plan "auto", runs the
speculative loop, and writes what it saw to OUT/rank{R}.json for the test to judge.

  torchrun --standalone --nproc-per-node 2 tests/tp_worker.py OUT

OUT/dense, OUT/qwen3_5, OUT/qwen3_next hold the tiny targets saved by the test. References are the single-process
targets' greedy decodings (the same weights loaded without tp_plan, in this process)."""
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from ddtree import embedded, ops, parallel
from ddtree.ops import reference  # noqa: E402
from ddtree.generate import generate, generate_batch  # noqa: E402
from ddtree import budget as cost_aware  # noqa: E402
from ddtree.generate import calibrate  # noqa: E402
from helpers import BatchOracle, greedy_reference, ScriptedBudgets, tiny_drafter  # noqa: E402


class ShardedOracle(BatchOracle):
    """BatchOracle whose step returns only this rank's vocabulary columns, as a drafter sharing a
    sharded LM head does: the loop then takes the sharded top-k."""

    def begin(self, target, prompt_hidden_states, capacity, cuda_graph=False):
        self.shard = parallel.vocab_shard(target)
        return super().begin(target, prompt_hidden_states, capacity, cuda_graph)

    def step(self, bonus, depth=None):
        full = super().step(bonus, depth)
        return full[..., self.shard.offset: self.shard.offset + self.shard.local_size].contiguous()


merges = [0]
_merge = ops.tree_topk_merge


def counting_merge(parts):
    merges[0] += 1
    return _merge(parts)


ops.tree_topk_merge = counting_merge


def run(results, name, target, drafter, prompt, n, want, **kw):
    merges[0] = 0
    got = generate(target, drafter, torch.tensor([prompt]), n, **kw)
    results[name] = dict(tokens=got.tokens, reference=want, merges=merges[0], tau=got.tau)


def main(out):
    rank = dist.get_rank() if dist.is_initialized() else None
    results = {}
    # Dense: the tiny Qwen3 target, the (untrained) tiny DFlash drafter and a sharded oracle.
    tp = parallel.load_tensor_parallel(os.path.join(out, "dense"))
    rank = dist.get_rank()
    full = AutoModelForCausalLM.from_pretrained(os.path.join(out, "dense"), dtype=torch.float32).eval()
    shard = parallel.vocab_shard(tp)
    results["shard"] = dict(offset=shard.offset, local=shard.local_size, vocab=shard.vocab_size,
                            world=shard.world_size)
    prompt = [5, 17, 42]
    want = greedy_reference(full, torch.tensor([prompt]), 40)
    run(results, "dense-autoregressive", tp, None, prompt, 40, want, mode="autoregressive")
    for mode in ("tree", "chain"):
        run(results, f"dense-{mode}", tp, tiny_drafter(), prompt, 40, want, mode=mode, budget=16)
        run(results, f"dense-oracle-{mode}", tp, ShardedOracle([want], [3], seed=1), prompt, 40,
            want, mode=mode, budget=16)
    # budget="auto": autoregressive and drafted rounds of every size mixed (a scripted policy, the
    # same on every rank), and the real policy with one cost profile.
    run(results, "dense-auto-scripted", tp, tiny_drafter(), prompt, 40, want, budget="auto",
        policy=ScriptedBudgets([0, 8, 0, 0, 16, 64, 4, 32]))
    cheap = cost_aware.CostProfile(batch=1, round_ms={0: 10.0, 4: 10.5, 8: 11.0, 16: 11.5,
                                                      32: 12.0, 64: 13.0},
                                   target="t", drafter="d", device="cpu", dtype="float32",
                                   version="test")
    run(results, "dense-auto-policy", tp, tiny_drafter(), prompt, 40, want, budget="auto",
        cost_profile=cheap)
    # A cost profile cached on rank 0 only (each rank its own cache directory): every rank
    # measures (none waits alone on the others' collectives), and all use rank 0's measurement.
    cache_dir = os.environ.get("DDTREE_CACHE_DIR")
    os.environ["DDTREE_CACHE_DIR"] = os.path.join(out, f"cache{rank}")
    planted = cost_aware.CostProfile(batch=1, round_ms={b: 1000.0 + b for b in cost_aware.BUCKETS},
                                     **cost_aware.profile_identity(tp, tiny_drafter()))
    if rank == 0:
        cost_aware.save_profile(planted)
    measured = calibrate(tp, tiny_drafter(), 1, rounds=2, repeats=1, progress=False)
    results["calibrate-cached-on-one-rank"] = dict(
        planted={str(b): ms for b, ms in planted.round_ms.items()},
        round_ms={str(b): ms for b, ms in measured.round_ms.items()},
        cached_after=cost_aware.load_profile(tp, tiny_drafter(), 1) is not None)
    if cache_dir is None:
        del os.environ["DDTREE_CACHE_DIR"]
    else:
        os.environ["DDTREE_CACHE_DIR"] = cache_dir
    # Sampling (temperature > 0) walks the gathered logits: the same tokens on every rank.
    merges[0] = 0
    sampled = generate(tp, tiny_drafter(), torch.tensor([prompt]), 24, mode="tree", budget=8,
                       temperature=0.8, top_p=0.9, seed=5)
    results["dense-sampled"] = dict(tokens=sampled.tokens, merges=merges[0])
    # A batch of prompts of different lengths.
    prompts = [[5, 17, 42], [9, 8, 7, 6, 5, 4, 3, 2, 1, 33, 44]]
    merges[0] = 0
    batch = generate_batch(tp, tiny_drafter(), prompts, 24, mode="tree", budget=8)
    results["dense-batch"] = dict(tokens=[r.tokens for r in batch], merges=merges[0],
                                  reference=[greedy_reference(full, torch.tensor([p]), 24)
                                             for p in prompts])

    # Tiny random hybrids (Gated DeltaNet layers; Qwen3-Next with its fused projections and MoE
    # MLPs) with the sharded oracle: deep acceptances, recurrent states committed along them.
    for kind in ("qwen3_5", "qwen3_next"):
        tp_kind = parallel.load_tensor_parallel(os.path.join(out, kind))
        full_kind = AutoModelForCausalLM.from_pretrained(os.path.join(out, kind),
                                                         dtype=torch.float32).eval()
        want = greedy_reference(full_kind, torch.tensor([prompt]), 40)
        for mode in ("tree", "chain"):
            run(results, f"hybrid-{kind}-oracle-{mode}", tp_kind, ShardedOracle([want], [3], seed=2),
                prompt, 40, want, mode=mode, budget=16)

    # Hybrid: the embedded pair (trained Qwen3.5-text target with Gated DeltaNet layers + its
    # DFlash drafter), tied embeddings sharded with the LM head.
    tp_hybrid = parallel.load_tensor_parallel(str(embedded.target_dir()))
    target, drafter, tokenizer = embedded.load()
    for i, text in enumerate(embedded.heldout_prompts(2)):
        ids = tokenizer(text, return_tensors="pt").input_ids
        want = generate(target, None, ids, 40, mode="autoregressive").tokens
        hf_greedy = greedy_reference(target, ids, 40)
        for mode in ("tree", "chain"):
            run(results, f"hybrid-{i}-{mode}", tp_hybrid, drafter, ids[0].tolist(), 40, want,
                mode=mode, budget=32)
            results[f"hybrid-{i}-{mode}"]["hf_greedy"] = hf_greedy

    # The sharded top-k over the embedded target's LM head shards, through the real all-gather,
    # against tree_topk's reference on the whole vocabulary (same random logits on every rank).
    hshard = parallel.vocab_shard(tp_hybrid)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 15, hshard.vocab_size, generator=g) * 4
    logits[0, 0, :] = 1.0  # all ties: ids decide across the shard border
    topk = {}
    for k in (1, 16, 64):
        local = logits[..., hshard.offset: hshard.offset + hshard.local_size].contiguous()
        lp, ids = hshard.tree_topk(local, k)
        ref_lp, ref_ids = reference.tree_topk(logits, k)
        topk[k] = dict(ids_equal=bool(torch.equal(ids, ref_ids)),
                       max_lp_err=float((lp - ref_lp).abs().max()))
    results["sharded-topk"] = topk

    # The debug check raises when the ranks disagree (a tensor that differs by rank).
    check = parallel.RankCheck(parallel.tensor_parallel_group(tp))
    try:
        check(tokens=torch.tensor([rank]))
        results["rank-check-raised"] = ""
    except RuntimeError as e:
        results["rank-check-raised"] = str(e)

    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
