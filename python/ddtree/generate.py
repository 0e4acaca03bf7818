"""The speculative loop over Hugging Face targets (spec §1): the drafter proposes a block, DDTree
turns it into the optimal draft tree, the target verifies the whole tree in one forward pass, the
accepted path is committed.

Targets: dense decoders (Qwen3, Qwen2, Llama, Mistral) and hybrid Qwen3.5 text / Qwen3-Next models
(Gated DeltaNet layers run over the tree, ddtree.hybrid); batches of prompts of different lengths
(generate_batch; generate is one request of it); greedy and sampling.

Every target and mode runs one round shape (ddtree.verify): fixed-size buffers, lengths and
drafter features on the device, the target on transformers' StaticCache. A round is
draft -> tree -> verify -> walk -> commit; its only host read is the round's verdict (accepted
tokens and counts: streaming and stop checks), one copy. Inputs are checked once, here; inside
the rounds the ops run with their value checks off (ddtree.validation). With cuda_graph=True the
verify step (every tree size the rounds can use, captured before them) and the drafter's step
are captured as CUDA graphs and replayed.
"""
from __future__ import annotations

import math
import numbers
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Protocol, Sequence

import torch

from . import budget as cost_aware
from . import distributed, hybrid, ops, validation
from .budget import BUCKETS as AUTO_BUCKETS
from .loading import text_config
from .verify import TargetVerifier

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama", "mistral")
HYBRID_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")
MODES = ("tree", "chain", "autoregressive")
STAGES = ("draft", "tree", "verify", "commit")


class DraftState(Protocol):
    """A drafter's state across the rounds of one generation."""

    def step(self, bonus: torch.Tensor, depth: Optional[int] = None) -> torch.Tensor:
        """Draft logits [B, L, V] of the blocks starting with bonus [B] (device, no host reads);
        with a tensor-parallel target whose LM head is vocabulary-sharded, either those or this
        rank's columns [B, L, V_local] (ddtree.distributed.vocab_shard). `depth`: the round's
        tree goes no deeper (a state may then draft only that many depths, L >= depth)."""

    def commit(self, hidden_states, verdict: ops.Verdict) -> None:
        """Takes the round's verdict (accepted rows of the target's hidden states) into account."""

    # Optional: select(index [B'] int64) keeps those batch rows, in that order (finished requests
    # leave the batch). Without it the batch keeps its size to the end.
    # Optional: known_new_rows(rows: int), after the round's host read: no request accepted more
    # than `rows` rows in the verdict just committed (an eager step may read fewer feature rows).


class Drafter(Protocol):
    """What generate_batch needs from a drafter (DFlashDrafter is one)."""
    block_size: int  # L + 1: the root and L draft depths

    def check_target(self, target) -> None:
        """Raises ValueError when the drafter does not belong to `target`."""

    def begin(self, target, prompt_hidden_states, capacity: int, cuda_graph: bool) -> DraftState:
        """The state for a batch of requests (one hidden-states tuple per prompt); contexts up
        to `capacity` rows."""


class Verifier(Protocol):
    """The target's side of a round (ddtree.verify.TargetVerifier)."""

    def prefill(self, prompts):
        """(last prompt position's logits [B, 1, V], hidden states of each prompt)."""

    def step(self, tree: ops.DraftTree, vis: ops.TreeVisibility, committed_len: torch.Tensor):
        """(logits [B, N, V], hidden states) of the tree rows; committed_len [B]: each request's
        committed cache rows."""

    def commit(self, verdict: ops.Verdict) -> None:
        """Keeps the accepted path's rows / states."""

    # Optional: capture(rows, committed_len [B]) captures, before the rounds, the steps of trees
    # of these row counts (cuda_graph) without changing any committed row or state.


