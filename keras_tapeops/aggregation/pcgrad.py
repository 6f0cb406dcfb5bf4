"""PCGrad (Yu et al., 2020, "Gradient Surgery for Multi-Task Learning").

Each task gradient `g_i` is projected, in a random order of the other
tasks `j`, onto the normal plane of every `g_j` it conflicts with
(`g_i^PC . g_j < 0`); the step is the sum of the projected gradients.

Where the paper and the reference code differ we follow the reference code
(torchjd's `PCGradWeighting`, also LibMTL's): a new random order per task
`i` (the official TF code shuffles once for all tasks), the task itself
skipped (LibMTL projects `g_i` on itself too), and the sum (not the mean)
of the projected gradients. The orders are drawn with a stateless RNG from
`(seed, optimizer step)`, so every replica, and a restarted run, draws the
same ones.
"""

from __future__ import annotations

from typing import Any
from typing import Sequence

import tensorflow as tf

from keras_tapeops import validation
from keras_tapeops.aggregation.base import Aggregator
from keras_tapeops.multitask.context import StepContext
from keras_tapeops.registration import register
from keras_tapeops.selectors import Selector


def task_orders(seed, step, k):
    """`[K, K]` int32: row `i` is the order in which task `i` visits the tasks.

    Args:
        seed: int.
        step: int or int tensor (the optimizer's applied-step count).
        k: number of tasks.

    Returns:
        A `[K, K]` int32 tensor, each row a permutation of `range(K)`.
    """
    key = tf.stack([tf.cast(seed, tf.int64), tf.cast(step, tf.int64)])
    noise = tf.random.stateless_uniform([k, k], seed=key)
    return tf.argsort(noise, axis=1, stable=True)


def pcgrad_weights(gramian, orders):
    """PCGrad's weights from the Gramian, for given visiting orders.

    Task `i`'s projected gradient is kept as weights over the rows
    (`g_i^PC = c_i^T J`, starting from `e_i`); visiting task `j` subtracts
    `min(0, g_i^PC . g_j) / ||g_j||^2` from `c_i[j]`. The tasks' projections
    are independent, so the K of them advance together, one visit per step.

    Args:
        gramian: `[K, K]` float32.
        orders: `[K, K]` int32, row `i` a permutation (see `task_orders`).

    Returns:
        `[K]` float32 weights `w` with `w^T J = sum_i g_i^PC`.
    """
    k = int(gramian.shape[0])
    tasks = tf.range(k, dtype=orders.dtype)
    current = tf.eye(k)  # row i: the weights of task i's projected gradient
    for t in range(k):
        j = orders[:, t]  # the task each task visits now
        rows_j = tf.gather(gramian, j)  # G[j_i, :]
        inner = tf.reduce_sum(rows_j * current, axis=1)  # g_i^PC . g_j
        norm2 = tf.gather_nd(gramian, tf.stack([j, j], axis=1))
        project = (inner < 0.0) & (norm2 > 0.0) & tf.not_equal(j, tasks)
        step = tf.where(project, inner / tf.where(norm2 > 0.0, norm2, 1.0), 0.0)
        current = current - step[:, tf.newaxis] * tf.one_hot(j, k)
    return tf.reduce_sum(current, axis=0)


@register
class PCGrad(Aggregator):
    """Projecting conflicting gradients (`compile(task_balancing=kt.PCGrad(...))`).

    Args:
        shared: selector of the shared variables (e.g. `"trunk/*"`).
        tasks: None or the output names that are tasks.
        seed: int seed of the random task orders; None draws one per model.

    Example:
    ```python
    inputs = keras.Input((8,))
    features = keras.Sequential([keras.layers.Dense(16, activation="relu")], name="trunk")(inputs)
    model = kt.upgrade(keras.Model(inputs, {"a": keras.layers.Dense(1, name="a")(features),
                                            "b": keras.layers.Dense(1, name="b")(features)}))
    model.compile(optimizer="adam", loss={"a": "mse", "b": "mse"},
                  task_balancing=kt.PCGrad(shared="trunk/*"))
    ```
    """

    def __init__(
        self,
        shared: Selector = None,
        tasks: Sequence[str] | None = None,
        seed: int | None = None,
    ) -> None:
        super().__init__(shared=shared, tasks=tasks)
        if seed is not None:
            seed = validation.finite_number(seed, "seed", minimum=0)
            if seed != int(seed):
                raise ValueError(f"`seed` must be an integer. Received: seed={seed!r}")
            seed = int(seed)
        self.seed = seed

    def weights(self, gramian: tf.Tensor, context: StepContext) -> tf.Tensor:
        orders = task_orders(context.seed, context.step, context.num_tasks)
        return pcgrad_weights(gramian, orders)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "seed": self.seed}
