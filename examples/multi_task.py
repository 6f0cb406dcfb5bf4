"""Multi-task training inside fit(): plain sum vs PCGrad vs MGDA vs uncertainty weighting.

Part 1, the two-objective toy landscape of the PCGrad paper (as coded in the
CAGrad repository's toy.py): each aggregator (`kt.PCGrad`, `kt.MGDA`,
`kt.CAGrad`) is used directly on the two gradients of a 2-D point
(`aggregator.aggregate(rows)`), next to the plain sum, from three starting
points; the final `(f1, f2)` of each run is printed and the trajectories are
drawn on the landscape, so you can see where each method's steps lead.

Part 2, a small two-output model on generated data with tasks of very
different scales (task `b`'s loss is ~25 times task `a`'s; their targets
depend on negatively correlated directions of the input, yet the logged
cosine of their trunk gradients stays near 0): the same model, initial
weights and batches trained with `fit()` and `compile(task_balancing=...)`:
per-task validation error (relative to the target's variance), the logged
task weights and gradient cosine, and the time per epoch.

Writes `multi_task.png` (or the path given with `--out`): toy trajectories and
the per-task validation curves. `--quick` runs a few steps only (smoke test).

Run: python examples/multi_task.py [--quick] [--out multi_task.png] [--json numbers.json]

`--json` writes both printed tables to a JSON file; `make figures` keeps it
next to the documentation's copy of the PNG (docs/figures/).
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_tapeops as kt  # noqa: E402
from keras_tapeops.multitask.option import StepContext  # noqa: E402

LOWER = 5e-6
STARTS = [(-8.5, 7.5), (0.0, 0.0), (9.0, 9.0)]


# ------------------------------------------------------------------ part 1
def toy_losses(point):
    """The two objectives of the PCGrad/CAGrad toy on a 2-D point `(x1, x2)`."""
    x1, x2 = point[0], point[1]
    f1 = tf.math.log(tf.maximum(tf.abs(0.5 * (-x1 - 7) - tf.tanh(-x2)), LOWER)) + 6
    f2 = tf.math.log(tf.maximum(tf.abs(0.5 * (-x1 + 3) + tf.tanh(-x2) + 2), LOWER)) + 6
    c1 = tf.maximum(tf.tanh(x2 * 0.5), 0.0)
    f1_sq = ((-x1 + 7) ** 2 + 0.1 * (-x2 - 8) ** 2) / 10 - 20
    f2_sq = ((-x1 - 7) ** 2 + 0.1 * (-x2 - 8) ** 2) / 10 - 20
    c2 = tf.maximum(tf.tanh(-x2 * 0.5), 0.0)
    return tf.stack([f1 * c1 + f1_sq * c2, f2 * c1 + f2_sq * c2])


def toy_trajectories(aggregator, starts, steps, learning_rate=0.01):
    """Adam on each starting point with the aggregated gradient (None: the plain sum)."""
    points = tf.Variable(np.array(starts, "float32"))
    optimizer = keras.optimizers.Adam(learning_rate)
    optimizer.build([points])

    @tf.function
    def step(index):
        directions = []
        for i in range(len(starts)):  # one trace for every starting point
            with tf.GradientTape() as tape:
                point = tf.identity(points[i])
                tape.watch(point)
                losses = toy_losses(point)
            rows = tape.jacobian(losses, point)  # [2 tasks, 2 coordinates]
            if aggregator is None:
                directions.append(tf.reduce_sum(rows, axis=0))
            else:
                context = StepContext(2, losses=losses, step=index, seed=0)
                directions.append(aggregator.aggregate(rows, context))
        optimizer.apply_gradients([(tf.stack(directions), points)])

    path = [points.numpy().copy()]
    for i in range(steps):
        step(tf.constant(i, tf.int64))
        path.append(points.numpy().copy())
    path = np.array(path)  # [steps + 1, starts, 2]
    finals = [toy_losses(tf.constant(p)).numpy() for p in path[-1]]
    return [path[:, i] for i in range(len(starts))], finals


def run_toy(steps, table=None):
    """Trajectories per method; appends each method's final (f1, f2) per start to `table`."""
    methods = {
        "sum": None,
        "PCGrad": kt.PCGrad(seed=0),
        "MGDA": kt.MGDA(),
        "CAGrad c=0.4": kt.CAGrad(c=0.4),
    }
    paths = {}
    print(f"Part 1: the two-objective toy, Adam(0.01), {steps} steps")
    print(f"{'method':<14}" + "".join(f"  start {str(s):<14}" for s in STARTS))
    for name, aggregator in methods.items():
        paths[name], losses = toy_trajectories(aggregator, STARTS, steps)
        finals = [f"f=({f1:6.2f},{f2:6.2f})" for f1, f2 in losses]
        if table is not None:
            table.append(dict(method=name, final=[[float(f1), float(f2)] for f1, f2 in losses]))
        print(f"{name:<14}" + "".join(f"  {f:<20}" for f in finals))
    return paths