@dataclass
class GenerationResult:
    tokens: List[int]                      # generated tokens, prompt excluded
    acceptance_lengths: List[int]          # tokens emitted per round (accepted + bonus)
    seconds: float                         # wall time of the call, prefill included
    stage_seconds: Dict[str, float] = field(default_factory=dict)  # summed over rounds, synced
    # Prefill and the warm-up round (the drafter's prompt pass; the graphs' capture before it):
    warmup_seconds: float = 0.0
    warmup_rounds: int = 0
    # budget="auto": each round's tree budget (0: an autoregressive round) and, per round, the
    # calibrated expected tokens the round would emit, predicted before it was verified.
    round_budgets: List[int] = field(default_factory=list)
    predicted_lengths: List[float] = field(default_factory=list)
    # The verify batch of each of the request's rounds: finished requests leave the batch, which
    # moves to the smallest power of two holding the live ones (every mode; budget="auto" then
    # prices its rounds with the smaller batch's cost profile).
    round_batch_sizes: List[int] = field(default_factory=list)

    @property
    def tau(self) -> float:
        """Mean tokens per target forward (acceptance length, bonus included)."""
        return sum(self.acceptance_lengths) / max(1, len(self.acceptance_lengths))

    @property
    def tokens_per_second(self) -> float:
        """Decoding speed after the warm-up (over the whole call when no round followed it)."""
        return tokens_per_second([[self]])

    def after_warmup(self):
        """(tokens emitted after the warm-up, seconds after it); the whole call when no round
        followed the warm-up."""
        tokens = min(len(self.tokens), 1 + sum(self.acceptance_lengths))
        warm = 1 + sum(self.acceptance_lengths[: self.warmup_rounds])
        if len(self.acceptance_lengths) > self.warmup_rounds and tokens > warm:
            return tokens - warm, max(1e-9, self.seconds - self.warmup_seconds)
        return len(self.tokens), self.seconds


def tokens_per_second(calls) -> float:
    """Decoding speed over several generate / generate_batch calls (each a list of its requests'
    results): the tokens emitted after each call's warm-up over the time after it. The requests
    of one batch share its wall time. The one definition the CLI, the demo and the benchmarks use."""
    tokens = seconds = 0.0
    for results in calls:
        spans = [r.after_warmup() for r in results]
        tokens += sum(t for t, _ in spans)
        seconds += max(sec for _, sec in spans)
    return tokens / seconds if seconds > 0 else float("inf")


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


class _Sampler:
    """Greedy or lossless sampling over a tree's target logits (verify_greedy / verify_sample);
    the per-round Philox offset lives on the device."""

    def __init__(self, temperature, top_k, top_p, seeds: torch.Tensor, depth: int):
        self.temperature, self.top_k, self.top_p, self.seeds = temperature, top_k, top_p, seeds
        self.depth = depth
        self.offset = torch.zeros_like(seeds)

    def verify(self, tree: ops.DraftTree, logits: torch.Tensor,
               vocab_shard=None) -> ops.Verdict:
        """vocab_shard: logits are this rank's vocabulary columns (greedy only): their sharded
        top-1 (ties to the lower id, as argmax) is the target's token."""
        if self.temperature <= 0:
            if vocab_shard is not None:
                return ops.verify_greedy(tree, vocab_shard.tree_topk(logits, 1)[1][..., 0],
                                         self.depth)
            return ops.verify_greedy(tree, logits.argmax(-1), self.depth)
        self.offset += 1  # the op reads float32 / bfloat16 / float16 logits as they are (no copy)
        return ops.verify_sample(tree, logits, self.depth, self.temperature, self.top_k,
                                 self.top_p, self.seeds, self.offset)

    def select(self, index: torch.Tensor) -> None:
        """Keeps the batch rows `index` (each request's seed and draw counter go with it)."""
        self.seeds, self.offset = self.seeds[index], self.offset[index]

    def first_token(self, logits: torch.Tensor) -> torch.Tensor:
        """The token after each prompt [B] from the prefill's last logits [B, 1, V]: the argmax,
        or, sampling, the draw verify_sample makes at a tree root (same Philox counters)."""
        if self.temperature <= 0:
            return logits[:, -1].argmax(-1)
        return self.verify(_root_only(logits.new_zeros(logits.shape[0], dtype=torch.long)),
                           logits).bonus


class _RankCheckedSampler:
    """A tensor-parallel debug wrapper (DDTREE_TP_CHECK=1, ddtree.distributed.rank_check): every
    walk's tree and verdict are compared across ranks before anything is committed."""

    def __init__(self, sampler: _Sampler, check):
        self.sampler, self.check = sampler, check

    def verify(self, tree: ops.DraftTree, logits: torch.Tensor, vocab_shard=None) -> ops.Verdict:
        verdict = self.sampler.verify(tree, logits, vocab_shard)
        self.check(tokens=tree.node_tokens, parents=tree.parents, accepted=verdict.accepted,
                   accept_len=verdict.accept_len, bonus=verdict.bonus)
        return verdict

    def select(self, index: torch.Tensor) -> None:
        self.sampler.select(index)

    def first_token(self, logits: torch.Tensor) -> torch.Tensor:
        token = self.sampler.first_token(logits)
        self.check(first_token=token)
        return token


