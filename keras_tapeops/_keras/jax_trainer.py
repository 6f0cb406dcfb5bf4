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
