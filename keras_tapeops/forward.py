"""The one forward-and-loss function: forward pass, compiled loss, loss terms, logging.

Every gradient path of the mixin's step (stock, micro-batches, cross-step
accumulation, SAM, and the single-pass engines) computes its loss through
`forward_and_loss`; `test_step` too. It runs the model once, records what
the loss terms asked for (layer outputs, a tape watching the inputs),
computes the compiled loss and the terms, and logs them once.
"""

import contextlib

import tensorflow as tf

from keras_tapeops import capture
from keras_tapeops._keras import private
from keras_tapeops.replicas import batch_size
from keras_tapeops.replicas import scale_for_distribution
from keras_tapeops.replicas import unscale_for_distribution
from keras_tapeops.terms.base import TermContext


def forward_and_loss(model, x, y, sample_weight, training, compute_terms, log=True):
    """Forward pass, `compute_loss` plus loss terms, and loss logging.

    Args:
        model: the model (a `TapeOpsMixin` model).
        x, y, sample_weight: the (micro-)batch.
        training: the forward pass's `training` flag (also selects the
            terms: training ones, or those with `in_validation`).
        compute_terms: `(terms, context) -> list of scalars`, the model's
            `compute_terms` hook.
        log: whether the loss and term trackers are updated (False in SAM's
            second pass).

    Returns:
        `(loss, y_pred)`: the replica-scaled total loss (not yet
        optimizer-scaled) and the model's outputs.
    """
    state = model.tapeops_state
    terms = state.active_terms(training) if state is not None else []
    with forward_recorder(terms, x) as recorder:
        y_pred = private.call_model(model, x, training)
    loss = private.compute_loss(model, x, y, y_pred, sample_weight, training)
    n = batch_size(x)
    context = TermContext(
        model,
        x,
        y,
        y_pred,
        sample_weight,
        training,
        recorder["activations"],
        recorder["tape"],
        recorder["watched"],
    )
    values = list(compute_terms(terms, context))
    if values:
        # A batch of zero samples (a term's mean over nothing is nan)
        # adds nothing, as stock Keras's loss does; the gradient of the
        # masked value is zero, not nan.
        values = [tf.where(n > 0, tf.cast(v, "float32"), 0.0) for v in values]
    if log:
        for (term, _), value in zip(terms, values):
            state.term_trackers[term.name].update_state(value, sample_weight=n)
    if values:
        total = tf.add_n([tf.cast(v, "float32") for v in values])
        loss = loss + tf.cast(scale_for_distribution(total), loss.dtype)
    if log:
        private.loss_tracker(model).update_state(unscale_for_distribution(loss), sample_weight=n)
    return loss, y_pred


@contextlib.contextmanager
def forward_recorder(terms, x):
    """Records the layer outputs the terms capture, and watches float inputs if asked.

    Args:
        terms: the active `(kt.Term, state)` pairs.
        x: the batch's inputs.

    Yields:
        A dict: `"activations"` (layer -> outputs), `"tape"` (a persistent
        tape watching the inputs, or None) and `"watched"` (which flat
        inputs it watches, or None).
    """
    layers = [layer for term, state in terms for layer in term.layers_to_capture(state)]
    wants_input_grads = any(term.needs_input_gradients for term, _ in terms)
    record = {"activations": {}, "tape": None, "watched": None}
    with capture.recording_outputs(layers) as activations:
        record["activations"] = activations
        if not wants_input_grads:
            yield record
            return
        flat = tf.nest.flatten(x)
        watched = [t is not None and tf.as_dtype(t.dtype).is_floating for t in flat]
        with tf.GradientTape(persistent=True, watch_accessed_variables=False) as tape:
            for tensor, watch in zip(flat, watched):
                if watch:
                    tape.watch(tensor)
            record["tape"] = tape
            record["watched"] = watched
            yield record
