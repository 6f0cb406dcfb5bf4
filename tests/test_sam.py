"""`compile(sharpness_aware=kt.SAM(...))` against a hand-written two-pass tape loop.

The oracle is the seed-style SAM loop: gradient at w, perturb by
rho * g / ||g|| (ASAM: rho * |w|^2 g / || |w| g ||), gradient at w + e with the
BatchNormalization moving statistics of that pass discarded, restore w, apply.
Each oracle step runs as a `tf.function` (fit's execution mode).
"""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt

from oracle_utils import graph_step

N, BATCH, LR, RHO = 64, 16, 0.1, 0.05


def data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, 4)).astype("float32")
    y = (np.sin(x[:, :1]) * 2 + x[:, 1:2]).astype("float32")
    w = rng.uniform(0.2, 2.0, size=(N,)).astype("float32")
    return x, y, w


def plain_model(batch_norm=True):
    layers = [keras.Input((4,)), keras.layers.Dense(8, activation="tanh", name="hidden")]
    if batch_norm:
        layers.append(keras.layers.BatchNormalization(name="bn"))
    layers.append(keras.layers.Dense(1, name="head"))
    return keras.Sequential(layers)


@pytest.fixture
def initial_weights():
    keras.utils.set_random_seed(7)
    return plain_model().get_weights()


def sam_model(initial_weights, batch_norm=True, **compile_kwargs):
    model = kt.upgrade(plain_model(batch_norm))
    model.set_weights(initial_weights)
    model.compile(keras.optimizers.SGD(LR), "mse", **compile_kwargs)
    return model


def oracle(initial_weights, x, y, sw=None, rho=RHO, adaptive=False, epochs=2,
           act_l2=None, loss_scale=False, perturb=None, batch_norm=True):
    """Hand-written SAM; returns (final weights, per-step first-pass losses).

    `perturb` (a layer name) restricts the perturbation to that layer.
    """
    model = plain_model(batch_norm)
    model.set_weights(initial_weights)
    optimizer = keras.optimizers.SGD(LR)
    if loss_scale:
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    variables = model.trainable_variables
    optimizer.build(variables)
    bn = model.get_layer("bn") if batch_norm else None
    hidden = model.get_layer("hidden")
    on = [perturb is None or f"/{perturb}/" in f"/{v.path}" for v in variables]

    def loss_fn(xb, yb, swb):
        h = hidden(xb)
        out = model.get_layer("head")(bn(h, training=True) if bn is not None else h)
        per_sample = tf.reduce_mean(tf.square(tf.cast(out, "float32") - yb), axis=-1)
        if swb is None:
            loss = tf.reduce_mean(per_sample)
        else:
            loss = tf.reduce_sum(per_sample * swb) / tf.cast(tf.size(per_sample), "float32")
        if act_l2 is not None:
            loss = loss + act_l2 * tf.reduce_mean(tf.square(tf.cast(h, "float32")))
        return loss

    def gradients(xb, yb, swb):
        with tf.GradientTape() as tape:
            loss = loss_fn(xb, yb, swb)
            scaled = optimizer.scale_loss(loss) if loss_scale else loss
        grads = tape.gradient(scaled, variables)
        if loss_scale:
            grads = [g / optimizer.dynamic_scale for g in grads]
        return loss, grads

    @graph_step
    def step(xb, yb, swb):
        loss, g = gradients(xb, yb, swb)
        s = [gi * tf.abs(v) if adaptive else gi for gi, v in zip(g, variables)]
        norm = tf.sqrt(tf.add_n([tf.reduce_sum(si * si) for si, o in zip(s, on) if o]))
        e = [rho * (si * tf.abs(v) if adaptive else si) / norm if o else tf.zeros_like(v)
             for si, v, o in zip(s, variables, on)]
        old = [tf.identity(v) for v in variables]
        stats = [tf.identity(bn.moving_mean), tf.identity(bn.moving_variance)] if bn else []
        for v, ei in zip(variables, e):
            v.assign_add(ei)
        _, g2 = gradients(xb, yb, swb)
        for v, o in zip(variables, old):
            v.assign(o)
        if bn is not None:
            bn.moving_mean.assign(stats[0])
            bn.moving_variance.assign(stats[1])
        if loss_scale:  # apply() divides by the scale again
            g2 = [gi * optimizer.dynamic_scale for gi in g2]
        optimizer.apply_gradients(zip(g2, variables))
        return loss

    losses = []
    for _ in range(epochs):
        for i in range(0, N, BATCH):
            swb = None if sw is None else tf.constant(sw[i:i + BATCH])
            losses.append(float(step(tf.constant(x[i:i + BATCH]),
                                     tf.constant(y[i:i + BATCH]), swb)))
    return model.get_weights(), losses


def max_diff(a, b):
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a, b))


