"""Where ddtree attaches to vLLM 0.32 (the plug-in's `register` installs these in every process).

- engine/arg_utils.py `EngineArgs.create_speculative_config`: a speculative_config with
  method "ddtree" is validated (options.parse) and becomes vLLM's DFlash config; the ddtree
  options travel to the engine processes in the environment (options.ENV).
- config/speculative.py `SpeculativeConfig.max_num_new_slots_for_drafting`: the scheduler's
  per-request reservation for the drafter's query rows (v1/core/sched/scheduler.py charges
  `num_new_tokens + draft_slots` of max_num_batched_tokens to every scheduled request). vLLM's
  DFlash queries num_speculative_tokens rows; ddtree's drafter queries draft_len rows whatever the
  tree budget (the tree's nodes are scheduled tokens, charged already), so a ddtree engine
  reserves draft_len.
- v1/worker/gpu_model_runner.py: the runner builds its drafter as `DFlashProposer(...)`; in a
  ddtree engine that name is DDTreeProposer (a DFlashProposer). `execute_model`, `_model_forward`,
  `_sample` and `sample_tokens` are wrapped: tree positions and attention rows around the target
  forward, ddtree's verify instead of the chain rejection sampler, the accepted path committed.
- v1/attention/backends/cpu_attn.py `CPUAttentionBackendImpl.forward`: the tree rows recomputed
  with ddtree's tree_attention (runner.tree_attention_rows).
- model_executor/layers/mamba/ops/cpu/gdn_attention.py `_spec_forward` (hybrid targets): the Gated
  DeltaNet layers' speculative rows run as trees, the accepted path committed after verify;
  model_executor/layers/mamba/gdn/base.py `GatedDeltaNetAttention.get_kv_cache_spec`: one state
  block per request (gdn.py).
Engines whose speculative method is not "ddtree" run vLLM's code unchanged: every wrapper checks
for the runner's ddtree state first.
"""
from __future__ import annotations

import functools
import os

from .options import ENV, METHOD, active_options, parse


def _first_hook(cls) -> bool:
    """Marks `cls` as wrapped; False when it already was (install runs in every process and
    again for each ddtree engine of a process)."""
    if getattr(cls, "_ddtree_hooked", False):
        return False
    cls._ddtree_hooked = True
    return True


def _target_config_dict(target_model_config):
    hf = getattr(target_model_config, "hf_config", None)
    return hf.to_dict() if hf is not None else None


def hook_engine_args() -> None:
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_speculative_config
    if getattr(original, "_ddtree", False):
        return

    @functools.wraps(original)
    def create_speculative_config(self, target_model_config, target_parallel_config):
        config = self.speculative_config
        if isinstance(config, dict) and config.get("method") == METHOD:
            dflash, options = parse(config, _target_config_dict(target_model_config))
            os.environ[ENV] = options.to_json()   # inherited by the engine processes
            self.speculative_config = dflash
            hook_runner()                         # an engine in this very process
            hook_cpu_attention()
            hook_gdn()
        else:
            os.environ.pop(ENV, None)             # an engine of another method: vLLM's code
        return original(self, target_model_config, target_parallel_config)

    create_speculative_config._ddtree = True
    EngineArgs.create_speculative_config = create_speculative_config


def hook_drafting_slots() -> None:
    from vllm.config.speculative import SpeculativeConfig

    original = SpeculativeConfig.max_num_new_slots_for_drafting
    if getattr(original.fget, "_ddtree", False):
        return

    def max_num_new_slots_for_drafting(self) -> int:
        options = active_options()
        if options is not None and self.use_dflash():
            return options.draft_len
        return original.fget(self)

    max_num_new_slots_for_drafting._ddtree = True
    SpeculativeConfig.max_num_new_slots_for_drafting = property(
        functools.wraps(original.fget)(max_num_new_slots_for_drafting))


# Sampling parameters vLLM's rejection sampler applies and ddtree's verify does not: refused per
# request (HTTP 400 naming the parameter), never silently ignored.
UNSUPPORTED = (("logprobs", lambda p: p.logprobs is not None),
               ("prompt_logprobs", lambda p: p.prompt_logprobs is not None),
               ("presence_penalty", lambda p: p.presence_penalty != 0.0),
               ("frequency_penalty", lambda p: p.frequency_penalty != 0.0),
               ("repetition_penalty", lambda p: p.repetition_penalty != 1.0),
               ("min_p", lambda p: p.min_p > 0.0),
               ("logit_bias", lambda p: bool(p.logit_bias)),
               ("bad_words", lambda p: bool(p.bad_words)),
               ("allowed_token_ids", lambda p: p.allowed_token_ids is not None),
               ("structured_outputs", lambda p: p.structured_outputs is not None))


