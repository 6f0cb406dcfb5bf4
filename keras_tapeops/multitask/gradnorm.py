"""GradNorm (Chen et al., 2018, "GradNorm: Gradient Normalization for Adaptive Loss Balancing").

Task weights `w = K softmax(p)` are learned so that each weighted task's
gradient norm on the shared variables, `G_k = w_k ||g_k||`, tracks
`mean(G) r_k^alpha`, `r_k` the task's relative inverse training rate
(`L_k / L_k(0)` over its mean). The shared variables get `sum_k w_k g_k`.

We follow the reference code (LibMTL's `GradNorm`) where it differs from
the paper: the weights are `K softmax(p)` (the paper renormalizes raw
weights to sum to K), `||g_k||` is taken on all the shared variables (the
paper: the last shared layer; pass `shared=` to choose), `L_k(0)` is the
task's mean loss over the first epoch and the first epoch trains with
weights 1. From the paper (LibMTL's heads get unweighted gradients): the
task-specific variables get the weighted loss's gradient.

`p` is training state (saved, not a model weight), stepped once per applied
optimizer step by Adam (`learning_rate`) along `d/dp sum_k |G_k - target_k|`
(targets held constant).
"""

from __future__ import annotations

from typing import Any
from typing import Sequence

import numpy as np
import tensorflow as tf

from keras_tapeops import validation
from keras_tapeops import gramian as gram
from keras_tapeops.multitask import learned
from keras_tapeops.multitask.context import StepContext
from keras_tapeops.multitask.option import TaskBalancing
from keras_tapeops.registration import register
from keras_tapeops.selectors import Selector


@register
class GradNorm(TaskBalancing):
    """Learned task weights that balance the tasks' gradient norms.

    Args:
        alpha: strength of the pull towards equal training rates (the
            paper's 1.5 for NYUv2).
        learning_rate: Adam's learning rate for the weight logits.
        shared: selector of the shared variables (norms are taken there).
        tasks: None or the output names that are tasks.

    Example:
    ```python
    kt.GradNorm(alpha=1.5, shared="trunk/*")
    ```
    """

    kind = "rows"
    needs_epochs = True

    def __init__(
        self,
        alpha: float = 1.5,
        learning_rate: float = 0.01,
        shared: Selector = None,
        tasks: Sequence[str] | None = None,
    ) -> None:
        super().__init__(shared=shared, tasks=tasks)
        self.alpha = validation.non_negative_number(alpha, "alpha")
        self.learning_rate = validation.positive_number(learning_rate, "learning_rate")

    def initial_state(self, num_tasks: int) -> dict[str, np.ndarray]:
        return {
            "logits": np.ones([num_tasks], "float32"),
            **learned.adam_state("logits", num_tasks),
        }

    def _active(self, context):
        return tf.convert_to_tensor(context.epochs.completed) >= 1.0

    def pass_weights(self, context: StepContext) -> tf.Tensor:
        k = context.num_tasks
        weights = k * tf.nn.softmax(tf.convert_to_tensor(context.state["logits"]))
        return tf.where(self._active(context), weights, tf.ones([k]))

    def weights(self, gramian: tf.Tensor, context: StepContext) -> tf.Tensor:
        return self.pass_weights(context)

    def update(self, context: StepContext, gramian: tf.Tensor | None = None) -> None:
        k = context.num_tasks
        norms = gram.row_norms(gramian)
        first = tf.convert_to_tensor(context.epochs.first)
        relative = context.losses / tf.where(first > 0.0, first, 1.0)
        rate = relative / tf.reduce_mean(relative)
        logits = tf.convert_to_tensor(context.state["logits"])
        with tf.GradientTape() as tape:
            tape.watch(logits)
            weighted = k * tf.nn.softmax(logits) * norms
            target = tf.stop_gradient(tf.reduce_mean(weighted) * rate**self.alpha)
            objective = tf.reduce_sum(tf.abs(weighted - target))
        grad = tape.gradient(objective, logits)
        ok = tf.logical_and(self._active(context), tf.reduce_all(tf.math.is_finite(grad)))
        learned.adam_step(
            context.state, "logits", tf.where(ok, grad, 0.0), self.learning_rate, apply=ok
        )

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "alpha": self.alpha, "learning_rate": self.learning_rate}
