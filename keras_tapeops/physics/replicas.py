"""How a physics term shares its points among the replicas of a `tf.distribute` step.

The collocation points are not the batch, so `fit` does not split them. Each
replica evaluates every `R`-th point (replica `r` takes points `r, r + R, ...`)
and returns `R * sum(its squared residuals) / total count`. The step divides
each replica's loss by `R` (as Keras scales losses) and sums the gradients
over replicas, so the update is that of the plain mean over all points: two
replicas equal one device, for any number of points, and the collocation work
is divided among the replicas instead of repeated.
"""

import tensorflow as tf


def replica_share(n):
    """Indices of the points this replica evaluates, and the replica count.

    Args:
        n: the total number of points (a Python int).

    Returns:
        `(indices, replicas)`: `indices` a 1-D int32 tensor (None outside a
        multi-replica step: take every point) and `replicas` an int.
    """
    context = tf.distribute.get_replica_context()
    replicas = context.num_replicas_in_sync if context is not None else 1
    if replicas == 1:
        return None, 1
    replica = tf.cast(context.replica_id_in_sync_group, "int32")
    return tf.range(replica, n, replicas), replicas


def take(values, indices):
    """`values` restricted to `indices` (all of it when `indices` is None)."""
    if indices is None or values is None:
        return values
    return tf.gather(values, indices)


def shared_mean(squares, total, replicas):
    """This replica's part of the mean over all replicas: `R * sum / total`.

    Args:
        squares: this replica's squared residuals (any shape, float32).
        total: the number of squared residuals over all replicas.
        replicas: the replica count `R`.

    Returns:
        A float32 scalar; summed over replicas and divided by `R`, the mean.
    """
    return tf.reduce_sum(squares) * (float(replicas) / float(total))