def hook_request_validation() -> None:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    original = InputProcessor._validate_params
    if getattr(original, "_ddtree", False):
        return

    @functools.wraps(original)
    def _validate_params(self, params, *args, **kwargs):
        result = original(self, params, *args, **kwargs)
        if isinstance(params, SamplingParams) and active_options() is not None:
            for name, used in UNSUPPORTED:
                if used(params):
                    from vllm.exceptions import VLLMValidationError

                    raise VLLMValidationError(
                        f"{name} is not supported with speculative method 'ddtree' (its tree "
                        f"verification applies temperature, top_k and top_p only)",
                        parameter=name)
        return result

    _validate_params._ddtree = True
    InputProcessor._validate_params = _validate_params


def hook_runner() -> None:
    from vllm.v1.worker import gpu_model_runner as gmr

    from .proposer import DDTreeProposer
    from .gdn import ActiveTrees
    from .runner import ActiveRows, Verifier, build_plan, tree_positions

    runner_cls = gmr.GPUModelRunner
    if not _first_hook(runner_cls):
        return
    gmr.DFlashProposer = DDTreeProposer

    init, execute_model = runner_cls.__init__, runner_cls.execute_model
    prepare_inputs = runner_cls._prepare_inputs
    model_forward, sample = runner_cls._model_forward, runner_cls._sample
    sample_tokens = runner_cls.sample_tokens

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        drafter = getattr(self, "drafter", None)
        self._ddtree = Verifier(self) if isinstance(drafter, DDTreeProposer) else None
        self._ddtree_scheduled = self._ddtree_plan = self._ddtree_state = None
        self._ddtree_decoding = None

    @functools.wraps(execute_model)
    def execute_model_(self, scheduler_output, *args, **kwargs):
        if getattr(self, "_ddtree", None) is not None:
            self._ddtree_scheduled = scheduler_output
            self._ddtree_plan = self._ddtree_decoding = None
            self._ddtree.forget(scheduler_output.finished_req_ids)
            self.drafter.forget(scheduler_output.finished_req_ids,
                                scheduler_output.scheduled_cached_reqs.resumed_req_ids)
        return execute_model(self, scheduler_output, *args, **kwargs)

    @functools.wraps(prepare_inputs)
    def _prepare_inputs(self, scheduler_output, *args, **kwargs):
        if getattr(self, "_ddtree", None) is None:
            return prepare_inputs(self, scheduler_output, *args, **kwargs)
        if not scheduler_output.scheduled_spec_decode_tokens:
            # No request has drafts: the step is prepared as in an engine without speculation
            # (no speculative metadata, vLLM's plain sampler, every row a plain decode for the
            # GDN layers); the drafter still sees the step's tokens (propose_draft_token_ids'
            # branch for spec_decode_metadata None).
            config, self.speculative_config = self.speculative_config, None
            try:
                result = prepare_inputs(self, scheduler_output, *args, **kwargs)
            finally:
                self.speculative_config = config
            self.num_decode_draft_tokens.np[:].fill(-1)
            self.num_decode_draft_tokens.copy_to_gpu()
            return result
        result = prepare_inputs(self, scheduler_output, *args, **kwargs)
        # vLLM marks a decoding request without drafts as a speculative row with 0 drafts (its
        # GDN state sits at an offset only its spec path applies). ddtree keeps the committed
        # GDN state where a plain decode reads it (gdn.py), so such a row is a plain decode for
        # the GDN layers: vLLM's one-token kernels advance it in place.
        drafts = self.num_decode_draft_tokens.np[:self.input_batch.num_reqs]
        self._ddtree_decoding = drafts >= 0
        if (drafts == 0).any():
            drafts[drafts == 0] = -1
            self.num_decode_draft_tokens.copy_to_gpu()
        return result

    def verifies(self) -> bool:
        """A target forward ddtree verifies: some request decodes (with drafts or without)."""
        if getattr(self, "_ddtree", None) is None:
            return False
        scheduled = self._ddtree_scheduled
        if scheduled is None:
            return False
        decoding = self._ddtree_decoding
        return bool(scheduled.scheduled_spec_decode_tokens) or bool(
            decoding is not None and decoding.any())

    @functools.wraps(model_forward)
    def _model_forward(self, input_ids=None, positions=None, *args, **kwargs):
        if not verifies(self):
            return model_forward(self, input_ids, positions, *args, **kwargs)
        plan = build_plan(self, self._ddtree_scheduled)
        self._ddtree_plan = plan
        ActiveRows.rows = plan.rows
        ActiveTrees.current, ActiveTrees.steps = plan.recurrent, []
        try:
            return model_forward(self, input_ids, tree_positions(positions, plan), *args, **kwargs)
        finally:
            ActiveRows.rows = None
            ActiveTrees.current = None

    @functools.wraps(sample)
    def _sample(self, logits, spec_decode_metadata):
        verifier = getattr(self, "_ddtree", None)
        if verifier is None or spec_decode_metadata is None or self._ddtree_plan is None:
            return sample(self, logits, spec_decode_metadata)
        return verifier.sample(logits, self._ddtree_plan, self._ddtree_state)

    @functools.wraps(sample_tokens)
    def sample_tokens_(self, grammar_output):
        verifier = getattr(self, "_ddtree", None)
        if verifier is not None:
            self._ddtree_state = self.execute_model_state
            scheduled = self._ddtree_scheduled
            if scheduled is not None:
                verifier.scheduled(scheduled.total_num_scheduled_tokens,
                                   len(scheduled.num_scheduled_tokens))
        try:
            return sample_tokens(self, grammar_output)
        finally:
            self._ddtree_state = None

    runner_cls.__init__ = __init__
    runner_cls.execute_model = execute_model_
    runner_cls._prepare_inputs = _prepare_inputs
    runner_cls._model_forward = _model_forward
    runner_cls._sample = _sample
    runner_cls.sample_tokens = sample_tokens_


