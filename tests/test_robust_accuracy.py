"""`kt.callbacks.RobustAccuracy` and `kt.attacks.evaluate_robustness` against hand computations."""

import glob
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt
from adversarial_oracle import crossentropy
from adversarial_oracle import data
from adversarial_oracle import loss_objective
from adversarial_oracle import mlp
from adversarial_oracle import oracle_attack
from adversarial_oracle import oracle_start

BATCH = 16


def attack():
    return kt.attacks.PGD(0.15, step_size=0.05, steps=4, clip=(0.0, 1.0), seed=11)


def compiled_mlp():
    model = mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss=crossentropy(),
                  weighted_metrics=["accuracy"])
    return model


def hand_robustness(model, x, y, sw, pgd):
    """PGD by hand on each batch (start keyed by the batch index), NumPy accuracy."""
    adversarial = []
    for index, start in enumerate(range(0, len(x), BATCH)):
        xb, yb = x[start:start + BATCH], y[start:start + BATCH]
        delta = oracle_start(xb.shape, pgd.epsilon, pgd.norm, pgd.seed, index)
        adversarial.append(oracle_attack(
            model, loss_objective(yb), xb, pgd.epsilon, pgd.step_size, pgd.steps,
            pgd.norm, pgd.clip, delta).numpy())
    x_adv = np.concatenate(adversarial)

    def accuracy(inputs):
        right = np.argmax(model.predict(inputs, verbose=0), axis=1) == y
        return float(np.sum(sw * right) / np.sum(sw))

    return accuracy(x), accuracy(x_adv), x_adv


def test_evaluate_robustness_equals_the_hand_computation_and_evaluate():
    x, y, sw = data(n=40)
    model = compiled_mlp()
    model.fit(x, y, batch_size=BATCH, epochs=3, verbose=0)
    result = kt.attacks.evaluate_robustness(model, (x, y, sw), attack(), batch_size=BATCH)
    clean, robust, x_adv = hand_robustness(model, x, y, sw, attack())
    assert result["accuracy"] == pytest.approx(clean, abs=1e-6)
    assert result["robust_accuracy"] == pytest.approx(robust, abs=1e-6)
    assert result["robust_accuracy"] < result["accuracy"]
    stock = model.evaluate(x, y, sample_weight=sw, batch_size=BATCH, verbose=0, return_dict=True)
    adversarial = model.evaluate(x_adv, y, sample_weight=sw, batch_size=BATCH, verbose=0,
                                 return_dict=True)
    assert result["loss"] == pytest.approx(stock["loss"], rel=1e-5)
    assert result["accuracy"] == pytest.approx(stock["accuracy"], abs=1e-6)
    assert result["robust_loss"] == pytest.approx(adversarial["loss"], rel=1e-5)
    assert result["robust_accuracy"] == pytest.approx(adversarial["accuracy"], abs=1e-6)
    # The check can fail: sample weights matter to the accuracy.
    unweighted = kt.attacks.evaluate_robustness(model, (x, y), attack(), batch_size=BATCH)
    assert unweighted["accuracy"] != pytest.approx(clean, abs=1e-6)


class Probe(keras.callbacks.Callback):
    """Records evaluate_robustness and the hand value at each epoch's end (after RobustAccuracy)."""

    def __init__(self, x, y):
        super().__init__()
        self.x, self.y = x, y
        self.library, self.hand = [], []

    def on_epoch_end(self, epoch, logs=None):
        ones = np.ones(len(self.x), "float32")
        self.library.append(kt.attacks.evaluate_robustness(
            self.model, (self.x, self.y), attack(), batch_size=BATCH)["robust_accuracy"])
        self.hand.append(hand_robustness(self.model, self.x, self.y, ones, attack())[1])


def test_callback_logs_evaluate_robustness_each_epoch(tmp_path, capsys):
    x, y, _ = data(n=48)
    model = compiled_mlp()
    robust = kt.callbacks.RobustAccuracy((x[:32], y[:32]), attack(), batch_size=BATCH)
    probe = Probe(x[:32], y[:32])
    stop = keras.callbacks.EarlyStopping(monitor="robust_accuracy", mode="max", patience=5,
                                         restore_best_weights=True)
    csv = keras.callbacks.CSVLogger(str(tmp_path / "log.csv"))
    board = keras.callbacks.TensorBoard(str(tmp_path / "board"))
    history = model.fit(x, y, batch_size=BATCH, epochs=3, verbose=2,
                        callbacks=[robust, probe, stop, csv, board]).history
    values = history["robust_accuracy"]
    assert len(values) == 3
    np.testing.assert_allclose(values, probe.library, atol=1e-7)
    np.testing.assert_allclose(values, probe.hand, atol=1e-6)
    assert robust.values == dict(enumerate(values))
    assert stop.best == max(values)
    assert "robust_accuracy:" in capsys.readouterr().out
    assert "robust_accuracy" in (tmp_path / "log.csv").read_text().splitlines()[0]
    events = glob.glob(os.path.join(str(tmp_path / "board"), "train", "events*"))
    tags = {value.tag for path in events for event in tf.compat.v1.train.summary_iterator(path)
            for value in event.summary.value}
    assert "epoch_robust_accuracy" in tags


def test_every_and_a_clashing_name():
    x, y, _ = data()
    model = compiled_mlp()
    robust = kt.callbacks.RobustAccuracy((x, y), attack(), every=2)
    history = model.fit(x, y, epochs=3, verbose=0, callbacks=[robust]).history
    assert sorted(robust.values) == [0, 2] and len(history["robust_accuracy"]) == 2
    clash = kt.callbacks.RobustAccuracy((x, y), attack(), name="loss")
    with pytest.raises(ValueError, match="Received: name='loss'"):
        model.fit(x, y, epochs=1, verbose=0, callbacks=[clash])


def test_under_mirrored_strategy_it_measures_the_trained_weights(mirrored):
    x, y, _ = data()
    with mirrored.scope():
        model = compiled_mlp()
    robust = kt.callbacks.RobustAccuracy((x, y), attack(), batch_size=BATCH)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[robust])
    ones = np.ones(len(x), "float32")
    assert robust.values[0] == pytest.approx(hand_robustness(model, x, y, ones, attack())[1],
                                             abs=1e-6)


def test_config_and_bad_arguments():
    x, y, _ = data()
    robust = kt.callbacks.RobustAccuracy((x, y), attack(), name="pgd_accuracy", batch_size=8)
    restored = kt.callbacks.RobustAccuracy.from_config(robust.get_config())
    assert restored.get_config()["attack"] is robust.attack
    assert (restored.name, restored.batch_size, restored.every) == ("pgd_accuracy", 8, 1)
    assert "PGD(" in repr(robust) and "shape=(32, 64)" in repr(robust)
    with pytest.raises(TypeError, match="Received: attack='pgd'"):
        kt.callbacks.RobustAccuracy((x, y), "pgd")
    with pytest.raises(ValueError, match="Received: batch_size=0"):
        kt.callbacks.RobustAccuracy((x, y), attack(), batch_size=0)
    with pytest.raises(ValueError, match="Received: every=0"):
        kt.callbacks.RobustAccuracy((x, y), attack(), every=0)
    with pytest.raises(ValueError, match="Received: name=''"):
        kt.callbacks.RobustAccuracy((x, y), attack(), name="")
    with pytest.raises(TypeError, match="Received: model="):
        kt.attacks.evaluate_robustness("model", (x, y), attack())
