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
