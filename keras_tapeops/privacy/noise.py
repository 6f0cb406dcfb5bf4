"""DP-SGD's Gaussian noise: drawn once per applied step, equal on every replica.

The noise of step `t` is a stateless normal keyed by `(seed, t, variable
index)`, `t = optimizer.iterations`: every replica (and every worker) draws
the same tensor, so two replicas equal one device, and a run with a given
seed is reproducible. Without a seed, each `compile()` draws a fresh 52-bit
seed from the operating system; under `tf.distribute` the first replica's
seed is used everywhere (shared in the step's one small all-reduce).
"""

import tensorflow as tf

from keras_tapeops.privacy.seeds import seed_halves


def replica_sums(local_count, seed):
    """The global sample count of the step and the seed of the first replica.

    One all-reduce of three float64 numbers, in replica context (none
    outside `tf.distribute` or with one replica).

    Args:
        local_count: this replica's sample count (float32 scalar).
        seed: this replica's seed (Python int).

    Returns:
        `(count, key)`: the float32 global count and an int64 `[2]` key.
    """
    high, low = seed_halves(seed)
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return local_count, tf.constant([high, low], tf.int64)
    first = tf.cast(tf.equal(context.replica_id_in_sync_group, 0), tf.float64)
    local = tf.stack([tf.cast(local_count, tf.float64), first * high, first * low])
    total = context.all_reduce(tf.distribute.ReduceOp.SUM, local)
    return tf.cast(total[0], tf.float32), tf.cast(total[1:], tf.int64)


def gaussian(shape, key, step, index, stddev):
    """A `N(0, stddev^2)` float32 tensor keyed by `(key, step, index)`.

    Example:
    ```python
    gaussian([3], tf.constant([1, 2], tf.int64), step=0, index=0, stddev=1.1)
    ```
    """
    return gaussian_at(shape, step_key(key, step), index, stddev)


def step_key(key, step):
    """The key of one step's noise: `key` with `step` folded in (once per step).

    Example:
    ```python
    at_step = step_key(tf.constant([1, 2], tf.int64), step=0)
    ```
    """
    # Philox explicitly, so every device and replica uses one algorithm. This
    # does NOT make jit_compile=True draw the graph's noise: XLA lowers the
    # stateless normal with its own kernels, so a seeded run under XLA draws
    # other (equally distributed) noise than the same run without XLA
    # (docs/privacy.md, "Composes with"). Within one mode, runs are reproducible.
    return tf.random.experimental.stateless_fold_in(key, tf.cast(step, tf.int64), alg="philox")


def gaussian_at(shape, key_of_step, index, stddev):
    """Variable `index`'s `N(0, stddev^2)` float32 noise from the step's key (`step_key`).

    Example:
    ```python
    gaussian_at([3], step_key(tf.constant([1, 2], tf.int64), 0), index=0, stddev=1.1)
    ```
    """
    key = tf.random.experimental.stateless_fold_in(key_of_step, index, alg="philox")
    return tf.random.stateless_normal(shape, key, stddev=stddev, dtype=tf.float32, alg="philox")
