"""Bad inputs get an error naming the argument (or a correct result): in-place outputs that alias
or overlap, 'meta' tensors among real ones, drafter checkpoints with stray or missing files and
broken configs, loop arguments of the wrong type or range. The table in docs/hardening.md lists
these cases; test_every_table_row_names_a_test keeps the two in step."""
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import ddtree
from ddtree import ops
from ddtree.generate import generate, generate_batch
from ddtree.models import DFlashDrafter
from helpers import tiny_drafter, tiny_target

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ["cpu", "emulated"]


def ops_for(backend):
    return torch.ops.ddtree if backend == "cpu" else torch.ops.ddtree_emu


def commit_args(batch=1):
    return (torch.zeros(batch, dtype=torch.long), torch.tensor([[0, 1]] * batch),
            torch.full((batch,), 2, dtype=torch.long))


# ---- in-place outputs ----

@pytest.mark.parametrize("backend", BACKENDS)
def test_commit_kv_rejects_aliased_and_expanded_caches(backend):
    o = ops_for(backend)
    cache = torch.randn(1, 2, 8, 4)
    with pytest.raises(RuntimeError, match=r"caches\[0\] and caches\[1\] share memory"):
        o.commit_kv_layers_([cache, cache], *commit_args(), "BHSD")
    buffer = torch.randn(1, 2, 12, 4)
    with pytest.raises(RuntimeError, match=r"caches\[0\] and caches\[1\] share memory"):
        o.commit_kv_layers_([buffer[:, :, :8], buffer[:, :, 4:]], *commit_args(), "BHSD")
    expanded = torch.randn(1, 1, 8, 4).expand(1, 2, 8, 4)
    with pytest.raises(RuntimeError, match="cache is written in place and must not be an expanded"):
        o.commit_kv_(expanded, *commit_args(), "BHSD")
    # Separate halves of one buffer are separate caches: accepted, each committed once.
    pair = torch.randn(2, 1, 2, 8, 4)
    want = pair.clone()
    o.commit_kv_layers_([pair[0], pair[1]], torch.tensor([2]), torch.tensor([[0, 3]]),
                        torch.tensor([2]), "BHSD")
    for i in range(2):
        want[i, :, :, 3] = want[i, :, :, 5]  # path node 1 (row 2 + 3) -> row 2 + 1
    assert torch.equal(pair, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_commit_recurrent_rejects_aliased_pools(backend):
    o = ops_for(backend)
    state, conv = torch.zeros(1, 2, 4, 4), torch.zeros(1, 6, 3)
    k, v = torch.randn(1, 3, 1, 4), torch.randn(1, 3, 2, 4)
    g, beta, x = torch.zeros(1, 3, 2), torch.zeros(1, 3, 2), torch.randn(1, 3, 6)
    slots, (_, accepted, accept_len) = torch.zeros(1, dtype=torch.long), commit_args()
    with pytest.raises(RuntimeError, match=r"states\[0\] and states\[1\] share memory"):
        o.commit_recurrent_layers_([state, state], [conv, conv.clone()], slots, [k, k], [v, v],
                                   [g, g], [beta, beta], [x, x], accepted, accept_len)
    with pytest.raises(RuntimeError, match=r"conv_states\[0\] and conv_states\[1\] share memory"):
        o.commit_recurrent_layers_([state, state.clone()], [conv, conv], slots, [k, k], [v, v],
                                   [g, g], [beta, beta], [x, x], accepted, accept_len)


@pytest.mark.parametrize("backend", BACKENDS)
def test_draft_attention_rejects_one_tensor_as_both_caches(backend):
    dtype, d = (torch.float32, 8) if backend == "cpu" else (torch.bfloat16, 64)
    q, kv = torch.randn(1, 2, 2, d, dtype=dtype), torch.randn(1, 3, 1, d, dtype=dtype)
    cache = torch.zeros(1, 1, 8, d, dtype=dtype)
    with pytest.raises(RuntimeError, match="k_cache and v_cache share memory"):
        ops_for(backend).draft_attention(q, kv, kv.clone(), cache, cache, torch.zeros(1, dtype=torch.long),
                                         torch.ones(d), torch.ones(d), torch.ones(1, 3, d),
                                         torch.zeros(1, 3, d), 1, 1e-6)


def test_meta_tensors_among_cpu_tensors_are_rejected():
    parents = torch.tensor([[-1, 0]])
    with pytest.raises(RuntimeError, match="num_nodes is on meta but parents is on cpu"):
        ddtree.tree_visibility(parents, torch.tensor([2], device="meta"))
    with pytest.raises(RuntimeError, match="cache is on meta but past_len is on cpu|past_len is on "
                                           "cpu but cache is on meta"):
        torch.ops.ddtree.commit_kv_(torch.zeros(1, 2, 8, 4, device="meta"), *commit_args(), "BHSD")
    with pytest.raises(RuntimeError, match="on meta"):
        ops.verify_greedy(ops.DraftTree(*[torch.zeros(1, 2, dtype=torch.long)] * 5,
                                        torch.ones(1, dtype=torch.long)),
                          torch.zeros(1, 2, dtype=torch.long, device="meta"), 1)
    # All-meta calls are shape inference, as before.
    out = ddtree.tree_visibility(parents.to("meta"), torch.tensor([2], device="meta"))
    assert out.packed.device.type == "meta"


# ---- drafter checkpoints ----

@pytest.fixture
def saved_drafter(tmp_path):
    drafter = tiny_drafter()
    drafter.save_pretrained(str(tmp_path))
    return drafter, tmp_path


def test_checkpoint_loading_reads_the_declared_files_only(saved_drafter):
    from safetensors.torch import load_file, save_file

    drafter, path = saved_drafter
    stray = {k: torch.zeros_like(v) for k, v in load_file(str(path / "model.safetensors")).items()}
    save_file(stray, str(path / "zz_old.safetensors"))
    loaded = DFlashDrafter.from_pretrained(str(path))
    assert torch.equal(loaded.fc.weight, drafter.fc.weight)
    # A sharded checkpoint: the index's files, whatever else lies there.
    state = load_file(str(path / "model.safetensors"))
    names = sorted(state)
    (path / "model.safetensors").unlink()
    save_file({k: state[k] for k in names[:3]}, str(path / "part-1.safetensors"))
    save_file({k: state[k] for k in names[3:]}, str(path / "part-2.safetensors"))
    index = {"weight_map": {k: "part-1.safetensors" if i < 3 else "part-2.safetensors"
                            for i, k in enumerate(names)}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    sharded = DFlashDrafter.from_pretrained(str(path))
    assert all(torch.equal(a, b) for a, b in zip(sharded.parameters(), drafter.parameters()))
    index["weight_map"][names[0]] = "missing.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="weight_map names 'missing.safetensors'"):
        DFlashDrafter.from_pretrained(str(path))
    (path / "model.safetensors.index.json").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        DFlashDrafter.from_pretrained(str(path))


@pytest.mark.parametrize("edit, message", [
    (lambda c: None, r"config.json: expected a JSON object, got NoneType"),
    (lambda c: {k: v for k, v in c.items() if k != "num_target_layers"},
     r"config.json: field 'num_target_layers' must be an integer >= 1, got None"),
    (lambda c: {**c, "block_size": 40}, r"config.json: field 'block_size' = 40 exceeds 33"),
    (lambda c: {**c, "block_size": 0}, r"config.json: field 'block_size' must be an integer >= 2"),
    (lambda c: {**c, "dflash_config": {**c["dflash_config"], "target_layer_ids": [-1, 3]}},
     r"config.json: field 'dflash_config.target_layer_ids' must list layer indices in \[0, "),
    (lambda c: {**c, "dflash_config": {}}, r"field 'dflash_config.mask_token_id' is required"),
    (lambda c: {**c, "hidden_size": "64"}, r"field 'hidden_size' must be an integer >= 1"),
])
def test_broken_drafter_configs_name_file_and_field(saved_drafter, edit, message):
    _, path = saved_drafter
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(edit(config)))
    with pytest.raises(ValueError, match=message):
        DFlashDrafter.from_pretrained(str(path))


def test_unreadable_drafter_config_names_the_file(saved_drafter):
    _, path = saved_drafter
    (path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config.json: not valid JSON"):
        DFlashDrafter.from_pretrained(str(path))
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        DFlashDrafter.from_pretrained(str(path / "nope"))


# ---- loop arguments ----

def test_loop_arguments_of_other_types_work_or_are_named():
    target, drafter = tiny_target(), tiny_drafter()
    want = generate(target, drafter, torch.tensor([[1, 2, 3]]), 6, budget=16).tokens
    assert generate(target, drafter, torch.tensor([[1, 2, 3]]), 6, budget=np.int64(16)).tokens == want
    assert generate(target, drafter, [[1, 2, 3]], np.int32(6), budget=16).tokens == want
    assert generate(target, drafter, [1, 2, 3], 6, budget=16).tokens == want
    assert generate_batch(target, drafter, [np.array([1, 2, 3])], 6, budget=[16])[0].tokens == want
    for kwargs, message in [
        (dict(max_new_tokens=3.5), "max_new_tokens must be an integer >= 1, got 3.5"),
        (dict(seed=2**62), r"seed must be an integer in \[0, 8796093022208\], got 4611686018427387904"),
        (dict(budget="16"), "budget must be an integer >= 0, a list of one per prompt"),
        (dict(budget=True), "budget must be an integer >= 0"),
        (dict(top_k=1.5), "top_k an integer"),
        (dict(stop_token_ids=["eos"]), "stop_token_ids must be integers"),
    ]:
        args = {"max_new_tokens": 6, **kwargs}
        with pytest.raises(ValueError, match=message):
            generate(target, drafter, torch.tensor([[1, 2]]), **args)
    with pytest.raises(TypeError, match="input_ids must hold integer token ids, got dtype "
                                        "torch.float32"):
        generate(target, drafter, [[1.5, 2.0]], 4)
    with pytest.raises(TypeError, match="prompts must be a list of prompts"):
        generate_batch(target, drafter, torch.tensor([[1, 2]]), 4)
    with pytest.raises(TypeError, match="input_ids must be a \\[1, P\\] tensor"):
        generate(target, drafter, "1 2 3", 4)
    with pytest.raises(TypeError, match="policy must be a ddtree.budget.Policy .*, got object"):
        generate(target, drafter, [1, 2, 3], 4, budget="auto", policy=object())


def test_draft_to_tree_names_a_bad_budget():
    logits = torch.randn(1, 3, 10)
    for budget in (-3, 2.5, None):
        with pytest.raises(ValueError, match=f"draft_to_tree: budget must be an integer >= 0, got "
                                             f"{re.escape(repr(budget))}"):
            ops.draft_to_tree(logits, torch.tensor([1]), budget)


# ---- the table ----

def test_every_table_row_names_a_test():
    """Each row of docs/hardening.md's bad-input table names the test that checks it."""
    text = (ROOT / "docs" / "hardening.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and "`tests/" in line]
    assert len(rows) >= 20
    for row in rows:
        for path, name in re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", row):
            source = (ROOT / path).read_text()
            assert re.search(rf"^def {name}\(", source, re.M), f"{path}::{name} (from: {row})"
