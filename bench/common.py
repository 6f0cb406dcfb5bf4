"""Shared timing helpers for the side-by-side benchmarks (one process, interleaved)."""

import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def without_autotune(dataset):
    """`dataset` with tf.data's autotuning off, so that timing `fit` on it times the steps.

    With autotuning on, a dataset iterator's background thread sleeps for
    periods that double (10 ms, 20 ms, ... about 1.27 s in all by the
    sixth), and destroying the iterator at the end of `fit` waits for the
    sleep to end: every `fit` on a cached dataset that ran for less than
    1.27 s took 1.27 s (30 CNN steps read as 42.2 ms each, in 4 of 10
    rounds, for stock and DP-SGD alike), and one of 1.3-2.5 s took 2.55 s.
    The steps themselves are unchanged.
    """
    import tensorflow as tf

    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


def time_call(fn, clock="wall"):
    """Seconds `fn()` takes on `clock`: `"wall"`, or `"cpu"` (the process's CPU time)."""
    now = time.perf_counter if clock == "wall" else time.process_time
    start = now()
    fn()
    return now() - start


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


def add_clock_argument(parser):
    """Adds `--clock wall|cpu` (default wall) to an `argparse` parser; see `interleaved_on`."""
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="wall time, or the process's CPU time (steadier on a shared machine: "
        "time other processes take from it is not counted)",
    )


def interleaved_on(clock, candidates, rounds):
    """`interleaved`, read on `clock`: `"wall"` or `"cpu"` (the process's CPU time)."""
    wall, cpu = interleaved_wall_and_cpu(candidates, rounds)
    return wall if clock == "wall" else cpu


def report(times, baseline, label):
    """Prints the median time of each candidate and its median ratio to `baseline`."""
    base = times[baseline]
    for name, values in times.items():
        ratios = [v / b for v, b in zip(values, base)]
        print(
            f"{name:<34} median {statistics.median(values) * 1000:8.1f} ms   "
            f"{statistics.median(ratios):.3f}x {label}"
        )
