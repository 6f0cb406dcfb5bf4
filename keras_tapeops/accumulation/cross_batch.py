"""`compile(accumulation_steps=k)`: k consecutive batches, one optimizer step.

Each batch adds `d_j * grad_j` (its per-replica, optimizer-scaled gradient
times its normalizer `d_j`) and `d_j` to per-replica accumulators. When the
window holds k batches, the step applies `sum_j d_j grad_j / sum_j d_j`: the
gradient of the window's loss normalized as Keras normalizes one batch,
exactly the step stock Keras takes on the concatenated batch. The normalizer
follows the compiled loss's reduction (see reductions.py): the sample count
for the default reductions (and for regularization losses and loss terms),
the sum of the sample weights for `"mean_with_sample_weight"` with sample
weights, the number of unmasked entries for a masked output; with `"sum"`
the batches' gradients are summed (`d_j = 1`, no division). A window whose
batch needs two normalizers (e.g. a `"sum"` output next to a mean-reduced
one) is refused on the first batch, before any weight changes: the window's
normalizers are known only after its last batch, and one accumulator can
wait for one. `optimizer.iterations` (and so learning-rate schedules) count
applied steps only.

The normalizer of a batch comes from its gradient pass
(`window_gradients`, which `TapeOpsMixin.compute_gradients` calls with
`accumulation_steps > 1`); `add` falls back to the sample count for a model
whose loss is not read (a custom `compute_loss`, a multi-gradient engine).

Distribution: the accumulators are `ON_READ`/`SUM` variables, so every
replica accumulates locally with no communication; the window's gradient is
all-reduced once, when it is applied, by `apply_optimizer_step`. The apply is
conditional; under a `tf.distribute` strategy the condition is evaluated in
cross-replica context (through `merge_call`) and the apply re-enters replica
context with `strategy.run`, because a synchronisation point inside a
replica-context `tf.cond` is not supported by tf.distribute (the failure of
Keras's own `gradient_accumulation_steps` in keras-team/keras#20582).

Mixed precision: the loss scale only changes when a step is applied, so every
batch of a window has the same scale; a non-finite batch makes the sum
non-finite and the LossScaleOptimizer skips the whole window.

The state is not saved with the model: it is reset at the start of every
epoch and a partial window is applied at the end of it (see flush.py).
"""

from __future__ import annotations

from typing import Any
from typing import Callable
from typing import Sequence
import threading
import weakref

import keras
import tensorflow as tf

from keras_tapeops.accumulation import reduction_kinds
from keras_tapeops.accumulation import reductions
from keras_tapeops.accumulation.micro_batches import micro_batch_pass
from keras_tapeops.replicas import batch_size
from keras_tapeops.typing_aliases import Gradient
from keras_tapeops.typing_aliases import Nested

# model -> {thread: (kind, normalizer tensor)} of the batch whose pass was just
# traced (MirroredStrategy traces each replica's step in its own thread).
_PENDING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def window_gradients(
    model: keras.Model, x: Nested, y: Nested, sample_weight: Nested
) -> tuple[list[Gradient], Nested]:
    """One batch's gradient pass under `accumulation_steps` (micro-batched if asked).

    Returns what `TapeOpsMixin.batch_gradients` (or `micro_batch_gradients`)
    returns, and leaves the batch's normalizer for `CrossBatchAccumulator.add`
    (same traced step).

    Args:
        model: the keras_tapeops model.
        x, y, sample_weight: the (per-replica) batch.

    Returns:
        `(grads, y_pred)`. Raises ValueError (while the first step is
        traced, before any weight changes) for a loss whose batches need two
        normalizers.
    """
    options = model.tapeops_options
    if options.micro_batches > 1:
        grads, y_pred, summary = micro_batch_pass(model, x, y, sample_weight, options.micro_batches)
        if summary is None:
            return grads, y_pred
        records, regularized = summary.records, summary.regularized
        sizes = dict(zip([r.key for r in records if r.kind == "masked"], summary.masked_sizes))
        totals = reductions.weight_totals(model, sample_weight)
        n = tf.cast(batch_size(x), tf.float32)

        def normalizer(record):
            if record.kind == "weights":
                return totals[record.index]
            if record.kind == "masked":
                return sizes[record.key]
            return n if record.kind == "samples" else tf.constant(1.0)
    else:
        if not reductions.analysable(model):
            return model.batch_gradients(x, y, sample_weight)
        reductions.build_compiled_loss(model, x, y, sample_weight)
        with reductions.intercepted(
            model, lambda r: r.value, reduction_kinds.option_of(options)
        ) as records:
            grads, y_pred = model.batch_gradients(x, y, sample_weight)
        regularized = bool(model.losses)

        def normalizer(record):
            return record.denominator

    kind, key = reductions.window_group(records, model, regularized, options.accumulation_steps)
    chosen = [r for r in records if r.key == key]
    weight = normalizer(chosen[0]) if chosen else tf.cast(batch_size(x), tf.float32)
    _PENDING.setdefault(model, {})[threading.get_ident()] = (kind, weight)
    return grads, y_pred


