"""Helpers shared by the test modules: kernel backends, tiny random targets and drafters, test
drafters and budget policies, the greedy reference decoding, hypothesis strategies."""
import math
import os

import pytest
import torch
from hypothesis import strategies as st

import ddtree

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from ddtree.models import DFlashDrafter, dflash_config  # noqa: E402
from ddtree.models.draft_rows import ContextRows  # noqa: E402
from ddtree.budget import Policy  # noqa: E402


# ---- kernel backends ----

def cuda_available() -> bool:
    return ddtree.has_cuda_kernels() and torch.cuda.is_available()


# Kernel backends: the CUDA kernel source in the SIMT emulator (always), the real GPU when present.
KERNEL_BACKENDS = [
    pytest.param("emulated", id="emulated"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=pytest.mark.skipif(not cuda_available(), reason="needs a GPU and the CUDA build"),
    ),
]


def kernel_device(backend: str) -> str:
    return "cpu" if backend == "emulated" else "cuda"


# ---- tiny models ----

VOCAB, HIDDEN, LAYERS = 96, 64, 4


def tiny_target(kind="qwen3", seed=0):
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                  max_position_embeddings=512)
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    for p in model.parameters():  # sharper logits than the default init: fewer near-ties
        p.data.mul_(3.0)
    return model.eval()


def tiny_drafter(block_size=8, seed=1, layer_ids=None, target_layers=LAYERS):
    torch.manual_seed(seed)
    extra = {"mask_token_id": VOCAB - 1}
    if layer_ids is not None:
        extra["target_layer_ids"] = layer_ids
    cfg = dflash_config(dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             intermediate_size=128, block_size=block_size,
                             num_target_layers=target_layers, dflash_config=extra))
    return DFlashDrafter(cfg).eval()


def greedy_reference(target, ids, n):
    out = target.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


class BatchOracle:
    """A test drafter (the ddtree.generate.Drafter protocol) that proposes each request's true
    continuation at each depth with probability `hit`, a random wrong token otherwise, plus noise
    so that the tree has alternatives: long partial acceptances through the tree, deep commits.
    It tracks each request's position from the verdicts (a host read; a test double)."""

    def __init__(self, truths, prompt_lens, block_size=8, hit=0.8, seed=0, device="cpu"):
        self.truths, self.block_size, self.hit, self.device = truths, block_size, hit, device
        self.g = torch.Generator().manual_seed(seed)

    def check_target(self, target):
        pass

    def begin(self, target, prompt_hidden_states, capacity, cuda_graph=False):
        self.at = [0] * len(self.truths)  # index in truth of each request's bonus token
        return self

    def step(self, bonus, depth=None):
        rows = []
        for truth, start in zip(self.truths, self.at):
            logits = torch.randn(1, self.block_size - 1, VOCAB, generator=self.g)
            for j in range(self.block_size - 1):
                at = start + 1 + j
                if at < len(truth) and torch.rand(1, generator=self.g).item() < self.hit:
                    logits[0, j, truth[at]] += 6.0
            rows.append(logits)
        return torch.cat(rows).to(self.device)

    def commit(self, hidden_states, verdict):
        self.at = [a + n for a, n in zip(self.at, verdict.accept_len.tolist())]


class OracleDrafter(BatchOracle):
    def __init__(self, truth, prompt_len, **kw):
        super().__init__([truth], [prompt_len], **kw)


PROMPTS = [[5, 17, 42], [1], [9, 8, 7, 6, 5, 4, 3, 2, 1, 33, 44]]


def tiny_drafter_of(hidden=HIDDEN, mask=VOCAB - 1):
    cfg = dflash_config(dict(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             intermediate_size=128, block_size=8, num_target_layers=LAYERS,
                             dflash_config={"mask_token_id": mask}))
    return DFlashDrafter(cfg).eval()


def tiny_hybrid(seed=3, kind="qwen3_5"):
    from transformers import Qwen3_5TextConfig, Qwen3NextConfig, Qwen3NextForCausalLM
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                  layer_types=["linear_attention", "full_attention"] * (LAYERS // 2),
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                  linear_value_head_dim=16, linear_conv_kernel_dim=4, intermediate_size=128)
    torch.manual_seed(seed)
    if kind == "qwen3_next":  # fused qkvz / ba projections, sparse MoE MLPs
        model = Qwen3NextForCausalLM(Qwen3NextConfig(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, **common)).eval()
    else:
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**common)).eval()
    for p in model.parameters():
        p.data.mul_(3.0)
    return model


