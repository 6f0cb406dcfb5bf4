"""Benchmark: `kt.MetaLearner` vs hand-written MAML steps; second vs first order.

1. Step time, all sides trained with `fit` in one process, interleaved rounds
   (A-B-B-A, the starting side alternating), on Finn et al.'s sinusoid setup
   (1 -> 40 -> 40 -> 1 ReLU, meta-batches of 25 tasks, K = 10, one inner
   step, second order, Adam):
     MetaLearner      kt.MetaLearner(net, inner_learning_rate=0.01)
     hand-vectorized  a hand-written `train_step`: the same math, nested
                      tapes on `stateless_call`, `tf.vectorized_map` over
                      tasks (the fastest hand-written form we know)
     hand-loop        the seed-style hand-written step: a Python loop over the
                      25 tasks, each with its own nested tapes
   Target: MetaLearner <= 1.05x hand-vectorized. Ratios of wall time and of
   the process's CPU time are both printed (the latter is steadier when
   other jobs share the machine).
2. Second vs first order (`first_order=True`) for 1, 5 and 10 inner steps, on
   a larger net (1 -> 128 -> 128 -> 1, K = 20): time per meta-step (interleaved
   `fit` epochs) and the peak of TensorFlow's CPU allocator during one
   `train_on_batch` above what was resident before it (BFC allocator, so
   `tf.config.experimental.get_memory_info` works on the CPU).

Usage: python bench/meta_learning.py [rounds]   (about 3 minutes on 2 cores)
"""

import os
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"  # before TensorFlow loads

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_tapeops as kt  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import without_autotune  # noqa: E402

TASKS, INNER_LR = 25, 0.01


def network(hidden, seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((1,)),
        keras.layers.Dense(hidden, activation="relu"),
        keras.layers.Dense(hidden, activation="relu"),
        keras.layers.Dense(1),
    ])


def sinusoid_dataset(meta_batches, shots, seed=0):
    """A dataset of `meta_batches` meta-batches of 25 tasks (static batch size)."""
    rng = np.random.default_rng(seed)
    n = meta_batches * TASKS
    amplitude = rng.uniform(0.1, 5.0, (n, 1, 1))
    phase = rng.uniform(0.0, np.pi, (n, 1, 1))
    sx, qx = rng.uniform(-5.0, 5.0, (2, n, shots, 1))
    sy, qy = amplitude * np.sin(sx - phase), amplitude * np.sin(qx - phase)
    arrays = [a.astype("float32") for a in (sx, sy, qx, qy)]
    data = tf.data.Dataset.from_tensor_slices(((arrays[0], arrays[1], arrays[2]), arrays[3]))
    return without_autotune(data.batch(TASKS, drop_remainder=True).cache())


class HandMAML(keras.Model):
    """A hand-written second-order MAML `train_step` (what users write today)."""

    def __init__(self, net, vectorized):
        super().__init__()
        self.net = net
        self.vectorized = vectorized
        self.tracker = keras.metrics.Mean(name="loss")

    @property
    def metrics(self):
        return [self.tracker]

    def train_step(self, data):
        (sx, sy, qx), qy = data
        net = self.net
        frozen = [tf.convert_to_tensor(v.value) for v in net.non_trainable_variables]

        def loss_at(weights, x, y):
            pred, _ = net.stateless_call(weights, frozen, x, training=True)
            return tf.reduce_mean(tf.square(pred - y))

        with tf.GradientTape() as tape:
            weights = [tf.convert_to_tensor(v.value) for v in net.trainable_variables]

            def task(t):
                with tf.GradientTape() as inner:
                    inner.watch(weights)
                    support_loss = loss_at(weights, t[0], t[1])
                grads = inner.gradient(support_loss, weights)
                adapted = [w - INNER_LR * g for w, g in zip(weights, grads)]
                return loss_at(adapted, t[2], t[3])

            if self.vectorized:
                losses = tf.vectorized_map(task, (sx, sy, qx, qy))
            else:
                losses = tf.stack([task((sx[i], sy[i], qx[i], qy[i]))
                                   for i in range(sx.shape[0])])
            loss = tf.reduce_mean(losses)
        variables = net.trainable_variables
        self.optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        self.tracker.update_state(loss)
        return {"loss": self.tracker.result()}


def timed_epoch(model, data):
    """`(wall seconds, CPU seconds of this process)` of one `fit` epoch."""
    wall, cpu = time.perf_counter(), time.process_time()
    model.fit(data, epochs=1, verbose=0, shuffle=False)
    return time.perf_counter() - wall, time.process_time() - cpu


def interleaved_ratios(models, data, rounds, baseline):
    """Per model: median seconds per epoch and median ratios to `baseline`.

    Returns `(seconds, wall_ratios, cpu_ratios)`. The CPU time of the process
    (all its threads) is much less disturbed than the wall time when other
    jobs share the machine; both are reported.
    """
    for model in models.values():
        timed_epoch(model, data)  # warm-up: tracing
    times = {name: [] for name in models}
    names = list(models)
    for i in range(rounds):
        order = names if i % 2 == 0 else names[::-1]
        for name in order + order[::-1]:
            times[name].append(timed_epoch(models[name], data))

    def per_round(name, k):
        v = times[name]
        return [(v[2 * r][k] + v[2 * r + 1][k]) / 2 for r in range(rounds)]

    def ratios(k):
        return {name: statistics.median(a / b for a, b in zip(per_round(name, k),
                                                              per_round(baseline, k)))
                for name in models}

    seconds = {name: statistics.median(per_round(name, 0)) for name in models}
    return seconds, ratios(0), ratios(1)


