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

import tensorflow as tf

from keras_tapeops import validation
from keras_tapeops.aggregation.base import Aggregator
from keras_tapeops.registration import register


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

    Args:
        gramian: `[K, K]` float32.
        orders: `[K, K]` int32, row `i` a permutation (see `task_orders`).

    Returns:
        `[K]` float32 weights `w` with `w^T J = sum_i g_i^PC`.
    """
    k = int(gramian.shape[0])
    total = tf.zeros([k])
    for i in range(k):
        current = tf.one_hot(i, k)
        for t in range(k):
            j = orders[i, t]
            g_j = tf.gather(gramian, j)
            inner = tf.reduce_sum(g_j * current)
            norm2 = tf.gather(g_j, j)
            project = tf.logical_and(
                tf.logical_and(inner < 0.0, norm2 > 0.0), tf.not_equal(j, i)
            )
            step = tf.where(project, inner / tf.where(norm2 > 0.0, norm2, 1.0), 0.0)
            current = current - step * tf.one_hot(j, k)
        total = total + current
    return total


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

    def __init__(self, shared=None, tasks=None, seed=None):
        super().__init__(shared=shared, tasks=tasks)
        if seed is not None:
            seed = validation.finite_number(seed, "seed", minimum=0)
            if seed != int(seed):
                raise ValueError(f"`seed` must be an integer. Received: seed={seed!r}")
            seed = int(seed)
        self.seed = seed

    def weights(self, gramian, context):
        orders = task_orders(context.seed, context.step, context.num_tasks)
        return pcgrad_weights(gramian, orders)

    def get_config(self):
        return {**super().get_config(), "seed": self.seed}
