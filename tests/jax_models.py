"""The model, data and options both sides of the JAX tests use (backend-neutral).

Imported by tests/jax_cases.py (KERAS_BACKEND=jax, its own process) and by
tests/test_jax_backend.py (TensorFlow): same layers, same initial weights
(passed as arrays), same batches.
"""

from __future__ import annotations

import keras
import numpy as np

EPOCHS, BATCH, LR = 2, 16, 0.1


def data():
    """64 examples of 8 features, a 1-d regression target (float32)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1)) + 0.5).astype("float32")
    return x, y


def make_mlp(init=None, upgrade=True):
    """body1 -> body2 -> head; upgraded with kt.upgrade unless `upgrade=False`."""
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="tanh", name="body1"),
            keras.layers.Dense(16, activation="tanh", name="body2"),
            keras.layers.Dense(1, name="head"),
        ]
    )
    if init is not None:
        model.set_weights(init)
    if upgrade:
        import keras_tapeops as kt

        model = kt.upgrade(model)
    return model


def initial_weights():
    """Seeded initial weights (NumPy), the same on both backends."""
    rng = np.random.default_rng(1)
    shapes = [(8, 16), (16,), (16, 16), (16,), (16, 1), (1,)]
    return [(rng.normal(size=s) * 0.5).astype("float32") for s in shapes]


def transforms(kt):
    """Three clip groups: one per tensor, one global group, one by value."""
    return [
        kt.ClipByNorm(0.05, where="head"),
        kt.ClipByGlobalNorm(0.5, where="body*"),
        kt.ClipByValue(0.01, where="body2"),
    ]


def sample_weights():
    """Per-example weights in [0.2, 1.8) (the reduction cases)."""
    return np.random.default_rng(2).uniform(0.2, 1.8, size=(64,)).astype("float32")


def make_regularized(init, upgrade=True):
    """The MLP with an L2 kernel regularizer (body1) and an activity regularizer (body2)."""
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(
                16, activation="tanh", name="body1", kernel_regularizer=keras.regularizers.L2(0.01)
            ),
            keras.layers.Dense(
                16,
                activation="tanh",
                name="body2",
                activity_regularizer=keras.regularizers.L1(0.01),
            ),
            keras.layers.Dense(1, name="head"),
        ]
    )
    model.set_weights(init)
    if upgrade:
        import keras_tapeops as kt

        model = kt.upgrade(model)
    return model


def make_batch_norm(init):
    """body1 -> BatchNormalization -> body2 -> head, upgraded (BN starts at its defaults)."""
    import keras_tapeops as kt

    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="tanh", name="body1"),
            keras.layers.BatchNormalization(name="norm"),
            keras.layers.Dense(16, activation="tanh", name="body2"),
            keras.layers.Dense(1, name="head"),
        ]
    )
    for name, start in [("body1", 0), ("body2", 2), ("head", 4)]:
        model.get_layer(name).set_weights(init[start : start + 2])
    return kt.upgrade(model)


def grouped_optimizers(kt, model):
    """SGD on the head, Adam on the body (kt.optimizer_groups)."""
    return kt.optimizer_groups(
        model,
        [("head", keras.optimizers.SGD(0.05)), ("body*", keras.optimizers.Adam(0.01))],
    )


def decayed_optimizer(kt, model):
    """Adam at 0.01 on the head, halved per block below it (kt.layerwise_lr_decay)."""
    return kt.layerwise_lr_decay(
        model, keras.optimizers.Adam(0.01), decay=0.5, layers=["body1", "body2", "head"]
    )
