"""A custom `train_step` that keeps the options (issue 29 item 3).

Oracle: the keras.io guide "Customizing what happens in fit()" step, verbatim,
with the gradients of `dense_2` clipped by hand (`tf.clip_by_norm`, as
`kt.ClipByNorm` documents), trained by stock `fit` from the same weights.
The library's version is the same step with `self.optimizer.apply(...)`
replaced by `self.apply_gradients_with_options(...)` and
`kt.ClipByNorm(0.05, where="dense_2")` compiled.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt

CLIP = 0.05


def guide_step(model, data, apply):
    """keras.io's `train_step`, with the line that applies the gradients swapped in."""
    x, y = data
    with tf.GradientTape() as tape:
        y_pred = model(x, training=True)
        loss = model.compute_loss(y=y, y_pred=y_pred)
    trainable_vars = model.trainable_variables
    gradients = tape.gradient(loss, trainable_vars)
    apply(gradients, trainable_vars, tf.shape(x)[0])
    for metric in model.metrics:
        if metric.name == "loss":
            metric.update_state(loss)
        else:
            metric.update_state(y, y_pred)
    return {m.name: m.result() for m in model.metrics}


class HandClipped(keras.Model):
    def train_step(self, data):
        def apply(gradients, variables, n):
            gradients = [tf.clip_by_norm(g, CLIP) if "dense_2" in v.path else g
                         for g, v in zip(gradients, variables)]
            self.optimizer.apply(gradients, variables)
        return guide_step(self, data, apply)


class WithOptions(kt.TapeOpsMixin, keras.Model):
    def train_step(self, data):
        def apply(gradients, variables, n):
            self.apply_gradients_with_options(gradients, batch_size=n)
        return guide_step(self, data, apply)


def build(cls, **options):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu", name="dense_1")(inputs)
    model = cls(inputs, keras.layers.Dense(1, name="dense_2")(hidden))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"], **options)
    return model


def data(n=64):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 8)).astype("float32")
    return x, (x[:, :1] * 3 + x[:, 1:2] ** 2).astype("float32")


def fit(model, **kwargs):
    return model.fit(*data(), batch_size=16, epochs=2, shuffle=False, verbose=0, **kwargs)


def test_guide_step_with_a_compiled_transform_equals_the_hand_clipped_step():
    oracle = build(HandClipped)
    expected = fit(oracle).history
    model = build(WithOptions, gradient_transforms=[kt.ClipByNorm(CLIP, where="dense_2")])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the step reached the options: no warning
        history = fit(model).history
    for a, b in zip(oracle.get_weights(), model.get_weights()):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)
    np.testing.assert_allclose(history["loss"], expected["loss"], rtol=1e-6)


def test_the_guide_step_needs_no_override_with_an_upgraded_model():
    """docs/from_keras_io.md: the guide's step is Keras's own: `kt.upgrade` + the option do it."""
    oracle = build(HandClipped)
    fit(oracle)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu", name="dense_1")(inputs)
    model = kt.upgrade(keras.Model(inputs, keras.layers.Dense(1, name="dense_2")(hidden)))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"],
                  gradient_transforms=[kt.ClipByNorm(CLIP, where="dense_2")])
    fit(model)
    for a, b in zip(oracle.get_weights(), model.get_weights()):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)


def test_the_oracle_can_fail_without_the_transform():
    oracle = build(HandClipped)
    fit(oracle)
    unclipped = build(WithOptions)
    fit(unclipped)
    difference = max(float(np.max(np.abs(a - b)))
                     for a, b in zip(oracle.get_weights(), unclipped.get_weights()))
    assert difference > 1e-3


def test_accumulation_in_a_custom_step_equals_the_librarys_step():
    stock_step = build(kt.TapeOpsFunctional, accumulation_steps=2)
    fit(stock_step)
    custom = build(WithOptions, accumulation_steps=2)
    fit(custom)
    for a, b in zip(stock_step.get_weights(), custom.get_weights()):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)


def test_custom_step_under_mirrored_strategy_equals_one_device(mirrored):
    one = build(WithOptions, gradient_transforms=[kt.ClipByGlobalNorm(0.05)])
    fit(one)
    with mirrored.scope():
        two = build(WithOptions, gradient_transforms=[kt.ClipByGlobalNorm(0.05)])
    fit(two)
    for a, b in zip(one.get_weights(), two.get_weights()):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5)


def test_options_that_compute_gradients_are_refused_by_name():
    model = build(WithOptions, micro_batches=2)
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match=r"micro_batches decide\(s\) how they are computed.*"
                       r"super\(\).train_step\(data\). Received: micro_batches=2"):
        fit(model)
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_accumulation_needs_the_batch_size():
    class NoSize(kt.TapeOpsMixin, keras.Model):
        def train_step(self, data):
            return guide_step(self, data, lambda g, v, n: self.apply_gradients_with_options(g))

    with pytest.raises(ValueError, match=r"needs `batch_size` with accumulation_steps=2"):
        fit(build(NoSize, accumulation_steps=2))


def test_a_step_that_skips_the_building_block_is_still_reported():
    class Plain(kt.TapeOpsMixin, keras.Model):
        def train_step(self, data):
            return guide_step(self, data, lambda g, v, n: self.optimizer.apply(g, v))

    with pytest.warns(UserWarning, match=r"apply_gradients_with_options"):
        fit(build(Plain, gradient_transforms=[kt.ClipByNorm(CLIP)]))
