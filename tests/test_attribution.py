"""`kt.attribution`: saliency, SmoothGrad, Integrated Gradients and Grad-CAM against hand computations."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt
from keras_tapeops.attribution import compiled

TOL = 1e-6


def images(n=3, size=8, channels=1, seed=0):
    return np.random.default_rng(seed).uniform(size=(n, size, size, channels)).astype("float32")


def small_cnn():
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(4, 3, activation="relu", name="conv"),
        keras.layers.Conv2D(5, 3, activation="tanh", name="conv_2"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(3, name="logits"),
    ])


def input_gradient(model, x, target):
    """Hand: d output[i, target[i]] / d x, one tape."""
    x = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        out = model(x, training=False)
        score = tf.reduce_sum(tf.gather(out, target, axis=1, batch_dims=1))
    return tape.gradient(score, x).numpy()


def predicted(model, x):
    return np.argmax(model(x, training=False).numpy(), axis=1)


def test_integrated_gradients_of_a_linear_model_is_input_times_weight():
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(3)])
    x = np.random.default_rng(0).normal(size=(4, 64)).astype("float32")
    baseline = np.full((64,), 0.25, "float32")
    kernel = model.layers[0].kernel.numpy()
    for target in (None, 2):
        ig = kt.attribution.integrated_gradients(model, x, baseline=baseline, target=target, steps=5)
        units = predicted(model, x) if target is None else np.full(4, target)
        np.testing.assert_allclose(ig, (x - baseline) * kernel[:, units].T, rtol=0, atol=TOL)


def test_integrated_gradients_is_complete_within_one_percent():
    model = keras.Sequential([
        keras.Input((64,)), keras.layers.Dense(16, activation="tanh"),
        keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3),
    ])
    x = np.random.default_rng(1).normal(size=(6, 64)).astype("float32") * 2.0
    ig = kt.attribution.integrated_gradients(model, x, steps=128)
    units = predicted(model, x)
    rows = np.arange(len(x))
    difference = (model(x).numpy() - model(np.zeros_like(x)).numpy())[rows, units]
    assert np.abs(difference).min() > 0.1
    np.testing.assert_allclose(ig.reshape(len(x), -1).sum(axis=1), difference, rtol=0.01)
    # The check can fail: a too-coarse path (1 step) is further off.
    coarse = kt.attribution.integrated_gradients(model, x, steps=1)
    assert np.abs(coarse.reshape(len(x), -1).sum(axis=1) - difference).max() > 0.01 * np.abs(difference).min()


def hand_integrated_gradients(model, x, baseline, target, steps):
    """keras.io's loop: one gradient per interpolation point, then the trapezoid."""
    grads = []
    for k in range(steps + 1):
        point = baseline + (k / steps) * (x - baseline)
        grads.append(input_gradient(model, point, target))
    grads = np.stack(grads)
    return (x - baseline) * ((grads[:-1] + grads[1:]) / 2.0).mean(axis=0)


@pytest.mark.parametrize("batch_size", [None, 7])
def test_integrated_gradients_equals_the_per_point_loop(batch_size):
    model = small_cnn()
    x = images()
    baseline = np.zeros_like(x) + 0.1
    target = np.array([0, 2, 1])
    expected = hand_integrated_gradients(model, x, baseline, target, steps=10)
    actual = kt.attribution.integrated_gradients(
        model, x, baseline=baseline, target=target, steps=10, batch_size=batch_size)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=TOL)


