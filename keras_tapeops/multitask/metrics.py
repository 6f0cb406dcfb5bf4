"""The multi-task engine's logged values (History, progress bar, TensorBoard).

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

All of them live in one Keras metric (a vector of sums and one count), so a
step adds them with two variable updates however many tasks there are.
"""

import keras
import tensorflow as tf

from keras_tapeops import gramian as gram
from keras_tapeops._keras import multitask as private


class TaskMetrics(keras.metrics.Metric):
    """The per-task weights, gradient norms and pairwise cosines, as one metric.

    `result()` is a dict name -> epoch mean (Keras logs each entry), empty
    while the model evaluates. `reset_state()` (Keras calls it when an epoch
    begins) also ends the epoch of `epochs` (DWA, GradNorm).

    Args:
        task_names: the tasks, in order.
        model: the model (its evaluation flag is read).
        weights: log `<task>_weight`.
        gradients: log `<task>_grad_norm` and `cosine_<a>_<b>`.
        epochs: an `EpochLosses` to roll at epoch boundaries, or None.

    Example:
    ```python
    metrics = TaskMetrics(["a", "b"], model, weights=True, gradients=True)
    metrics.update(weights=w, gramian=g)
    ```
    """

    def __init__(
        self, task_names, model, weights=True, gradients=True, epochs=None, name="task_balancing"
    ):
        super().__init__(name=name)
        self.task_names = list(task_names)
        self.pairs = gram.pairs(len(self.task_names))
        self.weights_logged = weights
        self.gradients_logged = gradients
        names = [f"{t}_weight" for t in self.task_names] if weights else []
        if gradients:
            names += [f"{t}_grad_norm" for t in self.task_names]
            names += [f"cosine_{self.task_names[i]}_{self.task_names[j]}" for i, j in self.pairs]
        self.names = names
        self.total = self.add_variable(
            shape=(len(names),), initializer="zeros", name="total", aggregation="sum"
        )
        self.count = self.add_variable(
            shape=(), initializer="zeros", name="count", aggregation="sum"
        )
        self._model_ref = [model]  # a list: not tracked as a sub-layer
        self._epochs = epochs

    def update(self, weights=None, gramian=None, sample_weight=None):
        """Adds one step's values.

        Args:
            weights: `[K]` task weights (if weights are logged).
            gramian: `[K, K]` Gramian of the task gradients (if gradients are logged).
            sample_weight: optional scalar (0 leaves the means unchanged).
        """
        parts = []
        if self.weights_logged:
            parts.append(tf.cast(weights, tf.float32))
        if self.gradients_logged:
            cosines = gram.cosine_similarities(gramian)
            parts.append(gram.row_norms(gramian))
            if self.pairs:
                parts.append(tf.gather_nd(cosines, self.pairs))
        values = tf.concat(parts, axis=0)
        weight = tf.constant(1.0) if sample_weight is None else tf.cast(sample_weight, tf.float32)
        self.total.assign_add(values * weight)
        self.count.assign_add(weight)

    def update_state(self, *args, **kwargs):
        raise NotImplementedError("TaskMetrics is updated by the engine (update()).")

    def result(self):
        if private.is_evaluating(self._model_ref[0]):
            return {}
        means = tf.math.divide_no_nan(self.total, self.count)
        return {name: means[i] for i, name in enumerate(self.names)}

    def reset_state(self):
        self.total.assign(tf.zeros_like(self.total))
        self.count.assign(tf.zeros_like(self.count))
        if self._epochs is not None and not private.is_evaluating(self._model_ref[0]):
            self._epochs.roll()