# ------------------------------------------------------------------ part 2
def make_data(n, seed):
    directions = np.random.default_rng(123)
    u = directions.normal(size=8)
    v = -0.8 * u + 0.6 * directions.normal(size=8)  # negatively correlated directions
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype("float32")
    y_a = np.tanh(x @ u / 3)[:, None] + 0.1 * rng.normal(size=(n, 1))
    y_b = 5.0 * np.tanh(x @ v / 3)[:, None] + 0.5 * rng.normal(size=(n, 1))
    return x, {"a": y_a.astype("float32"), "b": y_b.astype("float32")}


def make_model():
    inputs = keras.Input((8,))
    trunk = keras.layers.Dense(16, activation="relu", name="trunk")(inputs)
    outputs = {
        name: keras.layers.Dense(1, name=name)(
            keras.layers.Dense(8, activation="relu", name=f"{name}_hidden")(trunk)
        )
        for name in ("a", "b")
    }
    return kt.upgrade(keras.Model(inputs, outputs))


class EpochTimer(keras.callbacks.Callback):
    """Seconds per epoch, the first (which traces the step) left out when there are more."""

    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.times = getattr(self, "times", []) + [time.perf_counter() - self.start]

    def per_epoch(self):
        times = self.times[1:] or self.times
        return float(np.median(times))


def run_model(epochs, n, table=None):
    """Validation curves per method; appends each method's printed row to `table`."""
    x, y = make_data(n, 0)
    x_val, y_val = make_data(n // 2, 1)
    keras.utils.set_random_seed(0)
    initial = make_model().get_weights()
    variance = {k: float(np.var(v)) for k, v in y_val.items()}
    methods = {
        "sum": None,
        "PCGrad": kt.PCGrad(shared="trunk", seed=0),
        "MGDA": kt.MGDA(shared="trunk"),
        "uncertainty": kt.UncertaintyWeighting(learning_rate=0.05),
    }
    curves = {}
    print(f"\nPart 2: two-output model, {n} samples, {epochs} epochs, Adam(3e-3)")
    print(f"{'method':<12} {'val a (rel)':>11} {'val b (rel)':>11} {'weight a':>9} "
          f"{'weight b':>9} {'cos(a,b)':>9} {'s/epoch':>8}")
    for name, option in methods.items():
        model = make_model()
        model.set_weights(initial)
        model.compile(optimizer=keras.optimizers.Adam(3e-3), loss={"a": "mse", "b": "mse"},
                      task_balancing=option)
        timer = EpochTimer()
        history = model.fit(x, y, batch_size=32, epochs=epochs, shuffle=False, verbose=0,
                            validation_data=(x_val, y_val), callbacks=[timer])
        per_epoch = timer.per_epoch()
        logs = history.history
        curves[name] = {k: np.array(logs[f"val_{k}_loss"]) / variance[k] for k in ("a", "b")}
        weight = [logs.get(f"{k}_weight", [1.0])[-1] for k in ("a", "b")]
        cosine = logs.get("cosine_a_b", [float("nan")])[-1]
        if table is not None:
            table.append(dict(method=name, val_a=float(curves[name]["a"][-1]),
                              val_b=float(curves[name]["b"][-1]), weight_a=float(weight[0]),
                              weight_b=float(weight[1]), cosine=float(cosine),
                              seconds_per_epoch=per_epoch))
        print(f"{name:<12} {curves[name]['a'][-1]:11.3f} {curves[name]['b'][-1]:11.3f} "
              f"{weight[0]:9.3f} {weight[1]:9.3f} {cosine:9.3f} {per_epoch:8.3f}")
    return curves


def plot(paths, curves, out):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4.5))
    grid = np.linspace(-10, 10, 200)
    xx, yy = np.meshgrid(grid, grid)
    values = toy_losses(tf.constant(np.stack([xx, yy]), tf.float32)).numpy().sum(0)
    left.contourf(xx, yy, values, levels=30, cmap="Greys")
    for name, runs in paths.items():
        color = left.plot([], [], label=name)[0].get_color()
        for run in runs:
            left.plot(run[:, 0], run[:, 1], color=color, linewidth=1.5)
            left.scatter(run[-1, 0], run[-1, 1], color=color, s=20)
    left.set_title("toy: trajectories on f1 + f2")
    left.legend(fontsize=8)
    for axis, task in ((middle, "a"), (right, "b")):
        for name, curve in curves.items():
            axis.plot(np.arange(1, len(curve[task]) + 1), curve[task], label=name)
        axis.set_title(f"task {task}: validation MSE / variance")
        axis.set_xlabel("epoch")
        axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    print(f"\nwrote {out}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few steps (smoke test)")
    parser.add_argument("--out", default="multi_task.png", help="where to write the PNG")
    parser.add_argument("--json", default=None, help="also write the numbers to this JSON file")
    args = parser.parse_args()
    steps, epochs, n = (10, 2, 96) if args.quick else (3000, 30, 2048)
    toy, model = [], []
    paths = run_toy(steps, toy)
    curves = run_model(epochs, n, model)
    plot(paths, curves, args.out)
    if args.json:
        numbers = dict(toy_steps=steps, toy_starts=[list(s) for s in STARTS], epochs=epochs,
                       samples=n, quick=args.quick, toy=toy, model=model)
        with open(args.json, "w", encoding="utf-8") as f:
            # NaN (the cosine of a method that logs none) is written as null.
            f.write(json.dumps(numbers, indent=2).replace("NaN", "null"))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
