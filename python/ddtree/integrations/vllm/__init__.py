"""ddtree.integrations.vllm: DDTree as a vLLM speculative method (vLLM 0.32, CPU backend tested).

    vllm serve TARGET --speculative-config '{"method": "ddtree", "model": DRAFTER, "budget": "auto"}'
    LLM(TARGET, speculative_config={"method": "ddtree", "model": DRAFTER, "budget": 64})

vLLM loads `register` through the entry point `vllm.general_plugins: ddtree` (setup.py) in every
engine process. Modules: options (parsing, no vLLM), hooks (where ddtree attaches to vLLM),
proposer (DFlash pass -> trees), context (the drafter's context rows of steps without drafts),
auto (budget="auto"), runner (verify + commit), paged (tree attention over vLLM's paged CPU
cache), gdn (hybrid targets' Gated DeltaNet layers over trees). Nothing in ddtree outside this
package imports vLLM.
"""


def register() -> None:
    from .hooks import install

    install()
