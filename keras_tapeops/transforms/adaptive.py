"""Unit-wise transforms: adaptive gradient clipping and gradient centralization.

Both work per *unit* of a weight tensor, with Keras's kernel layouts, where
the output axis is the last one: a `Dense` kernel is `(in, out)`, a `Conv2D`
kernel `(h, w, in, out)` (HWIO), a `Conv1D`/`Conv3D` kernel the same with one
or three spatial axes. A unit is one output channel: the slice `w[..., j]`.

- Tensors of rank >= 2: one unit per output channel; norms and means are
  taken over every axis but the last.
- Tensors of rank <= 1 (biases, BatchNormalization's gamma/beta, scalars):
  the whole tensor is one unit (`AdaptiveClip`); `CentralizeGradients`
  leaves them unchanged.

Sparse gradients (`tf.IndexedSlices`, e.g. from `Embedding`): repeated rows
are summed first (see `clipping.py`). `AdaptiveClip` keeps them sparse (its
per-unit factor multiplies the values); `CentralizeGradients` returns a
dense gradient, since subtracting a column mean changes every row.

References: Brock et al. 2021, "High-Performance Large-Scale Image
Recognition Without Normalization" (NFNets, adaptive gradient clipping);
Yong et al. 2020, "Gradient Centralization". Compare optax's
`adaptive_grad_clip` and `centralize`, written for other layouts (see
docs/observability.md for the exact differences).
"""

from typing import Any
from typing import Sequence

import keras
from keras import ops

from keras_tapeops import validation
from keras_tapeops.transforms import sparse
from keras_tapeops.registration import register
from keras_tapeops.transforms.base import GradientTransform
from keras_tapeops.transforms.base import TransformState
from keras_tapeops.selectors import Selector
from keras_tapeops.transforms.clipping import _summed_rows

# optax and the NFNets reference floor the gradient norm at this value in the
# clip factor `max_norm / max(grad_norm, 1e-6)`.
_MIN_GRAD_NORM = 1e-6


@register
class AdaptiveClip(GradientTransform):
    """Unit-wise adaptive gradient clipping (AGC, Brock et al. 2021, NFNets).

    For every unit (output channel) of each selected weight, with `W` the
    unit's current weights and `G` its gradient (L2 norms over the unit):

        max_norm = clipping * max(||W||, eps)
        G <- G                             if ||G|| < max_norm
        G <- G * max_norm / max(||G||, 1e-6)   otherwise

    so every unit's gradient norm is at most `clipping` times its weight
    norm (`eps` lets zero-initialized weights, such as biases, move). Units
    follow Keras's layouts: for rank >= 2 a unit is an output channel and
    the norm runs over every axis but the last (Dense `(in, out)`: a
    column; Conv2D HWIO: an `(h, w, in)` block); a tensor of rank <= 1 is
    one unit. The gradient is the true gradient (unscaled, summed over
    replicas), and `W` is the weight before this step's update.

    The NFNets paper does not clip the final classifier layer; exclude it
    with `where=`, for example `where=lambda v: not v.path.startswith("head/")`
    or a glob that names the other layers. Clip after other transforms that
    should see the raw gradient (e.g. after `kt.LogGradientNorm`).

    Args:
        clipping: positive number, the largest ratio of unit gradient norm to
            unit weight norm (the paper uses 0.01 to 0.16, smaller for larger
            batches).
        eps: positive number, the smallest weight norm used (the paper's 1e-3).
        where: selector of the variables to clip (None: all).

    Returns:
        A transform for `compile(gradient_transforms=[...])`.

    Example:
    ```python
    model.compile(optimizer="sgd", loss="mse", gradient_transforms=[
        kt.AdaptiveClip(0.01, where="backbone/*"),   # not the classifier head
    ])
    ```
    """

    def __init__(self, clipping: float = 0.01, eps: float = 1e-3, where: Selector = None) -> None:
        super().__init__(where=where)
        self.clipping = validation.positive_number(clipping, "clipping")
        self.eps = validation.positive_number(eps, "eps")

    def transform(
        self, grads: Sequence[Any], variables: Sequence[keras.Variable], state: TransformState
    ) -> list[Any]:
        return [
            adaptive_clip(g, v, self.clipping, self.eps) if on and g is not None else g
            for g, v, on in zip(grads, variables, state.selected)
        ]

    def get_config(self) -> dict[str, Any]:
        return {"clipping": self.clipping, "eps": self.eps, **super().get_config()}