class CrossBatchAccumulator:
    """Per-replica gradient sums of the current accumulation window.

    Create it under the model's strategy scope (the mixin does, in
    `build_tapeops`).

    Args:
        model: the built keras_tapeops model.
        steps: batches per optimizer step (int >= 2).

    Example:
    ```python
    with model.distribute_strategy.scope():
        acc = CrossBatchAccumulator(model, steps=4)
    # in the train step, instead of applying the gradients:
    acc.add(model, grads, batch_size)
    ```
    """

    def __init__(self, model: keras.Model, steps: int) -> None:
        self.steps = steps
        self.variables = list(model.trainable_weights)
        self.sums = [
            _local_variable(tf.zeros(v.shape, v.dtype), f"accumulated_{i}")
            for i, v in enumerate(self.variables)
        ]
        self.samples = _local_variable(tf.constant(0.0), "accumulated_samples")
        # The window's normalizer (the sample count for the default reductions).
        self.normalizer = _local_variable(tf.constant(0.0), "accumulated_normalizer")
        self.unit = False  # "sum" reduction: the window's gradients are summed
        # Float, not int: integer variables are awkward on accelerators.
        self.batches = _local_variable(
            tf.constant(0.0),
            "accumulated_batches",
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
        )
        self.present = [True] * len(self.variables)
        self._flush_function: Callable[[], Any] | None = None

    # ------------------------------------------------------------ train step
    def add(
        self, model: keras.Model, grads: Sequence[Gradient], n_samples: int | tf.Tensor
    ) -> None:
        """Adds one batch to the window and applies the window when it is full.

        Args:
            model: the keras_tapeops model (its `apply_optimizer_step` applies).
            grads: per-replica optimizer-scaled gradients, one per variable.
            n_samples: the batch's (per-replica) sample count.

        Returns:
            None.
        """
        n = tf.cast(n_samples, tf.float32)
        kind, weight = _PENDING.get(model, {}).pop(threading.get_ident(), (None, None))
        if kind is None:
            kind, weight = _unread_loss_kind(model), n
        self.unit = kind == "unit"  # trace time: one kind per window
        if self.unit:
            weight = tf.constant(1.0)
        present = [g is not None for g in grads]
        self.present = present  # which variables get gradients (trace time)
        for total, grad in zip(self.sums, grads):
            if grad is not None:
                total.assign_add(tf.convert_to_tensor(grad) * tf.cast(weight, total.dtype))
        self.samples.assign_add(n)
        self.normalizer.assign_add(tf.cast(weight, tf.float32))
        self.batches.assign_add(1.0)
        full = self.batches.read_value() > self.steps - 0.5
        self._apply_if(model, full, present)

    def _apply_if(self, model, full, present):
        """Applies the window when `full`; a full window of zero samples is only reset."""
        if not tf.distribute.has_strategy():
            total = self.samples.read_value()
            normalizer = self.normalizer.read_value()
            tf.cond(
                full,
                lambda: tf.cond(
                    total > 0,
                    lambda: self._apply(model, total, present, normalizer),
                    self._reset_only,
                ),
                lambda: tf.constant(False),
            )
            return

        def cross_replica(strategy, full):
            full = strategy.experimental_local_results(full)[0]
            # Reading an ON_READ/SUM variable here sums it over replicas.
            total = self.samples.read_value()
            normalizer = self.normalizer.read_value()

            def apply():
                strategy.run(self._apply, args=(model, total, present, normalizer))
                return tf.constant(True)

            def reset():
                strategy.run(self._reset_only)
                return tf.constant(False)

            return tf.cond(
                full,
                lambda: tf.cond(total > 0, apply, reset),
                lambda: tf.constant(False),
            )

        tf.distribute.get_replica_context().merge_call(cross_replica, args=(full,))

    def _apply(self, model, total_samples, present, total_normalizer=None):
        """In replica context: applies the window's gradient and resets.

        Args:
            model: the keras_tapeops model.
            total_samples: the window's sample count (summed over replicas).
            present: which variables have gradients.
            total_normalizer: the window's normalizer summed over replicas
                (default: `total_samples`).
        """
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        if self.unit:
            # "sum": Keras does not scale it by replicas; the sum is the step.
            factor = tf.constant(1.0)
        elif total_normalizer is None:
            factor = tf.cast(replicas, tf.float32) / total_samples
        else:
            # sum over replicas of (local sum * replicas / total) = window
            # mean, since each replica's gradient carries Keras's
            # 1/replicas loss scale. A zero normalizer (every sample weight
            # zero) is a zero loss, as Keras's divide_no_nan makes it.
            factor = tf.math.divide_no_nan(tf.cast(replicas, tf.float32), total_normalizer)
        grads = [
            tf.cast(total.read_value() * tf.cast(factor, total.dtype), v.dtype) if on else None
            for total, v, on in zip(self.sums, self.variables, present)
        ]
        model.apply_optimizer_step(grads, self.variables)
        self._reset()
        return tf.constant(True)

    def _reset_only(self):
        """Discards a window of zero samples: no step (stock Keras changes nothing)."""
        self._reset()
        return tf.constant(False)

    def _reset(self):
        for total in self.sums:
            total.assign(tf.zeros_like(total))
        self.samples.assign(0.0)
        self.normalizer.assign(0.0)
        self.batches.assign(0.0)

    # ------------------------------------------------------------- epoch end
    def pending_batches(self) -> int:
        """Batches in the current window (eager; 0 when empty)."""
        return int(round(float(self.batches.numpy())))

    def flush(self, model: keras.Model) -> bool:
        """Applies a partial window now (averaged over its samples), if any.

        Called eagerly between steps (end of epoch, before validation).

        Args:
            model: the keras_tapeops model.

        Returns:
            True if a step was applied.
        """
        if self.pending_batches() == 0:
            return False
        if float(self.samples.numpy()) == 0:  # only empty batches: no step
            self._reset()
            return False
        strategy = model.distribute_strategy
        if self._flush_function is None:

            def flush_step():
                total = self.samples.read_value()
                normalizer = self.normalizer.read_value()
                strategy.run(self._apply, args=(model, total, self.present, normalizer))

            self._flush_function = flush_step if model.run_eagerly else tf.function(flush_step)
        self._flush_function()
        return True

    def reset(self) -> None:
        """Discards the current window (eager)."""
        self._reset()


