"""The tasks' Gramian taken layer by layer (`keras_tapeops.multitask.layerwise`).

- The Dense layer's Gramian, both ways (`<G_k, (A A^T) G_j>` and the
  rows), and its combination equal NumPy's rows `A^T G_k`.
- `fit` with UPGrad on a trunk that has everything the layerwise path must
  handle (a Dense on a sequence, a Dense called twice, a Dense whose kernel
  another layer also reads, a frozen kernel, a LayerNormalization) equals a
  hand-written loop that forms every task's gradient and aggregates in
  NumPy (float64); the Dense layers did go through the layerwise path, and
  a wrong combination fails the comparison.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt
import test_aggregation_reference as ref
from keras_tapeops.multitask import layerwise
from rnn_cells import DenseCell

LR = 0.1
NAMES = ("a", "b", "c")
UNITS = {"a": 1, "b": 2, "c": 1}


# ------------------------------------------------------------ one layer
class _Layer:
    """Stands for a built Dense layer: what `_KernelLayer` reads."""

    def __init__(self, p, o):
        self.kernel = tf.Variable(tf.zeros([p, o]))
        self.bias = tf.Variable(tf.zeros([o]))


@pytest.mark.unit
@pytest.mark.parametrize("ghost", [True, False])
def test_dense_gramian_and_combination_equal_numpy_rows(monkeypatch, ghost):
    rng = np.random.default_rng(0)
    n, p, k, o = 7, 5, 3, 4
    a = rng.normal(size=(n, p))
    g = rng.normal(size=(k, n, o))
    layer = _Layer(p, o)
    monkeypatch.setattr(layerwise, "ghost_is_cheaper", lambda *args: tf.constant(ghost))
    g = tf.constant(g, tf.float32)
    dense = layerwise._KernelLayer(
        layer, [layer.kernel, layer.bias], tf.constant(a, tf.float32), g, lambda m: m,
        tf.reduce_sum(g, 1),
    )
    g = g.numpy()
    rows = np.stack(  # task k's gradient: kernel A^T G_k, then bias sum_n G_k
        [np.concatenate([(a.T @ g[j]).ravel(), g[j].sum(0)]) for j in range(k)]
    )
    np.testing.assert_allclose(dense.gramian().numpy(), rows @ rows.T, rtol=1e-5, atol=1e-5)
    weights = rng.normal(size=k)
    combined = dense.combine(tf.constant(weights, tf.float32))
    expected = weights @ rows
    np.testing.assert_allclose(
        combined[id(layer.kernel)].numpy().ravel(), expected[: p * o], rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(
        combined[id(layer.bias)].numpy(), expected[p * o :], rtol=1e-5, atol=1e-5
    )


@pytest.mark.unit
def test_the_cheaper_way_follows_the_multiply_add_counts():
    # The bench's trunk (P = O = 1024, K = 8): 256 examples are cheaper as
    # (A A^T) products; a 128-feature first layer is cheaper as rows.
    assert bool(layerwise.ghost_is_cheaper(256, 1024, 8, 1024))
    assert not bool(layerwise.ghost_is_cheaper(256, 128, 8, 1024))
    assert not bool(layerwise.ghost_is_cheaper(100_000, 1024, 8, 1024))


# ------------------------------------------------------------ fit
class Tied(keras.layers.Layer):
    """`x @ source.kernel^T`: reads another layer's kernel (it keeps its rows)."""

    def __init__(self, source, **kwargs):
        super().__init__(**kwargs)
        self.source = source

    def call(self, x):
        return tf.matmul(x, self.source.kernel, transpose_b=True)


def build_model():
    inputs = keras.Input((3, 5), name="x")
    h = keras.layers.Dense(6, activation="tanh", name="trunk_seq")(inputs)  # [B, 3, 6]
    h = keras.layers.Flatten(name="flat")(h)
    h = keras.layers.LayerNormalization(name="trunk_norm")(h)
    twice = keras.layers.Dense(4, activation="tanh", name="trunk_twice")
    h = keras.layers.Concatenate(name="join")([twice(h), twice(-0.5 * h)])
    frozen = keras.layers.Dense(4, activation="tanh", name="trunk_frozen")
    h = frozen(h)
    tied_source = keras.layers.Dense(4, activation="tanh", name="trunk_tied_source")
    h = tied_source(h) + 0.1 * keras.layers.Dense(4, name="trunk_back")(
        Tied(tied_source, name="trunk_tied")(h)
    )
    outputs = {n: keras.layers.Dense(UNITS[n], name=n)(h) for n in NAMES}
    model = kt.upgrade(keras.Model(inputs, outputs))
    rng = np.random.default_rng(3)
    model.set_weights(
        [rng.normal(scale=0.7, size=w.shape).astype("float32") for w in model.get_weights()]
    )
    frozen.kernel.trainable = False
    return model


