"""`kt.callbacks.SelectionSchedule`: change the kept fraction or the threshold per epoch."""

from __future__ import annotations

from typing import Any
from typing import Callable

import keras

from keras_tapeops import validation
from keras_tapeops.selection.base import SelectionState
from keras_tapeops.selection.base import fraction_argument
from keras_tapeops.typing_aliases import Logs


class SelectionSchedule(keras.callbacks.Callback):
    """Sets the selection's fraction (or self-paced threshold) at each epoch's start.

    Options are immutable configuration; the value in use lives in the
    model's selection engine (`model.tapeops_state.engine.schedule_variable`,
    saved with the model's training state). This callback assigns
    `schedule(epoch)` to it before each epoch: a curriculum, e.g. start with
    all examples and keep fewer as training goes, or raise `kt.SelfPaced`'s
    threshold to admit harder examples. The value is logged as
    `selection_schedule`.

    Args:
        schedule: a callable `epoch (int, from 0) -> value`: the fraction kept
            (in (0, 1]) for `kt.TopLoss`, `kt.ReducibleLoss`,
            `kt.SelectiveBackprop`, `kt.ImportanceSampling`; the threshold
            (> 0) for `kt.SelfPaced` given as a number.
        verbose: 1 prints the value at each change.

    Example:
    ```python
    import keras, numpy as np, keras_tapeops as kt
    model = kt.upgrade(keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]))
    model.compile(optimizer="sgd", loss="mse", sample_selection=kt.TopLoss(fraction=1.0))
    schedule = kt.callbacks.SelectionSchedule(lambda epoch: max(0.25, 1.0 - 0.25 * epoch))
    model.fit(np.random.rand(16, 4), np.zeros((16, 1)), batch_size=8, epochs=3,
              callbacks=[schedule], verbose=0)
    ```
    """

    def __init__(self, schedule: Callable[[int], Any], verbose: int = 0) -> None:
        super().__init__()
        if not callable(schedule):
            raise TypeError(
                f"`schedule` must be a callable epoch -> value. Received: schedule={schedule!r}"
            )
        self.schedule = schedule
        self.verbose = verbose
        self._value = None

    def _engine(self):
        state = getattr(self.model, "tapeops_state", None)
        engine = getattr(state, "engine", None)
        if not isinstance(engine, SelectionState) or engine.schedule_variable is None:
            option = getattr(getattr(self.model, "tapeops_options", None), "sample_selection", None)
            raise ValueError(
                "SelectionSchedule needs a model compiled with a sample_selection "
                "whose fraction or threshold is a number (kt.TopLoss, kt.ReducibleLoss, "
                "kt.SelectiveBackprop, kt.ImportanceSampling, kt.SelfPaced(<number>)). "
                f"Received: sample_selection={option!r}"
            )
        return engine

    def on_epoch_begin(self, epoch: int, logs: Logs = None) -> None:
        engine = self._engine()
        value = self.schedule(epoch)
        if engine.value_name == "fraction":
            value = fraction_argument(value, "schedule(epoch)")
        else:
            value = validation.positive_number(value, "schedule(epoch)")
        if value != self._value and self.verbose:
            print(f"\nEpoch {epoch + 1}: SelectionSchedule sets {engine.value_name} to {value}.")
        engine.schedule_variable.assign(value)
        self._value = value

    def on_epoch_end(self, epoch: int, logs: Logs = None) -> None:
        if logs is not None and self._value is not None:
            logs["selection_schedule"] = self._value
