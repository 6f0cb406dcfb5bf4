"""The gradient transforms on true gradients in a stateless JAX step.

What `keras_tapeops.true_gradients.apply_transformed` does on TensorFlow,
for the JAX steps (`TapeOpsMixin`'s and each GAN player's): the gradients are
unscaled (a LossScaleOptimizer's dynamic scale or a static
`loss_scale_factor`), the gates decide and the transforms run on the true
gradients, then the result is scaled again for the optimizer's
`stateless_apply`, which divides by the scale once more. The scale of a
LossScaleOptimizer is a power of two, so unscaling and rescaling are exact.
An overflow stays an overflow: when the true gradients are not all finite,
a LossScaleOptimizer gets them untransformed (a clip could have made them
finite), so it skips the step and lowers its scale, as on TensorFlow; a step
a gate skips reaches it as nan, for the same reason.
"""

from __future__ import annotations

from typing import Any
from typing import Callable
from typing import Sequence

import keras
from keras import ops

#: `(true_grads, values) -> keep` (a scalar bool or None) or `-> grads`.
StepFunction = Callable[[list[Any], list[Any]], Any]


def true_transformed(
    optimizer: Any,
    scale: Any,
    grads: Sequence[Any],
    values: Sequence[Any],
    decide: StepFunction,
    transform: StepFunction,
) -> tuple[list[Any], Any]:
    """Unscales `grads`, lets `decide` and `transform` see them, scales the result again.

    Call it inside the step's metric scope: the gates and transforms may
    update metrics and training state.

    Args:
        optimizer: the optimizer that applies the result.
        scale: the step's loss scale (`backend/jax/loss.loss_scale`), or None.
        grads: the (loss-scaled) gradients; None entries stay None.
        values: the variables' values, in the same order.
        decide: the gates' decision on the true gradients (None: no gate).
        transform: the transforms on the true gradients.

    Returns:
        `(grads, keep)`: the gradients for `stateless_apply`, and the gates'
        decision (None without gates).

    Example:
    ```python
    grads, keep = true_transformed(optimizer, scale, grads, values,
                                   lambda g, v: keep_step_decision(bound, g, v),
                                   lambda g, v: apply_in_order(bound, g, v))
    ```
    """
    grads, values = list(grads), list(values)
    if scale is not None:
        grads = [g if g is None else g / ops.cast(scale, g.dtype) for g in grads]
    keep = decide(grads, values)
    new_grads = list(transform(grads, values))
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        finite = ops.all(ops.stack([ops.all(ops.isfinite(g)) for g in grads if g is not None]))
        new_grads = [
            new if new is None or old is None else ops.where(finite, new, old)
            for new, old in zip(new_grads, grads)
        ]
        if keep is not None:  # the LossScaleOptimizer skips it as an overflow
            nan = float("nan")
            new_grads = [g if g is None else ops.where(keep, g, nan) for g in new_grads]
    if scale is not None:
        new_grads = [g if g is None else g * ops.cast(scale, g.dtype) for g in new_grads]
    return new_grads, keep
