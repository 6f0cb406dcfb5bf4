"""`SkipNonFinite`: a step whose gradient has a nan or inf changes nothing."""

from __future__ import annotations

from typing import Any
from typing import Sequence

import keras
from keras import ops

from keras_tapeops import validation
from keras_tapeops.paths import LayerTree
from keras_tapeops.registration import register
from keras_tapeops.transforms.base import GradientTransform
from keras_tapeops.transforms.base import TransformState
from keras_tapeops.selectors import Selector
from keras_tapeops.transforms.sparse import is_sparse


@register
class SkipNonFinite(GradientTransform):
    """Skips every optimizer step whose selected true gradients are not all finite.

    A skipped step changes nothing: the optimizer is not called (weights,
    optimizer slots, `optimizer.iterations` and learning-rate schedules stay
    bit-identical) and the BatchNormalization moving statistics the forward
    pass updated are restored. The decision is taken on true gradients
    (summed over replicas), so every replica takes the same one. The epoch's
    number of skipped steps is logged as `skipped_steps`.

    With mixed precision the LossScaleOptimizer still sees the step as an
    overflow: it skips it and halves its scale, as without this transform
    (an overflow of the scaled loss is logged as a skipped step too). With
    `accumulation_steps`, a non-finite batch makes its window's sum
    non-finite and the whole window is skipped (moving statistics of the
    window's batches are not restored). With `micro_batches`, the batch is
    skipped and its statistics restored.

    What `max_consecutive` counts: steps whose true (unscaled) gradients
    are not finite. Under a `LossScaleOptimizer` an overflow while its
    scale is above 1 may come from the scale itself (the LossScaleOptimizer
    then halves it, as during its warm-up from 2**15): such a step is skipped
    and logged in `skipped_steps` but does not count, and does not reset the
    count. At a scale of 1 or below the scaled gradient is no larger than the
    true one, so a non-finite step counts. Healthy mixed-precision training
    is never stopped; a diverged one stops after the scale has fallen to 1
    (about 15 halvings from Keras's initial 2**15) and `max_consecutive`
    more steps.

    Args:
        max_consecutive: None, or an int >= 1: after this many non-finite
            steps in a row (see above) training stops with an error (the
            count is saved with the model, so it survives
            `BackupAndRestore`). On TensorFlow an assertion in the step
            raises `InvalidArgumentError`; it is not checked under XLA
            (`jit_compile=True`), which drops assertions. On JAX, where a
            compiled step cannot raise, `fit` and `train_on_batch` check the
            count after each execution of the step (every
            `steps_per_execution` batches) and raise `RuntimeError` with the
            same message; the steps after the one that reached the limit,
            to the end of the execution, change nothing (loss scale
            included), so the model keeps the weights of the last applied
            step, as on TensorFlow.
        where: selector of the gradients checked (None: all).
        name: the logged metric's name.

    Returns:
        A transform for `compile(gradient_transforms=[...])`; place it first.

    Example:
    ```python
    model.compile(optimizer="adam", loss="mse",
                  gradient_transforms=[kt.SkipNonFinite(max_consecutive=10),
                                       kt.ClipByGlobalNorm(1.0)])
    ```
    """

    def __init__(
        self,
        max_consecutive: int | None = None,
        where: Selector = None,
        name: str = "skipped_steps",
    ) -> None:
        super().__init__(where=where)
        if max_consecutive is not None:
            max_consecutive = validation.positive_int(max_consecutive, "max_consecutive")
        self.max_consecutive = max_consecutive
        self.name = validation.name(name, "name")

    def bind(
        self, model: keras.Model, variables: Sequence[keras.Variable], tree: LayerTree | None = None
    ) -> TransformState:
        state: Any = super().bind(model, variables, tree)  # plus `state.model`, below
        state.add_variable("consecutive_skips", 0.0)
        state.add_metric(ReplicaAgreedCount(name=self.name))
        state.model = model  # its optimizer's loss scale, read in each step
        return state

    def keep_step(
        self, grads: Sequence[Any], variables: Sequence[keras.Variable], state: TransformState
    ) -> Any:
        checks = [
            ops.all(ops.isfinite(_values(g)))
            for g, on in zip(grads, state.selected)
            if on and g is not None
        ]
        finite = ops.all(ops.stack(checks)) if checks else ops.convert_to_tensor(True)
        skipped = 1.0 - ops.cast(finite, "float32")
        # Every replica takes the same decision and counts it; the count
        # averages its replicas (see ReplicaAgreedCount).
        state.metrics[self.name].update_state(skipped)
        counter = state.variables["consecutive_skips"]
        counts = skipped * _true_overflow(getattr(state, "model", None))
        # A finite step resets the count; a loss-scale overflow leaves it.
        in_a_row = ops.where(finite, 0.0, counter + counts)
        if self.max_consecutive is not None and keras.backend.backend() == "jax":
            # Checked between executions of the step (backend/jax/stops.py):
            # once the count reaches the limit it stays there and no later
            # step of the same execution (`steps_per_execution > 1`) is
            # applied, as if training had stopped inside the step as on
            # TensorFlow.
            limit = float(self.max_consecutive)
            previous = ops.convert_to_tensor(counter)
            in_a_row = ops.where(previous >= limit, previous, in_a_row)
            counter.assign(in_a_row)
            return ops.logical_and(finite, in_a_row < limit)
        counter.assign(in_a_row)
        if self.max_consecutive is not None:
            import tensorflow as tf  # on JAX a callback stops training (see Args)

            tf.debugging.assert_less(
                in_a_row,
                tf.constant(float(self.max_consecutive)),
                message=self.stop_message(),
            )
        return finite

    def transform(
        self, grads: Sequence[Any], variables: Sequence[keras.Variable], state: TransformState
    ) -> list[Any]:
        return list(grads)

    def stop_message(self) -> str:
        """The error that stops training after `max_consecutive` non-finite steps in a row."""
        return (
            f"SkipNonFinite: {self.max_consecutive} steps in a row had "
            "non-finite true gradients (loss-scale overflows of mixed "
            "precision are not counted), so training stops. Look for "
            "nan or inf in the inputs, targets or sample weights, a loss "
            "or layer that takes log(0), sqrt(0) or divides by zero, or "
            "a diverging model (lower the learning rate, clip the "
            "gradients). Received: "
            f"max_consecutive={self.max_consecutive}"
        )

    def get_config(self) -> dict[str, Any]:
        return {
            "max_consecutive": self.max_consecutive,
            "name": self.name,
            **super().get_config(),
        }


