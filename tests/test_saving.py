"""model.save + keras.models.load_model restore the class, weights and options."""

import keras
import numpy as np
import pytest

import keras_tapeops as kt
from parity_utils import assert_weights_close
from parity_utils import classification_data
from parity_utils import sequential_model

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _functional():
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(8, activation="relu", name="trunk")(inputs)
    return keras.Model(inputs, keras.layers.Dense(3, name="head")(hidden), name="func")


@keras.saving.register_keras_serializable(package="tests")
class UserNet(kt.TapeOpsMixin, keras.Model):
    def __init__(self, units=8, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.hidden = keras.layers.Dense(units, activation="relu")
        self.out = keras.layers.Dense(3)

    def call(self, x):
        return self.out(self.hidden(x))

    def get_config(self):
        return {**super().get_config(), "units": self.units}


def _user_net():
    net = UserNet(units=6)
    net(np.zeros((1, 8), "float32"))
    return net


@pytest.mark.parametrize(
    "make", [lambda: kt.upgrade(sequential_model()), lambda: kt.upgrade(_functional()), _user_net],
    ids=["sequential", "functional", "subclass"],
)
def test_save_load_round_trip_and_resume(tmp_path, make):
    x, y = classification_data()
    model = make()
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2), loss=LOSS, metrics=["accuracy"],
        micro_batches=2, accumulation_steps=3,
    )
    options = model.tapeops_options
    # Train with the stock-equivalent step, then store the options to check.
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=LOSS, metrics=["accuracy"])
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    model._tapeops.micro_batches = options.micro_batches  # saved as compiled
    model._tapeops.accumulation_steps = options.accumulation_steps
    path = tmp_path / "model.keras"
    model.save(path)

    loaded = keras.models.load_model(path)
    assert type(loaded) is type(model)
    assert isinstance(loaded, kt.TapeOpsMixin)
    assert_weights_close(model, loaded, 0.0)
    assert loaded.tapeops_options.micro_batches == 2
    assert loaded.tapeops_options.accumulation_steps == 3
    np.testing.assert_allclose(
        model.predict(x, verbose=0), loaded.predict(x, verbose=0), atol=1e-6
    )
    # The optimizer state came back: resuming gives the same weights.
    for m in (model, loaded):
        m._tapeops.micro_batches = 1
        m._tapeops.accumulation_steps = 1
        m.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(model, loaded, 1e-6)
    assert int(loaded.optimizer.iterations) == int(model.optimizer.iterations)


def test_compile_config_round_trips_options():
    model = kt.upgrade(sequential_model())
    model.compile(optimizer="sgd", loss="mse", micro_batches=4)
    clone = kt.upgrade(sequential_model())
    clone.compile_from_config(model.get_compile_config())
    assert clone.tapeops_options.micro_batches == 4
    assert clone.tapeops_options.accumulation_steps == 1
    assert isinstance(clone.optimizer, keras.optimizers.SGD)


def test_uncompiled_model_saves_without_compile_config(tmp_path):
    model = kt.upgrade(sequential_model())
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert isinstance(loaded, kt.TapeOpsSequential)
    assert loaded.tapeops_options is None
