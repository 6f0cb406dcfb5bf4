"""Uncertainty weighting (Kendall, Gal & Cipolla, 2018).

Each task `k` has a learned log-variance `s_k`; the loss is
`sum_k L_k / (2 exp(s_k)) + s_k / 2`, so the tasks' gradient weights are
`1 / (2 exp(s_k))`. We follow the reference code (LibMTL's `UW`): one
formula for every task (the paper halves only regression tasks) and
`s_k = -0.5` at the start.

The log-variances are engine variables (training state saved with the model
and by `BackupAndRestore`, not model weights), stepped once per applied
optimizer step by Adam (`learning_rate`, PyTorch's defaults otherwise) along
`d/ds_k = 1/2 - L_k / (2 exp(s_k))`, `L_k` the step's mean task loss (with
accumulation, the large batch's: the step equals the large-batch step).
"""

from __future__ import annotations

from typing import Any
from typing import Sequence
from typing import cast

import numpy as np
import tensorflow as tf

from keras_tapeops import validation
from keras_tapeops.multitask import learned
from keras_tapeops.multitask.context import StepContext
from keras_tapeops.multitask.option import TaskBalancing
from keras_tapeops.registration import register


@register
class UncertaintyWeighting(TaskBalancing):
    """Learned per-task loss weights `1 / (2 exp(s_k))` (homoscedastic uncertainty).

    Args:
        tasks: None or the output names that are tasks.
        learning_rate: Adam's learning rate for the log-variances.
        initial_log_variance: `s_k` at the start (LibMTL: -0.5).

    Example:
    ```python
    inputs = keras.Input((8,))
    features = keras.Sequential([keras.layers.Dense(16, activation="relu")], name="trunk")(inputs)
    model = kt.upgrade(keras.Model(inputs, {"a": keras.layers.Dense(1, name="a")(features),
                                            "b": keras.layers.Dense(1, name="b")(features)}))
    model.compile(optimizer="adam", loss={"a": "mse", "b": "mse"},
                  task_balancing=kt.UncertaintyWeighting())
    ```
    """

    kind = "weighting"
    takes_shared = False

    def __init__(
        self,
        tasks: Sequence[str] | None = None,
        learning_rate: float = 0.01,
        initial_log_variance: float = -0.5,
    ) -> None:
        super().__init__(tasks=tasks)
        self.learning_rate = validation.positive_number(learning_rate, "learning_rate")
        self.initial_log_variance = validation.finite_number(
            initial_log_variance, "initial_log_variance"
        )

    def initial_state(self, num_tasks: int) -> dict[str, np.ndarray]:
        return {
            "log_variance": np.full([num_tasks], self.initial_log_variance, "float32"),
            **learned.adam_state("log_variance", num_tasks),
        }

    def pass_weights(self, context: StepContext) -> tf.Tensor:
        return 0.5 * tf.exp(-tf.convert_to_tensor(context.state["log_variance"]))

    def update(self, context: StepContext, gramian: tf.Tensor | None = None) -> None:
        s = tf.convert_to_tensor(context.state["log_variance"])
        losses = cast(tf.Tensor, context.losses)  # set on every applied step
        grad = 0.5 - 0.5 * losses * tf.exp(-s)
        finite = tf.reduce_all(tf.math.is_finite(grad))
        # A task whose loss is exactly 0 (no labelled example in the batch)
        # does not pull its log-variance down; an empty batch moves nothing.
        present = tf.not_equal(context.losses, 0.0)
        grad = tf.where(present, grad, 0.0)
        learned.adam_step(
            context.state,
            "log_variance",
            tf.where(finite, grad, 0.0),
            self.learning_rate,
            apply=tf.logical_and(finite, tf.reduce_any(present)),
        )

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "learning_rate": self.learning_rate,
            "initial_log_variance": self.initial_log_variance,
        }
