"""`micro_batches` / `accumulation_steps` combined with loss terms, clipping,
gradient penalties and MirroredStrategy, against hand-written oracles.

Oracles: a hand-written `tf.GradientTape` loop with plain SGD (same initial
weights, same batches in the same order, shuffle=False) or stock Keras on the
large batches. Each comparison has a companion showing that the wrong
semantics (or no feature) move the weights or the logs by far more than the
tolerance.

Data: 100 samples in batches of 16 make 7 batches per epoch; with
`accumulation_steps=2` the windows are batches (0, 1), (2, 3), (4, 5) and the
last batch of 4 samples alone, applied by the end-of-epoch flush.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt
from keras_tapeops import accumulation

from accumulation_utils import TOL
from accumulation_utils import assert_close
from accumulation_utils import make_data
from accumulation_utils import make_net
from accumulation_utils import max_diff
from accumulation_utils import to_int

RTOL_LOGS = 1e-5


@pytest.fixture(scope="module")
def initial_weights():
    keras.utils.set_random_seed(11)
    return make_net().get_weights()


def windows_of(n, batch_size, steps):
    """[[slice, ...], ...]: the batches of one epoch grouped in windows of `steps`."""
    batches = [slice(s, min(s + batch_size, n)) for s in range(0, n, batch_size)]
    return [batches[i:i + steps] for i in range(0, len(batches), steps)]


def epoch_mean(logged, column):
    """Keras's epoch value of a logged quantity: mean over batches weighted by size."""
    total = sum(row[0] for row in logged)
    return sum(row[0] * row[column] for row in logged) / total


def fit_ours(weights, x, y, sw, batch_size, lr, strategy=None, **compile_kwargs):
    scope = strategy.scope() if strategy is not None else _Null()
    with scope:
        model = make_net()
        model.set_weights(weights)
        model.compile(keras.optimizers.SGD(lr), "mse", **compile_kwargs)
    history = model.fit(x, y, sample_weight=sw, batch_size=batch_size, shuffle=False,
                        verbose=0)
    return model, history.history


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def task_loss(pred, y, sw):
    """mse with sample weights, Keras's "sum_over_batch_size" reduction."""
    return tf.reduce_sum(tf.reduce_mean(tf.square(pred - y), axis=-1) * sw) / len(y)


# ------------------------------------------------- accumulation x loss terms
def window_loop(weights, x, y, sw, windows, lr, l2=0.0, clip=None, clip_each_batch=False):
    """Hand-written accumulation: per window, sum_j n_j * grad(L_j) / N, one SGD step.

    `L_j = task_j + l2 * mean(hidden_j^2)` on batch j (the weights only change
    when a window is applied). With `clip`, the window's gradient is clipped
    to global norm `clip` (or, the wrong way, each batch's gradient before
    the sum). Returns the final weights and the per-batch `(n, loss, term)`.
    """
    model = make_net()
    model.set_weights(weights)
    hidden, head = model.get_layer("hidden"), model.get_layer("head")
    variables = model.trainable_variables
    logged = []
    for window in windows:
        total = sum(s.stop - s.start for s in window)
        sums = [tf.zeros_like(v) for v in variables]
        for sl in window:
            n = sl.stop - sl.start
            with tf.GradientTape() as tape:
                h = hidden(x[sl])
                term = l2 * tf.reduce_mean(tf.square(h))
                loss = task_loss(head(h), y[sl], sw[sl]) + term
            grads = tape.gradient(loss, variables)
            if clip is not None and clip_each_batch:
                grads, _ = tf.clip_by_global_norm(grads, clip)
            sums = [s + g * n / total for s, g in zip(sums, grads)]
            logged.append((n, float(loss), float(term)))
        if clip is not None and not clip_each_batch:
            sums, norm = tf.clip_by_global_norm(sums, clip)
            assert float(norm) > clip  # the clip is active on every applied step
        for v, g in zip(variables, sums):
            v.assign_sub(lr * g)
    return model.get_weights(), logged