def hook_cpu_attention() -> None:
    from vllm.v1.attention.backends import cpu_attn

    from .runner import tree_attention_rows

    impl_cls = cpu_attn.CPUAttentionBackendImpl
    if not _first_hook(impl_cls):
        return
    forward = impl_cls.forward

    @functools.wraps(forward)
    def forward_(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        result = forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                         *args, **kwargs)
        if self.attn_type == "decoder":
            tree_attention_rows(self, layer, query, kv_cache, attn_metadata, output)
        return result

    impl_cls.forward = forward_


def hook_gdn() -> None:
    """Hybrid targets: vLLM's CPU GDN speculative path runs ddtree's trees, and the GDN layers ask
    for one state block per request and a conv buffer of the committed window alone (gdn.py)."""
    from vllm.model_executor.layers.mamba.gdn.base import GatedDeltaNetAttention
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention

    from .gdn import narrow_state_shape, nonspec_or_trees, spec_forward, spec_without_draft_blocks

    if not getattr(gdn_attention._spec_forward, "_ddtree", False):
        gdn_attention._spec_forward = spec_forward(gdn_attention._spec_forward)
        gdn_attention._cpu_gdn_attention_nonspec = nonspec_or_trees(
            gdn_attention._cpu_gdn_attention_nonspec, gdn_attention)
        MambaStateShapeCalculator.gated_delta_net_state_shape = classmethod(narrow_state_shape(
            MambaStateShapeCalculator.gated_delta_net_state_shape.__func__))
    if not _first_hook(GatedDeltaNetAttention):
        return
    get_kv_cache_spec = GatedDeltaNetAttention.get_kv_cache_spec

    @functools.wraps(get_kv_cache_spec)
    def get_kv_cache_spec_(self, vllm_config):
        spec = get_kv_cache_spec(self, vllm_config)
        return spec_without_draft_blocks(spec) if active_options() is not None else spec

    GatedDeltaNetAttention.get_kv_cache_spec = get_kv_cache_spec_


def install() -> None:
    """The plug-in: the engine-args hook always (it acts on method "ddtree" only), the runner and
    attention hooks in processes that serve a ddtree engine."""
    hook_engine_args()
    hook_drafting_slots()
    hook_request_validation()
    if active_options() is not None:
        hook_runner()
        hook_cpu_attention()
        hook_gdn()