@register
class CentralizeGradients(GradientTransform):
    """Gradient centralization (Yong et al. 2020): zero-mean kernel gradients per unit.

    For each selected weight of rank > 1, subtracts from the gradient its
    mean over every axis but the last (the output axis in Keras's layouts:
    Dense `(in, out)`, Conv HWIO), so each output channel's gradient has
    zero mean. Gradients of rank <= 1 (biases, normalization scales) pass
    through unchanged. A sparse gradient (`Embedding`) becomes dense.

    Args:
        where: selector of the variables (None: all).

    Returns:
        A transform for `compile(gradient_transforms=[...])`.

    Example:
    ```python
    model.compile(optimizer="sgd", loss="mse",
                  gradient_transforms=[kt.CentralizeGradients()])
    ```
    """

    def transform(
        self, grads: Sequence[Any], variables: Sequence[keras.Variable], state: TransformState
    ) -> list[Any]:
        return [
            centralize(g, v) if on and g is not None else g
            for g, v, on in zip(grads, variables, state.selected)
        ]


def unit_axes(rank):
    """The axes a unit's norm or mean runs over: all but the last, or all for rank <= 1."""
    if rank <= 1:
        return None
    return tuple(range(rank - 1))


def unit_norm(tensor):
    """Float32 L2 norm of each unit, shaped to broadcast against `tensor`.

    Args:
        tensor: a dense tensor (a weight or a gradient).

    Returns:
        For rank >= 2, shape `(1, ..., 1, out)`; for rank <= 1, a scalar.
    """
    tensor = ops.cast(tensor, "float32")
    axes = unit_axes(len(tensor.shape))
    keepdims = axes is not None
    return ops.sqrt(ops.sum(ops.square(tensor), axis=axes, keepdims=keepdims))


def adaptive_clip(grad, variable, clipping, eps):
    """AGC of one gradient against its variable's current value (see `AdaptiveClip`).

    Args:
        grad: a tensor or `tf.IndexedSlices`.
        variable: the matching variable (its value before the update).
        clipping: positive float.
        eps: positive float.

    Returns:
        The clipped gradient, of the same kind and dtype as `grad`.
    """
    weight_norm = unit_norm(ops.convert_to_tensor(variable))
    max_norm = clipping * ops.maximum(weight_norm, eps)
    is_sparse = sparse.is_sparse(grad)
    if is_sparse:
        dense = _summed_rows(grad, variable)[0]
    else:
        grad = dense = ops.convert_to_tensor(grad)
    grad_norm = unit_norm(dense)
    factor = ops.where(
        grad_norm < max_norm,
        ops.ones_like(grad_norm),
        max_norm / ops.maximum(grad_norm, _MIN_GRAD_NORM),
    )
    if is_sparse:
        # The factor varies only along the last axis (or is a scalar): it
        # broadcasts against the value rows, and scaling is linear, so
        # repeated rows are fine.
        if len(factor.shape):
            factor = ops.reshape(factor, [-1])
        return sparse.scale_values(grad, factor)
    return grad * ops.cast(factor, grad.dtype)


def centralize(grad, variable=None):
    """`grad` minus its mean over every axis but the last (rank > 1), else unchanged.

    Args:
        grad: a tensor or `tf.IndexedSlices` (returned dense).
        variable: the matching variable (static row count for sparse
            gradients); optional.

    Returns:
        The centralized gradient.
    """
    if sparse.is_sparse(grad):
        if len(grad.values.shape) <= 1:
            return grad
        grad = ops.cast(_summed_rows(grad, variable)[0], grad.values.dtype)
    grad = ops.convert_to_tensor(grad)
    rank = len(grad.shape)
    if rank <= 1:
        return grad
    mean = ops.mean(ops.cast(grad, "float32"), axis=unit_axes(rank), keepdims=True)
    return grad - ops.cast(mean, grad.dtype)