class ReplicaAgreedCount(keras.metrics.Metric):
    """A running sum of a value every replica computes alike (a shared decision).

    `keras.metrics.Sum` sums its variable over replicas where Keras reads it
    in cross-replica context (the epoch's History), and its per-batch logs
    average the replicas' results: counting on every replica logs N times
    the count in History, counting on one replica logs 1/N of it per batch.
    This variable averages its replicas (`aggregation="mean"`), so both read
    the count.

    Args:
        name: the logged name.

    Example:
    ```python
    count = ReplicaAgreedCount(name="skipped_steps"); count.update_state(1.0)
    ```
    """

    def __init__(self, name="count", dtype=None):
        super().__init__(name=name, dtype=dtype)
        self.total = self.add_variable(
            shape=(), initializer="zeros", name="total", aggregation="mean"
        )

    def update_state(self, value):
        self.total.assign_add(ops.cast(value, self.total.dtype))

    def result(self):
        return ops.copy(self.total)

    def reset_state(self):
        self.total.assign(0.0)


def _true_overflow(model):
    """1.0 when a non-finite step is the true gradient's, 0.0 for a scale overflow.

    Under a `LossScaleOptimizer` whose scale is above 1 an overflow may be
    the scale's doing (it halves the scale and retries); at 1 or below, or
    without dynamic loss scaling, the true gradient is not finite.
    """
    optimizer = getattr(model, "optimizer", None)
    if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return ops.convert_to_tensor(1.0)
    scale = ops.cast(ops.convert_to_tensor(optimizer.dynamic_scale), "float32")
    return ops.cast(scale <= 1.0, "float32")


def _values(grad):
    """The values a gradient holds (an IndexedSlices' rows, not densified)."""
    return grad.values if is_sparse(grad) else grad