def make_data(n=16):
    rng = np.random.default_rng(11)
    x = rng.normal(size=(n, 3, 5)).astype("float32")
    ys = {name: rng.normal(size=(n, UNITS[name])).astype("float32") for name in NAMES}
    ys["a"] += 2.0 * x[:, :1, 0]
    ys["c"] -= 2.0 * x[:, :1, 0]  # pulls the trunk against task a
    sample_weight = rng.uniform(0.5, 1.5, size=(n,)).astype("float32")
    return x, ys, sample_weight


def is_shared(variable):
    return variable.path.startswith("trunk")


def oracle_fit(model, epochs=2, batch_size=8):
    """Every task's full gradient from one persistent tape; UPGrad in NumPy; SGD."""
    variables = list(model.trainable_variables)
    mse = keras.losses.MeanSquaredError()

    @tf.function
    def task_gradients(x, ys, sw):
        with tf.GradientTape(persistent=True) as tape:
            outputs = model(x, training=True)
            losses = [mse(ys[n], outputs[n], sample_weight=sw) for n in NAMES]
        return [
            tf.concat([tf.reshape(tf.zeros(v.shape) if g is None else g, [-1])
                       for g, v in zip(tape.gradient(loss, variables), variables)], 0)
            for loss in losses
        ]

    shared = np.concatenate(
        [np.full(int(np.prod(v.shape)), is_shared(v)) for v in variables]
    )
    x, ys, sw = make_data()
    for _ in range(epochs):
        for start in range(0, len(x), batch_size):
            sl = slice(start, start + batch_size)
            rows = np.stack(
                [np.asarray(r, np.float64)
                 for r in task_gradients(x[sl], {n: ys[n][sl] for n in NAMES}, sw[sl])]
            )
            grad = rows.sum(0)
            grad[shared] = ref.upgrad(rows[:, shared])
            offset = 0
            for v in variables:
                size = int(np.prod(v.shape))
                step = grad[offset : offset + size].reshape(v.shape)
                v.assign((v.numpy().astype(np.float64) - LR * step).astype(np.float32))
                offset += size
    return model.get_weights()


def upgraded_fit(model, epochs=2, batch_size=8, **options):
    x, ys, sw = make_data()
    model.compile(
        optimizer=keras.optimizers.SGD(LR),
        loss={n: "mse" for n in NAMES},
        task_balancing=kt.UPGrad(shared="trunk*"),
        **options,
    )
    model.fit(x, ys, sample_weight=sw, batch_size=batch_size, epochs=epochs, shuffle=False,
              verbose=0)
    return model.get_weights()


@pytest.fixture
def layered(monkeypatch):
    """The names of the layers whose Gramian was taken layer by layer."""
    names = []
    init = layerwise._KernelLayer.__init__

    def spy(self, layer, *args):
        names.append(layer.name)
        init(self, layer, *args)

    monkeypatch.setattr(layerwise._KernelLayer, "__init__", spy)
    return names


