"""per_example_losses: the compiled loss per example; its mean is stock compute_loss."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_tapeops.per_example import per_example_losses


def _stock_loss(model, x, y, sample_weight=None):
    """Stock compute_loss minus the regularization / add_loss losses."""
    y_pred = model(x, training=False)
    total = model.compute_loss(x, y, y_pred, sample_weight)
    extra = sum(float(l) for l in model.losses) if model.losses else 0.0
    return float(total) - extra, y_pred


def _check(model, x, y, sample_weight=None):
    expected, y_pred = _stock_loss(model, x, y, sample_weight)
    losses = per_example_losses(model, y, y_pred, sample_weight)
    assert losses.shape == (len(tf.nest.flatten(x)[0]),)
    assert losses.dtype == tf.float32
    np.testing.assert_allclose(float(tf.reduce_mean(losses)), expected, rtol=1e-6, atol=1e-7)
    return losses.numpy(), y_pred


def test_mse_with_sample_weight_and_regularizer(rng):
    model = keras.Sequential([
        keras.Input((3,)),
        keras.layers.Dense(2, kernel_regularizer=keras.regularizers.L2(0.1)),
    ])
    model.compile(optimizer="sgd", loss="mse")
    x = rng.normal(size=(5, 3)).astype("float32")
    y = rng.normal(size=(5, 2)).astype("float32")
    w = rng.uniform(size=(5,)).astype("float32")
    losses, y_pred = _check(model, x, y, w)
    # Each value is that example's weighted mean over its outputs.
    manual = w * np.mean((y_pred.numpy() - y) ** 2, axis=1)
    np.testing.assert_allclose(losses, manual, rtol=1e-5)


def test_sparse_crossentropy_with_class_weights_as_sample_weights(rng):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = rng.normal(size=(6, 4)).astype("float32")
    y = np.array([0, 1, 2, 1, 0, 2])
    class_weight = np.array([1.0, 2.0, 0.5], "float32")
    _check(model, x, y, class_weight[y])


def test_sequence_output_is_the_mean_over_time(rng):
    model = keras.Sequential([keras.Input((4, 3)), keras.layers.Dense(5)])
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = rng.normal(size=(3, 4, 3)).astype("float32")
    y = rng.integers(0, 5, size=(3, 4))
    losses, y_pred = _check(model, x, y)
    per_step = keras.losses.sparse_categorical_crossentropy(y, y_pred, from_logits=True)
    np.testing.assert_allclose(losses, np.mean(per_step.numpy(), axis=1), rtol=1e-5)


def test_sequence_sample_weight_per_time_step(rng):
    model = keras.Sequential([keras.Input((4, 3)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    x = rng.normal(size=(3, 4, 3)).astype("float32")
    y = rng.normal(size=(3, 4, 2)).astype("float32")
    _check(model, x, y, rng.uniform(size=(3, 4)).astype("float32"))


def test_multi_output_dict_with_loss_weights(rng):
    inputs = keras.Input((3,))
    a = keras.layers.Dense(2, name="a")(inputs)
    b = keras.layers.Dense(1, name="b")(inputs)
    model = keras.Model(inputs, {"a": a, "b": b})
    model.compile(optimizer="sgd", loss={"a": "mse", "b": "mae"}, loss_weights={"a": 0.3, "b": 2.0})
    x = rng.normal(size=(4, 3)).astype("float32")
    y = {"a": rng.normal(size=(4, 2)).astype("float32"), "b": rng.normal(size=(4, 1)).astype("float32")}
    losses, y_pred = _check(model, x, y, rng.uniform(size=(4,)).astype("float32"))
    manual = 0.3 * np.mean((y_pred["a"].numpy() - y["a"]) ** 2, axis=1) + 2.0 * np.abs(
        y_pred["b"].numpy() - y["b"]
    )[:, 0]
    assert not np.allclose(losses, manual)  # the sample weights are applied
    unweighted = per_example_losses(model, y, y_pred).numpy()
    np.testing.assert_allclose(unweighted, manual, rtol=1e-5)


def test_multi_output_list_outputs(rng):
    inputs = keras.Input((3,))
    model = keras.Model(inputs, [keras.layers.Dense(2)(inputs), keras.layers.Dense(1)(inputs)])
    model.compile(optimizer="sgd", loss=["mse", "mae"], loss_weights=[1.0, 0.5])
    x = rng.normal(size=(4, 3)).astype("float32")
    y = [rng.normal(size=(4, 2)).astype("float32"), rng.normal(size=(4, 1)).astype("float32")]
    _check(model, x, y)


def test_masked_sequence_follows_keras_normalization(rng):
    model = keras.Sequential([
        keras.Input((5,), dtype="int32"),
        keras.layers.Embedding(7, 3, mask_zero=True),
        keras.layers.Dense(4),
    ])
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.array([[1, 2, 0, 0, 0], [3, 4, 5, 6, 0], [1, 0, 0, 0, 0]], "int32")
    y = rng.integers(0, 4, size=(3, 5))
    losses, _ = _check(model, x, y)
    assert losses.shape == (3,)


@pytest.mark.parametrize("reduction", ["sum", "mean_with_sample_weight"])
def test_other_reductions_keep_the_mean_equal(rng, reduction):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss=keras.losses.MeanSquaredError(reduction=reduction))
    x = rng.normal(size=(5, 3)).astype("float32")
    y = rng.normal(size=(5, 2)).astype("float32")
    _check(model, x, y, rng.uniform(size=(5,)).astype("float32"))


def test_inside_tf_function_and_before_compile_loss_is_built(rng):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    x = rng.normal(size=(4, 3)).astype("float32")
    y = rng.normal(size=(4, 2)).astype("float32")
    traced = tf.function(lambda x, y: per_example_losses(model, y, model(x)))
    losses = traced(x, y).numpy()
    expected, _ = _stock_loss(model, x, y)
    np.testing.assert_allclose(losses.mean(), expected, rtol=1e-6)


def test_no_reduction_is_refused():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss=keras.losses.MeanSquaredError(reduction=None))
    x, y = np.ones((2, 3), "float32"), np.ones((2, 2), "float32")
    with pytest.raises(ValueError, match="Received: reduction=None"):
        per_example_losses(model, y, model(x))


def test_uncompiled_model_is_refused():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="Received: model="):
        per_example_losses(model, np.ones((2, 2), "float32"), model(np.ones((2, 3), "float32")))
