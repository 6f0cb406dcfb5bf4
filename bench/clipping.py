"""Benchmark: stock `fit` with `global_clipnorm` vs keras_tapeops with three clipping groups.

Both sides train the same MLP (backbone_1 -> backbone_2 -> head) with SGD on
the same data, one epoch per round:
  - stock fit: `keras.optimizers.SGD(global_clipnorm=5.0)`, one rule for all;
  - keras_tapeops, 1 group: `kt.ClipByGlobalNorm(5.0)` (same math as stock);
  - keras_tapeops, 3 groups: `ClipByNorm(1.0, where="head")`,
    `ClipByGlobalNorm(5.0, where="backbone_1")`,
    `ClipByValue(0.5, where="backbone_2")`.
Rounds are interleaved in one process; prints the median time per epoch and
the median ratio to stock fit (target: <= 1.05x).

Run: python bench/clipping.py   (about a minute on 2 CPU cores)
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import common  # noqa: E402  (sets the TF log level before TensorFlow loads)
import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_tapeops as kt  # noqa: E402

N, FEATURES, CLASSES, BATCH = 8192, 64, 10, 128
ROUNDS = 15


def make_model():
    inputs = keras.Input((FEATURES,))
    h = keras.layers.Dense(256, activation="relu", name="backbone_1")(inputs)
    h = keras.layers.Dense(256, activation="relu", name="backbone_2")(h)
    outputs = keras.layers.Dense(CLASSES, name="head")(h)
    return keras.Model(inputs, outputs)


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def stock(weights):
    model = make_model()
    model.set_weights(weights)
    model.compile(optimizer=keras.optimizers.SGD(0.01, global_clipnorm=5.0), loss=LOSS)
    return model


def tapeops(weights, transforms):
    model = kt.upgrade(make_model())
    model.set_weights(weights)
    model.compile(
        optimizer=keras.optimizers.SGD(0.01), loss=LOSS,
        gradient_transforms=transforms,
    )
    return model


def main():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, size=(N,))
    weights = make_model().get_weights()
    models = {
        "stock fit (global_clipnorm)": stock(weights),
        "keras_tapeops, 1 group": tapeops(weights, [kt.ClipByGlobalNorm(5.0)]),
        "keras_tapeops, 3 groups": tapeops(weights, [
            kt.ClipByNorm(1.0, where="head"),
            kt.ClipByGlobalNorm(5.0, where="backbone_1"),
            kt.ClipByValue(0.5, where="backbone_2"),
        ]),
    }

    def epoch(model):
        return lambda: model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)

    candidates = {name: epoch(model) for name, model in models.items()}
    for run in candidates.values():  # warm up: trace and compile
        run()
    print(f"MLP {FEATURES}-256-256-{CLASSES}, {N} samples, batch {BATCH}, "
          f"{ROUNDS} interleaved rounds of one epoch each")
    times = common.interleaved(candidates, ROUNDS)
    common.report(times, "stock fit (global_clipnorm)", "stock fit")


if __name__ == "__main__":
    main()
