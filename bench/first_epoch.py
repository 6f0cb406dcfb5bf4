"""First `fit` epoch (tracing included) with `micro_batches=4` vs stock, MobileNetV2.

The micro-batch step traces the forward/backward pass once (a concrete
function called by the loop); before, it traced it three times (issue 9:
2.4x stock's first epoch). Each round builds fresh models, so every epoch
pays for tracing. Prints the median ratio of the first epoch's wall time,
and of the process's CPU time over the same rounds: tracing is mostly one
Python thread, and on a shared 2-core machine CPU time is the steadier figure
(wall-time ratios moved between 1.32x and 1.64x on the same code within an
hour, while CPU-time ratios stayed within a few percent).

    python bench/first_epoch.py [--rounds 3]
"""

import argparse

import common  # noqa: F401  (sets TF log level before TensorFlow loads)
import keras
import numpy as np

import keras_tapeops as kt

ROUNDS = 3


def make_model():
    backbone = keras.applications.MobileNetV2(
        input_shape=(32, 32, 3), alpha=0.35, include_top=False, weights=None
    )
    inputs = keras.Input((32, 32, 3))
    pooled = keras.layers.GlobalAveragePooling2D()(backbone(inputs))
    return keras.Model(inputs, keras.layers.Dense(10, name="head")(pooled))


def first_epoch(micro_batches, x, y):
    def run():
        keras.utils.set_random_seed(0)
        model = make_model()
        if micro_batches > 1:
            model = kt.upgrade(model)
            model.compile("sgd", "sparse_categorical_crossentropy",
                          micro_batches=micro_batches)
        else:
            model.compile("sgd", "sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=64, epochs=1, verbose=0)
    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, size=256)
    first_epoch(1, x, y)()  # warm up TensorFlow and Keras themselves
    candidates = {"stock fit": first_epoch(1, x, y), "micro_batches=4": first_epoch(4, x, y)}
    wall, cpu = common.interleaved_wall_and_cpu(candidates, args.rounds)
    print("target <= 1.3x")
    common.report(wall, "stock fit", "stock first epoch (wall)")
    common.report(cpu, "stock fit", "stock first epoch (CPU)")


if __name__ == "__main__":
    main()
