"""CAGrad (Liu et al., 2021, "Conflict-Averse Gradient Descent for Multi-task Learning").

The step maximizes the worst task improvement within a ball around the
average gradient `g0`: with `phi = c^2 ||g0||^2`, the weights
`w = argmin_{w in simplex} g_w . g0 + sqrt(phi) ||g_w||` (`g_w = sum_k w_k g_k`)
give `d = g0 + (sqrt(phi) / ||g_w||) g_w`.

Where the paper and the reference code differ we follow the official code
(Cranial-XIX/CAGrad, also LibMTL): `d` is divided by `1 + c^2`
(`rescale=1`, the default; `rescale=0` is the paper's `d`, `rescale=2`
divides by `1 + c`). The sub-problem is solved exactly on the
trace-normalized Gramian (the official code calls scipy's SLSQP, torchjd
cvxpy): on each face of the simplex its minimizer has a closed form
(`cagrad_weights`), and the best feasible candidate over all faces, the
vertices and the min-norm point is taken (see `qp`).
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
def cagrad_weights(gramian, c, rescale=1):
    """CAGrad's weights: `d = weights^T J`.

    On the face with support `S`, stationarity of the Lagrangian gives
    `w_S = (mu v - u) / r` with `v = G_SS^+ 1`, `u = G_SS^+ (G b)_S`,
    `a = 1.v`, `beta = 1.u`, `gamma = u.(G b)_S`,
    `r = sqrt(beta^2 - a gamma + a phi)`, `mu = (beta + r) / a`.

    Args:
        gramian: `[K, K]` float32.
        c: the ball's radius relative to `||g0||` (>= 0).
        rescale: 0, 1 or 2 (see the module docstring).

    Returns:
        `[K]` float32 weights.
    """
    k = int(gramian.shape[0])
    g = gram.normalize(gramian, 1e-20)
    mean = tf.fill([k], 1.0 / k)
    pulled = tf.linalg.matvec(g, mean)  # G b, b = 1/K
    sqrt_phi = c * tf.sqrt(tf.maximum(tf.reduce_sum(pulled * mean), 0.0))
    masks = gram.subsets(k)
    inverse = gram.symmetric_pinv(gram.masked_blocks(g, masks))
    v = tf.linalg.matvec(inverse, masks)
    u = tf.linalg.matvec(inverse, masks * pulled[tf.newaxis])
    a = tf.reduce_sum(v, axis=1, keepdims=True)
    beta = tf.reduce_sum(u, axis=1, keepdims=True)
    gamma = tf.reduce_sum(u * pulled[tf.newaxis], axis=1, keepdims=True)
    r = tf.sqrt(beta**2 - a * gamma + a * sqrt_phi**2)  # nan where no solution
    mu = (beta + r) / a
    faces = (mu * v - u) / r
    candidates = tf.concat([faces, tf.eye(k), qp.min_norm_weights(g)[tf.newaxis]], axis=0)
    candidates = gram.onto_simplex_cheaply(candidates)
    objective = tf.linalg.matvec(candidates, pulled) + sqrt_phi * tf.sqrt(
        tf.maximum(gram.quadratic(candidates, g), 0.0)
    )
    w = gram.argmin_rows(candidates, objective)
    g_w_norm = tf.sqrt(tf.maximum(gram.quadratic(w, g), 0.0))
    weights = mean + (sqrt_phi / (g_w_norm + 1e-8)) * w
    divisor = {0: 1.0, 1: 1.0 + c**2, 2: 1.0 + c}[rescale]
    return weights / divisor


@register
class CAGrad(Aggregator):
    """Conflict-averse gradient descent.

    Args:
        c: radius of the ball around the average gradient, relative to its
            norm (`c=0` is the average gradient; the paper uses 0.4 for
            multi-task scene understanding, the official default is 0.5).
        rescale: 0 (the paper's `d`), 1 (`d / (1 + c^2)`, the official
            default) or 2 (`d / (1 + c)`).
        shared: selector of the shared variables.
        tasks: None or the output names that are tasks.

    Example:
    ```python
    kt.CAGrad(c=0.4, shared="trunk/*")
    ```
    """

    max_tasks = qp.MAX_TASKS

    def __init__(
        self,
        c: float = 0.4,
        rescale: int = 1,
        shared: Selector = None,
        tasks: Sequence[str] | None = None,
    ) -> None:
        super().__init__(shared=shared, tasks=tasks)
        self.c = validation.non_negative_number(c, "c")
        if rescale not in (0, 1, 2) or isinstance(rescale, bool):
            raise ValueError(f"`rescale` must be 0, 1 or 2. Received: rescale={rescale!r}")
        self.rescale = int(rescale)

    def weights(self, gramian: tf.Tensor, context: StepContext) -> tf.Tensor:
        return cagrad_weights(gramian, self.c, self.rescale)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "c": self.c, "rescale": self.rescale}
