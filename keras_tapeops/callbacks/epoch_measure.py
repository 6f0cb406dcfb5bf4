"""`EpochMeasure`: the base of callbacks that measure the model every N epochs and log it."""

from __future__ import annotations

from typing import Any
from typing import TYPE_CHECKING

import keras

from keras_tapeops import second_order
from keras_tapeops import validation
from keras_tapeops.typing_aliases import Logs

if TYPE_CHECKING:
    from typing_extensions import Self


class EpochMeasure(keras.callbacks.Callback):
    """Measures one value of the model on held-out `data` every `every` epochs.

    At the end of epochs `0, every, 2 * every, ...` (0-based, counted like
    `fit`'s `epoch`, so a resumed `fit(initial_epoch=...)` keeps the schedule)
    it calls `measure()` and writes the value into the epoch logs under
    `name`, so History, the progress bar, CSVLogger and TensorBoard show it
    like a metric. `values` maps each measured epoch to its value (reset when
    training begins). A `name` the epoch logs already hold (a metric or
    another callback) raises ValueError rather than overwriting it.

    A subclass validates its own arguments, calls `super().__init__(data,
    name, every)`, implements `measure()` and `get_config()` (its constructor
    arguments, in order; `repr()` and `from_config` are built from them).

    Args:
        data: a finite `tf.data.Dataset` of `(x, y[, sample_weight])`
            batches, or a tuple `(x, y[, sample_weight])` of arrays (checked
            by `keras_tapeops.second_order`'s data rules).
        name: non-empty str, the log key.
        every: positive int, the period in epochs.

    Returns:
        A `keras.callbacks.Callback` for `fit(callbacks=[...])`.

    Example:
    ```python
    import keras, numpy as np
    from keras_tapeops.callbacks.epoch_measure import EpochMeasure

    class MeanOutput(EpochMeasure):
        def __init__(self, data, name="mean_output", every=1):
            super().__init__(data, name, every)

        def measure(self):
            return float(np.mean(self.model.predict(self.data[0], verbose=0)))

        def get_config(self):
            return {"data": self.data, "name": self.name, "every": self.every}

    x, y = np.random.rand(16, 4), np.random.rand(16, 1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    history = model.fit(x, y, epochs=3, verbose=0,
                        callbacks=[MeanOutput((x, y), every=2)])
    len(history.history["mean_output"])   # 2: epochs 0 and 2
    ```
    """

    def __init__(self, data, name, every):
        super().__init__()
        second_order._check_data(data)
        self.data = data
        self.name = validation.name(name, "name")
        self.every = validation.positive_int(every, "every")
        self.values = {}

    def measure(self) -> Any:
        """Returns the value to log for `self.model` now (a subclass implements it)."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement `measure()`, returning the value to log."
        )

    def on_train_begin(self, logs: Logs = None) -> None:
        self.values = {}

    def on_epoch_end(self, epoch: int, logs: Logs = None) -> None:
        if epoch % self.every:
            return
        if logs is not None and self.name in logs:
            raise ValueError(
                f"{type(self).__name__} cannot log under `name`={self.name!r}: the "
                "epoch logs already have that key (a metric or another callback). "
                f"Pass another name. Received: name={self.name!r}"
            )
        value = self.measure()
        self.values[epoch] = value
        if logs is not None:
            logs[self.name] = value

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Self:
        return cls(**config)

    def __repr__(self):
        config = self.get_config()
        arguments = ", ".join(
            f"{key}={second_order._describe(value) if key == 'data' else repr(value)}"
            for key, value in config.items()
        )
        return f"{type(self).__name__}({arguments})"
