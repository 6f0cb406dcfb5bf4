"""Benchmark: time per epoch of every `task_balancing` method, K = 2, 4 and 8 tasks.

One shared trunk (Dense 1024 x 2 on 128 features, 1.2M parameters) and K heads (Dense 32 ->
Dense 1), 8192 samples from a cached `tf.data.Dataset`, batch 256 (32 steps
an epoch), so the step's compute, not `fit`'s per-epoch overhead, is timed.
Each candidate's time is its fastest of the interleaved rounds (on a
machine shared with other jobs, interference only adds time; medians of
per-round ratios moved by +-30% between runs there). Per K, in one
process, rounds interleaved, ratios of the fastest rounds:

- vs `sum`: stock `fit` on the summed loss (linear scalarization);
- vs `floor`: a hand-written `train_step` that calls `tape.gradient` once per
  task on a persistent tape (the floor for methods that need every task's
  gradient of the shared variables) and applies their sum.

Targets (issue 18): loss weightings and `MeasureConflict(every=10)` <= 1.10x
sum; gradient methods <= 1.10x floor (issue 31; 1.05x in issue 18); `MGDA(on="representation")` <= 1.5x
sum. `MeasureConflict(30)` has no target: it shows the cost falling with `every`. Also compares the two ways of computing the rows (`pfor` Jacobian vs
one `tape.gradient` per task, `keras_tapeops.multitask.engine.JACOBIAN_METHOD`) and,
for UPGrad, the Gramian taken layer by layer (the default) against the rows kept
every step ("UPGrad (rows)": what replicas and accumulation use).

Also prints each candidate's step memory: TensorFlow's CPU allocator peak
during one `train_on_batch` above what was allocated before it (MiB), per K.

`--clock cpu --statistic median` (with 15 or more rounds) reads the process's
CPU time and the median of the per-round ratios: steadier than the fastest
wall-clock rounds when other jobs share the machine, for targets within a few
percent (UPGrad at K = 2).

Run: python bench/multi_task.py [--rounds 5] [--ks 2 4 8] [--methods UPGrad]
     [--clock wall|cpu] [--statistic fastest|median]  (several minutes on 2 cores)
"""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"  # allocator statistics; before TensorFlow loads

from common import add_clock_argument  # noqa: E402
from common import interleaved_on  # noqa: E402
from common import without_autotune  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_tapeops as kt  # noqa: E402

N, FEATURES, WIDTH, BATCH = 8192, 128, 1024, 256
SHARED = ["trunk_1", "trunk_2"]


class FloorModel(keras.Model):
    """The hand-written loop: one `tape.gradient` per task on a persistent tape."""

    def train_step(self, data):
        x, y = data[0], data[1]  # train_on_batch passes (x, y, sample_weight)
        shared = [v for v in self.trainable_variables if v.path.split("/")[0] in SHARED]
        heads = [v for v in self.trainable_variables if v.path.split("/")[0] not in SHARED]
        with tf.GradientTape(persistent=True) as tape:
            y_pred = self(x, training=True)
            losses = [tf.reduce_mean(tf.square(y[k] - y_pred[k])) for k in sorted(y)]
            total = tf.add_n(losses)
        per_task = [tape.gradient(loss, shared) for loss in losses]
        shared_grads = [tf.add_n(list(gs)) for gs in zip(*per_task)]
        head_grads = tape.gradient(total, heads)
        self.optimizer.apply_gradients(zip(shared_grads + head_grads, shared + heads))
        return {"loss": total}


def build(k, floor=False):
    inputs = keras.Input((FEATURES,))
    h = keras.layers.Dense(WIDTH, activation="relu", name="trunk_1")(inputs)
    h = keras.layers.Dense(WIDTH, activation="relu", name="trunk_2")(h)
    outputs = {
        f"t{j}": keras.layers.Dense(1, name=f"t{j}")(
            keras.layers.Dense(32, activation="relu", name=f"h{j}")(h)
        )
        for j in range(k)
    }
    if floor:
        return FloorModel(inputs, outputs)
    return kt.upgrade(keras.Model(inputs, outputs))


def methods():
    return {
        "PCGrad": lambda: kt.PCGrad(shared=SHARED, seed=0),
        "PCGrad (pfor rows)": lambda: kt.PCGrad(shared=SHARED, seed=0),
        "UPGrad (rows)": lambda: kt.UPGrad(shared=SHARED),
        "MGDA": lambda: kt.MGDA(shared=SHARED),
        "MGDA representation": lambda: kt.MGDA(
            shared=SHARED, on="representation", representation="trunk_2"),
        "CAGrad": lambda: kt.CAGrad(c=0.4, shared=SHARED),
        "IMTLG": lambda: kt.IMTLG(shared=SHARED),
        "AlignedMTL": lambda: kt.AlignedMTL(shared=SHARED),
        "UPGrad": lambda: kt.UPGrad(shared=SHARED),
        "GradNorm": lambda: kt.GradNorm(shared=SHARED),
        "UncertaintyWeighting": lambda: kt.UncertaintyWeighting(),
        "DWA": lambda: kt.DWA(),
        "FAMO": lambda: kt.FAMO(),
        "MeasureConflict(10)": lambda: kt.MeasureConflict(every=10, shared=SHARED),
        "MeasureConflict(30)": lambda: kt.MeasureConflict(every=30, shared=SHARED),
    }