def test_saliency_is_the_input_gradient_on_three_model_kinds():
    class Subclassed(keras.Model):
        def __init__(self):
            super().__init__()
            self.hidden = keras.layers.Dense(5, activation="tanh")
            self.out = keras.layers.Dense(3)

        def call(self, x):
            return self.out(self.hidden(x))

    inputs = keras.Input((64,))
    functional = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Dense(5, "relu")(inputs)))
    sequential = keras.Sequential([keras.Input((64,)), keras.layers.Dense(3, activation="tanh")])
    x = np.random.default_rng(2).normal(size=(4, 64)).astype("float32")
    subclassed = Subclassed()
    subclassed(x)
    for model in (sequential, functional, subclassed):
        units = predicted(model, x)
        expected = input_gradient(model, x, units)
        np.testing.assert_allclose(
            kt.attribution.saliency(model, x, absolute=False), expected, rtol=0, atol=TOL)
        np.testing.assert_allclose(
            kt.attribution.saliency(model, x), np.abs(expected), rtol=0, atol=TOL)


def test_smoothgrad_averages_gradients_at_noisy_copies():
    model = small_cnn()
    x = images(n=2)
    samples, level, seed = 6, 0.2, 4
    spread = (x.max(axis=(1, 2, 3)) - x.min(axis=(1, 2, 3))).reshape(1, 2, 1, 1, 1)
    draws = tf.random.stateless_normal((samples,) + x.shape, [seed, 0]).numpy()
    noisy = x[None] + level * spread * draws
    units = predicted(model, x)
    expected = np.mean([input_gradient(model, point, units) for point in noisy], axis=0)
    for batch_size in (None, 4):
        actual = kt.attribution.smoothgrad(model, x, samples=samples, noise=level, seed=seed,
                                           absolute=False, batch_size=batch_size)
        np.testing.assert_allclose(actual, expected, rtol=0, atol=TOL)
    plain = kt.attribution.saliency(model, x, absolute=False)
    assert np.abs(plain - expected).max() > 1e-4  # the noise changes the map


def hand_grad_cam(feature_model, head, x, target):
    """Hand: features then head in one tape; weights = spatial mean of the gradient."""
    x = tf.constant(x)
    with tf.GradientTape() as tape:
        features = feature_model(x, training=False)
        tape.watch(features)
        out = head(features)
        score = tf.reduce_sum(tf.gather(out, target, axis=1, batch_dims=1))
    grads = tape.gradient(score, features).numpy()
    weights = grads.mean(axis=(1, 2), keepdims=True)
    return np.maximum((weights * features.numpy()).sum(axis=-1), 0.0)


def test_grad_cam_equals_the_hand_computation_on_a_sequential_cnn():
    model = small_cnn()
    x = images()
    conv, conv_2, pool, dense = model.layers

    def head(a):
        return dense(pool(conv_2(a)))

    feature_model = keras.Sequential([keras.Input((8, 8, 1)), conv])
    for target in (None, 1):
        units = predicted(model, x) if target is None else np.full(3, target)
        expected = hand_grad_cam(feature_model, head, x, units)
        cam = kt.attribution.grad_cam(model, x, layer="conv", target=target)
        assert cam.shape == (3, 6, 6)
        np.testing.assert_allclose(cam, expected, rtol=0, atol=TOL)
        assert cam.max() > 0
    upsampled = kt.attribution.grad_cam(model, x, layer=model.get_layer("conv"), upsample=True)
    resized = tf.image.resize(kt.attribution.grad_cam(model, x, "conv")[..., None], (8, 8))
    np.testing.assert_allclose(upsampled, resized.numpy()[..., 0], rtol=0, atol=TOL)
    # The check can fail: another layer gives another map.
    other = kt.attribution.grad_cam(model, x, layer="conv_2")
    assert other.shape == (3, 4, 4)


