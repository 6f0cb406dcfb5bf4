"""Dynamic weight average (Liu, Johns & Davison, 2019, MTAN).

From the third epoch on, task `k`'s loss weight is
`K softmax_k(r / T)` with `r_k = L_k(e-1) / L_k(e-2)`, the ratio of its mean
training loss over the last two epochs (a task whose loss stalls gets more
weight); the first two epochs use weight 1. As the reference code (the
official MTAN code and LibMTL), `L_k(e)` is the task's mean training loss
over epoch `e`. An epoch is `fit()`'s epoch (see `epochs`); the weights are
constant within an epoch, so accumulation steps equal the large batch.
"""

from __future__ import annotations

from typing import Any
from typing import Sequence

import tensorflow as tf

from keras_tapeops import validation
from keras_tapeops.multitask.context import StepContext
from keras_tapeops.multitask.option import TaskBalancing
from keras_tapeops.registration import register


@register
class DWA(TaskBalancing):
    """Dynamic weight average of the task losses.

    Args:
        temperature: the softmax temperature `T` (the paper uses 2).
        tasks: None or the output names that are tasks.

    Example:
    ```python
    kt.DWA(temperature=2.0)
    ```
    """

    kind = "weighting"
    takes_shared = False
    needs_epochs = True

    def __init__(self, temperature: float = 2.0, tasks: Sequence[str] | None = None) -> None:
        super().__init__(tasks=tasks)
        self.temperature = validation.positive_number(temperature, "temperature")

    def pass_weights(self, context: StepContext) -> tf.Tensor:
        epochs = context.epochs
        k = context.num_tasks
        before = tf.convert_to_tensor(epochs.before_last)
        ratio = tf.convert_to_tensor(epochs.last) / tf.where(before > 0.0, before, 1.0)
        weights = k * tf.nn.softmax(ratio / self.temperature)
        return tf.where(tf.convert_to_tensor(epochs.completed) >= 2.0, weights, tf.ones([k]))

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "temperature": self.temperature}
