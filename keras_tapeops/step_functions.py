"""How Keras makes the step functions of a keras_tapeops model.

`StepFunctionMethods` is a base of `TapeOpsMixin` (before `keras.Model`):
before Keras makes its `train_function`/`test_function`, the model's state
is bound to its variables, the logged names are checked and an overridden
step is watched (`keras_tapeops.step_watch`); `fit` adds the accumulation
window's flush callback.
"""

from __future__ import annotations

from typing import Any
from typing import Callable


from keras_tapeops import name_checks
from keras_tapeops import step_watch
from keras_tapeops._keras import private
from keras_tapeops.accumulation.flush import FlushingFit
from keras_tapeops.hook_overrides import overrides


class StepFunctionMethods(FlushingFit):
    """`fit` (`FlushingFit`), `make_train_function`/`make_test_function`, the name checks."""

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # Keras's build before the first step fails under
        # MultiWorkerMirroredStrategy (keras-team/keras#20585): see
        # `_keras.private.maybe_symbolic_build`.
        private.maybe_symbolic_build(self, iterator, data_batch, super()._maybe_symbolic_build)

    def make_train_function(self, force: bool = False) -> Callable[..., Any]:
        return self._make_step_function("train", super().make_train_function, force)

    def make_test_function(self, force: bool = False) -> Callable[..., Any]:
        return self._make_step_function("test", super().make_test_function, force)

    def _make_step_function(self, kind, stock_make, force):
        """Binds and checks names, then lets Keras make its `<kind>_function`.

        Args:
            kind: "train" or "test".
            stock_make: Keras's `make_<kind>_function` (bound).
            force: passed on.

        Returns:
            The function, wrapped for multi-worker logs where needed.
        """
        self.build_tapeops()
        self._check_logged_names()
        step = f"{kind}_step"
        with step_watch.watching_step(self, step, overrides(self, step)):
            stock_make(force=force)
        name = f"{kind}_function"
        setattr(self, name, private.with_multi_worker_logs(self, getattr(self, name)))
        return getattr(self, name)

    def _check_logged_names(self, y=None, y_pred=None):
        """The logged-name check (see `keras_tapeops.name_checks`)."""
        name_checks.check_logged_names(self, self._stock_metrics, y, y_pred)