def test_accumulation_steps_with_activation_penalty_equal_hand_written_loop(initial_weights):
    x, y, sw = make_data()
    expected, logged = window_loop(initial_weights, x, y, sw, windows_of(100, 16, 2), 0.2,
                                   l2=0.3)
    ours, history = fit_ours(initial_weights, x, y, sw, 16, 0.2, accumulation_steps=2,
                             loss_terms=[kt.ActivationPenalty("hidden", l2=0.3, name="act_l2")])
    assert_close(ours.get_weights(), expected)
    assert to_int(ours.optimizer.iterations) == 4
    # Logged like `loss`: the epoch's sample-weighted mean of the batches' values.
    np.testing.assert_allclose(history["act_l2"][0], epoch_mean(logged, 2), rtol=RTOL_LOGS)
    np.testing.assert_allclose(history["loss"][0], epoch_mean(logged, 1), rtol=RTOL_LOGS)


def test_accumulation_with_activation_penalty_companions(initial_weights):
    """Stepping every batch, or logging a plain mean over batches, would differ."""
    x, y, sw = make_data()
    expected, logged = window_loop(initial_weights, x, y, sw, windows_of(100, 16, 2), 0.2,
                                   l2=0.3)
    per_batch, _ = window_loop(initial_weights, x, y, sw, windows_of(100, 16, 1), 0.2, l2=0.3)
    assert max_diff(per_batch, expected) > 1e-3
    plain_mean = np.mean([row[2] for row in logged])
    weighted = epoch_mean(logged, 2)
    assert abs(plain_mean - weighted) > 100 * RTOL_LOGS * abs(weighted)


# --------------------------------------------- accumulation x ClipByGlobalNorm
CLIP = 0.05


def test_accumulation_steps_clip_the_window_mean_gradient_once(initial_weights):
    x, y, sw = make_data()
    expected, _ = window_loop(initial_weights, x, y, sw, windows_of(100, 16, 2), 0.5,
                              clip=CLIP)
    ours, _ = fit_ours(initial_weights, x, y, sw, 16, 0.5, accumulation_steps=2,
                       gradient_transforms=[kt.ClipByGlobalNorm(CLIP)])
    assert_close(ours.get_weights(), expected)
    assert to_int(ours.optimizer.iterations) == 4


def test_clipping_each_batch_of_the_window_would_differ(initial_weights):
    x, y, sw = make_data()
    expected, _ = window_loop(initial_weights, x, y, sw, windows_of(100, 16, 2), 0.5,
                              clip=CLIP)
    per_batch, _ = window_loop(initial_weights, x, y, sw, windows_of(100, 16, 2), 0.5,
                               clip=CLIP, clip_each_batch=True)
    assert max_diff(per_batch, expected) > 1e-3


# ------------------------------------------- micro_batches x GradientPenalty
GP_WEIGHT, GP_TARGET = 0.5, 1.0


def penalty_loop(weights, x, y, sw, batch_size, k, lr, mode="full_batch"):
    """Hand-written: task loss + GP_WEIGHT * mean_i (||d sum(f(x_i)) / d x_i|| - GP_TARGET)^2.

    `mode="full_batch"`: the penalty is a plain mean over the whole batch
    (what the micro-batch weighting n_j / n must reproduce).
    Wrong on purpose: `"sample_weighted"` (the penalty mean weighted by the
    sample weights) and `"equal_micro"` (per micro-batch penalties averaged
    with 1/k, which differs from n_j / n on an uneven split).
    Returns the final weights and the per-batch `(n, loss, weighted penalty)`.
    """
    model = make_net()
    model.set_weights(weights)
    variables = model.trainable_variables
    logged = []
    for start in range(0, len(x), batch_size):
        xb, yb, wb = (tf.constant(a[start:start + batch_size]) for a in (x, y, sw))
        n = int(xb.shape[0])
        pieces = [slice(0, n)]
        if mode == "equal_micro":
            ends = np.cumsum(accumulation.micro_batch_sizes(n, k))
            pieces = [slice(e - s, e) for s, e in
                      zip(accumulation.micro_batch_sizes(n, k), ends)]
        with tf.GradientTape() as tape:
            loss = tf.constant(0.0)
            penalty_log = 0.0
            for sl in pieces:
                xs = xb[sl]
                with tf.GradientTape() as inner:
                    inner.watch(xs)
                    pred = model(xs, training=True)
                dx = inner.gradient(pred, xs)
                sq = tf.square(tf.sqrt(tf.reduce_sum(tf.square(dx), axis=1)) - GP_TARGET)
                if mode == "sample_weighted":
                    penalty = tf.reduce_sum(sq * wb[sl]) / tf.reduce_sum(wb[sl])
                else:
                    penalty = tf.reduce_mean(sq)
                size = sl.stop - sl.start
                share = 1.0 / len(pieces) if mode == "equal_micro" else size / n
                task = task_loss(pred, yb[sl], wb[sl]) * size / n
                loss = loss + task + GP_WEIGHT * penalty * share
                penalty_log += GP_WEIGHT * float(penalty) * size / n
        grads = tape.gradient(loss, variables)
        for v, g in zip(variables, grads):
            v.assign_sub(lr * g)
        logged.append((n, float(loss), penalty_log))
    return model.get_weights(), logged