def fit(model, x, y, sw=None, epochs=2):
    return model.fit(x, y, sample_weight=sw, batch_size=BATCH, epochs=epochs,
                     shuffle=False, verbose=0).history


@pytest.mark.parametrize("adaptive", [False, True], ids=["SAM", "ASAM"])
def test_equals_two_pass_tape_loop(initial_weights, adaptive):
    x, y, _ = data()
    model = sam_model(initial_weights, sharpness_aware=kt.SAM(RHO, adaptive=adaptive))
    history = fit(model, x, y)
    expected, losses = oracle(initial_weights, x, y, adaptive=adaptive)
    assert max_diff(model.get_weights(), expected) < 1e-6
    # The logged loss is the first pass's (at w, not at w + e).
    np.testing.assert_allclose(history["loss"][-1], np.mean(losses[N // BATCH:]), rtol=1e-5)


def test_check_can_fail_plain_training_differs(initial_weights):
    """Companion: plain SGD, or ASAM where SAM is expected, is far from the oracle."""
    x, y, _ = data()
    expected, _ = oracle(initial_weights, x, y)
    plain = sam_model(initial_weights)
    fit(plain, x, y)
    assert max_diff(plain.get_weights(), expected) > 1e-3
    asam = sam_model(initial_weights, sharpness_aware=kt.SAM(RHO, adaptive=True))
    fit(asam, x, y)
    assert max_diff(asam.get_weights(), expected) > 1e-4


def test_sample_weights(initial_weights):
    x, y, sw = data()
    model = sam_model(initial_weights, sharpness_aware=kt.SAM(RHO))
    fit(model, x, y, sw)
    expected, _ = oracle(initial_weights, x, y, sw=sw)
    assert max_diff(model.get_weights(), expected) < 1e-6
    unweighted, _ = oracle(initial_weights, x, y)
    assert max_diff(expected, unweighted) > 1e-3  # the weights matter


def test_batch_norm_statistics_updated_once_per_step(initial_weights):
    x, y, _ = data()
    model = sam_model(initial_weights, sharpness_aware=kt.SAM(RHO))
    fit(model, x, y, epochs=1)
    # Plain training from the same weights updates the statistics with the
    # first pass's batches only; after one step they equal it exactly.
    plain = sam_model(initial_weights)
    bn_stats = lambda m: [m.get_layer("bn").moving_mean.numpy(),  # noqa: E731
                          m.get_layer("bn").moving_variance.numpy()]
    model1 = sam_model(initial_weights, sharpness_aware=kt.SAM(RHO))
    model1.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, shuffle=False, verbose=0)
    plain.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, shuffle=False, verbose=0)
    for a, b in zip(bn_stats(model1), bn_stats(plain)):
        np.testing.assert_array_equal(a, b)
    expected, _ = oracle(initial_weights, x, y, epochs=1)
    assert max_diff(model.get_weights(), expected) < 1e-6


def test_with_a_loss_term_in_both_passes(initial_weights):
    x, y, _ = data()
    model = sam_model(initial_weights, sharpness_aware=kt.SAM(RHO),
                      loss_terms=[kt.ActivationPenalty("hidden", l2=0.5, name="act")])
    history = fit(model, x, y)
    expected, _ = oracle(initial_weights, x, y, act_l2=0.5)
    assert max_diff(model.get_weights(), expected) < 1e-6
    assert "act" in history
    without_term, _ = oracle(initial_weights, x, y)
    assert max_diff(expected, without_term) > 1e-4


def test_where_perturbs_only_the_selected_layer(initial_weights):
    x, y, _ = data()
    model = sam_model(initial_weights, sharpness_aware=kt.SAM(RHO, where="head"))
    fit(model, x, y)
    expected, _ = oracle(initial_weights, x, y, perturb="head")
    assert max_diff(model.get_weights(), expected) < 1e-6


def test_rho_zero_equals_plain_training(initial_weights):
    x, y, _ = data()
    model = sam_model(initial_weights, sharpness_aware=kt.SAM(0.0))
    plain = sam_model(initial_weights)
    h1, h2 = fit(model, x, y), fit(plain, x, y)
    assert max_diff(model.get_weights(), plain.get_weights()) < 1e-6
    np.testing.assert_allclose(h1["loss"], h2["loss"], rtol=1e-6)


def test_mixed_float16_uses_the_true_gradient_norm(initial_weights):
    keras.config.set_dtype_policy("mixed_float16")
    x, y, _ = data()
    model = sam_model(initial_weights, sharpness_aware=kt.SAM(RHO))
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    fit(model, x, y)
    expected, _ = oracle(initial_weights, x, y, loss_scale=True)
    assert max_diff(model.get_weights(), expected) < 1e-5


def test_mirrored_equals_single_device_global_perturbation(mirrored):
    """Documented semantics: the perturbation uses the global gradient, so two
    replicas train like one device (no BatchNormalization here: its batch
    statistics are per replica under MirroredStrategy, with or without SAM)."""
    x, y, _ = data()
    keras.utils.set_random_seed(7)
    initial = plain_model(batch_norm=False).get_weights()
    with mirrored.scope():
        model = sam_model(initial, batch_norm=False, sharpness_aware=kt.SAM(RHO))
    fit(model, x, y)
    expected, _ = oracle(initial, x, y, batch_norm=False)
    assert max_diff(model.get_weights(), expected) < 1e-6
    plain, _ = oracle(initial, x, y, batch_norm=False, rho=0.0)
    assert max_diff(expected, plain) > 1e-4


def test_save_and_load_keep_the_option(initial_weights, tmp_path):
    x, y, _ = data()
    model = sam_model(initial_weights, sharpness_aware=kt.SAM(0.1, adaptive=True, where="head"))
    fit(model, x, y, epochs=1)
    path = tmp_path / "sam.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    sam = loaded.tapeops_options.sharpness_aware
    assert (sam.rho, sam.adaptive, sam.where) == (0.1, True, "head")
    fit(model, x, y, epochs=1)
    fit(loaded, x, y, epochs=1)
    assert max_diff(model.get_weights(), loaded.get_weights()) < 1e-6
    json.dumps(loaded.get_compile_config())


def test_config_round_trip_and_errors():
    sam = kt.SAM(rho=np.float32(0.5), adaptive=True, where=["head", "hidden"])
    again = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(sam))
    assert again.get_config() == sam.get_config()
    assert repr(sam) == "SAM(rho=0.5, adaptive=True, where=['head', 'hidden'])"
    with pytest.raises(ValueError, match=r"Received: rho=-1"):
        kt.SAM(rho=-1)
    with pytest.raises(TypeError, match=r"Received: adaptive=1"):
        kt.SAM(adaptive=1)
    with pytest.raises(TypeError, match=r"Received: sharpness_aware=0.05"):
        kt.upgrade(plain_model()).compile("sgd", "mse", sharpness_aware=0.05)
    with pytest.raises(ValueError, match=r"where='nope'"):
        kt.upgrade(plain_model()).compile("sgd", "mse", sharpness_aware=kt.SAM(where="nope"))


