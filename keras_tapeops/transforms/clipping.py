"""Clipping transforms: by value, by per-tensor norm, by group global norm.

All three act on the true gradients the step hands them (unscaled under mixed
precision, summed over replicas under `tf.distribute`) and only on the
variables their `where=` selects; other gradients and `None` pass through.

Sparse gradients (`tf.IndexedSlices`, e.g. from `Embedding`) stay sparse.
Their indices may repeat (a token seen twice in a batch, or the all-gather
that aggregates sparse gradients across replicas), so norms and value clips
are computed on the summed rows (`tf.math.unsorted_segment_sum`), i.e. on the
dense gradient the optimizer will effectively apply; norm clipping then
scales the values (scaling is linear, so repeats are fine), and value
clipping spreads each clipped row evenly over its repeats.
"""

from typing import Any
from typing import Sequence

import keras
from keras import ops

from keras_tapeops import validation
from keras_tapeops.transforms import sparse

from keras_tapeops.registration import register
from keras_tapeops.selectors import Selector
from keras_tapeops.transforms.base import GradientTransform
from keras_tapeops.transforms.base import TransformState


@register
class ClipByValue(GradientTransform):
    """Clips every entry of each selected gradient to `[-clip_value, clip_value]`.

    Args:
        clip_value: positive number, the largest absolute value kept.
        where: selector of the variables to clip (None: all).

    Returns:
        A transform for `compile(gradient_transforms=[...])`.

    Example:
    ```python
    model.compile(optimizer="sgd", loss="mse",
                  gradient_transforms=[kt.ClipByValue(0.5, where="head*")])
    ```
    """

    def __init__(self, clip_value: float, where: Selector = None) -> None:
        super().__init__(where=where)
        self.clip_value = validation.positive_number(clip_value, "clip_value")

    def transform(
        self, grads: Sequence[Any], variables: Sequence[keras.Variable], state: TransformState
    ) -> list[Any]:
        selected = state.selected
        return [
            clip_by_value(g, self.clip_value, v) if on and g is not None else g
            for g, v, on in zip(grads, variables, selected)
        ]

    def get_config(self) -> dict[str, Any]:
        return {"clip_value": self.clip_value, **super().get_config()}


@register
class ClipByNorm(GradientTransform):
    """Rescales each selected gradient whose L2 norm exceeds `clip_norm`.

    Each tensor is clipped separately, like `tf.clip_by_norm`:
    `g * clip_norm / max(norm(g), clip_norm)`.

    Args:
        clip_norm: positive number, the largest norm of each tensor.
        where: selector of the variables to clip (None: all).

    Returns:
        A transform for `compile(gradient_transforms=[...])`.

    Example:
    ```python
    model.compile(optimizer="sgd", loss="mse",
                  gradient_transforms=[kt.ClipByNorm(1.0, where="head*")])
    ```
    """

    def __init__(self, clip_norm: float, where: Selector = None) -> None:
        super().__init__(where=where)
        self.clip_norm = validation.positive_number(clip_norm, "clip_norm")

    def transform(
        self, grads: Sequence[Any], variables: Sequence[keras.Variable], state: TransformState
    ) -> list[Any]:
        selected = state.selected
        out = []
        for g, v, on in zip(grads, variables, selected):
            if on and g is not None:
                factor = _clip_factor(ops.sqrt(squared_norm(g, v)), self.clip_norm)
                g = scale(g, factor)
            out.append(g)
        return out

    def get_config(self) -> dict[str, Any]:
        return {"clip_norm": self.clip_norm, **super().get_config()}


@register
class ClipByGlobalNorm(GradientTransform):
    """Rescales the selected gradients together if their joint norm exceeds `clip_norm`.

    One L2 norm over the whole selected group, like `tf.clip_by_global_norm`:
    every selected gradient is multiplied by
    `clip_norm / max(global_norm, clip_norm)`.

    Args:
        clip_norm: positive number, the largest norm of the group.
        where: selector of the group (None: all trainable variables).

    Returns:
        A transform for `compile(gradient_transforms=[...])`.

    Example:
    ```python
    model.compile(optimizer="sgd", loss="mse",
                  gradient_transforms=[kt.ClipByGlobalNorm(5.0, where="backbone*")])
    ```
    """

    def __init__(self, clip_norm: float, where: Selector = None) -> None:
        super().__init__(where=where)
        self.clip_norm = validation.positive_number(clip_norm, "clip_norm")

    def transform(
        self, grads: Sequence[Any], variables: Sequence[keras.Variable], state: TransformState
    ) -> list[Any]:
        selected = state.selected
        group = [
            squared_norm(g, v)
            for g, v, on in zip(grads, variables, selected)
            if on and g is not None
        ]
        if not group:
            return list(grads)
        factor = _clip_factor(ops.sqrt(add_n(group)), self.clip_norm)
        return [scale(g, factor) if on and g is not None else g for g, on in zip(grads, selected)]

    def get_config(self) -> dict[str, Any]:
        return {"clip_norm": self.clip_norm, **super().get_config()}


def squared_norm(grad: Any, variable: Any = None) -> Any:
    """Sum of squares of `grad` as float32; repeated sparse rows are summed first.

    Args:
        grad: a tensor or `tf.IndexedSlices`.
        variable: the matching variable (gives a static row count for sparse
            gradients, which XLA needs); optional.

    Returns:
        A float32 scalar.
    """
    if sparse.is_sparse(grad):
        grad = _summed_rows(grad, variable)[0]
    grad = ops.cast(grad, "float32")
    return ops.sum(ops.square(grad))


def scale(grad: Any, factor: Any) -> Any:
    """Multiplies `grad` (tensor or IndexedSlices) by the float32 scalar `factor`."""
    if sparse.is_sparse(grad):
        return sparse.scale_values(grad, factor)
    return grad * ops.cast(factor, grad.dtype)


def clip_by_value(grad: Any, clip_value: float, variable: Any = None) -> Any:
    """Clips entries to `[-clip_value, clip_value]`; sparse repeats are summed first.

    Args:
        grad: a tensor or `tf.IndexedSlices`.
        clip_value: positive float.
        variable: the matching variable (static row count); optional.

    Returns:
        The clipped gradient, of the same kind as `grad`.
    """
    if sparse.is_sparse(grad):
        return sparse.clip_by_value(grad, clip_value, variable)
    return ops.clip(grad, -clip_value, clip_value)


def _summed_rows(grad, variable):
    """Dense float32 rows of an IndexedSlices (repeats summed) and row counts."""
    return sparse.summed_rows(grad, variable)


def add_n(tensors):
    """The sum of a non-empty list of float32 scalars, in list order."""
    total = tensors[0]
    for tensor in tensors[1:]:
        total = total + tensor
    return total


def _clip_factor(norm, clip_norm):
    """`clip_norm / max(norm, clip_norm)`: 1 when under the bound."""
    clip_norm = ops.convert_to_tensor(clip_norm, "float32")
    return clip_norm / ops.maximum(norm, clip_norm)
