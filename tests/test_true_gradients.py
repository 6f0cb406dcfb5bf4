"""Unit tests of keras_tapeops.true_gradients (the step behind gradient transforms)."""

import keras
import numpy as np
import tensorflow as tf

from keras_tapeops import true_gradients


def test_map_values_keeps_indexed_slices_sparse():
    grad = tf.IndexedSlices(tf.constant([[1.0, 2.0]]), tf.constant([3]), tf.constant([5, 2]))
    out = true_gradients.map_values(grad, lambda v: v * 2.0)
    assert isinstance(out, tf.IndexedSlices)
    np.testing.assert_array_equal(out.values.numpy(), [[2.0, 4.0]])
    np.testing.assert_array_equal(out.indices.numpy(), [3])
    assert true_gradients.map_values(None, lambda v: v) is None


def test_all_finite_sees_dense_and_sparse_values():
    dense = tf.constant([1.0, 2.0])
    sparse = tf.IndexedSlices(tf.constant([[np.inf]]), tf.constant([0]), tf.constant([2, 1]))
    assert bool(true_gradients.all_finite([dense, None]))
    assert not bool(true_gradients.all_finite([dense, sparse]))
    assert bool(true_gradients.all_finite([None]))


def test_keep_if_finite_returns_the_original_non_finite_gradient():
    old = tf.constant([np.inf, 1.0])
    new = tf.constant([0.5, 0.5])
    kept = true_gradients.keep_if_finite(tf.constant(False), new, old)
    np.testing.assert_array_equal(kept.numpy(), old.numpy())
    used = true_gradients.keep_if_finite(tf.constant(True), new, old)
    np.testing.assert_array_equal(used.numpy(), new.numpy())


def test_sum_over_replicas_is_identity_without_a_strategy():
    grads = [tf.constant(1.0), None]
    out, reduced = true_gradients.sum_over_replicas(grads)
    assert reduced is False
    assert out[1] is None and float(out[0]) == 1.0


def test_sum_over_replicas_sums_per_replica_values(mirrored):
    def step():
        ctx = tf.distribute.get_replica_context()
        value = tf.cast(ctx.replica_id_in_sync_group, tf.float32) + 1.0
        return true_gradients.sum_over_replicas([value, None])[0][0]

    result = mirrored.run(tf.function(step))
    assert [float(v) for v in mirrored.experimental_local_results(result)] == [3.0, 3.0]


def test_apply_transformed_unscales_before_the_transform():
    """The transform sees grads / loss scale; the optimizer gets them rescaled."""
    var = keras.Variable([1.0, 1.0])
    optimizer = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(1.0), initial_scale=8.0
    )
    seen = []

    def transform(grads, variables):
        seen.append(grads[0].numpy())
        return [g * 0.5 for g in grads]

    true_gradients.apply_transformed(optimizer, [tf.constant([8.0, 16.0])], [var], transform)
    np.testing.assert_allclose(seen[0], [1.0, 2.0])
    # SGD(1.0) on the unscaled, halved gradient [0.5, 1.0].
    np.testing.assert_allclose(var.numpy(), [0.5, 0.0])


def test_apply_transformed_skips_a_non_finite_step_even_if_the_transform_fixes_it():
    var = keras.Variable([1.0])
    optimizer = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(1.0), initial_scale=8.0
    )
    true_gradients.apply_transformed(
        optimizer, [tf.constant([np.inf])], [var],
        lambda grads, variables: [tf.clip_by_value(g, -1.0, 1.0) for g in grads],
    )
    np.testing.assert_array_equal(var.numpy(), [1.0])
    assert float(optimizer.dynamic_scale) == 4.0


def test_apply_transformed_divides_out_a_static_loss_scale_factor():
    """With `loss_scale_factor`, thresholds act on the unscaled gradient too."""
    var = keras.Variable([1.0, 1.0])
    optimizer = keras.optimizers.SGD(1.0, loss_scale_factor=8.0)
    seen = []

    def transform(grads, variables):
        seen.append(grads[0].numpy())
        return [tf.clip_by_value(g, -1.0, 1.0) for g in grads]

    # The loss was multiplied by 8 before differentiation (scale_loss).
    true_gradients.apply_transformed(optimizer, [tf.constant([8.0, 32.0])], [var], transform)
    np.testing.assert_allclose(seen[0], [1.0, 4.0])
    np.testing.assert_allclose(var.numpy(), [0.0, 0.0])  # 1 - clip([1, 4], 1)


def test_static_loss_scale_factor_with_clipping_in_fit_equals_unscaled_training():
    """fit with loss_scale_factor=8 and ClipByValue equals fit without the factor."""
    import keras_tapeops as kt

    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype("float32")
    y = rng.normal(size=(32, 1)).astype("float32") * 5

    def train(factor):
        keras.utils.set_random_seed(0)
        model = kt.upgrade(keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]))
        model.compile(
            optimizer=keras.optimizers.SGD(0.1, loss_scale_factor=factor), loss="mse",
            gradient_transforms=[kt.ClipByValue(0.5)],
        )
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
        return model.get_weights()

    plain, scaled = train(None), train(8.0)
    for a, b in zip(plain, scaled):
        np.testing.assert_allclose(a, b, atol=1e-6)
