"""`kt.SkipNonFinite(max_consecutive=...)` on JAX: training stops between steps.

On TensorFlow an assertion inside the step stops training. A compiled JAX
step cannot raise, so `fit` adds `ConsecutiveSkipsStop` (first, before the
user's callbacks): after each execution of the step it reads each
`SkipNonFinite`'s count of non-finite steps in a row (a variable the step
carries) and raises `RuntimeError` with the transform's message once the
count reaches `max_consecutive`. On JAX the count stays at the limit once
it reaches it (`SkipNonFinite.keep_step`), so a run of non-finite steps
that ends inside one execution (`steps_per_execution > 1`) still stops
training. Keras's `fit` then writes the last step's state back into the
model, so the model keeps its weights (the failing steps were skipped).
"""

from __future__ import annotations

from typing import Any

import keras

from keras_tapeops._keras import jax_trainer
from keras_tapeops.options import TapeOpsOptions
from keras_tapeops.transforms.finite import SkipNonFinite


def stops_requested(options: TapeOpsOptions | None) -> bool:
    """True when a compiled `SkipNonFinite` has `max_consecutive` set."""
    return options is not None and any(
        isinstance(t, SkipNonFinite) and t.max_consecutive is not None
        for t in options.gradient_transforms
    )


class ConsecutiveSkipsStop(keras.callbacks.Callback):
    """Raises once a `SkipNonFinite` has seen `max_consecutive` non-finite steps in a row.

    Example:
    ```python
    model.fit(x, y, callbacks=[ConsecutiveSkipsStop()])  # TapeOpsMixin.fit adds it
    ```
    """

    def __init__(self) -> None:
        super().__init__()
        self._counters: list[tuple[int, SkipNonFinite, Any]] = []

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        # The step is made (and the transforms bound) before on_train_begin.
        state = getattr(self.model, "tapeops_state", None)
        bound = [] if state is None else state.transforms
        self._counters = [
            (transform.max_consecutive, transform, transform_state.variables["consecutive_skips"])
            for transform, transform_state in bound
            if isinstance(transform, SkipNonFinite) and transform.max_consecutive is not None
        ]
        for limit, _, counter in self._counters:
            # A count left at the limit by a run that stopped: one more
            # non-finite step stops again, a finite one resets it (as on
            # TensorFlow, where the count would be one higher and not stay).
            if float(counter.numpy()) >= limit:
                counter.assign(float(limit - 1))

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        for limit, transform, counter in self._counters:
            in_a_row = float(jax_trainer.value_after_last_step(self.model, counter))
            if in_a_row >= limit:
                raise RuntimeError(transform.stop_message())
