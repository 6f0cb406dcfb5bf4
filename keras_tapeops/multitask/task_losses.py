"""The tasks of a multi-output model: its per-output losses, as Keras computes them.

A task is one output's loss in `compile(loss={...})` (or a loss list, or one
loss applied to every output), multiplied by its `loss_weights` entry, with
sample weights applied by Keras: exactly the terms whose sum is the model's
loss. They are read during the step's one forward pass
(`recording_task_losses`); regularization losses (`add_loss`, layer
regularizers) and keras_tapeops loss terms are not tasks.
"""

import contextlib

import tensorflow as tf

from keras_tapeops._keras import multitask as private


class TaskLossRecord:
    """The per-output loss values one forward pass produced (see `recording_task_losses`)."""

    def __init__(self, loss):
        self._loss = loss
        self._records = []

    def names(self):
        """The names of every output whose loss was computed (tasks or not)."""
        return [name for name, _, _ in self._records]

    def values(self, task_names):
        """`[K]` float32: each task's loss value (replica-scaled, `loss_weights` applied).

        Args:
            task_names: the task names, in the engine's order.

        Returns:
            A `[K]` float32 tensor. Raises ValueError naming the outputs with
            a loss when a task has none.
        """
        return tf.stack(self.value_list(task_names))

    def value_list(self, task_names):
        """`values(task_names)` as a list of K scalars (each differentiable on its own)."""
        found = {}
        for name, value, weight in self._records:
            value = tf.cast(tf.cast(value, private.loss_dtype(self._loss)), tf.float32)
            if weight is not None:
                value = value * tf.cast(weight, tf.float32)
            found.setdefault(name, value)
        missing = [t for t in task_names if t not in found]
        if missing:
            raise ValueError(
                f"`task_balancing` tasks {missing} have no loss: a task is an "
                "output with a loss in compile(loss=...), and the outputs with "
                f"a loss are {sorted(found)}. Pass tasks=[...] naming outputs "
                f"with a loss. Received: tasks={list(task_names)}"
            )
        return [found[t] for t in task_names]


@contextlib.contextmanager
def recording_task_losses(model):
    """Records each output's loss value while the model computes its loss in this block.

    Args:
        model: a compiled multi-output model.

    Returns:
        (yields) a `TaskLossRecord`; call `.values(task_names)` after the
        loss was computed.

    Example:
    ```python
    with recording_task_losses(model) as record:
        loss, y_pred = model.compute_total_loss(x, y, None, training=True)
    per_task = record.values(["a", "b"])
    ```
    """
    loss = private.compile_loss(model)
    if loss is None:
        raise ValueError(
            "`task_balancing` needs per-output losses: compile the model with "
            "loss={output_name: loss, ...} (or a list). Received: loss=None"
        )
    record = TaskLossRecord(loss)
    with private.recording_flat_losses(loss) as records:
        record._records = records
        yield record
