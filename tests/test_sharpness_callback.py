"""Sharpness: the top Hessian eigenvalue in the epoch logs during fit."""

import csv

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt
from keras_tapeops.callbacks.sharpness import Sharpness
from keras_tapeops.second_order import top_hessian_eigenvalue

D = 3


def _data(n=32):
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(n, D)) * np.array([2.0, 1.0, 0.5])).astype("float32")
    y = rng.normal(size=(n, 1)).astype("float32")
    return x, y


def _model(upgrade=False):
    model = keras.Sequential([
        keras.Input((D,)),
        keras.layers.Dense(4, activation="tanh"),
        keras.layers.Dense(1),
    ])
    if upgrade:
        model = kt.upgrade(model)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


class _WeightsAtEpochEnd(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.weights = {}

    def on_epoch_end(self, epoch, logs=None):
        self.weights[epoch] = self.model.get_weights()


@pytest.mark.parametrize("upgrade", [False, True])
def test_logged_every_two_epochs_equals_direct_call(upgrade):
    x, y = _data()
    probe = tf.data.Dataset.from_tensor_slices((x, y)).batch(10)
    model = _model(upgrade)
    sharpness = Sharpness(probe, every=2, iterations=10, seed=0)
    weights = _WeightsAtEpochEnd()
    history = model.fit(
        x, y, batch_size=8, epochs=5, verbose=0, callbacks=[sharpness, weights]
    ).history
    assert sorted(sharpness.values) == [0, 2, 4]
    assert history["sharpness"] == [sharpness.values[e] for e in (0, 2, 4)]
    assert len(history["loss"]) == 5
    for epoch, value in sharpness.values.items():
        model.set_weights(weights.weights[epoch])
        direct = top_hessian_eigenvalue(model, probe, iterations=10, seed=0)
        assert value == direct
    # Training moved the weights: the logged values differ between epochs.
    assert len(set(history["sharpness"])) == 3


def test_every_epoch_with_a_tuple_and_csv_logger(tmp_path):
    x, y = _data()
    model = _model()
    path = tmp_path / "log.csv"
    history = model.fit(
        x, y, batch_size=8, epochs=3, verbose=0,
        callbacks=[Sharpness((x[:16], y[:16]), name="top_eig", seed=1),
                   keras.callbacks.CSVLogger(str(path))],
    ).history
    assert len(history["top_eig"]) == 3
    assert all(isinstance(v, float) and v > 0 for v in history["top_eig"])
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert [float(r["top_eig"]) for r in rows] == pytest.approx(history["top_eig"])


def test_csv_logger_writes_na_between_measurements(tmp_path):
    x, y = _data()
    path = tmp_path / "log.csv"
    _model().fit(
        x, y, batch_size=8, epochs=3, verbose=0,
        callbacks=[Sharpness((x, y), every=2, iterations=3, seed=0),
                   keras.callbacks.CSVLogger(str(path))],
    )
    with open(path) as f:
        column = [r["sharpness"] for r in csv.DictReader(f)]
    assert column[1] == "NA" and column[0] != "NA" and column[2] != "NA"


def test_resumed_fit_keeps_the_schedule():
    x, y = _data()
    sharpness = Sharpness((x, y), every=2, iterations=3, seed=0)
    _model().fit(x, y, epochs=4, initial_epoch=1, verbose=0, callbacks=[sharpness])
    assert sorted(sharpness.values) == [2]


def test_state_unchanged_by_the_measurement():
    """Training with the callback equals training without it."""
    x, y = _data()
    plain, measured = _model(), _model()
    measured.set_weights(plain.get_weights())
    plain.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    measured.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                 callbacks=[Sharpness((x, y), iterations=3, seed=0)])
    for a, b in zip(plain.get_weights(), measured.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_name_clash_is_an_error():
    x, y = _data()
    with pytest.raises(ValueError, match="already have that key.*Received: name='loss'"):
        _model().fit(x, y, epochs=1, verbose=0,
                     callbacks=[Sharpness((x, y), name="loss", iterations=2)])


def test_get_config_round_trip():
    x, y = _data()
    callback = Sharpness((x, y), every=3, iterations=7, name="s", seed=5, tolerance=1e-3)
    config = callback.get_config()
    assert {k: v for k, v in config.items() if k != "data"} == {
        "every": 3, "iterations": 7, "name": "s", "seed": 5, "tolerance": 1e-3,
    }
    clone = Sharpness.from_config(config)
    assert clone.get_config() == config
    assert keras.saving.get_registered_object("keras_tapeops>Sharpness") is Sharpness
    assert repr(callback).startswith("Sharpness(data=(<ndarray shape=(32, 3)")
    # NumPy scalars become Python numbers.
    assert Sharpness((x, y), every=np.int64(2)).get_config()["every"] == 2


def test_argument_errors():
    x, y = _data()
    with pytest.raises(TypeError, match="Received: data="):
        Sharpness(x)
    with pytest.raises(ValueError, match="finite dataset"):
        Sharpness(tf.data.Dataset.from_tensor_slices((x, y)).batch(4).repeat())
    with pytest.raises(ValueError, match="Received: every=0"):
        Sharpness((x, y), every=0)
    with pytest.raises(TypeError, match="Received: every=1.5"):
        Sharpness((x, y), every=1.5)
    with pytest.raises(ValueError, match="Received: iterations=0"):
        Sharpness((x, y), iterations=0)
    with pytest.raises(ValueError, match="Received: name=''"):
        Sharpness((x, y), name="")
    with pytest.raises(ValueError, match="Received: seed=-1"):
        Sharpness((x, y), seed=-1)
    with pytest.raises(ValueError, match="Received: tolerance=nan"):
        Sharpness((x, y), tolerance=float("nan"))


def test_tensorboard_sees_it(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    x, y = _data()
    _model().fit(x, y, epochs=1, verbose=0,
                 callbacks=[Sharpness((x, y), iterations=3, seed=0),
                            keras.callbacks.TensorBoard(str(tmp_path))])
    events = EventAccumulator(str(tmp_path / "train"))
    events.Reload()
    assert "epoch_sharpness" in events.Tags()["tensors"]


def test_mirrored_model_equals_single_device(mirrored):
    """Under MirroredStrategy the callback measures on one device, whole batch."""
    x, y = _data()
    with mirrored.scope():
        distributed = _model()
    history = distributed.fit(
        x, y, batch_size=8, epochs=1, verbose=0,
        callbacks=[Sharpness((x, y), iterations=10, seed=0)],
    ).history
    single = _model()
    single.set_weights(distributed.get_weights())
    expected = top_hessian_eigenvalue(single, (x, y), iterations=10, seed=0)
    assert history["sharpness"][0] == pytest.approx(expected, rel=1e-6)
