"""`fit` with kt.DPSGD (noise_multiplier=0) equals the per-example oracle.

The oracle is the textbook loop: a tape per example (stock `compute_loss` on
that one example), clip its gradient over all variables to `l2_norm_clip`,
sum, divide by the number of examples of the step, apply with SGD. Same
initial weights, same batches; final weights compared at 1e-6.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt
from rnn_cells import DenseCell

CLIP = 0.05  # small: every example is clipped, so clipping changes the result
LR = 0.5


def _mlp():
    return keras.Sequential([
        keras.Input((5,)), keras.layers.Dense(6, activation="tanh"), keras.layers.Dense(3),
    ])


def _emb_conv():
    return keras.Sequential([
        keras.Input((7,), dtype="int32"),
        keras.layers.Embedding(9, 4),
        keras.layers.Conv1D(5, 3, padding="same", activation="relu"),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(3),
    ])


def _data(kind, n=12, seed=0):
    rng = np.random.default_rng(seed)
    if kind == "mlp":
        x = rng.normal(size=(n, 5)).astype("float32")
    else:
        x = rng.integers(0, 9, size=(n, 7)).astype("int32")
        x[:, :3] = x[:, 3:6]  # repeated ids within an example
    return x, rng.integers(0, 3, size=(n,))


def _build(kind, strategy=None):
    scope = strategy.scope() if strategy is not None else _null()
    with scope:
        keras.utils.set_random_seed(7)
        model = kt.upgrade(_mlp() if kind == "mlp" else _emb_conv())
    return model


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _dp_fit(model, x, y, batch_size, epochs=1, strategy=None, **options):
    scope = strategy.scope() if strategy is not None else _null()
    dp = options.pop("dp", kt.DPSGD(CLIP, 0.0, seed=0))
    with scope:
        model.compile(optimizer=keras.optimizers.SGD(LR), loss=_loss(),
                      differential_privacy=dp, **options)
    return model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)


def _oracle(model, x, y, windows, transform=None):
    """Per-example tapes, clip, sum, divide; one SGD step per window of examples."""
    model.compile(optimizer=keras.optimizers.SGD(LR), loss=_loss())  # stock
    optimizer = model.optimizer
    variables = model.trainable_variables

    @tf.function
    def example_gradient(xi, yi):
        with tf.GradientTape() as tape:
            loss = model.compute_loss(x=xi, y=yi, y_pred=model(xi, training=True))
        grads = [tf.convert_to_tensor(g) for g in tape.gradient(loss, variables)]
        scale = tf.minimum(1.0, CLIP / tf.linalg.global_norm(grads))
        return [g * scale for g in grads]

    @tf.function
    def apply(grads):
        optimizer.apply_gradients(zip(grads, variables))

    for start, stop in windows:
        total = [np.zeros(v.shape, "float32") for v in variables]
        for i in range(start, stop):
            for t, g in zip(total, example_gradient(x[i:i + 1], y[i:i + 1])):
                t += g.numpy()
        update = [t / (stop - start) for t in total]
        if transform is not None:
            update = transform(update)
        apply([tf.constant(u) for u in update])
    return model.get_weights()


def _windows(n, size):
    return [(s, min(s + size, n)) for s in range(0, n, size)]


def _assert_close(a_weights, b_weights, atol=1e-6):
    for a, b in zip(a_weights, b_weights):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=atol)


@pytest.mark.parametrize("kind", ["mlp", "emb_conv"])
def test_fit_equals_per_example_oracle(kind):
    x, y = _data(kind)
    model, oracle = _build(kind), _build(kind)
    _dp_fit(model, x, y, batch_size=4, epochs=2)
    expected = _oracle(oracle, np.concatenate([x, x]), np.concatenate([y, y]), _windows(24, 4))
    _assert_close(model.get_weights(), expected)


def test_companion_stock_fit_differs_from_the_oracle():
    x, y = _data("mlp")
    stock, oracle = _build("mlp"), _build("mlp")
    stock.compile(optimizer=keras.optimizers.SGD(LR), loss=_loss())
    stock.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    expected = _oracle(oracle, x, y, _windows(12, 4))
    assert max(np.abs(a - b).max() for a, b in zip(stock.get_weights(), expected)) > 1e-3


def test_vectorized_method_equals_the_oracle():
    x, y = _data("emb_conv")
    model, oracle = _build("emb_conv"), _build("emb_conv")
    _dp_fit(model, x, y, batch_size=6, dp=kt.DPSGD(CLIP, 0.0, method="vectorized"))
    _assert_close(model.get_weights(), _oracle(oracle, x, y, _windows(12, 6)))


def test_two_replicas_equal_the_oracle(mirrored):
    x, y = _data("emb_conv")
    model = _build("emb_conv", mirrored)
    oracle = _build("emb_conv")
    _dp_fit(model, x, y, batch_size=6, strategy=mirrored)
    _assert_close(model.get_weights(), _oracle(oracle, x, y, _windows(12, 6)))


def test_micro_batches_equal_the_oracle():
    x, y = _data("emb_conv")
    model, oracle = _build("emb_conv"), _build("emb_conv")
    _dp_fit(model, x, y, batch_size=6, micro_batches=3)
    _assert_close(model.get_weights(), _oracle(oracle, x, y, _windows(12, 6)))


def test_accumulation_windows_equal_the_oracle_with_a_short_last_window():
    # 14 examples, batches of 4: windows of 2 batches = 8 examples, then 6 (flushed).
    x, y = _data("emb_conv", n=14)
    model, oracle = _build("emb_conv"), _build("emb_conv")
    _dp_fit(model, x, y, batch_size=4, accumulation_steps=2, micro_batches=2)
    _assert_close(model.get_weights(), _oracle(oracle, x, y, [(0, 8), (8, 14)]))
    assert int(model.optimizer.iterations) == 2


def test_gradient_transforms_see_the_private_gradient():
    x, y = _data("mlp")
    model, oracle = _build("mlp"), _build("mlp")
    _dp_fit(model, x, y, batch_size=4, gradient_transforms=[kt.ClipByGlobalNorm(0.01)])

    def clip(update):
        norm = np.sqrt(sum(float((u ** 2).sum()) for u in update))
        return [u * min(1.0, 0.01 / norm) for u in update]

    _assert_close(model.get_weights(), _oracle(oracle, x, y, _windows(12, 4), transform=clip))


def test_mixed_precision_clips_in_float32():
    x, y = _data("mlp")
    oracle = _build("mlp")
    expected = _oracle(oracle, x, y, _windows(12, 4))
    keras.config.set_dtype_policy("mixed_float16")
    model = _build("mlp")
    history = _dp_fit(model, x, y, batch_size=4)
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    # float16 forward and backward; the clip weights, sums and update in float32.
    _assert_close(model.get_weights(), expected, atol=2e-3)
    assert np.isfinite(history.history["loss"][0])


def test_logged_loss_is_the_stock_mean():
    x, y = _data("mlp")
    model, stock = _build("mlp"), _build("mlp")
    history = _dp_fit(model, x, y, batch_size=12, dp=kt.DPSGD(1e6, 0.0))
    stock.compile(optimizer=keras.optimizers.SGD(LR), loss=_loss())
    stock_history = stock.fit(x, y, batch_size=12, shuffle=False, verbose=0)
    np.testing.assert_allclose(history.history["loss"], stock_history.history["loss"], rtol=1e-6)
    # With a clip that never binds, DP-SGD without noise is stock SGD.
    _assert_close(model.get_weights(), stock.get_weights())


def _conv2d():
    return keras.Sequential([
        keras.Input((6, 6, 2)),
        keras.layers.Conv2D(3, 2, padding="same", activation="tanh", name="kept_rows"),
        keras.layers.Conv2D(4, 3, strides=2, padding="same", activation="relu"),
        keras.layers.Conv2D(16, 2, dilation_rate=2, padding="valid", name="dilated"),
        keras.layers.Flatten(),
        keras.layers.Dense(3),
    ])


@pytest.mark.parametrize("chunk_elements", [None, 200])
def test_conv2d_fit_equals_oracle_with_norms_in_chunks(monkeypatch, chunk_elements):
    """Conv2D norms computed over chunks of the batch (200 floats: 1 example
    per chunk for most layers, 2 for the dilated one: an uneven last chunk of
    5 examples), the clipped sum from the filter gradient, or from the
    per-example gradients where they are smaller than the output gradients
    (`kept_rows`: 8 x 3 per example vs 36 x 3)."""
    from keras_tapeops.privacy import ghost_conv

    if chunk_elements is not None:
        monkeypatch.setattr(ghost_conv, "CHUNK_ELEMENTS", chunk_elements)
    rng = np.random.default_rng(3)
    x = rng.normal(size=(10, 6, 6, 2)).astype("float32")
    y = rng.integers(0, 3, size=(10,))
    keras.utils.set_random_seed(7)
    model = kt.upgrade(_conv2d())
    oracle = keras.models.clone_model(model)
    oracle.set_weights(model.get_weights())
    _dp_fit(model, x, y, batch_size=5, epochs=2)
    expected = _oracle(oracle, np.concatenate([x, x]), np.concatenate([y, y]), _windows(20, 5))
    _assert_close(model.get_weights(), expected)
    methods = {m for _, _, m in model.tapeops_state.engine.report()}
    assert methods >= {"Conv: per-example", "Conv: ghost"}, methods


@pytest.mark.parametrize("mode", ["jit", "mirrored", "mixed_float16", "steps_per_execution"])
def test_conv2d_chunked_norms_under_the_fault_matrix(monkeypatch, mirrored, mode):
    """The chunked Conv2D norms (a while_loop over chunks of 1-2 examples)
    under XLA, two replicas (3 examples each: an uneven last chunk),
    mixed precision (float16 patches cast to float32) and several steps per
    execution equal the per-example oracle."""
    from keras_tapeops.privacy import ghost_conv

    monkeypatch.setattr(ghost_conv, "CHUNK_ELEMENTS", 200)
    rng = np.random.default_rng(4)
    x = rng.normal(size=(12, 6, 6, 2)).astype("float32")
    y = rng.integers(0, 3, size=(12,))
    keras.utils.set_random_seed(7)
    oracle = _conv2d()
    start = oracle.get_weights()
    expected = _oracle(oracle, x, y, _windows(12, 6))
    if mode == "mixed_float16":
        keras.config.set_dtype_policy("mixed_float16")
    strategy = mirrored if mode == "mirrored" else None
    scope = strategy.scope() if strategy is not None else _null()
    with scope:
        model = kt.upgrade(_conv2d())
        model.set_weights(start)
    options = {"jit": {"jit_compile": True}, "steps_per_execution": {"steps_per_execution": 2}}
    _dp_fit(model, x, y, batch_size=6, strategy=strategy, **options.get(mode, {}))
    _assert_close(model.get_weights(), expected, atol=2e-3 if mode == "mixed_float16" else 1e-6)


def _rnn_model():
    keras.utils.set_random_seed(7)
    inputs = keras.Input((4, 5))
    h = keras.layers.RNN(DenseCell(6))(inputs)
    return kt.upgrade(keras.Model(inputs, keras.layers.Dense(3)(h)))


def test_a_layer_inside_an_rnn_loop_is_clipped_from_whole_model_rows():
    # Its outputs live in the loop body's graph, where the backward pass
    # cannot stop (before: InaccessibleTensorError); its variables are
    # clipped as variables read outside their layer's calls.
    rng = np.random.default_rng(3)
    x = rng.normal(size=(12, 4, 5)).astype("float32")
    y = rng.integers(0, 3, size=(12,))
    model, oracle = _rnn_model(), _rnn_model()
    _dp_fit(model, x, y, batch_size=4)
    _assert_close(model.get_weights(), _oracle(oracle, x, y, _windows(12, 4)))
    report = model.tapeops_state.engine.report()
    outside = {path for layer, path, method in report if layer == "(read outside its layer)"}
    assert outside == {"rnn/dense_cell/dense/kernel", "rnn/dense_cell/dense/bias"}, report