@pytest.mark.parametrize(
    "jit_compile, way", [(False, "cheaper"), (True, "cheaper"), (False, "ghost"), (False, "rows")]
)
def test_fit_equals_the_hand_written_loop(layered, monkeypatch, jit_compile, way):
    if way != "cheaper":  # this model's layers are cheaper as rows: force each way
        monkeypatch.setattr(
            layerwise, "ghost_is_cheaper", lambda *args: tf.constant(way == "ghost")
        )
    actual = upgraded_fit(build_model(), jit_compile=jit_compile)
    expected = oracle_fit(build_model())
    for got, want in zip(actual, expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # The Dense layers of the trunk went through the layerwise path; the one
    # whose kernel `Tied` also reads kept its rows.
    assert set(layered) == {"trunk_seq", "trunk_twice", "trunk_frozen", "trunk_back"}


def build_attention_model():
    """A trunk of MultiHeadAttention and an EinsumDense with a bias over positions."""
    inputs = keras.Input((3, 5), name="x")
    h = keras.layers.MultiHeadAttention(2, 3, name="trunk_attention")(inputs, inputs)
    h = keras.layers.EinsumDense(
        "abc,cd->abd", output_shape=(3, 4), bias_axes="bd", activation="tanh",
        name="trunk_einsum",
    )(h)
    h = keras.layers.Flatten(name="flat")(h)
    outputs = {n: keras.layers.Dense(UNITS[n], name=n)(h) for n in NAMES}
    model = kt.upgrade(keras.Model(inputs, outputs))
    rng = np.random.default_rng(5)
    model.set_weights(
        [rng.normal(scale=0.7, size=w.shape).astype("float32") for w in model.get_weights()]
    )
    return model


def test_attention_trunk_equals_the_hand_written_loop(layered):
    actual = upgraded_fit(build_attention_model())
    expected = oracle_fit(build_attention_model())
    for got, want in zip(actual, expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert set(layered) == {"query", "key", "value", "attention_output", "trunk_einsum"}


def test_a_wrong_combination_fails_the_comparison(monkeypatch):
    combine = layerwise._KernelLayer.combine

    def off_by_one_percent(self, weights):
        return {i: 1.01 * g for i, g in combine(self, weights).items()}

    monkeypatch.setattr(layerwise._KernelLayer, "combine", off_by_one_percent)
    actual = upgraded_fit(build_model())
    expected = oracle_fit(build_model())
    assert max(np.abs(a - b).max() for a, b in zip(actual, expected)) > 1e-4


def test_layerwise_and_rows_paths_train_alike():
    """The same model with the rows kept every step (the path replicas and accumulation take)."""
    by_layer = upgraded_fit(build_model())
    model = build_model()
    model.compile(optimizer=keras.optimizers.SGD(LR), loss={n: "mse" for n in NAMES},
                  task_balancing=kt.UPGrad(shared="trunk*"))
    model.tapeops_state.engine.layer_by_layer = False
    x, ys, sw = make_data()
    model.fit(x, ys, sample_weight=sw, batch_size=8, epochs=2, shuffle=False, verbose=0)
    for got, want in zip(model.get_weights(), by_layer):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _two_task_fit(build, by_layer, **options):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 4, 3)).astype("float32")
    ys = {n: rng.normal(size=(16, 1)).astype("float32") for n in ("a", "b")}
    model = build()
    model.compile(optimizer=keras.optimizers.SGD(LR), loss={"a": "mse", "b": "mse"},
                  **{"task_balancing": kt.UPGrad(shared="trunk*"), **options})
    model.tapeops_state.engine.layer_by_layer = by_layer
    history = model.fit(x, ys, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return model.get_weights(), history.history


def _two_task_model(trunk, seed, inputs_shape=(4, 3)):
    """`trunk(inputs) -> h`, then two Dense(1) heads "a" and "b"."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input(inputs_shape)
    h = trunk(inputs)
    outputs = {n: keras.layers.Dense(1, name=n)(h) for n in ("a", "b")}
    return kt.upgrade(keras.Model(inputs, outputs))


def _assert_paths_agree(build, atol=1e-5, **options):
    """Layer by layer equals the rows kept every step; returns both Histories."""
    by_layer, logs = _two_task_fit(build, True, **options)
    rows, expected = _two_task_fit(build, False, **options)
    for got, want in zip(by_layer, rows):
        np.testing.assert_allclose(got, want, rtol=atol, atol=atol)
    return logs, expected


def test_a_dense_inside_an_rnn_loop_keeps_its_rows(layered):
    """Its outputs live in the loop body's graph; the step equals the rows path."""

    def trunk(inputs):
        cell = DenseCell(5, dense_name="trunk_cell_dense")
        h = keras.layers.RNN(cell, name="trunk_rnn")(inputs)
        return keras.layers.Dense(6, activation="tanh", name="trunk_top")(h)

    _assert_paths_agree(lambda: _two_task_model(trunk, seed=1))
    assert set(layered) == {"trunk_top"}


def _time_distributed_model():
    def trunk(inputs):
        dense = keras.layers.Dense(5, activation="tanh", name="trunk_td_dense")
        h = keras.layers.TimeDistributed(dense, name="trunk_td")(inputs)
        h = keras.layers.GlobalAveragePooling1D()(h)
        return keras.layers.Dense(6, activation="tanh", name="trunk_top")(h)

    # Unknown length: TimeDistributed maps the Dense over time.
    return _two_task_model(trunk, seed=1, inputs_shape=(None, 3))


@pytest.mark.parametrize("run_eagerly", [False, True])
def test_time_distributed_dense_over_an_unknown_length(layered, run_eagerly):
    _assert_paths_agree(_time_distributed_model, run_eagerly=run_eagerly)
    assert {"trunk_td_dense", "trunk_top"} <= set(layered)


class Unused(keras.layers.Layer):
    """Calls its Dense twice and returns the first call only."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(5, activation="tanh", name="trunk_called_twice")

    def build(self, input_shape):
        self.dense.build(input_shape)

    def call(self, x):
        self.dense(2.0 * x)  # recorded, but no loss depends on it
        return self.dense(x)


def test_a_recorded_call_no_task_depends_on_keeps_the_layers_rows(layered):
    """(The guard against a call the loss bypasses: remat, custom gradients.)"""

    def trunk(inputs):
        h = Unused(name="trunk_unused")(keras.layers.Flatten()(inputs))
        return keras.layers.Dense(6, activation="tanh", name="trunk_top")(h)

    _assert_paths_agree(lambda: _two_task_model(trunk, seed=4))
    assert set(layered) == {"trunk_top"}


class OwnKernel(keras.layers.Dense):
    """Dense's own call on a kernel of its making (`kernel = v * scale`)."""

    def build(self, input_shape):
        super().build(input_shape)
        self.scale = self.add_weight(shape=(), initializer="ones", name="scale")

    @property
    def kernel(self):
        return self._kernel * self.scale


def test_a_dense_subclass_with_its_own_kernel_keeps_its_rows(layered):
    def trunk(inputs):
        h = OwnKernel(6, activation="tanh", name="trunk_own")(keras.layers.Flatten()(inputs))
        return keras.layers.Dense(5, activation="tanh", name="trunk_top")(h)

    _assert_paths_agree(lambda: _two_task_model(trunk, seed=2))
    assert set(layered) == {"trunk_top"}


def _plain_trunk():
    def trunk(inputs):
        h = keras.layers.Dense(8, activation="tanh", name="trunk_1")(inputs)
        return keras.layers.Dense(6, activation="tanh", name="trunk_2")(
            keras.layers.Flatten()(h)
        )

    return _two_task_model(trunk, seed=3)


def test_measure_conflict_logs_the_same_norms_and_cosines_layer_by_layer(layered):
    option = {"task_balancing": kt.MeasureConflict(every=2, shared="trunk*")}
    logs, expected = _assert_paths_agree(_plain_trunk, atol=1e-6, **option)
    measured = [name for name in expected if "cos" in name or "norm" in name]
    assert measured, expected
    for name in measured:
        np.testing.assert_allclose(logs[name], expected[name], rtol=1e-4, atol=1e-6)
    assert set(layered) == {"trunk_1", "trunk_2"}


def test_mixed_float16_layer_by_layer_equals_the_rows():
    keras.config.set_dtype_policy("mixed_float16")
    try:
        _assert_paths_agree(_plain_trunk, atol=2e-3)
    finally:
        keras.config.set_dtype_policy("float32")


def test_a_regularized_kernel_is_taken_layer_by_layer(layered):
    """The regularizer reads the kernel while the loss is computed: not a tied weight."""

    def trunk(inputs):
        return keras.layers.Dense(6, activation="tanh", name="trunk_regularized",
                                  kernel_regularizer=keras.regularizers.L2(0.05))(
            keras.layers.Flatten()(inputs))

    _assert_paths_agree(lambda: _two_task_model(trunk, seed=5))
    assert set(layered) == {"trunk_regularized"}
