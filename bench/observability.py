"""Benchmark: the cost of logging gradient norms and of skipping non-finite steps.

All sides train the same MLP (backbone_1 -> backbone_2 -> head) with SGD on
the same data, one epoch per round:
  - stock fit: a plain `keras.Model`, no options;
  - keras_tapeops, no options (the stock step);
  - keras_tapeops, log 3 groups: `LogGradientNorm` of `backbone_1`,
    `backbone_2` and `head` (three metrics updated every step);
  - keras_tapeops, SkipNonFinite: the finiteness check and the conditional
    optimizer step (no batch is non-finite, so every step is applied);
  - keras_tapeops, both.
Rounds are interleaved in one process; prints the median time per epoch and
the median ratio to stock fit (target: <= 1.03x for logging and for
SkipNonFinite).

Run: python bench/observability.py   (about 40 s on 2 CPU cores)
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import common  # noqa: E402  (sets the TF log level before TensorFlow loads)
import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_tapeops as kt  # noqa: E402

N, FEATURES, CLASSES, BATCH = 8192, 64, 10, 128
ROUNDS = 30
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def make_model():
    inputs = keras.Input((FEATURES,))
    h = keras.layers.Dense(256, activation="relu", name="backbone_1")(inputs)
    h = keras.layers.Dense(256, activation="relu", name="backbone_2")(h)
    outputs = keras.layers.Dense(CLASSES, name="head")(h)
    return keras.Model(inputs, outputs)


def stock(weights):
    model = make_model()
    model.set_weights(weights)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss=LOSS)
    return model


def tapeops(weights, transforms):
    model = kt.upgrade(make_model())
    model.set_weights(weights)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss=LOSS,
                  gradient_transforms=transforms)
    return model


def three_groups():
    return [kt.LogGradientNorm(where=g, name=f"{g}_norm")
            for g in ("backbone_1", "backbone_2", "head")]


def main():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, size=(N,))
    weights = make_model().get_weights()
    models = {
        "stock fit": stock(weights),
        "keras_tapeops, no options": tapeops(weights, None),
        "keras_tapeops, log 3 groups": tapeops(weights, three_groups()),
        "keras_tapeops, SkipNonFinite": tapeops(weights, [kt.SkipNonFinite()]),
        "keras_tapeops, both": tapeops(weights, [kt.SkipNonFinite(), *three_groups()]),
    }

    def epoch(model):
        return lambda: model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)

    candidates = {name: epoch(model) for name, model in models.items()}
    for run in candidates.values():  # warm up: trace and compile
        run()
    print(f"MLP {FEATURES}-256-256-{CLASSES}, {N} samples, batch {BATCH}, "
          f"{ROUNDS} interleaved rounds of one epoch each")
    times = common.interleaved(candidates, ROUNDS)
    common.report(times, "stock fit", "stock fit")


if __name__ == "__main__":
    main()
