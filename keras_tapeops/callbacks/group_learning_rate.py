"""`GroupLearningRateScheduler`: per-group learning rates of a MultiOptimizer, by epoch.

Works with the optimizer of `kt.optimizer_groups` / `kt.layerwise_lr_decay`
(a `keras.optimizers.MultiOptimizer`), also when mixed precision wraps it in a
`LossScaleOptimizer` (where Keras's `LearningRateScheduler` and
`ReduceLROnPlateau` fail: they read `optimizer.learning_rate`, which a
MultiOptimizer refuses). A plain optimizer is one group named after it.

Groups are named after their optimizers (`keras.optimizers.Adam(1e-3,
name="head")` is the group `"head"`); `kt.groups.group_optimizers(model)` lists
them.
"""

from __future__ import annotations

from typing import Callable
from typing import TYPE_CHECKING
import numbers
from typing import Any

import keras
import numpy as np

from keras_tapeops import selectors
from keras_tapeops import validation
from keras_tapeops.groups import group_optimizers
from keras_tapeops.registration import register
from keras_tapeops.typing_aliases import Logs

if TYPE_CHECKING:
    from typing_extensions import Self

LOG_PREFIX = "lr/"


def log_key(group):
    """The logs key of a group's learning rate: `"lr/<group>"`."""
    return f"{LOG_PREFIX}{group}"


def group_learning_rates(model):
    """`{group: current learning rate (float)}` for `model`'s optimizer.

    A group driven by a `LearningRateSchedule` reports the schedule's value
    at the optimizer's current step.
    """
    return {
        name: float(keras.ops.convert_to_numpy(optimizer.learning_rate))
        for name, optimizer in group_optimizers(model).items()
    }


def scheduled_groups(optimizers):
    """Names of the groups whose learning rate is a schedule (cannot be set)."""
    return [
        name
        for name, optimizer in optimizers.items()
        if isinstance(optimizer.get_config().get("learning_rate"), dict)
    ]


