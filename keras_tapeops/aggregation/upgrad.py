"""UPGrad (Quinton & Rey, 2024, "Jacobian Descent for Multi-Objective Optimization").

Each task gradient (scaled by the preference `1/K`) is projected onto the
dual cone of all task gradients (the directions that conflict with none),
and the projections are summed. As in torchjd (the reference code) the
projection is solved in weight space on the Gramian, normalized by its trace
(`norm_eps`) and regularized (`G + reg_eps I`) to be positive definite;
torchjd calls quadprog, we solve the same box-constrained QPs exactly
inside the step (`qp.dual_cone_weights`).
"""

from __future__ import annotations

from typing import Any
from typing import Sequence

import tensorflow as tf

from keras_tapeops import validation
from keras_tapeops import gramian as gram
from keras_tapeops.aggregation import qp
from keras_tapeops.aggregation.base import Aggregator
from keras_tapeops.multitask.context import StepContext
from keras_tapeops.registration import register
from keras_tapeops.selectors import Selector


@gram.nan_unless_finite
def upgrad_weights(gramian, norm_eps=1e-4, reg_eps=1e-4):
    """UPGrad's weights: the sum of the dual-cone projections of `e_i / K`.

    Args:
        gramian: `[K, K]` float32.
        norm_eps: below this trace the Gramian counts as zero.
        reg_eps: added to the normalized Gramian's diagonal.

    Returns:
        `[K]` float32 weights.
    """
    k = int(gramian.shape[0])
    g = gram.regularize(gram.normalize(gramian, norm_eps), reg_eps)
    projected = qp.dual_cone_weights(g, tf.eye(k) / k)
    return tf.reduce_sum(projected, axis=0)


@register
class UPGrad(Aggregator):
    """Unconflicting projection of gradients.

    Args:
        norm_eps: trace below which the Gramian counts as zero (torchjd: 1e-4).
        reg_eps: diagonal regularization (torchjd: 1e-4).
        shared: selector of the shared variables.
        tasks: None or the output names that are tasks.

    Example:
    ```python
    kt.UPGrad(shared="trunk/*")
    ```
    """

    max_tasks = qp.MAX_TASKS

    def __init__(
        self,
        norm_eps: float = 1e-4,
        reg_eps: float = 1e-4,
        shared: Selector = None,
        tasks: Sequence[str] | None = None,
    ) -> None:
        super().__init__(shared=shared, tasks=tasks)
        self.norm_eps = validation.non_negative_number(norm_eps, "norm_eps")
        self.reg_eps = validation.positive_number(reg_eps, "reg_eps")

    def weights(self, gramian: tf.Tensor, context: StepContext) -> tf.Tensor:
        return upgrad_weights(gramian, self.norm_eps, self.reg_eps)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "norm_eps": self.norm_eps, "reg_eps": self.reg_eps}
