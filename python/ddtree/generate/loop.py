"""The speculative loop over Hugging Face targets (spec §1): the drafter proposes a block, DDTree
turns it into the optimal draft tree, the target verifies the whole tree in one forward pass, the
accepted path is committed.

Targets: dense decoders (Qwen3, Qwen2, Llama, Mistral) and hybrid Qwen3.5 text / Qwen3-Next models
(Gated DeltaNet layers run over the tree, models.gated_delta); batches of prompts of different lengths
(generate_batch; generate is one request of it); greedy and sampling.

Every target and mode runs one round shape (generate.verifier): fixed-size buffers, lengths and
drafter features on the device, the target on transformers' StaticCache. A round is
draft -> tree -> verify -> walk -> commit; its only host read is the round's verdict (accepted
tokens and counts: streaming and stop checks), one copy. Inputs are checked once, here; inside
the rounds the ops run with their value checks off (ops.validation). With cuda_graph=True the
verify step (every tree size the rounds can use, captured before them) and the drafter's step
are captured as CUDA graphs and replayed.
"""
from __future__ import annotations

import time
from typing import Callable, Iterable, List, Optional

import torch

from .. import parallel
from ..budget import BUCKETS, CostProfile, GenerationReport, Policy, auto_policy
from ..budget import calibrate as measure_costs
from ..ops import validation
from .checks import as_token_ids, check_request
from .clock import StageClock
from .protocols import Drafter, NoDrafter
from .requests import Requests
from .results import GenerationResult
from .rounds import AutoRounds, Generation, run_fixed_rounds, tree_step
from .sampler import RankCheckedSampler, Sampler
from .verifier import TargetVerifier


def generate(target, drafter, input_ids: torch.Tensor, max_new_tokens: int, mode: str = "tree",
             budget: int = 64, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             stop_token_ids: Iterable[int] = (), seed: int = 0,
             streamer: Optional[Callable[[List[int]], None]] = None,
             cuda_graph: bool = False, policy=None, cost_profile=None) -> GenerationResult:
    """Generates up to max_new_tokens after input_ids [1, P]. At temperature 0 the tokens equal the
    target's own greedy decoding; at temperature > 0 they are distributed as the target's sampling
    (temperature, top-k, top-p). mode "chain" verifies DFlash's single chain (K = 1), "tree" the
    optimal tree of `budget` nodes (budget="auto": the cost-aware size each round, see
    generate_batch), "autoregressive" runs the target alone. cuda_graph=True
    (CUDA) captures the verify step (before the first round, every tree size the rounds can use)
    and the drafter's step once and replays them every round.
    (One request of generate_batch.)"""
    if not isinstance(input_ids, torch.Tensor):
        if not isinstance(input_ids, (list, tuple)):
            raise TypeError(f"generate: input_ids must be a [1, P] tensor (or a list of token ids), "
                            f"got {type(input_ids).__name__}")
        input_ids = as_token_ids("input_ids", input_ids)
        input_ids = input_ids[None] if input_ids.dim() == 1 else input_ids
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"generate: input_ids must be a non-empty [1, P] prompt, got shape "
                         f"{tuple(input_ids.shape)}")
    if input_ids.shape[0] != 1:
        raise ValueError("generate: input_ids must hold one prompt [1, P]; for a batch pass a list of "
                         "prompts to generate_batch (they may differ in length)")
    return generate_batch(target, drafter, [input_ids[0]], max_new_tokens, mode, budget,
                          temperature, top_k, top_p, stop_token_ids, seed,
                          (lambda _, new: streamer(new)) if streamer else None, cuda_graph,
                          policy, cost_profile)[0]


