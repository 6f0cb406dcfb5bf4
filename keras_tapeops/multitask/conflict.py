"""`MeasureConflict`: log whether the tasks' gradients conflict, without changing training.

The step is the stock one (the gradient of the summed loss). Every `every`
applied optimizer steps the per-task gradients of the shared variables are
also computed, and their norms and pairwise cosine similarities are logged
(`<task>_grad_norm`, `cosine_<a>_<b>`, the mean over the measured steps of
the epoch). Negative cosines that persist are the sign that gradient surgery
(PCGrad, CAGrad, UPGrad...) may help; if the cosines stay positive, the
plain sum is likely as good (Kurin et al., 2022). The other steps cost
nothing extra.
"""

from __future__ import annotations

from typing import Any
from typing import Sequence

from keras_tapeops import validation
from keras_tapeops.multitask.option import TaskBalancing
from keras_tapeops.registration import register
from keras_tapeops.selectors import Selector


@register
class MeasureConflict(TaskBalancing):
    """Measure task-gradient conflict every `every` steps (training unchanged).

    Args:
        every: measure on applied steps `0, every, 2 * every, ...`.
        shared: selector of the shared variables.
        tasks: None or the output names that are tasks.

    Example:
    ```python
    inputs = keras.Input((8,))
    features = keras.Sequential([keras.layers.Dense(16, activation="relu")], name="trunk")(inputs)
    model = kt.upgrade(keras.Model(inputs, {"a": keras.layers.Dense(1, name="a")(features),
                                            "b": keras.layers.Dense(1, name="b")(features)}))
    model.compile(optimizer="adam", loss={"a": "mse", "b": "mse"},
                  task_balancing=kt.MeasureConflict(every=10))
    ```
    """

    kind = "conflict"
    logs_weights = False

    def __init__(
        self,
        every: int = 10,
        shared: Selector = None,
        tasks: Sequence[str] | None = None,
    ) -> None:
        super().__init__(shared=shared, tasks=tasks)
        self.every = validation.positive_int(every, "every")

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "every": self.every}
