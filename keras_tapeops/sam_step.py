"""The TensorFlow SAM step: two passes, the weights perturbed in between (see sam.py)."""

import tensorflow as tf

from keras_tapeops import true_gradients
from keras_tapeops.accumulation.batch_norm import moving_statistics


def sharpness_aware_gradients(model, sam, selection, gradient_pass):
    """Runs the two passes of one SAM step; returns `(grads, y_pred)`.

    Args:
        model: the keras_tapeops model (its optimizer gives the loss scale).
        sam: the `SAM` configuration.
        selection: `() -> list of bools`: the model's bound selection for
            `sam` (asked after the first pass, which builds a lazy model).
        gradient_pass: `() -> (grads, y_pred)`: one logged forward/backward
            pass over the batch (micro-batched if asked); called twice.

    Returns:
        The second pass's gradients (per replica, optimizer-scaled, as
        `gradient_pass` returns them) and the first pass's predictions.
    """
    optimizer = model.optimizer
    if optimizer is not None and not optimizer.built and model.built:
        # Its loss scale must be a variable before either pass scales a loss.
        optimizer.build(model.trainable_variables)
    grads, y_pred = gradient_pass()
    variables = model.trainable_variables
    true, _ = true_gradients.sum_over_replicas(grads)
    scale = true_gradients.loss_scale(model.optimizer) if model.optimizer else None
    if scale is not None:
        true = [true_gradients.map_values(g, lambda t: t / tf.cast(scale, t.dtype)) for g in true]
    perturbation = sam.perturbation(true, variables, selection())
    saved = [
        tf.identity(tf.convert_to_tensor(v)) if e is not None else None
        for v, e in zip(variables, perturbation)
    ]
    for v, e in zip(variables, perturbation):
        if e is not None:
            v.assign_add(e)
    statistics = moving_statistics(model)
    with model.tapeops_unlogged():
        grads, _ = gradient_pass()
    # Automatic control dependencies order these writes after the second
    # pass's reads of the same variables.
    for v, old in zip(variables, saved):
        if old is not None:
            v.assign(old)
    for m, old in statistics:
        m.assign(old)
    return grads, y_pred
