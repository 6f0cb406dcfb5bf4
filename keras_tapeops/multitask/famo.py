"""FAMO (Liu et al., 2023, "FAMO: Fast Adaptive Multitask Optimization").

One backward pass per step of `sum_k z_k log(L_k) / c` (`z = softmax(w)`,
`c = sum_k z_k / L_k`, held constant), i.e. the task weights
`z_k / (c L_k)`; the logits `w` then move (Adam with weight decay, as the
reference code) along `J_softmax^T delta`, `delta_k` the drop of
`log L_k` from one step to the next, so tasks that improve slowly gain
weight. As in the reference code (official FAMO and LibMTL) the minimum
losses are 0 and 1e-8 is added inside the logs; losses must be positive.

Difference from the reference code: it runs a second forward pass on the
same batch after the update to measure `delta`; here `delta` compares the
step's loss with the previous step's (next-batch losses, no extra forward
pass), and the update runs once per applied optimizer step. Under
distribution the weights use the losses summed over replicas (one small
all-reduce in the pass), so `micro_batches` are refused (no
synchronization inside the micro-batch loop).
"""

import numpy as np
import tensorflow as tf

from keras_tapeops import validation
from keras_tapeops.multitask import learned
from keras_tapeops.multitask.option import TaskBalancing
from keras_tapeops.registration import register


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

    def __init__(self, learning_rate=0.025, weight_decay=1e-3, tasks=None):
        super().__init__(tasks=tasks)
        self.learning_rate = validation.positive_number(learning_rate, "learning_rate")
        self.weight_decay = validation.non_negative_number(weight_decay, "weight_decay")

    def initial_state(self, num_tasks):
        return {
            "logits": np.zeros([num_tasks], "float32"),
            "previous_losses": np.zeros([num_tasks], "float32"),
            "has_previous": np.zeros([], "float32"),
            **learned.adam_state("logits", num_tasks),
        }

    def pass_weights(self, context):
        z = tf.nn.softmax(tf.convert_to_tensor(context.state["logits"]))
        shifted = context.losses + 1e-8
        c = tf.reduce_sum(z / shifted)
        return z / (c * shifted)

    def update(self, context, gramian=None):
        state = context.state
        current = context.losses
        finite = tf.reduce_all(tf.math.is_finite(tf.math.log(current + 1e-8)))
        delta = tf.math.log(tf.convert_to_tensor(state["previous_losses"]) + 1e-8) - tf.math.log(
            current + 1e-8
        )
        z = tf.nn.softmax(tf.convert_to_tensor(state["logits"]))
        grad = z * (delta - tf.reduce_sum(z * delta))
        apply = tf.logical_and(finite, tf.convert_to_tensor(state["has_previous"]) > 0.0)
        learned.adam_step(
            state, "logits", tf.where(apply, grad, 0.0), self.learning_rate,
            weight_decay=self.weight_decay, apply=apply,
        )
        state["previous_losses"].assign(tf.where(finite, current, state["previous_losses"]))
        state["has_previous"].assign(tf.where(finite, 1.0, state["has_previous"]))

    def micro_batch_refusal(self, replicas):
        return "FAMO weighs each pass with the log of its own losses, so micro-batches would not add up to the batch"

    def get_config(self):
        return {
            **super().get_config(), "learning_rate": self.learning_rate,
            "weight_decay": self.weight_decay,
        }
