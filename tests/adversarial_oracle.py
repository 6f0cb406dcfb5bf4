"""Hand-written attacks (the `tape.watch` loop) and the tiny models of the issue 21 tests.

The oracle is written out independently of `keras_tapeops.attacks`: a plain
loop of `tape.watch(x_adv)`, `tape.gradient`, a signed or normalized step, a
projection and a clip. The only thing it shares with the library is the
documented key of a seeded random start (`keras_tapeops.attacks.noise`):
`stateless_fold_in([seed, step], input_index)` for the uniform draw of the
global batch (and, for L2, index 1 for the per-example radius).
"""

import keras
import numpy as np
import tensorflow as tf

import keras_tapeops as kt

FEATURES, CLASSES = 64, 3  # an 8x8 "digit", three classes


def data(n=32, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.uniform(0.0, 1.0, size=(n, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, size=n).astype("int32")
    sw = rng.uniform(0.2, 2.0, size=n).astype("float32")
    return x, y, sw


def mlp(upgrade=False):
    model = keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(6, activation="tanh", name="hidden"),
        keras.layers.Dense(CLASSES, name="logits"),
    ])
    return kt.upgrade(model) if upgrade else model


def crossentropy(reduction="sum_over_batch_size"):
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)


def per_example_norm(t):
    axes = list(range(1, t.shape.rank))
    return tf.sqrt(tf.reduce_sum(tf.square(t), axis=axes, keepdims=True))


def oracle_start(shape, epsilon, norm, seed, step):
    """The documented seeded random start for a single-input batch of `shape`."""
    key = tf.stack([tf.constant(seed, tf.int64), tf.cast(step, tf.int64)])
    first = tf.random.experimental.stateless_fold_in(key, 0)
    if norm == "inf":
        return epsilon * tf.random.stateless_uniform(shape, first, -1.0, 1.0)
    direction = tf.random.stateless_normal(shape, first)
    u = tf.random.stateless_uniform(
        shape[:1], tf.random.experimental.stateless_fold_in(key, 1)
    )
    size = float(np.prod(shape[1:]))
    radius = epsilon * u ** (1.0 / size)
    radius = tf.reshape(radius, [-1] + [1] * (len(shape) - 1))
    return radius * direction / per_example_norm(direction)


def oracle_attack(model, objective, x, epsilon, step_size, steps, norm,
                  clip=None, delta=None):
    """The seed-style loop: ascend `objective(model(x_adv))` by hand.

    Args:
        objective: `objective(outputs) -> scalar` to maximize.
        delta: the random start (None: start at `x`).
    """
    x = tf.convert_to_tensor(x, tf.float32)
    adv = x if delta is None else x + delta
    if clip is not None:
        adv = tf.clip_by_value(adv, clip[0], clip[1])
    for _ in range(steps):
        with tf.GradientTape() as tape:
            tape.watch(adv)
            value = objective(model(adv, training=False))
        grad = tape.gradient(value, adv)
        if norm == "inf":
            adv = adv + step_size * tf.sign(grad)
        else:
            adv = adv + step_size * grad / tf.maximum(per_example_norm(grad), 1e-12)
        delta = adv - x
        if norm == "inf":
            delta = tf.clip_by_value(delta, -epsilon, epsilon)
        else:
            delta = delta * tf.minimum(
                1.0, epsilon / tf.maximum(per_example_norm(delta), 1e-12)
            )
        adv = x + delta
        if clip is not None:
            adv = tf.clip_by_value(adv, clip[0], clip[1])
    return adv


def loss_objective(y, loss=None):
    """The summed crossentropy of the outputs against `y` (what attacks ascend)."""
    loss = loss or crossentropy("sum")
    return lambda outputs: loss(y, outputs)


def kl_objective(clean_logits):
    """TRADES's attack objective: `sum KL(softmax(clean) || softmax(outputs))`."""
    p = tf.nn.softmax(clean_logits)
    log_p = tf.nn.log_softmax(clean_logits)

    def objective(outputs):
        log_q = tf.nn.log_softmax(tf.cast(outputs, tf.float32))
        return tf.reduce_sum(p * (log_p - log_q))

    return objective


def kl_per_example(logits_p, logits_q):
    logits_p = tf.cast(logits_p, tf.float32)
    logits_q = tf.cast(logits_q, tf.float32)
    log_p = tf.nn.log_softmax(logits_p)
    return tf.reduce_sum(tf.exp(log_p) * (log_p - tf.nn.log_softmax(logits_q)), axis=-1)


def max_weight_difference(a, b):
    return max(float(np.abs(u - v).max()) for u, v in zip(a.get_weights(), b.get_weights()))