def test_micro_batches_perturb_with_the_whole_batch_gradient():
    """Documented: both passes run over the micro-batches; the perturbation
    comes from the whole batch's gradient, so the step equals SAM on the batch."""
    x, y, _ = data()
    keras.utils.set_random_seed(7)
    initial = plain_model(batch_norm=False).get_weights()
    model = sam_model(initial, batch_norm=False, sharpness_aware=kt.SAM(RHO), micro_batches=4)
    fit(model, x, y)
    expected, _ = oracle(initial, x, y, batch_norm=False)
    assert max_diff(model.get_weights(), expected) < 1e-6


def test_accumulation_perturbs_each_batch_with_its_own_gradient():
    """Documented: with accumulation_steps=2 each batch of 8 is perturbed by its
    own gradient; the window applies the mean of the second gradients. That is
    SAM with m-sharpness m=8 on batches of 16, not SAM on the 16-sample batch."""
    x, y, _ = data()
    keras.utils.set_random_seed(7)
    initial = plain_model(batch_norm=False).get_weights()
    model = sam_model(initial, batch_norm=False, sharpness_aware=kt.SAM(RHO),
                      accumulation_steps=2)
    model.fit(x, y, batch_size=BATCH // 2, epochs=2, shuffle=False, verbose=0)

    oracle_model = plain_model(batch_norm=False)
    oracle_model.set_weights(initial)
    variables = oracle_model.trainable_variables
    optimizer = keras.optimizers.SGD(LR)
    optimizer.build(variables)

    def grads_at(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(oracle_model(xb) - yb))
        return tape.gradient(loss, variables)

    @graph_step
    def step(xb, yb):
        total = [tf.zeros_like(v) for v in variables]
        for half in (slice(0, BATCH // 2), slice(BATCH // 2, BATCH)):
            g = grads_at(xb[half], yb[half])
            norm = tf.sqrt(tf.add_n([tf.reduce_sum(gi * gi) for gi in g]))
            old = [tf.identity(v) for v in variables]
            for v, gi in zip(variables, g):
                v.assign_add(RHO * gi / norm)
            g2 = grads_at(xb[half], yb[half])
            for v, o in zip(variables, old):
                v.assign(o)
            total = [t + gi / 2 for t, gi in zip(total, g2)]
        optimizer.apply_gradients(zip(total, variables))

    for _ in range(2):
        for i in range(0, N, BATCH):
            step(tf.constant(x[i:i + BATCH]), tf.constant(y[i:i + BATCH]))
    assert max_diff(model.get_weights(), oracle_model.get_weights()) < 1e-6
    whole_batch, _ = oracle(initial, x, y, batch_norm=False)
    assert max_diff(whole_batch, oracle_model.get_weights()) > 1e-5
