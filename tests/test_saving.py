"""model.save + keras.models.load_model restore the class, weights and options."""

import keras
import numpy as np
import pytest

import keras_tapeops as kt
from parity_utils import assert_history_close
from parity_utils import assert_weights_close
from parity_utils import classification_data
from parity_utils import max_weight_difference
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


class StockNet(keras.Model):
    """The stock twin of UserNet (same layers, same variable order)."""

    def __init__(self, units=8, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(units, activation="relu")
        self.out = keras.layers.Dense(3)

    def call(self, x):
        return self.out(self.hidden(x))


def _built(model):
    model(np.zeros((1, 8), "float32"))
    return model


def _pair(kind):
    """(keras_tapeops model, stock twin with the same initial weights)."""
    if kind == "sequential":
        model, stock = kt.upgrade(sequential_model()), sequential_model()
    elif kind == "functional":
        model, stock = kt.upgrade(_functional()), _functional()
    else:
        model, stock = _built(UserNet(units=6)), _built(StockNet(units=6))
    stock.set_weights(model.get_weights())
    return model, stock


# 112 samples in batches of 16 = 7 batches; accumulation_steps=3 makes windows
# of 3, 3 and 1 batches (the last flushed at the epoch's end): exactly stock
# Keras with batches of 48, 48 and 16. micro_batches=2 splits each batch of 16.
N_SAMPLES, BATCH, ACCUMULATION, MICRO = 112, 16, 3, 2
OPTIONS = {"micro_batches": MICRO, "accumulation_steps": ACCUMULATION,
           "batch_norm_updates": "per_micro_batch"}


def _compile(model, **options):
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2), loss=LOSS, metrics=["accuracy"],
        **options,
    )


def _epoch(model, x, y, batch_size=BATCH):
    return model.fit(
        x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0
    ).history


@pytest.mark.parametrize("kind", ["sequential", "functional", "subclass"])
def test_save_load_round_trip_and_resume(tmp_path, kind):
    x, y = classification_data(n=N_SAMPLES)
    model, stock = _pair(kind)
    _compile(model, **OPTIONS)
    _compile(stock)
    history = _epoch(model, x, y)
    stock_history = _epoch(stock, x, y, batch_size=ACCUMULATION * BATCH)
    # The options were in force while training: stock Keras on the large batches.
    assert int(model.optimizer.iterations) == 3
    assert_weights_close(model, stock, 1e-5)
    assert_history_close(history, stock_history, 1e-5)

    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded) is type(model)
    options = loaded.tapeops_options
    assert (options.micro_batches, options.accumulation_steps,
            options.batch_norm_updates) == (MICRO, ACCUMULATION, "per_micro_batch")
    assert loaded.get_compile_config() == model.get_compile_config()
    assert_weights_close(model, loaded, 0.0)
    for a, b in zip(model.optimizer.variables, loaded.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=a.path)

    # One more epoch: the loaded model trains with the restored options and
    # optimizer state exactly like the original and like stock Keras.
    again = _epoch(model, x, y)
    loaded_again = _epoch(loaded, x, y)
    stock_again = _epoch(stock, x, y, batch_size=ACCUMULATION * BATCH)
    assert int(loaded.optimizer.iterations) == int(model.optimizer.iterations) == 6
    assert_weights_close(loaded, model, 1e-6)
    assert_history_close(loaded_again, again, 1e-6)
    assert_weights_close(loaded, stock, 1e-5)
    assert_history_close(loaded_again, stock_again, 1e-5)


def test_round_trip_comparison_can_fail():
    """Companion: without the options in force, training differs from the oracle."""
    x, y = classification_data(n=N_SAMPLES)
    model, stock = _pair("sequential")
    _compile(model)  # no options: batches of 16, 7 optimizer steps
    _compile(stock)
    _epoch(model, x, y)
    _epoch(stock, x, y, batch_size=ACCUMULATION * BATCH)
    assert max_weight_difference(model, stock) > 1e-3


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
