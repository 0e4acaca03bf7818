"""Helpers of the Python benchmarks: median wall time after one warm-up run, and the result file
every benchmark writes (its payload under the run's date, machine, command and commit)."""
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time


def median_time(fn, repeats: int = 3) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_info() -> dict:
    """When, where and how this benchmark ran: UTC date, machine (architecture, cores, torch
    threads), the command line, and the repository's commit (with "+changes" when the tree was
    not clean; None outside a git checkout)."""
    import torch

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                                  check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None

    commit = git("rev-parse", "--short", "HEAD")
    if commit and git("status", "--porcelain", "--untracked-files=no"):
        commit += "+changes"
    return dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                machine=f"{platform.machine()}, {os.cpu_count()} cores, "
                        f"{torch.get_num_threads()} torch threads",
                command=" ".join(["python", *sys.argv]), commit=commit)


def write_result(path: str, payload) -> None:
    """The benchmark's result file: {"run": run_info(), "result": payload}."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(dict(run=run_info(), result=payload), f, indent=1)
        f.write("\n")
