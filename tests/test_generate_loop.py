"""The speculative loop: lossless at temperature 0 (fp32, CPU) against the target's own greedy
decoding, for tree / chain / autoregressive modes, with random and with 'oracle' drafters (long
acceptances, deep commits); stop tokens inside accepted paths; the DFlash checkpoint format; bad
input."""
import json
import math
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402

import ddtree  # noqa: E402
from ddtree.generate import generate  # noqa: E402
from ddtree.models import DFlashDrafter, dflash_config  # noqa: E402
from helpers import (  # noqa: E402
    HIDDEN, LAYERS, PROMPTS, VOCAB, BatchOracle, OracleDrafter, ScriptedBudgets, greedy_reference,
    propose, tiny_drafter, tiny_drafter_of, tiny_hybrid, tiny_target)

@pytest.mark.parametrize("kind", ["qwen3", "llama"])
@pytest.mark.parametrize("mode", ["tree", "chain", "autoregressive"])
def test_lossless_with_the_dflash_drafter(kind, mode):
    target = tiny_target(kind)
    drafter = tiny_drafter()
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        for n in (1, 2, 9, 24):
            expected = greedy_reference(target, ids, n)
            got = generate(target, drafter, ids, n, mode=mode, budget=16)
            assert got.tokens == expected, (prompt, n)


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
@pytest.mark.parametrize("budget", [8, 32])
def test_lossless_with_long_acceptances(kind, budget):
    target = tiny_target(kind, seed=3)
    for p, prompt in enumerate(PROMPTS):
        ids = torch.tensor([prompt])
        truth = greedy_reference(target, ids, 60)
        drafter = OracleDrafter(truth, len(prompt), seed=p)
        got = generate(target, drafter, ids, 60, mode="tree", budget=budget)
        assert got.tokens == truth
        assert got.tau > 2.5, got.acceptance_lengths  # deep paths were accepted and committed
        chain = generate(target, OracleDrafter(truth, len(prompt), seed=p), ids, 60, mode="chain")
        assert chain.tokens == truth


@pytest.mark.parametrize("hybrid", [False, True], ids=["dense", "hybrid"])
def test_lossless_when_the_drafter_drafts_only_as_deep_as_the_tree(hybrid):
    """A tree of n nodes is at most n deep: with a budget below the drafter's depth the DFlash
    state drafts a block of budget + 1 rows (fewer logits rows), in fixed modes and in auto
    rounds of small buckets; the output is the target's greedy decoding either way (batch of
    prompts of different lengths, dense and hybrid targets)."""
    from ddtree.generate import generate_batch
    from ddtree.models import dflash

    target = tiny_hybrid() if hybrid else tiny_target(seed=3)
    truths = [greedy_reference(target, torch.tensor([p]), 20) for p in PROMPTS]
    depths = []
    real = dflash.DFlashDrafter.draft_block

    def spy(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        depths.append(out.shape[1])
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dflash.DFlashDrafter, "draft_block", spy)
        for budget in (2, 4):
            depths.clear()
            results = generate_batch(target, tiny_drafter(), PROMPTS, 20, budget=budget)
            assert [r.tokens for r in results] == truths
            assert set(depths) == {budget}
        depths.clear()
        policy = ScriptedBudgets([4, 16, 0, 4, 32])
        results = generate_batch(target, tiny_drafter(), PROMPTS, 20, budget="auto",
                                 policy=policy)
    assert [r.tokens for r in results] == truths
    drafted = [b for b in policy.choices if b]
    assert depths == [min(b, 7) for b in drafted]  # tiny drafter: block 8, depth 7
    # Rounds of 4 measured buckets 0 and 4 of (0, 4, 8, 16, 32, 64); full drafts every bucket.
    assert [s.observed for s in policy.stats if s is not None] == \
        [2 if b == 4 else None for b in drafted]


@pytest.mark.parametrize("at,max_new", [(12, 40), (19, 20)], ids=["inside-a-path", "last-position"])
def test_stop_token(at, max_new):
    """A stop token inside an accepted path, and as the very last allowed token."""
    target = tiny_target(seed=3)
    ids = torch.tensor([PROMPTS[0]])
    truth = greedy_reference(target, ids, max_new)
    stop = truth[at]
    cut = truth.index(stop) + 1
    got = generate(target, OracleDrafter(truth, 3, hit=1.0), ids, max_new, stop_token_ids=[stop])
    assert got.tokens == truth[:cut]


def test_streaming_and_statistics():
    target = tiny_target(seed=3)
    ids = torch.tensor([PROMPTS[2]])
    truth = greedy_reference(target, ids, 30)
    streamed = []
    got = generate(target, OracleDrafter(truth, len(PROMPTS[2])), ids, 30, streamer=streamed.extend)
    assert streamed[: len(got.tokens)] == got.tokens == truth
    assert sum(got.acceptance_lengths) + 1 >= len(got.tokens)
    assert set(got.stage_seconds) == {"draft", "tree", "verify", "commit"}
    # tokens/s: the tokens emitted after the warm-up rounds over the time after them
    after_warmup = len(got.tokens) - (1 + sum(got.acceptance_lengths[: got.warmup_rounds]))
    assert after_warmup > 0
    assert math.isclose(got.tokens_per_second * (got.seconds - got.warmup_seconds), after_warmup,
                        rel_tol=1e-9)
    assert got.warmup_rounds == 1 and 0 < got.warmup_seconds < got.seconds
    assert sum(got.stage_seconds.values()) <= got.seconds


def test_tokens_per_second_excludes_the_warm_up():
    """Prefill + warm-up rounds (the drafter's prompt pass, graph capture) are not in tokens/s:
    10 tokens, the first token and the first round's 3 in 0.4 s, the 6 after in 0.6 s -> 10/s;
    without a round after the warm-up, the whole call counts."""
    from ddtree.generate import GenerationResult

    r = GenerationResult(list(range(10)), [3, 3, 3], 1.0, {}, warmup_seconds=0.4, warmup_rounds=1)
    assert r.tokens_per_second == pytest.approx(10.0)
    r = GenerationResult(list(range(4)), [3], 2.0, {}, warmup_seconds=2.0, warmup_rounds=1)
    assert r.tokens_per_second == pytest.approx(2.0)


@pytest.mark.parametrize("tree_attention", [False, True], ids=["sdpa", "tree-attention"])
def test_sampling_mode_runs_and_is_reproducible(tree_attention):
    from ddtree import models

    target = tiny_target()
    if tree_attention:
        models.use_tree_attention(target)
    drafter = tiny_drafter()
    ids = torch.tensor([PROMPTS[0]])
    a = generate(target, drafter, ids, 12, temperature=0.8, top_k=20, top_p=0.9, seed=4)
    b = generate(target, drafter, ids, 12, temperature=0.8, top_k=20, top_p=0.9, seed=4)
    c = generate(target, drafter, ids, 12, temperature=0.8, top_k=20, top_p=0.9, seed=5)
    assert a.tokens == b.tokens and len(a.tokens) == 12
    assert c.tokens != a.tokens  # the seed matters


