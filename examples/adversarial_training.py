"""Adversarial training in `fit`: standard vs FGSM-RS vs PGD-7 vs TRADES on 8x8 digits.

The same small CNN, from the same initial weights and batches, is trained
four ways on scikit-learn's bundled digits (pixels scaled to [0, 1]; a
generated 10-class image problem if scikit-learn is missing):

- standard training,
- FGSM with a random start (Wong et al. 2020, "fast" adversarial training):
  `loss_terms=[kt.AdversarialLoss(kt.attacks.FGSM(eps))]`, watched by
  `kt.callbacks.RobustAccuracy` + `EarlyStopping(restore_best_weights=True)`
  to catch catastrophic overfitting,
- PGD-7 (Madry et al. 2018): `kt.AdversarialLoss(kt.attacks.PGD(eps, steps=7))`,
- TRADES (Zhang et al. 2019): `kt.TRADES(kt.attacks.PGD(eps, steps=7), beta=6)`.

For each it prints the clean and PGD-20 test accuracy
(`kt.attacks.evaluate_robustness`) and the time per epoch, and it writes
`adversarial_examples.png` (clean digits, their PGD-20 versions against the
standard and the PGD-7 model, with the predictions). Run:

    python examples/adversarial_training.py [--quick] [--out DIR] [--json numbers.json]

`--quick` trains on a few batches for one epoch (a smoke test, seconds).
`--json` writes the printed table to a JSON file; `make figures` keeps it next
to the documentation's copy of the PNG (docs/figures/).
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_tapeops as kt  # noqa: E402

EPSILON = 0.1  # on pixels in [0, 1]


def load_digits_images():
    try:
        from sklearn.datasets import load_digits

        digits = load_digits()
        x = (digits.images / 16.0).astype("float32")[..., None]
        y = digits.target.astype("int32")
        source = "scikit-learn digits"
    except ImportError:
        rng = np.random.default_rng(0)
        prototypes = rng.uniform(size=(10, 8, 8, 1))
        y = rng.integers(0, 10, size=1797).astype("int32")
        x = np.clip(prototypes[y] + 0.2 * rng.normal(size=(1797, 8, 8, 1)), 0, 1)
        x = x.astype("float32")
        source = "generated 10-class images"
    order = np.random.default_rng(1).permutation(len(x))
    return x[order], y[order], source


def make_model():
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(64, 3, strides=2, padding="same", activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])


class EpochTimer(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.times = getattr(self, "times", []) + [time.perf_counter() - self.start]


def train(initial, x, y, epochs, terms, callbacks=()):
    model = kt.upgrade(make_model())
    model.set_weights(initial)
    model.compile(optimizer=keras.optimizers.Adam(2e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], loss_terms=terms)
    timer = EpochTimer()
    model.fit(x, y, batch_size=64, epochs=epochs, shuffle=False, verbose=0,
              callbacks=[*callbacks, timer])
    # The first epoch includes tracing; report the later ones when there are.
    times = timer.times[1:] or timer.times
    return model, float(np.mean(times))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny run (smoke test)")
    parser.add_argument("--out", default=".", help="directory of the PNG")
    parser.add_argument("--json", default=None, help="also write the numbers to this JSON file")
    args = parser.parse_args()
    x, y, source = load_digits_images()
    n_train, epochs = (128, 1) if args.quick else (1400, 20)
    (x_train, y_train), (x_test, y_test) = (x[:n_train], y[:n_train]), (x[1400:], y[1400:])
    if args.quick:
        x_test, y_test = x_test[:32], y_test[:32]
    print(f"data: {source}, {len(x_train)} training and {len(x_test)} test images, "
          f"epsilon {EPSILON} (L-inf, pixels in [0, 1])")
    keras.utils.set_random_seed(0)
    initial = make_model().get_weights()
    clip = (0.0, 1.0)
    pgd7 = kt.attacks.PGD(EPSILON, step_size=EPSILON / 4, steps=7, clip=clip, seed=0)
    pgd20 = kt.attacks.PGD(EPSILON, step_size=EPSILON / 8, steps=20, clip=clip, seed=1)
    # Wong et al.: FGSM from a random start, step 1.25 * epsilon; stop on
    # the best PGD accuracy (catastrophic overfitting shows up there).
    watch = kt.callbacks.RobustAccuracy(
        (x_test[:128], y_test[:128]), kt.attacks.PGD(EPSILON, EPSILON / 4, 7, clip=clip, seed=2))
    stop = keras.callbacks.EarlyStopping(monitor="robust_accuracy", mode="max", patience=5,
                                         restore_best_weights=True)
    runs = {
        "standard": ([], ()),
        "FGSM-RS": ([kt.AdversarialLoss(kt.attacks.FGSM(EPSILON, clip=clip, seed=0))],
                    (watch, stop)),
        "PGD-7": ([kt.AdversarialLoss(pgd7)], ()),
        "TRADES": ([kt.TRADES(pgd7, beta=6.0)], ()),
    }
    models, table = {}, []
    print(f"{'training':<10} {'clean acc':>9} {'PGD-20 acc':>10} {'s/epoch':>8}")
    for label, (terms, callbacks) in runs.items():
        model, seconds = train(initial, x_train, y_train, epochs, terms, callbacks)
        result = kt.attacks.evaluate_robustness(model, (x_test, y_test), pgd20, batch_size=256)
        models[label] = model
        table.append(dict(training=label, clean_accuracy=float(result["accuracy"]),
                          robust_accuracy=float(result["robust_accuracy"]),
                          seconds_per_epoch=seconds))
        print(f"{label:<10} {result['accuracy']:>9.4f} {result['robust_accuracy']:>10.4f} "
              f"{seconds:>8.3f}")
    path = os.path.join(args.out, "adversarial_examples.png")
    if save_examples(path, models, x_test[:8], y_test[:8], pgd20):
        print(f"wrote {path}")
    if args.json:
        numbers = dict(train_images=len(x_train), test_images=len(x_test), epochs=epochs,
                       epsilon=EPSILON, quick=args.quick, runs=table)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(numbers, f, indent=2)
        print(f"wrote {args.json}")


def save_examples(path, models, x, y, attack):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('matplotlib is not installed (pip install "keras-tapeops[examples]"): no PNG')
        return False
    rows = [("clean", x, models["standard"])]
    for label in ("standard", "PGD-7"):
        rows.append((f"PGD-20 vs {label}", attack(models[label], x, y).numpy(), models[label]))
    fig, axes = plt.subplots(len(rows), len(x), figsize=(1.4 * len(x), 1.6 * len(rows)))
    for r, (title, images, model) in enumerate(rows):
        predictions = np.argmax(model.predict(images, verbose=0), axis=1)
        for c in range(len(x)):
            ax = axes[r, c]
            ax.imshow(images[c, ..., 0], cmap="gray", vmin=0, vmax=1)
            color = "green" if predictions[c] == y[c] else "red"
            ax.set_title(f"pred {predictions[c]}", fontsize=8, color=color)
            ax.axis("off")
        axes[r, 0].text(-1.5, 3.5, title, fontsize=8, ha="right", va="center")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


if __name__ == "__main__":
    main()
