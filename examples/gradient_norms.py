"""Per-group gradient norms and update ratios over training, plotted to a PNG.

Choosing a clipping threshold blind is guesswork: this script logs, inside
`model.fit`, the L2 norm of the true gradient of three groups (`block_1`,
`block_2`, `head`) and of the whole model before and after a
`ClipByGlobalNorm`, and the ratio `||update|| / ||weights||` of each group,
then plots them per training step:

    gradient_transforms=[
        kt.LogGradientNorm(where="block_1", name="block_1_norm"), ...,
        kt.LogGradientNorm(name="grad_norm", log_max=True),
        kt.ClipByGlobalNorm(CLIP),
        kt.LogGradientNorm(name="clipped_norm"),
        kt.LogUpdateRatio(where="block_1", name="block_1_update"), ...,
    ]

History holds each epoch's mean (and `grad_norm_max`). For a per-step
curve, `PerStepValues` recovers each step's value from the running means
Keras passes to `on_train_batch_end` (value_k = k * mean_k - (k-1) * mean_{k-1}).

Run: python examples/gradient_norms.py [out.png [numbers.json]]   (about 15 s on a laptop CPU;
the PNG needs matplotlib: pip install "keras-tapeops[examples]")
"""

import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_tapeops as kt  # noqa: E402


GROUPS = ["block_1", "block_2", "head"]
CLIP = 1.2
EPOCHS = 8
BATCH = 64


def make_data(n=4096, features=32, classes=5, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    w = rng.normal(size=(features, classes))
    y = np.argmax(np.tanh(x @ w) + 0.3 * rng.normal(size=(n, classes)), axis=1)
    return x, y


def make_model(features=32, classes=5):
    inputs = keras.Input((features,))
    h = keras.layers.Dense(128, activation="relu", name="block_1")(inputs)
    h = keras.layers.Dense(128, activation="relu", name="block_2")(h)
    outputs = keras.layers.Dense(classes, name="head")(h)
    return kt.upgrade(keras.Model(inputs, outputs))


def transforms():
    return (
        [kt.LogGradientNorm(where=g, name=f"{g}_norm") for g in GROUPS]
        + [
            kt.LogGradientNorm(name="grad_norm", log_max=True),
            kt.ClipByGlobalNorm(CLIP),
            kt.LogGradientNorm(name="clipped_norm"),
        ]
        + [kt.LogUpdateRatio(where=g, name=f"{g}_update") for g in GROUPS]
    )


class PerStepValues(keras.callbacks.Callback):
    """Each step's value of the named running-mean metrics (steps_per_execution=1)."""

    def __init__(self, names):
        super().__init__()
        self.names = names
        self.values = {name: [] for name in names}
        self._previous = {}

    def on_epoch_begin(self, epoch, logs=None):
        self._previous = {name: 0.0 for name in self.names}

    def on_train_batch_end(self, batch, logs=None):
        k = batch + 1  # steps so far in this epoch
        for name in self.names:
            mean = float(logs[name])
            self.values[name].append(k * mean - (k - 1) * self._previous[name])
            self._previous[name] = mean


def plot(steps, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('matplotlib is not installed (pip install "keras-tapeops[examples]"): '
              "no PNG written")
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for g in GROUPS:
        left.plot(steps.values[f"{g}_norm"], label=g, linewidth=1)
    left.plot(steps.values["grad_norm"], label="all (before clip)", color="black",
              linewidth=1)
    left.plot(steps.values["clipped_norm"], label="all (after clip)", color="gray",
              linestyle="--", linewidth=1)
    left.axhline(CLIP, color="red", linewidth=0.8, label=f"ClipByGlobalNorm({CLIP})")
    left.set(yscale="log", xlabel="training step", ylabel="gradient L2 norm",
             title="LogGradientNorm per group")
    left.legend(fontsize=8)
    for g in GROUPS:
        right.plot(steps.values[f"{g}_update"], label=g, linewidth=1)
    right.set(yscale="log", xlabel="training step", ylabel="||update|| / ||weights||",
              title="LogUpdateRatio per group")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main(path="gradient_norms.png", json_path=None):
    """Trains, prints the epoch means and writes the PNG (and the numbers as JSON if asked)."""
    keras.utils.set_random_seed(0)
    x, y = make_data()
    model = make_model()
    model.compile(
        optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        gradient_transforms=transforms(),
    )
    names = ([f"{g}_norm" for g in GROUPS] + ["grad_norm", "clipped_norm"]
             + [f"{g}_update" for g in GROUPS])
    steps = PerStepValues(names)
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0,
                        callbacks=[steps]).history

    print("epoch  " + "  ".join(f"{n:>13}" for n in ["grad_norm", "grad_norm_max",
                                                      "clipped_norm"] + names[:3]))
    for e in range(EPOCHS):
        row = [history[n][e] for n in ["grad_norm", "grad_norm_max", "clipped_norm"]
               + names[:3]]
        print(f"{e + 1:>5}  " + "  ".join(f"{v:13.4f}" for v in row))
    per_epoch = len(steps.values["grad_norm"]) // EPOCHS
    reproduced = all(
        np.isclose(np.mean(steps.values[n][e * per_epoch:(e + 1) * per_epoch]),
                   history[n][e], rtol=1e-4)
        for n in names for e in range(EPOCHS)
    )
    clipped = sum(v > CLIP for v in steps.values["grad_norm"])
    print(f"per-step values reproduce the epoch means: {reproduced}")
    print(f"steps clipped by ClipByGlobalNorm({CLIP}): {clipped} of "
          f"{len(steps.values['grad_norm'])}")
    print(f"final accuracy: {history['accuracy'][-1]:.3f}")
    if plot(steps, path):
        print(f"wrote {path}")
    if json_path:
        numbers = dict(epochs=EPOCHS, batch=BATCH, clip=CLIP, steps=len(steps.values["grad_norm"]),
                       clipped_steps=int(clipped), per_step_reproduces_epoch_means=bool(reproduced),
                       final_accuracy=float(history["accuracy"][-1]),
                       epoch_means={n: [float(v) for v in history[n]]
                                    for n in ["grad_norm_max"] + names})
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(numbers, f, indent=2)
        print(f"wrote {json_path}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
