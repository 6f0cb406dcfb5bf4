"""`Aggregator`: a `task_balancing` option that reduces the task rows to one gradient.

An aggregator is a small class over the `K x K` Gramian of the rows
`J = [g_1; ...; g_K]` (per-task gradients of the shared variables):
`weights = f(J J^T)` and the step's shared gradient is `weights^T J`
(torchjd's `GramianWeightedAggregator`). The rows themselves are computed
apart (`keras_tapeops.rows`), so each aggregator is a pure function of a
small matrix, testable with NumPy.

`Aggregator` is a public extension point: a user aggregator subclasses it
and implements `weights(gramian, context) -> [K]` (see `docs/extending.md`).
"""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_tapeops import rows as row_ops
from keras_tapeops.multi_gradient import require_override
from keras_tapeops.multitask.context import StepContext
from keras_tapeops.multitask.engine import TaskEngine
from keras_tapeops.multitask.option import TaskBalancing
from keras_tapeops.paths import LayerTree


class Aggregator(TaskBalancing):
    """Base class of the gradient aggregators (`kind = "rows"`); public.

    Subclasses implement one method, `weights(gramian, context) -> [K]`.
    The rows are the per-task gradients `g_k = d L_k / d shared` (`L_k` with
    compile's `loss_weights` applied) of the shared variables, `gramian` is
    their `[K, K]` float32 Gramian `J J^T` (summed over replicas and over the
    passes of an applied step), and the shared variables' gradient is
    `sum_k w_k g_k`; the other variables (the heads) get their ordinary
    gradient. `weights` runs once per applied optimizer step, in float32,
    inside the step function (use TensorFlow ops). `context` is a
    `keras_tapeops.multitask.StepContext` (`num_tasks`, `losses`, `step`,
    `seed`, `state`). Learned state: `initial_state`/`update`, as for
    `keras_tapeops.multitask.LossWeighting`.

    A user aggregator is immutable configuration: extend `get_config()`
    with its own arguments (`shared` and `tasks` are saved by the base) and
    register the class with `keras.saving.register_keras_serializable`.

    Args:
        shared: selector of the shared variables (see `TaskBalancing`).
        tasks: None or the output names that are tasks.

    Example:
    ```python
    import keras
    import tensorflow as tf
    from keras_tapeops.aggregation import Aggregator

    @keras.saving.register_keras_serializable(package="my_aggregators")
    class Mean(Aggregator):
        def weights(self, gramian, context):
            k = context.num_tasks
            return tf.fill([k], 1.0 / k)

    Mean(shared="trunk/*").aggregate([[1.0, 0.0], [0.0, 1.0]])  # [0.5, 0.5]
    ```
    """

    kind = "rows"

    def bind(self, model: keras.Model, tree: LayerTree) -> TaskEngine:
        require_override(
            self,
            "Aggregator",
            "weights(gramian, context)",
            TaskBalancing.weights,
            "returns the [K] weights of the task gradients",
            "task_balancing",
        )
        return super().bind(model, tree)

    def aggregate(self, rows: tf.Tensor, context: StepContext | None = None) -> tf.Tensor:
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
            context = StepContext(int(rows.shape[0]), step=tf.constant(0, tf.int64), seed=seed or 0)
        return row_ops.combine(self.weights(row_ops.gramian(rows), context), rows)
