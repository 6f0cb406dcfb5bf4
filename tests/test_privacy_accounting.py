"""kt.privacy.epsilon / noise_multiplier_for (= dp_accounting), poisson_batches, PrivacyBudget."""

import math
import sys

import dp_accounting
import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt


def _direct(steps, q, sigma, delta, accountant):
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
    )
    tracker = (
        dp_accounting.pld.PLDAccountant() if accountant == "pld"
        else dp_accounting.rdp.RdpAccountant()
    )
    return tracker.compose(event).get_epsilon(delta)


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_epsilon_equals_dp_accounting(accountant):
    ours = kt.privacy.epsilon(steps=300, sampling_rate=0.02, noise_multiplier=1.1,
                              delta=1e-5, accountant=accountant)
    assert ours == _direct(300, 0.02, 1.1, 1e-5, accountant)
    assert 0.5 < ours < 5


def test_epsilon_edges_and_order():
    assert kt.privacy.epsilon(0, 0.1, 1.0) == 0.0
    assert kt.privacy.epsilon(10, 0.1, 0.0) == math.inf
    pld = kt.privacy.epsilon(100, 0.05, 1.0)
    rdp = kt.privacy.epsilon(100, 0.05, 1.0, accountant="rdp")
    assert pld <= rdp  # RDP is an upper bound, PLD tighter


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_noise_multiplier_for_reaches_the_target(accountant):
    sigma = kt.privacy.noise_multiplier_for(4.0, steps=4, sampling_rate=0.5, accountant=accountant)
    reached = kt.privacy.epsilon(4, 0.5, sigma, accountant=accountant)
    assert reached <= 4.0 + 1e-9
    assert kt.privacy.epsilon(4, 0.5, sigma * 0.98, accountant=accountant) > 4.0


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: kt.privacy.epsilon(10, 0.0, 1.0), "Received: sampling_rate=0.0"),
        (lambda: kt.privacy.epsilon(10, 1.5, 1.0), "Received: sampling_rate=1.5"),
        (lambda: kt.privacy.epsilon(10, 0.1, -1.0), "Received: noise_multiplier=-1.0"),
        (lambda: kt.privacy.epsilon(10, 0.1, 1.0, delta=1.0), "Received: delta=1.0"),
        (lambda: kt.privacy.epsilon(-1, 0.1, 1.0), "Received: steps=-1"),
        (lambda: kt.privacy.epsilon(10, 0.1, 1.0, accountant="moments"), "Received: accountant='moments'"),
        (lambda: kt.privacy.noise_multiplier_for(0, 10, 0.1), "Received: target_epsilon=0"),
        (lambda: kt.privacy.poisson_batches((np.ones((4, 2)), np.ones(4)), 0), "Received: sampling_rate=0"),
        (lambda: kt.callbacks.PrivacyBudget(100, sampling_rate=2.0), "Received: sampling_rate=2.0"),
        (lambda: kt.callbacks.PrivacyBudget(0), "Received: dataset_size=0"),
    ],
)
def test_bad_values_raise_with_received(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_clear_import_error_without_dp_accounting(monkeypatch):
    monkeypatch.setitem(sys.modules, "dp_accounting", None)
    with pytest.raises(ImportError, match=r"pip install keras-tapeops\[privacy\]"):
        kt.privacy.epsilon(10, 0.1, 1.0)


# ------------------------------------------------------------------ sampling
def _arrays(n=200):
    x = np.arange(n, dtype="float32")[:, None] + 1.0  # row i holds i + 1 (never 0)
    return x, np.arange(n)


def _batches(dataset):
    return [tuple(t.numpy() for t in element) for element in dataset]


def test_poisson_batches_shape_mask_and_rate():
    q, n = 0.1, 200
    batches = kt.privacy.poisson_batches(_arrays(n), q, seed=0, steps=60)
    drawn = _batches(batches)
    sizes = []
    for x, y, mask in drawn:
        assert x.shape == (56, 1) and mask.dtype == bool  # 20 + 7 * 4.24 + 1 -> 56
        count = int(mask.sum())
        sizes.append(count)
        real = x[mask, 0]
        assert len(set(real)) == count  # no example twice in a batch
        np.testing.assert_array_equal(real - 1, y[mask])
        assert (x[~mask] == 0).all() and mask[:count].all()
    # 60 steps of Binomial(200, 0.1): mean 20, standard error sqrt(18 / 60) = 0.55;
    # a 5-standard-error bound fails by chance with probability < 1e-6.
    assert abs(np.mean(sizes) - 20) < 5 * math.sqrt(18 / 60)
    assert np.std(sizes) > 1  # sizes vary


def test_poisson_batches_seeded_and_new_each_epoch():
    a = kt.privacy.poisson_batches(_arrays(), 0.1, seed=4, steps=3)
    b = kt.privacy.poisson_batches(tf.data.Dataset.from_tensor_slices(_arrays()), 0.1, seed=4, steps=3)
    first, again = _batches(a), _batches(a)
    for (x1, _, m1), (x2, _, m2) in zip(first, _batches(b)):
        np.testing.assert_array_equal(x1, x2)
        np.testing.assert_array_equal(m1, m2)
    assert any(not np.array_equal(u[0], v[0]) for u, v in zip(first, again))


def test_truncation_probability_of_the_default_size():
    from keras_tapeops.privacy import poisson

    size = poisson.default_max_batch_size(60000, 0.004)
    assert size % 8 == 0 and size > 240
    assert poisson.truncation_probability(60000, 0.004, size) < 1e-9
    assert poisson.truncation_probability(100, 0.5, 50) > 0.4


def test_fit_on_poisson_batches_masks_padding_and_traces_once():
    """Noise 0: the update is the clipped sum over the real examples divided by the padded size."""
    x = np.random.default_rng(0).normal(size=(40, 3)).astype("float32")
    y = np.random.default_rng(1).integers(0, 2, size=40)
    model = kt.upgrade(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]))
    start = model.get_weights()
    model.compile(optimizer=keras.optimizers.SGD(0.5),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  differential_privacy=kt.DPSGD(0.1, 0.0))
    engine = model.tapeops_state.engine
    traces = []
    original = engine.forward_parts
    engine.forward_parts = lambda *a: traces.append(1) or original(*a)
    model.fit(kt.privacy.poisson_batches((x, y), 0.2, seed=3, steps=4), epochs=1, verbose=0)
    assert len(traces) == 1  # variable batch sizes, one trace

    oracle = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    oracle.set_weights(start)
    oracle.compile(optimizer=keras.optimizers.SGD(0.5),
                   loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    @tf.function
    def clipped(xi, yi):
        with tf.GradientTape() as tape:
            loss = oracle.compute_loss(x=xi, y=yi, y_pred=oracle(xi, training=True))
        grads = tape.gradient(loss, oracle.trainable_variables)
        return [g * tf.minimum(1.0, 0.1 / tf.linalg.global_norm(grads)) for g in grads]

    fresh = kt.privacy.poisson_batches((x, y), 0.2, seed=3, steps=4)
    batches = _batches(fresh)  # the first iteration: the one fit drew
    for bx, by, mask in batches:
        total = [np.zeros(v.shape, "float32") for v in oracle.trainable_variables]
        for i in np.flatnonzero(mask):
            for t, g in zip(total, clipped(bx[i:i + 1], by[i:i + 1])):
                t += g.numpy()
        oracle.optimizer.apply_gradients(
            zip([tf.constant(t / len(mask)) for t in total], oracle.trainable_variables)
        )
    assert any(0 < b[2].sum() < len(b[2]) for b in batches)
    for a, b in zip(model.get_weights(), oracle.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_privacy_budget_logs_epsilon_and_stops_before_the_target():
    x = np.random.default_rng(0).normal(size=(32, 3)).astype("float32")
    y = np.random.default_rng(1).integers(0, 2, size=32)
    model = kt.upgrade(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]))
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  differential_privacy=kt.DPSGD(1.0, 0.8))
    allowed = 6  # epsilon after 6 steps at q = 8 / 32 is the target: the 7th would exceed it
    target = kt.privacy.epsilon(allowed, 0.25, 0.8, accountant="rdp")
    budget = kt.callbacks.PrivacyBudget(32, target_epsilon=target, accountant="rdp")
    history = model.fit(x, y, batch_size=8, epochs=5, callbacks=[budget], verbose=0)
    assert int(model.optimizer.iterations) == allowed
    np.testing.assert_allclose(
        history.history["epsilon"], [kt.privacy.epsilon(4, 0.25, 0.8, accountant="rdp"), target]
    )


def test_privacy_budget_shows_in_the_progress_bar_and_round_trips(capsys):
    x = np.random.default_rng(0).normal(size=(8, 3)).astype("float32")
    y = np.random.default_rng(1).integers(0, 2, size=8)
    model = kt.upgrade(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]))
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  differential_privacy=kt.DPSGD(1.0, 1.0))
    budget = kt.callbacks.PrivacyBudget(8, sampling_rate=0.5, accountant="rdp", name="eps")
    model.fit(x, y, batch_size=4, epochs=1, callbacks=[budget], verbose=2)
    assert "eps: " in capsys.readouterr().out
    config = budget.get_config()
    assert kt.callbacks.PrivacyBudget.from_config(config).get_config() == config


def test_privacy_budget_needs_dpsgd():
    model = kt.upgrade(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]))
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="differential_privacy=kt.DPSGD"):
        model.fit(np.ones((4, 3)), np.ones((4, 2)), callbacks=[kt.callbacks.PrivacyBudget(4)], verbose=0)
