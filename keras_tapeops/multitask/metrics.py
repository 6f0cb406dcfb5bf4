"""The multi-task engine's logged metrics (History, progress bar, TensorBoard).

Names, for tasks `a`, `b`, `c` (the output names Keras uses in `a_loss`):

- `a_weight`: the weight the method gave task `a` in the step's gradient
  (`g = sum_k weight_k g_k` on the shared variables; for loss weightings the
  multiplier of `a`'s loss);
- `a_grad_norm`: the norm of task `a`'s gradient on the shared variables
  (with `MGDA(on="representation")`: on the shared representation);
- `cosine_a_b`: the cosine similarity of the gradients of `a` and `b` (the
  conflict signal: negative means the tasks pull the shared layers apart).

Each is the mean over the epoch's measured steps (every applied step, or
every `every`-th for `MeasureConflict`), like `loss`. Training only:
`evaluate()` does not report them.
"""

import keras
import tensorflow as tf

from keras_tapeops.aggregation import gramian as gram


class TaskMetrics:
    """One `Mean` per logged quantity (see the module docstring for names).

    Args:
        task_names: the tasks, in order.
        weights: log `<task>_weight`.
        gradients: log `<task>_grad_norm` and `cosine_<a>_<b>`.

    Example:
    ```python
    metrics = TaskMetrics(["a", "b"], weights=True, gradients=True)
    metrics.update(weights=w, gramian=g)
    ```
    """

    def __init__(self, task_names, weights=True, gradients=True):
        self.task_names = list(task_names)
        self.pairs = gram.pairs(len(self.task_names))
        self.weight = (
            [keras.metrics.Mean(name=f"{t}_weight") for t in self.task_names] if weights else []
        )
        self.norm = (
            [keras.metrics.Mean(name=f"{t}_grad_norm") for t in self.task_names]
            if gradients else []
        )
        self.cosine = (
            [
                keras.metrics.Mean(
                    name=f"cosine_{self.task_names[i]}_{self.task_names[j]}"
                )
                for i, j in self.pairs
            ]
            if gradients else []
        )

    def as_dict(self):
        """name -> metric, in logging order."""
        return {m.name: m for m in self.weight + self.norm + self.cosine}

    def update(self, weights=None, gramian=None, sample_weight=None):
        """Adds one step's values.

        Args:
            weights: `[K]` task weights, or None.
            gramian: `[K, K]` Gramian of the task gradients, or None.
            sample_weight: optional scalar (0 leaves the means unchanged).
        """
        if weights is not None:
            for k, metric in enumerate(self.weight):
                metric.update_state(weights[k], sample_weight=sample_weight)
        if gramian is not None and self.norm:
            norms = gram.row_norms(gramian)
            cosines = gram.cosine_similarities(gramian)
            for k, metric in enumerate(self.norm):
                metric.update_state(norms[k], sample_weight=sample_weight)
            for (i, j), metric in zip(self.pairs, self.cosine):
                metric.update_state(cosines[i, j], sample_weight=sample_weight)


def finite_or_zero(values):
    """`values` with non-finite entries replaced by 0 (a skipped fp16 step logs 0)."""
    return tf.where(tf.math.is_finite(values), values, tf.zeros_like(values))
