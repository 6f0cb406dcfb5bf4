"""Shared timing helpers for the side-by-side benchmarks (one process, interleaved)."""

import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def time_call(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved(candidates, rounds):
    """Times each zero-argument callable once per round, alternating order.

    Args:
        candidates: dict name -> callable (already warmed up).
        rounds: number of rounds.

    Returns:
        dict name -> list of seconds, one per round.
    """
    return interleaved_wall_and_cpu(candidates, rounds)[0]


def interleaved_wall_and_cpu(candidates, rounds):
    """`interleaved`, also reading the process's CPU time of each call.

    Returns:
        `(wall, cpu)`: two dicts name -> list of seconds, one per round.
    """
    wall = {name: [] for name in candidates}
    cpu = {name: [] for name in candidates}
    names = list(candidates)
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            start_cpu = time.process_time()
            wall[name].append(time_call(candidates[name]))
            cpu[name].append(time.process_time() - start_cpu)
    return wall, cpu


def report(times, baseline, label):
    """Prints the median time of each candidate and its median ratio to `baseline`."""
    base = times[baseline]
    for name, values in times.items():
        ratios = [v / b for v, b in zip(values, base)]
        print(
            f"{name:<34} median {statistics.median(values) * 1000:8.1f} ms   "
            f"{statistics.median(ratios):.3f}x {label}"
        )
