"""Shared helpers for tests that compare keras_tapeops against stock Keras."""

import keras
import numpy as np


def assert_weights_close(a, b, atol):
    wa, wb = a.get_weights(), b.get_weights()
    assert len(wa) == len(wb)
    for i, (x, y) in enumerate(zip(wa, wb)):
        np.testing.assert_allclose(x, y, atol=atol, rtol=0, err_msg=f"weight {i}")


def assert_history_close(ha, hb, atol):
    assert sorted(ha) == sorted(hb), (sorted(ha), sorted(hb))
    for key in ha:
        np.testing.assert_allclose(ha[key], hb[key], atol=atol, rtol=0, err_msg=key)


def max_weight_difference(a, b):
    return max(
        float(np.max(np.abs(x - y))) for x, y in zip(a.get_weights(), b.get_weights())
    )


def classification_data(n=96, features=8, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    y = (x[:, :classes].argmax(axis=1)).astype("int32")
    return x, y


def sequential_model(features=8, classes=3, regularizer=None, name=None):
    return keras.Sequential(
        [
            keras.Input((features,)),
            keras.layers.Dense(
                16, activation="relu", name="backbone_dense",
                kernel_regularizer=regularizer,
            ),
            keras.layers.Dense(classes, name="head"),
        ],
        name=name,
    )
