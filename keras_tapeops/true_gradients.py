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

from keras_tapeops._keras import private


def apply_transformed(
    optimizer,
    grads,
    variables,
    transform,
    aggregate=None,
    keep_step=None,
    after_apply=None,
):
    """Applies `transform(true_grads, variables)` with `optimizer`.

    Args:
        optimizer: a built or unbuilt Keras optimizer (built here if needed).
        grads: per-replica, loss-scaled gradients, one per variable (None and
            `tf.IndexedSlices` allowed).
        variables: the matching variables.
        transform: callable `(grads, variables) -> grads` on true gradients.
        aggregate: callable `grads -> (grads, was_reduced)`; default
            `sum_over_replicas`.
        keep_step: optional callable `(true_grads, variables) -> None or
            scalar bool`: False skips the optimizer step. Under a
            LossScaleOptimizer a skipped step is handed to it as non-finite,
            so it skips the step and lowers its scale as for any overflow.
        after_apply: optional callable `()` run after the optimizer step.

    Returns:
        The keep decision (a scalar bool tensor), or None without gates.

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
    keep = keep_step(grads, variables) if keep_step is not None else None
    new_grads = list(transform(grads, variables))
    loss_scaled = private.is_loss_scale_optimizer(optimizer)
    if loss_scaled:
        finite = all_finite(grads)
        new_grads = [keep_if_finite(finite, new, old) for new, old in zip(new_grads, grads)]
        if keep is not None:  # the LossScaleOptimizer skips it as an overflow
            new_grads = [poison_unless(keep, g) for g in new_grads]
    if scale is not None:
        new_grads = [map_values(g, lambda v: v * tf.cast(scale, v.dtype)) for g in new_grads]

    def apply(grads):
        guard = (
            private.optimizer_all_reduce_disabled(optimizer)
            if reduced
            else contextlib.nullcontext()
        )
        with guard:
            optimizer.apply_gradients(zip(grads, variables))

    if keep is None or loss_scaled:
        apply(new_grads)
    else:
        apply_if(keep, apply, new_grads)
    if after_apply is not None:
        after_apply()
    return keep


def apply_if(condition, apply, grads):
    """Runs `apply(grads)` only where `condition` (equal on every replica) holds.

    Under `tf.distribute` the optimizer synchronizes replicas, and a
    synchronization point inside a replica-context `tf.cond` is not supported,
    so the condition is taken in cross-replica context (`merge_call`) and the
    apply re-enters replica context with `strategy.run`.
    """
    context = tf.distribute.get_replica_context()
    if not tf.distribute.has_strategy() or context is None:
        tf.cond(condition, lambda: _run(apply, grads), lambda: tf.constant(False))
        return

    def cross_replica(strategy, condition, grads):
        condition = strategy.experimental_local_results(condition)[0]
        return tf.cond(
            condition,
            lambda: _run(lambda g: strategy.run(apply, args=(g,)), grads),
            lambda: tf.constant(False),
        )

    context.merge_call(cross_replica, args=(condition, grads))


def _run(apply, grads):
    apply(grads)
    return tf.constant(True)


def poison_unless(keep, grad):
    """`grad` where `keep`, else nan (so a LossScaleOptimizer skips the step)."""
    if grad is None:
        return None
    nan = tf.constant(float("nan"))
    return map_values(grad, lambda v: tf.where(keep, v, tf.cast(nan, v.dtype)))


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