@register
class GroupLearningRateScheduler(keras.callbacks.Callback):
    """Sets each group's learning rate at the start of every epoch; can log them.

    Like `keras.callbacks.LearningRateScheduler`, per optimizer group: at
    `on_epoch_begin(epoch)` a group's rate becomes `fn(epoch, lr)`, where
    `lr` is that group's current rate (a float) and `fn` returns a float.

    Args:
        schedule: None (only log), one callable `fn(epoch, lr) -> lr` applied
            to every group with that group's own rate (a multiplicative `fn`
            keeps the ratios between groups), or a dict
            `{group_name: fn}`; groups not in the dict keep their rate.
        log: if True, the logs of every epoch get `"lr/<group>"`, each
            group's rate at the end of the epoch: History, the progress bar,
            CSVLogger and TensorBoard show them.
        verbose: 0 (quiet) or 1 (print each change).

    Raises:
        TypeError: at construction, for a `schedule` of the wrong type.
        ValueError: at construction, for a bad argument; at the start of
            `fit`, for a dict naming a group the optimizer lacks (the
            message lists the groups) or a scheduled group whose rate is a
            `LearningRateSchedule` (Keras cannot set it); during training,
            for a schedule that does not return a number.

    Example:
    ```python
    model.compile(loss="mse", optimizer=kt.optimizer_groups(model, [
        ("backbone/*", keras.optimizers.Adam(name="backbone")),
        ("head", keras.optimizers.Adam(name="head"))]))
    warm = kt.callbacks.GroupLearningRateScheduler(
        {"head": lambda epoch, lr: lr, "backbone": lambda epoch, lr: 1e-5 if epoch < 2 else 1e-4},
        log=True)
    model.fit(x, y, epochs=5, callbacks=[warm])   # History has "lr/head", "lr/backbone"
    ```
    """

    def __init__(
        self,
        schedule: (
            Callable[[int, float], float] | dict[str, Callable[[int, float], float]] | None
        ) = None,
        log: bool = False,
        verbose: int = 0,
    ) -> None:
        super().__init__()
        self.schedule = _check_schedule(schedule)
        self.log = validation.boolean(log, "log")
        self.verbose = check_verbose(verbose)

    # ------------------------------------------------------------ callbacks
    def on_train_begin(self, logs: Logs = None) -> None:
        optimizers = group_optimizers(self.model)
        if isinstance(self.schedule, dict):
            unknown = [name for name in self.schedule if name not in optimizers]
            if unknown:
                raise ValueError(
                    f"GroupLearningRateScheduler schedules groups {unknown} that "
                    f"the model's optimizer does not have. Groups: "
                    f"{list(optimizers)} (a group is named after its optimizer). "
                    f"Received: schedule keys={list(self.schedule)}"
                )
        fixed = [n for n in scheduled_groups(optimizers) if n in self._targets(optimizers)]
        if fixed:
            raise ValueError(
                f"Groups {fixed} take their learning rate from a "
                "LearningRateSchedule, which a callback cannot set. Schedule "
                "them with the schedule, or leave them out of `schedule`."
            )

    def on_epoch_begin(self, epoch: int, logs: Logs = None) -> None:
        optimizers = group_optimizers(self.model)
        for name in self._targets(optimizers):
            optimizer = optimizers[name]
            fn = self.schedule[name] if isinstance(self.schedule, dict) else self.schedule
            old = float(keras.ops.convert_to_numpy(optimizer.learning_rate))
            new = fn(epoch, old)
            if isinstance(new, (bool, np.bool_)) or not isinstance(new, numbers.Real):
                raise ValueError(
                    f"The schedule of group {name!r} must return a float. "
                    f"Received: {new!r} at epoch {epoch}"
                )
            optimizer.learning_rate = float(new)
            if self.verbose:
                print(
                    f"\nEpoch {epoch + 1}: GroupLearningRateScheduler setting "
                    f"{name} learning rate to {float(new)}."
                )

    def on_epoch_end(self, epoch: int, logs: Logs = None) -> None:
        if self.log and logs is not None:
            for name, rate in group_learning_rates(self.model).items():
                logs[log_key(name)] = rate

    # ---------------------------------------------------------------- helpers
    def _targets(self, optimizers):
        if self.schedule is None:
            return []
        if isinstance(self.schedule, dict):
            return [name for name in optimizers if name in self.schedule]
        return list(optimizers)

    def get_config(self) -> dict[str, Any]:
        schedule = self.schedule
        if isinstance(schedule, dict):
            schedule = {
                name: selectors.serialize_callable(fn, f"schedule[{name!r}]")
                for name, fn in schedule.items()
            }
        elif schedule is not None:
            schedule = selectors.serialize_callable(schedule, "schedule")
        return {"schedule": schedule, "log": self.log, "verbose": self.verbose}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Self:
        config = dict(config)
        schedule = config.get("schedule")
        if isinstance(schedule, dict) and "class_name" not in schedule:
            config["schedule"] = {
                name: keras.saving.deserialize_keras_object(fn) for name, fn in schedule.items()
            }
        elif schedule is not None:
            config["schedule"] = keras.saving.deserialize_keras_object(schedule)
        return cls(**config)


def _check_schedule(schedule):
    if schedule is None or (callable(schedule) and not isinstance(schedule, dict)):
        return schedule
    if isinstance(schedule, dict):
        if not schedule:
            raise ValueError(
                "`schedule` as a dict must name at least one group. "
                f"Received: schedule={schedule!r}"
            )
        for name, fn in schedule.items():
            if not isinstance(name, str) or not callable(fn):
                raise TypeError(
                    "`schedule` as a dict must map group names (str) to "
                    f"callables fn(epoch, lr) -> lr. Received: schedule={schedule!r}"
                )
        return dict(schedule)
    raise TypeError(
        "`schedule` must be None, a callable fn(epoch, lr) -> lr, or a dict "
        f"{{group_name: fn}}. Received: schedule={schedule!r}"
    )


def check_verbose(verbose):
    """Returns `verbose` (0 or 1) as an int, else raises ValueError."""
    if isinstance(verbose, (bool, np.bool_)) or verbose not in (0, 1):
        raise ValueError(f"`verbose` must be 0 or 1. Received: verbose={verbose!r}")
    return int(verbose)
