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
import tensorflow as tf

from keras_tapeops import validation

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
                factor = _clip_factor(tf.sqrt(squared_norm(g, v)), self.clip_norm)
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
        factor = _clip_factor(tf.sqrt(tf.add_n(group)), self.clip_norm)
        return [
            scale(g, factor) if on and g is not None else g
            for g, on in zip(grads, selected)
        ]

    def get_config(self) -> dict[str, Any]:
        return {"clip_norm": self.clip_norm, **super().get_config()}


def squared_norm(grad: Any, variable: Any = None) -> tf.Tensor:
    """Sum of squares of `grad` as float32; repeated sparse rows are summed first.

    Args:
        grad: a tensor or `tf.IndexedSlices`.
        variable: the matching variable (gives a static row count for sparse
            gradients, which XLA needs); optional.

    Returns:
        A float32 scalar.
    """
    if isinstance(grad, tf.IndexedSlices):
        grad = _summed_rows(grad, variable)[0]
    grad = tf.cast(grad, "float32")
    return tf.reduce_sum(tf.square(grad))


def scale(grad: Any, factor: Any) -> Any:
    """Multiplies `grad` (tensor or IndexedSlices) by the float32 scalar `factor`."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(
            grad.values * tf.cast(factor, grad.values.dtype),
            grad.indices,
            grad.dense_shape,
        )
    return grad * tf.cast(factor, grad.dtype)


def clip_by_value(grad: Any, clip_value: float, variable: Any = None) -> Any:
    """Clips entries to `[-clip_value, clip_value]`; sparse repeats are summed first.

    Args:
        grad: a tensor or `tf.IndexedSlices`.
        clip_value: positive float.
        variable: the matching variable (static row count); optional.

    Returns:
        The clipped gradient, of the same kind as `grad`.
    """
    if not isinstance(grad, tf.IndexedSlices):
        return tf.clip_by_value(grad, -clip_value, clip_value)
    summed, counts = _summed_rows(grad, variable)
    clipped = tf.clip_by_value(summed, -clip_value, clip_value)
    # Each occurrence of a row gets clipped_row / count: the occurrences sum
    # back to exactly the clipped row when the optimizer scatters them.
    per_row = clipped / tf.maximum(counts, 1.0)
    values = tf.cast(tf.gather(per_row, grad.indices), grad.values.dtype)
    return tf.IndexedSlices(values, grad.indices, grad.dense_shape)


def _summed_rows(grad, variable):
    """Dense float32 rows of an IndexedSlices (repeats summed) and row counts."""
    if variable is not None and variable.shape[0] is not None:
        rows = variable.shape[0]
    else:
        rows = tf.cast(grad.dense_shape[0], grad.indices.dtype)
    values = tf.cast(grad.values, "float32")
    summed = tf.math.unsorted_segment_sum(values, grad.indices, rows)
    ones = tf.ones(tf.shape(grad.indices), "float32")
    counts = tf.math.unsorted_segment_sum(ones, grad.indices, rows)
    counts = tf.reshape(counts, [-1] + [1] * (values.shape.rank - 1))
    return summed, counts


def _clip_factor(norm, clip_norm):
    """`clip_norm / max(norm, clip_norm)`: 1 when under the bound."""
    clip_norm = tf.constant(clip_norm, "float32")
    return clip_norm / tf.maximum(norm, clip_norm)
