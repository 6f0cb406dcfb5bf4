"""kt.upgrade(): same layers, weights, name, inputs and outputs; clear errors."""

import keras
import numpy as np
import pytest

import keras_tapeops as kt
from parity_utils import classification_data
from parity_utils import sequential_model


def test_upgrade_sequential_shares_layers_and_weights():
    model = sequential_model(name="my_seq")
    upgraded = kt.upgrade(model)
    assert isinstance(upgraded, kt.TapeOpsMixin)
    assert isinstance(upgraded, keras.Sequential)
    assert upgraded.name == "my_seq"
    assert all(a is b for a, b in zip(model.layers, upgraded.layers))
    assert len(upgraded.layers) == len(model.layers)
    assert upgraded.inputs[0].shape == model.inputs[0].shape
    x, _ = classification_data(n=8)
    np.testing.assert_array_equal(model.predict(x, verbose=0), upgraded.predict(x, verbose=0))
    # Shared, not copied: changing one changes the other.
    model.layers[0].kernel.assign(np.zeros(model.layers[0].kernel.shape))
    np.testing.assert_array_equal(upgraded.layers[0].kernel.numpy(), 0.0)


def test_upgrade_unbuilt_sequential():
    model = keras.Sequential([keras.layers.Dense(4), keras.layers.Dense(1)])
    upgraded = kt.upgrade(model)
    upgraded.compile(optimizer="sgd", loss="mse")
    x = np.ones((8, 3), "float32")
    upgraded.fit(x, np.ones((8, 1)), verbose=0)
    assert model.layers[0].kernel is upgraded.layers[0].kernel


def test_upgrade_functional_keeps_input_and_output_structure():
    inputs = {
        "a": keras.Input((3,), name="a"),
        "b": keras.Input((2,), name="b"),
    }
    merged = keras.layers.Concatenate()([inputs["a"], inputs["b"]])
    outputs = {"y": keras.layers.Dense(1, name="y")(merged)}
    model = keras.Model(inputs, outputs, name="dict_model")
    upgraded = kt.upgrade(model)
    assert isinstance(upgraded, kt.TapeOpsMixin)
    assert upgraded.name == "dict_model"
    assert set(upgraded.input) == {"a", "b"}
    assert set(upgraded.output) == {"y"}
    assert [w.path for w in upgraded.weights] == [w.path for w in model.weights]
    data = {"a": np.ones((4, 3), "float32"), "b": np.ones((4, 2), "float32")}
    np.testing.assert_array_equal(
        model.predict(data, verbose=0)["y"], upgraded.predict(data, verbose=0)["y"]
    )


def test_upgrade_returns_enabled_model_unchanged():
    upgraded = kt.upgrade(sequential_model())
    assert kt.upgrade(upgraded) is upgraded


def test_upgrade_keeps_trainable_flag():
    model = sequential_model()
    model.trainable = False
    assert kt.upgrade(model).trainable is False


class Plain(keras.Model):
    def __init__(self):
        super().__init__()
        self.d = keras.layers.Dense(1)

    def call(self, x):
        return self.d(x)


def test_upgrade_subclassed_model_says_to_mix_in():
    with pytest.raises(TypeError, match=r"class Plain\(kt.TapeOpsMixin, keras.Model\)"):
        kt.upgrade(Plain())


def test_upgrade_rejects_non_models():
    with pytest.raises(TypeError, match="Received: model="):
        kt.upgrade(keras.layers.Dense(3))


def test_mixin_is_not_a_keras_model():
    assert not issubclass(kt.TapeOpsMixin, keras.Model)
