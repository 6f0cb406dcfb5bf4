"""Batch size and the replica scaling of losses, shared by every step.

Keras divides each replica's loss by the number of replicas in sync before
differentiating (so the summed gradients are those of the global mean) and
multiplies it back before logging. Loss terms, GANs, meta-learning and the
engines scale their own values the same way, with these helpers.
"""

import tensorflow as tf


def batch_size(x):
    """Number of samples in `x` (first dimension of its first tensor).

    Args:
        x: a tensor or a nested structure of tensors (None entries skipped).

    Returns:
        A scalar int32 tensor.

    Example:
    ```python
    batch_size({"a": tf.zeros([4, 2]), "b": None})  # 4
    ```
    """
    first = next(t for t in tf.nest.flatten(x) if t is not None)
    return tf.shape(first)[0]


def num_replicas():
    """Replicas in sync under the current `tf.distribute` strategy (1 without)."""
    return tf.distribute.get_strategy().num_replicas_in_sync


def scale_for_distribution(value):
    """Divides by the number of replicas, as Keras scales losses."""
    n = num_replicas()
    if n > 1:
        value = value * tf.cast(1.0 / n, value.dtype)
    return value


def unscale_for_distribution(value):
    """Multiplies by the number of replicas, as Keras does before logging."""
    n = num_replicas()
    if n > 1:
        value = value * tf.cast(n, value.dtype)
    return value
