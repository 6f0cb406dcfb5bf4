"""Differentially private training of a small CNN on scikit-learn's digits.

The same CNN (Conv2D, Conv2D, Dense) is trained from the same initial
weights four times: with `compile(differential_privacy=kt.DPSGD(...))` at
epsilon about 1, 3 and 8 (delta = 1e-5), and without privacy. The private
runs draw Poisson-sampled batches (`kt.privacy.poisson_batches`, the sampling
the accountant assumes); the noise multiplier of each run is the smallest
that keeps its epsilon (`kt.privacy.noise_multiplier_for`, RDP), and the
spent epsilon is reported by `kt.callbacks.PrivacyBudget` (PLD, tighter).
It prints test accuracy and time per epoch and writes a PNG of accuracy
against epsilon.

    python examples/private_training.py [--quick] [--out private_training.png]
        [--json numbers.json]

`--json` writes the printed numbers (each run's noise multiplier, spent
epsilon and test accuracy) to a JSON file; `make figures` keeps it next to
the documentation's copy of the PNG (docs/figures/).
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from absl import logging  # noqa: E402  (dp-accounting's RDP warns on orders it skips)

import keras_tapeops as kt  # noqa: E402

DELTA = 1e-5
TARGETS = (1.0, 3.0, 8.0)
EXPECTED_BATCH = 128
CLIP = 1.0


def load_data():
    """Digits as 8x8x1 images in [0, 1] (generated blobs without scikit-learn)."""
    try:
        from sklearn.datasets import load_digits

        digits = load_digits()
        x, y, source = digits.data / 16.0, digits.target, "scikit-learn digits"
    except ImportError:
        rng = np.random.default_rng(0)
        y = rng.integers(0, 10, size=1797)
        x = np.clip(rng.normal(size=(10, 64))[y] * 0.3 + 0.5 + rng.normal(size=(1797, 64)) * 0.2, 0, 1)
        source = "generated 10-class images"
    order = np.random.default_rng(1).permutation(len(x))
    x = x[order].reshape(-1, 8, 8, 1).astype("float32")
    y = y[order].astype("int32")
    return (x[:1400], y[:1400]), (x[1400:], y[1400:]), source


def make_model():
    return kt.upgrade(keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(32, 3, strides=2, padding="same", activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(10),
    ]))


class EpochTimer(keras.callbacks.Callback):
    """Wall time of each epoch (the first one includes tracing)."""

    def on_train_begin(self, logs=None):
        self.times = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.times.append(time.perf_counter() - self._start)


def seconds_per_epoch(timer):
    later = timer.times[1:] or timer.times
    return float(np.mean(later))


def train(initial, data, test, epochs, dp=None, sampling_rate=None, seed=0, accountant="pld",
          batch_size=EXPECTED_BATCH):
    (x, y), (x_test, y_test) = data, test
    model = make_model()
    model.set_weights(initial)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    timer = EpochTimer()
    callbacks = [timer]
    if dp is None:
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=loss,
                      metrics=["accuracy"])
        model.fit(x, y, batch_size=batch_size, epochs=epochs, callbacks=callbacks, verbose=0)
        epsilon = float("inf")
    else:
        model.compile(optimizer=keras.optimizers.SGD(1.0, momentum=0.5), loss=loss,
                      metrics=["accuracy"], differential_privacy=dp)
        budget = kt.callbacks.PrivacyBudget(
            len(x), delta=DELTA, sampling_rate=sampling_rate, accountant=accountant
        )
        batches = kt.privacy.poisson_batches((x, y), sampling_rate, seed=seed)
        # The timer first: its epoch ends before the budget's accounting runs.
        history = model.fit(batches, epochs=epochs, callbacks=callbacks + [budget], verbose=0)
        epsilon = history.history["epsilon"][-1]
    accuracy = model.evaluate(x_test, y_test, verbose=0, return_dict=True)["accuracy"]
    return accuracy, epsilon, seconds_per_epoch(timer)


def plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install keras-tapeops[examples])")
        return
    private = [r for r in rows if np.isfinite(r["epsilon"])]
    public = [r for r in rows if not np.isfinite(r["epsilon"])]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot([r["epsilon"] for r in private], [r["accuracy"] for r in private], "o-", label="DP-SGD")
    for r in public:
        ax.axhline(r["accuracy"], color="gray", linestyle="--", label="non-private")
    ax.set_xscale("log")
    ax.set_xticks(list(TARGETS), [f"{t:g}" for t in TARGETS])
    ax.minorticks_off()
    ax.set_xlabel(f"epsilon (delta = {DELTA:g})")
    ax.set_ylabel("test accuracy")
    ax.set_title("Small CNN on digits")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"wrote {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 epochs on 600 images (a smoke test)")
    parser.add_argument("--out", default="private_training.png", help="PNG path")
    parser.add_argument("--json", default=None, help="also write the numbers to this JSON file")
    args = parser.parse_args()
    logging.set_verbosity(logging.ERROR)
    epochs = 2 if args.quick else 20
    batch = 64 if args.quick else EXPECTED_BATCH
    accountant = "rdp" if args.quick else "pld"

    train_data, test_data, source = load_data()
    if args.quick:  # a smoke test: fewer training images
        train_data = (train_data[0][:600], train_data[1][:600])
    keras.utils.set_random_seed(0)
    initial = make_model().get_weights()
    n = len(train_data[0])
    rate = batch / n
    steps = epochs * max(1, round(1 / rate))
    print(f"data: {source}, {n} training and {len(test_data[0])} test images; "
          f"Poisson sampling rate {rate:.4f} (expected batch {batch}), "
          f"{steps} steps, clip {CLIP}")

    rows = []
    for target in TARGETS:
        sigma = kt.privacy.noise_multiplier_for(target, steps, rate, delta=DELTA, accountant="rdp")
        dp = kt.DPSGD(l2_norm_clip=CLIP, noise_multiplier=sigma)
        accuracy, epsilon, seconds = train(
            initial, train_data, test_data, epochs, dp, rate, accountant=accountant,
            batch_size=batch,
        )
        rows.append(dict(target=target, sigma=sigma, epsilon=epsilon, accuracy=accuracy, seconds=seconds))
    accuracy, epsilon, seconds = train(initial, train_data, test_data, epochs, batch_size=batch)
    rows.append(dict(target=float("inf"), sigma=0.0, epsilon=epsilon, accuracy=accuracy, seconds=seconds))

    print(f"{'target eps':>10} {'sigma':>7} {'spent eps (' + accountant.upper() + ')':>16} "
          f"{'test acc':>9} {'s/epoch':>8}")
    for r in rows:
        label = "none" if not np.isfinite(r["target"]) else f"{r['target']:g}"
        spent = "inf" if not np.isfinite(r["epsilon"]) else f"{r['epsilon']:.3f}"
        print(f"{label:>10} {r['sigma']:7.3f} {spent:>16} {r['accuracy']:9.3f} {r['seconds']:8.3f}")
    plot(rows, args.out)
    if args.json:
        write_numbers(args.json, rows, epochs=epochs, train_images=n, expected_batch=batch,
                      accountant=accountant, quick=args.quick)


def write_numbers(path, rows, **settings):
    """The numbers the table prints, as JSON (epsilon None for the non-private run)."""
    private = [r for r in rows if np.isfinite(r["target"])]
    [public] = [r for r in rows if not np.isfinite(r["target"])]
    numbers = dict(
        settings, delta=DELTA, clip=CLIP,
        private=[dict(target_epsilon=r["target"], noise_multiplier=float(r["sigma"]),
                      spent_epsilon=float(r["epsilon"]), test_accuracy=float(r["accuracy"]),
                      seconds_per_epoch=r["seconds"]) for r in private],
        non_private=dict(test_accuracy=float(public["accuracy"]),
                         seconds_per_epoch=public["seconds"]),
    )
    with open(path, "w", encoding="utf-8") as f:
        json.dump(numbers, f, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
