"""Timing helper of the Python benchmarks: median wall time after one warm-up run."""
import statistics
import time


def median_time(fn, repeats: int = 3) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
