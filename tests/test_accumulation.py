"""Unit tests of keras_tapeops.accumulation: splitting, options, callbacks, errors."""

import inspect

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt
from keras_tapeops import accumulation
from keras_tapeops.accumulation import splitting
from keras_tapeops import split_sizes


def dense_net(units=3, n_in=4):
    return kt.upgrade(
        keras.Sequential(
            [keras.Input((n_in,)), keras.layers.Dense(units, activation="tanh"),
             keras.layers.Dense(2)]
        )
    )


# ------------------------------------------------------------------ splitting
@pytest.mark.parametrize("n", [1, 2, 5, 7, 16, 36, 63, 64, 100])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
def test_micro_batch_sizes_properties(n, k):
    sizes = accumulation.micro_batch_sizes(n, k)
    assert sum(sizes) == n
    assert len(sizes) == min(k, n)
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes)  # small micro-batches first


def test_micro_batch_sizes_examples():
    assert accumulation.micro_batch_sizes(10, 4) == [2, 2, 3, 3]
    assert accumulation.micro_batch_sizes(64, 4) == [16] * 4
    assert accumulation.micro_batch_sizes(3, 8) == [1, 1, 1]


@pytest.mark.parametrize("n, k", [(10, 4), (64, 4), (3, 8), (16, 3), (1, 1)])
def test_equal_size_groups_cover_the_sizes_in_order(n, k):
    # The JAX micro-batch scan runs one lax.scan per group.
    groups = split_sizes.equal_size_groups(n, k)
    assert len(groups) <= 2
    sizes = [size for _, count, size in groups for _ in range(count)]
    assert sizes == accumulation.micro_batch_sizes(n, k)
    assert [start for start, _, _ in groups] == [0, groups[0][1] * groups[0][2]][: len(groups)]
    assert split_sizes.equal_size_groups(10, 4) == [(0, 2, 2), (4, 2, 3)]


@pytest.mark.parametrize("pad_empty", [False, True])
@pytest.mark.parametrize("n, k", [(10, 4), (12, 4), (3, 8), (1, 4), (9, 2)])
def test_tensor_split_matches_python_sizes_and_order(n, k, pad_empty):
    x = np.arange(n * 2, dtype="float32").reshape(n, 2)
    q, r, n_small = splitting.plan(tf.constant(n), k)
    (small,), (large,) = splitting.stack_groups(x, q, r, n_small, pad_empty)
    # Padding (for XLA) gives an empty group one unread micro-batch.
    assert large.shape[0] == (1 if pad_empty and int(r) == 0 else int(r))
    pieces = [small[i].numpy() for i in range(int(n_small))]
    pieces += [large[i].numpy() for i in range(int(r))]
    assert [len(p) for p in pieces] == accumulation.micro_batch_sizes(n, k)
    np.testing.assert_array_equal(np.concatenate(pieces), x)


# -------------------------------------------------------------- gradients
def test_micro_batch_gradients_equal_full_batch_gradients(rng):
    model = dense_net()
    model.compile(optimizer="sgd", loss="mse", micro_batches=3)
    x = rng.normal(size=(10, 4)).astype("float32")
    y = rng.normal(size=(10, 2)).astype("float32")
    sw = rng.uniform(0.1, 2.0, size=(10,)).astype("float32")
    grads, y_pred = accumulation.micro_batch_gradients(model, x, y, sw, 3)
    full, full_pred = model.batch_gradients(x, y, sw)
    for g, f in zip(grads, full):
        np.testing.assert_allclose(g.numpy(), f.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y_pred.numpy(), full_pred.numpy(), rtol=1e-6)


