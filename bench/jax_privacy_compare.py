"""Benchmark: DP-SGD on JAX, keras_tapeops's `fit` step against `jax_privacy` (issue 32).

The same MLP (64 -> 256 -> 256 -> 10, softmax cross-entropy) and data, noise
off, clip 1.0, SGD: one epoch of `model.fit` with
`differential_privacy=kt.DPSGD(1.0, 0.0)` (per-example gradients by
`jax.vmap`) against one epoch of a jitted step built on
`jax_privacy.clipping.clipped_grad` (the mean of the clipped per-example
gradients, then the SGD update), called batch by batch from Python, as
`fit` calls its step. Rounds interleaved; median times and the median
ratio. Both equal the same run (tests/test_jax_backend.py,
`test_dp_sgd_equals_jax_privacy_clipped_grad`). No target: the peer is
the floor a hand-written JAX loop reaches.

Run: python bench/jax_privacy_compare.py   (about a minute on 2 CPU cores)
"""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import common  # noqa: E402  (sets the TF log level before TensorFlow loads)
import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from jax_privacy.clipping import clipped_grad  # noqa: E402

import keras_tapeops as kt  # noqa: E402

N, FEATURES, CLASSES, BATCH, CLIP, LR = 4096, 64, 10, 128, 1.0, 0.01
ROUNDS = 7


def make_mlp():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,))
    h = keras.layers.Dense(256, activation="relu")(inputs)
    h = keras.layers.Dense(256, activation="relu")(h)
    return keras.Model(inputs, keras.layers.Dense(CLASSES)(h))


def main():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, size=N).astype("int32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    model = kt.upgrade(make_mlp())
    model.compile(optimizer=keras.optimizers.SGD(LR), loss=loss,
                  differential_privacy=kt.DPSGD(CLIP, 0.0))

    def ours():
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)

    peer_model = make_mlp()
    non_trainable = [v.value for v in peer_model.non_trainable_variables]
    state = {"weights": [v.value for v in peer_model.trainable_variables]}

    def example_loss(values, x_one, y_one):
        logits, _ = peer_model.stateless_call(values, non_trainable, x_one)
        return loss(y_one, logits)

    mean_clipped = clipped_grad(example_loss, l2_clip_norm=CLIP, batch_argnums=(1, 2),
                                normalize_by=BATCH)

    @jax.jit
    def step(values, x_batch, y_batch):
        grads = mean_clipped(values, x_batch, y_batch)
        return [w - LR * g for w, g in zip(values, grads)]

    def peer():
        values = state["weights"]
        for start in range(0, N, BATCH):
            values = step(values, x[start : start + BATCH], y[start : start + BATCH])
        jax.block_until_ready(values)
        state["weights"] = values

    ours()
    peer()  # trace and compile both first
    times = common.interleaved({"jax_privacy clipped_grad": peer, "kt.DPSGD fit": ours}, ROUNDS)
    common.report(times, "jax_privacy clipped_grad", "of jax_privacy's step")


if __name__ == "__main__":
    main()
