"""Logged-name checks: a name the options log must not be one stock Keras logs.

`compile()` checks the names its arguments show (`compile_arg_names`);
the rest (per-output losses of a list loss, metrics of several outputs) is
checked before the first step, once Keras has built its compiled metrics
(`check_logged_names`). Both run before any weight update; a failed check
stores nothing, so compiling again with a free name works.
"""

import tensorflow as tf

from keras_tapeops._keras import private


def compile_arg_names(args, kwargs):
    """Names Keras will log that `compile()`'s arguments already show.

    "loss", metrics given by name or as objects, and the per-output losses
    of a dict loss; names Keras resolves later (per-output losses of a list
    loss, metrics of several outputs) are checked before the first step.

    Args:
        args, kwargs: the stock `compile()` arguments.

    Returns:
        A set of names.
    """
    names = {"loss"}
    for key in ("metrics", "weighted_metrics"):
        for metric in tf.nest.flatten(kwargs.get(key) or []):
            name = metric if isinstance(metric, str) else getattr(metric, "name", None)
            if name:
                names.add(name)
    loss = kwargs.get("loss", args[1] if len(args) > 1 else None)
    if isinstance(loss, dict):
        names.update(f"{output}_loss" for output in loss)
    return names


def check_logged_names(model, stock_metrics, y=None, y_pred=None):
    """Raises if a name the options log is also a name stock Keras logs.

    Runs before the step function is made (Keras has built the compiled
    metrics and per-output losses symbolically by then) and, as a
    fallback, in the first traced step (given `y`, `y_pred` it builds
    them).

    Args:
        model: the model.
        stock_metrics: the model's stock `metrics` list.
        y, y_pred: the step's targets and outputs, if in a step.
    """
    state = model.tapeops_state
    if state is None or state.metric_names_checked or not state.variables_bound:
        return
    if state.logged_metrics:
        taken = private.logged_metric_names(model, stock_metrics, y, y_pred)
        if taken is None:
            return  # not known yet: checked in the first step
        state.check_names_against(taken, "a metric of the model")
    state.metric_names_checked = True


def needs_eager_build(model):
    """True when an eager step must build symbolically before its forward pass.

    A traced step only raises at trace time (nothing has run), so checking
    after its forward pass is early enough; an eager one
    (`run_eagerly=True`) builds the model and Keras's compiled metrics and
    loss symbolically first, as Keras does under a distribution strategy.
    """
    state = model.tapeops_state
    logs_names = state is not None and (
        state.options.loss_terms or state.options.gradient_transforms or state.engine is not None
    )
    return bool(logs_names) and not state.metric_names_checked and tf.executing_eagerly()
