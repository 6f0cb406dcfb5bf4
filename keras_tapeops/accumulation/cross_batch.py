"""`compile(accumulation_steps=k)`: k consecutive batches, one optimizer step.

Each batch adds `n_j * grad_j` (its per-replica, optimizer-scaled gradient
times its sample count) and `n_j` to per-replica accumulators. When the window
holds k batches, the step applies `sum_j n_j grad_j / sum_j n_j`: the gradient
of the sample-weighted mean loss over every sample of the window, exactly the
step stock Keras takes on the concatenated batch. `optimizer.iterations` (and
so learning-rate schedules) count applied steps only.

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

import tensorflow as tf


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

    def __init__(self, model, steps):
        self.steps = steps
        self.variables = list(model.trainable_weights)
        self.sums = [
            _local_variable(tf.zeros(v.shape, v.dtype), f"accumulated_{i}")
            for i, v in enumerate(self.variables)
        ]
        self.samples = _local_variable(tf.constant(0.0), "accumulated_samples")
        # Float, not int: integer variables are awkward on accelerators.
        self.batches = _local_variable(
            tf.constant(0.0), "accumulated_batches",
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
        )
        self.present = [True] * len(self.variables)
        self._flush_function = None

    # ------------------------------------------------------------ train step
    def add(self, model, grads, n_samples):
        """Adds one batch to the window and applies the window when it is full.

        Args:
            model: the keras_tapeops model (its `apply_optimizer_step` applies).
            grads: per-replica optimizer-scaled gradients, one per variable.
            n_samples: the batch's (per-replica) sample count.

        Returns:
            None.
        """
        n = tf.cast(n_samples, tf.float32)
        present = [g is not None for g in grads]
        self.present = present  # which variables get gradients (trace time)
        for total, grad in zip(self.sums, grads):
            if grad is not None:
                total.assign_add(tf.convert_to_tensor(grad) * tf.cast(n, total.dtype))
        self.samples.assign_add(n)
        self.batches.assign_add(1.0)
        full = self.batches.read_value() > self.steps - 0.5
        self._apply_if(model, full, present)

    def _apply_if(self, model, full, present):
        """Applies the window when `full`; a full window of zero samples is only reset."""
        if not tf.distribute.has_strategy():
            total = self.samples.read_value()
            tf.cond(
                full,
                lambda: tf.cond(
                    total > 0,
                    lambda: self._apply(model, total, present),
                    self._reset_only,
                ),
                lambda: tf.constant(False),
            )
            return

        def cross_replica(strategy, full):
            full = strategy.experimental_local_results(full)[0]
            # Reading an ON_READ/SUM variable here sums it over replicas.
            total = self.samples.read_value()

            def apply():
                strategy.run(self._apply, args=(model, total, present))
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

    def _apply(self, model, total_samples, present):
        """In replica context: applies the window's mean gradient and resets."""
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        # sum over replicas of (local sum * replicas / total) = window mean,
        # since each replica's gradient carries Keras's 1/replicas loss scale.
        factor = tf.cast(replicas, tf.float32) / total_samples
        grads = [
            tf.cast(total.read_value() * tf.cast(factor, total.dtype), v.dtype)
            if on else None
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
        self.batches.assign(0.0)

    # ------------------------------------------------------------- epoch end
    def pending_batches(self):
        """Batches in the current window (eager; 0 when empty)."""
        return int(round(float(self.batches.numpy())))

    def flush(self, model):
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
                strategy.run(self._apply, args=(model, total, self.present))

            self._flush_function = (
                flush_step if model.run_eagerly else tf.function(flush_step)
            )
        self._flush_function()
        return True

    def reset(self):
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
