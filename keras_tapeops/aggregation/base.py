"""`Aggregator`: a `task_balancing` option that reduces the task rows to one gradient.

An aggregator is a small class over the `K x K` Gramian of the rows
`J = [g_1; ...; g_K]` (per-task gradients of the shared variables):
`weights = f(J J^T)` and the step's shared gradient is `weights^T J`
(torchjd's `GramianWeightedAggregator`). The rows themselves are computed
apart (`keras_tapeops.rows`), so each aggregator is a pure function of a
small matrix, testable with NumPy.
"""

import tensorflow as tf

from keras_tapeops import rows as row_ops
from keras_tapeops.multitask.context import StepContext
from keras_tapeops.multitask.option import TaskBalancing


class Aggregator(TaskBalancing):
    """Base class of the gradient aggregators (`kind = "rows"`).

    Subclasses implement `weights(gramian, context) -> [K]`.

    Args:
        shared: selector of the shared variables (see `TaskBalancing`).
        tasks: None or the output names that are tasks.

    Example:
    ```python
    class Mean(Aggregator):
        def weights(self, gramian, context):
            k = context.num_tasks
            return tf.fill([k], 1.0 / k)
    ```
    """

    kind = "rows"

    def aggregate(self, rows, context=None):
        """`weights(J J^T)^T J`: the aggregated `[P]` gradient of `[K, P]` rows.

        Args:
            rows: `[K, P]` float32 task gradients.
            context: optional `StepContext` (losses, step, seed).

        Returns:
            `[P]` float32.
        """
        rows = tf.convert_to_tensor(rows, tf.float32)
        if context is None:
            seed = getattr(self, "seed", None)
            context = StepContext(
                int(rows.shape[0]), step=tf.constant(0, tf.int64), seed=seed or 0
            )
        return row_ops.combine(self.weights(row_ops.gramian(rows), context), rows)
