"""`Sharpness`: logs the top Hessian eigenvalue of the loss during `fit`."""

from __future__ import annotations

from typing import Any

from keras_tapeops import second_order
from keras_tapeops import validation
from keras_tapeops.callbacks.epoch_measure import EpochMeasure
from keras_tapeops.registration import register
from keras_tapeops.typing_aliases import Data


@register
class Sharpness(EpochMeasure):
    """Logs the loss Hessian's largest-magnitude eigenvalue every `every` epochs.

    At the end of epochs `0, every, 2 * every, ...` (0-based, counted like
    `fit`'s `epoch` and Keras's TensorBoard `histogram_freq`, so a resumed
    `fit(initial_epoch=...)` keeps the schedule) it runs
    `kt.top_hessian_eigenvalue(model, data, iterations, seed, tolerance)` and
    writes the value into the epoch logs under `name`. History, the progress
    bar, CSVLogger and TensorBoard see it like a metric; History's list holds
    one value per measured epoch (`callback.values` maps epoch -> value).
    Because epoch 0 is always measured, CSVLogger adds the column from the
    first epoch and writes "NA" for the epochs in between.

    The measurement uses `training=False` (BatchNormalization's moving
    statistics, no dropout) and changes nothing in the model. Its cost is
    about `2 * iterations` passes over `data`; use a small, fixed sample.

    Args:
        data: a finite `tf.data.Dataset` of `(x, y[, sample_weight])` batches
            giving the same batches each time, or a tuple
            `(x, y[, sample_weight])` used as one batch.
        every: positive int, the period in epochs.
        iterations: positive int, power iterations per measurement.
        name: non-empty str, the log key.
        seed: None or a non-negative int for the random start vector (the
            same start at every measurement).
        tolerance: non-negative number, the early-stopping tolerance of the
            power iteration (see `kt.top_hessian_eigenvalue`).

    Example:
    ```python
    probe = val_ds.take(4)
    history = model.fit(train_ds, epochs=10,
                        callbacks=[kt.callbacks.Sharpness(probe, every=2, seed=0)])
    history.history["sharpness"]   # epochs 0, 2, 4, 6, 8
    ```
    """

    def __init__(
        self,
        data: Data,
        every: int = 1,
        iterations: int = 20,
        name: str = "sharpness",
        seed: int | None = None,
        tolerance: float = 1e-4,
    ) -> None:
        super().__init__(data, name, every)
        self.iterations = validation.positive_int(iterations, "iterations")
        self.seed = second_order._check_seed(seed)
        self.tolerance = validation.non_negative_number(tolerance, "tolerance")

    def measure(self) -> float:
        """Returns `kt.top_hessian_eigenvalue` of the model's loss on `data`."""
        return second_order.top_hessian_eigenvalue(
            self.model,
            self.data,
            iterations=self.iterations,
            seed=self.seed,
            tolerance=self.tolerance,
        )

    def get_config(self) -> dict[str, Any]:
        """The arguments; `data` is held by reference (not JSON-serializable)."""
        return {
            "data": self.data,
            "every": self.every,
            "iterations": self.iterations,
            "name": self.name,
            "seed": self.seed,
            "tolerance": self.tolerance,
        }
