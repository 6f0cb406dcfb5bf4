"""Overhead of the keras_tapeops step with no options vs stock `fit`.

Same model and data on both sides, one process, interleaved rounds of one epoch
each; prints the median ratio. Target: at most 1.02x stock fit.
"""

import common  # noqa: F401  (sets TF log level before TensorFlow loads)
import keras
import numpy as np

import keras_tapeops as kt

ROUNDS = 15


def make_model():
    return keras.Sequential(
        [
            keras.Input((32,)),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def main():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8192, 32)).astype("float32")
    y = rng.integers(0, 10, size=8192)
    stock = make_model()
    upgraded = kt.upgrade(make_model())
    upgraded.set_weights(stock.get_weights())
    for model in (stock, upgraded):
        model.compile(
            optimizer="adam",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        model.fit(x, y, batch_size=128, epochs=1, verbose=0)  # warm-up: trace once

    def epoch(model):
        return lambda: model.fit(x, y, batch_size=128, epochs=1, verbose=0)

    times = common.interleaved(
        {"stock fit": epoch(stock), "kt.upgrade, no options": epoch(upgraded)}, ROUNDS
    )
    print(f"overhead: {ROUNDS} interleaved one-epoch rounds, 64 steps of batch 128")
    common.report(times, "stock fit", "stock fit")


if __name__ == "__main__":
    main()