@torch.no_grad()
def generate_batch(target, drafter: Optional[Drafter], prompts, max_new_tokens: int,
                   mode: str = "tree", budget=64, temperature: float = 0.0, top_k: int = 0,
                   top_p: float = 1.0, stop_token_ids: Iterable[int] = (), seed: int = 0,
                   streamer: Optional[Callable[[int, List[int]], None]] = None,
                   cuda_graph: bool = False, policy=None, cost_profile=None,
                   ) -> List[GenerationResult]:
    """Batched `generate`: prompts of different lengths (list of token lists / 1-D tensors) and
    per-request budgets (int or list), or budget="auto": each round verifies the tree size (or
    an autoregressive step) that maximises expected tokens per second under the measured cost
    profile of this batch size (ddtree.budget; measured on first use, before the clock starts,
    and cached on disk, with those of the smaller batch sizes it shrinks to; or given as
    cost_profile, one CostProfile or a sequence of them; `policy` replaces the AutoBudget
    policy).
    The requests share one static cache whose rows between a request's committed length and the
    tree's start row are padding (masked). A finished request stops advancing (nothing of it is
    committed any more). Returns one GenerationResult per request; streamer(request,
    new_tokens)."""
    prompts, budgets, is_hybrid, stops = check_request(
        target, drafter, prompts, max_new_tokens, mode, budget, temperature, top_k, top_p, seed,
        stop_token_ids)
    if budget == "auto" and policy is not None and not isinstance(policy, Policy):
        raise TypeError(f"generate: policy must be a ddtree.budget.Policy (AutoBudget, "
                        f"FixedBucket or a subclass), got {type(policy).__name__}")
    if budget == "auto" and policy is None:
        policy = auto_policy(target, drafter, len(prompts), cost_profile,
                             run=calibration_run(target, drafter))
    # budget="auto" where no tree can pay at this batch size: plain autoregressive rounds.
    auto_plain = budget == "auto" and \
        policy.plain_autoregressive(len(prompts), drafter.block_size - 1)
    if auto_plain:
        mode, budget, budgets = "autoregressive", 0, [0] * len(prompts)
    started = time.perf_counter()
    device = target.get_input_embeddings().weight.device
    batch, depth = len(prompts), (drafter.block_size - 1 if mode != "autoregressive" else 0)
    n = 1 if mode == "autoregressive" else depth + 1 if mode == "chain" else max(budgets) + 1
    longest = max(p.numel() for p in prompts)
    # A request's committed rows stay below longest + max_new_tokens + depth (a round overshoots
    # max_new_tokens by at most depth); the tree goes on top, the drafter writes a block there.
    # Tensor-parallel target (ddtree.parallel): the draft top-k and, when greedy, the verify
    # walk's argmax over the sharded LM head.
    shard = parallel.vocab_shard(target)
    verifier = TargetVerifier(target, batch=batch, rows=n, max_depth=depth,
                              max_cache_len=longest + max_new_tokens + depth + n,
                              want_hidden=mode != "autoregressive", cuda_graph=cuda_graph,
                              is_hybrid=is_hybrid, vocab_shard=shard if temperature <= 0 else None)
    sampler = Sampler(temperature, top_k, top_p,
                      torch.tensor([seed * 1000003 + b for b in range(batch)], device=device), depth)
    check_ranks = parallel.rank_check(target)
    if check_ranks is not None:
        sampler = RankCheckedSampler(sampler, check_ranks)
    prompts = [p.to(device) for p in prompts]
    last, prompt_hidden = verifier.prefill(prompts)
    committed_len = torch.tensor([p.numel() for p in prompts], device=device)
    bonus = sampler.first_token(last)
    requests = Requests(bonus.tolist(), max_new_tokens, set(int(t) for t in stops), streamer,
                        device)
    prefilled = time.perf_counter()  # the prefill's tokens were read: it is done
    draft = NoDrafter() if mode == "autoregressive" else \
        drafter.begin(target, prompt_hidden, longest + max_new_tokens + 2 * depth + 1, cuda_graph)
    # cuda_graph: the verify graph of every tree row count the rounds can use and the drafter's
    # step, captured now (and again whenever finished requests leave the batch): no decoding
    # round captures; the first round is the warm-up, as in eager mode (the drafter's prompt
    # pass, eager in both).
    graph_rows = [b + 1 for b in BUCKETS] if budget == "auto" else [n]
    gen = Generation(StageClock(device), draft, verifier, sampler, requests, committed_len,
                     bonus, graph_rows, shard)
    gen.capture()
    if budget == "auto":
        if not hasattr(draft, "defer"):
            raise TypeError(f"generate: budget='auto' needs a draft state with defer() (the "
                            f"context of autoregressive rounds); {type(draft).__name__} has none")
        policy.start(batch, depth, device)
        auto = AutoRounds(policy, device, depth)
        with validation(False):
            auto.run(gen)
        loop_ms = 1e3 * (time.perf_counter() - prefilled)  # the drafter's prompt pass included
        results = _results(gen, started)
        policy.finish_generation(GenerationReport(
            len(gen.clock.round_starts), loop_ms=loop_ms, prefill_ms=1e3 * (prefilled - started),
            tokens_after_first=[len(r.tokens) - 1 for r in results],  # a plain round each
            calibration_sums=auto.calibration.sums.tolist()))
        return results
    budget_t = torch.tensor(budgets, device=device)
    with validation(False):
        run_fixed_rounds(gen, lambda b: tree_step(mode, n - 1, b, gen), budget_t,
                         n - 1 if mode == "tree" else None, 0 if auto_plain else None)
    if auto_plain:
        policy.finish_generation(GenerationReport(len(gen.clock.round_starts), plain=True))
    return _results(gen, started)


def _results(gen: Generation, started: float) -> List[GenerationResult]:
    """Each request's result; the warm-up is the prefill and the first round."""
    return gen.requests.results(time.perf_counter() - started, gen.clock.totals(),
                                gen.clock.elapsed_before(1, started), 1)


def calibration_run(target, drafter):
    """The loop's generation as budget.calibrate runs it: greedy, budget="auto", the rounds of
    the given policy."""
    return lambda prompts, max_new_tokens, policy: generate_batch(
        target, drafter, prompts, max_new_tokens, budget="auto", policy=policy)


def calibrate(target, drafter, batch: int, **kwargs) -> CostProfile:
    """The cost profile of `batch` requests measured on this loop (budget.calibrate; cached on
    disk, `use_cache=False` measures again)."""
    return measure_costs(target, drafter, batch, calibration_run(target, drafter), **kwargs)
