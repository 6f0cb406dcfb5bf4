"""How a batch of dynamic size n is cut into micro-batches.

`m = min(k, n)` micro-batches: the first `m - r` hold `q = n // m` samples,
the last `r = n % m` hold `q + 1`; sizes differ by at most one and the
samples keep their order. Each group of equal-sized micro-batches is a
reshape of a contiguous slice, `[count, size, ...]`, so a loop can take
micro-batch `i` with a static-size index: this is what lets XLA
(`jit_compile=True`) compile the loop, since slice sizes must be constants.
"""

from __future__ import annotations

import tensorflow as tf


def plan(n, k):
    """Tensor version of `split_sizes.micro_batch_sizes`: returns `(q, r, n_small)`.

    Args:
        n: scalar int32 tensor, the batch size.
        k: python int, requested micro-batches.

    Returns:
        `q` (small size), `r` (number of micro-batches of size `q + 1`),
        `n_small` (number of micro-batches of size `q`, always >= 1).
    """
    m = tf.maximum(tf.minimum(tf.constant(k, n.dtype), n), 1)
    return n // m, n % m, m - n % m


def groups(structure, n, k, static_shapes=False):
    """How a loop reads the micro-batches of `structure`: `[(count, size_of, take)]`.

    Without static shapes there is one group: micro-batch `i` is a
    contiguous slice of dynamic size. XLA (`jit_compile=True`) needs every
    loop iteration to see the same shape, so then there are two groups, the
    `q`-sized and the `(q + 1)`-sized micro-batches, each a reshape.

    Args:
        structure: nested structure of tensors (None leaves kept as None).
        n: scalar int32 tensor, the batch size.
        k: python int, requested micro-batches.
        static_shapes: True under XLA.

    Returns:
        A list of `(count, size_of, take)`: the group's number of
        micro-batches, `size_of(i)` (its size) and `take(i)` (micro-batch
        `i` of the group, as `structure`).
    """
    q, r, n_small = plan(n, k)
    if static_shapes:
        small, large = stack_groups(structure, q, r, n_small, pad_empty=True)
        return [
            (n_small, lambda i: q, lambda i: take(structure, small, i)),
            (r, lambda i: q + 1, lambda i: take(structure, large, i)),
        ]
    flat = [None if t is None else tf.convert_to_tensor(t) for t in tf.nest.flatten(structure)]

    def size_of(i):
        return q + tf.cast(i >= n_small, q.dtype)

    def take_slice(i):
        start = i * q + tf.maximum(i - n_small, 0)
        end = start + size_of(i)
        return tf.nest.pack_sequence_as(
            structure, [None if t is None else t[start:end] for t in flat]
        )

    return [(n_small + r, size_of, take_slice)]


def stack_groups(structure, q, r, n_small, pad_empty=False):
    """Splits every tensor of `structure` into its two groups of micro-batches.

    Args:
        structure: nested structure of tensors (None leaves kept as None).
        q, r, n_small: from `plan`.
        pad_empty: give an empty group one all-zero micro-batch that the loop
            never reads. XLA (`jit_compile=True`) compiles the loop body even
            when it runs zero times, and indexing an empty axis does not
            compile. The padding copies the batch, so it is only done for XLA.

    Returns:
        `(small, large)`: flat lists aligned with `tf.nest.flatten(structure)`,
        tensors of shape `[n_small, q, ...]` and `[r, q + 1, ...]`.
    """
    small, large = [], []
    for t in tf.nest.flatten(structure):
        if t is None:
            small.append(None)
            large.append(None)
            continue
        t = tf.convert_to_tensor(t)
        rest = tf.shape(t)[1:]
        head = n_small * q
        small.append(_reshape(t[:head], n_small, q, rest, t.shape[1:], pad_empty))
        large.append(_reshape(t[head:], r, q + 1, rest, t.shape[1:], pad_empty))
    return small, large


def take(structure, stacked, i):
    """Micro-batch `i` of a group made by `stack_groups`, as `structure`."""
    flat = [None if t is None else t[i] for t in stacked]
    return tf.nest.pack_sequence_as(structure, flat)


def _reshape(t, count, size, rest, static_rest, pad_empty):
    out = tf.reshape(t, tf.concat([tf.stack([count, size]), rest], axis=0))
    if pad_empty:
        empty = tf.cast(tf.equal(count, 0), count.dtype)
        paddings = tf.concat([[[0, empty]], tf.zeros([tf.rank(t), 2], count.dtype)], axis=0)
        out = tf.pad(out, paddings)
    out.set_shape([None, None] + static_rest.as_list())
    return out
