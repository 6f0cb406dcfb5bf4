"""Tests of the `kt.GradientPenalty` loss term against a hand-written nested-tape loop."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt

from oracle_utils import graph_step

N, BATCH, LR = 48, 16, 0.1


def data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, 3)).astype("float32")
    y = np.stack([np.sin(x[:, 0]), x[:, 1] * x[:, 2]], axis=1).astype("float32")
    return x, y


def plain_model():
    return keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(6, activation="tanh", name="hidden"),
            keras.layers.Dense(2, name="out"),
        ]
    )


def tapeops_model(initial_weights):
    model = kt.upgrade(plain_model())
    model.set_weights(initial_weights)
    return model


def oracle_fit(model, x, y, weight, target, epochs, loss_scale=False,
               clip_global_norm=None, activation_l2=None):
    """Hand-written loop: MSE + weight * mean((||d sum(pred)/dx|| - target)^2).

    Options for the combined tests: `loss_scale` wraps SGD in a
    `LossScaleOptimizer` (for mixed_float16, the loss is scaled before the
    outer gradient); `activation_l2` adds `activation_l2 * mean(hidden^2)`
    of the "hidden" layer's output from the same forward pass;
    `clip_global_norm` clips all gradients jointly (`tf.clip_by_global_norm`)
    before the update. Returns the per-epoch History-style logs. Each step
    runs as a `tf.function`, like fit's (see `oracle_utils`: under
    mixed_float16 an eager step differs).
    """
    optimizer = keras.optimizers.SGD(LR)
    if loss_scale:
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    optimizer.build(model.trainable_variables)  # before tracing: see graph_step
    hidden_layer, out_layer = model.get_layer("hidden"), model.get_layer("out")

    @graph_step
    def step(xb, yb):
        with tf.GradientTape() as tape:
            with tf.GradientTape() as inner:
                inner.watch(xb)
                # The Sequential model's call, layer by layer.
                hidden = hidden_layer(xb, training=True)
                pred = out_layer(hidden, training=True)
            grad_x = inner.gradient(pred, xb)
            norm = tf.sqrt(tf.reduce_sum(tf.square(grad_x), axis=1))
            penalty = weight * tf.reduce_mean(tf.square(norm - target))
            mse = tf.reduce_mean(tf.square(yb - tf.cast(pred, "float32")))
            act = tf.constant(0.0)
            if activation_l2 is not None:
                act = activation_l2 * tf.reduce_mean(
                    tf.square(tf.cast(hidden, "float32"))
                )
            total = mse + penalty + act
            scaled = optimizer.scale_loss(total) if loss_scale else total
        grads = tape.gradient(scaled, model.trainable_variables)
        clipped = tf.constant(False)
        if clip_global_norm is not None:
            grads, global_norm = tf.clip_by_global_norm(grads, clip_global_norm)
            clipped = global_norm > clip_global_norm
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return penalty, act, total, clipped

    logs = {"gradient_penalty": [], "act": [], "loss": [], "clipped_steps": 0}
    for _ in range(epochs):
        epoch = {"gradient_penalty": [], "act": [], "loss": []}
        sizes = []
        for start in range(0, len(x), BATCH):
            xb = tf.constant(x[start:start + BATCH])
            yb = tf.constant(y[start:start + BATCH])
            penalty, act, total, clipped = step(xb, yb)
            logs["clipped_steps"] += int(clipped)
            for key, value in (("gradient_penalty", penalty), ("act", act), ("loss", total)):
                epoch[key].append(float(value))
            sizes.append(len(xb))
        for key, values in epoch.items():
            logs[key].append(np.average(values, weights=sizes))
    return logs


def compile_with_penalty(model, weight, target, **kwargs):
    model.compile(
        optimizer=keras.optimizers.SGD(LR), loss="mse",
        loss_terms=[kt.GradientPenalty(weight=weight, target=target)], **kwargs,
    )


def assert_weights_close(a, b, atol):
    for i, (u, v) in enumerate(zip(a.get_weights(), b.get_weights())):
        np.testing.assert_allclose(u, v, rtol=0, atol=atol, err_msg=f"weight {i}")


def oracle_and_initial(weight, target, epochs=2):
    x, y = data()
    oracle = plain_model()
    initial = oracle.get_weights()
    expected = oracle_fit(oracle, x, y, weight, target, epochs)["gradient_penalty"]
    return x, y, oracle, initial, expected


def max_weight_difference(a, b):
    return max(
        float(np.abs(u - v).max()) for u, v in zip(a.get_weights(), b.get_weights())
    )


@pytest.mark.parametrize("target", [0.0, 1.0])
def test_fit_equals_nested_tape_loop(target):
    x, y, oracle, initial, expected = oracle_and_initial(0.5, target)
    model = tapeops_model(initial)
    compile_with_penalty(model, 0.5, target)
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(model, oracle, atol=1e-5)
    np.testing.assert_allclose(history.history["gradient_penalty"], expected, atol=1e-5)
    assert expected[0] > 1e-3


def test_comparison_fails_without_the_term():
    x, y, oracle, initial, _ = oracle_and_initial(0.5, 1.0)
    model = tapeops_model(initial)
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    assert max_weight_difference(model, oracle) > 1e-3


def test_mirrored_strategy_equals_single_device(mirrored):
    x, y, oracle, initial, expected = oracle_and_initial(0.5, 1.0)
    with mirrored.scope():
        model = tapeops_model(initial)
        compile_with_penalty(model, 0.5, 1.0)
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(model, oracle, atol=1e-5)
    np.testing.assert_allclose(history.history["gradient_penalty"], expected, atol=1e-5)


@pytest.mark.parametrize(
    "options", [{"jit_compile": True}, {"steps_per_execution": 2}]
)
def test_jit_compile_and_steps_per_execution(options):
    x, y, oracle, initial, expected = oracle_and_initial(0.5, 1.0)
    model = tapeops_model(initial)
    compile_with_penalty(model, 0.5, 1.0, **options)
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(model, oracle, atol=1e-5)
    np.testing.assert_allclose(history.history["gradient_penalty"], expected, atol=1e-5)


def mixed_precision_oracle(initial, weight):
    """The nested-tape loop under mixed_float16 with a LossScaleOptimizer."""
    x, y = data()
    oracle = plain_model()
    oracle.set_weights(initial)
    assert oracle.compute_dtype == "float16"
    logs = oracle_fit(oracle, x, y, weight, 1.0, epochs=2, loss_scale=True)
    return oracle, logs


def test_mixed_precision_equals_nested_tape_loop_under_mixed_float16():
    x, y = data()
    initial = plain_model().get_weights()
    keras.config.set_dtype_policy("mixed_float16")
    oracle, expected = mixed_precision_oracle(initial, 0.5)
    model = tapeops_model(initial)
    compile_with_penalty(model, 0.5, 1.0)
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    # No step was skipped for overflow (else both would just stand still).
    assert int(model.optimizer.iterations) == 2 * N // BATCH
    # The oracle's step is a tf.function like fit's, so float16 rounds the
    # same way in both (measured: weights equal, logs within 4e-8); an
    # eager oracle would be ~1e-4 away on CPUs where oneDNN runs float16.
    assert_weights_close(model, oracle, atol=1e-5)
    np.testing.assert_allclose(
        history.history["gradient_penalty"], expected["gradient_penalty"], atol=1e-5
    )
    np.testing.assert_allclose(history.history["loss"], expected["loss"], atol=1e-5)


@pytest.mark.parametrize("other_weight", [0.0, 0.25])
def test_mixed_precision_comparison_can_fail(other_weight):
    # Under mixed_float16, dropping or halving the penalty moves the weights
    # and the logged penalty far beyond the tolerances used above.
    initial = plain_model().get_weights()
    keras.config.set_dtype_policy("mixed_float16")
    oracle, expected = mixed_precision_oracle(initial, 0.5)
    other, other_logs = mixed_precision_oracle(initial, other_weight)
    assert max_weight_difference(other, oracle) > 1e-2
    assert np.max(np.abs(
        np.subtract(other_logs["gradient_penalty"], expected["gradient_penalty"])
    )) > 1e-2


def test_save_load_restores_term_and_resumes(tmp_path):
    x, y = data()
    model = tapeops_model(plain_model().get_weights())
    compile_with_penalty(model, 0.25, 1.0)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    path = str(tmp_path / "penalized.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    (term,) = loaded.tapeops_options.terms
    assert isinstance(term, kt.GradientPenalty)
    assert (term.weight, term.target, term.name) == (0.25, 1.0, "gradient_penalty")
    a = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    b = loaded.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(loaded, model, atol=1e-6)
    np.testing.assert_allclose(
        a.history["gradient_penalty"], b.history["gradient_penalty"], atol=1e-6
    )


def test_validation_default_skips_the_penalty():
    x, y = data()
    model = tapeops_model(plain_model().get_weights())
    compile_with_penalty(model, 10.0, 1.0)
    logs = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    mse = float(np.mean((model.predict(x, verbose=0) - y) ** 2))
    np.testing.assert_allclose(logs["loss"], mse, rtol=1e-5)


def test_in_validation_true_counts_the_penalty_in_evaluate():
    x, y = data()
    model = tapeops_model(plain_model().get_weights())
    model.compile(
        optimizer="sgd", loss="mse",
        loss_terms=[kt.GradientPenalty(2.0, target=1.0, in_validation=True)],
    )
    logs = model.evaluate(x, y, batch_size=N, verbose=0, return_dict=True)
    xt = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        pred = model(xt)
    norm = tf.norm(tape.gradient(pred, xt), axis=1)
    penalty = 2.0 * float(tf.reduce_mean((norm - 1.0) ** 2))
    mse = float(tf.reduce_mean((pred - y) ** 2))
    np.testing.assert_allclose(logs["gradient_penalty"], penalty, rtol=1e-5)
    np.testing.assert_allclose(logs["loss"], mse + penalty, rtol=1e-5)


def test_dict_inputs_use_the_joint_norm():
    rng = np.random.default_rng(1)
    a_in, b_in = keras.Input((2,), name="a"), keras.Input((3,), name="b")
    hidden = keras.layers.Dense(4, activation="tanh")(
        keras.layers.Concatenate()([a_in, b_in])
    )
    model = kt.upgrade(keras.Model({"a": a_in, "b": b_in}, keras.layers.Dense(1)(hidden)))
    x = {"a": rng.normal(size=(8, 2)).astype("float32"),
         "b": rng.normal(size=(8, 3)).astype("float32")}
    y = np.zeros((8, 1), "float32")
    model.compile(
        optimizer="sgd", loss="mse",
        loss_terms=[kt.GradientPenalty(target=0.5, in_validation=True)],
    )
    logs = model.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    xa, xb = tf.constant(x["a"]), tf.constant(x["b"])
    with tf.GradientTape() as tape:
        tape.watch([xa, xb])
        pred = model({"a": xa, "b": xb})
    ga, gb = tape.gradient(pred, [xa, xb])
    norm = tf.sqrt(tf.reduce_sum(ga**2, 1) + tf.reduce_sum(gb**2, 1))
    expected = float(tf.reduce_mean((norm - 0.5) ** 2))
    np.testing.assert_allclose(logs["gradient_penalty"], expected, rtol=1e-5)


CLIP, ACT_L2 = 0.3, 0.5


def compile_combined(model, clip=True, activation=True):
    terms = [kt.GradientPenalty(weight=0.5, target=1.0)]
    if activation:
        terms.append(kt.ActivationPenalty("hidden", l2=ACT_L2, name="act"))
    model.compile(
        optimizer=keras.optimizers.SGD(LR), loss="mse", loss_terms=terms,
        gradient_transforms=[kt.ClipByGlobalNorm(CLIP)] if clip else None,
    )


def test_with_global_norm_clipping_and_activation_penalty():
    x, y = data()
    oracle = plain_model()
    initial = oracle.get_weights()
    expected = oracle_fit(oracle, x, y, 0.5, 1.0, epochs=2,
                          clip_global_norm=CLIP, activation_l2=ACT_L2)
    # The clip acts on most steps, so a run without it could not pass.
    assert expected["clipped_steps"] >= 4
    model = tapeops_model(initial)
    compile_combined(model)
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(model, oracle, atol=1e-5)
    for key in ("gradient_penalty", "act", "loss"):
        np.testing.assert_allclose(history.history[key], expected[key], atol=1e-5,
                                   err_msg=key)


@pytest.mark.parametrize("drop", ["clip", "activation"])
def test_combined_comparison_can_fail(drop):
    x, y = data()
    oracle = plain_model()
    initial = oracle.get_weights()
    oracle_fit(oracle, x, y, 0.5, 1.0, epochs=2,
               clip_global_norm=CLIP, activation_l2=ACT_L2)
    model = tapeops_model(initial)
    compile_combined(model, clip=drop != "clip", activation=drop != "activation")
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    assert max_weight_difference(model, oracle) > 1e-3


def test_registered_name():
    assert (keras.saving.get_registered_name(kt.GradientPenalty)
            == "keras_tapeops>GradientPenalty")
    assert (keras.saving.get_registered_object("keras_tapeops>GradientPenalty")
            is kt.GradientPenalty)
    serialized = keras.saving.serialize_keras_object(kt.GradientPenalty())
    assert serialized["registered_name"] == "keras_tapeops>GradientPenalty"


def test_registered_name_check_can_fail():
    class Unregistered(kt.GradientPenalty):
        pass

    assert keras.saving.get_registered_name(Unregistered) == "Unregistered"


def test_config_round_trip():
    term = kt.GradientPenalty(weight=3.0, target=1.0, name="gp", in_validation=True)
    config = term.get_config()
    assert config == {"weight": 3.0, "name": "gp", "in_validation": True, "target": 1.0}
    clone = kt.GradientPenalty.from_config(config)
    assert clone.get_config() == config
    restored = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(term)
    )
    assert isinstance(restored, kt.GradientPenalty)
    assert restored.get_config() == config
    assert kt.GradientPenalty().in_validation is False
    assert kt.GradientPenalty().target == 0.0


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"target": -1.0}, ValueError, r"Received: target=-1.0"),
        ({"target": "one"}, TypeError, "Received: target='one'"),
        ({"weight": "big"}, TypeError, "Received: weight='big'"),
        ({"name": ""}, ValueError, "Received: name=''"),
        ({"in_validation": 1}, TypeError, "Received: in_validation=1"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        kt.GradientPenalty(**kwargs)
