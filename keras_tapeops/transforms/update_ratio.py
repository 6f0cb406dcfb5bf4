"""`LogUpdateRatio`: how far one optimizer step moved a group, relative to its size."""

from typing import Any
from typing import Sequence

import keras
from keras import ops

from keras_tapeops import validation
from keras_tapeops.paths import LayerTree
from keras_tapeops.registration import register
from keras_tapeops.transforms.base import GradientTransform
from keras_tapeops.transforms.base import TransformState
from keras_tapeops.transforms.clipping import add_n
from keras_tapeops.selectors import Selector


@register
class LogUpdateRatio(GradientTransform):
    """Logs `||applied update|| / ||weights||` of the selected group, per step.

    After each optimizer step, with `W` the selected variables before the
    step and `W'` after it (both taken as one flat vector over the group):

        ratio = ||W' - W|| / ||W||

    The update is what the optimizer actually applied (learning rate,
    momentum, Adam's scaling and weight decay included), not the gradient.
    The ratio is logged under `name` as the epoch's mean over optimizer
    steps in History, the progress bar and TensorBoard. A common rule of
    thumb is a ratio around 1e-3 per step; much larger values mean the
    learning rate is too high for that group.

    A skipped step (by `kt.SkipNonFinite`, or a mixed-precision overflow
    the LossScaleOptimizer skips) applies no update and logs 0. A step where
    the group's weights have norm 0 (or the ratio is not finite) is not
    counted. With `accumulation_steps=k` one value is logged per applied
    window, not per batch. The gradients pass through unchanged; the
    position of this transform in the list does not matter.

    Args:
        where: selector of the group (None: all trainable variables).
        name: the logged name.

    Returns:
        A transform for `compile(gradient_transforms=[...])`.

    Example:
    ```python
    model.compile(optimizer="adam", loss="mse", gradient_transforms=[
        kt.LogUpdateRatio(where="backbone/*", name="backbone_update"),
        kt.LogUpdateRatio(where="head", name="head_update"),
    ])
    ```
    """

    needs_previous_values = True

    def __init__(self, where: Selector = None, name: str = "update_ratio") -> None:
        super().__init__(where=where)
        self.name = validation.name(name, "name")

    def bind(
        self, model: keras.Model, variables: Sequence[keras.Variable], tree: LayerTree | None = None
    ) -> TransformState:
        state = super().bind(model, variables, tree)
        state.add_metric(keras.metrics.Mean(name=self.name))
        return state

    def transform(
        self, grads: Sequence[Any], variables: Sequence[keras.Variable], state: TransformState
    ) -> list[Any]:
        return list(grads)

    def after_apply(
        self, variables: Sequence[keras.Variable], previous: Any, state: TransformState
    ) -> None:
        update, weights = [], []
        for v, old in zip(variables, previous):
            if old is None:  # not selected
                continue
            old = ops.cast(old, "float32")
            new = ops.cast(ops.convert_to_tensor(v), "float32")
            update.append(ops.sum(ops.square(new - old)))
            weights.append(ops.sum(ops.square(old)))
        if not update:
            return None
        ratio = ops.sqrt(add_n(update)) / ops.sqrt(add_n(weights))
        counted = ops.isfinite(ratio)
        state.metrics[self.name].update_state(
            ops.where(counted, ratio, 0.0), sample_weight=ops.cast(counted, "float32")
        )
        return None

    def get_config(self) -> dict[str, Any]:
        return {"name": self.name, **super().get_config()}
