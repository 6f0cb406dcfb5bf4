"""`TaskBalancing`: the base of every `compile(task_balancing=...)` option.

An option is immutable configuration (what to do with the tasks); the
per-model engine (`keras_tapeops.multitask.engine.TaskEngine`) resolves the
tasks and the shared variables and runs the step. Subclasses say how the
step's gradient is made (`kind`):

- `"rows"`: the per-task gradients (rows) of the shared variables are
  computed and reduced by `weights(gramian, context)` to one gradient, once
  per applied optimizer step (PCGrad, MGDA, CAGrad, IMTL-G, Aligned-MTL,
  UPGrad, GradNorm);
- `"weighting"`: one backward pass of the loss with the tasks reweighted by
  `pass_weights(context)` (uncertainty weighting, DWA, FAMO);
- `"representation"`: MGDA's upper bound on the shared representation;
- `"conflict"`: the plain step, with the rows measured now and then
  (`MeasureConflict`).

Extension points (see `docs/extending.md`): a user loss weighting subclasses
`LossWeighting` and implements `pass_weights(context) -> [K]`; a user
gradient aggregator subclasses `keras_tapeops.aggregation.Aggregator` and
implements `weights(gramian, context) -> [K]`.
"""

from __future__ import annotations

from typing import Any
from typing import Sequence
from typing import TYPE_CHECKING

import keras
import numpy as np
import tensorflow as tf

from keras_tapeops import selectors
from keras_tapeops.multi_gradient import MultiGradientOption
from keras_tapeops.multi_gradient import require_override
from keras_tapeops.multitask import tasks as task_resolution
from keras_tapeops.multitask.context import StepContext  # noqa: F401  (re-exported)
from keras_tapeops.multitask.engine import TaskEngine
from keras_tapeops.paths import LayerTree
from keras_tapeops.selectors import Selector

if TYPE_CHECKING:
    from typing_extensions import Self


class TaskBalancing(MultiGradientOption):
    """Base class of the multi-task options (`compile(task_balancing=...)`).

    Args:
        shared: selector of the variables the tasks share (the one path
            grammar: `"trunk/*"`, a layer, a list, a callable). None: on a
            functional model, every trainable variable that two or more task
            outputs depend on.
        tasks: None (every output with a loss) or a list of output names;
            other outputs' losses then get the ordinary gradient.

    A user-defined method subclasses one of the two public bases below it,
    `LossWeighting` (`pass_weights`) or `keras_tapeops.aggregation.Aggregator`
    (`weights`), rather than this class.

    Example:
    ```python
    import tensorflow as tf
    from keras_tapeops.multitask import TaskBalancing

    class EqualWeights(TaskBalancing):
        kind = "weighting"
        takes_shared = False
        def pass_weights(self, context):
            return tf.ones([context.num_tasks])
    ```
    """

    option_name = "task_balancing"
    kind = "rows"
    takes_shared = True  # False for loss weightings (they touch every variable alike)
    max_tasks: int | None = None  # set by aggregators whose sub-problem grows as 2^K
    needs_epochs = False  # DWA and GradNorm read per-epoch task losses
    needs_global_losses = False  # pass weights from this pass's losses summed over replicas
    logs_weights = True

    def __init__(self, shared: Selector = None, tasks: Sequence[str] | None = None) -> None:
        if self.takes_shared:
            self.shared = _validate_shared(shared)
        self.tasks = task_resolution.validate_tasks(tasks)

    def bind(self, model: keras.Model, tree: LayerTree) -> TaskEngine:
        return TaskEngine(self, model, tree)

    # -------------------------------------------------------- method hooks
    def initial_state(self, num_tasks: int) -> dict[str, np.ndarray]:
        """Learned state: dict name -> initial float32 array (engine variables, saved)."""
        return {}

    def pass_weights(self, context: StepContext) -> tf.Tensor | None:
        """`[K]` multipliers of the task losses in the backward pass, or None (all 1)."""
        return None

    def weights(self, gramian: tf.Tensor, context: StepContext) -> tf.Tensor:
        """`[K]` weights of the rows from their `[K, K]` Gramian ("rows" kind)."""
        raise NotImplementedError(f"{type(self).__name__} must implement weights().")

    def update(self, context: StepContext, gramian: tf.Tensor | None = None) -> None:
        """Updates the learned state once per applied step (after the gradient is made)."""

    def micro_batch_refusal(self, replicas: int) -> str | None:
        """Why `micro_batches > 1` cannot be used with `replicas` replicas, or None."""
        return None

    # ------------------------------------------------------------- config
    def get_config(self) -> dict[str, Any]:
        config = {"tasks": list(self.tasks) if self.tasks is not None else None}
        if self.takes_shared:
            config["shared"] = selectors.serialize_selector(self.shared)
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Self:
        config = dict(config)
        if "shared" in config:
            config["shared"] = selectors.deserialize_selector(config["shared"])
        return cls(**config)


