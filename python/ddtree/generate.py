"""The speculative loop over Hugging Face targets (SPEC §1): the drafter proposes a block, DDTree
turns it into the optimal draft tree, the target verifies the whole tree in one forward pass, the
accepted path is committed.

Supported now: dense decoder targets (Qwen3, Qwen2, Llama, Mistral) and hybrid Qwen3.5 text /
Qwen3-Next models (Gated DeltaNet layers run over the tree, see ddtree.hybrid), batches of
prompts of different lengths (generate_batch; generate is one request of it), greedy and
sampling. Verification attention: the "ddtree" attention implementation (`ddtree.hf.
use_tree_attention(target)`: the tree_attention op on packed visibility rows), otherwise the
target's own attention with the dense additive tree mask through transformers' 4-D mask path.
Host synchronisation inside a round: one copy of the verdict (accepted paths, lengths, bonus
tokens, tree tokens) to the host, needed to crop the shared KV cache, stream and stop. The DFlash drafter
drafts the whole batch in one pass (`batched = True`: new context rows right-padded and masked);
drafters without it are called request by request.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional

import torch
import torch.nn.functional as F

from . import hf, hybrid, ops

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama", "mistral")
HYBRID_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")
MODES = ("tree", "chain", "autoregressive")


@dataclass
class GenerationResult:
    tokens: List[int]                      # generated tokens, prompt excluded
    acceptance_lengths: List[int]          # tokens emitted per round (accepted + bonus)
    seconds: float
    stage_seconds: Dict[str, float] = field(default_factory=dict)

    @property
    def tau(self) -> float:
        """Mean tokens per target forward (acceptance length, bonus included)."""
        return sum(self.acceptance_lengths) / max(1, len(self.acceptance_lengths))

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else float("inf")


def _check_target(target) -> bool:
    """True for a hybrid target (Gated DeltaNet layers, run over the tree by ddtree.hybrid)."""
    model_type = getattr(target.config, "model_type", None)
    if model_type in HYBRID_MODEL_TYPES:
        if not hybrid.gated_delta_layers(target):
            raise ValueError(f"generate: hybrid target '{model_type}' has no Gated DeltaNet layers "
                             "that ddtree recognises")
        return True
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"generate: unsupported target architecture '{model_type}'; supported: "
                         f"{', '.join(SUPPORTED_MODEL_TYPES + HYBRID_MODEL_TYPES)}")
    return False


def _same_layout(tensors):
    """The tensors grouped by (shape, strides, dtype), order kept: commit_kv_layers_ batches."""
    groups = {}
    for t in tensors:
        groups.setdefault((tuple(t.shape), t.stride(), t.dtype), []).append(t)
    return list(groups.values())


def _static_path_available(target) -> bool:
    """The static verify path needs the tree_attention op for the target's attention layers."""
    if not hf.uses_tree_attention(target):
        return False
    weight = target.get_input_embeddings().weight
    cfg = target.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return ops.attention_op_supports(weight.device, weight.dtype, head_dim)


class _Sampler:
    """Greedy or lossless sampling over a tree's target logits (verify_greedy / verify_sample)."""

    def __init__(self, temperature, top_k, top_p, seed, depth):
        self.temperature, self.top_k, self.top_p, self.seed = temperature, top_k, top_p, seed
        self.depth = depth
        self.offset = 0

    def verify(self, tree: ops.DraftTree, logits: torch.Tensor, seed=None) -> ops.GreedyVerdict:
        if self.temperature <= 0:
            return ops.verify_greedy(tree, logits.argmax(-1), self.depth)
        self.offset += 1
        return ops.verify_sample(tree, logits.float(), self.depth, self.temperature, self.top_k,
                                 self.top_p, self.seed if seed is None else seed, self.offset)


def _no_context():
    import contextlib

    return contextlib.nullcontext()


def _root_only_tree(token: torch.Tensor) -> ops.DraftTree:
    z = torch.zeros(1, 1, dtype=torch.long, device=token.device)
    return ops.DraftTree(token.view(1, 1).long(), z - 1, z, z - 1, z - 1,
                         torch.ones(1, dtype=torch.long, device=token.device))


