"""The input-gradient penalties' shared math, backend-neutral (`keras.ops`).

`per_sample_norm` (the safe per-sample L2 norm of input gradients) and
`validate_target`, used by `kt.gradient_penalty` and the GAN penalties
(TensorFlow) and by `kt.GradientPenalty` (TensorFlow and JAX).
"""

from __future__ import annotations

from typing import Any
from typing import Sequence

from keras import ops

from keras_tapeops import validation
from keras_tapeops.transforms.clipping import add_n

_TINY = 1e-30


def per_sample_norm(grads: Sequence[Any]) -> Any:
    """Per-sample L2 norm of a list of batch-first tensors, taken jointly.

    Safe at zero: the squared norm is clamped below at 1e-30 (so a zero
    gradient has norm 1e-15, not 0), which makes its derivative 0 there
    instead of the infinite derivative of `sqrt` at 0: no NaN/inf in double
    backprop. Norms above 1e-15 are exact.

    Args:
        grads: list of tensors with the same batch size (None entries, e.g.
            for inputs the outputs do not depend on, are skipped).

    Returns:
        A float32 tensor of shape `(batch,)`.

    Example:
    ```python
    norm = per_sample_norm([keras.ops.ones((4, 3))])   # [1.732..] * 4
    ```
    """
    squares = []
    for g in grads:
        if g is None:
            continue
        g = ops.cast(g, "float32")
        rank = len(g.shape) if _known_rank(g) else None
        if rank is None:  # a TensorFlow tensor of unknown rank
            import tensorflow as tf

            g = tf.reshape(g, [tf.shape(g)[0], -1])
            rank = 2
        squares.append(ops.sum(ops.square(g), axis=tuple(range(1, rank))))
    if not squares:
        raise ValueError(
            "The outputs do not depend on any float input, so there is no input "
            "gradient to penalize. Received: gradients that are all None"
        )
    squared = add_n(squares)
    # Below 1e-30 the norm is clamped to 1e-15 and its gradient is 0: exact
    # elsewhere, and never the infinite derivative of sqrt at 0.
    return ops.sqrt(ops.maximum(squared, _TINY))


def validate_target(target: Any) -> float:
    """Checks a penalty `target` (a non-negative finite number); returns it as float."""
    return validation.non_negative_number(target, "target")


def _known_rank(tensor: Any) -> bool:
    """False for a TensorFlow tensor whose rank is unknown at trace time."""
    shape = tensor.shape
    return getattr(shape, "rank", len(shape)) is not None