def propose(drafter, target, bonus: torch.Tensor, features, cache,
            block_rows=None) -> torch.Tensor:
    """The drafter step driven from host lists (a test oracle for DFlashDraftState and the
    training forward): bonus [B] (each block's first token); features: [B, C, n*H], or a list of B tensors
    [1, C_b, n*H] / [C_b, n*H] when the requests bring different numbers of rows — the target
    features of tokens not yet in the drafter's context (request b's sit at positions
    cache.lengths[b] ..). Appends them to the context cache and returns draft logits
    [B, block_size - 1, V] (a block of block_rows rows: [B, block_rows - 1, V]). One pass for
    the whole batch: new rows right-padded, padding masked (draft_attention's context_len when
    fused)."""
    b = bonus.shape[0]
    device = bonus.device
    if isinstance(features, torch.Tensor):
        features = list(features)
    feats = [f.reshape(-1, f.shape[-1]) for f in features]
    if len(feats) != b or len(cache.lengths) != b:
        raise ValueError(f"propose: {b} bonus tokens, {len(feats)} feature rows "
                         f"and a cache of {len(cache.lengths)} requests must agree")
    new = [f.shape[0] for f in feats]
    ctx_in = torch.nn.utils.rnn.pad_sequence(feats, batch_first=True) if max(new) > 0 \
        else feats[0].new_zeros(b, 0, feats[0].shape[-1])
    as_t = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
    key_rows = max(c + n for c, n in zip(cache.lengths, new)) + drafter.block_size
    rows = ContextRows(as_t(cache.lengths), as_t(new), key_rows)
    # padding rows of the unfused step land past the block (ContextRows.step)
    drafter.reserve(cache, b, max(cache.lengths) + ctx_in.shape[1] + drafter.block_size)
    logits = drafter.draft_block(target, bonus, ctx_in, rows, cache, block_rows=block_rows)
    cache.lengths = [l + n for l, n in zip(cache.lengths, new)]
    return logits


# ---- test policies and strategies ----

class ScriptedBudgets(Policy):
    """A budget="auto" policy that plays a fixed sequence of buckets (0 = autoregressive round)
    and records the statistics each round hands back."""

    def __init__(self, sequence):
        self.sequence, self.choices, self.stats, self.sizes = list(sequence), [], [], []

    def observe_round(self, report):
        if report.ms is not None:
            self.observe_cost(report.bucket, report.ms)
        self.observe(report.stats)

    def observe_cost(self, bucket, ms):
        pass

    def choose(self):
        bucket = self.sequence[len(self.choices) % len(self.sequence)]
        self.choices.append(bucket)
        return bucket

    def observe(self, stats):
        self.stats.append(stats)

    def resize(self, batch):
        self.sizes.append(batch)


# Random draft top-k inputs for build_tree: ties, -inf / NaN tails, per-request budgets.
@st.composite
def draft_inputs(draw, max_batch=3, max_depth=6, max_k=6, max_budget=40):
    batch = draw(st.integers(1, max_batch))
    depth = draw(st.integers(0, max_depth))
    k = draw(st.integers(0, max_k))
    budget = draw(st.integers(0, max_budget))
    style = draw(st.sampled_from(["random", "ties", "tails"]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    vocab = k + draw(st.integers(0, 4))
    logits = torch.randn(batch, depth, max(vocab, 1), generator=g) * draw(st.sampled_from([0.5, 2.0, 6.0]))
    if style == "ties":
        logits = logits.round()
    lp = torch.log_softmax(logits, -1)
    values, ids = lp.sort(dim=-1, descending=True, stable=True)
    values, ids = values[..., :k].contiguous(), ids[..., :k].contiguous()
    if style == "tails" and k > 0:
        cut = torch.randint(0, k + 1, (batch, depth, 1), generator=g)
        tail = torch.arange(k).expand(batch, depth, k) >= cut
        values = values.masked_fill(tail, -math.inf)
        if draw(st.booleans()):
            values = values.masked_fill(tail & (torch.rand(values.shape, generator=g) < 0.3), math.nan)
    roots = torch.randint(0, 1000, (batch,), generator=g)
    budgets = None
    if draw(st.booleans()):
        budgets = torch.randint(0, budget + 1, (batch,), generator=g)
    return values, ids, roots, budget, budgets
