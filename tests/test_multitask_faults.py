"""task_balancing under faults (issue 28): a zero-loss task, non-finite steps.

- `kt.FAMO` with a task whose batch loss is 0 (all its sample weights 0:
  its labels are missing): the other tasks keep training, and `fit` equals a
  hand-written FAMO loop (per-task gradients from one persistent tape in a
  `tf.function`, FAMO's weights and logit update in NumPy float64, SGD),
  same initial weights and batches, 1e-6. The rule for an absent task is
  `kt.FAMO`'s documented one (weight 0, log drop 0, last positive loss kept).
- The Gramian aggregators (`MGDA`, `CAGrad`, `IMTLG`, `AlignedMTL`, `UPGrad`)
  on a non-finite step: under `kt.SkipNonFinite` with a NaN target the step
  is skipped (the weights equal a fit without that batch) and under
  `mixed_float16` with the default dynamic loss scale they skip as many
  steps as stock Keras and train on.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt
from keras_tapeops import gramian as gram
from keras_tapeops.aggregation.aligned_mtl import aligned_mtl_weights
from keras_tapeops.aggregation.cagrad import cagrad_weights
from keras_tapeops.aggregation.imtlg import imtlg_weights
from keras_tapeops.aggregation.mgda import mgda_weights
from keras_tapeops.aggregation.upgrad import upgrad_weights
from test_multi_task import numpy_adam

LR = 0.1
N = 16
BATCH = 8


def two_task_model(upgrade=True, seed=42):
    """Trunk Dense(4, tanh) and heads `a`, `b` (one unit each); fixed weights."""
    inputs = keras.Input((3,), name="x")
    trunk = keras.layers.Dense(4, activation="tanh", name="trunk")(inputs)
    outputs = {name: keras.layers.Dense(1, name=name)(trunk) for name in "ab"}
    model = keras.Model(inputs, outputs)
    if upgrade:
        model = kt.upgrade(model)
    rng = np.random.default_rng(seed)
    model.set_weights([rng.normal(scale=0.8, size=w.shape).astype("float32")
                       for w in model.get_weights()])
    return model


def two_task_data(n=N, scale_a=1.0, seed=7):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3)).astype("float32")
    ys = {
        "a": (scale_a * (rng.normal(size=(n, 1)) + 2.0 * x[:, :1])).astype("float32"),
        "b": (rng.normal(size=(n, 1)) - 2.0 * x[:, :1]).astype("float32"),
    }
    return x, ys


# ------------------------------------------------------------------- FAMO
class FamoOracle:
    """FAMO by hand: per-task losses and gradients in a `tf.function`, the rest in NumPy.

    Args:
        model: a fresh `two_task_model()` (its variables are updated).
    """

    def __init__(self, model):
        self.variables = list(model.trainable_variables)
        self.state = {"w": np.zeros(2)}
        self.previous = np.zeros(2)
        self.has_previous = False
        self.logged_weights = []
        mse = keras.losses.MeanSquaredError()

        @tf.function
        def ingredients(x, ys, weights):
            with tf.GradientTape(persistent=True) as tape:
                outputs = model(x, training=True)
                losses = [mse(ys[n], outputs[n], sample_weight=weights[n]) for n in "ab"]
            rows = []
            for loss in losses:
                grads = tape.gradient(loss, self.variables)
                rows.append([tf.zeros(v.shape) if g is None else g
                             for g, v in zip(grads, self.variables)])
            return tf.stack(losses), rows

        self.ingredients = ingredients

    def step(self, x, ys, weights):
        losses, rows = self.ingredients(x, ys, weights)
        losses = np.asarray(losses, np.float64)
        present = losses > 0
        z = np.exp(self.state["w"]) / np.exp(self.state["w"]).sum()
        inverse = np.where(present, 1.0 / (losses + 1e-8), 0.0)
        c = (z * inverse).sum()
        task_weights = z * inverse / c if c > 0 else np.zeros(2)
        self.logged_weights.append(task_weights)
        for i, variable in enumerate(self.variables):
            grad = sum(task_weights[k] * np.asarray(rows[k][i], np.float64) for k in range(2))
            variable.assign((variable.numpy() - LR * grad).astype(np.float32))
        # The logits move after the step's gradient is made.
        if self.has_previous:
            both = present & (self.previous > 0)
            delta = np.where(both, np.log(np.where(both, self.previous, 1.0) + 1e-8)
                             - np.log(np.where(both, losses, 1.0) + 1e-8), 0.0)
            numpy_adam(self.state, "w", z * (delta - z @ delta), 0.025, 1e-3)
        self.previous = np.where(present, losses, self.previous)
        self.has_previous = True

    def fit(self, x, ys, sample_weights, epochs):
        for _ in range(epochs):
            for start in range(0, len(x), BATCH):
                part = slice(start, start + BATCH)
                self.step(x[part], {n: ys[n][part] for n in "ab"},
                          {n: sample_weights[n][part] for n in "ab"})
        return [v.numpy() for v in self.variables]


def famo_fit(model, sample_weights, epochs):
    x, ys = two_task_data()
    model.compile(optimizer=keras.optimizers.SGD(LR), loss={"a": "mse", "b": "mse"},
                  task_balancing=kt.FAMO())
    return model.fit(x, ys, sample_weight=sample_weights, batch_size=BATCH,
                     epochs=epochs, shuffle=False, verbose=0)


@pytest.mark.parametrize("missing", ["always", "second_half"])
def test_famo_task_with_zero_loss_lets_the_others_train(missing):
    """Old: task a's loss 0 gave 1 / 1e-8 in c, b's weight ~1e-8 and a's
    gradient is 0, so the model stayed bit-identical (`always`). Now a is
    absent from those steps and b trains, equal to the hand-written loop.
    """
    weights_a = np.zeros(N, "float32")
    if missing == "second_half":  # batches 1, 3, 5 have labels for a; 2, 4, 6 do not
        weights_a[:BATCH] = 1.0
    sample_weights = {"a": weights_a, "b": np.ones(N, "float32")}
    epochs = 3
    model = two_task_model()
    initial = model.get_weights()
    history = famo_fit(model, sample_weights, epochs)
    oracle = FamoOracle(two_task_model())
    expected = oracle.fit(*two_task_data(), sample_weights, epochs)
    for actual, want in zip(model.get_weights(), expected):
        np.testing.assert_allclose(actual, want, rtol=1e-6, atol=1e-6)
    trunk_before, trunk_after = initial[0], model.get_weights()[0]
    assert np.abs(trunk_after - trunk_before).max() > 1e-2  # b trains the trunk
    b_kernel = model.get_layer("b").get_weights()[0]
    assert np.abs(b_kernel - initial[4]).max() > 1e-2
    for values in history.history.values():
        assert np.all(np.isfinite(values))
    # The logged weights are the oracle's (epoch means of the step weights).
    logged = np.array(oracle.logged_weights).reshape(epochs, -1, 2).mean(axis=1)
    np.testing.assert_allclose(history.history["b_weight"], logged[:, 1], rtol=1e-5)
    if missing == "always":
        np.testing.assert_allclose(history.history["a_weight"], 0.0, atol=1e-7)
        np.testing.assert_allclose(history.history["b_weight"], 1.0, rtol=1e-6)


@pytest.mark.unit
def test_famo_old_weights_stop_training_when_a_loss_is_zero():
    """Companion: the formula before the fix, `z / (c (L + 1e-8))` over every
    task, gives the present task a weight of about 1e-8 when another's loss
    is 0 (so its gradient vanishes); the fixed weights give it 1."""
    losses = np.array([0.0, 2.5])
    z = np.array([0.5, 0.5])
    shifted = losses + 1e-8
    old = z / ((z / shifted).sum() * shifted)
    assert old[1] < 1e-8
    context = type("Context", (), {})()
    context.losses = tf.constant(losses, tf.float32)
    context.state = {"logits": tf.zeros([2])}
    np.testing.assert_allclose(kt.FAMO().pass_weights(context).numpy(), [0.0, 1.0], rtol=1e-6)


# ------------------------------------------------- Gramian aggregators, NaN
WEIGHTINGS = {
    "MGDA": mgda_weights,
    "CAGrad": lambda g: cagrad_weights(g, 0.4),
    "IMTLG": imtlg_weights,
    "AlignedMTL": aligned_mtl_weights,
    "UPGrad": upgrad_weights,
}
AGGREGATORS = {
    "MGDA": lambda: kt.MGDA(shared="trunk"),
    "CAGrad": lambda: kt.CAGrad(c=0.4, shared="trunk"),
    "IMTLG": lambda: kt.IMTLG(shared="trunk"),
    "AlignedMTL": lambda: kt.AlignedMTL(shared="trunk"),
    "UPGrad": lambda: kt.UPGrad(shared="trunk"),
}


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(WEIGHTINGS))
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_weighting_of_a_non_finite_gramian_is_nan_not_a_crash(name, bad):
    """Old: the eigendecomposition (or Cholesky) raised and stopped fit."""
    gramian = np.array([[2.0, -1.0], [-1.0, bad]], "float32")
    weights = WEIGHTINGS[name](tf.constant(gramian)).numpy()
    assert weights.shape == (2,) and np.all(np.isnan(weights))
    # A finite Gramian is untouched by the guard.
    finite = tf.constant([[2.0, -1.0], [-1.0, 3.0]])
    assert np.all(np.isfinite(WEIGHTINGS[name](finite).numpy()))


@pytest.mark.unit
def test_nan_guard_passes_finite_gramians_through_unchanged():
    raw = lambda g: tf.reduce_sum(g, axis=0)  # noqa: E731
    guarded = gram.nan_unless_finite(raw)
    g = tf.constant([[1.0, 2.0], [2.0, 5.0]])
    np.testing.assert_array_equal(guarded(g).numpy(), raw(g).numpy())


def _fit_skip_non_finite(make, x, ys):
    model = two_task_model()
    model.compile(optimizer=keras.optimizers.SGD(LR), loss={"a": "mse", "b": "mse"},
                  task_balancing=make(), gradient_transforms=[kt.SkipNonFinite()])
    history = model.fit(x, ys, batch_size=4, shuffle=False, verbose=0)
    return model, history


@pytest.mark.parametrize("name", sorted(AGGREGATORS))
def test_nan_target_step_is_skipped_under_skip_non_finite(name):
    """A NaN target in batch 2 of 3: the step is skipped, so the weights equal
    the fit on batches 1 and 3 (SGD: a skipped step changes nothing)."""
    x, ys = two_task_data(n=12)
    ys["a"][5, 0] = np.nan  # batch 2 (samples 4-7)
    model, history = _fit_skip_non_finite(AGGREGATORS[name], x, ys)
    keep = np.r_[0:4, 8:12]
    reference, _ = _fit_skip_non_finite(AGGREGATORS[name], x[keep], {n: v[keep] for n, v in ys.items()})
    for actual, want in zip(model.get_weights(), reference.get_weights()):
        assert np.all(np.isfinite(actual))
        np.testing.assert_allclose(actual, want, rtol=1e-6, atol=1e-6)
    assert history.history["skipped_steps"][-1] == 1
    assert np.abs(model.get_weights()[0] - two_task_model().get_weights()[0]).max() > 1e-3


def _fit_mixed_float16(make):
    keras.config.set_dtype_policy("mixed_float16")
    try:
        x, ys = two_task_data(n=48, scale_a=10.0)
        model = two_task_model(upgrade=make is not None)
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01))
        options = {} if make is None else {"task_balancing": make()}
        model.compile(optimizer=optimizer, loss={"a": "mse", "b": "mse"}, **options)
        model.fit(x, ys, batch_size=4, shuffle=False, verbose=0)
    finally:
        keras.config.set_dtype_policy("float32")
    return model, optimizer


@pytest.mark.parametrize("name", ["MGDA", "CAGrad", "IMTLG", "AlignedMTL"])
def test_mixed_float16_default_loss_scale_skips_like_stock(name):
    """The default scale 2^15 overflows float16 on the first steps: stock
    Keras skips them and halves the scale; so must the aggregators (old: a
    crash in the eigendecomposition on the first overflow)."""
    stock, stock_optimizer = _fit_mixed_float16(None)
    ours, optimizer = _fit_mixed_float16(AGGREGATORS[name])
    steps = 48 // 4
    stock_applied = int(stock_optimizer.iterations.numpy())
    assert 0 < stock_applied < steps  # the condition: stock skips some steps and trains
    assert int(optimizer.iterations.numpy()) == stock_applied
    assert float(optimizer.dynamic_scale.numpy()) == float(stock_optimizer.dynamic_scale.numpy())
    initial = two_task_model().get_weights()
    assert all(np.all(np.isfinite(w)) for w in ours.get_weights())
    assert np.abs(ours.get_weights()[0] - initial[0]).max() > 1e-4  # training went on
