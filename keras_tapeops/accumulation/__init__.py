"""Gradient accumulation: `compile(micro_batches=k)` and `compile(accumulation_steps=k)`.

- `micro_batch_gradients` (micro_batches.py): one batch, split into k
  micro-batches run one after the other, one optimizer step.
- `CrossBatchAccumulator` (cross_batch.py): k consecutive batches, one step;
  `window_gradients` is the gradient pass of each of its batches.
- reductions.py: how each compiled loss normalizes a batch, so both stay
  exact for every Keras reduction (`check_compile_loss` refuses at compile()
  what cannot be).
- `AccumulationFlush` (flush.py): applies a window cut short by the epoch end.
- batch_norm.py: BatchNormalization moving statistics under micro-batching.

flush.py and reduction_kinds.py are backend-neutral (the JAX window,
`keras_tapeops.backend.jax.accumulation`, uses them); the rest is TensorFlow's.
"""

from __future__ import annotations

from typing import Any

import keras

from keras_tapeops.accumulation.flush import AccumulationFlush
from keras_tapeops.accumulation.flush import add_flush_callback
from keras_tapeops.accumulation.reduction_kinds import check_compile_loss
from keras_tapeops.split_sizes import micro_batch_sizes

# The passes and the window below are TensorFlow's (the JAX step has its own,
# keras_tapeops.backend.jax); flush.py and reduction_kinds.py serve both.
if keras.backend.backend() == "tensorflow":
    from keras_tapeops.accumulation.batch_norm import check_batch_norm_layers
    from keras_tapeops.accumulation.cross_batch import CrossBatchAccumulator
    from keras_tapeops.accumulation.cross_batch import window_gradients
    from keras_tapeops.accumulation.micro_batches import micro_batch_gradients


def check_model(model: keras.Model, options: Any) -> None:
    """Raises (before any step) if `model` cannot honour the accumulation options.

    Args:
        model: the compiled keras_tapeops model.
        options: its `TapeOpsOptions`.

    Returns:
        None.
    """
    if options.micro_batches > 1:
        check_batch_norm_layers(model, options.batch_norm_updates)


__all__ = [
    "AccumulationFlush",
    "CrossBatchAccumulator",
    "add_flush_callback",
    "check_compile_loss",
    "check_model",
    "micro_batch_gradients",
    "micro_batch_sizes",
    "window_gradients",
]
