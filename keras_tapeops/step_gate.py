"""Skipping a whole step: the gates of gradient transforms and their bookkeeping.

A transform's `keep_step` may veto the optimizer step (see
`transforms/base.py`). When a step is skipped nothing it would have changed
changes: the optimizer is not called (weights, slots, `iterations` and so
learning-rate schedules stay as they were), and the BatchNormalization moving
statistics that the forward pass already updated are put back.
`after_apply` hooks run after the optimizer step, skipped or not.
"""

import tensorflow as tf

from keras_tapeops.accumulation.batch_norm import moving_statistics
from keras_tapeops.transforms.base import keep_step_decision
from keras_tapeops.transforms.base import with_hook


def keep_step_function(bound):
    """`(grads, variables) -> None or bool`: the AND of the bound transforms' gates.

    Args:
        bound: `(transform, state)` pairs.

    Returns:
        A callable for `true_gradients.apply_transformed(keep_step=...)`, or
        None when no transform gates.
    """
    if not with_hook(bound, "keep_step"):
        return None
    return lambda grads, variables: keep_step_decision(bound, grads, variables)


def after_apply_function(bound, variables):
    """`()` running every bound transform's `after_apply`, or None if none has one.

    Values the transforms asked for (`needs_previous_values`) are read now,
    before the optimizer step, and handed to them after it.
    """
    hooked = with_hook(bound, "after_apply")
    if not hooked:
        return None
    previous = {}
    for transform, state in hooked:
        if transform.needs_previous_values:
            previous[id(transform)] = [
                tf.identity(tf.convert_to_tensor(v)) if on else None
                for v, on in zip(variables, state.selected)
            ]

    def after_apply():
        for transform, state in hooked:
            transform.after_apply(variables, previous.get(id(transform)), state)

    return after_apply


def batch_norm_snapshot(model, state):
    """Moving statistics read before the forward pass, if a step may be skipped.

    Returns:
        A list of `(variable, value)` pairs, empty when no transform gates
        the step (the usual case: nothing is read) or when accumulating
        (a window is not restored; see docs/observability.md).
    """
    if state is None or not state.gates or state.accumulator is not None:
        return []
    return moving_statistics(model)


def restore_unless(keep, snapshot):
    """Writes the snapshot back where the step was skipped (`keep` False)."""
    if keep is None or not snapshot:
        return
    for variable, old in snapshot:
        variable.assign(tf.where(keep, tf.convert_to_tensor(variable), old))
