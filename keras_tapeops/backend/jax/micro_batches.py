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
by `size / n`, as on TensorFlow. Loss terms are computed inside the scan,
each on its micro-batch (inputs, labels, predictions, recorded layer
outputs, input gradients) and weighted by `size / n`, as the TensorFlow loop
adds them to each micro-batch's loss (`micro_batch_scan`).

Non-trainable state (BatchNormalization moving statistics, seed generators)
is carried from one micro-batch to the next: `batch_norm_updates=
"per_micro_batch"` semantics. With `"large_batch"` (the default, as on
TensorFlow) the BatchNormalization layers run with momentum 0 inside the
scan, so each micro-batch leaves its own mean and variance in the moving
variables; the scan returns them, and `LargeBatchStatistics.finish` merges
them (sample-weighted mean; variance via E[x^2] - mean^2) into one update
of the moving statistics with the whole batch's statistics, the update stock
Keras makes on the batch (`keras_tapeops/accumulation/batch_norm.py` is the
TensorFlow loop's).
"""

from __future__ import annotations

import contextlib
from typing import Any
from typing import Callable
from typing import Sequence

import jax
import keras
from keras import ops

from keras_tapeops._keras import masking
from keras_tapeops.accumulation.batch_norm_statistics import batch_norm_layers
from keras_tapeops.accumulation.batch_norm_statistics import merged_moments
from keras_tapeops.accumulation.batch_norm_statistics import momentum_zero
from keras_tapeops.accumulation.batch_norm_statistics import moving_average
from keras_tapeops.split_sizes import equal_size_groups
from keras_tapeops.split_sizes import static_batch_size

Forward = Callable[[Any, Any, Any], tuple[Any, Any, list[Any]]]
#: `pass_fn(trainable, non_trainable, x, y, sample_weight, optimizer_vars) ->
#: (y_pred, non_trainable, losses, values)`: one forward pass and its terms.
Pass = Callable[..., tuple[Any, Any, list[Any], list[Any]]]


class LargeBatchStatistics:
    """`batch_norm_updates="large_batch"` on JAX: one moving-statistics update per batch.

    Args:
        model: the model (its trainable BatchNormalization layers are merged).

    Example:
    ```python
    merge = LargeBatchStatistics(model)
    with merge.momentum_zero():   # while the micro-batch scan is traced
        ...                       # each micro-batch: merge.picked(non_trainable)
    non_trainable = merge.finish(before, after, stats, sizes, n)
    ```
    """

    def __init__(self, model: keras.Model) -> None:
        self.layers = batch_norm_layers(model)
        self.momenta = [layer.momentum for layer in self.layers]  # (zero while traced)
        index = {id(v): i for i, v in enumerate(model.non_trainable_variables)}
        self.positions = [
            (index[id(layer.moving_mean)], index[id(layer.moving_variance)])
            for layer in self.layers
        ]

    def __bool__(self) -> bool:
        return bool(self.layers)

    def momentum_zero(self) -> contextlib.AbstractContextManager[None]:
        """Moving statistics := the micro-batch's own statistics, while traced."""
        return momentum_zero(self.layers, self.momenta)

    def picked(self, non_trainable: Sequence[Any]) -> list[Any]:
        """The moving means and variances a micro-batch left (its own statistics)."""
        return [non_trainable[i] for pair in self.positions for i in pair]

    def finish(
        self,
        before: Sequence[Any],
        after: Sequence[Any],
        stats: Sequence[tuple[list[Any], int]],
        n: int,
    ) -> list[Any]:
        """`after` with each moving statistic updated once, with the whole batch's statistics.

        Args:
            before: the non-trainable values before the batch.
            after: the non-trainable values after the scan.
            stats: per run of equal-sized micro-batches, `(picked values
                stacked over its micro-batches, micro-batch size)`.
            n: the batch's sample count.
        """
        out = list(after)
        for j, (momentum, (mean_at, variance_at)) in enumerate(zip(self.momenta, self.positions)):
            mean_sum, square_sum = 0.0, 0.0
            for picked, size in stats:
                means = ops.cast(picked[2 * j], "float32")
                variances = ops.cast(picked[2 * j + 1], "float32")
                mean_sum = mean_sum + size * ops.sum(means, axis=0)
                square_sum = square_sum + size * ops.sum(variances + ops.square(means), axis=0)
            mean, variance = merged_moments(mean_sum, square_sum, float(n))
            for at, stat in ((mean_at, mean), (variance_at, variance)):
                out[at] = ops.cast(moving_average(before[at], stat, momentum), before[at].dtype)
        return out


def micro_batch_forward(
    forward: Forward, k: int, merge: LargeBatchStatistics | None = None
) -> Forward:
    """The forward pass of a batch in `k` rematerialized micro-batches.

    Args:
        forward: `forward(trainable, non_trainable, x) -> (y_pred,
            non_trainable, losses)`, the model's stateless training pass
            (`backend/jax/loss.stateless_forward`).
        k: requested number of micro-batches (a smaller batch uses one per
            sample).
        merge: the model's `LargeBatchStatistics` for `"large_batch"`
            BatchNormalization updates (None: per micro-batch).

    Returns:
        `forward(trainable, non_trainable, x) -> (y_pred, non_trainable,
        [extra_loss])`, for `jax_trainer.stateless_loss`: `y_pred` is the
        whole batch's, in sample order.

    Example:
    ```python
    model.compile(optimizer="sgd", loss="mse", micro_batches=4)
    model.fit(x, y, batch_size=64)  # on JAX: 4 passes of 16 samples, 1 step
    ```
    """

    def one_pass(trainable, non_trainable, x, y, sample_weight, optimizer_vars):
        return (*forward(trainable, non_trainable, x), [])

    def split_forward(trainable, non_trainable, x):
        y_pred, non_trainable, losses, _ = micro_batch_scan(
            one_pass, (trainable, non_trainable, None), (x, None, None), k, merge
        )
        return y_pred, non_trainable, losses

    return split_forward


def micro_batch_scan(
    pass_fn: Pass,
    state: tuple[Any, Any, Any],
    batch: tuple[Any, Any, Any],
    k: int,
    merge: LargeBatchStatistics | None = None,
) -> tuple[Any, Any, list[Any], list[Any]]:
    """`pass_fn` over `k` micro-batches, one rematerialized pass at a time.

    Args:
        pass_fn: one forward pass (and its loss terms) on a micro-batch,
            see `Pass`; its losses and values are float scalars.
        state: `(trainable, non_trainable, optimizer_vars)`; the
            non-trainable values are carried from one micro-batch to the next.
        batch: `(x, y, sample_weight)` of the whole batch (y and
            sample_weight may be None).
        k: requested number of micro-batches.
        merge: the model's `LargeBatchStatistics` (None, or one without
            layers: the moving statistics are carried per micro-batch).

    Returns:
        `(y_pred, non_trainable, [extra_loss], values)`: the whole batch's
        predictions in sample order, the last non-trainable values, and
        the forward losses and term values of the micro-batches, each
        weighted by `size / n`.
    """
    if merge:
        with merge.momentum_zero():
            return _scan(pass_fn, state, batch, k, merge)
    return _scan(pass_fn, state, batch, k, None)


def _scan(pass_fn, state, batch, k, merge):
    trainable, non_trainable, optimizer_vars = state
    before = non_trainable
    n = static_batch_size(batch[0])

    @jax.checkpoint
    def one_micro_batch(trainable, non_trainable, optimizer_vars, micro):
        y_pred, non_trainable, losses, values = pass_fn(
            trainable, non_trainable, *micro, optimizer_vars
        )
        extra = sum((ops.cast(loss, "float32") for loss in losses), ops.zeros((), "float32"))
        masks = [masking.keras_mask(t) for t in keras.tree.flatten(y_pred)]
        values = [ops.cast(v, "float32") for v in values]
        return (y_pred, masks), non_trainable, extra, values

    extra = ops.zeros((), "float32")
    values: list[Any] | None = None
    pieces, statistics = [], []
    for start, count, size in equal_size_groups(n, k):
        group = jax.tree_util.tree_map(lambda t: stacked(t, start, count, size), batch)

        def body(carry, micro, size=size):
            non_trainable, extra = carry
            y_pred, non_trainable, loss, micro_values = one_micro_batch(
                trainable, non_trainable, optimizer_vars, micro
            )
            picked = merge.picked(non_trainable) if merge else []
            return (non_trainable, extra + loss * (size / n)), (y_pred, micro_values, picked)

        (non_trainable, extra), (y_stacked, stacked_values, picked) = jax.lax.scan(
            body, (non_trainable, extra), group
        )
        statistics.append((picked, size))
        pieces.append(jax.tree_util.tree_map(unstacked, y_stacked))
        shares = [ops.sum(v) * (size / n) for v in stacked_values]
        values = shares if values is None else [a + b for a, b in zip(values, shares)]
    y_pred, masks = jax.tree_util.tree_map(lambda *p: jax.numpy.concatenate(p, axis=0), *pieces)
    # The Keras masks (e.g. Embedding(mask_zero=True)) travel beside the
    # predictions through the scan; the compiled loss reads them from y_pred.
    leaves = [masking.with_keras_mask(t, m) for t, m in zip(keras.tree.flatten(y_pred), masks)]
    y_pred = keras.tree.pack_sequence_as(y_pred, leaves)
    if merge:
        non_trainable = merge.finish(before, non_trainable, statistics, n)
    return y_pred, non_trainable, [extra], values or []


def stacked(t: Any, start: int, count: int, size: int) -> Any:
    """Samples `start .. start + count * size` of `t` as `[count, size, ...]`."""
    return ops.reshape(t[start : start + count * size], (count, size) + tuple(t.shape[1:]))


def unstacked(t: Any) -> Any:
    """`[count, size, ...]` back to `[count * size, ...]` (samples in order)."""
    return ops.reshape(t, (t.shape[0] * t.shape[1],) + tuple(t.shape[2:]))