# ---- the DFlash checkpoint format ----

def test_drafter_checkpoint_round_trip(tmp_path):
    drafter = tiny_drafter()
    drafter.save_pretrained(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["block_size"] == 8 and config["num_target_layers"] == LAYERS
    assert config["dflash_config"]["mask_token_id"] == VOCAB - 1
    from safetensors.torch import load_file, save_file

    keys = set(load_file(str(tmp_path / "model.safetensors")))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_norm.weight",
            "layers.0.mlp.gate_proj.weight", "layers.0.post_attention_layernorm.weight"} <= keys
    assert not any("embed" in k or "lm_head" in k for k in keys)
    loaded = DFlashDrafter.from_pretrained(str(tmp_path))
    for (k, v), (k2, v2) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)
    # Exports with a "model." prefix load too.
    state = load_file(str(tmp_path / "model.safetensors"))
    os.remove(tmp_path / "model.safetensors")
    save_file({"model." + k: v for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    prefixed = DFlashDrafter.from_pretrained(str(tmp_path))
    assert torch.equal(prefixed.fc.weight, drafter.fc.weight)


def test_default_target_layer_ids():
    assert ddtree.models.default_target_layer_ids(36, 1) == [18]
    assert ddtree.models.default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert tiny_drafter().target_layer_ids == [LAYERS // 2]


def test_drafter_target_mismatch_is_reported():
    target = tiny_target()
    with pytest.raises(ValueError, match="drafter hidden_size 32 != target hidden_size 64"):
        cfg = dflash_config(dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                 intermediate_size=64, num_target_layers=LAYERS,
                                 dflash_config={"mask_token_id": 1}))
        DFlashDrafter(cfg).check_target(target)
    bad_mask = tiny_drafter()
    bad_mask.mask_token_id = VOCAB + 5
    with pytest.raises(ValueError, match="mask_token_id 101 is outside the target vocabulary"):
        generate(target, bad_mask, torch.tensor([[1, 2]]), 4)
    with pytest.raises(ValueError, match="drafter expects a 12-layer target with feature layers "
                                         r"\[9\]; target has 4 layers"):
        tiny_drafter(layer_ids=[9], target_layers=12).check_target(target)
    with pytest.raises(ValueError, match=r"target_layer_ids' must list layer indices in \[0, "
                                         r"num_target_layers = 4\), got \[9\]"):
        tiny_drafter(layer_ids=[9])
    with pytest.raises(ValueError, match="mask_token_id' is required"):
        dflash_config(dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_target_layers=4))


def test_bad_input():
    target, drafter = tiny_target(), tiny_drafter()
    with pytest.raises(ValueError, match="non-empty"):
        generate(target, drafter, torch.zeros(1, 0, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="budget must be an integer >= 0"):
        generate(target, drafter, torch.tensor([[1]]), 4, budget=-1)
    with pytest.raises(ValueError, match="mode must be one of"):
        generate(target, drafter, torch.tensor([[1]]), 4, mode="beam")
    with pytest.raises(ValueError, match="needs a drafter"):
        generate(target, None, torch.tensor([[1]]), 4, mode="tree")
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=4))
    with pytest.raises(ValueError, match="unsupported target architecture 'gpt2'"):
        generate(gpt2, drafter, torch.tensor([[1]]), 4)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1, got 0"):
        generate(target, drafter, torch.tensor([[1]]), 0)
    with pytest.raises(ValueError, match=r"prompt 0 holds token ids outside the target's "
                                         r"vocabulary \[0, 96\): min 1, max 96"):
        generate(target, drafter, torch.tensor([[1, VOCAB]]), 4)
    with pytest.raises(ValueError, match="min -1"):
        generate(target, drafter, torch.tensor([[-1, 3]]), 4)
    with pytest.raises(ValueError, match=r"longest prompt \(500 tokens\) \+ max_new_tokens \(13\) "
                                         r"exceeds the target's max_position_embeddings \(512\)"):
        generate(target, drafter, torch.ones(1, 500, dtype=torch.long), 13)
    for bad in (dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5), dict(temperature=float("nan"))):
        with pytest.raises(ValueError, match="finite temperature"):
            generate(target, drafter, torch.tensor([[1]]), 4, **bad)
    # A drafter of another target: hidden size, feature layers, mask token outside the vocabulary.
    with pytest.raises(ValueError, match="hidden_size"):
        generate(tiny_hybrid(), tiny_drafter_of(hidden=32), torch.tensor([[1]]), 4)
    with pytest.raises(ValueError, match="feature layers"):
        generate(target, tiny_drafter(layer_ids=[1, 7], target_layers=8), torch.tensor([[1]]), 4)
    with pytest.raises(ValueError, match="mask_token_id 200 is outside the target vocabulary"):
        generate(target, tiny_drafter_of(mask=200), torch.tensor([[1]]), 4)