class LossWeighting(TaskBalancing):
    """Public base of a loss weighting (`kind = "weighting"`).

    Implement `pass_weights(context) -> [K]`: the multipliers of the K task
    losses in the step's one backward pass (the step differentiates
    `total + sum_k (w_k - 1) L_k`, so regularization and loss terms keep
    weight 1). `L_k` already includes compile's `loss_weights`: fixed weights
    `w` equal stock `compile(loss_weights=w)`. The weights are not
    differentiated (`tf.stop_gradient`).

    `context` is a `keras_tapeops.multitask.StepContext`: `num_tasks`,
    `losses` (`[K]` task losses of this pass), `state` (the learned state),
    `step` and `epochs` (per-epoch task losses when `needs_epochs = True`).
    For learned weights also implement `initial_state(num_tasks)` (a dict
    name -> float32 array, kept as engine variables and saved with the
    model) and `update(context, gramian=None)` (once per applied step).

    A weighting is immutable configuration: extend `get_config()` with your
    arguments (the default `from_config` calls `cls(**config)`) and register
    the class with `keras.saving.register_keras_serializable`.

    Args:
        tasks: None (every output with a loss) or a list of output names.

    Example:
    ```python
    import keras
    import numpy as np
    import tensorflow as tf
    import keras_tapeops as kt
    from keras_tapeops.multitask import LossWeighting

    @keras.saving.register_keras_serializable(package="my_weightings")
    class Fixed(LossWeighting):
        def __init__(self, values, tasks=None):
            super().__init__(tasks=tasks)
            self.values = [float(v) for v in values]

        def pass_weights(self, context):
            return tf.constant(self.values)

        def get_config(self):
            return {**super().get_config(), "values": self.values}

    inputs = keras.Input((4,))
    trunk = keras.layers.Dense(8, activation="relu", name="trunk")(inputs)
    model = kt.upgrade(keras.Model(inputs, {"a": keras.layers.Dense(1, name="a")(trunk),
                                            "b": keras.layers.Dense(1, name="b")(trunk)}))
    model.compile(optimizer="sgd", loss={"a": "mse", "b": "mse"},
                  task_balancing=Fixed([0.3, 0.7]))
    x = np.random.rand(16, 4)
    model.fit(x, {"a": np.random.rand(16, 1), "b": np.random.rand(16, 1)}, verbose=0)
    ```
    """

    kind = "weighting"
    takes_shared = False

    def __init__(self, tasks: Sequence[str] | None = None) -> None:
        super().__init__(tasks=tasks)

    def pass_weights(self, context: StepContext) -> tf.Tensor:
        """`[K]` multipliers of the task losses in this pass's backward pass."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement pass_weights(context) -> [K] weights."
        )

    def bind(self, model: keras.Model, tree: LayerTree) -> TaskEngine:
        require_override(
            self,
            "LossWeighting",
            "pass_weights(context)",
            LossWeighting.pass_weights,
            "returns the [K] multipliers of the task losses",
            "task_balancing",
        )
        return super().bind(model, tree)


def _validate_shared(shared):
    try:
        return selectors.validate_selector(shared)
    except (TypeError, ValueError) as error:
        raise type(error)(task_resolution._as_shared(str(error))) from None
