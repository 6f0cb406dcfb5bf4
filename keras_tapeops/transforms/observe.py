"""`LogGradientNorm`: the L2 norm of a group's true gradient, logged every epoch."""

from typing import Any
from typing import Sequence

import keras
from keras import ops

from keras_tapeops import validation
from keras_tapeops.paths import LayerTree
from keras_tapeops.registration import register
from keras_tapeops.transforms.base import GradientTransform
from keras_tapeops.transforms.base import TransformState
from keras_tapeops.selectors import Selector
from keras_tapeops.transforms.clipping import add_n
from keras_tapeops.transforms.clipping import squared_norm


@register
class LogGradientNorm(GradientTransform):
    """Logs the L2 norm of the selected gradients at its place in the transform list.

    The norm is taken over the whole selected group (like
    `ClipByGlobalNorm`), on true gradients (unscaled under mixed precision,
    summed over replicas), at this point of the list: put one before and one
    after a clipping rule to see both. It is logged under `name` as the
    epoch's mean over steps (and `<name>_max`, the epoch's largest value, if
    `log_max=True`) in History, the progress bar and TensorBoard. Steps whose
    gradient is not finite (a mixed-precision overflow) are not counted. The
    gradients pass through unchanged.

    Args:
        where: selector of the group (None: all trainable variables).
        name: the logged name.
        log_max: also log the epoch's largest norm as `<name>_max`.

    Returns:
        A transform for `compile(gradient_transforms=[...])`.

    Example:
    ```python
    model.compile(optimizer="adam", loss="mse", gradient_transforms=[
        kt.LogGradientNorm(name="grad_norm"),
        kt.ClipByGlobalNorm(1.0),
        kt.LogGradientNorm(name="clipped_norm"),
    ])
    ```
    """

    def __init__(
        self, where: Selector = None, name: str = "grad_norm", log_max: bool = False
    ) -> None:
        super().__init__(where=where)
        self.name = validation.name(name, "name")
        self.log_max = validation.boolean(log_max, "log_max")

    def bind(
        self, model: keras.Model, variables: Sequence[keras.Variable], tree: LayerTree | None = None
    ) -> TransformState:
        state = super().bind(model, variables, tree)
        state.add_metric(keras.metrics.Mean(name=self.name))
        if self.log_max:
            state.add_metric(EpochMax(name=self.name + "_max"))
        return state

    def transform(
        self, grads: Sequence[Any], variables: Sequence[keras.Variable], state: TransformState
    ) -> list[Any]:
        group = [
            squared_norm(g, v)
            for g, v, on in zip(grads, variables, state.selected)
            if on and g is not None
        ]
        norm = ops.sqrt(add_n(group)) if group else ops.zeros((), "float32")
        finite = ops.cast(ops.isfinite(norm), "float32")
        safe = ops.where(finite > 0, norm, 0.0)
        state.metrics[self.name].update_state(safe, sample_weight=finite)
        if self.log_max:
            state.metrics[self.name + "_max"].update_state(safe)
        return list(grads)

    def get_config(self) -> dict[str, Any]:
        return {"name": self.name, "log_max": self.log_max, **super().get_config()}


class EpochMax(keras.metrics.Metric):
    """The largest value seen since the last reset (reset every epoch by fit).

    Args:
        name: the logged name.

    Example:
    ```python
    m = EpochMax(name="grad_norm_max"); m.update_state(3.0); float(m.result())
    ```
    """

    def __init__(self, name="max", dtype=None):
        super().__init__(name=name, dtype=dtype)
        self.value = self.add_variable(
            shape=(), initializer="zeros", name="value", aggregation="mean"
        )

    def update_state(self, value):
        self.value.assign(ops.maximum(self.value, ops.cast(value, self.value.dtype)))

    def result(self):
        return ops.copy(self.value)  # a read, not the variable itself (TF)

    def reset_state(self):
        self.value.assign(0.0)
