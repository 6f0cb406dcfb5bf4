"""Slicing a (candidate) batch: the kept examples, the example ids, k.

Helpers shared by every `sample_selection` engine: they act on the
structures `fit` passes to the step (`x`, `y`, `sample_weight` may be
tensors, lists or dicts, `y`/`sample_weight` may be None).
"""

import tensorflow as tf


def gather(structure, indices):
    """`structure` with every tensor restricted to rows `indices` (None kept)."""
    if structure is None:
        return None
    return tf.nest.map_structure(lambda t: None if t is None else tf.gather(t, indices), structure)


def kept_count(fraction, n):
    """k = ceil(fraction * n), at least 1 and at most n (int32 scalar tensor).

    A relative tolerance of 1e-6 absorbs float32 rounding (0.1 * 10 is 1.0000001
    in float32 and must keep 1 example, not 2).

    Args:
        fraction: float32 scalar in (0, 1].
        n: int32 scalar, the batch size.
    """
    nf = tf.cast(n, "float32")
    product = tf.cast(fraction, "float32") * nf
    k = tf.math.ceil(product - 1e-6 * tf.maximum(product, 1.0))
    return tf.clip_by_value(tf.cast(k, "int32"), tf.minimum(1, n), n)


def split_ids(x, id_key):
    """`(x_without_ids, ids)` for the id convention of `kt.ReducibleLoss`.

    `x` is a dict holding the example ids under `id_key`; the other entries
    are the model's inputs. If one entry remains it is passed unwrapped (a
    single-input model), otherwise the remaining dict is.

    Returns:
        `(x, None)` when `x` carries no ids.
    """
    if not isinstance(x, dict) or id_key not in x:
        return x, None
    rest = {key: value for key, value in x.items() if key != id_key}
    ids = x[id_key]
    if len(rest) == 1:
        rest = next(iter(rest.values()))
    return rest, tf.reshape(ids, [-1])


def describe(x):
    """A short description of `x` for error messages."""
    if isinstance(x, dict):
        return f"a dict with keys {sorted(x)}"
    return f"{type(x).__name__}"