def _root_only(tokens: torch.Tensor) -> ops.DraftTree:
    """One-node trees [B, 1] of the given root tokens."""
    none = torch.full((tokens.shape[0], 1), -1, dtype=torch.long, device=tokens.device)
    return ops.DraftTree(tokens[:, None].clone(), none, none + 1, none, none,
                         torch.ones_like(tokens))


def root_tree(tokens: torch.Tensor, start: torch.Tensor):
    """(DraftTree, TreeVisibility) of one-node trees: the autoregressive step's 'tree'."""
    tree = _root_only(tokens)
    return tree, ops.tree_visibility(tree.parents, tree.num_nodes, start)


class _NoDrafter:
    """The autoregressive mode's drafter: no draft, the tree is the root alone."""

    def step(self, bonus, depth=None):
        return None

    def commit(self, hidden_states, verdict):
        pass

    def select(self, index):
        pass


class _StageClock:
    """Per-round stage boundaries: CUDA events on a GPU (read once, after the last round),
    perf_counter on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: List[list] = []
        self.round_starts: List[float] = []

    def mark(self, new_round: bool = False) -> None:
        if new_round:
            self.marks.append([])
            self.round_starts.append(time.perf_counter())
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks[-1].append(event)
        else:
            self.marks[-1].append(time.perf_counter())

    def elapsed_before(self, rounds: int, started: float) -> float:
        """Seconds from `started` to the start of round `rounds` (0-based; host clock: each round
        ends with its host read, so the host is in step) — the whole call when fewer ran."""
        if len(self.round_starts) <= rounds:
            return time.perf_counter() - started
        return self.round_starts[rounds] - started

    def totals(self) -> Dict[str, float]:
        out = dict.fromkeys(STAGES, 0.0)
        if self.cuda and self.marks:
            torch.cuda.synchronize()
        for m in self.marks:
            for name, a, b in zip(STAGES, m, m[1:]):
                out[name] += a.elapsed_time(b) / 1e3 if self.cuda else b - a
        return out


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
        input_ids = _as_token_ids("input_ids", input_ids)
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


_MAX_SEED = 2**43  # request b's Philox key is seed * 1000003 + b (int64)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _as_token_ids(name: str, value) -> torch.Tensor:
    """A prompt as an int64 tensor; a clear error for anything that is not integer token ids."""
    try:
        t = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"generate: {name} must be token ids (a list of ints or an integer tensor): "
                        f"{e}") from None
    if t.numel() > 0 and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        raise TypeError(f"generate: {name} must hold integer token ids, got dtype {t.dtype}")
    return t.long()


def _check_request(target, drafter, prompts, max_new_tokens, mode, budget, temperature, top_k,
                   top_p, seed, stop_token_ids):
    """The API boundary's checks (the rounds run the ops without value checks); returns (prompts
    as 1-D long tensors, budgets, is_hybrid, stop token ids)."""
    if mode not in MODES:
        raise ValueError(f"generate: mode must be one of {MODES}, got {mode!r}")
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not _is_int(top_k) or not all(isinstance(x, numbers.Real) and not isinstance(x, bool)
                                     for x in (temperature, top_p)):
        raise ValueError(f"generate: temperature and top_p must be numbers and top_k an integer; got "
                         f"temperature={temperature!r}, top_k={top_k!r}, top_p={top_p!r}")
    if not math.isfinite(temperature) or top_k < 0 or not 0.0 < top_p <= 1.0:
        raise ValueError(f"generate: sampling needs a finite temperature (<= 0: greedy), top_k >= 0 "
                         f"and 0 < top_p <= 1; got temperature={temperature}, top_k={top_k}, "
                         f"top_p={top_p}")
    if isinstance(prompts, torch.Tensor) or not isinstance(prompts, (list, tuple)):
        raise TypeError(f"generate_batch: prompts must be a list of prompts (token lists or 1-D "
                        f"tensors), got {type(prompts).__name__}")
    prompts = [_as_token_ids(f"prompt {i}", p).reshape(-1) for i, p in enumerate(prompts)]
    if not prompts or any(p.numel() == 0 for p in prompts):
        raise ValueError("generate: every prompt must be non-empty")
    if budget == "auto":
        if mode != "tree":
            raise ValueError(f"generate: budget='auto' chooses tree sizes; it needs mode='tree', got "
                             f"mode={mode!r}")
        budgets = [max(AUTO_BUCKETS)] * len(prompts)
    else:
        budgets = [budget] * len(prompts) if _is_int(budget) else \
            list(budget) if isinstance(budget, (list, tuple)) else None
        if budgets is None or len(budgets) != len(prompts) or \
                not all(_is_int(b) and b >= 0 for b in budgets):
            raise ValueError(f"generate: budget must be an integer >= 0, a list of one per prompt "
                             f"({len(prompts)}) or 'auto', got {budget!r}")
        budgets = [int(b) for b in budgets]
    if not _is_int(seed) or not 0 <= seed <= _MAX_SEED:
        raise ValueError(f"generate: seed must be an integer in [0, {_MAX_SEED}], got {seed!r}")
    stops = list(stop_token_ids)
    if not all(_is_int(t) for t in stops):
        raise ValueError(f"generate: stop_token_ids must be integers, got {stops!r}")
    is_hybrid = _check_target(target)
    vocab = target.get_input_embeddings().num_embeddings
    for i, p in enumerate(prompts):
        if p.min() < 0 or p.max() >= vocab:
            raise ValueError(f"generate: prompt {i} holds token ids outside the target's vocabulary "
                             f"[0, {vocab}): min {int(p.min())}, max {int(p.max())}")
    cfg = text_config(target.config)
    limit = getattr(cfg, "max_position_embeddings", None)
    longest = max(p.numel() for p in prompts)
    if limit is not None and longest + max_new_tokens > limit:
        raise ValueError(f"generate: the longest prompt ({longest} tokens) + max_new_tokens "
                         f"({max_new_tokens}) exceeds the target's max_position_embeddings ({limit})")
    if mode != "autoregressive":
        if drafter is None:
            raise ValueError(f"generate: mode '{mode}' needs a drafter")
        missing = [a for a in ("block_size", "check_target", "begin") if not hasattr(drafter, a)]
        if missing:
            raise TypeError(f"generate: the drafter must follow the ddtree.generate.Drafter "
                            f"protocol (block_size, check_target, begin); "
                            f"{type(drafter).__name__} lacks {', '.join(missing)}")
        drafter.check_target(target)
    return prompts, budgets, is_hybrid, stops


def kept_rows(done: Sequence[bool]) -> Optional[List[int]]:
    """The rows of a smaller batch when requests have finished (done[i]: row i's): the live
    rows, padded with finished ones up to the next power of two (one shape, one captured graph,
    per bucket); None when nothing is live or that size is not smaller than the batch."""
    live = [i for i, d in enumerate(done) if not d]
    size = 1 << max(len(live) - 1, 0).bit_length()
    if not live or size >= len(done):
        return None
    return sorted(live + [i for i, d in enumerate(done) if d][: size - len(live)])


class _Requests:
    """Host-side bookkeeping: each request's tokens, round lengths, streaming and stop rule; the
    batch row of each request (rows[i] = the request in row i); and the device-side mirror, per
    row, of 'still generating' (alive) and tokens emitted."""

    def __init__(self, first: List[int], max_new_tokens, stops, streamer, device):
        self.tokens = [[t] for t in first]
        self.rows = list(range(len(first)))
        self.lengths: List[List[int]] = [[] for _ in first]
        self.budgets: List[List[int]] = [[] for _ in first]
        self.predicted: List[List[float]] = [[] for _ in first]
        self.batch_sizes: List[List[int]] = [[] for _ in first]
        self.max_new, self.stops, self.streamer = max_new_tokens, stops, streamer
        self.stops_t = torch.tensor(sorted(stops), dtype=torch.long, device=device)
        self.done = [False] * len(first)  # the request's stop rule has fired (the host side)
        for b, toks in enumerate(self.tokens):
            self._stream(b, toks)
            self._check_done(b, toks)
        self.alive = torch.tensor([not d for d in self.done], device=device)
        self.count = torch.ones(len(first), dtype=torch.long, device=device)
        self.columns: Optional[torch.Tensor] = None

    def _check_done(self, b: int, new: List[int]) -> None:
        """O(new tokens): max_new_tokens reached or a stop token among the new ones."""
        if len(self.tokens[b]) >= self.max_new or any(t in self.stops for t in new):
            self.done[b] = True

    def finished(self, b: int) -> bool:
        return self.done[b]

    def all_finished(self) -> bool:
        return all(self.done)

    def remaining(self) -> Dict[int, int]:
        """Request id -> tokens still to generate (max_new_tokens), for the live requests."""
        return {b: self.max_new - len(self.tokens[b]) for b in self.rows if not self.done[b]}

    def rows_to_keep(self) -> Optional[List[int]]:
        """kept_rows of the batch's rows."""
        return kept_rows([self.done[b] for b in self.rows])

    def select(self, keep: List[int], index: torch.Tensor) -> None:
        self.rows = [self.rows[i] for i in keep]
        self.alive, self.count = self.alive[index], self.count[index]

    def _stream(self, b, new):
        if self.streamer:
            self.streamer(b, list(new))

    def emitted(self, tree: ops.DraftTree, verdict: ops.Verdict) -> torch.Tensor:
        """[B, 1 + A]: accept_len, then the round's new tokens (accepted nodes after the root,
        then the bonus) padded; updates alive / count on the device. Every small op counts on
        the CPU (10-30 us inside a round): the new tokens are one gather, and the stop check
        runs only when there are stop tokens."""
        n_acc = verdict.accept_len
        # accepted [B, A] after the root, -1 padded, then one more -1: request b's first -1 sits
        # at n_acc[b] - 1, where the bonus goes — column N of [node_tokens | bonus].
        index = torch.nn.functional.pad(verdict.accepted[:, 1:], (0, 1), value=-1)
        tokens = torch.cat([tree.node_tokens, verdict.bonus[:, None]], 1)
        new = tokens.gather(1, index.masked_fill_(index < 0, tokens.shape[1] - 1))
        if self.stops_t.numel():
            real = self._columns(new.shape[1], new.device) < n_acc[:, None]
            self.alive &= ~(torch.isin(new, self.stops_t) & real).any(1)
        self.count += n_acc
        self.alive &= self.count < self.max_new
        return torch.cat([n_acc[:, None], new], 1)

    def _columns(self, width: int, device) -> torch.Tensor:
        """[1, width]: 0 .. width - 1 (made once per width)."""
        if self.columns is None or self.columns.shape[1] != width:
            self.columns = torch.arange(width, device=device)[None]
        return self.columns

    def take(self, host_rows: List[List[int]], bucket: Optional[int] = None,
             predicted: Optional[List[float]] = None) -> None:
        """The round's host copy of emitted(): extend, stream; with budget="auto" also the
        round's budget and each request's predicted length."""
        for i, row in enumerate(host_rows):
            if row[0] == 0:  # finished before this round
                continue
            b, new = self.rows[i], row[1: 1 + row[0]]
            if bucket is not None:
                self.budgets[b].append(bucket)
                self.predicted[b].append(predicted[i] if predicted else 1.0)
            self.lengths[b].append(len(new))
            self.batch_sizes[b].append(len(host_rows))
            self.tokens[b].extend(new)
            self._stream(b, new)
            self._check_done(b, new)

    def results(self, seconds: float, stages: Dict[str, float], warmup_seconds: float,
                warmup_rounds: int) -> List[GenerationResult]:
        out = []
        for toks, lengths, budgets, predicted, sizes in zip(
                self.tokens, self.lengths, self.budgets, self.predicted, self.batch_sizes):
            cut = next((i + 1 for i, t in enumerate(toks) if t in self.stops), len(toks))
            out.append(GenerationResult(toks[: min(cut, self.max_new)], lengths, seconds,
                                        dict(stages), warmup_seconds, warmup_rounds, budgets,
                                        predicted, sizes))
        return out


def _leave_finished(requests: _Requests, parts) -> Optional[torch.Tensor]:
    """Finished requests leave the verify batch once the live ones fit a smaller bucket: every
    part (draft state, verifier, sampler) keeps the chosen rows. Returns the rows' index (for the
    loop's own per-row tensors), or None when the batch stays (or a part cannot select)."""
    keep = requests.rows_to_keep()
    if keep is None or not all(hasattr(p, "select") for p in parts):
        return None
    index = torch.tensor(keep, device=requests.alive.device)
    for part in parts:
        part.select(index)
    requests.select(keep, index)
    return index


def _head_shard(shard, draft_logits):
    """The vocabulary shard when the draft logits are this rank's columns of a tensor-parallel
    LM head (ddtree.distributed), else None."""
    if shard is None or draft_logits is None or draft_logits.shape[-1] != shard.local_size:
        return None
    return shard


def _tree_builder(mode: str, budget: int, budgets: torch.Tensor, shard):
    """The round's tree step for a fixed mode, chosen once: (draft logits, bonus, committed_len) ->
    (tree, visibility)."""
    if mode == "tree":
        return lambda logits, bonus, committed_len: ops.draft_to_tree(
            logits, bonus, budget, committed_len, budgets, vocab_shard=_head_shard(shard, logits))
    if mode == "chain":  # the argmax chain (no log-softmax / top-k machinery)
        return lambda logits, bonus, committed_len: ops.chain_to_tree(
            logits, bonus, committed_len, vocab_shard=_head_shard(shard, logits))
    return lambda logits, bonus, committed_len: root_tree(bonus, committed_len)


def _known_new_rows(draft, rows: List[List[int]]) -> None:
    """Tells a draft state that takes it (known_new_rows) the most rows any request accepted
    this round: row[0] of the host copy of emitted() is the accept_len the state committed."""
    if hasattr(draft, "known_new_rows"):
        draft.known_new_rows(max((row[0] for row in rows), default=0))


def _capture(verifier, draft, rows: List[int], committed_len: torch.Tensor) -> None:
    """A verifier and a draft state that take it (capture) capture their steps now, before the
    rounds that replay them: the verify graphs of these tree row counts, the drafter's step
    (cuda_graph; eager ones do nothing)."""
    if hasattr(verifier, "capture"):
        verifier.capture(rows, committed_len)
    if hasattr(draft, "capture"):
        draft.capture()


def _verify(clock, verifier, sampler, requests, tree, vis, committed_len):
    """The target's side of a round: the verify pass, the walk (finished requests accept
    nothing), the stage mark, the target's commit. Returns (verdict, hidden states, the round's
    emitted rows for the host read)."""
    logits, hidden_states = verifier.step(tree, vis, committed_len)
    verdict = sampler.verify(tree, logits, verifier.vocab_shard)
    verdict = verdict._replace(accept_len=verdict.accept_len * requests.alive)
    clock.mark()
    verifier.commit(verdict)
    return verdict, hidden_states, requests.emitted(tree, verdict)


class _AutoRounds:
    """One round of budget="auto": the policy's bucket (from the last round's host read); an
    autoregressive round (the drafter defers the accepted row to its context) or a drafted round
    verifying the best bucket-sized prefix of a tree built at the largest bucket; the
    calibration and the policy's statistics ride on the round's one host read."""

    def __init__(self, policy, device, shard, full_depth: int):
        self.policy, self.shard, self.full_depth = policy, shard, full_depth
        self.buckets = tuple(AUTO_BUCKETS)
        prior = policy.calibration_prior() if hasattr(policy, "calibration_prior") else None
        self.calibration = cost_aware.Calibration(device, sums=prior)
        self.index = {b: torch.tensor([min(c, b) for c in self.buckets], device=device)
                      for b in self.buckets}
        # Rounds timed for the policy (observe_cost) leave out warm-ups: the generation's first
        # round, a bucket's first round at the current batch size (allocations; the verify
        # graphs are captured before the rounds) and the first two drafted ones there (the
        # drafter's prompt pass, its first allocations); and an autoregressive round right after a
        # drafted one, which also moves that round's accepted rows into the drafter's deferred
        # buffer and pays the switch (drafting's cost, not a decoding step's — plain decoding is
        # priced from these rounds).
        self.warm: set = set()
        self.rounds = self.drafted = 0
        self.last = None  # the bucket of the round before

    def resized(self) -> None:
        self.warm, self.drafted = set(), 0

    def _timed(self, bucket: int) -> bool:
        """Whether the round just run (counted) is timed."""
        return self.rounds > 1 and bucket in self.warm and \
            (self.drafted > 2 if bucket else self.last == 0)

    def round(self, clock, draft, verifier, sampler, requests, committed_len, bonus):
        bucket = self.policy.choose()
        clock.mark(new_round=True)
        nodes = None
        if bucket == 0:
            clock.mark()
            tree, vis = root_tree(bonus, committed_len)
        else:
            # A tree of `bucket` nodes is at most `bucket` deep: the drafter may draft only that.
            draft_logits = draft.step(bonus, bucket)
            clock.mark()
            built = self.buckets[-1]  # the expected gain of every bucket, for the next choice
            full = ops.draft_tree(draft_logits, bonus, built,
                                  vocab_shard=_head_shard(self.shard, draft_logits))
            nodes = ops.expected_accepts(full).index_select(1, self.index[built])  # [B, buckets]
            column = self.buckets.index(bucket)
            position = cost_aware.Calibration.position(self.rounds)
            tree = ops.first_nodes(full, bucket)
            vis = ops.tree_visibility(tree.parents, tree.num_nodes, committed_len)
        clock.mark()
        # The requests taking part in this round (emitted() drops those it finishes): the
        # round's statistics cover them, its last round included.
        took_part = None if bucket == 0 else requests.alive.to(nodes.dtype)  # 1 / 0, a copy
        verdict, hidden_states, emitted = _verify(clock, verifier, sampler, requests, tree, vis,
                                                  committed_len)
        batch = emitted.shape[0]
        if bucket == 0:
            draft.defer(hidden_states)
        else:
            draft.commit(hidden_states, verdict)
            # The policy's statistics look ahead (the steady calibration); the round's own
            # prediction is its position's. The sums travel as they were before this round.
            emitted = torch.cat([emitted, cost_aware.pack_stats(
                nodes, took_part, self.calibration.sums, emitted.shape[1])])
            self.calibration.update(nodes[:, column], verdict.accept_len, position, took_part)
        rows = emitted.tolist()  # the round's one host read
        stats = None if bucket == 0 else \
            cost_aware.unpack_stats(rows[batch:], len(self.buckets), batch, column, position)
        if stats is not None:
            stats.requests = list(requests.rows)
            stats.observed = cost_aware.observed_buckets(self.buckets, draft_logits.shape[1],
                                                         self.full_depth)
        requests.take(rows[:batch], bucket, stats.predicted if stats else None)
        if bucket:
            _known_new_rows(draft, rows[:batch])
        if hasattr(self.policy, "observe_remaining"):
            self.policy.observe_remaining(requests.remaining())
        self.rounds, self.drafted = self.rounds + 1, self.drafted + (bucket > 0)
        if self._timed(bucket) and hasattr(self.policy, "observe_cost"):
            self.policy.observe_cost(bucket, 1e3 * (time.perf_counter() - clock.round_starts[-1]))
        self.warm.add(bucket)
        self.last = bucket
        self.policy.observe(stats)
        clock.mark()
        return committed_len + verdict.accept_len, verdict.bonus


def _fixed_rounds(clock, draft, verifier, sampler, requests, committed_len, bonus, budgets,
                  tree_builder, graph_rows: List[int], bucket: Optional[int],
                  depth: Optional[int] = None) -> None:
    """Rounds of one fixed mode until every request is done: tree_builder(budgets [B]) is the
    round's tree step (_tree_builder), made anew when finished requests leave the batch (and
    the verify graphs of `graph_rows` captured anew at the smaller batch size);
    `bucket`: the budget each round records (budget="auto" run autoregressive), or None;
    `depth`: the deepest draft depth a tree can use (a tree of n nodes: n), or None (all)."""
    build_tree = tree_builder(budgets)
    while not requests.all_finished():
        clock.mark(new_round=True)
        draft_logits = draft.step(bonus, depth)
        clock.mark()
        tree, vis = build_tree(draft_logits, bonus, committed_len)
        clock.mark()
        verdict, hidden_states, emitted = _verify(clock, verifier, sampler, requests, tree, vis,
                                                  committed_len)
        draft.commit(hidden_states, verdict)
        committed_len, bonus = committed_len + verdict.accept_len, verdict.bonus
        rows = emitted.tolist()  # the one host read
        requests.take(rows, bucket)
        _known_new_rows(draft, rows)
        clock.mark()
        kept = _leave_finished(requests, (draft, verifier, sampler))
        if kept is not None:
            committed_len, bonus, budgets = (t[kept] for t in (committed_len, bonus, budgets))
            _capture(verifier, draft, graph_rows, committed_len)
            build_tree = tree_builder(budgets)


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
    prompts, budgets, is_hybrid, stops = _check_request(
        target, drafter, prompts, max_new_tokens, mode, budget, temperature, top_k, top_p, seed,
        stop_token_ids)
    if budget == "auto" and policy is None:
        policy = cost_aware.auto_policy(target, drafter, len(prompts), cost_profile)
    # budget="auto" where no tree can pay at this batch size: plain autoregressive rounds.
    auto_plain = budget == "auto" and hasattr(policy, "plain_autoregressive") and \
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
    # Tensor-parallel target (ddtree.distributed): the draft top-k and, when greedy, the verify
    # walk's argmax over the sharded LM head.
    shard = distributed.vocab_shard(target)
    verifier = TargetVerifier(target, batch=batch, rows=n, max_depth=depth,
                              max_cache_len=longest + max_new_tokens + depth + n,
                              want_hidden=mode != "autoregressive", cuda_graph=cuda_graph,
                              is_hybrid=is_hybrid, vocab_shard=shard if temperature <= 0 else None)
    sampler = _Sampler(temperature, top_k, top_p,
                       torch.tensor([seed * 1000003 + b for b in range(batch)], device=device), depth)
    check_ranks = distributed.rank_check(target)
    if check_ranks is not None:
        sampler = _RankCheckedSampler(sampler, check_ranks)
    prompts = [p.to(device) for p in prompts]
    last, prompt_hidden = verifier.prefill(prompts)
    committed_len = torch.tensor([p.numel() for p in prompts], device=device)
    bonus = sampler.first_token(last)
    requests = _Requests(bonus.tolist(), max_new_tokens, set(int(t) for t in stops),
                         streamer, device)
    prefilled = time.perf_counter()  # the prefill's tokens were read: it is done
    draft = _NoDrafter() if mode == "autoregressive" else \
        drafter.begin(target, prompt_hidden, longest + max_new_tokens + 2 * depth + 1, cuda_graph)
    budget_t = torch.tensor(budgets, device=device)
    # cuda_graph: the verify graph of every tree row count the rounds can use and the drafter's
    # step, captured now (and again whenever finished requests leave the batch): no decoding
    # round captures; the first round is the warm-up, as in eager mode (the drafter's prompt
    # pass, eager in both).
    graph_rows = [b + 1 for b in AUTO_BUCKETS] if budget == "auto" else [n]
    _capture(verifier, draft, graph_rows, committed_len)
    clock = _StageClock(device)
    if budget == "auto":
        if not hasattr(draft, "defer"):
            raise TypeError(f"generate: budget='auto' needs a draft state with defer() (the "
                            f"context of autoregressive rounds); {type(draft).__name__} has none")
        policy.start(batch, depth, device)
        auto = _AutoRounds(policy, device, shard, depth)
        with validation(False):
            while not requests.all_finished():
                committed_len, bonus = auto.round(clock, draft, verifier, sampler, requests,
                                                  committed_len, bonus)
                kept = _leave_finished(requests, (draft, verifier, sampler))
                if kept is not None:
                    committed_len, bonus = committed_len[kept], bonus[kept]
                    _capture(verifier, draft, graph_rows, committed_len)
                    auto.resized()
                    if hasattr(policy, "resize"):
                        policy.resize(kept.numel())
        loop_ms = 1e3 * (time.perf_counter() - prefilled)  # the drafter's prompt pass included
        results = requests.results(time.perf_counter() - started, clock.totals(),
                                   clock.elapsed_before(1, started), 1)
        if hasattr(policy, "observe_generation"):  # tokens after the first: a plain round each
            policy.observe_generation(loop_ms, [len(r.tokens) - 1 for r in results],
                                      prefill_ms=1e3 * (prefilled - started))
        if hasattr(policy, "finish"):
            policy.finish(auto.calibration.sums.tolist())
            cost_aware.remember(policy)
        return results
    with validation(False):
        _fixed_rounds(clock, draft, verifier, sampler, requests, committed_len, bonus, budget_t,
                      lambda budgets: _tree_builder(mode, n - 1, budgets, shard), graph_rows,
                      0 if auto_plain else None, n - 1 if mode == "tree" else None)
    if auto_plain:
        policy.record_autoregressive(len(clock.round_starts))
        cost_aware.remember(policy)
    return requests.results(time.perf_counter() - started, clock.totals(),
                            clock.elapsed_before(1, started), 1)
