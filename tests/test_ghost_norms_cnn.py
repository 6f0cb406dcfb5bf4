"""DP-SGD's rules for the layers of mobile CNNs equal a per-example tape loop's norms.

DepthwiseConv1D/2D and SeparableConv1D/2D (padding, strides, dilation, both
together, depth multiplier, activation, channels first) and
GroupNormalization (groups, instance normalization) get their per-example
norms from their recorded inputs and output gradients (one backward pass),
not the vectorized fallback; a DP-SGD `fit` with them equals the vectorized
one, and a MobileNetV2 with GroupNormalization needs no fallback at all.
"""

import math

import keras
import numpy as np
import tensorflow as tf

import keras_tapeops as kt
from test_ghost_norms import _check


def _with_stride(rate):
    """`rate` where Keras accepts strides > 1 with dilation > 1 (3.15), else 1.

    The oldest supported Keras refuses the pair when the layer is created;
    there the "both" branches below run strided only.
    """
    try:
        keras.layers.DepthwiseConv1D(2, strides=2, dilation_rate=2)
    except ValueError:
        return 1
    return rate


def _functional(inputs, branches):
    flat = [keras.layers.Flatten()(b) for b in branches]
    merged = keras.layers.Concatenate()(flat) if len(flat) > 1 else flat[0]
    model = kt.upgrade(keras.Model(inputs, keras.layers.Dense(2, name="head")(merged)))
    model.compile(optimizer="sgd", loss="mse", differential_privacy=kt.DPSGD(1.0, 0.0, seed=0))
    return model


def _no_fallback(engine):
    return [row for row in engine.report() if "vectorized" in row[2] or "any layer" in row[2]]


def test_depthwise_conv2d(rng):
    inputs = keras.Input((7, 6, 2))
    first = keras.layers.Permute((3, 1, 2))(inputs)
    branches = [
        keras.layers.DepthwiseConv2D(3, padding="same", activation="relu", name="same")(inputs),
        keras.layers.DepthwiseConv2D(3, strides=2, depth_multiplier=2, name="strided")(inputs),
        keras.layers.DepthwiseConv2D((3, 2), dilation_rate=2, padding="same", activation="tanh",
                                     use_bias=False, name="dilated")(inputs),
        keras.layers.DepthwiseConv2D(2, strides=2, dilation_rate=_with_stride(2), padding="same",
                                     name="both")(inputs),
        # Output [B, 4, 5, 4]: Keras adds this channels-first bias on the last axis (4 = C * M).
        keras.layers.DepthwiseConv2D(3, depth_multiplier=2, data_format="channels_first",
                                     name="first")(first),
    ]
    model = _functional(inputs, branches)
    x = rng.normal(size=(4, 7, 6, 2)).astype("float32")
    y = rng.normal(size=(4, 2)).astype("float32")
    engine = _check(model, x, y, {("same", "kernel"): "DepthwiseConv: per-example",
                                  ("strided", "bias"): "DepthwiseConv: per-example",
                                  ("first", "kernel"): "DepthwiseConv: per-example"})
    assert not _no_fallback(engine)


def test_depthwise_conv1d(rng):
    inputs = keras.Input((9, 3))
    branches = [
        keras.layers.DepthwiseConv1D(3, padding="same", strides=2, activation="relu")(inputs),
        keras.layers.DepthwiseConv1D(3, dilation_rate=2, depth_multiplier=2)(inputs),
        keras.layers.DepthwiseConv1D(2, strides=2, dilation_rate=_with_stride(3), padding="same",
                                     name="both")(inputs),
    ]
    model = _functional(inputs, branches)
    x = rng.normal(size=(4, 9, 3)).astype("float32")
    y = rng.normal(size=(4, 2)).astype("float32")
    engine = _check(model, x, y, {("both", "kernel"): "DepthwiseConv: per-example"})
    assert not _no_fallback(engine)


def test_separable_conv2d(rng):
    inputs = keras.Input((7, 6, 2))
    first = keras.layers.Permute((3, 1, 2))(inputs)
    branches = [
        keras.layers.SeparableConv2D(3, 3, padding="same", activation="relu", name="same")(inputs),
        # T = 2 * 2 positions, P = 2 * 2, O = 16: 2 T^2 < P O -> ghost
        keras.layers.SeparableConv2D(16, 3, strides=3, depth_multiplier=2, name="wide")(inputs),
        keras.layers.SeparableConv2D(2, (3, 2), dilation_rate=2, padding="same", use_bias=False,
                                     activation="tanh", name="dilated")(inputs),
        keras.layers.SeparableConv2D(3, 2, strides=2, dilation_rate=_with_stride(2), padding="same",
                                     name="both")(inputs),
        keras.layers.SeparableConv2D(2, 3, depth_multiplier=2, data_format="channels_first",
                                     name="first")(first),
    ]
    model = _functional(inputs, branches)
    x = rng.normal(size=(4, 7, 6, 2)).astype("float32")
    y = rng.normal(size=(4, 2)).astype("float32")
    engine = _check(model, x, y, {
        ("same", "depthwise_kernel"): "SeparableConv: per-example",
        ("same", "pointwise_kernel"): "SeparableConv: per-example",
        ("wide", "pointwise_kernel"): "SeparableConv: ghost",
        ("first", "bias"): "SeparableConv: per-example",
    })
    assert not _no_fallback(engine)


