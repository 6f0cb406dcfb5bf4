"""User-defined extension points train in `fit` (issue 27, docs/extending.md).

Each public base (`keras_tapeops.aggregation.Aggregator`,
`keras_tapeops.multitask.LossWeighting`, `keras_tapeops.selection.SelectionRule`)
is subclassed here as a user would, outside the library, registered under a
package of its own, trained with `fit` and compared with an oracle that does
not use the extension: stock Keras (with `loss_weights`), a hand-written
`tf.GradientTape` loop, or the built-in `kt.TopLoss`. SGD keeps the
comparisons tight (final weights within 1e-6).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt
from keras_tapeops.aggregation import Aggregator
from keras_tapeops.multitask import LossWeighting
from keras_tapeops.selection import SelectionRule

ATOL = 1e-6
PACKAGE = "test_extending"


# ------------------------------------------------------------ user classes
@keras.saving.register_keras_serializable(package=PACKAGE)
class FixedAggregator(Aggregator):
    """Rows weighted by fixed numbers (None: 1/K each)."""

    def __init__(self, values=None, shared=None, tasks=None):
        super().__init__(shared=shared, tasks=tasks)
        self.values = None if values is None else [float(v) for v in values]

    def weights(self, gramian, context):
        if self.values is None:
            k = context.num_tasks
            return tf.fill([k], 1.0 / k)
        return tf.constant(self.values, tf.float32)

    def get_config(self):
        return {**super().get_config(), "values": self.values}


@keras.saving.register_keras_serializable(package=PACKAGE)
class FixedWeighting(LossWeighting):
    """Task losses multiplied by fixed numbers."""

    def __init__(self, values, tasks=None):
        super().__init__(tasks=tasks)
        self.values = [float(v) for v in values]

    def pass_weights(self, context):
        return tf.constant(self.values, tf.float32)

    def get_config(self):
        return {**super().get_config(), "values": self.values}


@keras.saving.register_keras_serializable(package=PACKAGE)
class TopHalf(SelectionRule):
    """Weight 1 on the ceil(n * fraction) largest losses, 0 elsewhere."""

    def __init__(self, fraction=0.5):
        self.fraction = float(fraction)

    def select(self, losses, context):
        n = tf.shape(losses)[0]
        k = tf.cast(tf.math.ceil(self.fraction * tf.cast(n, tf.float32)), tf.int32)
        top = tf.math.top_k(losses, k=k).indices
        return tf.scatter_nd(top[:, None], tf.ones([k]), [n])

    def get_config(self):
        return {"fraction": self.fraction}


class NoWeights(Aggregator):
    pass


class NoPassWeights(LossWeighting):
    pass


class NoSelect(SelectionRule):
    pass


# ------------------------------------------------------------------ models
def two_task_model(upgraded=True):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((4,))
    trunk = keras.layers.Dense(6, activation="tanh", name="trunk")(inputs)
    outputs = {"a": keras.layers.Dense(1, name="a")(trunk),
               "b": keras.layers.Dense(1, name="b")(trunk)}
    model = keras.Model(inputs, outputs)
    return kt.upgrade(model) if upgraded else model


def two_task_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype("float32")
    return x, {"a": rng.normal(size=(32, 1)).astype("float32"),
               "b": (3.0 * rng.normal(size=(32, 1))).astype("float32")}


def fit_two_tasks(upgraded, **compile_kwargs):
    model = two_task_model(upgraded)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss={"a": "mse", "b": "mse"},
                  **compile_kwargs)
    x, y = two_task_data()
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return [w.numpy() if hasattr(w, "numpy") else np.asarray(w) for w in model.get_weights()]


def max_difference(a, b):
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a, b))


# ---------------------------------------------------------- the aggregator
def hand_written_aggregation(task_weights):
    """The oracle: per-task tapes; trunk gets sum_k w_k g_k, each head its own gradient."""
    model = two_task_model(upgraded=False)
    optimizer = keras.optimizers.SGD(0.05)
    x, y = two_task_data()
    trunk = model.get_layer("trunk").trainable_variables
    heads = [v for v in model.trainable_variables if all(v is not t for t in trunk)]

    @tf.function
    def step(xb, ya, yb):
        with tf.GradientTape(persistent=True) as tape:
            out = model(xb, training=True)
            la = tf.reduce_mean(tf.square(ya - out["a"]))
            lb = tf.reduce_mean(tf.square(yb - out["b"]))
            total = la + lb
        ga, gb = tape.gradient(la, trunk), tape.gradient(lb, trunk)
        trunk_grads = [task_weights[0] * a + task_weights[1] * b for a, b in zip(ga, gb)]
        head_grads = tape.gradient(total, heads)
        optimizer.apply_gradients(zip(trunk_grads + head_grads, trunk + heads))

    for _ in range(2):
        for start in range(0, len(x), 8):
            end = start + 8
            step(x[start:end], y["a"][start:end], y["b"][start:end])
    return model.get_weights()


def test_user_aggregator_of_equal_weights_equals_a_hand_written_loop():
    # Shared trunk: sum_k g_k / K; the heads keep their ordinary gradient.
    ours = fit_two_tasks(True, task_balancing=FixedAggregator(shared="trunk"))
    assert max_difference(ours, hand_written_aggregation([0.5, 0.5])) < ATOL


def test_user_aggregator_of_unit_weights_equals_the_stock_step():
    # sum_k g_k is the gradient of the total loss: stock Keras.
    ours = fit_two_tasks(True, task_balancing=FixedAggregator([1.0, 1.0], shared="trunk"))
    assert max_difference(ours, fit_two_tasks(False)) < ATOL


def test_the_aggregator_check_can_fail():
    # Weights (1, 0) drop task b from the trunk's gradient: no longer the oracle.
    ours = fit_two_tasks(True, task_balancing=FixedAggregator([1.0, 0.0], shared="trunk"))
    assert max_difference(ours, hand_written_aggregation([0.5, 0.5])) > 1e-3


def test_user_aggregator_sees_the_gramian_of_the_task_rows():
    seen = {}

    class Recording(Aggregator):
        def weights(self, gramian, context):
            seen["shape"] = tuple(gramian.shape)
            seen["k"] = context.num_tasks
            return tf.fill([context.num_tasks], 0.5)

    rows = np.array([[1.0, 2.0, 0.0], [0.0, 1.0, 3.0]], "float32")
    out = Recording(shared="trunk").aggregate(rows)
    np.testing.assert_allclose(out, rows.mean(axis=0), atol=ATOL)
    assert seen == {"shape": (2, 2), "k": 2}


# ----------------------------------------------------- the loss weighting
def test_user_loss_weighting_of_fixed_weights_equals_stock_loss_weights():
    ours = fit_two_tasks(True, task_balancing=FixedWeighting([0.3, 0.7]))
    stock = fit_two_tasks(False, loss_weights={"a": 0.3, "b": 0.7})
    assert max_difference(ours, stock) < ATOL


# ---------------------------------------------------- the selection rule
def one_output_model(upgraded=True):
    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"),
                              keras.layers.Dense(1)])
    return kt.upgrade(model) if upgraded else model


def one_output_data():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(24, 3)).astype("float32")
    return x, (x[:, :1] * 2.0 + rng.normal(size=(24, 1))).astype("float32")


def fit_selected(selection):
    model = one_output_model()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", sample_selection=selection)
    x, y = one_output_data()
    history = model.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0)
    return model.get_weights(), history.history


def hand_written_top_half():
    """The oracle: score in inference mode, step on the mean loss of the top half."""
    model = one_output_model(upgraded=False)
    optimizer = keras.optimizers.SGD(0.1)
    x, y = one_output_data()

    @tf.function
    def step(xb, yb):
        losses = tf.reduce_mean(tf.square(yb - model(xb, training=False)), axis=-1)
        k = (tf.shape(losses)[0] + 1) // 2
        kept = tf.sort(tf.math.top_k(losses, k=k).indices)
        xk, yk = tf.gather(xb, kept), tf.gather(yb, kept)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(yk - model(xk, training=True)))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    for _ in range(2):
        for start in range(0, len(x), 6):
            step(x[start:start + 6], y[start:start + 6])
    return model.get_weights()


def test_user_selection_of_the_top_half_equals_a_hand_written_loop_and_top_loss():
    ours, history = fit_selected(TopHalf(0.5))
    assert max_difference(ours, hand_written_top_half()) < ATOL
    builtin, builtin_history = fit_selected(kt.TopLoss(0.5))
    assert max_difference(ours, builtin) < ATOL
    np.testing.assert_allclose(history["selection_fraction"], [0.5, 0.5], atol=ATOL)
    np.testing.assert_allclose(history["loss"], builtin_history["loss"], rtol=1e-6)


def test_the_selection_check_can_fail():
    ours, _ = fit_selected(TopHalf(1.0))  # every example: the stock step
    assert max_difference(ours, hand_written_top_half()) > 1e-3


def test_user_selection_rule_with_weights_one_everywhere_is_the_stock_step():
    class Everyone(SelectionRule):
        def select(self, losses, context):
            return tf.ones_like(losses)

    ours, _ = fit_selected(Everyone())
    stock = one_output_model(upgraded=False)
    stock.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x, y = one_output_data()
    stock.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0)
    assert max_difference(ours, stock.get_weights()) < ATOL


def test_user_selection_weights_multiply_the_sample_weights():
    # Weight 2 on every example equals stock Keras with sample weights of 2.
    class Double(SelectionRule):
        def select(self, losses, context):
            return 2.0 * tf.ones_like(losses)

    ours, _ = fit_selected(Double())
    stock = one_output_model(upgraded=False)
    stock.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x, y = one_output_data()
    stock.fit(x, y, sample_weight=np.full(len(x), 2.0, "float32"), batch_size=6, epochs=2,
              shuffle=False, verbose=0)
    assert max_difference(ours, stock.get_weights()) < ATOL


def test_user_selection_rule_under_jit_compile_equals_top_loss():
    def fit(selection):
        model = one_output_model()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse",
                      sample_selection=selection, jit_compile=True)
        x, y = one_output_data()
        model.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0)
        return model.get_weights()

    assert max_difference(fit(TopHalf(0.5)), fit(kt.TopLoss(0.5))) < ATOL


# ---------------------------------------------------------------- saving
@pytest.mark.parametrize("make, model_kind", [
    (lambda: FixedAggregator([0.25, 0.75], shared="trunk"), "two"),
    (lambda: FixedWeighting([0.3, 0.7], tasks=["a", "b"]), "two"),
    (lambda: TopHalf(0.25), "one"),
], ids=["aggregator", "loss_weighting", "selection_rule"])
def test_user_class_round_trips_through_save_and_load(make, model_kind, tmp_path):
    option = make()
    again = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(option))
    assert type(again) is type(option) and again.get_config() == option.get_config()

    if model_kind == "two":
        model = two_task_model()
        model.compile(optimizer="sgd", loss={"a": "mse", "b": "mse"}, task_balancing=option)
        name = "task_balancing"
    else:
        model = one_output_model()
        model.compile(optimizer="sgd", loss="mse", sample_selection=option)
        name = "sample_selection"
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    restored = getattr(loaded.tapeops_options, name)
    assert type(restored) is type(option)
    assert restored.get_config() == option.get_config()


# ------------------------------------------------------------- bad input
@pytest.mark.parametrize("option, argument, method", [
    (NoWeights(shared="trunk"), "task_balancing", "weights(gramian, context)"),
    (NoPassWeights(), "task_balancing", "pass_weights(context)"),
    (NoSelect(), "sample_selection", "select(losses, context)"),
], ids=["aggregator", "loss_weighting", "selection_rule"])
def test_a_subclass_missing_its_method_is_refused_at_compile(option, argument, method):
    if argument == "task_balancing":
        model = two_task_model()
        loss = {"a": "mse", "b": "mse"}
    else:
        model = one_output_model()
        loss = "mse"
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(TypeError) as info:
        model.compile(optimizer="sgd", loss=loss, **{argument: option})
    message = str(info.value)
    assert type(option).__name__ in message and method in message and "Received:" in message
    assert max_difference(model.get_weights(), before) == 0.0


def test_a_selection_rule_returning_the_wrong_shape_names_the_method():
    class Scalar(SelectionRule):
        def select(self, losses, context):
            return tf.reduce_mean(losses)

    model = one_output_model()
    model.compile(optimizer="sgd", loss="mse", sample_selection=Scalar())
    x, y = one_output_data()
    with pytest.raises(ValueError, match=r"Scalar\.select\(losses, context\) must return"):
        model.fit(x, y, batch_size=6, epochs=1, verbose=0)


def test_unregistered_user_class_is_refused_at_save_time(tmp_path):
    class Local(SelectionRule):
        def select(self, losses, context):
            return tf.ones_like(losses)

    model = one_output_model()
    model.compile(optimizer="sgd", loss="mse", sample_selection=Local())
    with pytest.raises(ValueError, match="register_keras_serializable"):
        model.save(str(tmp_path / "m.keras"))
