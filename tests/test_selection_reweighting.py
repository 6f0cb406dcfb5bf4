"""kt.SelfPaced and kt.SuperLoss (per-example weights in the loss) and
kt.callbacks.SelectionSchedule (the engine's fraction/threshold per epoch)."""

import math

import keras
import numpy as np
import pytest
import scipy.special
import tensorflow as tf

import keras_tapeops as kt
from keras_tapeops.selection.super_loss import confidence
from tests.selection_oracle import data, select_then_step, tiny_model


def _fit(model, x, y, epochs=1, callbacks=None, **options):
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **options)
    return model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0,
                     callbacks=callbacks)


def _close(a, b, tol=1e-6):
    for u, v in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_allclose(u, v, rtol=tol, atol=tol)


def _weighted_oracle(x, y, weight_fn):
    """SGD where batch t's mean loss weights example i by weight_fn(losses, t)[i]."""
    model = tiny_model()
    variables = model.trainable_weights

    @tf.function
    def step(xb, yb, t):
        losses = tf.reduce_mean(tf.square(model(xb, training=False) - yb), axis=1)
        weights = weight_fn(losses, t)
        with tf.GradientTape() as tape:
            per = tf.reduce_mean(tf.square(model(xb, training=True) - yb), axis=1)
            loss = tf.reduce_mean(weights * per)
        for v, g in zip(variables, tape.gradient(loss, variables)):
            v.assign_sub(0.1 * g)

    for t, start in enumerate((0, 8)):
        step(tf.constant(x[start:start + 8]), tf.constant(y[start:start + 8]), tf.constant(t, "float32"))
    return model


def test_self_paced_trains_on_losses_below_the_threshold():
    x, y = data()
    ours = tiny_model()
    history = _fit(ours, x, y, sample_selection=kt.SelfPaced(threshold_schedule=1.0))
    oracle = _weighted_oracle(x, y, lambda l, t: tf.cast(l < 1.0, "float32"))
    _close(ours, oracle)
    assert 0.0 < history.history["selection_fraction"][0] < 1.0
    # Companion: the stock step (every weight 1) ends elsewhere.
    stock = tiny_model()
    _fit(stock, x, y)
    assert not np.allclose(stock.get_weights()[0], oracle.get_weights()[0], atol=1e-4)


def test_self_paced_threshold_schedule_of_the_optimizer_step():
    x, y = data()
    ours = tiny_model()
    schedule = keras.optimizers.schedules.ExponentialDecay(0.5, decay_steps=1, decay_rate=2.0)
    history = _fit(ours, x, y, sample_selection=kt.SelfPaced(threshold_schedule=schedule))
    oracle = _weighted_oracle(x, y, lambda l, t: tf.cast(l < 0.5 * 2.0 ** t, "float32"))
    _close(ours, oracle)
    # Companion: the constant first threshold keeps fewer examples at step 2.
    fixed = _weighted_oracle(x, y, lambda l, t: tf.cast(l < 0.5, "float32"))
    assert not np.allclose(fixed.get_weights()[0], oracle.get_weights()[0], atol=1e-4)
    assert 0.0 < history.history["selection_fraction"][0] < 1.0


def test_super_loss_confidence_is_the_closed_form_minimizer():
    losses = np.array([0.0, 0.3, 0.7, 1.0, 2.5, 10.0], "float32")
    tau, lam = 1.0, 0.5
    got = confidence(tf.constant(losses), tau, lam).numpy()
    beta = (losses - tau) / lam
    expected = np.exp(-scipy.special.lambertw(0.5 * np.maximum(-2 / math.e, beta)).real)
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    # sigma* is a stationary point of (l - tau) s + lam log(s)^2 (a minimum
    # for l >= tau, the local minimum otherwise), where one exists
    # (beta >= -2/e; below, the paper clamps beta at -2/e).
    ok = beta >= -2 / math.e
    derivative = (losses[ok] - tau) + 2 * lam * np.log(got[ok]) / got[ok]
    np.testing.assert_allclose(derivative, 0.0, atol=1e-5)


def test_super_loss_fit_weights_examples_by_confidence():
    x, y = data()
    ours = tiny_model()
    _fit(ours, x, y, sample_selection=kt.SuperLoss(lam=0.5, tau=1.0))
    oracle = _weighted_oracle(x, y, lambda l, t: tf.stop_gradient(confidence(l, 1.0, 0.5)))
    _close(ours, oracle, tol=1e-5)


def test_super_loss_running_tau_follows_the_batch_losses():
    x, y = data()
    model = tiny_model()
    _fit(model, x, y, sample_selection=kt.SuperLoss(lam=1.0, momentum=0.5))
    tau = model.tapeops_state.engine.tau.numpy()
    assert tau > 0 and np.isfinite(tau)


def test_selection_schedule_changes_the_fraction_per_epoch():
    x, y = data()
    ours = tiny_model()
    schedule = kt.callbacks.SelectionSchedule(lambda epoch: [1.0, 0.25][epoch])
    history = _fit(ours, x, y, epochs=2, callbacks=[schedule],
                   sample_selection=kt.TopLoss(fraction=0.5))
    assert history.history["selection_fraction"] == [pytest.approx(1.0), pytest.approx(0.25)]
    assert history.history["selection_schedule"] == [1.0, 0.25]
    oracle = select_then_step(tiny_model(), x, y, batch=8, fraction=1.0, lr=0.1)
    oracle = select_then_step(oracle, x, y, batch=8, fraction=0.25, lr=0.1)
    _close(ours, oracle)
    # The option itself is unchanged configuration.
    assert ours.tapeops_options.sample_selection.fraction == 0.5


def test_selection_schedule_refusals():
    x, y = data()
    with pytest.raises(ValueError, match="Received: schedule\\(epoch\\)=1.5"):
        _fit(tiny_model(), x, y, callbacks=[kt.callbacks.SelectionSchedule(lambda e: 1.5)],
             sample_selection=kt.TopLoss(0.5))
    with pytest.raises(ValueError, match="Received: sample_selection=None"):
        _fit(tiny_model(), x, y, callbacks=[kt.callbacks.SelectionSchedule(lambda e: 0.5)])
    with pytest.raises(TypeError, match="Received: schedule=0.5"):
        kt.callbacks.SelectionSchedule(0.5)


@pytest.mark.parametrize("option", [
    kt.SelfPaced(threshold_schedule=2.0),
    kt.SelfPaced(threshold_schedule=keras.optimizers.schedules.ExponentialDecay(1.0, 10, 1.5)),
    kt.SuperLoss(lam=0.5, tau=None, momentum=0.8),
], ids=["number", "schedule", "superloss"])
def test_reweighting_config_round_trip(option):
    config = option.get_config()
    again = type(option).from_config(config)
    assert again.get_config() == config
    via_keras = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(option))
    assert via_keras.get_config() == config


def test_reweighting_refusals():
    with pytest.raises(ValueError, match="Received: threshold_schedule=-1"):
        kt.SelfPaced(threshold_schedule=-1)
    with pytest.raises(ValueError, match="Received: lam=0"):
        kt.SuperLoss(lam=0)
    with pytest.raises(ValueError, match="Received: momentum=1"):
        kt.SuperLoss(momentum=1)