def generate(target, drafter, input_ids: torch.Tensor, max_new_tokens: int, mode: str = "tree",
             budget: int = 64, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             stop_token_ids: Iterable[int] = (), seed: int = 0,
             streamer: Optional[Callable[[List[int]], None]] = None, cuda_graph: bool = False,
             static_cache: Optional[bool] = None) -> GenerationResult:
    """Generates up to max_new_tokens after input_ids [1, P]. At temperature 0 the tokens equal the
    target's own greedy decoding; at temperature > 0 they are distributed as the target's sampling
    (temperature, top-k, top-p). mode "chain" verifies DFlash's single chain (K = 1), "tree" the
    optimal tree of `budget` nodes, "autoregressive" runs the target alone. cuda_graph=True
    (CUDA, dense target on ddtree.hf.use_tree_attention) captures the fixed-shape verify step
    once and replays it every round; static_cache=True runs that same static path without the
    graph. (One request of generate_batch.)"""
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"generate: input_ids must be a non-empty [1, P] prompt, got shape "
                         f"{tuple(input_ids.shape)}")
    if input_ids.shape[0] != 1:
        raise ValueError("generate: input_ids must hold one prompt [1, P]; for a batch pass a list of "
                         "prompts to generate_batch (they may differ in length)")
    if budget < 0:
        raise ValueError(f"generate: budget must be >= 0, got {budget}")
    return generate_batch(target, drafter, [input_ids[0]], max_new_tokens, mode, budget,
                          temperature, top_k, top_p, stop_token_ids, seed,
                          (lambda _, new: streamer(new)) if streamer else None, cuda_graph,
                          static_cache)[0]


def _merge_caches(target, caches, lengths):
    """One batched cache from per-request prefill caches: attention layers right-padded to the
    longest prompt (padding rows are masked by prefix_len), linear-attention states stacked."""
    from transformers import DynamicCache

    merged = DynamicCache(config=target.config)
    longest = max(lengths)
    for i, layer in enumerate(merged.layers):
        parts = [c.layers[i] for c in caches]
        if getattr(parts[0], "keys", None) is not None:
            pad = [(0, 0, 0, longest - int(n)) for n in lengths]
            keys = torch.cat([F.pad(p.keys, pd) for p, pd in zip(parts, pad)])
            values = torch.cat([F.pad(p.values, pd) for p, pd in zip(parts, pad)])
            merged.update(keys, values, i)
        else:
            merged.update_conv_state(torch.cat([p.conv_states[0] for p in parts]), i)
            merged.update_recurrent_state(torch.cat([p.recurrent_states[0] for p in parts]), i)
    return merged