def test_micro_batches_with_gradient_penalty_equal_the_full_batch_penalty(initial_weights):
    """Batches of 25 split 12 + 13, and a last batch of 3 split 1 + 2: the n_j / n
    weighting gives the batch's plain mean."""
    x, y, sw = make_data(53)
    expected, logged = penalty_loop(initial_weights, x, y, sw, 25, 2, 0.1)
    ours, history = fit_ours(initial_weights, x, y, sw, 25, 0.1, micro_batches=2,
                             loss_terms=[kt.GradientPenalty(GP_WEIGHT, target=GP_TARGET)])
    assert accumulation.micro_batch_sizes(25, 2) == [12, 13]
    assert accumulation.micro_batch_sizes(3, 2) == [1, 2]
    assert_close(ours.get_weights(), expected)
    np.testing.assert_allclose(history["gradient_penalty"][0], epoch_mean(logged, 2),
                               rtol=RTOL_LOGS)
    np.testing.assert_allclose(history["loss"][0], epoch_mean(logged, 1), rtol=RTOL_LOGS)


@pytest.mark.parametrize("mode", ["sample_weighted", "equal_micro"])
def test_gradient_penalty_with_the_wrong_weighting_would_differ(initial_weights, mode):
    x, y, sw = make_data(53)
    expected, _ = penalty_loop(initial_weights, x, y, sw, 25, 2, 0.1)
    wrong, _ = penalty_loop(initial_weights, x, y, sw, 25, 2, 0.1, mode=mode)
    assert max_diff(wrong, expected) > 50 * TOL, max_diff(wrong, expected)


# ----------------------------- accumulation_steps x micro_batches x Mirrored
def stock_on_batches(weights, x, y, sw, bounds, lr):
    model = keras.Sequential([keras.Input((5,)),
                              keras.layers.Dense(6, activation="tanh", name="hidden"),
                              keras.layers.Dense(2, name="head")])
    model.set_weights(weights)
    model.compile(keras.optimizers.SGD(lr), "mse")
    for start, end in bounds:
        model.train_on_batch(x[start:end], y[start:end], sample_weight=sw[start:end])
    return model.get_weights()


def test_accumulation_and_micro_batches_under_mirrored_equal_single_device_stock(
        initial_weights, mirrored):
    """96 samples, global batches of 16 (8 per replica, micro-batches 2 + 3 + 3),
    windows of 4: steps on 64 then 32 samples (the flush), as stock on one device."""
    x, y, sw = make_data(96)
    expected = stock_on_batches(initial_weights, x, y, sw, [(0, 64), (64, 96)], 0.3)
    ours, _ = fit_ours(initial_weights, x, y, sw, 16, 0.3, strategy=mirrored,
                       accumulation_steps=4, micro_batches=3)
    assert_close(ours.get_weights(), expected)
    assert to_int(ours.optimizer.iterations) == 2


def test_mirrored_combination_companion_stepping_every_batch_differs(initial_weights):
    x, y, sw = make_data(96)
    expected = stock_on_batches(initial_weights, x, y, sw, [(0, 64), (64, 96)], 0.3)
    every_batch = stock_on_batches(initial_weights, x, y, sw,
                                   [(s, s + 16) for s in range(0, 96, 16)], 0.3)
    assert max_diff(every_batch, expected) > 1e-3
