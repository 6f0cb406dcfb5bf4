"""Shared model, data and comparison helpers of the accumulation tests."""

import keras
import numpy as np

import keras_tapeops as kt

TOL = 2e-5


def make_net(bn=False):
    """A small upgraded regression net (optionally with BatchNormalization first)."""
    layers = [keras.Input((5,))]
    if bn:
        layers.append(keras.layers.BatchNormalization(momentum=0.9, name="bn"))
    layers += [keras.layers.Dense(6, activation="tanh", name="hidden"),
               keras.layers.Dense(2, name="head")]
    return kt.upgrade(keras.Sequential(layers))


def make_data(n=100, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 5)).astype("float32")
    y = rng.normal(size=(n, 2)).astype("float32")
    sw = rng.uniform(0.2, 2.0, size=(n,)).astype("float32")
    return x, y, sw


def assert_close(actual, expected, tol=TOL):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(a, e, atol=tol, rtol=tol)


def max_diff(a, b):
    return max(float(np.abs(u - v).max()) for u, v in zip(a, b))


def to_int(variable):
    return int(keras.ops.convert_to_numpy(variable))
