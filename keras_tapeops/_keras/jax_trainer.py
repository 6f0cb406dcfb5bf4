"""Keras's JAX trainer internals, isolated here (JAX backend only)."""

from __future__ import annotations

from typing import Any


def update_metrics_variables(
    model: Any,
    metrics_variables: Any,
    unscaled_loss: Any,
    x: Any,
    y: Any,
    y_pred: Any,
    sample_weight: Any,
) -> tuple[Any, Any]:
    """The stock JAX step's metric update: `(logs, new_metrics_variables)`.

    `JAXTrainer._update_metrics_variables` updates the loss tracker and the
    compiled metrics inside a `StatelessScope` and returns the new metric
    values; it is what the stock `train_step(state, data)` calls after the
    optimizer, and it reads the private loss tracker. Keras exports no public
    function for it; checked on Keras 3.15.
    """
    return model._update_metrics_variables(
        metrics_variables, unscaled_loss, x, y, y_pred, sample_weight
    )


def call_kwargs(model: Any, training: bool) -> dict[str, Any]:
    """`{"training": training}` when the model's `call` takes it, else `{}`.

    The stock JAX step reads the private `_call_has_training_arg` (set by
    `Layer.__init__` from `call`'s signature) to decide; a forward pass of
    our own must pass the same arguments. Checked on Keras 3.15.
    """
    return {"training": training} if model._call_has_training_arg else {}


def stateless_loss(
    model: Any,
    trainable: Any,
    non_trainable: Any,
    metrics_variables: Any,
    x: Any,
    y: Any,
    y_pred: Any,
    sample_weight: Any,
    losses: list[Any],
    training: bool,
) -> tuple[Any, Any, Any]:
    """The compiled loss of `y_pred` plus the forward pass's own `losses`.

    What the stock `JAXTrainer.compute_loss_and_updates` does after its
    forward pass (Keras 3.15's `backend/jax/trainer.py`): the forward pass's
    losses (`add_loss`, activity and weight regularizers, computed from the
    stateless values) reach `compute_loss` through the private
    `_losses_override` list; Keras has no public way to hand them over.
    Checked on Keras 3.15.

    Returns:
        `(loss, non_trainable, metrics_variables)` (loss not yet scaled).
    """
    if losses:
        model._losses_override.clear()
        model._losses_override = losses
    loss, variables = model.stateless_compute_loss(
        trainable,
        non_trainable,
        metrics_variables,
        x=x,
        y=y,
        y_pred=y_pred,
        sample_weight=sample_weight,
        training=training,
    )
    if losses:
        model._losses_override.clear()
    _, non_trainable, metrics_variables = variables
    return loss, non_trainable, metrics_variables


def value_after_last_step(model: Any, variable: Any) -> Any:
    """The value `variable` (a metric's or the optimizer's) has after the last step.

    Keras's JAX `fit` passes the variables' values from step to step and
    writes them back only at the end of an epoch (`jax_state_sync`); between
    steps the latest values are in the private `model._jax_state` dict (its
    `"metrics_variables"` and `"optimizer_variables"` lists follow
    `model.metrics_variables` and `model.optimizer.variables`), and
    `model._jax_state_synced` is False. A callback's `on_train_batch_begin`
    or `on_train_batch_end` reads them here. Otherwise, the variable's own
    value. Checked on Keras 3.15.
    """
    state = getattr(model, "_jax_state", None)
    if state and not getattr(model, "_jax_state_synced", True):
        optimizer = getattr(model, "optimizer", None)
        groups = [
            (model.metrics_variables, state.get("metrics_variables")),
            ([] if optimizer is None else optimizer.variables, state.get("optimizer_variables")),
        ]
        for references, values in groups:
            for reference, value in zip(references, values or []):
                if reference is variable:
                    return value
    return variable.value
