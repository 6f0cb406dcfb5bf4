"""`kt.SelfPaced`: self-paced learning, hard weights by a loss threshold (Kumar et al. 2010)."""

from __future__ import annotations

from typing import Any
from typing import TYPE_CHECKING

import keras
import tensorflow as tf

from keras_tapeops import validation
from keras_tapeops.paths import LayerTree
from keras_tapeops.registration import register
from keras_tapeops.selection.base import SelectionOption
from keras_tapeops.selection.base import SelectionState

if TYPE_CHECKING:
    from typing_extensions import Self


@register
class SelfPaced(SelectionOption):
    """Trains on the examples whose loss is below a threshold (weights 0 or 1).

    Each example's sample weight is multiplied by v_i = 1 if loss_i < lambda
    else 0 (the closed-form minimizer of self-paced learning's
    sum(v_i loss_i) - lambda sum(v_i) for fixed weights). The loss stays
    divided by the whole batch size (the compiled reduction), so a batch with
    no easy example takes no step. Raise lambda over training (a schedule, or
    `kt.callbacks.SelectionSchedule`) to admit harder examples: the
    curriculum.

    Args:
        threshold_schedule: lambda: a positive number (the engine holds it,
            `kt.callbacks.SelectionSchedule` changes it per epoch) or a
            `keras.optimizers.schedules.LearningRateSchedule` of the
            optimizer step.

    Returns:
        An option for `compile(sample_selection=...)`.

    Example:
    ```python
    import keras, numpy as np, keras_tapeops as kt
    model = kt.upgrade(keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]))
    model.compile(optimizer="sgd", loss="mse",
                  sample_selection=kt.SelfPaced(threshold_schedule=1.0))
    model.fit(np.random.rand(16, 4), np.zeros((16, 1)), batch_size=8, verbose=0)
    ```
    """

    def __init__(
        self, threshold_schedule: float | keras.optimizers.schedules.LearningRateSchedule = 1.0
    ) -> None:
        if isinstance(threshold_schedule, keras.optimizers.schedules.LearningRateSchedule):
            self.threshold_schedule = threshold_schedule
        else:
            self.threshold_schedule = validation.positive_number(
                threshold_schedule, "threshold_schedule"
            )

    def bind(self, model: keras.Model, tree: LayerTree) -> SelfPacedState:
        return SelfPacedState(self.threshold_schedule)

    def get_config(self) -> dict[str, Any]:
        value = self.threshold_schedule
        if not isinstance(value, float):
            value = keras.saving.serialize_keras_object(value)
        return {"threshold_schedule": value}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Self:
        value = config["threshold_schedule"]
        if isinstance(value, dict):
            value = keras.saving.deserialize_keras_object(value)
        return cls(threshold_schedule=value)


class SelfPacedState(SelectionState):
    def __init__(self, threshold):
        self.schedule = None
        if isinstance(threshold, float):
            super().__init__(threshold, value_name="threshold")
        else:
            super().__init__(None, value_name="threshold")
            self.schedule = threshold

    def threshold(self, model):
        if self.schedule is None:
            return self.schedule_variable.read_value()
        return tf.cast(self.schedule(model.optimizer.iterations), "float32")

    def select(self, model, x, y, sample_weight, losses, ids, y_pred):
        return None, tf.cast(losses < self.threshold(model), "float32")
