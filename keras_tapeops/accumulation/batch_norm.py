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
from keras_tapeops.accumulation.flat import FlatLayout


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
    pass of the loop; `before = stats.read()` and `state = stats.start()`
    before the first; after each forward `state = stats.add(state, size)`;
    at the end `stats.finish(before, state, n)`.

    The statistics of every layer travel packed (`flat.FlatLayout`: one
    vector per dtype for the means, one for the squares), so the loop
    carries a few variables and each update is a few ops, whatever the
    number of layers.

    Args:
        model: the model whose BatchNormalization layers are merged.

    Example:
    ```python
    stats = LargeBatchStatistics(model)
    before, state = stats.read(), stats.start()
    with stats.momentum_zero():
        for xb in micro_batches:
            model(xb, training=True)
            state = stats.add(state, tf.shape(xb)[0])
    stats.finish(before, state, n)
    ```
    """

    def __init__(self, model):
        self.layers = batch_norm_layers(model)
        means = [layer.moving_mean for layer in self.layers]
        self._layout = FlatLayout([v.shape for v in means], [v.dtype for v in means])

    def momentum_zero(self):
        """Moving statistics := the last micro-batch's statistics, while traced."""
        return momentum_zero(self.layers, [layer.momentum for layer in self.layers])

    def read(self):
        """The moving means and variances now, packed (read before the loop)."""
        return self._pack_moving()

    def start(self):
        """Returns the loop state: zero sums of `n_i * mean_i` and `n_i * E_i[x^2]`."""
        return self._layout.zeros() + self._layout.zeros()

    def add(self, state, size):
        """Adds the statistics the last forward pass left in the moving variables."""
        groups = len(self._layout.groups)
        means_and_variances = self._pack_moving()
        means, variances = means_and_variances[:groups], means_and_variances[groups:]
        mean_sums, square_sums = state[:groups], state[groups:]
        mean_sums = [s + tf.cast(size, s.dtype) * m for s, m in zip(mean_sums, means)]
        square_sums = [
            s + tf.cast(size, s.dtype) * (v + tf.square(m))
            for s, v, m in zip(square_sums, variances, means)
        ]
        return mean_sums + square_sums

    def finish(self, before, state, n):
        """One update of every moving statistic with the whole batch's statistics."""
        groups = len(self._layout.groups)
        momenta = [layer.momentum for layer in self.layers]
        # Both factors from Python floats, as `moving_average` takes them.
        keep = self._layout.constant(momenta)
        take = self._layout.constant([1.0 - m for m in momenta])
        new_means, new_variances = [], []
        for g in range(groups):
            mean, variance = merged_moments(state[g], state[groups + g], tf.cast(n, state[g].dtype))
            new_means.append(before[g] * keep[g] + mean * take[g])
            new_variances.append(before[groups + g] * keep[g] + variance * take[g])
        means = self._layout.unpack(new_means)
        variances = self._layout.unpack(new_variances)
        for layer, mean, variance in zip(self.layers, means, variances):
            layer.moving_mean.assign(mean)
            layer.moving_variance.assign(variance)

    def _pack_moving(self):
        means = self._layout.pack(
            [tf.convert_to_tensor(layer.moving_mean) for layer in self.layers]
        )
        variances = self._layout.pack(
            [tf.convert_to_tensor(layer.moving_variance) for layer in self.layers]
        )
        return means + variances


def _moving(layer):
    return (layer.moving_mean, layer.moving_variance)


def _read(variable):
    return tf.identity(tf.convert_to_tensor(variable))
