"""A hand-written nested-tape MAML loop (seed style): the oracle of the MetaLearner tests.

The other `test_meta_learning*` modules import it; the tests here check the
oracle itself against central finite differences in float64.

The network is written out in TensorFlow (`tanh(x @ W1 + b1) @ W2 + b2`, the
weights copied from a Keras `1 -> 8 -> 1` MLP), the loss is the mean squared
error written out, and the tasks are a Python loop: nothing of Keras or of
keras_tapeops is used to compute the meta-gradient. Steps run as
`tf.function`s, as `fit` runs its step.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

HIDDEN = 8


def make_mlp(seed=0):
    """The model under test: `1 -> 8 (tanh) -> 1`, layers "hidden" and "head"."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((1,)),
            keras.layers.Dense(HIDDEN, activation="tanh", name="hidden"),
            keras.layers.Dense(1, name="head"),
        ],
        name="mlp",
    )


def sinusoid_tasks(tasks, support, query, seed=0):
    """Finn et al.'s sinusoid tasks: `(support_x, support_y, query_x, query_y)`."""
    rng = np.random.default_rng(seed)
    amplitude = rng.uniform(0.1, 5.0, (tasks, 1, 1))
    phase = rng.uniform(0.0, np.pi, (tasks, 1, 1))
    sx = rng.uniform(-5.0, 5.0, (tasks, support, 1))
    qx = rng.uniform(-5.0, 5.0, (tasks, query, 1))
    f = lambda x: amplitude * np.sin(x - phase)  # noqa: E731
    return tuple(a.astype("float32") for a in (sx, f(sx), qx, f(qx)))


def forward(params, x):
    w1, b1, w2, b2 = params
    return tf.matmul(tf.tanh(tf.matmul(x, w1) + b1), w2) + b2


def mse(params, x, y):
    return tf.reduce_mean(tf.square(forward(params, x) - y))


class HandMAML:
    """MAML / first-order MAML / Reptile / ANIL / Meta-SGD by hand, outer SGD.

    Args:
        weights: `[W1, b1, W2, b2]` (NumPy), the start.
        inner_lr: the inner SGD rate (the initial learned rates for Meta-SGD).
        steps: inner steps.
        outer_lr: the outer SGD rate.
        first_order, reptile, meta_sgd: the variant.
        adapted: indices of the adapted weights (ANIL: `[2, 3]`, the head).
    """

    def __init__(self, weights, inner_lr, steps, outer_lr, first_order=False,
                 reptile=False, meta_sgd=False, adapted=(0, 1, 2, 3)):
        self.params = [tf.Variable(w) for w in weights]
        self.rates = (
            [tf.Variable(tf.fill(self.params[i].shape, inner_lr)) for i in adapted]
            if meta_sgd else None
        )
        self.inner_lr, self.steps, self.outer_lr = inner_lr, steps, outer_lr
        self.first_order, self.reptile = first_order, reptile
        self.adapted = list(adapted)
        self.step = tf.function(self._step)  # one trace per meta-batch size

    def inner(self, params, x, y, steps):
        params = list(params)
        for _ in range(steps):
            with tf.GradientTape() as tape:
                watched = [params[i] for i in self.adapted]
                tape.watch(watched)
                loss = mse(params, x, y)
            grads = tape.gradient(loss, watched)
            for k, (i, g) in enumerate(zip(self.adapted, grads)):
                if self.first_order:
                    g = tf.stop_gradient(g)
                rate = self.rates[k] if self.rates is not None else self.inner_lr
                params[i] = params[i] - rate * g
        return params

    def _step(self, sx, sy, qx, qy):
        n = sx.shape[0]
        if self.reptile:
            losses, deltas = [], [tf.zeros_like(p) for p in self.params]
            for t in range(n):
                adapted = self.inner(self.params, sx[t], sy[t], self.steps)
                losses.append(mse(adapted, qx[t], qy[t]))
                deltas = [d + (p - a) / n for d, p, a in zip(deltas, self.params, adapted)]
            for p, d in zip(self.params, deltas):
                p.assign_sub(self.outer_lr * d)
            return tf.stack(losses)
        variables = self.params + (self.rates or [])
        with tf.GradientTape() as outer:
            losses = []
            for t in range(n):
                adapted = self.inner(self.params, sx[t], sy[t], self.steps)
                losses.append(mse(adapted, qx[t], qy[t]))
            meta_loss = tf.add_n(losses) / n
        for v, g in zip(variables, outer.gradient(meta_loss, variables)):
            v.assign_sub(self.outer_lr * g)
        return tf.stack(losses)

    def fit(self, data, batch_size, epochs=1):
        """Returns the per-epoch mean query loss (what History logs as `loss`)."""
        history = []
        for _ in range(epochs):
            losses = []
            for start in range(0, len(data[0]), batch_size):
                batch = [tf.constant(a[start:start + batch_size]) for a in data]
                losses.extend(self.step(*batch).numpy())
            history.append(float(np.mean(losses)))
        return history

    def adapt(self, x, y, steps):
        return self.inner(self.params, tf.constant(x), tf.constant(y), steps)

    def evaluate(self, data, steps):
        """Mean query loss and MAE after adaptation, over all tasks."""
        sx, sy, qx, qy = data
        losses, errors = [], []
        for t in range(len(sx)):
            adapted = self.adapt(sx[t], sy[t], steps)
            losses.append(float(mse(adapted, qx[t], qy[t])))
            errors.append(np.abs(forward(adapted, qx[t]).numpy() - qy[t]))
        return float(np.mean(losses)), float(np.mean(errors))

    def weights(self):
        return [p.numpy() for p in self.params]


def max_difference(a, b):
    return max(float(np.max(np.abs(np.asarray(u) - np.asarray(v)))) for u, v in zip(a, b))


# ------------------------------------------------- the oracle's own checks
def _meta_loss(weights, data, steps, first_order):
    oracle = HandMAML(weights, inner_lr=0.05, steps=steps, outer_lr=0.0,
                      first_order=first_order)
    sx, sy, qx, qy = (tf.constant(a) for a in data)
    with tf.GradientTape() as tape:
        losses = [mse(oracle.inner(oracle.params, sx[t], sy[t], steps), qx[t], qy[t])
                  for t in range(len(data[0]))]
        loss = tf.add_n(losses) / len(losses)
    return float(loss), [g.numpy() for g in tape.gradient(loss, oracle.params)]


@pytest.mark.parametrize("steps", [1, 2])
def test_second_order_oracle_equals_finite_differences(steps):
    """The oracle's meta-gradient is the derivative of the meta-loss (float64)."""
    weights = [w.astype("float64") for w in make_mlp().get_weights()]
    data = tuple(a.astype("float64") for a in sinusoid_tasks(2, 4, 5))
    _, grads = _meta_loss(weights, data, steps, first_order=False)
    _, first = _meta_loss(weights, data, steps, first_order=True)
    eps = 1e-6
    checked = 0
    for i in range(len(weights)):
        for index in list(np.ndindex(weights[i].shape))[:3]:
            plus = [w.copy() for w in weights]
            minus = [w.copy() for w in weights]
            plus[i][index] += eps
            minus[i][index] -= eps
            numeric = (_meta_loss(plus, data, steps, False)[0]
                       - _meta_loss(minus, data, steps, False)[0]) / (2 * eps)
            np.testing.assert_allclose(grads[i][index], numeric, rtol=1e-6, atol=1e-8)
            checked += 1
    assert checked == 10  # 3 entries of W1, b1, W2; b2 has one
    # First order drops a real part of that derivative.
    assert max_difference(grads, first) > 1e-3