def _local_variable(initial, name, aggregation=tf.VariableAggregation.SUM):
    return tf.Variable(
        initial,
        trainable=False,
        name=name,
        synchronization=tf.VariableSynchronization.ON_READ,
        aggregation=aggregation,
    )


def _unread_loss_kind(model):
    """The window kind when no `window_gradients` pass told it (sample counts).

    Reached for a loss this module does not read (a custom `compute_loss`, a
    multi-gradient engine), and when the step's gradient pass did not go
    through `window_gradients`. Then only the sample count is known: a
    compiled loss reduced otherwise is refused (before any weight changes)
    rather than accumulated with the wrong weights.
    """
    if not reductions.analysable(model):
        return "samples"
    named = {
        entry.name: getattr(entry.loss, "reduction", "sum_over_batch_size")
        for entry in reductions.flat_losses(model)
    }
    for name, reduction in named.items():
        if reduction in reduction_kinds.UNREDUCED:
            raise reduction_kinds.refuse_unreduced(
                *reduction_kinds.option_of(model.tapeops_options), name, reduction
            )
    if all(r in reduction_kinds.MEAN_REDUCTIONS for r in named.values()):
        return "samples"
    raise reduction_kinds.refuse_mixed_window(
        model.tapeops_options.accumulation_steps,
        named,
        "batches weighted by their sample counts",
    )
