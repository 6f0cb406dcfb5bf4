"""Attribution maps of a digit classifier: saliency, Integrated Gradients and Grad-CAM.

A small CNN is trained on scikit-learn's bundled 8x8 digits (a generated
10-class image problem if scikit-learn is missing). For a few test digits
the script computes, each in one traced call for the whole batch:

- `kt.attribution.saliency` (|d logit / d pixel|),
- `kt.attribution.integrated_gradients` (black baseline, 64 steps), and
  checks completeness: the attributions sum to `f(x) - f(baseline)`,
- `kt.attribution.grad_cam` on the last convolution, upsampled to 8x8,

and writes `attribution.png` (one row per digit: input, saliency, IG,
Grad-CAM). Run:

    python examples/attribution.py [--quick] [--out DIR] [--json numbers.json]

`--quick` trains for one epoch on a few batches (a smoke test, seconds).
`--json` writes the test accuracy and the completeness error to a JSON file;
`make figures` keeps it next to the documentation's copy of the PNG
(docs/figures/).
"""

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_tapeops as kt  # noqa: E402


def load_digits_images():
    try:
        from sklearn.datasets import load_digits

        digits = load_digits()
        return (digits.images / 16.0).astype("float32")[..., None], digits.target.astype("int32")
    except ImportError:
        rng = np.random.default_rng(0)
        prototypes = rng.uniform(size=(10, 8, 8, 1))
        y = rng.integers(0, 10, size=1797).astype("int32")
        x = np.clip(prototypes[y] + 0.2 * rng.normal(size=(1797, 8, 8, 1)), 0, 1)
        return x.astype("float32"), y


def make_model():
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu", name="conv_1"),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu", name="conv_2"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(10, name="logits"),
    ])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny run (smoke test)")
    parser.add_argument("--out", default=".", help="directory of the PNG")
    parser.add_argument("--json", default=None, help="also write the numbers to this JSON file")
    args = parser.parse_args()
    x, y = load_digits_images()
    n_train, epochs = (128, 1) if args.quick else (1500, 30)
    keras.utils.set_random_seed(0)
    model = make_model()
    model.compile(optimizer=keras.optimizers.Adam(3e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    model.fit(x[:n_train], y[:n_train], batch_size=64, epochs=epochs, verbose=0)
    _, accuracy = model.evaluate(x[1500:], y[1500:], verbose=0)
    print(f"test accuracy {accuracy:.4f}")

    digits = x[1500:1506]
    sal = kt.attribution.saliency(model, digits)
    ig = kt.attribution.integrated_gradients(model, digits, steps=64)
    cam = kt.attribution.grad_cam(model, digits, layer="conv_2", upsample=True)
    logits = model.predict(digits, verbose=0)
    predicted = np.argmax(logits, axis=1)
    rows = np.arange(len(digits))
    gap = logits[rows, predicted] - model.predict(np.zeros_like(digits), verbose=0)[rows, predicted]
    error = np.abs(ig.reshape(len(digits), -1).sum(axis=1) - gap) / np.abs(gap)
    print(f"IG completeness: max relative error {error.max():.4f} over {len(digits)} digits")
    path = os.path.join(args.out, "attribution.png")
    if save_figure(path, digits, predicted, sal, ig, cam):
        print(f"wrote {path}")
    if args.json:
        numbers = dict(train_images=n_train, epochs=epochs, quick=args.quick,
                       test_accuracy=float(accuracy), digits=len(digits),
                       ig_completeness_max_relative_error=float(error.max()),
                       predicted=[int(p) for p in predicted],
                       labels=[int(label) for label in y[1500:1506]])
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(numbers, f, indent=2)
        print(f"wrote {args.json}")


def save_figure(path, digits, predicted, sal, ig, cam):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('matplotlib is not installed (pip install "keras-tapeops[examples]"): no PNG')
        return False
    columns = [("input", digits[..., 0], "gray"), ("saliency", sal[..., 0], "magma"),
               ("integrated gradients", ig[..., 0], "bwr"), ("Grad-CAM", cam, "jet")]
    fig, axes = plt.subplots(len(digits), len(columns), figsize=(7, 1.7 * len(digits)))
    for r in range(len(digits)):
        for c, (title, maps, cmap) in enumerate(columns):
            ax = axes[r, c]
            if cmap == "bwr":
                bound = np.abs(maps[r]).max() or 1.0
                ax.imshow(maps[r], cmap=cmap, vmin=-bound, vmax=bound)
            else:
                ax.imshow(maps[r], cmap=cmap)
            ax.axis("off")
            if r == 0:
                ax.set_title(title, fontsize=9)
        axes[r, 0].text(-1.5, 3.5, f"pred {predicted[r]}", fontsize=8, ha="right", va="center")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


if __name__ == "__main__":
    main()
