"""kt.ReducibleLoss (NumPy oracle with ids), kt.SelectiveBackprop (formula, statistical
test) and kt.ImportanceSampling (unbiased reweighted gradient)."""

import keras
import numpy as np
import pytest
import scipy.stats
import tensorflow as tf

import keras_tapeops as kt
from tests.selection_oracle import data, select_then_step, tiny_model


def _compile(model, option, lr=0.1):
    model.compile(optimizer=keras.optimizers.SGD(lr), loss="mse", sample_selection=option)
    return model


def _close(a, b, tol=1e-6):
    for u, v in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_allclose(u, v, rtol=tol, atol=tol)


# ------------------------------------------------------------ ReducibleLoss
def test_reducible_loss_selects_by_training_minus_irreducible_loss_with_ids():
    x, y = data()
    irreducible = np.random.default_rng(5).uniform(0, 3, size=len(x)).astype("float32")
    ids = np.arange(len(x))
    ours = _compile(tiny_model(), kt.ReducibleLoss(irreducible=irreducible, fraction=0.25))
    ours.fit({"x": x, "example_id": ids}, y, batch_size=8, shuffle=False, verbose=0)
    oracle = select_then_step(tiny_model(), x, y, batch=8, fraction=0.25, lr=0.1, offsets=irreducible)
    _close(ours, oracle)
    # Companion: ranking by the training loss alone (TopLoss) ends elsewhere.
    top = select_then_step(tiny_model(), x, y, batch=8, fraction=0.25, lr=0.1)
    assert not np.allclose(top.get_weights()[0], oracle.get_weights()[0], atol=1e-4)


def test_reducible_loss_with_a_holdout_model():
    x, y = data()
    holdout = tiny_model(seed=7)
    offsets = np.mean((holdout.predict(x, verbose=0) - y) ** 2, axis=1).astype("float32")
    ours = _compile(tiny_model(), kt.ReducibleLoss(irreducible=holdout, fraction=0.25))
    ours.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    oracle = select_then_step(tiny_model(), x, y, batch=8, fraction=0.25, lr=0.1, offsets=offsets)
    _close(ours, oracle, tol=1e-5)


def test_reducible_loss_refuses_a_batch_without_ids():
    x, y = data()
    model = _compile(tiny_model(), kt.ReducibleLoss(irreducible=np.zeros(16), fraction=0.5))
    with pytest.raises(ValueError, match="'example_id'.*Received: x as ndarray|Received: x as"):
        model.fit(x, y, batch_size=8, verbose=0)


@pytest.mark.parametrize("irreducible", [[], [[1.0]], [np.nan], "abc"])
def test_reducible_loss_refuses_bad_tables(irreducible):
    with pytest.raises(ValueError, match="Received: irreducible="):
        kt.ReducibleLoss(irreducible=irreducible)


# ------------------------------------------------------- SelectiveBackprop
def _engine(option, n=8):
    model = _compile(tiny_model(), option)
    x, y = data(n)
    model.single_pass_gradients(x, y, None)  # builds the compiled loss
    return model.tapeops_state.engine


def test_selective_backprop_keep_probability_is_percentile_to_the_beta():
    engine = _engine(kt.SelectiveBackprop(beta=2.0, history_size=12))
    rng = np.random.default_rng(0)
    history = []
    for _ in range(3):  # the third batch wraps around the ring buffer
        losses = rng.exponential(size=8).astype("float32")
        history = (history + list(losses))[-12:]
        got = engine.keep_probabilities(tf.constant(losses)).numpy()
        h = np.array(history)
        expected = np.array([(h <= l).mean() for l in losses]) ** 2.0
        np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_selective_backprop_draws_follow_the_keep_probabilities():
    """k=1 draw per call picks example i with probability p_i / sum(p).

    Chi-square goodness of fit over 3000 draws; the test fails falsely with
    probability 1e-3 (its significance level).
    """
    engine = _engine(kt.SelectiveBackprop(beta=1.0, history_size=8, fraction=1 / 8, seed=3))
    losses = tf.constant([0.1, 0.5, 0.2, 3.0, 1.0, 0.05, 2.0, 0.7])
    engine.keep_probabilities(losses)  # history = this batch from now on
    p = engine.keep_probabilities(losses).numpy()
    np.testing.assert_allclose(p, (np.argsort(np.argsort(losses.numpy())) + 1) / 8.0, rtol=1e-6)

    @tf.function
    def draws(count):
        return tf.map_fn(
            lambda _: engine.select(None, None, None, None, losses, None, None)[0][0],
            tf.range(count), fn_output_signature=tf.int32,
        )

    picks = draws(3000).numpy()
    counts = np.bincount(picks, minlength=8)
    expected = 3000 * p / p.sum()
    assert scipy.stats.chisquare(counts, expected).pvalue > 1e-3
    # Companion: the same counts are far from uniform draws.
    assert scipy.stats.chisquare(counts, np.full(8, 3000 / 8)).pvalue < 1e-3


def test_selective_backprop_fit_keeps_the_fixed_fraction():
    x, y = data()
    model = _compile(tiny_model(), kt.SelectiveBackprop(beta=1.0, seed=0))
    history = model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert history.history["selection_fraction"] == [pytest.approx(0.5)]
    assert model.tapeops_state.engine.seen.numpy() == 16


# ------------------------------------------------------ ImportanceSampling
def _flat(grads):
    return np.concatenate([np.ravel(g) for g in grads])


@pytest.mark.parametrize("score", ["loss", "gradient_bound"])
def test_importance_sampling_gradient_is_unbiased(score):
    """Mean of 2000 reweighted draws equals the full-batch gradient.

    Per coordinate, |mean - full| <= 4.5 standard errors (normal
    approximation: a false failure has probability about 7e-6 per coordinate,
    2e-4 over the 29 coordinates). The companion shows draws without the
    1 / (n q) reweighting miss the same tolerance.
    """
    x, y = data(8)
    y[:2] *= 6.0  # a few large losses: sampling is far from uniform
    option = kt.ImportanceSampling(fraction=0.25, score=score, smoothing=0.1, seed=1)
    model = _compile(tiny_model(), option)
    xt, yt = tf.constant(x), tf.constant(y)
    full = _flat(model.single_pass_gradients(xt, yt, None)[0])
    engine = model.tapeops_state.engine

    def statistic(unweighted):
        select = engine.select
        if unweighted:
            engine.select = lambda *a: (select(*a)[0], None)
        step = tf.function(lambda: engine.batch_gradients(model, xt, yt, None)[0])
        samples = np.stack([_flat(step()) for _ in range(2000)])
        engine.select = select
        error = np.abs(samples.mean(0) - full)
        return error / (samples.std(0) / np.sqrt(len(samples)) + 1e-12)

    assert statistic(unweighted=False).max() <= 4.5
    assert statistic(unweighted=True).max() > 4.5


def test_importance_sampling_refusals():
    with pytest.raises(ValueError, match="Received: score="):
        kt.ImportanceSampling(score="norm")
    with pytest.raises(ValueError, match="Received: smoothing="):
        kt.ImportanceSampling(smoothing=1.5)
    with pytest.raises(ValueError, match="Received: fraction="):
        kt.ImportanceSampling(fraction=0.0)


def test_selective_backprop_refusals():
    with pytest.raises(ValueError, match="Received: beta="):
        kt.SelectiveBackprop(beta=0)
    with pytest.raises(ValueError, match="Received: history_size="):
        kt.SelectiveBackprop(history_size=0)
