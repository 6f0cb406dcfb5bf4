"""TensorFlow's sparse gradients (`tf.IndexedSlices`, e.g. from `Embedding`).

The transforms' dense math is `keras.ops` (every backend); these helpers are
only reached for a gradient `is_sparse` says is sparse, so only on
TensorFlow, which they import then.
"""

from __future__ import annotations

import sys
from typing import Any


def is_sparse(grad: object) -> bool:
    """True for a `tf.IndexedSlices` gradient (an embedding's, on TensorFlow).

    JAX gradients are always dense; TensorFlow is not imported to answer.

    Args:
        grad: a gradient (tensor, IndexedSlices or None).

    Returns:
        A bool.
    """
    tf = sys.modules.get("tensorflow")
    return tf is not None and isinstance(grad, tf.IndexedSlices)


def dense(grad: Any) -> Any:
    """`grad` as a dense tensor (an IndexedSlices is converted; others as they are)."""
    if not is_sparse(grad):
        return grad
    import tensorflow as tf

    return tf.convert_to_tensor(grad)


def summed_rows(grad: Any, variable: Any = None) -> tuple[Any, Any]:
    """Dense float32 rows of an IndexedSlices (repeats summed) and row counts.

    Args:
        grad: a `tf.IndexedSlices`.
        variable: the matching variable (gives a static row count, which
            XLA needs); optional.

    Returns:
        `(summed, counts)`: the dense rows and, shaped to broadcast against
        them, how many times each row occurs.
    """
    import tensorflow as tf

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


def scale_values(grad: Any, factor: Any) -> Any:
    """Multiplies an IndexedSlices' values by `factor` (broadcast against a row)."""
    import tensorflow as tf

    values = grad.values * tf.cast(factor, grad.values.dtype)
    return tf.IndexedSlices(values, grad.indices, grad.dense_shape)


def clip_by_value(grad: Any, clip_value: float, variable: Any = None) -> Any:
    """Clips the summed rows; each occurrence gets `clipped_row / count`.

    The occurrences sum back to exactly the clipped row when the optimizer
    scatters them.
    """
    import tensorflow as tf

    summed, counts = summed_rows(grad, variable)
    clipped = tf.clip_by_value(summed, -clip_value, clip_value)
    per_row = clipped / tf.maximum(counts, 1.0)
    values = tf.cast(tf.gather(per_row, grad.indices), grad.values.dtype)
    return tf.IndexedSlices(values, grad.indices, grad.dense_shape)
