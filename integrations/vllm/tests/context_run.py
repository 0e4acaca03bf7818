"""One in-process vLLM engine (dense pair, fp32, ddtree) whose drafting steps follow a fixed
pattern; records every drafting step's drafts and what the drafter attends to (its context K/V
at the committed positions, every drafter layer). test_context.py runs it with the context rows
of steps without drafts projected at once (eager) and kept until the next drafting step.

    python context_run.py TARGET DRAFTER eager|deferred OUT.pt
"""
from __future__ import annotations

import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

DRAFT_EVERY = 4     # every 4th step drafts; the others keep (or project) their context rows
BUDGET = 8


def main(target: str, drafter: str, mode: str, out: str) -> None:
    import numpy as np
    import torch
    from vllm import LLM, SamplingParams

    from conftest import held_out_prompts
    from ddtree.integrations.vllm import auto, paged, proposer

    def draft_step(self, batch):
        self.decisions += 1
        return self.decisions % DRAFT_EVERY == 0

    auto.StepBudget.draft_step = draft_step
    auto.StepBudget._auto = lambda self, probs, batch: [BUDGET] * batch
    proposer.DDTreeProposer.defer_context = mode == "deferred"
    record = {"drafts": [], "context": [], "caught_up": 0}
    propose = proposer.DDTreeProposer.propose

    def propose_(self, num_speculative_tokens, *args, **kwargs):
        drafts = propose(self, num_speculative_tokens, *args, **kwargs)
        if not any(drafts):
            return drafts
        record["caught_up"] += self.caught_up
        cad = kwargs["common_attn_metadata"]
        batch = len(drafts)
        starts = cad.query_start_loc_cpu[:batch + 1].numpy().astype(np.int64)
        valid = np.diff(starts)
        rejected = kwargs.get("num_rejected_tokens_gpu")
        if rejected is not None:
            valid = valid - rejected[:batch].numpy()
        positions = kwargs["target_positions"]
        step = []   # per request in batch order, per drafter layer: (K, V) [Hkv, length, D]
        for b in range(batch):
            length = int(positions[starts[b] + valid[b] - 1]) + 1
            step.append([tuple(t.clone() for t in paged.gather_kv(
                layer.kv_cache, cad.block_table_tensor[b], length, "vec"))
                for layer in self.model.model._attn_layers])
        record["drafts"].append(drafts)
        record["context"].append(step)
        return drafts

    proposer.DDTreeProposer.propose = propose_
    llm = LLM(target, dtype="float32", enforce_eager=True, enable_prefix_caching=False,
              max_num_seqs=8, speculative_config={"method": "ddtree", "model": drafter,
                                                  "budget": "auto"})
    prompts = [{"prompt_token_ids": p} for p in held_out_prompts(6)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40),
                           use_tqdm=False)
    record["tokens"] = [list(o.outputs[0].token_ids) for o in outputs]
    torch.save(record, out)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(*sys.argv[1:5])
