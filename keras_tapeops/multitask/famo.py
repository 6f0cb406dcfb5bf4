"""FAMO (Liu et al., 2023, "FAMO: Fast Adaptive Multitask Optimization").

One backward pass per step of `sum_k z_k log(L_k) / c` (`z = softmax(w)`,
`c = sum_k z_k / L_k`, held constant), i.e. the task weights
`z_k / (c L_k)`; the logits `w` then move (Adam with weight decay, as the
reference code) along `J_softmax^T delta`, `delta_k` the drop of
`log L_k` from one step to the next, so tasks that improve slowly gain
weight. As in the reference code (official FAMO and LibMTL) the minimum
losses are 0 and 1e-8 is added inside the logs; losses must be positive.

A task whose batch loss is 0 or negative (e.g. all its sample weights are
0 because its labels are missing from the batch) is absent from that step:
its weight is 0 and the others are computed from the present tasks alone
(`z_k / (c L_k)` with `c` summed over them), and the logits move only on
the log drops of tasks present at both steps (an absent task's drop is 0;
it keeps its last positive loss as its previous one). Without this, its
`1 / (L_k + 1e-8) = 1e8` would dominate `c` and zero every other task's
weight, stopping all training.

Difference from the reference code: it runs a second forward pass on the
same batch after the update to measure `delta`; here `delta` compares the
step's loss with the previous step's (next-batch losses, no extra forward
pass), and the update runs once per applied optimizer step. Under
distribution the weights use the losses summed over replicas (one small
all-reduce in the pass), so `micro_batches` are refused (no
synchronization inside the micro-batch loop).
"""

from __future__ import annotations

from typing import Any
from typing import Sequence

import numpy as np
import tensorflow as tf

from keras_tapeops import validation
from keras_tapeops.multitask import learned
from keras_tapeops.multitask.context import StepContext
from keras_tapeops.multitask.option import TaskBalancing
from keras_tapeops.registration import register


def present_tasks(losses):
    """Tasks that take part in a step: those with a positive (finite or not) loss.

    A task whose batch loss is 0 (e.g. every sample weight of its output is
    0: its labels are missing in this batch) or negative is absent.
    """
    return tf.cast(losses, tf.float32) > 0.0


@register
class FAMO(TaskBalancing):
    """Fast adaptive multitask optimization (loss weighting, O(1) per step).

    Args:
        learning_rate: Adam's learning rate for the task logits (0.025).
        weight_decay: Adam's weight decay on them (0.001).
        tasks: None or the output names that are tasks.

    Example:
    ```python
    kt.FAMO()
    ```
    """

    kind = "weighting"
    takes_shared = False
    needs_global_losses = True

    def __init__(
        self,
        learning_rate: float = 0.025,
        weight_decay: float = 1e-3,
        tasks: Sequence[str] | None = None,
    ) -> None:
        super().__init__(tasks=tasks)
        self.learning_rate = validation.positive_number(learning_rate, "learning_rate")
        self.weight_decay = validation.non_negative_number(weight_decay, "weight_decay")

    def initial_state(self, num_tasks: int) -> dict[str, np.ndarray]:
        return {
            "logits": np.zeros([num_tasks], "float32"),
            "previous_losses": np.zeros([num_tasks], "float32"),
            "has_previous": np.zeros([], "float32"),
            **learned.adam_state("logits", num_tasks),
        }

    def pass_weights(self, context: StepContext) -> tf.Tensor:
        losses = tf.cast(context.losses, tf.float32)
        present = present_tasks(losses)
        z = tf.nn.softmax(tf.convert_to_tensor(context.state["logits"]))
        # An absent task (loss <= 0) takes no part: its 1 / L_k would
        # otherwise dominate c and zero every other task's weight.
        inverse = tf.where(present, 1.0 / tf.where(present, losses + 1e-8, 1.0), 0.0)
        c = tf.reduce_sum(z * inverse)
        return tf.math.divide_no_nan(z * inverse, c)

    def update(self, context: StepContext, gramian: tf.Tensor | None = None) -> None:
        state = context.state
        current = tf.cast(context.losses, tf.float32)
        previous = tf.convert_to_tensor(state["previous_losses"])
        finite = tf.reduce_all(tf.math.is_finite(tf.math.log(tf.maximum(current, 0.0) + 1e-8)))
        # A task present now and at its previous step contributes its log
        # drop; the others contribute 0 this step.
        both = tf.logical_and(present_tasks(current), present_tasks(previous))
        delta = tf.where(
            both,
            tf.math.log(tf.where(both, previous, 1.0) + 1e-8)
            - tf.math.log(tf.where(both, current, 1.0) + 1e-8),
            0.0,
        )
        z = tf.nn.softmax(tf.convert_to_tensor(state["logits"]))
        grad = z * (delta - tf.reduce_sum(z * delta))
        apply = tf.logical_and(finite, tf.convert_to_tensor(state["has_previous"]) > 0.0)
        learned.adam_step(
            state,
            "logits",
            tf.where(apply, grad, 0.0),
            self.learning_rate,
            weight_decay=self.weight_decay,
            apply=apply,
        )
        # An absent task keeps its last present loss as its "previous" one.
        keep_new = tf.logical_and(finite, present_tasks(current))
        state["previous_losses"].assign(tf.where(keep_new, current, previous))
        state["has_previous"].assign(tf.where(finite, 1.0, state["has_previous"]))

    def micro_batch_refusal(self, replicas: int) -> str | None:
        return (
            "FAMO weighs each pass with the log of its own losses, "
            "so micro-batches would not add up to the batch"
        )

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "learning_rate": self.learning_rate,
            "weight_decay": self.weight_decay,
        }
