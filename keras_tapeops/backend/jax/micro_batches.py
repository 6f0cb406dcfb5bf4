"""`compile(micro_batches=k)` on JAX: one batch, k forward passes, one gradient.

The batch is cut as on TensorFlow (`split_sizes.micro_batch_sizes`: sizes
differ by at most one, small ones first, samples in order). Each run of
equal-sized micro-batches is one `jax.lax.scan` over a rematerialized
(`jax.checkpoint`) forward pass: the scan keeps only each micro-batch's
inputs and predictions, and the backward pass recomputes one micro-batch's
activations at a time, so activation memory is about one micro-batch's.

The compiled loss is then computed once, on the whole batch's predictions,
by Keras's own `compute_loss`: the gradient is the whole batch's for every
reduction, sample and class weights, masks and multi-output losses, with no
per-reduction rescaling (which the TensorFlow loop needs because it
differentiates each micro-batch's loss apart). The forward pass's own losses
(regularizers, `add_loss`) count once: each micro-batch's share is weighted
by `size / n`, as on TensorFlow.

Non-trainable state (BatchNormalization moving statistics, seed generators)
is carried from one micro-batch to the next: `batch_norm_updates=
"per_micro_batch"` semantics. The TensorFlow-only `"large_batch"` merge is
refused for models with BatchNormalization layers (`check_batch_norm`).
"""

from __future__ import annotations

from typing import Any
from typing import Callable

import jax
import keras
from keras import ops

from keras_tapeops._keras import jax_trainer
from keras_tapeops._keras import private
from keras_tapeops.split_sizes import equal_size_groups
from keras_tapeops.split_sizes import static_batch_size

Forward = Callable[[Any, Any, Any], tuple[Any, Any, list[Any]]]


def micro_batch_forward(model: keras.Model, k: int) -> Forward:
    """The forward pass of a batch in `k` rematerialized micro-batches.

    Args:
        model: the (built) model, called statelessly in training mode.
        k: requested number of micro-batches (a smaller batch uses one per
            sample).

    Returns:
        `forward(trainable, non_trainable, x) -> (y_pred, non_trainable,
        [extra_loss])`, for `jax_trainer.compute_loss_and_updates`:
        `y_pred` is the whole batch's, in sample order.

    Example:
    ```python
    model.compile(optimizer="sgd", loss="mse", micro_batches=4)
    model.fit(x, y, batch_size=64)  # on JAX: 4 passes of 16 samples, 1 step
    ```
    """
    kwargs = jax_trainer.call_kwargs(model, training=True)

    @jax.checkpoint
    def one_micro_batch(trainable, non_trainable, x):
        y_pred, non_trainable, losses = model.stateless_call(
            trainable, non_trainable, x, return_losses=True, **kwargs
        )
        extra = sum((ops.cast(loss, "float32") for loss in losses), ops.zeros((), "float32"))
        return y_pred, non_trainable, extra

    def forward(trainable, non_trainable, x):
        n = static_batch_size(x)
        extra = ops.zeros((), "float32")
        pieces = []
        for start, count, size in equal_size_groups(n, k):
            stacked = jax.tree_util.tree_map(lambda t: _stack(t, start, count, size), x)

            def body(carry, x_micro, size=size):
                non_trainable, extra = carry
                y_pred, non_trainable, loss = one_micro_batch(trainable, non_trainable, x_micro)
                return (non_trainable, extra + loss * (size / n)), y_pred

            (non_trainable, extra), y_stacked = jax.lax.scan(body, (non_trainable, extra), stacked)
            pieces.append(jax.tree_util.tree_map(_unstack, y_stacked))
        y_pred = jax.tree_util.tree_map(lambda *p: jax.numpy.concatenate(p, axis=0), *pieces)
        return y_pred, non_trainable, [extra]

    return forward


def check_batch_norm(model: keras.Model, micro_batches: int, mode: str) -> None:
    """Raises ValueError when BatchNormalization needs the TF-only large-batch merge.

    Args:
        model: the model to train.
        micro_batches: the compiled `micro_batches`.
        mode: the compiled `batch_norm_updates`.

    Returns:
        None.
    """
    if micro_batches <= 1 or mode != "large_batch":
        return
    layers = [
        layer.name
        for layer in private.all_layers(model)
        if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable
    ]
    if layers:
        raise ValueError(
            "`micro_batches` with BatchNormalization layers needs "
            "batch_norm_updates='per_micro_batch' on the JAX backend (one "
            "moving-statistics update per micro-batch); the 'large_batch' merge "
            f"is TensorFlow-only for now. Layers: {layers}. "
            f"Received: micro_batches={micro_batches}, batch_norm_updates={mode!r}"
        )


def _stack(t: Any, start: int, count: int, size: int) -> Any:
    """Samples `start .. start + count * size` of `t` as `[count, size, ...]`."""
    return ops.reshape(t[start : start + count * size], (count, size) + tuple(t.shape[1:]))


def _unstack(t: Any) -> Any:
    return ops.reshape(t, (t.shape[0] * t.shape[1],) + tuple(t.shape[2:]))
