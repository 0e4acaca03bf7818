"""Pure-PyTorch versions of the ops, written from docs/spec.md. They are the test oracles:
simple, slow and obviously correct, never used on a hot path."""
from __future__ import annotations

import heapq
import math
import struct
from typing import Tuple, Union

import torch


def tree_depths(parents: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    """Depth of every node (0 for roots and padding rows), int64 [B, N]."""
    parents = parents.to(torch.int64).cpu()
    batch, n = parents.shape
    depth = torch.zeros(batch, n, dtype=torch.int64)
    for b in range(batch):
        for i in range(int(num_nodes[b])):
            p = int(parents[b, i])
            if p >= 0:
                depth[b, i] = depth[b, p] + 1
    return depth


def tree_visibility_bool(parents: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    """spec §4: vis[i, i] = True and vis[i, :i] = vis[parent[i], :i]; padding rows see only
    themselves. bool [B, N, N]."""
    parents = parents.to(torch.int64).cpu()
    batch, n = parents.shape
    vis = torch.zeros(batch, n, n, dtype=torch.bool)
    for b in range(batch):
        for i in range(n):
            vis[b, i, i] = True
            p = int(parents[b, i])
            if i < int(num_nodes[b]) and p >= 0:
                vis[b, i, :i] = vis[b, p, :i]
    return vis


def pack_rows(vis: torch.Tensor) -> torch.Tensor:
    """Bit-pack the last dimension: bit j of word j // 32 (little-endian), int32 [..., ceil(N/32)]."""
    *lead, n = vis.shape
    words = (n + 31) // 32
    padded = torch.zeros(*lead, words * 32, dtype=torch.int64)
    padded[..., :n] = vis.to(torch.int64)
    weights = torch.tensor([1 << k for k in range(32)], dtype=torch.int64)
    packed = (padded.view(*lead, words, 32) * weights).sum(-1)
    packed = torch.where(packed >= 1 << 31, packed - (1 << 32), packed)
    return packed.to(torch.int32)


def tree_visibility(
    parents: torch.Tensor, num_nodes: torch.Tensor, start: Union[int, torch.Tensor] = 0
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(visible bool [B, N, N], packed int32 [B, N, ceil(N/32)], positions int64 [B, N])."""
    vis = tree_visibility_bool(parents, num_nodes)
    start_t = torch.as_tensor(start, dtype=torch.int64).cpu()
    positions = tree_depths(parents, num_nodes) + start_t.reshape(-1, 1)
    return vis, pack_rows(vis), positions


def tree_attention_mask(
    parents: torch.Tensor, num_nodes: torch.Tensor, past: int, dtype: torch.dtype = torch.float32,
    committed_len=None, start=None,
) -> torch.Tensor:
    """Additive mask [B, 1, N, past + N]: request b's tree block at columns [s, s + N) with
    s = start[b] (default past); 0 on the prefix columns before s (only the first committed_len[b]
    when given) and on visible nodes, finfo.min elsewhere (after the block too)."""
    vis = tree_visibility_bool(parents, num_nodes)
    batch, n, _ = vis.shape
    lowest = torch.finfo(dtype).min
    mask = torch.full((batch, 1, n, past + n), lowest, dtype=dtype)
    for b in range(batch):
        s = past if start is None else int(start[b])
        open_cols = s if committed_len is None else min(s, max(0, int(committed_len[b])))
        mask[b, :, :, :open_cols] = 0
        mask[b, 0, :, s:s + n] = torch.where(vis[b], torch.zeros((), dtype=dtype),
                                             torch.tensor(lowest, dtype=dtype))
    return mask


def _is_candidate(x: float) -> bool:
    return not math.isnan(x) and x != -math.inf


def build_tree_single(logq, ids, budget: int, root_token: int):
    """spec §3 for one request, with heapq: logq / ids are [L][K] lists (floats / ints).
    Returns (node_tokens, parents, depths, path log-probs) including the root row (log-prob 0);
    scores are Python floats (float64) updated with exactly the spec's expressions; heap ties
    break on the rank path."""
    depth_l = len(logq)
    k = len(logq[0]) if depth_l else 0
    tokens, parents, depths, paths, scores = [root_token], [-1], [0], [()], [0.0]
    heap = []
    if budget > 0 and depth_l > 0 and k > 0 and _is_candidate(logq[0][0]):
        heapq.heappush(heap, (-float(logq[0][0]), (0,), 0, 1, 0))
    while heap and len(tokens) - 1 < budget:
        neg, ranks, parent, depth, rank = heapq.heappop(heap)
        score = -neg
        node = len(tokens)
        tokens.append(int(ids[depth - 1][rank]))
        parents.append(parent)
        depths.append(depth)
        paths.append(ranks)
        scores.append(score)
        if rank + 1 < k and _is_candidate(logq[depth - 1][rank + 1]):
            sibling = score - logq[depth - 1][rank] + logq[depth - 1][rank + 1]
            heapq.heappush(heap, (-sibling, ranks[:-1] + (rank + 1,), parent, depth, rank + 1))
        if depth < depth_l and _is_candidate(logq[depth][0]):
            child = score + logq[depth][0]
            heapq.heappush(heap, (-child, ranks + (0,), node, depth + 1, 0))
    return tokens, parents, depths, scores


def build_tree(logprobs, ids, root_tokens, budget: int, budgets=None):
    """Batched reference build_tree: (node_tokens, parents, depths, first_child, next_sibling,
    num_nodes, path_logprobs) padded to budget + 1 rows (padding: token 0, links -1, depth 0,
    log-prob -inf). path_logprobs float32: each node's path log-probability (spec §3's score)."""
    batch = logprobs.shape[0]
    n = budget + 1
    out = {name: torch.full((batch, n), fill, dtype=torch.int64)
           for name, fill in (("tokens", 0), ("parents", -1), ("depths", 0),
                              ("first_child", -1), ("next_sibling", -1))}
    counts = torch.zeros(batch, dtype=torch.int64)
    path_logprobs = torch.full((batch, n), float("-inf"), dtype=torch.float32)
    for b in range(batch):
        cap = budget if budgets is None else int(budgets[b])
        tokens, parents, depths, scores = build_tree_single(
            logprobs[b].tolist(), ids[b].tolist(), cap, int(root_tokens[b]))
        m = len(tokens)
        counts[b] = m
        out["tokens"][b, :m] = torch.tensor(tokens)
        out["parents"][b, :m] = torch.tensor(parents)
        out["depths"][b, :m] = torch.tensor(depths)
        path_logprobs[b, :m] = torch.tensor(scores, dtype=torch.float64).float()
        for i in range(m - 1, 0, -1):
            out["next_sibling"][b, i] = out["first_child"][b, parents[i]]
            out["first_child"][b, parents[i]] = i
    return (out["tokens"], out["parents"], out["depths"], out["first_child"],
            out["next_sibling"], counts, path_logprobs)


def verify_greedy(node_tokens, parents, num_nodes, target_tokens, max_depth: int):
    """spec §5 greedy walk from children lists built from `parents`: (accepted [B, max_depth+1]
    -1 padded, accept_len [B], bonus [B])."""
    batch = node_tokens.shape[0]
    accepted = torch.full((batch, max_depth + 1), -1, dtype=torch.int64)
    lengths = torch.zeros(batch, dtype=torch.int64)
    bonus = torch.zeros(batch, dtype=torch.int64)
    for b in range(batch):
        count = int(num_nodes[b])
        children = {}
        for i in range(1, count):
            children.setdefault(int(parents[b, i]), []).append(i)
        path = [0]
        while len(path) < max_depth + 1:
            want = int(target_tokens[b, path[-1]])
            nxt = [c for c in children.get(path[-1], []) if int(node_tokens[b, c]) == want]
            if not nxt:
                break
            path.append(nxt[0])
        accepted[b, : len(path)] = torch.tensor(path)
        lengths[b] = len(path)
        bonus[b] = target_tokens[b, path[-1]]
    return accepted, lengths, bonus


def commit_kv(cache, past_len, accepted, accept_len, layout: str = "BHSD", committed_len=None):
    """spec §6 on a copy: rows past + accepted[j] -> dst + j for j < accept_len."""
    out = cache.clone()
    view = out if layout == "BHSD" else out.transpose(1, 2)
    src = cache if layout == "BHSD" else cache.transpose(1, 2)
    for b in range(cache.shape[0]):
        past = int(past_len[b])
        for j in range(int(accept_len[b])):
            dst = past if committed_len is None else int(committed_len[b])
            view[b, :, dst + j] = src[b, :, past + int(accepted[b, j])]
    return out


def tree_topk(logits, k: int):
    """Log-softmax over the full vocabulary (as logits - logsumexp, in float32) and the k best
    per row: descending value, ties to the lower token id, NaN logits ranked below -inf."""
    x = logits.float()
    logprobs = x - torch.logsumexp(x, dim=-1, keepdim=True)
    nan = torch.isnan(x)
    order = torch.sort(x.masked_fill(nan, -math.inf), dim=-1, descending=True, stable=True).indices
    order = torch.gather(order, -1, torch.sort(torch.gather(nan, -1, order).to(torch.int8), dim=-1,
                                               stable=True).indices)
    ids = order[..., :k]
    return torch.gather(logprobs, -1, ids), ids


# ---- tree_topk over a vocabulary split into shards (tensor-parallel LM heads) ----
# A shard's "part": its k best candidates as 64-bit selection keys (a larger key is a better
# candidate: higher logit, then lower global token id; NaN below every number) and its log-sum-exp
# accumulator (m = max of its non-NaN logits, s = sum of exp(x - m); s is NaN after a NaN, 1 when
# m = +inf, 0 when nothing is finite), packed as the float32 bits of m (high word) and s (low).
# Merging the parts = the k best keys of all shards, logprob = logit - lse of the merged
# accumulators: tree_topk of the whole vocabulary.

def _float_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def _float_order_key(v: float) -> int:
    """Order-preserving 32-bit key of a float32 (-0 as +0); NaN -> 0, below every number."""
    if math.isnan(v):
        return 0
    u = _float_bits(v)
    u = 0 if u == 0x80000000 else u
    return (~u & 0xFFFFFFFF) if u & 0x80000000 else (u | 0x80000000)


def _from_order_key(key: int) -> float:
    if key == 0:
        return math.nan
    u = (key ^ 0x80000000) if key & 0x80000000 else (~key & 0xFFFFFFFF)
    return struct.unpack("<f", struct.pack("<I", u))[0]


def _as_int64(u: int) -> int:
    return u - (1 << 64) if u >= (1 << 63) else u


def topk_key(value: float, token_id: int) -> int:
    """The selection key as the int64 the ops store (unsigned order)."""
    return _as_int64((_float_order_key(value) << 32) | (0xFFFFFFFF - token_id))


def tree_topk_shard(logits, k: int, vocab_offset: int, vocab_size: int):
    """int64 [B, L, k + 1]: per row the shard's k best keys (global ids, descending, 0-padded)
    and its packed accumulator."""
    x = logits.float()
    B, L, V = x.shape
    assert 0 <= vocab_offset and vocab_offset + V <= vocab_size and 1 <= k <= vocab_size
    out = torch.zeros(B, L, k + 1, dtype=torch.long)
    ids = tree_topk(x, min(k, V))[1] if V else torch.zeros(B, L, 0, dtype=torch.long)
    for b in range(B):
        for r in range(L):
            row = x[b, r]
            keys = [topk_key(float(row[i]), i + vocab_offset) for i in ids[b, r].tolist()]
            out[b, r, :len(keys)] = torch.tensor(keys, dtype=torch.long)
            real = row[~torch.isnan(row)]
            m = float(real.max()) if real.numel() else -math.inf
            if bool(torch.isnan(row).any()):
                s = math.nan
            elif m == math.inf:
                s = 1.0
            elif m == -math.inf:
                s = 0.0
            else:
                s = float(torch.exp(row.double() - m).sum())
            out[b, r, k] = _as_int64((_float_bits(m) << 32) | _float_bits(s))
    return out


def tree_topk_merge(parts):
    """Parts of every shard [S, B, L, k + 1] -> (logprobs float32 [B, L, k], ids [B, L, k])."""
    S, B, L, k1 = parts.shape
    k = k1 - 1
    logprobs = torch.zeros(B, L, k)
    ids = torch.zeros(B, L, k, dtype=torch.long)
    for b in range(B):
        for r in range(L):
            keys = sorted((int(key) & 0xFFFFFFFFFFFFFFFF for key in parts[:, b, r, :k].reshape(-1)),
                          reverse=True)[:k]
            acc = []
            for j in range(S):
                word = int(parts[j, b, r, k]) & 0xFFFFFFFFFFFFFFFF
                acc.append((struct.unpack("<f", struct.pack("<I", word >> 32))[0],
                            struct.unpack("<f", struct.pack("<I", word & 0xFFFFFFFF))[0]))
            top = max(m for m, _ in acc)
            if any(math.isnan(s) for _, s in acc):
                lse = math.nan
            elif top in (math.inf, -math.inf):
                lse = top
            else:
                lse = top + math.log(sum(s * math.exp(m - top) for m, s in acc))
            for j, key in enumerate(keys):
                ids[b, r, j] = 0xFFFFFFFF - (key & 0xFFFFFFFF)
                logprobs[b, r, j] = (torch.tensor(_from_order_key(key >> 32), dtype=torch.float32)
                                     - torch.tensor(lse, dtype=torch.float32))
    return logprobs, ids


def chain_tree(logits, root_tokens):
    """The K = 1 tree of budget L (DFlash's chain): build_tree over the top-1 log-softmax."""
    logprobs, ids = tree_topk(logits, 1)
    return build_tree(logprobs, ids, root_tokens, logits.shape[1])


def filtered_probs(logits_row, temperature: float, top_k: int = 0, top_p: float = 1.0):
    """The target's sampling distribution for one row (float64 [V]): temperature, then top-k
    (values >= the k-th largest kept), then top-p (lowest values dropped, whole groups of equal
    value at a time, while their cumulative mass stays <= 1 - top_p). T <= 0: one-hot argmax."""
    x = logits_row.double()
    if temperature <= 0:
        probs = torch.zeros_like(x)
        probs[int(torch.argmax(x))] = 1.0  # torch.argmax returns the first maximal index
        return probs
    z = x / temperature
    keep = torch.ones_like(z, dtype=torch.bool)
    if 0 < top_k < z.numel():
        keep &= z >= torch.topk(z, top_k).values[-1]
    weights = torch.where(keep, torch.exp(z - z[keep].max()), torch.zeros_like(z))
    probs = weights / weights.sum()
    if top_p < 1.0:
        dropped = 0.0
        for value in torch.unique(z[keep]).tolist():  # ascending
            group = float(probs[z == value].sum())
            if dropped + group > 1.0 - top_p:
                break
            dropped += group
            keep &= z != value
        probs = torch.where(keep, probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    return probs


def sample_walk_distribution(node_tokens, parents, num_nodes, target_logits, max_depth: int,
                             temperature: float, top_k: int = 0, top_p: float = 1.0):
    """Exact distribution of what verify_sample emits for one tree: {(accepted tokens below the
    root..., bonus): probability} — the target sampling token after token, until a token leaves
    the tree. This is the distribution of sampling the target directly."""
    count = int(num_nodes)
    children = {}
    for i in range(1, count):
        children.setdefault(int(parents[i]), {})[int(node_tokens[i])] = i
    out = {}

    def walk(node, emitted, mass, length):
        probs = filtered_probs(target_logits[node], temperature, top_k, top_p)
        for token, q in enumerate(probs.tolist()):
            if q == 0.0:
                continue
            child = children.get(node, {}).get(token)
            if child is not None and length < max_depth + 1:
                walk(child, emitted + (token,), mass * q, length + 1)
            else:
                key = emitted + (token,)
                out[key] = out.get(key, 0.0) + mass * q

    walk(0, (), 1.0, 1)
    return out


# ---- recurrent layers (spec §7), chain formulas evaluated on each node's root->node path ----

def l2norm(x, eps: float = 1e-6):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_chain(q, k, v, g, beta, state):
    """One sequence: q, k [T, Hk, Dk], v [T, Hv, Dv], g / beta [T, Hv], state [Hv, Dk, Dv].
    Returns (out [T, Hv, Dv] fp32, final state fp32): S <- S*exp(g); delta = (v - S^T k)*beta;
    S <- S + k (x) delta; out = S^T q with q, k l2-normalised and q / sqrt(Dk); Hv / Hk GQA."""
    rep = v.shape[1] // k.shape[1]
    dk = k.shape[-1]
    qn = l2norm(q.float()).repeat_interleave(rep, 1) / math.sqrt(dk)
    kn = l2norm(k.float()).repeat_interleave(rep, 1)
    s = state.float().clone()
    outs = []
    for t in range(k.shape[0]):
        s = s * torch.exp(g[t].float())[:, None, None]
        kv = (s * kn[t][:, :, None]).sum(-2)
        delta = (v[t].float() - kv) * beta[t].float()[:, None]
        s = s + kn[t][:, :, None] * delta[:, None, :]
        outs.append((s * qn[t][:, :, None]).sum(-2))
    return torch.stack(outs) if outs else v.float()[:0], s


def tree_path(parents_row, count: int, i: int):
    """Node indices root..i (a padding row is a lone root)."""
    path = [i]
    while i < count and int(parents_row[i]) >= 0:
        i = int(parents_row[i])
        path.append(i)
    return path[::-1]


def tree_gated_delta_rule(q, k, v, g, beta, state, slots, parents, num_nodes):
    batch, n = parents.shape
    out = torch.zeros(v.shape, dtype=torch.float32)
    for b in range(batch):
        for i in range(n):
            path = tree_path(parents[b], int(num_nodes[b]), i)
            o, _ = gated_delta_chain(q[b, path], k[b, path], v[b, path], g[b, path], beta[b, path],
                                     state[int(slots[b])])
            out[b, i] = o[-1]
    return out


def conv_chain(x, window, weight, bias, activation):
    """Chain short conv: x [T, C] after the committed window [C, W]; y_t = act(sum_w weight[:, w]
    * seq[t - W + 1 + w] + bias). Returns (y [T, C], new window [C, W])."""
    width = weight.shape[1]
    seq = torch.cat([window.float().t(), x.float()], 0)
    ys = []
    for t in range(x.shape[0]):
        cols = seq[t + 1: t + 1 + width]  # the W inputs ending at token t
        y = (cols.t() * weight.float()).sum(-1) + (bias.float() if bias is not None else 0)
        ys.append(torch.nn.functional.silu(y) if activation else y)
    return torch.stack(ys), seq[-width:].t()


def tree_causal_conv1d(x, conv_state, slots, weight, bias, parents, num_nodes, activation="silu"):
    batch, n, _ = x.shape
    out = torch.zeros(x.shape, dtype=torch.float32)
    for b in range(batch):
        for i in range(n):
            path = tree_path(parents[b], int(num_nodes[b]), i)
            y, _ = conv_chain(x[b, path], conv_state[int(slots[b])], weight, bias, activation)
            out[b, i] = y[-1]
    return out


def commit_recurrent(state, conv_state, slots, k, v, g, beta, conv_x, accepted, accept_len):
    """New (state pool, conv pool): the chains run along each request's accepted path."""
    state, conv_state = state.clone(), conv_state.clone()
    for b in range(k.shape[0]):
        path = accepted[b, : int(accept_len[b])].tolist()
        slot = int(slots[b])
        if not path:
            continue
        _, state[slot] = gated_delta_chain(k[b, path], k[b, path], v[b, path], g[b, path],
                                           beta[b, path], state[slot])
        window = conv_state[slot]
        _, new_window = conv_chain(conv_x[b, path], window, torch.ones_like(window), None, False)
        conv_state[slot] = new_window.to(conv_state.dtype)
    return state, conv_state


def tree_attention(q, k_cache, v_cache, past_len, visible, scale=None, committed_len=None):
    """SDPA with an explicit dense mask per request: prefix [0, past) visible, tree block per the
    bool visibility [B, N, N], nothing beyond. q [B, N, Hq, D], caches [B, Hkv, S, D]."""
    batch, n, hq, d = q.shape
    hkv, s = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    for b in range(batch):
        past = int(past_len[b])
        mask = torch.zeros(n, s, dtype=torch.bool)
        mask[:, :past if committed_len is None else int(committed_len[b])] = True
        mask[:, past: past + n] = visible[b]
        k = k_cache[b].repeat_interleave(hq // hkv, 0)
        v = v_cache[b].repeat_interleave(hq // hkv, 0)
        o = torch.nn.functional.scaled_dot_product_attention(q[b].transpose(0, 1), k, v,
                                                             attn_mask=mask, scale=scale)
        out[b] = o.transpose(0, 1)
    return out


def _rms_rope(x, weight, eps, cos, sin):
    """RMSNorm then RoPE (rotate-half) in float64; x [..., D], cos / sin broadcastable."""
    x = x.double()
    x = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * weight.double()
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos.double() + rot * sin.double()


def draft_attention(q, k_new, v_new, k_cache, v_cache, cache_len, q_norm_weight, k_norm_weight,
                    cos, sin, num_context, eps, scale=None, context_len=None):
    """(out [B, Lq, Hq, D] float64, new K rows [B, C, Hkv, D], new V rows): norm + RoPE, then
    non-causal SDPA of the block queries over [cache[:cache_len]; new context; block]; with
    context_len [B] only the first context_len[b] new context rows of request b take part."""
    batch, lq, hq, _ = q.shape
    hkv = k_new.shape[2]
    if batch == 0:
        return (torch.zeros(q.shape, dtype=torch.float64),
                torch.zeros(0, num_context, hkv, q.shape[-1], dtype=torch.float64),
                v_new[:, :num_context])
    outs, new_k = [], []
    for b in range(batch):
        cached = int(cache_len[b])
        c = num_context if context_len is None else int(context_len[b])
        kn = _rms_rope(k_new[b], k_norm_weight, eps, cos[b][:, None], sin[b][:, None])
        qn = _rms_rope(q[b], q_norm_weight, eps, cos[b, num_context:][:, None],
                       sin[b, num_context:][:, None])
        rows = list(range(c)) + list(range(num_context, k_new.shape[1]))
        keys = torch.cat([k_cache[b, :, :cached].transpose(0, 1).double(), kn[rows]], 0)
        values = torch.cat([v_cache[b, :, :cached].transpose(0, 1).double(),
                            v_new[b, rows].double()], 0)
        rep = hq // hkv
        o = torch.nn.functional.scaled_dot_product_attention(
            qn.transpose(0, 1), keys.transpose(0, 1).repeat_interleave(rep, 0),
            values.transpose(0, 1).repeat_interleave(rep, 0), scale=scale)
        outs.append(o.transpose(0, 1))
        new_k.append(kn[:num_context])
    return torch.stack(outs), torch.stack(new_k), v_new[:, :num_context]
