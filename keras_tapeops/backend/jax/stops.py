"""`kt.SkipNonFinite(max_consecutive=...)` on JAX: training stops between steps.

On TensorFlow an assertion inside the step stops training. A compiled JAX
step cannot raise, so `fit` adds `ConsecutiveSkipsStop` (first, before the
user's callbacks): after each execution of the step it reads each
`SkipNonFinite`'s count of non-finite steps in a row (a variable the step
carries) and raises `RuntimeError` with the transform's message once the
count reaches `max_consecutive`. On JAX the count stays at the limit once
it reaches it (`SkipNonFinite.keep_step`), so a run of non-finite steps
that ends inside one execution (`steps_per_execution > 1`) still stops
training; every later step of that execution changes nothing (`halted`:
weights, optimizer state and loss scale, moving statistics), as TensorFlow,
whose assertion ends the execution, never runs them. Keras's
`fit` then writes the last step's state back into the model.
`train_on_batch` checks the same way (`TapeOpsMixin.train_on_batch`).
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

from keras_tapeops._keras import jax_trainer
from keras_tapeops.options import TapeOpsOptions
from keras_tapeops.transforms.finite import SkipNonFinite


def stops_requested(options: TapeOpsOptions | None) -> bool:
    """True when a compiled `SkipNonFinite` has `max_consecutive` set."""
    return options is not None and any(
        isinstance(t, SkipNonFinite) and t.max_consecutive is not None
        for t in options.gradient_transforms
    )


def counters(model: keras.Model) -> list[tuple[int, SkipNonFinite, Any]]:
    """`(limit, transform, count variable)` of each bound `SkipNonFinite(max_consecutive)`."""
    state = getattr(model, "tapeops_state", None)
    bound = [] if state is None else state.transforms
    return [
        (transform.max_consecutive, transform, transform_state.variables["consecutive_skips"])
        for transform, transform_state in bound
        if isinstance(transform, SkipNonFinite) and transform.max_consecutive is not None
    ]


def resume(model: keras.Model) -> None:
    """Before training: a count left at the limit by a run that stopped is lowered by one.

    One more non-finite step then stops again, a finite one resets the count
    (as on TensorFlow, where the count would be one higher and not stay).
    """
    for limit, _, counter in counters(model):
        if float(counter.numpy()) >= limit:
            counter.assign(float(limit - 1))


def raise_if_stopped(model: keras.Model) -> None:
    """Raises the transform's error once a count has reached its limit (read between steps)."""
    for limit, transform, counter in counters(model):
        if float(jax_trainer.value_after_last_step(model, counter)) >= limit:
            raise RuntimeError(transform.stop_message())


def halted(model: keras.Model) -> Any:
    """In the step, before the gates: True once a count is at its limit (None without one).

    The step that reaches the limit is skipped as usual (under mixed
    precision the LossScaleOptimizer lowers its scale, as on TensorFlow,
    where the assertion fails after it); the steps after it in the same
    execution, which TensorFlow never runs, are halted: they change nothing
    (weights, optimizer state and loss scale, moving statistics).
    """
    flags = [
        ops.convert_to_tensor(counter) >= float(limit) for limit, _, counter in counters(model)
    ]
    if not flags:
        return None
    flag = flags[0]
    for other in flags[1:]:
        flag = ops.logical_or(flag, other)
    return flag


class ConsecutiveSkipsStop(keras.callbacks.Callback):
    """Raises once a `SkipNonFinite` has seen `max_consecutive` non-finite steps in a row.

    Example:
    ```python
    model.fit(x, y, callbacks=[ConsecutiveSkipsStop()])  # TapeOpsMixin.fit adds it
    ```
    """

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        # The step is made (and the transforms bound) before on_train_begin.
        resume(self.model)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        raise_if_stopped(self.model)
