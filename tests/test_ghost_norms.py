"""Per-example gradient norms of DP-SGD's rules equal a per-example tape loop's.

For each supported layer family (Dense with sequence inputs, EinsumDense,
Embedding with repeated ids, Conv1D/2D with padding, strides and dilation,
LayerNormalization) and for the vectorized fallback, the squared norm of
every variable's per-example gradient computed by `DPSGDState.forward_parts`
(one forward, one backward pass) equals the one from a tape per example.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt
from keras_tapeops.per_example import per_example_losses


def _compiled(layers, input_shape, loss="mse", method="auto", input_dtype="float32"):
    model = kt.upgrade(keras.Sequential([keras.Input(input_shape, dtype=input_dtype), *layers]))
    model.compile(
        optimizer="sgd", loss=loss,
        differential_privacy=kt.DPSGD(1.0, 0.0, seed=0, method=method),
    )
    return model


def _engine_norms(model, x, y):
    engine = model.build_tapeops().engine

    @tf.function
    def norms(x, y):
        parts, _, _ = engine.forward_parts(model, x, y)
        return [parts[id(v)].squared_norms for v in model.trainable_weights]

    return [n.numpy() for n in norms(x, y)], engine


def _loop_norms(model, x, y):
    @tf.function
    def one(xi, yi):
        with tf.GradientTape() as tape:
            loss = per_example_losses(model, yi, model(xi, training=True))[0]
        grads = tape.gradient(loss, model.trainable_weights)
        return [tf.reduce_sum(tf.square(tf.convert_to_tensor(g))) for g in grads]

    n = len(tf.nest.flatten(x)[0])
    rows = [
        one(tf.nest.map_structure(lambda t: t[i:i + 1], x), y[i:i + 1]) for i in range(n)
    ]
    return [np.array([float(r[k]) for r in rows]) for k in range(len(model.trainable_weights))]


def _check(model, x, y, methods=None):
    ours, engine = _engine_norms(model, x, y)
    expected = _loop_norms(model, x, y)
    for variable, a, b in zip(model.trainable_weights, ours, expected):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7, err_msg=variable.path)
    # The norms differ between examples (the check can fail).
    total = sum(expected)
    assert np.ptp(total) > 1e-2 * np.mean(total)
    chosen = {(path, name): method for path, name, method in engine.report()}
    for key, method in (methods or {}).items():
        assert chosen[key] == method, chosen
    return engine


def test_dense_two_dimensional_inputs(rng):
    model = _compiled([keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(3)], (5,))
    x, y = rng.normal(size=(6, 5)).astype("float32"), rng.normal(size=(6, 3)).astype("float32")
    _check(model, x, y, {("dense", "kernel"): "Dense: ghost", ("dense", "bias"): "Dense: per-example"})


def test_dense_sequence_inputs_ghost_or_materialized(rng):
    # T=3 positions: 2 * 3^2 < 16 * 16 -> Gramians; 2 * 3^2 >= 16 * 1 -> per example.
    model = _compiled([keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)], (3, 16))
    x = rng.normal(size=(4, 3, 16)).astype("float32")
    y = rng.normal(size=(4, 3, 1)).astype("float32")
    _check(model, x, y, {("dense", "kernel"): "Dense: ghost", ("dense_1", "kernel"): "Dense: per-example"})


def test_dense_called_twice_counts_both_calls(rng):
    shared = keras.layers.Dense(3, name="shared")
    inputs = keras.Input((4,))
    outputs = shared(keras.layers.Dense(4, name="pre")(shared(keras.layers.Dense(4)(inputs))[..., :1] * inputs))
    model = kt.upgrade(keras.Model(inputs, outputs))
    model.compile(optimizer="sgd", loss="mse", differential_privacy=kt.DPSGD(1.0, 0.0, seed=0))
    x, y = rng.normal(size=(5, 4)).astype("float32"), rng.normal(size=(5, 3)).astype("float32")
    _check(model, x, y)


def test_einsum_dense_layouts(rng):
    layers = [
        keras.layers.EinsumDense("abc,cde->abde", (3, 2, 2), bias_axes="de", activation="tanh", name="e1"),
        keras.layers.EinsumDense("abcd,cde->abe", (3, 4), bias_axes="e", name="e2"),
        keras.layers.EinsumDense("...b,bc->...c", (5,), bias_axes="c", name="e3"),
        keras.layers.Flatten(),
        keras.layers.EinsumDense("ab,bc->ac", (3,), bias_axes="c", name="e4"),
    ]
    model = _compiled(layers, (3, 4))
    x = rng.normal(size=(4, 3, 4)).astype("float32")
    y = rng.normal(size=(4, 3)).astype("float32")
    # e1: T=3 positions, P=4, O=4: 2 * 9 >= 16 -> per example; e4: one position -> ghost.
    _check(model, x, y, {("e1", "kernel"): "EinsumDense: per-example", ("e4", "kernel"): "EinsumDense: ghost"})


def test_embedding_with_repeated_ids(rng):
    short, long = keras.Input((6,), dtype="int32"), keras.Input((300,), dtype="int32")
    pooled = [
        keras.layers.GlobalAveragePooling1D()(keras.layers.Dense(2)(keras.layers.Embedding(5, 3, name="short")(short))),
        keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(5, 2, name="long")(long)),
    ]
    model = kt.upgrade(keras.Model([short, long], keras.layers.Dense(2)(keras.layers.Concatenate()(pooled))))
    model.compile(optimizer="sgd", loss="mse", differential_privacy=kt.DPSGD(1.0, 0.0, seed=0))
    ids_short = rng.integers(0, 5, size=(4, 6)).astype("int32")  # ids repeat
    ids_short[0, :] = 2  # one example uses a single id everywhere
    ids_long = rng.integers(0, 5, size=(4, 300)).astype("int32")  # the grouped path (T > 256)
    y = rng.normal(size=(4, 2)).astype("float32")
    _check(model, (ids_short, ids_long), y, {("short", "embeddings"): "Embedding: ghost"})


def test_conv1d_padding_strides_dilation(rng):
    inputs = keras.Input((9, 2))
    branches = [
        keras.layers.Conv1D(3, 3, padding="same", strides=2, activation="relu")(inputs),
        keras.layers.Conv1D(3, 3, padding="valid", dilation_rate=2)(inputs),
        keras.layers.Conv1D(3, 2, padding="causal", activation="tanh")(inputs),
    ]
    flat = keras.layers.Concatenate()([keras.layers.Flatten()(b) for b in branches])
    model = kt.upgrade(keras.Model(inputs, keras.layers.Dense(2)(flat)))
    model.compile(optimizer="sgd", loss="mse", differential_privacy=kt.DPSGD(1.0, 0.0, seed=0))
    x = rng.normal(size=(4, 9, 2)).astype("float32")
    y = rng.normal(size=(4, 2)).astype("float32")
    _check(model, x, y)


def test_conv2d_mixed_ghost_clipping(rng):
    inputs = keras.Input((7, 6, 2))
    branches = [
        keras.layers.Conv2D(3, (3, 2), padding="same", strides=2, activation="tanh", name="same")(inputs),
        keras.layers.Conv2D(2, (3, 2), padding="valid", name="valid")(inputs),
        keras.layers.Conv2D(32, (3, 2), padding="valid", strides=3, name="wide")(inputs),
    ]
    flat = keras.layers.Concatenate()([keras.layers.Flatten()(b) for b in branches])
    model = kt.upgrade(keras.Model(inputs, keras.layers.Dense(2)(flat)))
    model.compile(optimizer="sgd", loss="mse", differential_privacy=kt.DPSGD(1.0, 0.0, seed=0))
    x = rng.normal(size=(3, 7, 6, 2)).astype("float32")
    y = rng.normal(size=(3, 2)).astype("float32")
    # valid: T=25 positions, P=12, O=2 -> per example; wide: T=4, P=12, O=32 -> ghost (32 < 384).
    _check(model, x, y, {("valid", "kernel"): "Conv: per-example", ("wide", "kernel"): "Conv: ghost"})


def test_conv2d_dilation_and_conv3d(rng):
    inputs = keras.Input((6, 6, 6, 2))
    branches = [
        keras.layers.Conv3D(3, 2, padding="same", strides=2, activation="relu", name="same3d")(inputs),
        keras.layers.Conv3D(16, (3, 2, 2), padding="valid", name="valid3d")(inputs),
    ]
    planes = keras.layers.Reshape((6, 6, 12))(inputs)
    branches.append(keras.layers.Conv2D(2, 3, dilation_rate=2, padding="same", name="dilated")(planes))
    flat = keras.layers.Concatenate()([keras.layers.Flatten()(b) for b in branches])
    model = kt.upgrade(keras.Model(inputs, keras.layers.Dense(2)(flat)))
    model.compile(optimizer="sgd", loss="mse", differential_privacy=kt.DPSGD(1.0, 0.0, seed=0))
    x = rng.normal(size=(3, 6, 6, 6, 2)).astype("float32")
    y = rng.normal(size=(3, 2)).astype("float32")
    # valid3d: T=4*5*5=100, P=24, O=16 -> per example; same3d: T=27, P=16, O=3 -> per example.
    _check(model, x, y, {("valid3d", "kernel"): "Conv: per-example",
                         ("dilated", "kernel"): "Conv: per-example"})


def test_layer_normalization(rng):
    layers = [
        keras.layers.Dense(4),
        keras.layers.LayerNormalization(axis=-1, name="last"),
        keras.layers.LayerNormalization(axis=[1, 2], name="both"),
        keras.layers.Dense(2),
    ]
    model = _compiled(layers, (3, 5))
    x = rng.normal(size=(4, 3, 5)).astype("float32")
    y = rng.normal(size=(4, 3, 2)).astype("float32")
    _check(model, x, y, {("last", "gamma"): "LayerNormalization: per-example",
                         ("both", "beta"): "LayerNormalization: per-example"})


def test_vectorized_fallback_for_other_layers(rng):
    model = _compiled(
        [keras.layers.Dense(4), keras.layers.Reshape((2, 2)), keras.layers.PReLU(name="prelu"),
         keras.layers.Flatten(), keras.layers.Dense(2)],
        (3,),
    )
    x, y = rng.normal(size=(5, 3)).astype("float32"), rng.normal(size=(5, 2)).astype("float32")
    _check(model, x, y, {("prelu", "alpha"): "any layer: vectorized"})


def test_method_vectorized_uses_the_fallback_everywhere(rng):
    model = _compiled([keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(3)], (5,), method="vectorized")
    x, y = rng.normal(size=(6, 5)).astype("float32"), rng.normal(size=(6, 3)).astype("float32")
    engine = _check(model, x, y)
    assert {m for _, _, m in engine.report()} == {"any layer: vectorized"}


def test_transformer_block_with_attention(rng):
    inputs = keras.Input((4,), dtype="int32")
    h = keras.layers.Embedding(7, 8)(inputs)
    h = keras.layers.LayerNormalization()(h + keras.layers.MultiHeadAttention(2, 4)(h, h))
    outputs = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(h))
    model = kt.upgrade(keras.Model(inputs, outputs))
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  differential_privacy=kt.DPSGD(1.0, 0.0, seed=0))
    x = rng.integers(0, 7, size=(4, 4)).astype("int32")
    y = rng.integers(0, 3, size=(4,))
    engine = _check(model, x, y)
    methods = {m for _, _, m in engine.report()}
    assert "any layer: vectorized" not in methods
    assert any(m.startswith("EinsumDense") for m in methods)


def test_weights_read_outside_their_layer_are_clipped_through_the_whole_model(rng):
    class Tied(keras.layers.Layer):
        """Projects on the transposed embedding table (weights tied)."""

        def __init__(self, embedding, **kwargs):
            super().__init__(**kwargs)
            self.embedding = embedding

        def call(self, h):
            return tf.matmul(h, self.embedding.embeddings, transpose_b=True)

    inputs = keras.Input((3,), dtype="int32")
    embedding = keras.layers.Embedding(6, 4)
    h = keras.layers.Dense(4, activation="tanh")(embedding(inputs))
    outputs = Tied(embedding)(h)
    model = kt.upgrade(keras.Model(inputs, outputs))
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  differential_privacy=kt.DPSGD(1.0, 0.0, seed=0))
    x = rng.integers(0, 6, size=(4, 3)).astype("int32")
    y = rng.integers(0, 6, size=(4, 3))
    engine = _check(model, x, y)
    assert any("whole model" in m for _, _, m in engine.report())