GRADIENT_METHODS = {"PCGrad", "PCGrad (pfor rows)", "UPGrad (rows)", "MGDA", "CAGrad", "IMTLG", "AlignedMTL",
                    "UPGrad", "GradNorm"}
WEIGHTINGS = {"UncertaintyWeighting", "DWA", "FAMO", "MeasureConflict(10)"}


peaks = {}  # name -> step MiB of the K being measured
ONLY = None  # --methods


def candidates(k):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, FEATURES)).astype("float32")
    y = {f"t{j}": rng.normal(size=(N, 1)).astype("float32") for j in range(k)}
    loss = {name: "mse" for name in y}
    data = without_autotune(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).cache().prefetch(2)
    )
    fits = {}
    xb = tf.constant(x[:BATCH])
    yb = {name: tf.constant(values[:BATCH]) for name, values in y.items()}

    def prepare(name, model):
        model.fit(data, epochs=1, verbose=0)  # trace
        fits[name] = lambda: model.fit(data, epochs=1, verbose=0)
        model.train_on_batch(xb, yb)  # traces the single-batch function
        tf.config.experimental.reset_memory_stats("CPU:0")
        base = tf.config.experimental.get_memory_info("CPU:0")["current"]
        model.train_on_batch(xb, yb)
        peaks[name] = (tf.config.experimental.get_memory_info("CPU:0")["peak"] - base) / 2**20

    keras.utils.set_random_seed(0)
    stock = build(k)
    stock.compile(optimizer="adam", loss=loss)
    prepare("sum", stock)
    floor = build(k, floor=True)
    floor.compile(optimizer="adam")
    prepare("floor", floor)
    for name, make in methods().items():
        if ONLY is not None and name not in ONLY:
            continue
        model = build(k)
        model.compile(optimizer="adam", loss=loss, task_balancing=make())
        if "pfor" in name:
            model.tapeops_state.engine.jacobian_method = "pfor"
        if "(rows)" in name:  # every step keeps the rows (no layerwise Gramian)
            model.tapeops_state.engine.layer_by_layer = False
        prepare(name, model)
    return fits


def summary(values, sums, floors, statistic):
    """`(seconds, x sum, x floor)` of one candidate's rounds, by `statistic`."""
    if statistic == "fastest":
        best = min(values)
        return best, best / min(sums), best / min(floors)
    return (
        statistics.median(values),
        statistics.median(v / s for v, s in zip(values, sums)),
        statistics.median(v / f for v, f in zip(values, floors)),
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--methods", nargs="+", default=None,
                        help="only these methods (the sum and the floor always run)")
    add_clock_argument(parser)
    parser.add_argument("--statistic", choices=["fastest", "median"], default="fastest",
                        help="ratios of the fastest rounds, or the median of the per-round "
                        "ratios (neighbours in one round share the machine's state)")
    args = parser.parse_args()
    global ONLY
    ONLY = args.methods
    table = {}
    memory = {}
    for k in args.ks:
        peaks.clear()
        rounds = interleaved_on(args.clock, candidates(k), args.rounds)
        for name, values in rounds.items():
            table.setdefault(name, {})[k] = summary(values, rounds["sum"], rounds["floor"],
                                                    args.statistic)
            memory.setdefault(name, {})[k] = peaks[name]
        keras.backend.clear_session()
    print(f"\n{args.clock} time per epoch ({N} samples, batch {BATCH}), {args.rounds} "
          f"interleaved rounds: " + ("fastest rounds" if args.statistic == "fastest" else
                                     "medians (time; per-round ratios)"))
    header = "".join(f" | K={k}: ms   x sum  x floor" for k in args.ks)
    print(f"{'method':<22}{header}")
    for name, row in table.items():
        cells = "".join(
            f" | {row[k][0] * 1000:8.0f} {row[k][1]:6.2f} {row[k][2]:7.2f}" for k in args.ks
        )
        print(f"{name:<22}{cells}")
    print("\nstep memory (allocator peak of one train_on_batch above the start, MiB)")
    print(f"{'method':<22}" + "".join(f" | K={k}: MiB  x floor" for k in args.ks))
    for name, row in memory.items():
        cells = "".join(f" | {row[k]:8.1f} {row[k] / memory['floor'][k]:7.2f}" for k in args.ks)
        print(f"{name:<22}{cells}")
    print("\ntargets: loss weightings and MeasureConflict(10) <= 1.10x sum; gradient methods "
          "<= 1.10x floor; MGDA representation <= 1.5x sum")
    for name, row in table.items():
        for k in args.ks:
            _, vs_sum, vs_floor = row[k]
            if name in WEIGHTINGS and vs_sum > 1.10:
                print(f"  above target: {name} K={k}: {vs_sum:.2f}x sum")
            if name in GRADIENT_METHODS and vs_floor > 1.10:
                print(f"  above target: {name} K={k}: {vs_floor:.2f}x floor")
            if name == "MGDA representation" and vs_sum > 1.5:
                print(f"  above target: {name} K={k}: {vs_sum:.2f}x sum")


if __name__ == "__main__":
    main()