class BatchSizeRecorder(keras.layers.Layer):
    """Identity that records the batch size each traced training call sees."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen = []

    def call(self, x, training=None):
        if training and not isinstance(x, keras.KerasTensor):
            self.seen.append(x.shape[0])
        return x


@pytest.mark.parametrize(
    "n, static, expected",
    [(12, True, 3), (3, True, 1), (10, True, None), (12, False, None)],
)
def test_micro_batch_pass_is_traced_with_a_static_size_when_the_batch_splits_evenly(
    rng, n, static, expected
):
    # Stock Keras traces a step with the batch's static size; the micro-batch
    # pass does too when every micro-batch has the same size (batch 12 or
    # 3 with k=4), and with an unknown one otherwise (10 = 2+2+3+3, or an
    # unknown batch size). Either way the gradients are the whole batch's.
    recorder = BatchSizeRecorder()
    model = kt.upgrade(
        keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(3), keras.layers.BatchNormalization(),
             recorder, keras.layers.Dense(2)]
        )
    )
    model.compile(optimizer="sgd", loss="mse", micro_batches=4)
    x = rng.normal(size=(n, 4)).astype("float32")
    y = rng.normal(size=(n, 2)).astype("float32")

    @tf.function(input_signature=[tf.TensorSpec([n if static else None, 4]),
                                  tf.TensorSpec([n if static else None, 2])])
    def gradients(x, y):
        return accumulation.micro_batch_gradients(model, x, y, None, 4)[0]

    grads = gradients(x, y)
    assert recorder.seen == [expected]
    sizes = accumulation.micro_batch_sizes(n, 4)
    bounds = np.cumsum([0] + sizes)
    # The oracle: each micro-batch's own gradient, weighted by its share.
    oracle = None
    for start, stop in zip(bounds[:-1], bounds[1:]):
        with tf.GradientTape() as tape:
            pred = model(x[start:stop], training=True)
            loss = tf.reduce_mean(tf.square(pred - y[start:stop])) * (stop - start) / n
        part = tape.gradient(loss, model.trainable_weights)
        oracle = part if oracle is None else [a + b for a, b in zip(oracle, part)]
    for g, o in zip(grads, oracle):
        np.testing.assert_allclose(g.numpy(), o.numpy(), rtol=1e-5, atol=1e-6)


class WithUnusedLayer(kt.TapeOpsMixin, keras.Model):
    def __init__(self):
        super().__init__()
        self.embedding = keras.layers.Embedding(20, 4)
        self.flatten = keras.layers.Flatten()
        self.dense = keras.layers.Dense(1)
        # Built, but not on the output path. (A layer set as an attribute of
        # a functional model after construction is not tracked before Keras 3.15.)
        self.unused = keras.layers.Dense(1)
        self.unused.build((None, 3))

    def call(self, x):
        return self.dense(self.flatten(self.embedding(x)))


def test_micro_batch_gradients_keep_none_and_densify_sparse(rng):
    model = WithUnusedLayer()
    model.compile(optimizer="sgd", loss="mse", micro_batches=2)
    x = rng.integers(0, 20, size=(6, 3)).astype("int32")
    y = rng.normal(size=(6, 1)).astype("float32")
    grads, _ = accumulation.micro_batch_gradients(model, x, y, None, 2)
    full, _ = model.batch_gradients(x, y, None)
    assert [g is None for g in grads] == [f is None for f in full]
    assert any(g is None for g in grads)
    for g, f in zip(grads, full):
        if f is not None:
            np.testing.assert_allclose(
                g.numpy(), tf.convert_to_tensor(f).numpy(), rtol=1e-5, atol=1e-6
            )


def test_micro_batches_work_with_dict_inputs_and_outputs(rng):
    a = keras.Input((2,), name="a")
    b = keras.Input((3,), name="b")
    h = keras.layers.Concatenate()([a, b])
    outputs = {"p": keras.layers.Dense(1, name="p")(h), "q": keras.layers.Dense(2, name="q")(h)}
    model = kt.TapeOpsFunctional({"a": a, "b": b}, outputs)
    model.compile(optimizer="sgd", loss={"p": "mse", "q": "mse"}, micro_batches=3)
    x = {"a": rng.normal(size=(7, 2)).astype("float32"),
         "b": rng.normal(size=(7, 3)).astype("float32")}
    y = {"p": rng.normal(size=(7, 1)).astype("float32"),
         "q": rng.normal(size=(7, 2)).astype("float32")}
    grads, y_pred = accumulation.micro_batch_gradients(model, x, y, None, 3)
    full, full_pred = model.batch_gradients(x, y, None)
    for g, f in zip(grads, full):
        np.testing.assert_allclose(g.numpy(), f.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y_pred["q"].numpy(), full_pred["q"].numpy(), rtol=1e-6)


# ------------------------------------------------------------------ options
@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"micro_batches": 0}, ValueError, r"Received: micro_batches=0"),
        ({"micro_batches": -3}, ValueError, r"Received: micro_batches=-3"),
        ({"micro_batches": 4.0}, TypeError, r"Received: micro_batches=4.0"),
        ({"micro_batches": False}, TypeError, r"Received: micro_batches=False"),
        ({"micro_batches": None}, TypeError, r"Received: micro_batches=None"),
        ({"accumulation_steps": -1}, ValueError, r"Received: accumulation_steps=-1"),
        ({"accumulation_steps": 1.5}, TypeError, r"Received: accumulation_steps=1.5"),
        ({"accumulation_steps": True}, TypeError, r"Received: accumulation_steps=True"),
        ({"batch_norm_updates": "sometimes"}, ValueError,
         r"batch_norm_updates.*Received: batch_norm_updates='sometimes'"),
        ({"batch_norm_updates": None}, ValueError, r"Received: batch_norm_updates=None"),
    ],
)
def test_bad_accumulation_options_raise_clear_errors(kwargs, error, message):
    model = dense_net()
    with pytest.raises(error, match=message):
        model.compile(optimizer="sgd", loss="mse", **kwargs)
    assert model.tapeops_options is None  # nothing half-applied


@pytest.mark.skipif(
    "renorm" not in inspect.signature(keras.layers.BatchNormalization).parameters,
    reason="BatchNormalization(renorm=) is new in Keras 3.14",
)
def test_renorm_with_large_batch_mode_fails_at_compile_keeping_the_old_compilation(rng):
    model = kt.upgrade(
        keras.Sequential([keras.Input((4,)), keras.layers.BatchNormalization(renorm=True),
                          keras.layers.Dense(1)])
    )
    model.compile(optimizer="sgd", loss="mse")
    x = rng.normal(size=(8, 4)).astype("float32")
    with pytest.raises(ValueError, match=r"renorm=True.*Received: batch_norm_updates='large_batch'"):
        model.compile(optimizer="adam", loss="mae", micro_batches=2)
    assert model.tapeops_options.micro_batches == 1  # the previous compilation is kept
    assert isinstance(model.optimizer, keras.optimizers.SGD)
    model.compile(optimizer="sgd", loss="mse", micro_batches=2,
                  batch_norm_updates="per_micro_batch")
    model.fit(x, x[:, :1], verbose=0)  # the per-micro-batch mode accepts renorm


def test_options_round_trip_through_compile_config():
    model = dense_net()
    model.compile(optimizer="sgd", loss="mse", micro_batches=3, accumulation_steps=2,
                  batch_norm_updates="per_micro_batch")
    config = model.get_compile_config()
    assert config["batch_norm_updates"] == "per_micro_batch"
    other = dense_net()
    other.compile_from_config(config)
    options = other.tapeops_options
    assert (options.micro_batches, options.accumulation_steps, options.batch_norm_updates) == (
        3, 2, "per_micro_batch")


# ---------------------------------------------------------------- callbacks
class Marker(keras.callbacks.Callback):
    pass


def test_add_flush_callback_puts_flush_first_and_names_every_argument():
    model = dense_net()
    marker = Marker()
    x = np.zeros((4, 4), "float32")
    args, kwargs = accumulation.add_flush_callback(
        model, (x, x[:, :2], 2, 3, 0, [marker]), {"shuffle": False}
    )
    assert args == ()
    assert kwargs["batch_size"] == 2 and kwargs["epochs"] == 3 and kwargs["shuffle"] is False
    assert isinstance(kwargs["callbacks"][0], accumulation.AccumulationFlush)
    assert kwargs["callbacks"][1:] == [marker]
    # Passing the result again does not add a second flush callback.
    _, again = accumulation.add_flush_callback(model, (), kwargs)
    assert sum(isinstance(c, accumulation.AccumulationFlush) for c in again["callbacks"]) == 1


def test_callback_list_is_rejected_with_accumulation_steps():
    model = dense_net()
    model.compile(optimizer="sgd", loss="mse", accumulation_steps=2)
    x = np.zeros((4, 4), "float32")
    with pytest.raises(TypeError, match="Received: callbacks="):
        model.fit(x, x[:, :2], callbacks=keras.callbacks.CallbackList([]), verbose=0)


def test_accumulator_state_is_local_per_replica(mirrored):
    with mirrored.scope():
        model = dense_net()
        model.compile(optimizer="sgd", loss="mse", accumulation_steps=3)
    model.build_tapeops()
    acc = model.tapeops_state.accumulator
    assert len(acc.sums) == len(model.trainable_weights)
    for variable in acc.sums + [acc.samples]:
        assert variable.synchronization == tf.VariableSynchronization.ON_READ
        assert variable.aggregation == tf.VariableAggregation.SUM
    assert acc.pending_batches() == 0
    assert not acc.flush(model)  # empty window: nothing applied
    # The accumulator is not part of the model's weights (not saved).
    assert len(model.weights) == 4
