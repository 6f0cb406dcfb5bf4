"""Per-task mean training losses of past epochs (for DWA and GradNorm).

DWA weighs the tasks by how fast their losses fell over the last two
epochs, and GradNorm compares each loss with its first-epoch value (as in
LibMTL's `train_loss_buffer`). An epoch is what `fit()` calls one: Keras
resets the model's metrics when an epoch begins, and the engine's metric
(`metrics.TaskMetrics.reset_state`) then moves the finished epoch's mean
losses into the history (not when `evaluate()` resets them).

All of it is training state saved with the model (and by
`BackupAndRestore`), so a resumed run continues with the same weights.
"""

import keras
import numpy as np


class EpochLosses:
    """The current epoch's loss sums and the last epochs' mean losses.

    Args:
        num_tasks: K.

    Attributes:
        current, steps: sums over the current epoch's applied steps.
        last, before_last, first: `[K]` mean losses of the last, the one
            before, and the first completed epoch.
        completed: number of completed epochs (float).

    Example:
    ```python
    losses = EpochLosses(2); losses.add(step_losses); losses.roll()
    ```
    """

    def __init__(self, num_tasks):
        def variable(name, shape):
            return keras.Variable(
                np.zeros(shape, "float32"),
                trainable=False,
                name=f"task_epoch_{name}",
                aggregation="only_first_replica",
            )

        self.current = variable("current", [num_tasks])
        self.steps = variable("steps", [])
        self.last = variable("last", [num_tasks])
        self.before_last = variable("before_last", [num_tasks])
        self.first = variable("first", [num_tasks])
        self.completed = variable("completed", [])

    @property
    def variables(self):
        return [self.current, self.steps, self.last, self.before_last, self.first, self.completed]

    def add(self, losses):
        """Adds one applied step's `[K]` task losses (inside the step)."""
        self.current.assign_add(losses)
        self.steps.assign_add(1.0)

    def roll(self):
        """Ends the current epoch (eager): its mean becomes `last`. No-op if empty."""
        steps = float(np.asarray(self.steps.numpy()))
        if steps <= 0:
            return
        mean = np.asarray(self.current.numpy()) / steps
        self.before_last.assign(self.last.numpy())
        self.last.assign(mean)
        if float(np.asarray(self.completed.numpy())) == 0:
            self.first.assign(mean)
        self.completed.assign(self.completed.numpy() + 1.0)
        self.current.assign(np.zeros_like(mean))
        self.steps.assign(0.0)
