"""Unit tests of ActivationPenalty and LossTerm: arguments, configs, layer lookup, values."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt
from keras_tapeops.paths import LayerTree


@keras.saving.register_keras_serializable(package="keras_tapeops_tests")
def output_mean(model, x, y, y_pred):
    return tf.reduce_mean(y_pred)


def roundtrip(term):
    config = keras.saving.serialize_keras_object(term)
    return keras.saving.deserialize_keras_object(config)


# ------------------------------------------------------------------ configs
def test_registered_under_package_name():
    assert keras.saving.get_registered_name(kt.ActivationPenalty) == (
        "keras_tapeops>ActivationPenalty"
    )
    assert keras.saving.get_registered_name(kt.LossTerm) == "keras_tapeops>LossTerm"


def test_activation_penalty_config_roundtrip():
    schedule = keras.optimizers.schedules.ExponentialDecay(1.0, 10, 0.5)
    term = kt.ActivationPenalty(
        "backbone/dense", l1=0.1, l2=0.2, name="act", in_validation=False,
        weight=schedule,
    )
    again = roundtrip(term)
    assert isinstance(again, kt.ActivationPenalty)
    assert again.get_config() == term.get_config()
    assert (again.layer, again.l1, again.l2) == ("backbone/dense", 0.1, 0.2)
    assert again.in_validation is False
    assert float(again.weight_at(10)) == pytest.approx(0.5)
    assert kt.ActivationPenalty.from_config(term.get_config()).name == "act"


def test_loss_term_config_roundtrip():
    term = kt.LossTerm(output_mean, weight=0.3, name="om")
    again = roundtrip(term)
    assert isinstance(again, kt.LossTerm)
    assert again.fn is output_mean
    assert again.get_config() == term.get_config()
    assert kt.LossTerm.from_config(term.get_config()).weight == 0.3


def test_default_names():
    assert kt.ActivationPenalty("backbone/dense", l2=1.0).name == (
        "activation_penalty_backbone_dense"
    )
    assert kt.LossTerm(output_mean).name == "output_mean"
    assert kt.LossTerm(lambda m, x, y, p: 0.0).name == "loss_term"


def test_weight_schedule_and_callable():
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay([2], [0.0, 4.0])
    term = kt.LossTerm(output_mean, weight=schedule)
    assert [float(term.weight_at(s)) for s in (0, 2, 3)] == [0.0, 0.0, 4.0]
    term = kt.ActivationPenalty("d", l2=1.0, weight=lambda step: 2.0 * step)
    assert float(term.weight_at(3)) == 6.0


# ------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"l1": -1.0}, r"`l1` must be a non-negative finite number\. Received: l1=-1\.0"),
        ({"l2": "big"}, r"Received: l2='big'"),
        ({"l2": True}, r"Received: l2=True"),
        ({"l1": float("nan")}, r"Received: l1=nan"),
        ({"l1": float("inf")}, r"Received: l1=inf"),
        ({"l2": 1e39}, r"Received: l2=1e\+39"),  # finite in float64, inf in float32
        ({}, r"needs a positive `l1` or `l2`\. Received: l1=0\.0, l2=0\.0"),
    ],
)
def test_activation_penalty_bad_coefficients(kwargs, match):
    # A wrong type is a TypeError, a wrong value a ValueError (Keras style).
    with pytest.raises((ValueError, TypeError), match=match):
        kt.ActivationPenalty("dense", **kwargs)


def test_activation_penalty_bad_layer_argument():
    with pytest.raises(TypeError, match=r"`layer` must be .*Received: layer=3"):
        kt.ActivationPenalty(3, l2=1.0)
    with pytest.raises(TypeError, match=r"Received: layer='/'"):
        kt.ActivationPenalty("/", l2=1.0)


def test_term_base_argument_errors():
    with pytest.raises(TypeError, match=r"Received: weight='heavy'"):
        kt.ActivationPenalty("d", l2=1.0, weight="heavy")
    with pytest.raises(ValueError, match=r"Received: name=''"):
        kt.LossTerm(output_mean, name="")
    with pytest.raises(TypeError, match=r"Received: in_validation='yes'"):
        kt.LossTerm(output_mean, in_validation="yes")


def test_loss_term_fn_must_be_callable():
    with pytest.raises(TypeError, match=r"`fn` must be a callable .*Received: fn=3"):
        kt.LossTerm(3)


def test_unregistered_functions_cannot_be_saved():
    def local_fn(model, x, y, y_pred):
        return 0.0

    for fn in (local_fn, lambda m, x, y, p: 0.0):
        with pytest.raises(ValueError, match=r"register_keras_serializable"):
            kt.LossTerm(fn, name="t").get_config()


def test_unserializable_callable_object_cannot_be_saved():
    class Fn:
        def __call__(self, model, x, y, y_pred):
            return 0.0

    with pytest.raises(ValueError, match=r"LossTerm 't' cannot be saved: its `fn` is not "
                                         r"registered.*Received: fn="):
        kt.LossTerm(Fn(), name="t").get_config()


# ------------------------------------------------------------ layer lookup
class Block(keras.layers.Layer):
    """A custom layer owning a sub-layer named `inner`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(2, name="inner")

    def call(self, x):
        return self.inner(x)


def nested_model():
    backbone = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(4, name="hidden"), Block(name="block")],
        name="backbone",
    )
    inputs = keras.Input((3,))
    outputs = keras.layers.Dense(2, name="hidden_head")(backbone(inputs))
    return kt.upgrade(keras.Model(inputs, outputs))


