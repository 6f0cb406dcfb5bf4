"""Hand-written select-then-step loops: the oracles of tests/test_selection*.py."""

import math

import keras
import numpy as np
import tensorflow as tf


def tiny_model(seed=0, units=3, inputs=4, outputs=2):
    """A two-layer MLP with fixed weights (returned as a keras_tapeops model)."""
    import keras_tapeops as kt

    model = kt.upgrade(keras.Sequential([
        keras.Input((inputs,)),
        keras.layers.Dense(units, activation="tanh"),
        keras.layers.Dense(outputs),
    ]))
    rng = np.random.default_rng(seed)
    model.set_weights([rng.normal(size=w.shape).astype("float32") * 0.5 for w in model.get_weights()])
    return model


def data(n=16, inputs=4, outputs=2, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, inputs)).astype("float32")
    y = rng.normal(size=(n, outputs)).astype("float32")
    return x, y


def k_of(fraction, n):
    return max(1, min(n, math.ceil(fraction * n - 1e-9)))


def select_then_step(model, x, y, batch, fraction, lr, groups=1, offsets=None):
    """SGD on the top-k losses of each batch (mse), `groups` slices per batch.

    `offsets[i]` (optional, aligned with x) is subtracted from the loss before
    ranking (RHO-LOSS: the irreducible loss). With `groups=2` each half of a
    batch selects apart and the step's gradient is the mean of the halves'
    gradients (two replicas, or two micro-batches).
    """
    variables = model.trainable_weights

    @tf.function
    def step(xb, yb, ob):
        grads = None
        for xs, ys, os in zip(tf.split(xb, groups), tf.split(yb, groups), tf.split(ob, groups)):
            losses = tf.reduce_mean(tf.square(model(xs, training=False) - ys), axis=1)
            k = k_of(fraction, int(xs.shape[0]))
            keep = tf.sort(tf.math.top_k(losses - os, k=k).indices)
            with tf.GradientTape() as tape:
                pred = model(tf.gather(xs, keep), training=True)
                loss = tf.reduce_mean(tf.square(pred - tf.gather(ys, keep)))
            g = tape.gradient(loss, variables)
            grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        for v, g in zip(variables, grads):
            v.assign_sub(lr * g / groups)

    if offsets is None:
        offsets = np.zeros(len(x), "float32")
    for start in range(0, len(x), batch):
        sl = slice(start, start + batch)
        step(tf.constant(x[sl]), tf.constant(y[sl]), tf.constant(offsets[sl]))
    return model
