"""Bad configuration fails at start-up with a message naming the option (vLLM's LLM entry point
and the server)."""
from __future__ import annotations

import pytest
from conftest import Server, ddtree_config, make_dense_pair


def build(target, spec):
    from vllm import LLM

    return LLM(model=str(target), dtype="float32", enforce_eager=True, max_model_len=512,
               speculative_config=spec)


@pytest.mark.parametrize("options, message", [
    ({"budget": 0}, "'budget' must be an integer in [1, 256]"),
    ({"budget": 1000}, "'budget' must be an integer in [1, 256]"),
    ({"budget": "big"}, "'budget' must be an integer in [1, 256] or \"auto\""),
    ({"budget": 8, "max_budget": 16}, "'max_budget' applies to budget=\"auto\" only"),
    ({"budget": "auto", "max_budget": 0}, "'max_budget' must be an integer"),
    ({"draft_len": 99}, "'draft_len' must be an integer in [1, 15]"),
    ({"num_speculative_tokens": 4}, "'num_speculative_tokens' is set by ddtree"),
    ({"tree_width": 4}, "unknown option(s) ['tree_width']"),
])
def test_bad_ddtree_options_are_refused_by_name(dense_pair, options, message):
    target, drafter = dense_pair
    with pytest.raises(ValueError) as error:
        build(target, {"method": "ddtree", "model": str(drafter), **options})
    assert message in str(error.value)


def test_drafter_that_is_not_dflash_or_does_not_match(dense_pair, embedded_pair):
    target, drafter = dense_pair
    with pytest.raises(ValueError, match="'model' .* is not a DFlash drafter"):
        build(target, {"method": "ddtree", "model": str(target)})
    with pytest.raises(ValueError, match=r"'model' \(the DFlash drafter directory\) is required"):
        build(target, {"method": "ddtree"})
    embedded_target, _ = embedded_pair
    # the dense pair's drafter has vocabulary 64, the embedded target 4096
    with pytest.raises(ValueError, match="does not match the target: drafter vocab_size 64"):
        build(embedded_target, {"method": "ddtree", "model": str(drafter)})


def test_target_whose_cpu_attention_layout_is_unsupported_fails_at_startup(tmp_path):
    # head_dim 80: vLLM's CPU attention picks the "vec16" ISA, whose cache layout ddtree's paged
    # tree attention does not read
    target, drafter = make_dense_pair(tmp_path / "pair", head_dim=80)
    server = Server(target, "--dtype", "float32", "--speculative-config",
                    ddtree_config(drafter, budget=8), log=tmp_path / "serve.log")
    try:
        with pytest.raises(RuntimeError, match="exited"):
            server.wait_ready(timeout=240)
    finally:
        server.stop()
    assert "ddtree: vLLM's CPU attention uses ISA 'vec16'" in server.tail(200000)


def stub_config(dtype, cache_dtype, head_size=64, block_size=32):
    from types import SimpleNamespace

    import torch
    model = SimpleNamespace(dtype=getattr(torch, dtype), get_head_size=lambda: head_size,
                            get_num_kv_heads=lambda parallel: 2)
    return SimpleNamespace(model_config=model, parallel_config=None,
                           cache_config=SimpleNamespace(block_size=block_size,
                                                        cache_dtype=cache_dtype))


def test_quantized_kv_cache_is_refused_and_this_cpus_layout_is_checked():
    from ddtree.integrations.vllm.runner import check_target_runs

    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8'"):
        check_target_runs(stub_config("bfloat16", "fp8"))
    # the layouts vLLM picks on this CPU (bf16: "amx" where the CPU has AMX tiles, else "vec")
    # are read back exactly by ddtree, at the model's dtype
    for dtype, cache_dtype in (("bfloat16", "auto"), ("float32", "auto"), ("bfloat16", "bfloat16")):
        check_target_runs(stub_config(dtype, cache_dtype))
    with pytest.raises(ValueError, match="ISA 'vec16'"):
        check_target_runs(stub_config("float32", "auto", head_size=80))
