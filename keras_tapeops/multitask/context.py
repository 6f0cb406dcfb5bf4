"""`StepContext`: what a multi-task method sees when it computes weights."""

from __future__ import annotations

from typing import Any

import tensorflow as tf


class StepContext:
    """What a method sees when it computes weights or updates its state.

    Attributes:
        num_tasks: K.
        losses: `[K]` float32 task losses (mean over the step's samples,
            `loss_weights` applied), or None.
        state: dict name -> the engine's variables for this method.
        step: the optimizer's applied-step count (int64 tensor).
        seed: an int, fixed per model (random task orders).
        epochs: the engine's `EpochLosses`, or None.
    """

    def __init__(
        self,
        num_tasks: int,
        losses: tf.Tensor | None = None,
        state: dict[str, Any] | None = None,
        step: tf.Tensor | None = None,
        seed: int = 0,
        epochs: Any = None,
    ) -> None:
        self.num_tasks = num_tasks
        self.losses = losses
        self.state = state or {}
        self.step = step
        self.seed = seed
        self.epochs = epochs
