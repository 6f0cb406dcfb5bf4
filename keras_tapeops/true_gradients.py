"""The optimizer step behind gradient transforms: transforms see true gradients.

Shared by `TapeOpsMixin.apply_optimizer_step` and `WGANGP`'s critic update.
"True" means what single-device float32 training would compute:

- summed over replicas once (`sum_over_replicas`), with the optimizer's own
  all-reduce switched off for that step, so norms are global, not per replica;
- divided by the loss scale (a `LossScaleOptimizer`'s dynamic scale or a static
  `loss_scale_factor`), and multiplied back before the optimizer sees them;
- a non-finite step reaches a `LossScaleOptimizer` as non-finite even if a
  transform would have made it finite, so the step is skipped and the scale
  adapts as in stock Keras.
"""

import contextlib

import tensorflow as tf

from keras_tapeops import _keras_private as private


def apply_transformed(optimizer, grads, variables, transform, aggregate=None):
    """Applies `transform(true_grads, variables)` with `optimizer`.

    Args:
        optimizer: a built or unbuilt Keras optimizer (built here if needed).
        grads: per-replica, loss-scaled gradients, one per variable (None and
            `tf.IndexedSlices` allowed).
        variables: the matching variables.
        transform: callable `(grads, variables) -> grads` on true gradients.
        aggregate: callable `grads -> (grads, was_reduced)`; default
            `sum_over_replicas`.

    Returns:
        None.

    Example:
    ```python
    apply_transformed(model.optimizer, grads, model.trainable_variables,
                      lambda g, v: kt.ClipByGlobalNorm(1.0)(g, v))
    ```
    """
    if not optimizer.built:
        # Stock apply_gradients builds lazily on the first trace; the loss
        # scale must exist before it is read here.
        optimizer.build(variables)
    grads, reduced = (aggregate or sum_over_replicas)(grads)
    scale = loss_scale(optimizer)
    if scale is not None:
        grads = [map_values(g, lambda v: v / tf.cast(scale, v.dtype)) for g in grads]
    new_grads = list(transform(grads, variables))
    if private.is_loss_scale_optimizer(optimizer):
        finite = all_finite(grads)
        new_grads = [keep_if_finite(finite, new, old) for new, old in zip(new_grads, grads)]
    if scale is not None:
        new_grads = [map_values(g, lambda v: v * tf.cast(scale, v.dtype)) for g in new_grads]
    guard = (
        private.optimizer_all_reduce_disabled(optimizer)
        if reduced
        else contextlib.nullcontext()
    )
    with guard:
        optimizer.apply_gradients(zip(new_grads, variables))


def sum_over_replicas(grads):
    """Sums `grads` over replicas in one all-reduce; returns `(grads, was_reduced)`.

    Outside `tf.distribute` (or with one replica) the gradients are returned
    unchanged with `was_reduced=False`.
    """
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return list(grads), False
    present = [g for g in grads if g is not None]
    reduced = iter(context.all_reduce(tf.distribute.ReduceOp.SUM, present))
    return [None if g is None else next(reduced) for g in grads], True


def loss_scale(optimizer):
    """The factor the loss was multiplied by before differentiation, or None."""
    if private.is_loss_scale_optimizer(optimizer):
        return optimizer.dynamic_scale
    # A static `loss_scale_factor`: the optimizer's apply() divides it out.
    return optimizer.loss_scale_factor


def map_values(grad, fn):
    """Applies `fn` to a dense gradient or to the values of `tf.IndexedSlices`."""
    if grad is None:
        return None
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(fn(grad.values), grad.indices, grad.dense_shape)
    return fn(grad)


def all_finite(grads):
    """A scalar bool: every entry of every gradient is finite."""
    checks = [
        tf.reduce_all(tf.math.is_finite(g.values if isinstance(g, tf.IndexedSlices) else g))
        for g in grads
        if g is not None
    ]
    return tf.reduce_all(tf.stack(checks)) if checks else tf.constant(True)


def keep_if_finite(finite, new, old):
    """`new` where the step is finite, else the original non-finite `old`."""
    if new is None or old is None:
        return new
    if isinstance(new, tf.IndexedSlices) and isinstance(old, tf.IndexedSlices):
        if new.values.shape == old.values.shape:
            return tf.IndexedSlices(
                tf.where(finite, new.values, old.values), new.indices, new.dense_shape
            )
    return tf.where(finite, tf.convert_to_tensor(new), tf.convert_to_tensor(old))
