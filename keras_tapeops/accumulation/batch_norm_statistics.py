"""The large-batch BatchNormalization update, backend-neutral (`keras.ops`).

Shared by the TensorFlow micro-batch loop (`accumulation/batch_norm.py`) and
the JAX micro-batch scan (`backend/jax/micro_batches.py`): which layers
update moving statistics, running them with momentum 0 so that a micro-batch
leaves its own mean and variance, merging the micro-batches' statistics into
the whole batch's, and the one moving-average update with them.
"""

from __future__ import annotations

import contextlib
from typing import Any
from typing import Iterator
from typing import Sequence

import keras
from keras import ops

from keras_tapeops._keras import private


def batch_norm_layers(model: keras.Model) -> list[Any]:
    """The BatchNormalization layers of `model` that update moving statistics.

    Example:
    ```python
    names = [layer.name for layer in batch_norm_layers(model)]
    ```
    """
    return [
        layer
        for layer in private.all_layers(model)
        if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable
    ]


@contextlib.contextmanager
def momentum_zero(layers: Sequence[Any], momenta: Sequence[float]) -> Iterator[None]:
    """Moving statistics := the last pass's own statistics, while the block runs.

    Args:
        layers: BatchNormalization layers.
        momenta: their momenta, put back when the block ends.

    Example:
    ```python
    with momentum_zero(layers, [layer.momentum for layer in layers]):
        model(x, training=True)   # each moving mean is now mean(x)
    ```
    """
    for layer in layers:
        layer.momentum = 0.0
    try:
        yield
    finally:
        for layer, momentum in zip(layers, momenta):
            layer.momentum = momentum


def merged_moments(mean_sum: Any, square_sum: Any, n: Any) -> tuple[Any, Any]:
    """The whole batch's mean and (biased) variance from its pieces' sums.

    Args:
        mean_sum: `sum_i n_i * mean_i` over the pieces.
        square_sum: `sum_i n_i * (variance_i + mean_i^2)`.
        n: the batch's sample count.

    Returns:
        `(mean, variance)`; the variance, `E[x^2] - mean^2`, is clamped at 0.

    Example:
    ```python
    mean, variance = merged_moments(4 * m1 + 4 * m2, 4 * (v1 + m1**2) + 4 * (v2 + m2**2), 8.0)
    ```
    """
    mean = mean_sum / n
    return mean, ops.maximum(square_sum / n - ops.square(mean), 0.0)


def moving_average(old: Any, statistic: Any, momentum: float) -> Any:
    """`old * momentum + statistic * (1 - momentum)`, as Keras's BatchNormalization updates.

    Example:
    ```python
    moving_average(moving_mean, batch_mean, 0.99)
    ```
    """
    return old * momentum + statistic * (1.0 - momentum)
