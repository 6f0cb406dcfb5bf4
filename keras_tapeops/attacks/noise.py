"""Random starts: uniform points of the epsilon ball, reproducible across replicas.

With a seed, the start is drawn for the whole global batch from a stateless
generator keyed by `(seed, step)` and each replica takes its own rows (its
offset comes from one all-gather of the replicas' batch sizes), so training
on two replicas draws exactly what one device draws. In `fit`, `step` is the
optimizer step (times `accumulation_steps`, plus the batch's place in the
accumulation window), so every applied step, and every batch of a window,
gets a fresh start, and a model loaded from a checkpoint continues the same
sequence. The micro-batches of one batch (`micro_batches=k`) share the key:
example `i` of each micro-batch starts from the same noise; their passes are
traced in a loop body, where no cross-replica call is allowed, so there each
replica takes its rows as if the replicas' micro-batches were equal in size.

Without a seed the start comes from TensorFlow's global generator (seeded by
`keras.utils.set_random_seed`): random per step and per replica, so two
replicas do not reproduce one device.

Uniform points: `epsilon * U(-1, 1)` per element for `norm="inf"`; for
`norm="l2"` a uniform point of the ball (jointly over all perturbed inputs of
an example): a Gaussian direction, normalized, times `epsilon * u ** (1/d)`,
`u ~ U(0, 1)`, `d` the number of perturbed elements per example.
"""

import tensorflow as tf

from keras_tapeops import second_order


def validate_seed(seed):
    """None or a non-negative int (else ValueError naming `seed`)."""
    return second_order._check_seed(seed)


def random_start(clean, epsilon, norm, seed, step, gather_batch_sizes=True):
    """One random perturbation per tensor of `clean`, inside the `epsilon` ball.

    Args:
        clean: list of float32 batch-first tensors (the perturbed inputs).
        epsilon: the ball's radius.
        norm: `"inf"` or `"l2"`.
        seed: None (global generator) or a non-negative int.
        step: an integer scalar keying the seeded draw.
        gather_batch_sizes: find this replica's rows by all-gathering the
            replicas' batch sizes (exact for uneven splits). False assumes
            equal per-replica batches (no collective: for passes traced in a
            nested function or loop body, where a cross-replica call is not
            allowed, such as `micro_batches`).

    Returns:
        A list of float32 tensors shaped like `clean`.

    Example:
    ```python
    deltas = random_start([x], 0.1, "inf", seed=0, step=0)
    ```
    """
    draw = _Draws(clean[0], seed, step, gather_batch_sizes)
    if norm == "inf":
        return [
            epsilon * draw.uniform(i, c.shape, minval=-1.0, maxval=1.0) for i, c in enumerate(clean)
        ]
    directions = [draw.normal(i, c.shape) for i, c in enumerate(clean)]
    norms = tf.sqrt(
        tf.add_n(
            [
                tf.reduce_sum(tf.reshape(tf.square(d), [tf.shape(d)[0], -1]), axis=1)
                for d in directions
            ]
        )
    )
    size = tf.add_n([tf.cast(tf.reduce_prod(tf.shape(c)[1:]), tf.float32) for c in clean])
    u = draw.uniform(len(clean), tf.TensorShape([None]))
    radius = epsilon * tf.pow(u, 1.0 / size) / tf.maximum(norms, 1e-12)
    return [tf.reshape(radius, [-1] + [1] * (d.shape.rank - 1)) * d for d in directions]


class _Draws:
    """Draws for this replica's rows of the global batch (seeded) or locally."""

    def __init__(self, first, seed, step, gather_batch_sizes):
        self.n = tf.shape(first)[0]
        self.seed = seed
        if seed is not None:
            self.key = tf.stack([tf.constant(seed, tf.int64), tf.cast(step, tf.int64)])
            self.offset, self.total = global_rows(self.n, gather_batch_sizes)

    def uniform(self, index, shape, minval=0.0, maxval=1.0):
        if self.seed is None:
            return tf.random.uniform(self._dynamic(shape, self.n), minval, maxval, tf.float32)
        full = tf.random.stateless_uniform(
            self._dynamic(shape, self.total),
            self._key(index),
            minval,
            maxval,
            tf.float32,
        )
        return full[self.offset : self.offset + self.n]

    def normal(self, index, shape):
        if self.seed is None:
            return tf.random.normal(self._dynamic(shape, self.n), dtype=tf.float32)
        full = tf.random.stateless_normal(
            self._dynamic(shape, self.total), self._key(index), dtype=tf.float32
        )
        return full[self.offset : self.offset + self.n]

    def _key(self, index):
        return tf.random.experimental.stateless_fold_in(self.key, index)

    @staticmethod
    def _dynamic(shape, rows):
        rest = tf.TensorShape(shape)[1:]
        if not rest.is_fully_defined():
            raise ValueError(
                "A random start needs inputs whose non-batch dimensions are "
                f"known. Received: an input of shape {shape}"
            )
        return tf.concat([tf.reshape(rows, [1]), tf.constant(rest.as_list(), tf.int32)], 0)


def global_rows(n, gather_batch_sizes=True):
    """`(offset, total)`: this replica's first row in the global batch, and its size.

    Under a multi-replica strategy (inside `strategy.run`) the replicas'
    batch sizes are all-gathered (uneven last batches included), or, with
    `gather_batch_sizes=False`, taken equal (`offset = replica_id * n`);
    elsewhere the batch is the global batch: `(0, n)`.
    """
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return tf.constant(0, tf.int32), n
    replica = context.replica_id_in_sync_group
    if not gather_batch_sizes:
        n = tf.cast(n, tf.int32)
        return replica * n, context.num_replicas_in_sync * n
    sizes = context.all_gather(tf.reshape(tf.cast(n, tf.int32), [1]), axis=0)
    return tf.reduce_sum(sizes[:replica]), tf.reduce_sum(sizes)


def step_counter(model):
    """The step that keys a seeded start inside `fit`: an int64 scalar.

    The optimizer's step; with `accumulation_steps=k`, `k * step` plus the
    batch's place in the window, so each batch of a window draws anew.
    Without an optimizer, 0.
    """
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return tf.constant(0, tf.int64)
    step = tf.cast(optimizer.iterations, tf.int64)
    state = getattr(model, "tapeops_state", None)
    accumulator = getattr(state, "accumulator", None)
    if accumulator is not None:
        window = tf.cast(accumulator.batches.read_value(), tf.int64)
        step = step * accumulator.steps + window
    return step
