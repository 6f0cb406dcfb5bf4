"""SAM step time vs stock `fit` (floor: two forward/backward passes, about 2x).

Same model and data on both sides, one process, interleaved one-epoch rounds;
prints the median ratio. Target: SAM at most 2.1x stock fit.
"""

import common  # noqa: F401  (sets TF log level before TensorFlow loads)
import keras
import numpy as np

import keras_tapeops as kt

ROUNDS = 11


def make_model():
    return keras.Sequential(
        [
            keras.Input((32,)),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def main():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8192, 32)).astype("float32")
    y = rng.integers(0, 10, size=8192)
    stock = make_model()
    sam = kt.upgrade(make_model())
    asam = kt.upgrade(make_model())
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    stock.compile(optimizer="sgd", loss=loss, metrics=["accuracy"])
    sam.compile(optimizer="sgd", loss=loss, metrics=["accuracy"],
                sharpness_aware=kt.SAM(0.05))
    asam.compile(optimizer="sgd", loss=loss, metrics=["accuracy"],
                 sharpness_aware=kt.SAM(0.5, adaptive=True))
    for model in (stock, sam, asam):
        model.fit(x, y, batch_size=128, epochs=1, verbose=0)  # warm-up: trace once

    def epoch(model):
        return lambda: model.fit(x, y, batch_size=128, epochs=1, verbose=0)

    times = common.interleaved(
        {"stock fit": epoch(stock), "SAM": epoch(sam), "ASAM": epoch(asam)}, ROUNDS
    )
    print(f"sam: {ROUNDS} interleaved one-epoch rounds, 64 steps of batch 128")
    common.report(times, "stock fit", "stock fit")


if __name__ == "__main__":
    main()