def part_one(rounds):
    meta_batches = 100
    data = sinusoid_dataset(meta_batches, shots=10)
    net = network(40)
    weights = net.get_weights()
    models = {}
    meta = kt.MetaLearner(net, inner_learning_rate=INNER_LR, inner_steps=1)
    meta.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    models["MetaLearner"] = meta
    for name, vectorized in (("hand-vectorized", True), ("hand-loop", False)):
        other = network(40)
        other.set_weights(weights)
        hand = HandMAML(other, vectorized)
        hand.compile(optimizer=keras.optimizers.Adam(1e-3))
        models[name] = hand
    seconds, wall, cpu = interleaved_ratios(models, data, rounds, "hand-vectorized")
    print(f"1. step time, sinusoid 1-40-40-1, {TASKS} tasks x K=10, 1 inner step, "
          f"second order (median of {rounds} interleaved rounds, {meta_batches} "
          "meta-steps per epoch)")
    for name in models:
        print(f"   {name:<16} {seconds[name] / meta_batches * 1e3:7.2f} ms/meta-step   "
              f"wall {wall[name]:.3f}x  CPU {cpu[name]:.3f}x hand-vectorized")
    print(f"   MetaLearner: {wall['MetaLearner']:.2f}x (wall) / {cpu['MetaLearner']:.2f}x "
          f"(CPU time) the hand-written vectorized step (target <= 1.05x); "
          f"hand-loop is {wall['hand-loop']:.2f}x / {cpu['hand-loop']:.2f}x")
    step_only(models, next(iter(data)), rounds)


def step_only(models, batch, rounds, calls=200):
    """The traced train steps alone, called back to back (no `fit` loop), interleaved."""
    steps = {}
    for name in ("MetaLearner", "hand-vectorized"):
        steps[name] = tf.function(models[name].train_step)
        steps[name](batch)  # traced
    times = {name: [] for name in steps}
    for i in range(2 * rounds):
        for name in (list(steps) if i % 2 == 0 else list(steps)[::-1]):
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(calls):
                steps[name](batch)
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    ratio = [
        statistics.median(a[k] / b[k] for a, b in zip(times["MetaLearner"], times["hand-vectorized"]))
        for k in (0, 1)
    ]
    print(f"   step alone ({calls} calls x {2 * rounds} interleaved rounds): MetaLearner "
          f"{ratio[0]:.3f}x (wall) / {ratio[1]:.3f}x (CPU time) the hand-written vectorized step")


def allocator_peak_mib(fn):
    tf.config.experimental.reset_memory_stats("CPU:0")
    base = tf.config.experimental.get_memory_info("CPU:0")["current"]
    fn()
    return (tf.config.experimental.get_memory_info("CPU:0")["peak"] - base) / 2**20


def part_two(rounds):
    meta_batches = 10
    data = sinusoid_dataset(meta_batches, shots=20, seed=1)
    batch = next(iter(data))
    weights = network(128).get_weights()
    rows = []
    for steps in (1, 5, 10):
        models = {}
        for first_order in (False, True):
            net = network(128)
            net.set_weights(weights)
            meta = kt.MetaLearner(net, inner_learning_rate=INNER_LR, inner_steps=steps,
                                  first_order=first_order)
            meta.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
            models["first" if first_order else "second"] = meta
        seconds, _, cpu = interleaved_ratios(models, data, rounds, "first")
        memory = {}
        for name, meta in models.items():
            meta.train_on_batch(*batch)  # traced
            memory[name] = statistics.median(
                allocator_peak_mib(lambda: meta.train_on_batch(*batch)) for _ in range(3))
        rows.append((steps, seconds, memory, cpu["second"]))
    print(f"\n2. second vs first order, 1-128-128-1, {TASKS} tasks x K=20 "
          f"(median of {rounds} interleaved rounds)")
    print(f"   {'inner steps':>11} {'2nd ms':>8} {'1st ms':>8} {'time 2nd/1st':>13} "
          f"{'CPU 2nd/1st':>12} {'2nd MiB':>8} {'1st MiB':>8} {'mem 2nd/1st':>12}")
    for steps, seconds, memory, cpu_ratio in rows:
        second, first = (seconds[n] / meta_batches * 1e3 for n in ("second", "first"))
        print(f"   {steps:>11} {second:8.2f} {first:8.2f} {second / first:13.2f} "
              f"{cpu_ratio:12.2f} "
              f"{memory['second']:8.2f} {memory['first']:8.2f} "
              f"{memory['second'] / memory['first']:12.2f}")
    base = rows[0]
    for steps, seconds, memory, _ in rows[1:]:
        print(f"   {steps} inner steps vs 1: second order time x"
              f"{seconds['second'] / base[1]['second']:.1f}, memory x"
              f"{memory['second'] / base[2]['second']:.1f}; first order time x"
              f"{seconds['first'] / base[1]['first']:.1f}, memory x"
              f"{memory['first'] / base[2]['first']:.1f}")


def main(rounds=7):
    part_one(rounds)
    part_two(rounds)


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:2]))
