"""An engine without speculation next to a ddtree engine in one process: ddtree's hooks act on
vLLM's classes, so the engine built before them must still run vLLM's own code."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def test_an_engine_without_ddtree_beside_a_ddtree_engine(dense_pair):
    target, drafter = dense_pair
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
               VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND",
                                                        f"0-{os.cpu_count() - 1}"))
    proc = subprocess.run([sys.executable, str(HERE / "same_process_run.py"), str(target),
                           str(drafter)], env=env, cwd=HERE, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    result = json.loads(line[len("RESULT "):])
    assert len(result["before"]) == 8 and all(len(t) == 32 for t in result["before"])
    assert result["after"] == result["before"]     # the plain engine, unchanged by the hooks
    assert result["ddtree"] == result["before"]    # fp32 greedy: lossless