def test_separable_conv1d(rng):
    inputs = keras.Input((9, 3))
    branches = [
        keras.layers.SeparableConv1D(4, 3, padding="same", strides=2, activation="relu")(inputs),
        keras.layers.SeparableConv1D(2, 3, dilation_rate=2, depth_multiplier=2)(inputs),
        keras.layers.SeparableConv1D(2, 2, strides=2, dilation_rate=_with_stride(2), padding="same",
                                     name="both")(inputs),
    ]
    model = _functional(inputs, branches)
    x = rng.normal(size=(4, 9, 3)).astype("float32")
    y = rng.normal(size=(4, 2)).astype("float32")
    engine = _check(model, x, y, {("both", "pointwise_kernel"): "SeparableConv: per-example"})
    assert not _no_fallback(engine)


def test_separable_conv_called_twice(rng):
    shared = keras.layers.SeparableConv2D(2, 3, padding="same", name="shared")
    inputs = keras.Input((5, 5, 2))
    model = _functional(inputs, [shared(shared(inputs))])
    x = rng.normal(size=(4, 5, 5, 2)).astype("float32")
    y = rng.normal(size=(4, 2)).astype("float32")
    _check(model, x, y, {("shared", "depthwise_kernel"): "SeparableConv: per-example"})


def test_group_normalization(rng):
    inputs = keras.Input((5, 4, 4))
    h = keras.layers.Conv2D(4, 3, padding="same")(inputs)
    branches = [
        keras.layers.GroupNormalization(groups=2, name="two")(h),
        keras.layers.GroupNormalization(groups=-1, name="instance")(h),
        keras.layers.GroupNormalization(groups=1, axis=1, center=False, name="axis1")(h),
    ]
    model = _functional(inputs, branches)
    x = rng.normal(size=(4, 5, 4, 4)).astype("float32") * [1.0, 3.0, 0.5, 2.0]
    y = rng.normal(size=(4, 2)).astype("float32")
    engine = _check(model, x, y, {("two", "gamma"): "GroupNormalization: per-example",
                                  ("instance", "beta"): "GroupNormalization: per-example",
                                  ("axis1", "gamma"): "GroupNormalization: per-example"})
    assert not _no_fallback(engine)


def _block(method):
    keras.utils.set_random_seed(0)
    layers = [
        keras.layers.Conv2D(8, 3, strides=2, padding="same", use_bias=False),
        keras.layers.GroupNormalization(groups=2),
        keras.layers.ReLU(6.0),
        keras.layers.DepthwiseConv2D(3, padding="same", use_bias=False),
        keras.layers.GroupNormalization(groups=-1),
        keras.layers.ReLU(6.0),
        keras.layers.Conv2D(4, 1, use_bias=False),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(3),
    ]
    model = kt.upgrade(keras.Sequential([keras.Input((8, 8, 3)), *layers]))
    model.compile(optimizer=keras.optimizers.SGD(0.5),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  differential_privacy=kt.DPSGD(1.0, 0.0, seed=0, method=method))
    return model


def test_mobilenet_block_fit_equals_vectorized(rng):
    x = rng.normal(size=(8, 8, 8, 3)).astype("float32")
    y = rng.integers(0, 3, size=(8,))
    auto, vectorized = _block("auto"), _block("vectorized")
    initial = auto.get_weights()
    vectorized.set_weights(initial)
    for model in (auto, vectorized):
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)  # 2 steps
    for a, b in zip(auto.get_weights(), vectorized.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    moved = [np.max(np.abs(a - w)) for a, w in zip(auto.get_weights(), initial)]
    assert min(moved) > 1e-3, moved
    families = {method.split(":")[0] for _, _, method in auto.tapeops_state.engine.report()}
    assert families == {"Conv", "GroupNormalization", "DepthwiseConv", "Dense"}, families
    assert not _no_fallback(auto.tapeops_state.engine)


def _group_normalized(layer):
    if isinstance(layer, keras.layers.BatchNormalization):
        channels = layer.input.shape[layer.axis]
        return keras.layers.GroupNormalization(
            groups=math.gcd(channels, 8), axis=layer.axis, epsilon=layer.epsilon, name=layer.name
        )
    return layer.__class__.from_config(layer.get_config())


def _call_without_mask(layer, *args, **kwargs):
    # A BatchNormalization's node passes `training` and `mask`; GroupNormalization takes neither.
    if isinstance(layer, keras.layers.GroupNormalization):
        return layer(*args)
    return layer(*args, **kwargs)


def test_mobilenet_v2_with_group_normalization_needs_no_fallback(rng):
    base = keras.applications.MobileNetV2(
        weights=None, input_shape=(32, 32, 3), alpha=0.35, classes=10
    )
    model = kt.upgrade(keras.models.clone_model(
        base, clone_function=_group_normalized, call_function=_call_without_mask
    ))
    assert not any(isinstance(layer, keras.layers.BatchNormalization) for layer in model.layers)
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(),
                  differential_privacy=kt.DPSGD(1.0, 0.0, seed=0))
    engine = model.build_tapeops().engine
    x = rng.normal(size=(2, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, size=(2,))
    # Every rule runs on the real shapes.
    parts, _, _ = engine.forward_parts(model, tf.constant(x), tf.constant(y))
    norms = [parts[id(v)].squared_norms.numpy() for v in model.trainable_weights]
    assert all(n.shape == (2,) and np.all(np.isfinite(n)) for n in norms)
    assert not _no_fallback(engine)
    families = {method.split(":")[0] for _, _, method in engine.report()}
    assert families == {"Conv", "DepthwiseConv", "GroupNormalization", "Dense"}, families
