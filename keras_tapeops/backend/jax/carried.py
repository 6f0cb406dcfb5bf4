"""Training state the stateless JAX step carries as metric variables.

Keras's JAX trainer threads four groups of variables through every step
(trainable, non-trainable, optimizer, metrics) and writes them back at the end
of an epoch. Training state that is neither a weight nor an optimizer slot
(an accumulation window, a transform's counter) rides in the metrics group:
a `CarriedState` is listed in `model.metrics`, so the step receives and
returns its variables, `DataParallel` replicates them, and it is not a weight
(weight files stay stock). It logs nothing, and `reset_metrics()` (which
`fit` and `evaluate` call) leaves it alone.
"""

from __future__ import annotations

from typing import Any
from typing import Sequence

import keras


class CarriedState(keras.metrics.Metric):
    """A metric that only carries variables through the JAX step (nothing logged).

    Args:
        name: the metric's name (never a log key).

    Example:
    ```python
    class Counter(CarriedState):
        def __init__(self):
            super().__init__(name="counter")
            self.count = self.add_variable((), "zeros", "float32", name="count")
    ```
    """

    def update_state(self, *args: Any, **kwargs: Any) -> None:
        """Not a logged metric: the step assigns its variables."""
        raise NotImplementedError(f"{self.name} is updated by the JAX step.")

    def result(self) -> dict[str, Any]:
        """Nothing is logged."""
        return {}

    def reset_state(self) -> None:
        """Kept across `reset_metrics()`."""


class TransformVariables(CarriedState):
    """The bound gradient transforms' training-state variables (`state.add_variable`).

    Args:
        variables: the variables, in the transforms' order.

    Example:
    ```python
    carried = TransformVariables([v for _, s in bound for v in s.variables.values()])
    ```
    """

    def __init__(self, variables: Sequence[keras.Variable]) -> None:
        super().__init__(name="tapeops_transform_state")
        self._carried = list(variables)

    @property
    def variables(self) -> list[keras.Variable]:
        """The transforms' variables (what the JAX step carries)."""
        return list(self._carried)


class EvaluationStep(CarriedState):
    """The optimizer's step as evaluation reads it (scheduled term weights).

    The JAX evaluation step carries no optimizer state, and a value read from
    `optimizer.iterations` inside it would be traced in as a constant; this
    variable is set from `optimizer.iterations` before each evaluation and
    carried with the metrics (see `TapeOpsMixin.evaluate` on JAX).

    Example:
    ```python
    carried = EvaluationStep()
    carried.step.assign(model.optimizer.iterations)
    ```
    """

    def __init__(self) -> None:
        super().__init__(name="tapeops_evaluation_step")
        self.step = self.add_variable((), "zeros", "float32", name="step")