def test_sampling_is_distributed_as_target_sampling():
    """temperature 0.9, top-k 4 on a 6-token vocabulary: the first two generated tokens over many
    seeds follow the target's own two-step sampling distribution (chi-square, fixed seeds)."""
    from ddtree.ops import reference
    from test_ops_verify_sample import chi_square_pvalue

    torch.manual_seed(7)
    vocab = 6
    target = Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab, hidden_size=HIDDEN, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                          intermediate_size=128)).eval()
    cfg = dflash_config(dict(vocab_size=vocab, hidden_size=HIDDEN, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             intermediate_size=128, block_size=4, num_target_layers=2,
                             dflash_config={"mask_token_id": vocab - 1}))
    drafter = DFlashDrafter(cfg).eval()
    ids = torch.tensor([[1, 2, 3]])
    settings = dict(temperature=0.9, top_k=4, top_p=1.0)
    with torch.no_grad():
        first = reference.filtered_probs(target(ids).logits[0, -1], **settings)
        expected = {}
        for t1 in range(vocab):
            if first[t1] == 0:
                continue
            second = reference.filtered_probs(target(torch.tensor([[1, 2, 3, t1]])).logits[0, -1],
                                              **settings)
            for t2 in range(vocab):
                if second[t2] > 0:
                    expected[(t1, t2)] = float(first[t1] * second[t2])
    draws = 700
    counts = {}
    for seed in range(draws):
        out = generate(target, drafter, ids, 2, budget=6, seed=seed, **settings)
        key = tuple(out.tokens)
        counts[key] = counts.get(key, 0) + 1
    assert chi_square_pvalue(counts, expected, draws) > 1e-3


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_lossless_with_the_tree_attention_implementation(kind, monkeypatch):
    """The "ddtree" attention (tree_attention on packed rows, no dense mask) in the loop."""
    from ddtree import models
    from ddtree.models import attention

    calls = []
    real = attention.tree_attention
    monkeypatch.setattr(attention, "tree_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    target = tiny_target(kind, seed=3)
    models.use_tree_attention(target)
    assert models.uses_tree_attention(target)
    for p, prompt in enumerate(PROMPTS):
        ids = torch.tensor([prompt])
        truth = greedy_reference(target, ids, 40)
        got = generate(target, OracleDrafter(truth, len(prompt), seed=p), ids, 40, budget=16)
        assert got.tokens == truth and got.tau > 2
        got = generate(target, tiny_drafter(), ids, 20, budget=16)
        assert got.tokens == truth[:20]
    assert len(calls) >= LAYERS  # verification went through the tree_attention op


def test_fused_draft_attention_gives_the_same_proposals():
    """The drafter through the draft_attention op (preallocated cache, one launch per layer)
    proposes what the unfused SDPA path proposes, round after round."""
    target = tiny_target()
    plain, fused = tiny_drafter(), tiny_drafter()
    # "auto" on CPU: fused for a small attention (heads x head_dim x capacity), not for a cache
    # that grows (capacity 0) or a long context.
    assert plain.uses_fused_attention(64) and not plain.uses_fused_attention()
    assert not plain.uses_fused_attention(plain.CPU_FUSED_MAX_WORK)
    plain.fused_attention, fused.fused_attention = False, True
    assert not plain.uses_fused_attention(64) and fused.uses_fused_attention()
    caches = [plain.new_cache(), fused.new_cache()]
    g = torch.Generator().manual_seed(0)
    for round_ in range(4):
        feats = torch.randn(1, 1 + round_ * 3, HIDDEN * len(plain.target_layer_ids), generator=g)
        bonus = torch.randint(0, VOCAB, (1,), generator=g)
        a = propose(plain, target, bonus, feats, caches[0])
        b = propose(fused, target, bonus, feats, caches[1])
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert caches[1].fused and caches[1].layers[0][0].shape[2] >= caches[1].length
    ids = torch.tensor([PROMPTS[0]])
    assert generate(target, fused, ids, 12).tokens == greedy_reference(target, ids, 12)


@pytest.mark.parametrize("fused", [False, True])
def test_batched_drafter_proposes_what_each_request_alone_proposes(fused):
    """One host-list drafter step for three requests whose contexts grow by different numbers of rows per round
    (right-padded, masked; draft_attention's context_len when fused) equals three one-request
    drafters, round after round; the context caches hold the same rows."""
    target = tiny_target()
    drafter = tiny_drafter()
    drafter.fused_attention = fused
    width = HIDDEN * len(drafter.target_layer_ids)
    g = torch.Generator().manual_seed(1)
    batch_cache = drafter.new_cache(3)
    alone = [drafter.new_cache() for _ in range(3)]
    for round_ in range(5):
        counts = [(3 * round_ + b) % 7 + (1 if round_ == 0 else 0) for b in range(3)]
        feats = [torch.randn(1, c, width, generator=g) for c in counts]
        bonus = torch.randint(0, VOCAB, (3,), generator=g)
        together = propose(drafter, target, bonus, feats, batch_cache)
        one_by_one = torch.cat([propose(drafter, target, bonus[b:b + 1], feats[b], alone[b])
                                for b in range(3)])
        torch.testing.assert_close(together, one_by_one, rtol=1e-4, atol=1e-4)
    assert batch_cache.lengths == [c.length for c in alone]
    for b in range(3):
        rows = alone[b].length
        torch.testing.assert_close(batch_cache.layers[0][0][b, :, :rows], alone[b].layers[0][0][0, :, :rows])


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("mode", ["tree", "chain", "autoregressive"])
def test_lossless_hybrid_target(kind, mode):
    """Gated DeltaNet layers verified over the tree (tree conv + tree GDN ops) and committed along
    the accepted path: the output equals the hybrid target's own greedy decoding, with deep
    acceptances (recurrent state of deep leaves committed) and with the DFlash drafter."""
    from ddtree.models import gated_delta as hybrid

    target = tiny_hybrid(kind=kind)
    gdn = hybrid.gated_delta_layers(target)
    assert len(gdn) == LAYERS // 2
    for p, prompt in enumerate(PROMPTS):
        ids = torch.tensor([prompt])
        truth = greedy_reference(target, ids, 40)
        got = generate(target, OracleDrafter(truth, len(prompt), seed=p), ids, 40, mode=mode,
                       budget=16)
        assert got.tokens == truth
        if mode != "autoregressive":
            assert got.tau > 2.5
        assert generate(target, tiny_drafter(), ids, 16, mode=mode, budget=16).tokens == truth[:16]
    assert all("forward" not in vars(m) for m in gdn)  # the class forward is back


def test_hybrid_with_tree_attention_and_stop_token(monkeypatch):
    from ddtree import models

    target = tiny_hybrid(seed=5)
    models.use_tree_attention(target)
    ids = torch.tensor([PROMPTS[2]])
    truth = greedy_reference(target, ids, 30)
    stop = truth[17]
    got = generate(target, OracleDrafter(truth, len(PROMPTS[2]), hit=0.9), ids, 30, budget=32,
                   stop_token_ids=[stop])
    assert got.tokens == truth[: truth.index(stop) + 1]


@pytest.mark.parametrize("kind", ["qwen3", "llama", "qwen3_5"])
@pytest.mark.parametrize("mode", ["tree", "chain", "autoregressive"])
def test_lossless_batch_with_different_prompt_lengths_and_budgets(kind, mode):
    """Three requests (prompt lengths 3, 1, 11) in one batch sharing one KV cache: each equals
    its own greedy decoding; per-request budgets; deep acceptances."""
    from ddtree.generate import generate_batch

    target = tiny_hybrid() if kind == "qwen3_5" else tiny_target(kind, seed=3)
    truths = [greedy_reference(target, torch.tensor([p]), 30) for p in PROMPTS]
    oracle = BatchOracle(truths, [len(p) for p in PROMPTS])
    results = generate_batch(target, oracle, PROMPTS, 30, mode=mode, budget=[16, 8, 24])
    assert [r.tokens for r in results] == truths
    if mode != "autoregressive":
        assert min(r.tau for r in results) > 2
    results = generate_batch(target, tiny_drafter(), PROMPTS, 12, mode=mode, budget=16)
    assert [r.tokens for r in results] == [t[:12] for t in truths]


def test_batch_with_tree_attention_stop_tokens_and_streaming():
    from ddtree import models
    from ddtree.generate import generate_batch

    target = tiny_target(seed=3)
    models.use_tree_attention(target)
    truths = [greedy_reference(target, torch.tensor([p]), 24) for p in PROMPTS]
    stop = truths[1][9]
    streamed = {0: [], 1: [], 2: []}
    results = generate_batch(target, BatchOracle(truths, [len(p) for p in PROMPTS]), PROMPTS, 24,
                             budget=16, stop_token_ids=[stop],
                             streamer=lambda b, new: streamed[b].extend(new))
    for b, (r, t) in enumerate(zip(results, truths)):
        cut = t.index(stop) + 1 if stop in t else len(t)
        assert r.tokens == t[:cut]
        assert streamed[b][: len(r.tokens)] == r.tokens


def test_batch_bad_input():
    from ddtree.generate import generate_batch

    target, drafter = tiny_target(), tiny_drafter()
    with pytest.raises(ValueError, match="every prompt must be non-empty"):
        generate_batch(target, drafter, [[1, 2], []], 4)
    with pytest.raises(ValueError, match="a list of one per prompt"):
        generate_batch(target, drafter, [[1, 2], [3]], 4, budget=[4])
    with pytest.raises(ValueError, match="for a batch pass a list of prompts"):
        generate(target, drafter, torch.ones(2, 3, dtype=torch.long), 4)


@pytest.mark.parametrize("mode", ["tree", "chain", "autoregressive"])
def test_lossless_batch_on_the_tree_attention_implementation(mode, monkeypatch):
    """The fixed-shape verify step (static cache and buffers, tree start and write offset as
    device tensors) on the tree_attention op: a batch of different prompt lengths with deep
    acceptances equals each request's greedy decoding; the step always has N = budget + 1 rows."""
    from ddtree import models
    from ddtree.generate import generate_batch
    from ddtree.generate import TargetVerifier

    target = tiny_target(seed=3)
    models.use_tree_attention(target)
    truths = [greedy_reference(target, torch.tensor([p]), 30) for p in PROMPTS]
    oracle = BatchOracle(truths, [len(p) for p in PROMPTS])
    rows = []
    real_step = TargetVerifier.step
    monkeypatch.setattr(TargetVerifier, "step",
                        lambda self, tree, *a: rows.append(tree.node_tokens.shape[1]) or
                        real_step(self, tree, *a))
    results = generate_batch(target, oracle, PROMPTS, 30, mode=mode, budget=[16, 8, 24])
    assert rows and set(rows) == {1 if mode == "autoregressive" else 8 if mode == "chain" else 25}
    assert [r.tokens for r in results] == truths
    if mode != "autoregressive":
        assert min(r.tau for r in results) > 2
    got = generate(target, tiny_drafter(), torch.tensor([PROMPTS[2]]), 12, mode=mode, budget=16)
    assert got.tokens == truths[2][:12]


def _graph_target(kind, device="cuda", dtype=torch.bfloat16):
    """A tiny target the CUDA kernels take (head_dim 64; the hybrid's tree conv / GDN layers
    too), on the tree_attention implementation."""
    from ddtree import models

    torch.manual_seed(0)
    if kind == "qwen3":
        cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=LAYERS,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                          intermediate_size=256, max_position_embeddings=512)
        target = Qwen3ForCausalLM(cfg)
    else:
        from transformers import Qwen3_5TextConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

        target = Qwen3_5ForCausalLM(Qwen3_5TextConfig(
            vocab_size=VOCAB, hidden_size=128, num_hidden_layers=LAYERS,
            layer_types=["linear_attention", "full_attention"] * (LAYERS // 2),
            num_attention_heads=2, num_key_value_heads=1, head_dim=64, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
            linear_conv_kernel_dim=4, intermediate_size=256))
    target = target.eval().to(device, dtype)
    models.use_tree_attention(target)
    return target


def _graph_drafter(device="cuda", dtype=torch.bfloat16):
    """A DFlash drafter (block 8) whose step the fused draft_attention op runs (head_dim 64)."""
    extra = {"mask_token_id": VOCAB - 1}
    dcfg = dflash_config(dict(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                              intermediate_size=256, block_size=8, num_target_layers=LAYERS,
                              dflash_config=extra))
    return DFlashDrafter(dcfg).eval().to(device, dtype)


def _each_tensor(outputs, *more):
    """(tensor, tensors at the same place in `more`) through nested tuples; None skipped."""
    if isinstance(outputs, torch.Tensor):
        yield (outputs, *more)
    elif outputs is not None:
        for parts in zip(outputs, *more, strict=True):
            yield from _each_tensor(*parts)


class ReplayedStep:
    """A CUDA graph's contract, on the CPU: replay() runs the captured step again and writes its
    results into the tensors the capture returned (a graph's static outputs), and, as graphs
    sharing a memory pool may reuse each other's scratch memory, fills the float outputs of the
    other graphs of its pool with NaN. A loop that reads a step's outputs after another replay,
    or captures at the wrong moment, then emits other tokens than greedy decoding. (What it
    cannot show: a captured kernel reading a tensor the step rebinds later; a real graph keeps
    the old one.)"""

    def __init__(self, step, outputs, pools, pool):
        self.step, self.outputs, self.pools = step, outputs, pools
        self.pool_id = pool if pool is not None else len(pools)
        pools.setdefault(self.pool_id, []).append(self)

    def pool(self):
        return self.pool_id

    def replay(self):
        for other in self.pools[self.pool_id]:
            if other is not self:
                for (t,) in _each_tensor(other.outputs):
                    if t.is_floating_point():
                        t.fill_(float("nan"))
        for dst, src in _each_tensor(self.outputs, self.step()):
            dst.copy_(src)


def replayed_graphs(monkeypatch):
    """cuda_graph=True on the CPU with ReplayedStep for every capture (the verifier's and the
    drafter's). Returns the list of captures: (verify passes run so far, "verify" with its
    (batch, tree rows, negated for a graph with a pool of its own) or "draft" with its batch)."""
    from ddtree.generate import verifier as verify

    captures, passes, pools = [], [], {}
    step = verify.TargetVerifier.step

    def counted_step(self, *args):
        passes.append(None)
        return step(self, *args)

    def capture(step, prepare=lambda: None, pool=None):
        for _ in range(3):  # two warm-up runs and the capture, as capture_graph runs them
            prepare()
            outputs = step()
        if isinstance(outputs, tuple):  # rows: its tree rows; a later one shares the first's pool
            rows = outputs[0].shape[1] if pool is not None else -outputs[0].shape[1]
            captures.append((len(passes), "verify", (outputs[0].shape[0], rows)))
        else:
            captures.append((len(passes), "draft", (outputs.shape[0], None)))
        return ReplayedStep(step, outputs, pools, pool), outputs

    monkeypatch.setattr(verify.TargetVerifier, "step", counted_step)
    from ddtree.models import dflash_state

    for module in (verify, dflash_state):
        monkeypatch.setattr(module, "capture_graph", capture)
    monkeypatch.setattr(verify, "check_graph_device", lambda device: None)
    return captures


def captured_per_batch(captures):
    """Batch size -> (the moments of its captures, verify graphs' tree rows, drafter graphs)."""
    out = {}
    for moment, what, (batch, rows) in captures:
        moments, verify_rows, drafts = out.setdefault(batch, (set(), [], []))
        moments.add(moment)
        (verify_rows if what == "verify" else drafts).append(rows)
    return out


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_graph_rounds_replayed_on_the_cpu_are_lossless(kind, monkeypatch):
    """The cuda_graph=True loop with graph replays emulated on the CPU (ReplayedStep; fp32):
    fixed tree budget and budget="auto" through every bucket emit the target's greedy tokens
    (the fixed budget in the same rounds as eager steps).
    At every batch size (three requests, then fewer as they finish) all graphs are captured at
    one moment, before the batch's first round: the verify graph of every tree size the rounds
    can use and the drafter's step, never inside a round."""
    from ddtree.budget import BUCKETS
    from ddtree.generate import generate_batch

    target = tiny_target(seed=3) if kind == "qwen3" else tiny_hybrid(kind=kind)
    truths = [greedy_reference(target, torch.tensor([p]), 30) for p in PROMPTS]
    policy = ScriptedBudgets([0, 0, 4, 0, 0, 0, 0, 16, 64, 0, 8, 32, 32, 0, 4, 64, 0, 0, 16])
    for budget, rows in ((16, [17]), ("auto", [b + 1 for b in BUCKETS])):
        captures = replayed_graphs(monkeypatch)
        results = generate_batch(target, tiny_drafter(), PROMPTS, 30, budget=budget,
                                 policy=policy if budget == "auto" else None, cuda_graph=True)
        assert [r.tokens for r in results] == truths, budget
        if budget == 16:  # the same rounds as eager ones (full-depth drafts in both)
            eager = generate_batch(target, tiny_drafter(), PROMPTS, 30, budget=16)
            assert [r.acceptance_lengths for r in results] == \
                [r.acceptance_lengths for r in eager]
        sizes = {s for r in results for s in r.round_batch_sizes}
        per_batch = captured_per_batch(captures)
        assert len(sizes) > 1 and set(per_batch) == sizes, budget  # the batch did shrink
        assert per_batch[len(PROMPTS)][0] == {0}, budget  # before round one
        for batch, (moments, verify_rows, drafts) in per_batch.items():
            # largest first, its pool shared by the others
            assert verify_rows == [-rows[-1]] + rows[-2::-1], (budget, batch)
            assert len(moments) == 1, (budget, batch)
            assert drafts == [None], (budget, batch)
    assert set(BUCKETS) <= set(policy.choices)


@pytest.mark.skipif(not (torch.cuda.is_available() and ddtree.has_cuda_kernels()),
                    reason="needs a GPU and the CUDA build")
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_lossless_with_cuda_graph(kind):
    """cuda_graph=True on the GPU: captured once, replayed every round, it emits exactly what the
    same fixed-shape step run eagerly emits (same kernels; that path is lossless against greedy
    decoding in fp32 on CPU, above). bf16 target, tree_attention kernel; for the hybrid also the
    tree conv / GDN kernels inside the graph. Deep acceptances through an oracle drafter built
    from greedy decoding."""
    from ddtree.generate import generate_batch

    target = _graph_target(kind)
    prompts = [torch.tensor(p, device="cuda") for p in PROMPTS]
    truths = [greedy_reference(target, p[None], 24) for p in prompts]

    def oracle():
        return BatchOracle(truths, [len(p) for p in PROMPTS], device="cuda")

    eager = generate_batch(target, oracle(), prompts, 24, budget=16)
    graph = generate_batch(target, oracle(), prompts, 24, budget=16, cuda_graph=True)
    assert [r.tokens for r in graph] == [r.tokens for r in eager]
    assert [r.acceptance_lengths for r in graph] == [r.acceptance_lengths for r in eager]
    assert max(r.tau for r in graph) > 1.5
    # The DFlash drafter's step captured too (fused draft_attention, head_dim 64).
    drafter = _graph_drafter()
    assert drafter.new_cache().fused
    eager = generate_batch(target, drafter, prompts, 24, budget=16)
    graph = generate_batch(target, drafter, prompts, 24, budget=16, cuda_graph=True)
    assert [r.tokens for r in graph] == [r.tokens for r in eager]


@pytest.mark.skipif(not (torch.cuda.is_available() and ddtree.has_cuda_kernels()),
                    reason="needs a GPU and the CUDA build")
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_auto_budget_with_cuda_graph_matches_eager(kind, monkeypatch):
    """budget="auto" with cuda_graph=True: rounds switch between autoregressive steps and every
    tree bucket at least the drafter's block deep (one verify graph per bucket, the drafter's
    graph, its deferred context rows written in chunks of 3 between replays) and emit exactly
    what the same rounds run eagerly emit (eager auto rounds are lossless against greedy
    decoding in fp32 on CPU: test_budget_policy.py)."""
    from ddtree.generate import generate_batch
    from ddtree.models.dflash_state import DFlashDraftState

    monkeypatch.setattr(DFlashDraftState, "DEFER_ROWS", 3)
    target, drafter = _graph_target(kind), _graph_drafter()
    prompts = [torch.tensor(p, device="cuda") for p in PROMPTS]
    # Buckets >= block_size - 1: eager drafts run the full block, as a captured graph does.
    script = [0, 0, 8, 0, 0, 0, 0, 16, 64, 0, 8, 32, 32, 0, 0, 64, 0, 0, 16]
    eager = generate_batch(target, drafter, prompts, 30, budget="auto",
                           policy=ScriptedBudgets(script))
    policy = ScriptedBudgets(script)
    graph = generate_batch(target, drafter, prompts, 30, budget="auto", policy=policy,
                           cuda_graph=True)
    assert {0, 8, 16, 32, 64} <= set(policy.choices)
    assert [r.tokens for r in graph] == [r.tokens for r in eager]
    assert [r.round_budgets for r in graph] == [r.round_budgets for r in eager]


def test_drafter_norm_and_rope_table_are_qwen3s():
    """The drafter's RMSNorm (torch's rms_norm op in fp32) gives bit for bit what Qwen3's
    RMSNorm gives, for fp32 and bf16 inputs, and the loop state's RoPE table holds exactly what
    the rotary embedding computes at each position."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from ddtree.models.dflash import RMSNorm

    g = torch.Generator().manual_seed(0)
    for dim, dtype in [(64, torch.float32), (256, torch.float32), (4096, torch.float32),
                       (128, torch.bfloat16)]:
        ours, theirs = RMSNorm(dim, eps=1e-6).to(dtype), Qwen3RMSNorm(dim, eps=1e-6).to(dtype)
        weight = torch.randn(dim, generator=g).to(dtype)
        ours.weight.data.copy_(weight)
        theirs.weight.data.copy_(weight)
        for shape in [(1, 1, dim), (2, 16, dim), (1, 33, 4, dim)]:
            x = (3 * torch.randn(shape, generator=g)).to(dtype)
            assert torch.equal(ours(x), theirs(x)), (dim, dtype, shape)
    drafter = tiny_drafter()
    cos, sin = drafter.rope_table(40, "cpu")
    positions = torch.tensor([[0, 7, 39], [3, 3, 20]])
    want = drafter.rotary_emb(cos.new_empty(0), positions)
    assert torch.equal(cos[positions], want[0]) and torch.equal(sin[positions], want[1])


def test_draft_block_refuses_a_block_outside_its_rows():
    """draft_block(block_rows=) outside 2..block_size: a clear error naming it."""
    target, drafter = tiny_target(), tiny_drafter()
    hidden = tuple(torch.randn(1, 4, HIDDEN) for _ in range(LAYERS + 1))
    state = drafter.begin(target, [hidden], 40)
    for bad in (1, 9):
        with pytest.raises(ValueError, match="block_rows must be in 2..8"):
            drafter.draft_block(target, torch.tensor([3]), state.prompt, state.rows, state.cache,
                                block_rows=bad)


@pytest.mark.parametrize("depths", [(None,) * 6, (3, 1, 7, 12, None, 5)],
                         ids=["full-blocks", "shallow-blocks"])
@pytest.mark.parametrize("told", [False, True], ids=["all-rows", "known-new-rows"])
@pytest.mark.parametrize("fused", [False, True])
def test_draft_state_proposes_what_the_host_list_step_proposes(fused, told, depths):
    """The drafter's fixed-shape loop state (prompt rows first, then the accepted rows gathered on
    the device into a [B, block_size] buffer, padded rows masked) proposes what
    the host-list drafter step (helpers.propose) proposes from the same rows, round after round,
    including requests that bring no new row (finished) — also when told the most rows a
    request accepted (known_new_rows, as the loop does after its host read: the step then reads
    only that many feature rows; a round where none accepted any included), and when a round's
    tree goes only `depth` deep (step(bonus, depth): a block of depth + 1 rows, the host-list
    step's logits for that block — its rows attend to each other, so they differ from the full
    block's; depth >= the drafter's 7 drafts the full block)."""
    target = tiny_target()
    drafter = tiny_drafter()
    drafter.fused_attention = fused
    g = torch.Generator().manual_seed(2)

    def hidden(batch, rows):
        return tuple(torch.randn(batch, rows, HIDDEN, generator=g) for _ in range(LAYERS + 1))

    prompts = [hidden(1, c) for c in (11, 3, 20)]
    state = drafter.begin(target, prompts, 120)
    plain = drafter.new_cache(3)
    feats = [drafter.target_features(h)[0] for h in prompts]
    for round_, depth in enumerate(depths):
        bonus = torch.randint(0, VOCAB, (3,), generator=g)
        block = None if depth is None or depth >= 7 else depth + 1
        want = propose(drafter, target, bonus, feats, plain, block_rows=block)
        got = state.step(bonus, depth)
        assert got.shape[1] == (7 if block is None else depth)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        rows = hidden(3, 12)
        accept_len = torch.tensor([(round_ + b * 3) % 9 for b in range(3)]) * (round_ != 2)
        accepted = torch.stack([torch.randperm(12, generator=g)[:8] for _ in range(3)])
        accepted[torch.arange(8)[None] >= accept_len[:, None]] = -1
        state.commit(rows, ddtree.Verdict(accepted, accept_len, bonus))
        if told:
            state.known_new_rows(int(accept_len.max()))
        f = drafter.target_features(rows)
        feats = [f[b, accepted[b, : accept_len[b]]] for b in range(3)]
    assert state.rows.committed_len.tolist() == plain.lengths


def test_lossless_with_the_fused_drafter_and_tree_attention(monkeypatch):
    from ddtree import models
    from ddtree.generate import generate_batch
    from ddtree.models.dflash_state import DFlashDraftState

    target = tiny_target(seed=3)
    models.use_tree_attention(target)
    drafter = tiny_drafter()
    drafter.fused_attention = True
    calls = []
    real = DFlashDraftState.step
    monkeypatch.setattr(DFlashDraftState, "step", lambda self, *a: calls.append(1) or real(self, *a))
    truths = [greedy_reference(target, torch.tensor([p]), 16) for p in PROMPTS]
    for mode in ("tree", "chain"):
        results = generate_batch(target, drafter, PROMPTS, 16, mode=mode, budget=[16, 8, 24])
        assert [r.tokens for r in results] == truths
    assert calls


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_lossless_hybrid_with_tree_attention(kind, mode, monkeypatch):
    """Hybrid targets with the tree_attention op: static attention cache, the Gated DeltaNet layers
    over the tree from static parents / node counts, recurrent commit from the pass's tensors; a
    batch with deep acceptances stays lossless."""
    from ddtree import models
    from ddtree.generate import generate_batch
    from ddtree.models import attention

    calls = []
    real = attention.tree_attention
    monkeypatch.setattr(attention, "tree_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    target = tiny_hybrid(kind=kind)
    models.use_tree_attention(target)
    truths = [greedy_reference(target, torch.tensor([p]), 30) for p in PROMPTS]
    results = generate_batch(target, BatchOracle(truths, [len(p) for p in PROMPTS]), PROMPTS, 30,
                             mode=mode, budget=[16, 8, 24])
    assert calls
    assert [r.tokens for r in results] == truths
    assert min(r.tau for r in results) > 2


def test_loop_bad_input():
    from ddtree.generate import generate_batch

    target, drafter = tiny_target(), tiny_drafter()
    with pytest.raises(ValueError, match="cuda_graph=True needs the target on a CUDA device"):
        generate_batch(target, drafter, [[1, 2]], 4, cuda_graph=True)
    with pytest.raises(TypeError, match="Drafter protocol"):
        generate(target, object(), torch.tensor([[1, 2]]), 4)


HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("mode", ["tree", "chain", "autoregressive", "auto"])
@pytest.mark.parametrize("tree_attention", [False, True], ids=["sdpa", "tree-attention"])
def test_one_host_read_per_round(kind, mode, tree_attention, monkeypatch):
    """Every round of the loop (DFlash drafter, batch of 3 with a stop token and a streamer) reads
    from the device exactly once: Tensor.item / tolist / cpu / numpy / bool / int / float / index
    are counted between the round's first and last stage marks — budget="auto" included (its
    bucket choice, calibration and statistics ride on that read; autoregressive and drafted
    rounds mixed). Inside the rounds the ops' value checks are off; after the call they are
    back on."""
    from ddtree import models
    from ddtree.generate import generate_batch
    from ddtree.generate.clock import StageClock

    target = tiny_hybrid() if kind == "qwen3_5" else tiny_target(seed=3)
    if tree_attention:
        models.use_tree_attention(target)
    truths = [greedy_reference(target, torch.tensor([p]), 20) for p in PROMPTS]
    reads = [0]
    for name in HOST_READS:
        real = getattr(torch.Tensor, name)

        def counted(self, *a, _real=real, **k):
            reads[0] += 1
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    rounds, checks = [], []
    real_mark = StageClock.mark

    def mark(self, new_round=False):
        if new_round:
            rounds.append([])
        rounds[-1].append(reads[0])
        checks.append(ddtree.validation_enabled())
        real_mark(self, new_round)

    monkeypatch.setattr(StageClock, "mark", mark)
    streamed = {0: [], 1: [], 2: []}
    stop = truths[1][9]
    budget = dict(mode="tree", budget="auto", policy=ScriptedBudgets([8, 0, 0, 16, 4, 0, 64])) \
        if mode == "auto" else dict(mode=mode, budget=[16, 8, 24])
    results = generate_batch(target, tiny_drafter(), PROMPTS, 20, stop_token_ids=[stop],
                             streamer=lambda b, new: streamed[b].extend(new), **budget)
    monkeypatch.undo()
    assert [r.tokens for r in results] == [t[: t.index(stop) + 1] if stop in t else t
                                           for t in truths]
    assert [streamed[b][: len(r.tokens)] for b, r in enumerate(results)] == [r.tokens for r in results]
    assert len(rounds) >= 5 and all(len(m) == 5 for m in rounds)
    assert [m[-1] - m[0] for m in rounds] == [1] * len(rounds)
    assert not any(checks) and ddtree.validation_enabled()


@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_max_new_tokens_boundaries_with_full_acceptances(mode):
    """A drafter that is always right (rounds of block_size tokens) at every max_new_tokens around
    the block boundaries, a batch of three: exactly the first max_new_tokens greedy tokens — the
    last round overshoots and is cut, the static caches hold the overshoot."""
    from ddtree.generate import generate_batch

    target = tiny_target(seed=3)
    truths = [greedy_reference(target, torch.tensor([p]), 26) for p in PROMPTS]
    for n in (1, 2, 7, 8, 9, 15, 16, 17, 25):
        oracle = BatchOracle([t + [0] * 16 for t in truths], [len(p) for p in PROMPTS], hit=1.0)
        results = generate_batch(target, oracle, PROMPTS, n, mode=mode, budget=[16, 8, 40])
        assert [r.tokens for r in results] == [t[:n] for t in truths], n
        if n >= 9:
            assert max(r.tau for r in results) == 8.0  # full blocks were accepted


def test_budget_above_the_vocabulary():
    target = tiny_target(seed=3)
    ids = torch.tensor([PROMPTS[2]])
    got = generate(target, tiny_drafter(), ids, 20, budget=3 * VOCAB)  # K = V, N = 289 rows
    assert got.tokens == greedy_reference(target, ids, 20)


FIVE_PROMPTS = PROMPTS + [[3, 3, 60], [70, 2, 11, 4]]


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("mode", ["tree", "chain", "autoregressive", "auto"])
def test_finished_requests_leave_the_verify_batch(kind, mode):
    """Five requests stopping at different rounds (each on the first stop token of its own greedy
    continuation): every request gets exactly its greedy tokens, cut at the first stop token,
    while the verify batch shrinks to the smallest power of two holding the requests still live
    (recomputed here from the rounds each request ran) — the cache rows, recurrent states,
    drafter contexts (deferred rows of autoregressive rounds included), per-request budgets and
    draw counters move with their requests; budget="auto" is told each new batch size."""
    from ddtree.generate import generate_batch

    target = tiny_hybrid() if kind == "qwen3_5" else tiny_target(seed=3)
    truths = [greedy_reference(target, torch.tensor([p]), 24) for p in FIVE_PROMPTS]
    stops = [t[2 + 3 * i] for i, t in enumerate(truths[:4])]  # the fifth runs to the end
    want = [next((t[: j + 1] for j, x in enumerate(t) if x in stops), t) for t in truths]
    policy = ScriptedBudgets([4, 0, 0, 16, 0, 8, 64, 0, 32])
    kwargs = dict(budget="auto", policy=policy) if mode == "auto" else \
        dict(mode=mode, budget=[16, 8, 24, 4, 12])
    results = generate_batch(target, tiny_drafter(), FIVE_PROMPTS, 24, stop_token_ids=stops,
                             **kwargs)
    assert [r.tokens for r in results] == want
    rounds = [len(r.acceptance_lengths) for r in results]
    expected, size = [], 5
    for r in range(max(rounds)):  # the batch of round r: live = requests that run round r
        live = sum(n > r for n in rounds)
        bucket = 1 << (live - 1).bit_length()
        size = bucket if bucket < size else size
        expected.append(size)
    for r, n in zip(results, rounds):
        assert r.round_batch_sizes == expected[:n]
    assert expected[-1] < 5
    if mode == "auto":
        assert policy.sizes == sorted(set(expected) - {5}, reverse=True)


def test_leaving_the_batch_when_sampling_is_reproducible():
    """Sampling: a request's draws are keyed by its seed, its draw counter and its batch row, so a
    shrinking batch draws other (equally distributed) tokens than a static one, but the same ones
    on every run; the stop rule cuts each request at its first stop token."""
    from ddtree.generate import loop

    target = tiny_target(seed=3)
    truths = [greedy_reference(target, torch.tensor([p]), 20) for p in FIVE_PROMPTS]
    stops = [truths[0][4], truths[3][9]]
    run = lambda: loop.generate_batch(  # noqa: E731
        target, tiny_drafter(), FIVE_PROMPTS, 20, budget=12, temperature=0.9, top_p=0.95,
        seed=7, stop_token_ids=stops)
    first, second = run(), run()
    assert [r.tokens for r in first] == [r.tokens for r in second]
    assert min(min(r.round_batch_sizes) for r in first) < 5
    for r in first:
        assert len(r.tokens) <= 20 and all(t not in stops for t in r.tokens[:-1])
        assert len(r.tokens) == 20 or r.tokens[-1] in stops


def test_rows_to_keep_pads_live_rows_to_a_power_of_two():
    """Live rows kept in order, padded with the first finished rows up to the next power of two;
    no change when that bucket is not smaller, or when nothing is live."""
    from ddtree.generate.requests import Requests

    requests = Requests([1] * 8, 10, set(), None, "cpu")
    cases = [([1, 0, 1, 1, 0, 1, 1, 0], [0, 1, 4, 7]),
             ([1, 1, 1, 1, 1, 1, 1, 0], [7]),
             ([0, 0, 0, 0, 0, 1, 1, 1], None),
             ([1] * 8, None)]
    for done, want in cases:
        requests.done = [bool(d) for d in done]
        assert requests.rows_to_keep() == want, done
    requests.done = [True, False, True, False, True, True, True, True]
    keep = requests.rows_to_keep()
    assert keep == [1, 3]
    requests.select(keep, torch.tensor(keep))
    assert requests.rows == [1, 3] and requests.alive.shape == (2,)


@pytest.mark.parametrize("stops", [(), (9,)], ids=["no-stop-tokens", "stop-token"])
def test_round_host_copy_is_accepted_tokens_then_bonus(stops):
    """Requests.emitted, per row: accept_len, then the accepted nodes' tokens after the root and
    the bonus (spec §5's emitted tokens) — a fully accepted path (the bonus in the last column), a
    partial one, a root-only one and a row that accepted nothing (finished); count / alive follow
    (max_new_tokens, and a stop token among the emitted tokens, not among the padding)."""
    from ddtree import ops
    from ddtree.generate.requests import Requests

    tokens = torch.tensor([[5, 6, 7, 8], [5, 9, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]])
    parents = torch.tensor([[-1, 0, 1, 2]] * 4)
    tree = ops.DraftTree(tokens, parents, torch.arange(4).expand(4, 4), None, None,
                         torch.full((4,), 4))
    accepted = torch.tensor([[0, 1, 2, 3], [0, 1, -1, -1], [0, -1, -1, -1], [0, -1, -1, -1]])
    verdict = ops.Verdict(accepted, torch.tensor([4, 2, 1, 0]), torch.tensor([11, 12, 13, 9]))
    requests = Requests([1] * 4, 4, set(stops), None, "cpu")
    rows = requests.emitted(tree, verdict).tolist()
    want = [[4, 6, 7, 8, 11], [2, 9, 12], [1, 13], [0]]  # accept_len, new tokens
    assert [row[: 1 + row[0]] for row in rows] == want
    assert requests.count.tolist() == [5, 3, 2, 1]
    # max_new_tokens 4 ends row 0; the stop token 9 ends row 1; row 3 emitted nothing (its
    # padding holds 9: not a real token)
    assert requests.alive.tolist() == [False, not stops, True, True]


def test_packed_lm_head_computes_the_linear_and_keeps_the_module():
    """models.use_packed_lm_head: the LM head stays the same module with the same parameters (state
    dict, tied embeddings); its CPU fp32 inference products equal nn.Linear's (1 to 33 rows, 2-D
    and 3-D inputs, with a bias), follow a change of the weight (in place, another tensor, a
    dtype round trip: the packed copy is made again), and grad mode with a weight requiring grad or another dtype runs nn.Linear's
    own forward (same gradients, same values); copies and pickles leave the packed copy out."""
    import copy
    import io

    from ddtree import models

    def save(module):
        buffer = io.BytesIO()
        torch.save(module, buffer)
        buffer.seek(0)
        return buffer

    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN: use_packed_lm_head leaves the head as it is")
    for tied in (False, True):
        target = Qwen3ForCausalLM(Qwen3Config(
            vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, intermediate_size=64,
            tie_word_embeddings=tied)).eval()
        head, weight = target.get_output_embeddings(), target.get_output_embeddings().weight
        before = {k: v.clone() for k, v in target.state_dict().items()}
        assert models.use_packed_lm_head(target) and models.use_packed_lm_head(target)
        assert target.get_output_embeddings() is head and head.weight is weight
        assert isinstance(head, models.PackedLinear)
        assert (head.weight is target.get_input_embeddings().weight) == tied
        after = target.state_dict()
        assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    torch.manual_seed(0)
    for bias in (False, True):
        head = torch.nn.Linear(HIDDEN, VOCAB, bias=bias)
        plain = torch.nn.functional.linear
        head.__class__ = models.PackedLinear
        with torch.no_grad():
            for shape in ((1, HIDDEN), (3, HIDDEN), (2, 17, HIDDEN), (1, 33, HIDDEN)):
                x = torch.randn(shape)
                torch.testing.assert_close(head(x), plain(x, head.weight, head.bias))
            x = torch.randn(2, 5, HIDDEN)
            head.weight.mul_(-2.0)  # in place: the next call packs the new weight
            torch.testing.assert_close(head(x), plain(x, head.weight, head.bias))
            head.weight = torch.nn.Parameter(torch.randn_like(head.weight))  # another tensor
            torch.testing.assert_close(head(x), plain(x, head.weight, head.bias))
            half = x.to(torch.bfloat16)
            assert torch.equal(head.to(torch.bfloat16)(half),
                               plain(half, head.weight, head.bias))
            head.float()  # rounded through bf16: a new weight, packed anew
            torch.testing.assert_close(head(x), plain(x, head.weight, head.bias))
        x = torch.randn(4, HIDDEN)
        with torch.no_grad():
            for twin in (copy.deepcopy(head), torch.load(save(head), weights_only=False)):
                assert isinstance(twin, models.PackedLinear) and "_packed" not in twin.__dict__
                torch.testing.assert_close(twin(x), head(x))
        out = head(x)  # grad mode, the weight requires grad: nn.Linear's forward
        out.square().sum().backward()
        grad = head.weight.grad.clone()
        head.weight.grad = None
        plain(x, head.weight, head.bias).square().sum().backward()
        torch.testing.assert_close(grad, head.weight.grad)
    assert not models.use_packed_lm_head(torch.nn.Module())  # no LM head: nothing changed


def test_packed_linears_keep_the_modules_and_compute_the_linear():
    """models.use_packed_linears: plain nn.Linear modules of at least min_elements weight elements
    (not the LM head) become PackedLinear for products of at least min_rows rows — the same
    modules and parameters; fewer rows are nn.Linear's product exactly, more equal it to
    rounding; idempotent; a bf16 model is left as it is; the cost profile's model key sees it;
    bad arguments are named."""
    from ddtree import budget, models

    target = tiny_target(seed=3)
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN: use_packed_linears changes nothing")
    head = target.get_output_embeddings()
    linears = [m for m in target.modules() if type(m) is torch.nn.Linear and m is not head]
    big = max(m.weight.numel() for m in linears)
    params = {n: p for n, p in target.named_parameters()}
    state = {k: v.clone() for k, v in target.state_dict().items()}
    key = budget.costs.model_key(target)
    changed = models.use_packed_linears(target, min_rows=3, min_elements=big)
    packed = [m for m in linears if isinstance(m, models.PackedLinear)]
    assert changed == len(packed) == sum(m.weight.numel() >= big for m in linears) > 0
    assert type(head) is torch.nn.Linear  # the head is use_packed_lm_head's
    assert all(type(m) is torch.nn.Linear for m in linears if m.weight.numel() < big)
    assert {n: p for n, p in target.named_parameters()} == params
    assert all(torch.equal(state[k], v) for k, v in target.state_dict().items())
    assert budget.costs.model_key(target) != key
    assert models.use_packed_linears(target, min_rows=3, min_elements=big) == 0  # idempotent
    module = packed[0]
    with torch.no_grad():
        for rows in (1, 2, 3, 9, 17):
            x = torch.randn(rows, module.in_features)
            want = torch.nn.functional.linear(x, module.weight, module.bias)
            if rows < 3:
                assert torch.equal(module(x), want)
            else:
                torch.testing.assert_close(module(x), want)
    assert models.use_packed_linears(tiny_target(seed=3).to(torch.bfloat16), min_elements=0) == 0
    for bad in ({"min_rows": 0}, {"min_rows": 1.5}, {"min_rows": True}, {"min_elements": -1}):
        name = next(iter(bad))
        with pytest.raises(ValueError, match=name):
            models.use_packed_linears(tiny_target(seed=3), **bad)


@pytest.mark.parametrize("mode,budget", [("tree", 16), ("tree", "auto"), ("autoregressive", 0)])
@pytest.mark.parametrize("linears", [False, True], ids=["head", "head+linears"])
def test_lossless_with_the_packed_lm_head(mode, budget, linears):
    """The loop with a packed LM head (the verify pass's tree rows, the drafter's block rows),
    and with every other linear of the target and the drafter packed for products of 2 rows or
    more, emits the plain model's greedy tokens."""
    import copy

    from ddtree import models
    from ddtree.generate import generate_batch

    target = tiny_target(seed=3)
    truths = [greedy_reference(target, torch.tensor([p]), 20) for p in PROMPTS]
    packed = copy.deepcopy(target)
    drafter = tiny_drafter()
    if not models.use_packed_lm_head(packed):
        pytest.skip("torch built without oneDNN: use_packed_lm_head leaves the head as it is")
    if linears:
        assert models.use_packed_linears(packed, min_elements=0) > 0
        assert models.use_packed_linears(drafter, min_elements=0) > 0
    got = generate_batch(packed, drafter, [torch.tensor(p) for p in PROMPTS], 20,
                         mode=mode, budget=budget)
    assert [r.tokens for r in got] == truths
