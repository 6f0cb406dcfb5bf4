"""Attribution after the model is edited (issue 28): the cached trace must not explain the old model.

The keras.io Grad-CAM recipe sets the last layer's activation to None before
explaining. Old: `saliency`, `integrated_gradients` and `grad_cam` kept the
trace of their first call and went on explaining the softmax model (relative
error 0.71-0.92). The oracle is a direct `tf.GradientTape` computation on
the edited model, eager, with the same targets.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt
from keras_tapeops.attribution import compiled

TARGET = np.array([1, 2, 0])


def make_model():
    keras.utils.set_random_seed(3)
    return keras.Sequential([
        keras.Input((6, 6, 2)),
        keras.layers.Conv2D(4, 3, activation="relu", name="conv"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(3, activation="softmax", name="head"),
    ])


def inputs():
    return np.random.default_rng(0).uniform(size=(3, 6, 6, 2)).astype("float32")


def direct_saliency(model, x):
    x = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        scores = tf.gather(model(x, training=False), TARGET, axis=1, batch_dims=1)
    return np.abs(tape.gradient(scores, x).numpy())


def direct_integrated_gradients(model, x, steps):
    x = tf.constant(x)
    grads = []
    for alpha in np.linspace(0.0, 1.0, steps + 1):
        point = alpha * x
        with tf.GradientTape() as tape:
            tape.watch(point)
            scores = tf.gather(model(point, training=False), TARGET, axis=1, batch_dims=1)
        grads.append(tape.gradient(scores, point).numpy())
    grads = np.stack(grads)
    return x.numpy() * (grads[:-1] + grads[1:]).sum(0) / (2.0 * steps)


def direct_grad_cam(model, x):
    probe = keras.Model(model.inputs, [model.get_layer("conv").output, model.outputs[0]])
    with tf.GradientTape() as tape:
        activations, outputs = probe(tf.constant(x), training=False)
        scores = tf.gather(outputs, TARGET, axis=1, batch_dims=1)
    grads = tape.gradient(scores, activations)
    weights = tf.reduce_mean(grads, axis=[1, 2], keepdims=True)
    return tf.nn.relu(tf.reduce_sum(weights * activations, axis=-1)).numpy()


METHODS = {
    "saliency": (lambda m, x: kt.attribution.saliency(m, x, target=TARGET), direct_saliency),
    "integrated_gradients": (
        lambda m, x: kt.attribution.integrated_gradients(m, x, target=TARGET, steps=8),
        lambda m, x: direct_integrated_gradients(m, x, 8)),
    "grad_cam": (lambda m, x: kt.attribution.grad_cam(m, x, layer="conv", target=TARGET),
                 direct_grad_cam),
}


def _relative_error(actual, expected):
    return np.abs(actual - expected).max() / np.abs(expected).max()


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(METHODS))
def test_edited_model_is_explained_as_it_is_now(name):
    method, direct = METHODS[name]
    model, x = make_model(), inputs()
    before = method(model, x)  # traced and cached for the softmax model
    assert _relative_error(before, direct(model, x)) < 1e-5
    model.layers[-1].activation = None  # the keras.io Grad-CAM recipe
    after = method(model, x)
    expected = direct(model, x)
    assert _relative_error(after, expected) < 1e-5
    # Companion: the edit changes the explanation (the softmax one is far off).
    assert _relative_error(before, expected) > 0.1


@pytest.mark.unit
def test_unedited_model_reuses_its_trace():
    """The fingerprint is stable across calls: one trace for repeated calls
    (a layer's first-call bookkeeping does not force a second one)."""
    model, x = make_model(), inputs()
    kt.attribution.saliency(model, x, target=TARGET)
    function = compiled._FUNCTIONS[model][("saliency",)]
    for _ in range(3):
        kt.attribution.saliency(model, x, target=TARGET)
    assert compiled._FUNCTIONS[model][("saliency",)] is function
    assert function.experimental_get_tracing_count() == 1
    # An edit and an edit back: traced again, then the first model's numbers.
    first = kt.attribution.saliency(model, x, target=TARGET)
    softmax = model.layers[-1].activation
    model.layers[-1].activation = None
    kt.attribution.saliency(model, x, target=TARGET)
    assert compiled._FUNCTIONS[model][("saliency",)] is not function
    model.layers[-1].activation = softmax
    np.testing.assert_allclose(kt.attribution.saliency(model, x, target=TARGET), first, rtol=1e-6)


@pytest.mark.unit
def test_fingerprint_sees_nested_layers_and_subclassed_model_attributes():
    inner = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, activation="tanh")])
    outer = keras.Sequential([keras.Input((4,)), inner, keras.layers.Dense(1)])
    before = compiled.fingerprint(outer)
    assert compiled.fingerprint(outer) == before
    inner.layers[0].activation = keras.activations.relu
    assert compiled.fingerprint(outer) != before

    class Tempered(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)
            self.temperature = 1.0

        def call(self, x):
            return self.dense(x) / self.temperature

    model = Tempered()
    x = np.ones((2, 4), "float32")
    first = kt.attribution.saliency(model, x, target=0, absolute=False)
    model.temperature = 4.0
    np.testing.assert_allclose(
        kt.attribution.saliency(model, x, target=0, absolute=False), first / 4.0, rtol=1e-6)
