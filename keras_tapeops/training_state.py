"""The training state of a model's options, as Keras saves it (on every backend).

`TrainingState` is the saveable a keras_tapeops model exposes as its
`_tapeops_training_state` attribute (see `keras_tapeops.saving`): the
variables of stateful gradient transforms and of the multi-gradient engine,
keyed by `state.training_state_items()`. The TensorFlow `ModelState` and the
JAX `JaxModelState` both provide `options`, `variables_bound` and
`training_state_items()`; a GAN's players pass their own `restorable`.
"""

from __future__ import annotations

import warnings
from typing import Any
from typing import Sequence

import numpy as np

from keras_tapeops._keras import private


def transform_state_items(bound: Sequence[tuple[Any, Any]]) -> list[tuple[str, Any]]:
    """`(key, variable)` of the bound transforms' training state, keyed as saved in files.

    A transform's variable is keyed `"<position in gradient_transforms>.
    <class>.<variable name>"` on both backends, so a file saved with other
    options, or on the other backend, restores what matches by key.

    Args:
        bound: the `(transform, TransformState)` pairs, in list order.

    Returns:
        The `(key, variable)` pairs, in order.
    """
    return [
        (f"{i}.{type(t).__name__}.{name}", variable)
        for i, (t, s) in enumerate(bound)
        for name, variable in s.variables.items()
    ]


class TrainingState(private.KerasSaveable):
    """The training state of one model's options, as Keras saves it.

    The transforms' variables (e.g. `SkipNonFinite`'s count of skipped steps
    in a row) and the multi-gradient engine's are training state, like the
    optimizer's: they are not in `model.weights` (so `get_weights`,
    `set_weights` and weight files are the stock model's), but `model.save`,
    `save_weights` and so `BackupAndRestore` write them, under the model's
    `_tapeops_training_state` entry, and loading restores them. A stock model
    never reads that entry; a file without it (a stock model's, or one saved
    without stateful options) leaves the state as it is; entries of another
    configuration are skipped with a warning, as Keras skips an optimizer
    whose variables do not match.

    Args:
        state: the `ModelState` whose variables this saves.
        restorable: callable `() -> bool`, whether the state's variables
            exist yet (loaded values wait until they do). Default: once the
            state's transforms are bound, or at once without transforms.
    """

    def __init__(self, state, restorable=None):
        self._state = state
        self._restorable = restorable or (
            lambda: not state.options.gradient_transforms or state.variables_bound
        )
        self._pending = None  # loaded before the transforms were bound

    def _obj_type(self):
        # Keras's saving walk asks every saveable for its type to pick the
        # attributes it skips; "Loss" skips a plain object's (this one has
        # no child to save).
        return "Loss"

    def save_own_variables(self, store):
        for key, variable in self._state.training_state_items():
            store[key] = variable

    def load_own_variables(self, store):
        saved = {key: np.asarray(store[key]) for key in store.keys()}
        if not saved:
            return
        self._pending = saved
        self.restore_pending()

    def restore_pending(self):
        """Assigns loaded values once the variables exist; warns about leftovers."""
        state = self._state
        if self._pending is None:
            return
        if not self._restorable():
            return  # its variables are created later (before the first step); restored then
        saved, self._pending = self._pending, None
        skipped = []
        for key, variable in state.training_state_items():
            value = saved.pop(key, None)
            if value is not None and tuple(value.shape) == tuple(variable.shape):
                variable.assign(value)
            else:
                skipped.append(key)
        skipped += sorted(saved)
        if skipped:
            warnings.warn(
                "Skipping part of the keras_tapeops training state: the file "
                "was saved with other gradient_transforms or options. Not "
                f"restored (left as they were, or not in this model): {skipped}",
                stacklevel=2,
            )