def test_grad_cam_reaches_into_a_nested_keras_applications_backbone():
    backbone = keras.applications.MobileNetV2(
        input_shape=(32, 32, 3), alpha=0.35, include_top=False, weights=None)
    inputs = keras.Input((32, 32, 3))
    pooled = keras.layers.GlobalAveragePooling2D()(backbone(inputs))
    model = keras.Model(inputs, keras.layers.Dense(4)(pooled))
    x = images(n=2, size=32, channels=3)
    path = f"{backbone.name}/block_3_expand"
    cam = kt.attribution.grad_cam(model, x, layer=path, target=3)
    inner = backbone.get_layer("block_3_expand")
    split = keras.Model(backbone.inputs, [inner.output, backbone.output])
    x_t = tf.constant(x)
    with tf.GradientTape() as tape:
        features, last = split(x_t, training=False)
        out = model.layers[-1](model.layers[-2](last))
        score = tf.reduce_sum(out[:, 3])
    grads = tape.gradient(score, features).numpy()
    weights = grads.mean(axis=(1, 2), keepdims=True)
    expected = np.maximum((weights * features.numpy()).sum(axis=-1), 0.0)
    assert cam.shape == expected.shape == (2, 8, 8) and expected.max() > 0
    np.testing.assert_allclose(cam, expected, rtol=1e-5, atol=TOL)
    assert kt.attribution.grad_cam(model, x, layer=path, upsample=True).shape == (2, 32, 32)


def test_grad_cam_on_a_layer_inside_a_subclassed_model():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.features = keras.Sequential([keras.layers.Conv2D(3, 3, name="c")], name="features")
            self.pool = keras.layers.GlobalAveragePooling2D()
            self.out = keras.layers.Dense(2)

        def call(self, x):
            return self.out(self.pool(self.features(x)))

    net = Net()
    x = images(n=2)
    net(x)
    cam = kt.attribution.grad_cam(net, x, layer="features/c", target=0)
    expected = hand_grad_cam(net.features, lambda a: net.out(net.pool(a)), x, np.zeros(2, int))
    np.testing.assert_allclose(cam, expected, rtol=0, atol=TOL)


def test_each_method_is_traced_once_per_model_and_setting():
    model = small_cnn()
    x = images()
    for _ in range(3):
        kt.attribution.integrated_gradients(model, x, steps=8)
        kt.attribution.grad_cam(model, x, "conv")
    functions = compiled._FUNCTIONS[model]
    assert len(functions) == 2
    assert all(f.experimental_get_tracing_count() == 1 for f in functions.values())


def test_bad_arguments_raise_with_received():
    model = small_cnn()
    x = images()
    with pytest.raises(ValueError, match="Received: steps=0"):
        kt.attribution.integrated_gradients(model, x, steps=0)
    with pytest.raises(ValueError, match="below 3. Received: target=7"):
        kt.attribution.saliency(model, x, target=7)
    with pytest.raises(ValueError, match="Received: target=-1"):
        kt.attribution.saliency(model, x, target=-1)
    with pytest.raises(ValueError, match=r"shape \(3,\)\). Received: target=\[0, 1\]"):
        kt.attribution.saliency(model, x, target=[0, 1])
    with pytest.raises(ValueError, match=r"Received: baseline of shape \(5,\)"):
        kt.attribution.integrated_gradients(model, x, baseline=np.zeros(5))
    with pytest.raises(ValueError, match="No layer 'nope'.*Received: layer='nope'"):
        kt.attribution.grad_cam(model, x, layer="nope")
    with pytest.raises(ValueError, match=r"Received: layer='conv\*'"):
        kt.attribution.grad_cam(model, x, layer="conv*")
    with pytest.raises(ValueError, match="spatial output.*Received: layer='logits'"):
        kt.attribution.grad_cam(model, x, layer="logits")
    with pytest.raises(ValueError, match="Received: noise=-0.1"):
        kt.attribution.smoothgrad(model, x, noise=-0.1)
    with pytest.raises(TypeError, match="Received: x of type list"):
        kt.attribution.saliency(model, [x, x])
    inputs = keras.Input((4,))
    two = keras.Model(inputs, [keras.layers.Dense(2)(inputs), keras.layers.Dense(2)(inputs)])
    with pytest.raises(ValueError, match="several"):
        kt.attribution.saliency(two, np.ones((2, 4), "float32"))
