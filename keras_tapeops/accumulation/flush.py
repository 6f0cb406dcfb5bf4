"""Applies an accumulation window cut short by the end of an epoch.

With `accumulation_steps=k` and an epoch of b batches, the last `b % k`
batches form a short window. `AccumulationFlush` applies it (averaged over
the samples it saw) as soon as the epoch's training batches are done: in
`on_test_begin` when `fit()` validates, else in `on_epoch_end`, and in
`on_train_end` (a fit stopped early). It runs before the other callbacks, so
`ModelCheckpoint`, `BackupAndRestore` and validation see the flushed weights.
`on_epoch_begin` and `on_train_begin` start a fresh window.

`TapeOpsMixin.fit()` (`FlushingFit`, on both backends) adds this callback
itself; users never need to.
"""

from __future__ import annotations

from typing import Any
import inspect

import keras

from keras_tapeops import fit_callbacks
from keras_tapeops.typing_aliases import Logs
from keras_tapeops.typing_aliases import ModelMixinBase


class AccumulationFlush(keras.callbacks.Callback):
    """Flushes the model's cross-batch accumulator at epoch boundaries.

    Finds the accumulator of the model it is attached to (does nothing for a
    model without `accumulation_steps > 1`).

    Example:
    ```python
    # Added automatically by TapeOpsMixin.fit(); by hand it would be:
    model.fit(x, y, callbacks=[AccumulationFlush(), *others])
    ```
    """

    def __init__(self):
        super().__init__()
        self._in_fit = False

    def _accumulator(self):
        model = self.model
        state = model.build_tapeops()
        return None if state is None else state.accumulator

    def _flush(self):
        accumulator = self._accumulator()
        if accumulator is not None:
            accumulator.flush(self.model)

    def _reset(self):
        accumulator = self._accumulator()
        if accumulator is not None:
            accumulator.reset()

    def on_train_begin(self, logs: Logs = None) -> None:
        self._in_fit = True
        self._reset()

    def on_epoch_begin(self, epoch: int, logs: Logs = None) -> None:
        self._reset()

    def on_test_begin(self, logs: Logs = None) -> None:
        if self._in_fit:  # validation inside fit(); not a standalone evaluate()
            self._flush()

    def on_epoch_end(self, epoch: int, logs: Logs = None) -> None:
        self._flush()

    def on_train_end(self, logs: Logs = None) -> None:
        self._flush()
        self._in_fit = False


def add_flush_callback(
    model: keras.Model, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Returns `fit()`'s `(args, kwargs)` with an `AccumulationFlush` first.

    Args:
        model: the keras_tapeops model `fit()` is called on.
        args, kwargs: the arguments given to `fit()`.

    Returns:
        `((), kwargs)`: every argument by name, `callbacks` starting with
        an `AccumulationFlush` (so it runs before checkpoints and validation).
    """
    return add_callbacks_first(
        model, args, kwargs, [AccumulationFlush()], "With accumulation_steps > 1"
    )


def add_callbacks_first(
    model: keras.Model,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    first: list[keras.callbacks.Callback],
    reason: str,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Returns `fit()`'s `(args, kwargs)` with the callbacks `first` before the user's.

    Args:
        model: the keras_tapeops model `fit()` is called on.
        args, kwargs: the arguments given to `fit()`.
        first: the callbacks to run first (a callback of the same type the
            user passed is replaced).
        reason: why they are added, for the error about a `CallbackList`.

    Returns:
        `((), kwargs)`: every argument by name.
    """
    bound = inspect.signature(keras.Model.fit).bind(model, *args, **kwargs)
    arguments = dict(bound.arguments)
    del arguments["self"]
    arguments.update(arguments.pop("kwargs", {}))
    callbacks = arguments.get("callbacks") or []
    if isinstance(callbacks, keras.callbacks.CallbackList):
        raise TypeError(
            f"{reason}, pass `callbacks` as a list, not a "
            f"CallbackList. Received: callbacks={callbacks!r}"
        )
    types = tuple(type(c) for c in first)
    callbacks = [c for c in callbacks if not isinstance(c, types)]
    arguments["callbacks"] = list(first) + list(callbacks)
    return (), arguments


class FlushingFit(ModelMixinBase):
    """`fit()` that adds `AccumulationFlush` first when `accumulation_steps > 1`
    and the callbacks the training dataset asks for.

    A base of `TapeOpsMixin` on every backend (before `keras.Model`).

    Example:
    ```python
    class Net(FlushingFit, keras.Model): ...  # (TapeOpsMixin includes it)
    ```
    """

    def fit(self, *args: Any, **kwargs: Any) -> keras.callbacks.History:
        """Stock `fit()`; with `accumulation_steps > 1` it also flushes windows.

        A window cut short by the end of an epoch is applied before
        validation and before other callbacks' `on_epoch_end` (see
        `AccumulationFlush`). The callbacks a keras_tapeops dataset asks for
        (`keras_tapeops.fit_callbacks`) run first.
        """
        options = self.tapeops_options
        if options is not None and options.accumulation_steps > 1:
            args, kwargs = add_flush_callback(self, args, kwargs)
        x = kwargs.get("x", args[0] if args else None)
        requested = fit_callbacks.requested_by(x)
        if requested:  # e.g. kt.privacy.poisson_batches(model=...)'s epoch clock
            args, kwargs = add_callbacks_first(
                self, args, kwargs, requested, "With this training dataset"
            )
        return super().fit(*args, **kwargs)
