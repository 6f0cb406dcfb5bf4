"""Stock callbacks run unchanged on an upgraded model and behave as on stock."""

import os

import keras
import numpy as np
import pytest

import keras_tapeops as kt
from parity_utils import assert_history_close
from parity_utils import assert_weights_close
from parity_utils import classification_data
from parity_utils import sequential_model

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _pair():
    stock = sequential_model()
    enabled = kt.upgrade(sequential_model())
    enabled.set_weights(stock.get_weights())
    for model in (stock, enabled):
        model.compile(optimizer=keras.optimizers.Adam(5e-2), loss=LOSS)
    return stock, enabled


def test_early_stopping_modelcheckpoint_tensorboard(tmp_path):
    x, y = classification_data()
    histories = []
    for tag, model in zip(("stock", "enabled"), _pair()):
        callbacks = [
            keras.callbacks.EarlyStopping(monitor="val_loss", patience=0, min_delta=10.0),
            keras.callbacks.ModelCheckpoint(tmp_path / f"{tag}.keras"),
            keras.callbacks.TensorBoard(log_dir=str(tmp_path / f"logs_{tag}")),
        ]
        histories.append(
            model.fit(
                x, y, validation_split=0.25, batch_size=16, epochs=5,
                shuffle=False, verbose=0, callbacks=callbacks,
            ).history
        )
    # min_delta=10 means no epoch "improves": both stop after patience runs out.
    assert len(histories[0]["loss"]) == len(histories[1]["loss"]) < 5
    assert_history_close(*histories, atol=1e-6)
    restored = keras.models.load_model(tmp_path / "enabled.keras")
    assert isinstance(restored, kt.TapeOpsSequential)
    assert os.listdir(tmp_path / "logs_enabled" / "train")


class _StopAtEpoch(keras.callbacks.Callback):
    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError("interrupted")


def test_backup_and_restore_resumes_like_stock(tmp_path):
    x, y = classification_data()
    for tag, model in zip(("stock", "enabled"), _pair()):
        backup = keras.callbacks.BackupAndRestore(str(tmp_path / tag))
        with pytest.raises(RuntimeError, match="interrupted"):
            model.fit(
                x, y, batch_size=16, epochs=3, shuffle=False, verbose=0,
                callbacks=[backup, _StopAtEpoch(2)],
            )
        history = model.fit(
            x, y, batch_size=16, epochs=3, shuffle=False, verbose=0,
            callbacks=[keras.callbacks.BackupAndRestore(str(tmp_path / tag))],
        ).history
        assert len(history["loss"]) == 1  # resumed at the third epoch
        if tag == "stock":
            stock = model
    assert_weights_close(stock, model, 1e-6)
