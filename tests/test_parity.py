"""With no keras_tapeops option, training equals stock Keras (weights and History)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt
from parity_utils import assert_history_close
from parity_utils import assert_weights_close
from parity_utils import classification_data
from parity_utils import sequential_model

TOL = 1e-6
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _fit_both(stock, enabled, compile_kwargs, fit_args, fit_kwargs):
    enabled.set_weights(stock.get_weights())
    histories = []
    for model in (stock, enabled):
        model.compile(**compile_kwargs())
        histories.append(
            model.fit(*fit_args, shuffle=False, verbose=0, **fit_kwargs).history
        )
    return histories


def _sequential_case(regularizer=None, **compile_extra):
    stock = sequential_model(regularizer=regularizer)
    enabled = kt.upgrade(sequential_model(regularizer=regularizer))

    def compile_kwargs():
        return dict(
            optimizer=keras.optimizers.Adam(1e-2), loss=LOSS,
            metrics=["accuracy"], **compile_extra,
        )

    return stock, enabled, compile_kwargs


@pytest.mark.parametrize(
    "compile_extra, fit_extra",
    [
        ({}, {}),
        ({"steps_per_execution": 3}, {}),
        ({"jit_compile": True}, {}),
        ({"run_eagerly": True}, {}),
        ({}, {"class_weight": {0: 1.0, 1: 2.0, 2: 0.5}}),
        ({}, {"validation_split": 0.25}),
    ],
    ids=["plain", "steps_per_execution", "jit", "eager", "class_weight", "validation"],
)
def test_sequential_matches_stock(compile_extra, fit_extra):
    x, y = classification_data()
    stock, enabled, compile_kwargs = _sequential_case(**compile_extra)
    ha, hb = _fit_both(
        stock, enabled, compile_kwargs, (x, y),
        dict(batch_size=16, epochs=2, **fit_extra),
    )
    assert_history_close(ha, hb, TOL)
    assert_weights_close(stock, enabled, TOL)


def test_sample_weight_and_regularizer_match_stock():
    x, y = classification_data()
    sw = np.linspace(0.1, 2.0, len(x)).astype("float32")
    stock, enabled, compile_kwargs = _sequential_case(
        regularizer=keras.regularizers.L2(1e-2), weighted_metrics=["accuracy"]
    )
    ha, hb = _fit_both(
        stock, enabled, compile_kwargs, (x, y),
        dict(sample_weight=sw, batch_size=20, epochs=2),
    )
    assert_history_close(ha, hb, TOL)
    assert_weights_close(stock, enabled, TOL)


def test_parity_check_can_fail():
    """Different batches give different weights: the comparison above has teeth."""
    x, y = classification_data()
    stock, enabled, compile_kwargs = _sequential_case()
    enabled.set_weights(stock.get_weights())
    stock.compile(**compile_kwargs())
    enabled.compile(**compile_kwargs())
    stock.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    enabled.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    with pytest.raises(AssertionError):
        assert_weights_close(stock, enabled, TOL)


def _two_output_functional():
    inputs = keras.Input((8,), name="features")
    hidden = keras.layers.Dense(12, activation="tanh", name="trunk")(inputs)
    cls = keras.layers.Dense(3, name="cls")(hidden)
    reg = keras.layers.Dense(1, name="reg")(hidden)
    return keras.Model(inputs, {"cls": cls, "reg": reg}, name="two_heads")


def test_functional_two_outputs_loss_dict_matches_stock():
    x, y = classification_data()
    y_reg = x[:, :1] * 2.0
    stock = _two_output_functional()
    enabled = kt.upgrade(_two_output_functional())

    def compile_kwargs():
        return dict(
            optimizer=keras.optimizers.SGD(5e-2, momentum=0.9),
            loss={"cls": LOSS, "reg": "mse"},
            loss_weights={"cls": 1.0, "reg": 0.3},
            metrics={"cls": ["accuracy"], "reg": ["mae"]},
        )

    ha, hb = _fit_both(
        stock, enabled, compile_kwargs, (x, {"cls": y, "reg": y_reg}),
        dict(batch_size=16, epochs=2),
    )
    assert "cls_loss" in hb and "reg_mae" in hb
    assert_history_close(ha, hb, TOL)
    assert_weights_close(stock, enabled, TOL)
    for key in ("cls", "reg"):
        np.testing.assert_allclose(
            stock.predict(x, verbose=0)[key], enabled.predict(x, verbose=0)[key],
            atol=TOL,
        )


def _counting_two_output_model(base, traces):
    """`_two_output_functional` as a `base` subclass whose step records each trace."""

    class Counting(base):
        def train_step(self, data):
            traces.append(type(self).__name__)
            return super().train_step(data)

    plain = _two_output_functional()
    return Counting(plain.inputs, plain.outputs, name="two_heads")


@pytest.mark.parametrize("base, expected", [
    (keras.Model, 2),  # stock Keras builds the per-output loss trackers in the first trace
    (kt.TapeOpsMixin, 1),
], ids=["stock", "mixin"])
def test_two_output_model_step_is_traced(base, expected):
    """The mixin builds a multi-output compiled loss before the first trace: one trace.

    If Keras stops tracing twice, the stock row fails: then
    `_keras.private._build_multi_output_loss` can go.
    """
    x, y = classification_data()
    traces = []
    bases = (base,) if base is keras.Model else (base, keras.Model)
    model = _counting_two_output_model(type("Base", bases, {}), traces)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss={"cls": LOSS, "reg": "mse"})
    model.fit(x, {"cls": y, "reg": x[:, :1]}, batch_size=16, epochs=2, verbose=0)
    assert len(traces) == expected, traces


class AddLossNet(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(10, activation="relu")
        self.out = keras.layers.Dense(3)

    def call(self, x, training=False):
        h = self.hidden(x)
        self.add_loss(1e-2 * tf.reduce_mean(tf.square(h)))
        return self.out(h)


class TapeOpsAddLossNet(kt.TapeOpsMixin, AddLossNet):
    pass


def test_subclassed_model_with_add_loss_matches_stock():
    x, y = classification_data()
    stock, enabled = AddLossNet(), TapeOpsAddLossNet()
    stock(x[:2])
    enabled(x[:2])

    def compile_kwargs():
        return dict(optimizer=keras.optimizers.Adam(1e-2), loss=LOSS)

    ha, hb = _fit_both(
        stock, enabled, compile_kwargs, (x, y), dict(batch_size=32, epochs=2)
    )
    assert_history_close(ha, hb, TOL)
    assert_weights_close(stock, enabled, TOL)
    np.testing.assert_allclose(
        stock.evaluate(x, y, verbose=0), enabled.evaluate(x, y, verbose=0), atol=TOL
    )


def test_mixed_float16_matches_stock():
    keras.config.set_dtype_policy("mixed_float16")
    x, y = classification_data()
    stock, enabled, compile_kwargs = _sequential_case()
    ha, hb = _fit_both(
        stock, enabled, compile_kwargs, (x, y), dict(batch_size=16, epochs=2)
    )
    assert isinstance(enabled.optimizer, keras.optimizers.LossScaleOptimizer)
    # The logged loss is the unscaled loss (a scaled one would be ~32768x larger).
    assert hb["loss"][-1] < 10.0
    assert_history_close(ha, hb, TOL)
    assert_weights_close(stock, enabled, TOL)


def test_mirrored_strategy_matches_stock(mirrored):
    x, y = classification_data()
    with mirrored.scope():
        stock, enabled, compile_kwargs = _sequential_case()
        ha, hb = _fit_both(
            stock, enabled, compile_kwargs, (x, y), dict(batch_size=16, epochs=2)
        )
    assert_history_close(ha, hb, TOL)
    assert_weights_close(stock, enabled, TOL)


def test_evaluate_and_predict_match_stock():
    x, y = classification_data()
    stock, enabled, compile_kwargs = _sequential_case()
    enabled.set_weights(stock.get_weights())
    stock.compile(**compile_kwargs())
    enabled.compile(**compile_kwargs())
    np.testing.assert_allclose(
        stock.evaluate(x, y, batch_size=20, verbose=0),
        enabled.evaluate(x, y, batch_size=20, verbose=0),
        atol=TOL,
    )
    np.testing.assert_allclose(
        stock.predict(x, verbose=0), enabled.predict(x, verbose=0), atol=TOL
    )
    # Keras < 3.14 returns 0-d NumPy arrays here, newer Keras Python floats.
    np.testing.assert_allclose(
        stock.train_on_batch(x[:16], y[:16]),
        enabled.train_on_batch(x[:16], y[:16]),
        atol=TOL,
    )
    assert_weights_close(stock, enabled, TOL)
