"""Loss-based selection on digits with 30% label noise: stock vs TopLoss vs RHO-LOSS vs Selective Backprop.

scikit-learn's digits (8x8 images; generated blobs if scikit-learn is
missing) split into train / holdout / test; 30% of the train and holdout
labels are replaced by a random other class. The same MLP is trained from the
same initial weights four ways, each taking gradient steps on 32 examples:

  stock              `fit` on batches of 32;
  TopLoss            candidate batches of 160, the 32 largest losses kept
                     (`kt.TopLoss(fraction=0.2)`);
  RHO-LOSS           candidate batches of 160, the 32 largest reducible
                     losses (`kt.ReducibleLoss(table, fraction=0.2)`; the
                     irreducible loss of each train example, by id, from a
                     model trained on the holdout set);
  Selective Backprop candidate batches of 160, 32 drawn by loss percentile
                     (`kt.SelectiveBackprop(beta=2.0, fraction=0.2)`).

Test accuracy (clean labels) is recorded every `EVAL_EVERY` steps against the
number of steps and the training wall-clock time (evaluation excluded). It
prints a table and writes a PNG with both curves.

    python examples/loss_based_selection.py [--quick] [--out loss_based_selection.png]
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_tapeops as kt  # noqa: E402

NOISE = 0.3
KEPT = 32
CANDIDATES = 160
EVAL_EVERY = 10


def load_data(seed=0):
    """(train, holdout, test) splits; train and holdout labels 30% noisy."""
    try:
        from sklearn.datasets import load_digits

        digits = load_digits()
        x, y = (digits.data / 16.0).astype("float32"), digits.target.astype("int32")
    except ImportError:
        rng = np.random.default_rng(seed)
        centers = rng.normal(size=(10, 64))
        y = rng.integers(0, 10, size=1797).astype("int32")
        x = (centers[y] + rng.normal(size=(1797, 64))).astype("float32")
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(x))
    x, y = x[order], y[order]
    splits = {"train": slice(0, 1000), "holdout": slice(1000, 1400), "test": slice(1400, None)}
    data = {name: (x[s], y[s].copy()) for name, s in splits.items()}
    for name in ("train", "holdout"):
        labels = data[name][1]
        noisy = rng.random(len(labels)) < NOISE
        labels[noisy] = (labels[noisy] + rng.integers(1, 10, size=noisy.sum())) % 10
    return data


def mlp():
    keras.utils.set_random_seed(1)
    return kt.upgrade(keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(10),
    ]))


def ce(reduction="sum_over_batch_size"):
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)


class Curve(keras.callbacks.Callback):
    """Test accuracy every `EVAL_EVERY` steps, against steps and training seconds."""

    def __init__(self, test):
        super().__init__()
        self.test = test
        self.points = []  # (steps, seconds, accuracy)
        self.seconds = 0.0

    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds += time.perf_counter() - self.start
        x, y = self.test
        predicted = np.argmax(self.model.predict(x, verbose=0, batch_size=512), axis=1)
        steps = int(self.model.optimizer.iterations.numpy())
        self.points.append((steps, self.seconds, float(np.mean(predicted == y))))


def irreducible_table(data, epochs):
    """Per-example loss of a holdout-trained model on every train example (by id)."""
    holdout = mlp()
    holdout.compile(optimizer=keras.optimizers.Adam(1e-3), loss=ce())
    holdout.fit(*data["holdout"], batch_size=32, epochs=epochs, verbose=0)
    x, y = data["train"]
    return ce(None)(y, holdout.predict(x, verbose=0)).numpy()


def run(name, data, steps, table):
    x, y = data["train"]
    model = mlp()
    selection = {
        "stock": None,
        "TopLoss": kt.TopLoss(fraction=KEPT / CANDIDATES),
        "RHO-LOSS": kt.ReducibleLoss(irreducible=table, fraction=KEPT / CANDIDATES),
        "SelectiveBackprop": kt.SelectiveBackprop(beta=2.0, fraction=KEPT / CANDIDATES, seed=0),
    }[name]
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=ce(), sample_selection=selection)
    inputs = {"x": x, "example_id": np.arange(len(x))} if name == "RHO-LOSS" else x
    batch = KEPT if selection is None else CANDIDATES
    dataset = (tf.data.Dataset.from_tensor_slices((inputs, y))
               .shuffle(len(x), seed=0).repeat().batch(batch, drop_remainder=True))
    curve = Curve(data["test"])
    model.fit(dataset, steps_per_epoch=EVAL_EVERY, epochs=steps // EVAL_EVERY,
              callbacks=[curve], verbose=0)
    return curve.points


def plot(curves, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install keras-tapeops[examples])")
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for name, points in curves.items():
        steps, seconds, accuracy = zip(*points)
        axes[0].plot(steps, accuracy, label=name)
        axes[1].plot(seconds, accuracy, label=name)
    axes[0].set_xlabel("gradient steps (32 examples each)")
    axes[1].set_xlabel("training wall-clock time (s)")
    axes[0].set_ylabel("test accuracy (clean labels)")
    axes[0].legend()
    fig.suptitle(f"digits, {int(NOISE * 100)}% label noise")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="30 steps per method (a smoke test)")
    parser.add_argument("--steps", type=int, default=400, help="gradient steps per method")
    parser.add_argument("--out", default="loss_based_selection.png", help="PNG path")
    args = parser.parse_args()
    steps = 30 if args.quick else args.steps

    data = load_data()
    table = irreducible_table(data, epochs=3 if args.quick else 30)
    curves = {name: run(name, data, steps, table)
              for name in ("stock", "TopLoss", "RHO-LOSS", "SelectiveBackprop")}
    print(f"{'method':<18} {'steps':>6} {'final acc':>9} {'best acc':>9} {'train s':>8}")
    for name, points in curves.items():
        best = max(p[2] for p in points)
        steps_done, seconds, final = points[-1]
        print(f"{name:<18} {steps_done:>6d} {final:>9.3f} {best:>9.3f} {seconds:>8.2f}")
    plot(curves, args.out)


if __name__ == "__main__":
    main()
