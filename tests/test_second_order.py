"""hessian_vector_product and top_hessian_eigenvalue against independent Hessians.

Oracles:
- linear regression with MSE: `H = 2/n X~^T diag(s) X~` (X~ = [X, 1], s the
  sample weights), in NumPy float64, plus the closed-form Hessians of an L2
  kernel regularizer (`2 l2 I`) and of an `add_loss` term;
- a tanh network with softmax cross-entropy: the Hessian of a hand-written
  float64 forward pass over the flattened parameters, by `tf.GradientTape`
  jacobian of the gradient (no Keras, no compute_loss);
- eigenvalues: `np.linalg.eigh` of those matrices.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_tapeops.second_order import _FUNCTIONS
from keras_tapeops.second_order import hessian_vector_product
from keras_tapeops.second_order import top_hessian_eigenvalue

N, D = 24, 3


def _flat(tensors):
    return np.concatenate([np.asarray(t, dtype=np.float64).ravel() for t in tensors])


def _split(flat, model):
    out, i = [], 0
    for var in model.trainable_variables:
        size = int(np.prod(var.shape))
        out.append(flat[i : i + size].reshape(tuple(var.shape)).astype("float32"))
        i += size
    return out


def _hessian_by_columns(model, x, y, **kwargs):
    """The full matrix, one hessian_vector_product per basis vector."""
    size = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    columns = []
    for i in range(size):
        e = np.zeros(size)
        e[i] = 1.0
        columns.append(_flat(hessian_vector_product(model, x, y, _split(e, model), **kwargs)))
    return np.stack(columns, axis=1)


def _rel(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _regression_data(n=N, seed=0):
    rng = np.random.default_rng(seed)
    # Columns of different scales: a clear gap between the top eigenvalues.
    x = (rng.normal(size=(n, D)) * np.array([2.0, 1.0, 0.5])).astype("float32")
    y = rng.normal(size=(n, 1)).astype("float32")
    return x, y


def _linear_model(**dense_kwargs):
    model = keras.Sequential([keras.Input((D,)), keras.layers.Dense(1, **dense_kwargs)])
    model.compile(optimizer="sgd", loss="mse")
    return model


def _closed_form(x, sample_weight=None):
    """Hessian of Keras MSE (sum_over_batch_size) w.r.t. [kernel; bias]."""
    xt = np.concatenate([x.astype(np.float64), np.ones((len(x), 1))], axis=1)
    s = np.ones(len(x)) if sample_weight is None else sample_weight.astype(np.float64)
    return 2.0 / len(x) * xt.T @ (s[:, None] * xt)


def _top(matrix):
    values = np.linalg.eigh(matrix)[0]
    return values[np.argmax(np.abs(values))]


# --- Hessian-vector products -----------------------------------------------------


def test_linear_regression_matches_closed_form():
    x, y = _regression_data()
    model = _linear_model()
    h = _closed_form(x)
    assert _rel(_hessian_by_columns(model, x, y), h) < 1e-6
    v = np.random.default_rng(1).normal(size=D + 1)
    hv = hessian_vector_product(model, x, y, _split(v, model))
    assert [tuple(t.shape) for t in hv] == [(D, 1), (1,)]
    assert _rel(_flat(hv), h @ v) < 1e-6


def test_sample_weights_respected():
    x, y = _regression_data()
    s = np.random.default_rng(2).uniform(0.0, 3.0, size=N).astype("float32")
    model = _linear_model()
    weighted = _hessian_by_columns(model, x, y, sample_weight=s)
    assert _rel(weighted, _closed_form(x, s)) < 1e-6
    # The oracle tells the difference: the unweighted Hessian is far off.
    assert _rel(weighted, _closed_form(x)) > 1e-1


def test_regularizer_and_add_loss_count():
    class MeanSquareOutput(keras.layers.Layer):
        """Identity that adds `c * mean(out^2)` with add_loss."""

        def __init__(self, c, **kwargs):
            super().__init__(**kwargs)
            self.c = c

        def call(self, inputs):
            self.add_loss(self.c * keras.ops.mean(inputs**2))
            return inputs

    l2, c = 0.3, 0.25
    x, y = _regression_data()
    model = keras.Sequential([
        keras.Input((D,)),
        keras.layers.Dense(1, kernel_regularizer=keras.regularizers.L2(l2)),
        MeanSquareOutput(c),
    ])
    model.compile(optimizer="sgd", loss="mse")
    expected = _closed_form(x) * (1.0 + c)      # MSE + c * mean(out^2)
    expected[:D, :D] += 2.0 * l2 * np.eye(D)    # l2 * ||kernel||^2
    assert _rel(_hessian_by_columns(model, x, y), expected) < 1e-6


def test_a_wrong_vector_gives_a_different_product():
    x, y = _regression_data()
    model = _linear_model()
    h = _closed_form(x)
    rng = np.random.default_rng(3)
    v = rng.normal(size=D + 1)
    hv = _flat(hessian_vector_product(model, x, y, _split(v, model)))
    assert _rel(hv, h @ v) < 1e-6
    wrong = v.copy()
    wrong[0] += 0.1
    assert _rel(hv, h @ wrong) > 1e-2
    assert _rel(hv, h @ v[::-1]) > 1e-1


def _tanh_net():
    model = keras.Sequential([
        keras.Input((D,)),
        keras.layers.Dense(4, activation="tanh"),
        keras.layers.Dense(3),
    ])
    return model


def _tanh_net_hessian(model, x, labels):
    """Hessian of mean softmax cross-entropy, hand-written, float64."""
    shapes = [tuple(v.shape) for v in model.trainable_variables]
    theta = tf.constant(_flat(model.get_weights()))
    x64 = tf.constant(x, tf.float64)
    onehot = tf.one_hot(labels, 3, dtype=tf.float64)

    def loss(flat):
        parts, i = [], 0
        for shape in shapes:
            size = int(np.prod(shape))
            parts.append(tf.reshape(flat[i : i + size], shape))
            i += size
        w1, b1, w2, b2 = parts
        logits = tf.tanh(x64 @ w1 + b1) @ w2 + b2
        return -tf.reduce_mean(tf.reduce_sum(onehot * tf.nn.log_softmax(logits), axis=-1))

    with tf.GradientTape() as outer:
        outer.watch(theta)
        with tf.GradientTape() as inner:
            inner.watch(theta)
            value = loss(theta)
        grad = inner.gradient(value, theta)
    return outer.jacobian(grad, theta).numpy()


@pytest.mark.parametrize("loss", ["sparse", "categorical"])
def test_tanh_network_matches_jacobian_of_gradient(loss):
    rng = np.random.default_rng(4)
    x = rng.normal(size=(16, D)).astype("float32")
    labels = rng.integers(0, 3, size=16)
    model = _tanh_net()
    if loss == "sparse":
        model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        y = labels.astype("int32")
    else:
        model.compile(loss=keras.losses.CategoricalCrossentropy(from_logits=True))
        y = np.eye(3, dtype="float32")[labels]
    h = _tanh_net_hessian(model, x, labels)
    assert np.allclose(h, h.T, atol=1e-12)
    measured = _hessian_by_columns(model, x, y)
    assert _rel(measured, h) < 1e-5


def test_embedding_gradients_are_densified():
    """Embedding lookups equal a bias-free Dense on one-hot inputs."""
    vocab, dim = 5, 2
    rng = np.random.default_rng(5)
    ids = rng.integers(0, vocab, size=(12, 3)).astype("int32")  # repeated rows
    y = rng.normal(size=(12, 1)).astype("float32")

    sparse = keras.Sequential([
        keras.Input((3,), dtype="int32"),
        keras.layers.Embedding(vocab, dim),
        keras.layers.Flatten(),
        keras.layers.Dense(1),
    ])
    dense = keras.Sequential([
        keras.Input((3, vocab)),
        keras.layers.Dense(dim, use_bias=False),
        keras.layers.Flatten(),
        keras.layers.Dense(1),
    ])
    for model in (sparse, dense):
        model.compile(loss="mse")
    dense.set_weights(sparse.get_weights())
    v = [rng.normal(size=tuple(w.shape)).astype("float32") for w in sparse.trainable_variables]
    hv_sparse = hessian_vector_product(sparse, ids, y, v)
    hv_dense = hessian_vector_product(dense, np.eye(vocab, dtype="float32")[ids], y, v)
    assert all(isinstance(t, tf.Tensor) for t in hv_sparse)
    assert [tuple(t.shape) for t in hv_sparse] == [(vocab, dim), (3 * dim, 1), (1,)]
    assert _rel(_flat(hv_sparse), _flat(hv_dense)) < 1e-5


def _bn_dropout_model():
    model = keras.Sequential([
        keras.Input((D,)),
        keras.layers.Dense(4),
        keras.layers.BatchNormalization(),
        keras.layers.Dropout(0.5),
        keras.layers.Dense(1),
    ])
    model.compile(loss="mse")
    return model


def test_batch_norm_dropout_training_flag_and_state_put_back():
    x, y = _regression_data()
    model = _bn_dropout_model()
    model.fit(x, y, epochs=1, verbose=0)  # moving statistics away from 0/1
    state = [v.numpy().copy() for v in model.non_trainable_variables]
    weights = model.get_weights()
    v = [np.ones(tuple(w.shape), "float32") for w in model.trainable_variables]

    inference = _flat(hessian_vector_product(model, x, y, v))
    first = _flat(hessian_vector_product(model, x, y, v, training=True))
    second = _flat(hessian_vector_product(model, x, y, v, training=True))
    # Batch statistics and dropout make a different Hessian; the seed state is
    # put back, so the same masks are drawn again.
    assert _rel(first, inference) > 1e-2
    np.testing.assert_array_equal(first, second)
    for before, after in zip(state, model.non_trainable_variables):
        np.testing.assert_array_equal(before, after.numpy())
    for before, after in zip(weights, model.get_weights()):
        np.testing.assert_array_equal(before, after)

    # The eigenvalue uses training=False: H from training=False products.
    size = inference.size
    columns = [
        _flat(hessian_vector_product(model, x, y, _split(np.eye(size)[i], model)))
        for i in range(size)
    ]
    h = np.stack(columns, axis=1)
    h = (h + h.T) / 2
    value = top_hessian_eigenvalue(model, (x, y), iterations=300, seed=0, tolerance=0)
    assert abs(value - _top(h)) <= 1e-4 * abs(_top(h))
    for before, after in zip(state, model.non_trainable_variables):
        np.testing.assert_array_equal(before, after.numpy())


def test_metric_trackers_untouched():
    inputs = keras.Input((D,))
    hidden = keras.layers.Dense(4, activation="tanh")(inputs)
    model = keras.Model(inputs, [keras.layers.Dense(1, name="a")(hidden),
                                 keras.layers.Dense(1, name="b")(hidden)])
    model.compile(loss=["mse", "mse"], metrics=[["mae"], ["mae"]])
    x, y = _regression_data()
    logs = model.evaluate(x, [y, y], verbose=0, return_dict=True)
    before = [v.numpy().copy() for v in model.metrics_variables]
    assert any(np.any(b != 0) for b in before)
    v = [np.ones(tuple(w.shape), "float32") for w in model.trainable_variables]
    hessian_vector_product(model, x, [y, y], v)
    top_hessian_eigenvalue(model, (x, [y, y]), iterations=3, seed=0)
    for b, var in zip(before, model.metrics_variables):
        np.testing.assert_array_equal(b, var.numpy())
    assert float(model.get_metrics_result()["loss"]) == pytest.approx(logs["loss"])


def test_mixed_precision_close_to_float32():
    x, y = _regression_data()
    reference = _tanh_regression()
    v = [np.random.default_rng(6).normal(size=tuple(w.shape)).astype("float32")
         for w in reference.trainable_variables]
    expected = _flat(hessian_vector_product(reference, x, y, v))
    keras.config.set_dtype_policy("mixed_float16")
    model = _tanh_regression()
    model.set_weights(reference.get_weights())
    hv = hessian_vector_product(model, x, y, v)
    assert all(t.dtype == tf.float32 for t in hv)
    assert _rel(_flat(hv), expected) < 1e-2


def _tanh_regression():
    model = keras.Sequential([
        keras.Input((D,)),
        keras.layers.Dense(4, activation="tanh"),
        keras.layers.Dense(1),
    ])
    model.compile(loss="mse")
    return model


def test_traced_once_and_retraced_after_compile():
    x, y = _regression_data()
    model = _linear_model()
    v = _split(np.ones(D + 1), model)
    first = _flat(hessian_vector_product(model, x, y, v))
    for _ in range(3):
        hessian_vector_product(model, x + 1.0, y, v)
    assert _FUNCTIONS[model][1].experimental_get_tracing_count() == 1
    # A new compile (a new loss) is not served by the old trace.
    model.compile(optimizer="sgd", loss="mse", loss_weights=3.0)
    np.testing.assert_allclose(
        _flat(hessian_vector_product(model, x, y, v)), 3.0 * first, rtol=1e-6
    )


def test_trainable_change_with_the_same_shapes_is_not_served_by_the_old_trace():
    x, y = _regression_data()
    a, b = keras.layers.Dense(D, name="a"), keras.layers.Dense(D, name="b")
    model = keras.Sequential([keras.Input((D,)), a, keras.layers.Activation("tanh"),
                              b, keras.layers.Dense(1)])
    a.trainable = False
    model.compile(loss="mse")
    v = [np.ones(tuple(w.shape), "float32") for w in model.trainable_variables]
    before = _flat(hessian_vector_product(model, x, y, v))
    a.trainable, b.trainable = True, False   # same shapes, other variables
    after = _flat(hessian_vector_product(model, x, y, v))
    _FUNCTIONS.pop(model)
    fresh = _flat(hessian_vector_product(model, x, y, v))
    np.testing.assert_array_equal(after, fresh)
    assert _rel(after, before) > 1e-2


def test_inside_a_custom_train_step():
    """v^T H v logged from a traced train_step equals the eager value."""
    x, y = _regression_data()

    class Probe(keras.Model):
        def train_step(self, data):
            x, y = data
            v = [tf.ones_like(w) for w in self.trainable_variables]
            hv = hessian_vector_product(self, x, y, v)
            return {"vhv": tf.add_n([tf.reduce_sum(a * b) for a, b in zip(v, hv)])}

    inputs = keras.Input((D,))
    hidden = keras.layers.Dense(4, activation="tanh")(inputs)
    model = Probe(inputs, keras.layers.Dense(1)(hidden))
    model.compile(optimizer="sgd", loss="mse")
    logs = model.fit(x, y, batch_size=N, epochs=1, verbose=0).history
    v = [np.ones(tuple(w.shape), "float32") for w in model.trainable_variables]
    eager = float(_flat(v) @ _flat(hessian_vector_product(model, x, y, v)))
    assert logs["vhv"][0] == pytest.approx(eager, rel=1e-5)


# --- The top eigenvalue ---------------------------------------------------------


def test_eigenvalue_matches_eigh_linear():
    x, y = _regression_data()
    model = _linear_model()
    expected = np.linalg.eigh(_closed_form(x))[0][-1]
    value = top_hessian_eigenvalue(model, (x, y), iterations=200, seed=0, tolerance=0)
    assert isinstance(value, float)
    assert abs(value - expected) <= 1e-5 * expected
    # The default tolerance stops early and still lands within 1e-4.
    value = top_hessian_eigenvalue(model, (x, y), iterations=200, seed=0)
    assert abs(value - expected) <= 1e-4 * expected


def test_eigenvalue_matches_eigh_tanh_network():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(16, D)).astype("float32")
    labels = rng.integers(0, 3, size=16)
    model = _tanh_net()
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    expected = _top(_tanh_net_hessian(model, x, labels))
    value = top_hessian_eigenvalue(
        model, (x, labels.astype("int32")), iterations=400, seed=0, tolerance=0
    )
    assert abs(value - expected) <= 1e-4 * abs(expected)


def test_dataset_batches_weighted_by_size_with_sample_weights():
    """Uneven batches (10, 10, 4) of weighted samples = the whole-data Hessian."""
    x, y = _regression_data()
    s = np.random.default_rng(8).uniform(0.5, 2.0, size=N).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y, s)).batch(10)
    model = _linear_model()
    expected = np.linalg.eigh(_closed_form(x, s))[0][-1]
    value = top_hessian_eigenvalue(model, dataset, iterations=200, seed=0, tolerance=0)
    assert abs(value - expected) <= 1e-5 * expected
    # An unweighted mean over batches would give another value.
    unweighted = np.mean(
        [_closed_form(x[i : i + 10], s[i : i + 10]) for i in (0, 10, 20)], axis=0
    )
    assert abs(np.linalg.eigh(unweighted)[0][-1] - expected) > 1e-2 * expected


def test_largest_magnitude_keeps_the_sign():
    """A loss with negative curvature: MSE - 3 mean(out^2), H = -2 H_mse."""

    class Subtract(keras.layers.Layer):
        def call(self, inputs):
            self.add_loss(-3.0 * keras.ops.mean(inputs**2))
            return inputs

    x, y = _regression_data()
    model = keras.Sequential([keras.Input((D,)), keras.layers.Dense(1), Subtract()])
    model.compile(loss="mse")
    expected = -2.0 * np.linalg.eigh(_closed_form(x))[0][-1]
    value = top_hessian_eigenvalue(model, (x, y), iterations=200, seed=0, tolerance=0)
    assert value < 0
    assert abs(value - expected) <= 1e-5 * abs(expected)


def test_seed_makes_it_deterministic():
    x, y = _regression_data()
    model = _tanh_regression()
    a = top_hessian_eigenvalue(model, (x, y), iterations=5, seed=3, tolerance=0)
    b = top_hessian_eigenvalue(model, (x, y), iterations=5, seed=3, tolerance=0)
    c = top_hessian_eigenvalue(model, (x, y), iterations=5, seed=4, tolerance=0)
    assert a == b
    assert a != c


# --- Errors ------------------------------------------------------------------------


def test_vector_errors():
    x, y = _regression_data()
    model = _linear_model()
    with pytest.raises(TypeError, match=r"Received: vectors=<ndarray shape=\(4,\)"):
        hessian_vector_product(model, x, y, np.ones(4))
    with pytest.raises(ValueError, match=r"one tensor per trainable variable: 2.*Received: vectors=\[.*\] \(1 tensors\)"):
        hessian_vector_product(model, x, y, [np.ones((D, 1))])
    with pytest.raises(ValueError, match=r"vectors\[1\]` must have the shape of .*\(1,\); it has \(2,\)\. Received: vectors="):
        hessian_vector_product(model, x, y, [np.ones((D, 1)), np.ones(2)])
    with pytest.raises(ValueError, match=r"vectors\[0\]"):
        hessian_vector_product(model, x, y, [np.ones((1, D)), np.ones(1)])
    with pytest.raises(TypeError, match=r"vectors\[0\]` must be numeric"):
        hessian_vector_product(model, x, y, [np.array([["a"]] * D), np.ones(1)])
    with pytest.raises(TypeError, match="Received: training='yes'"):
        hessian_vector_product(model, x, y, _split(np.ones(D + 1), model), training="yes")


def test_model_errors():
    x, y = _regression_data()
    uncompiled = keras.Sequential([keras.Input((D,)), keras.layers.Dense(1)])
    v = [np.ones((D, 1)), np.ones(1)]
    with pytest.raises(ValueError, match="must be compiled.*Received: model=<Sequential"):
        hessian_vector_product(uncompiled, x, y, v)
    with pytest.raises(ValueError, match="must be compiled"):
        top_hessian_eigenvalue(uncompiled, (x, y))
    unbuilt = keras.Sequential([keras.layers.Dense(1)])
    unbuilt.compile(loss="mse")
    with pytest.raises(ValueError, match="must be built"):
        hessian_vector_product(unbuilt, x, y, v)
    with pytest.raises(TypeError, match="must be a keras.Model"):
        hessian_vector_product(keras.layers.Dense(1), x, y, v)


def test_eigenvalue_argument_errors():
    x, y = _regression_data()
    model = _linear_model()
    with pytest.raises(TypeError, match=r"Received: data=<ndarray shape=\(24, 3\)"):
        top_hessian_eigenvalue(model, x)
    infinite = tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat()
    with pytest.raises(ValueError, match=r"finite dataset.*take\(n\).*Received: data="):
        top_hessian_eigenvalue(model, infinite)
    empty = tf.data.Dataset.from_tensor_slices((x, y)).batch(8).take(0)
    with pytest.raises(ValueError, match="no batches"):
        top_hessian_eigenvalue(model, empty)
    filtered = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda a, b: False).batch(8)
    with pytest.raises(ValueError, match="gave no samples"):
        top_hessian_eigenvalue(model, filtered)
    with pytest.raises(ValueError, match="Received: iterations=0"):
        top_hessian_eigenvalue(model, (x, y), iterations=0)
    with pytest.raises(ValueError, match="Received: tolerance=-1"):
        top_hessian_eigenvalue(model, (x, y), tolerance=-1)
    with pytest.raises(ValueError, match="Received: seed=-2"):
        top_hessian_eigenvalue(model, (x, y), seed=-2)
    with pytest.raises(ValueError, match="Received: seed=1.5"):
        top_hessian_eigenvalue(model, (x, y), seed=1.5)
