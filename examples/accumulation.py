"""Large effective batches on limited memory with keras_tapeops accumulation.

- `micro_batches=4`: every batch of 64 runs as 4 sequential passes of 16
  (peak activation memory of 16 samples), one optimizer step per batch.
- `accumulation_steps=4`: 4 consecutive batches of 16 make one step.

Both give the step stock Keras takes on the batch of 64; this script checks it.
Run: python examples/accumulation.py   (a few seconds on CPU)
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_tapeops as kt  # noqa: E402


def make_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((20,)),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dense(3),
    ])


def main():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 20)).astype("float32")
    y = rng.integers(0, 3, size=(256,))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    stock = make_model()
    stock.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss)
    stock.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)

    micro = kt.upgrade(make_model())
    micro.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss,
                  micro_batches=4,
                  # With BatchNormalization layers: one moving-statistics update
                  # per batch with the whole batch's statistics (the default),
                  # or "per_micro_batch".
                  batch_norm_updates="large_batch")
    micro.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)

    window = kt.upgrade(make_model())
    window.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss,
                   accumulation_steps=4)
    window.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)

    for name, model in [("micro_batches=4", micro), ("accumulation_steps=4", window)]:
        diff = max(float(np.abs(a - b).max())
                   for a, b in zip(model.get_weights(), stock.get_weights()))
        steps = int(keras.ops.convert_to_numpy(model.optimizer.iterations))
        print(f"{name:22s} optimizer steps={steps}  max |w - stock batch 64| = {diff:.2e}")


if __name__ == "__main__":
    main()