def test_find_layer_by_name_and_path():
    model = nested_model()
    tree = LayerTree(model)
    assert tree.paths() == [
        "backbone", "backbone/hidden", "backbone/block", "backbone/block/inner",
        "hidden_head",
    ]
    hidden = model.get_layer("backbone").get_layer("hidden")
    assert tree.find("backbone/hidden") is hidden
    assert tree.find("hidden") is hidden
    assert tree.find("backbone/block/inner").name == "inner"


def test_find_layer_unknown_lists_available_paths():
    model = nested_model()
    with pytest.raises(
        ValueError,
        match=r"No layer 'backbone/nope'.*Available layer paths: \['backbone', "
        r"'backbone/hidden', .*'hidden_head'\]\. Received: layer='backbone/nope'",
    ):
        kt.ActivationPenalty("backbone/nope", l2=1.0).bind(model)


def test_find_layer_ambiguous_name_asks_for_a_path():
    shared_name = keras.Sequential([keras.Input((3,)), keras.layers.Dense(3, name="d")],
                                   name="a")
    inputs = keras.Input((3,))
    outputs = keras.layers.Dense(2, name="d")(shared_name(inputs))
    model = keras.Model(inputs, outputs)
    with pytest.raises(ValueError, match=r"Several layers .* are named 'd' \(\['a/d', 'd'\]\)"):
        LayerTree(model).find("d")
    assert LayerTree(model).find("a/d") is shared_name.get_layer("d")


def test_layer_object_must_belong_to_the_model():
    model = nested_model()
    term = kt.ActivationPenalty(keras.layers.Dense(1, name="stray"), l2=1.0)
    with pytest.raises(ValueError, match=r"'stray' is not part of the model"):
        term.bind(model)
    inner = model.get_layer("backbone").get_layer("block").inner
    term = kt.ActivationPenalty(inner, l2=1.0, name="inner_l2")
    assert term.bind(model) is inner
    assert term.get_config()["layer"] == "inner"  # outside a model: its name
    with kt.selectors.paths_relative_to(model):
        assert term.get_config()["layer"] == "backbone/block/inner"


# ------------------------------------------------------------------- values
def evaluate_terms(model, terms, x, y):
    model.compile(optimizer="sgd", loss="mse", loss_terms=terms)
    return model.evaluate(x, y, batch_size=len(x), verbose=0, return_dict=True)


class TwoOutputs(keras.layers.Layer):
    def call(self, x):
        return x * 2.0, x - 1.0


def test_several_outputs_and_calls_each_count():
    x = np.random.default_rng(0).normal(size=(8, 3)).astype("float32")
    inputs = keras.Input((3,))
    shared = keras.layers.Dense(3, name="shared")
    a, b = TwoOutputs(name="two")(inputs)
    outputs = shared(shared(a) + b)
    model = kt.upgrade(keras.Model(inputs, outputs))
    logs = evaluate_terms(
        model,
        [kt.ActivationPenalty("two", l1=0.5, l2=0.25, name="two_pen"),
         kt.ActivationPenalty("shared", l2=1.0, name="shared_pen")],
        x, np.zeros((8, 3), "float32"),
    )

    def pen(t, l1, l2):
        return l1 * np.mean(np.abs(t)) + l2 * np.mean(np.square(t))

    first = shared(x * 2.0).numpy()
    second = shared(first + (x - 1.0)).numpy()
    np.testing.assert_allclose(
        logs["two_pen"], pen(x * 2.0, 0.5, 0.25) + pen(x - 1.0, 0.5, 0.25), rtol=1e-5
    )
    np.testing.assert_allclose(
        logs["shared_pen"], pen(first, 0, 1) + pen(second, 0, 1), rtol=1e-5
    )


def test_loss_term_value_and_loss_total():
    x = np.random.default_rng(1).normal(size=(8, 3)).astype("float32")
    y = np.ones((8, 2), "float32")
    model = kt.upgrade(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]))
    logs = evaluate_terms(model, [kt.LossTerm(output_mean, weight=3.0)], x, y)
    pred = model.predict(x, verbose=0)
    np.testing.assert_allclose(logs["output_mean"], 3.0 * pred.mean(), rtol=1e-5)
    np.testing.assert_allclose(
        logs["loss"], np.mean((pred - y) ** 2) + 3.0 * pred.mean(), rtol=1e-5
    )


def test_non_scalar_fn_fails_before_weight_change():
    x = np.ones((4, 3), "float32")
    model = kt.upgrade(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]))
    before = model.get_weights()
    model.compile(
        optimizer="sgd", loss="mse",
        loss_terms=[kt.LossTerm(lambda m, x, y, p: p, name="vec")],
    )
    with pytest.raises(ValueError, match=r"'vec': `fn` must return a scalar"):
        model.fit(x, np.zeros((4, 2)), verbose=0)
    for a, b in zip(model.get_weights(), before):
        np.testing.assert_array_equal(a, b)


class UnusedLayerNet(kt.TapeOpsMixin, keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.used = keras.layers.Dense(2, name="used")
        self.unused = keras.layers.Dense(2, name="unused")

    def build(self, input_shape):
        self.used.build(input_shape)
        self.unused.build(input_shape)

    def call(self, x):
        return self.used(x)


def test_layer_that_does_not_run_fails_clearly():
    model = UnusedLayerNet()
    model(np.ones((1, 3), "float32"))
    model.compile(
        optimizer="sgd", loss="mse",
        loss_terms=[kt.ActivationPenalty("unused", l2=1.0)],
    )
    with pytest.raises(ValueError, match=r"'unused' produced no floating-point output"):
        model.fit(np.ones((4, 3)), np.zeros((4, 2)), verbose=0)