@torch.no_grad()
def generate_batch(target, drafter, prompts, max_new_tokens: int, mode: str = "tree",
                   budget=64, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                   stop_token_ids: Iterable[int] = (), seed: int = 0,
                   streamer: Optional[Callable[[int, List[int]], None]] = None,
                   cuda_graph: bool = False, static_cache: Optional[bool] = None
                   ) -> List[GenerationResult]:
    """Batched `generate`: prompts of different lengths (list of token lists / 1-D tensors) and
    per-request budgets (int or list). The requests share one KV cache whose rows past a request's
    valid length are padding (masked by prefix_len; paths committed to each request's length).
    A finished request stops advancing (its accepted rows are no longer committed).
    static_cache: the target verifies on transformers' StaticCache with fixed-shape buffers
    (ddtree.static_verify: no cache concatenation or crop per round); default on for targets on
    the tree_attention implementation whose attention the kernel covers, and for cuda_graph;
    cuda_graph: that step (hybrid Gated DeltaNet layers included) is captured once as a CUDA
    graph and replayed, and so is the DFlash drafter's step when it runs on draft_attention
    (static_verify.StaticDrafter; with static_cache alone it runs eagerly).
    Returns one GenerationResult per request; streamer(request, new_tokens)."""
    if mode not in MODES:
        raise ValueError(f"generate: mode must be one of {MODES}, got {mode!r}")
    prompts = [torch.as_tensor(p, dtype=torch.long).reshape(-1) for p in prompts]
    if not prompts or any(p.numel() == 0 for p in prompts):
        raise ValueError("generate: every prompt must be non-empty")
    budgets = [budget] * len(prompts) if isinstance(budget, int) else list(budget)
    if len(budgets) != len(prompts) or min(budgets) < 0:
        raise ValueError("generate: budget must be >= 0, one int or one per prompt")
    if max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be >= 1, got {max_new_tokens}")
    is_hybrid = _check_target(target)
    if static_cache is None:
        static_cache = cuda_graph or _static_path_available(target)
    if cuda_graph and not static_cache:
        raise ValueError("generate: cuda_graph=True needs static_cache (fixed-shape verify step)")
    speculative = mode != "autoregressive"
    if speculative:
        if drafter is None:
            raise ValueError(f"generate: mode '{mode}' needs a drafter")
        if hasattr(drafter, "check_target"):
            drafter.check_target(target)
    from transformers import DynamicCache

    device = target.get_input_embeddings().weight.device
    batch = len(prompts)
    depth = drafter.block_size - 1 if speculative else 0
    seeds = torch.tensor([seed * 1000003 + b for b in range(batch)], device=device)
    sampler = _Sampler(temperature, top_k, top_p, seeds, depth)
    started = time.perf_counter()
    stops = set(int(t) for t in stop_token_ids)
    caches, features, first = [], [], []
    for b, prompt in enumerate(prompts):
        cache = DynamicCache(config=target.config)
        out = target(input_ids=prompt[None].to(device), past_key_values=cache, use_cache=True,
                     output_hidden_states=speculative)
        verdict = sampler.verify(_root_only_tree(prompt[-1:].to(device)), out.logits[:, -1:],
                                 seed=seeds[b:b + 1])
        first.append(verdict.bonus)
        caches.append(cache)
        if speculative:
            features.append(drafter.target_features(out.hidden_states))
    valid = torch.tensor([p.numel() for p in prompts], device=device)
    valid_h = valid.tolist()
    cache = _merge_caches(target, caches, valid_h)
    phys = max(valid_h)
    verifier = None
    if static_cache:
        from .static_verify import StaticVerifier

        n_rows = 1 if not speculative else (depth + 1 if mode == "chain" else max(budgets) + 1)
        verifier = StaticVerifier(target, cache, batch, n_rows,
                                  phys + max_new_tokens + depth + n_rows + 1, speculative,
                                  cuda_graph, is_hybrid, depth)
        cache = verifier.cache
    bonus = torch.cat(first)
    batched_drafter = speculative and getattr(drafter, "batched", False)
    static_drafter = None
    if not speculative:
        draft_caches = None
    elif (batched_drafter and static_cache and hasattr(drafter, "draft_block")
          and getattr(drafter.new_cache(), "fused", False)):
        from .static_verify import StaticDrafter

        static_drafter = StaticDrafter(drafter, target, batch, phys + max_new_tokens + 2 * (depth + 1),
                                       features[0].shape[-1], cuda_graph)
        draft_caches = static_drafter.cache
    elif batched_drafter:
        draft_caches = drafter.new_cache(batch)
    else:
        draft_caches = [drafter.new_cache() for _ in range(batch)]
    tokens = [[int(t)] for t in bonus.tolist()]
    lengths: List[List[int]] = [[] for _ in range(batch)]
    if streamer:
        for b in range(batch):
            streamer(b, list(tokens[b]))
    budget_t = torch.tensor(budgets, device=device)

    def finished(b) -> bool:
        return len(tokens[b]) >= max_new_tokens or any(t in stops for t in tokens[b])

    stages = dict(draft=0.0, tree=0.0, verify=0.0, commit=0.0)
    while not all(finished(b) for b in range(batch)):
        t0 = time.perf_counter()
        if static_drafter is not None:
            logits = static_drafter.propose(bonus, features)
        elif batched_drafter:
            logits = drafter.propose(target, bonus, features, draft_caches)
        elif speculative:
            logits = torch.cat([drafter.propose(target, bonus[b:b + 1], features[b], draft_caches[b])
                                for b in range(batch)])
        t1 = time.perf_counter()
        if speculative:
            if mode == "chain":  # the argmax chain, without the log-softmax / top-k machinery
                tree, vis = ops.chain_to_tree(logits, bonus, start=valid)
            else:
                tree, vis = ops.draft_to_tree(logits, bonus, max(budgets), start=valid,
                                              budgets=budget_t)
        else:
            none = torch.full((batch, 1), -1, dtype=torch.long, device=device)
            tree = ops.DraftTree(bonus[:, None].clone(), none, none + 1, none, none,
                                 torch.ones(batch, dtype=torch.long, device=device))
            vis = ops.tree_visibility(tree.parents, tree.num_nodes, valid)
        n = tree.node_tokens.shape[1]
        t2 = time.perf_counter()
        if verifier is not None:
            logits, hidden_states = verifier.run(tree, vis, valid, phys)
            tree_pass = verifier.tree_pass
        else:
            tree_pass = hybrid.TreePass(tree, depth)
            if hf.uses_tree_attention(target):
                mask = vis.packed[:, None]
            else:
                mask = ops.tree_attention_mask(tree.parents, tree.num_nodes, phys,
                                               target.get_input_embeddings().weight.dtype, valid)
            with hybrid.tree_verification(target, tree_pass) if is_hybrid else _no_context(), \
                    hf.batch_prefix(valid):
                out = target(input_ids=tree.node_tokens, position_ids=vis.positions,
                             attention_mask={"full_attention": mask, "linear_attention": None}
                             if is_hybrid else mask,
                             past_key_values=cache, use_cache=True,
                             output_hidden_states=speculative)
            logits, hidden_states = out.logits, out.hidden_states
        verdict = sampler.verify(tree, logits)
        # Finished requests stop advancing: nothing of theirs is committed any more.
        alive = torch.tensor([not finished(b) for b in range(batch)], device=device)
        verdict = verdict._replace(accept_len=verdict.accept_len * alive)
        t3 = time.perf_counter()
        # The round's one host read: everything the host needs from the verdict.
        accepted, accept_len, bonus_h, node_tokens = (
            t.tolist() for t in (verdict.accepted, verdict.accept_len, verdict.bonus,
                                 tree.node_tokens))
        start = torch.full((batch,), phys, dtype=torch.long, device=device)
        new_valid = valid + verdict.accept_len
        new_phys = max(v + a for v, a in zip(valid_h, accept_len))
        attention = [layer for layer in cache.layers if getattr(layer, "keys", None) is not None]
        for group in _same_layout([t for layer in attention for t in (layer.keys, layer.values)]):
            ops.commit_kv_layers_(group, start, verdict.accepted, verdict.accept_len, "BHSD", valid)
        if verifier is None and phys + n > new_phys:
            for layer in attention:
                layer.crop(-(phys + n - new_phys))
        if is_hybrid:
            hybrid.commit(cache, tree_pass, verdict)
        if speculative:
            all_features = drafter.target_features(hidden_states)
        for b in range(batch):
            path = accepted[b][: accept_len[b]]
            if speculative:
                features[b] = all_features[b:b + 1, path]
            if finished(b):
                continue
            new = [node_tokens[b][i] for i in path[1:]] + [bonus_h[b]]
            lengths[b].append(len(new))
            tokens[b].extend(new)
            if streamer:
                streamer(b, new)
        valid, phys, bonus = new_valid, new_phys, verdict.bonus
        valid_h = [v + a for v, a in zip(valid_h, accept_len)]
        for name, dt in zip(stages, (t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3)):
            stages[name] += dt
    seconds = time.perf_counter() - started
    results = []
    for b in range(batch):
        toks = tokens[b]
        for i, t in enumerate(toks):
            if t in stops:
                toks = toks[: i + 1]
                break
        results.append(GenerationResult(toks[:max_new_tokens], lengths[b], seconds, dict(stages)))
    return results
