"""BatchNormalization moving statistics under `micro_batches`.

Stock Keras on a batch of n samples updates each BatchNormalization layer's
moving statistics once, with the mean and (biased) variance of the n samples:
`moving = moving * momentum + stat * (1 - momentum)`.

- `batch_norm_updates="large_batch"` (default) keeps that: the micro-batch
  loop runs the layers with momentum 0, so after each micro-batch the moving
  variables hold exactly that micro-batch's mean and variance; these are
  merged (sample-weighted mean; variance via E[x^2] - mean^2) and the moving
  statistics get one update with the whole batch's statistics.
- `batch_norm_updates="per_micro_batch"`: each micro-batch updates the moving
  statistics with its own statistics, k updates per batch (what Keras's
  `gradient_accumulation_steps` does).

In both modes the forward pass normalizes each micro-batch with its own
statistics (as any micro-batching does); gradients are exact for the
micro-batch network.
"""

import tensorflow as tf

from keras_tapeops import _compat
from keras_tapeops.accumulation.batch_norm_statistics import batch_norm_layers
from keras_tapeops.accumulation.batch_norm_statistics import merged_moments
from keras_tapeops.accumulation.batch_norm_statistics import momentum_zero
from keras_tapeops.accumulation.batch_norm_statistics import moving_average


def moving_statistics(model):
    """`(variable, value now)` for every moving statistic of `model`'s BatchNorm layers.

    Read before a pass whose statistics updates may have to be undone (a
    skipped step, SAM's second pass); `variable.assign(value)` restores one.
    """
    return [(v, _read(v)) for layer in batch_norm_layers(model) for v in _moving(layer)]


def check_batch_norm_layers(model, mode):
    """Raises if `mode` cannot be honoured for a layer of `model`.

    Args:
        model: the model to be trained with `micro_batches > 1`.
        mode: the validated `batch_norm_updates` value.

    Returns:
        None.
    """
    if mode != "large_batch":
        return
    for layer in batch_norm_layers(model):
        if _compat.batch_norm_renorm(layer):
            raise ValueError(
                "batch_norm_updates='large_batch' cannot merge the statistics "
                f"of BatchNormalization layer {layer.name!r} because it uses "
                "renorm=True; compile with batch_norm_updates='per_micro_batch'. "
                "Received: batch_norm_updates='large_batch'"
            )


class LargeBatchStatistics:
    """Turns k per-micro-batch BatchNorm updates into one large-batch update.

    Use: `with stats.momentum_zero():` around the tracing of every forward
    pass of the loop; `state = stats.start()` before the first; after each
    forward `state = stats.add(state, size)`; at the end
    `stats.finish(state, n)`.

    Args:
        model: the model whose BatchNormalization layers are merged.

    Example:
    ```python
    stats = LargeBatchStatistics(model)
    state = stats.start()
    with stats.momentum_zero():
        for xb in micro_batches:
            model(xb, training=True)
            state = stats.add(state, tf.shape(xb)[0])
    stats.finish(state, n)
    ```
    """

    def __init__(self, model):
        self.layers = batch_norm_layers(model)

    def momentum_zero(self):
        """Moving statistics := the last micro-batch's statistics, while traced."""
        return momentum_zero(self.layers, [layer.momentum for layer in self.layers])

    def start(self):
        """Returns the loop state: the moving statistics now and zero sums."""
        old = [_read(v) for layer in self.layers for v in _moving(layer)]
        return old + [tf.zeros_like(t) for t in old]

    def add(self, state, size):
        """Adds the statistics the last forward pass left in the moving variables."""
        n_vars = len(state) // 2
        old, sums = state[:n_vars], list(state[n_vars:])
        size = tf.cast(size, tf.float32)
        i = 0
        for layer in self.layers:
            mean = _read(layer.moving_mean)
            variance = _read(layer.moving_variance)
            sums[i] = sums[i] + size * mean
            sums[i + 1] = sums[i + 1] + size * (variance + tf.square(mean))
            i += 2
        return old + sums

    def finish(self, state, n):
        """One update of every moving statistic with the whole batch's statistics."""
        n_vars = len(state) // 2
        old, sums = state[:n_vars], state[n_vars:]
        n = tf.cast(n, tf.float32)
        i = 0
        for layer in self.layers:
            mean, variance = merged_moments(sums[i], sums[i + 1], n)
            layer.moving_mean.assign(moving_average(old[i], mean, layer.momentum))
            layer.moving_variance.assign(moving_average(old[i + 1], variance, layer.momentum))
            i += 2


def _moving(layer):
    return (layer.moving_mean, layer.moving_variance)


def _read(variable):
    return tf.identity(tf.convert_to_tensor(variable))
