"""bench/bench_concurrency.py end to end on the embedded pair, at a size that runs in seconds: it
finishes (it exits with an error when a mode's tokens differ from autoregressive's), and its JSON
holds every mode at every batch size with auto's choices and generation records."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_concurrency_benchmark_runs_and_records_auto(tmp_path):
    out = tmp_path / "concurrency.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python"), "DDTREE_CACHE_DIR": str(tmp_path)}
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_concurrency.py"),
                          "--batches", "1", "2", "--requests", "2", "--new-tokens", "6",
                          "--repeats", "1", "--json", str(out)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    written = json.loads(out.read_text())
    # The run's date, machine, command and commit, then the benchmark's payload.
    assert set(written["run"]) == {"date", "machine", "command", "commit"}
    assert "bench_concurrency.py" in written["run"]["command"]
    data = written["result"]
    modes = ["autoregressive", "tree auto", "chain", "tree 8", "tree 16", "tree 64", "tree 256"]
    assert [(r["batch"], r["mode"]) for r in data["rows"]] == [(b, m) for b in (1, 2)
                                                               for m in modes]
    assert sorted(data["profiles"], key=int) == ["1", "2"]
    for row in data["rows"]:
        assert row["tokens_per_second"] > 0 and row["min"] <= row["tokens_per_second"] <= row["max"]
        if row["mode"] == "autoregressive":
            assert row["vs_autoregressive"] == 1.0
        if row["mode"] != "tree auto":
            continue
        # Two requests: two groups at batch 1 and one at batch 2, auto at least 8 times per
        # batch size (PAIRS_PER_BATCH), each generation recorded in order.
        generations = row["generations"]
        assert len(generations) >= 8
        if row["batch"] == 1:  # one request per generation: each round is a request-round
            for bucket, count in row["chosen_budgets"].items():
                assert sum(n for g in generations for key, n in g["rounds_by_choice"].items()
                           if key.split(":")[0] == bucket) == count
        drafted = sum(c for b, c in row["chosen_budgets"].items() if b != "0")
        assert sum(g["drafted_request_rounds"] for g in generations) == drafted
        assert all(g["measured_speedup"] is None or g["measured_speedup"] > 0
                   for g in generations)
        assert all(g["recheck"] in (True, False) for g in generations)
        # The plain decoding time it estimated, next to the same requests' real one.
        assert all((g["plain_estimate_ms"] is None) == (g["measured_speedup"] is None)
                   and g["autoregressive_ms"] > 0 for g in generations)
        estimates = [g["plain_estimate_ms"] / g["autoregressive_ms"] for g in generations
                     if g["plain_estimate_ms"] is not None]
        assert row["plain_estimate_vs_autoregressive"] == (
            pytest.approx(sorted(estimates)[len(estimates) // 2]) if len(estimates) % 2 else
            pytest.approx(sum(sorted(estimates)[len(estimates) // 2 - 1:][:2]) / 2)
            if estimates else None)
