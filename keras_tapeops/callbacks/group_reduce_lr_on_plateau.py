"""`GroupReduceLROnPlateau`: `ReduceLROnPlateau` that scales every group's rate.

Keras 3.15's `ReduceLROnPlateau` handles a bare MultiOptimizer, but not one
wrapped in a `LossScaleOptimizer` (mixed precision): it reads
`optimizer.learning_rate`, which the MultiOptimizer refuses. This callback
finds the groups through the wrapper, multiplies every group's rate by the
same `factor` on a plateau (so the ratios between groups, e.g. a layer-wise
decay, are kept until a group reaches `min_lr`), and can log the rates.
"""

from __future__ import annotations

from typing import Any
from typing import TYPE_CHECKING
import warnings

import keras
import numpy as np

from keras_tapeops import validation
from keras_tapeops.callbacks.group_learning_rate import check_verbose
from keras_tapeops.callbacks.group_learning_rate import group_learning_rates
from keras_tapeops.callbacks.group_learning_rate import log_key
from keras_tapeops.callbacks.group_learning_rate import scheduled_groups
from keras_tapeops.groups import group_optimizers
from keras_tapeops.registration import register
from keras_tapeops.typing_aliases import Logs

if TYPE_CHECKING:
    from typing_extensions import Self


@register
class GroupReduceLROnPlateau(keras.callbacks.Callback):
    """Multiplies every group's learning rate by `factor` when `monitor` stops improving.

    The arguments and the plateau logic are those of
    `keras.callbacks.ReduceLROnPlateau`; the reduction applies to each
    optimizer group (a plain optimizer is one group): a group above `min_lr`
    gets `max(lr * factor, min_lr)`.

    Args:
        monitor: the logged quantity to watch.
        factor: number in (0, 1), the multiplier on a plateau.
        patience: epochs without improvement before reducing.
        verbose: 0 or 1.
        mode: "auto", "min" or "max".
        min_delta: the smallest change that counts as an improvement.
        cooldown: epochs to wait after a reduction before counting again.
        min_lr: lower bound of every group's rate.
        log: if True, the epoch logs get `"lr/<group>"` for every group
            (after any reduction of that epoch).

    Example:
    ```python
    model.fit(x, y, validation_split=0.25, epochs=6, callbacks=[
        kt.callbacks.GroupReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=2, log=True)])
    ```
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        factor: float = 0.1,
        patience: int = 10,
        verbose: int = 0,
        mode: str = "auto",
        min_delta: float = 1e-4,
        cooldown: int = 0,
        min_lr: float = 0.0,
        log: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(monitor, str) or not monitor:
            raise ValueError(f"`monitor` must be a non-empty string. Received: monitor={monitor!r}")
        self.monitor = monitor
        self.factor = validation.positive_number(factor, "factor")
        if self.factor >= 1.0:
            raise ValueError(f"`factor` must be in (0, 1). Received: factor={factor!r}")
        self.patience = _non_negative_int(patience, "patience")
        self.verbose = check_verbose(verbose)
        self.mode = validation.choice(mode, "mode", ("auto", "min", "max"))
        self.min_delta = validation.non_negative_number(min_delta, "min_delta")
        self.cooldown = _non_negative_int(cooldown, "cooldown")
        self.min_lr = validation.non_negative_number(min_lr, "min_lr")
        self.log = validation.boolean(log, "log")
        self._reset()

    def _reset(self):
        self.best = None
        self.wait = 0
        self.cooldown_counter = 0

    def _improves(self, value):
        if self.best is None:
            return True
        if self._maximize():
            return value - self.min_delta > self.best
        return value + self.min_delta < self.best

    def _maximize(self):
        if self.mode != "auto":
            return self.mode == "max"
        name = self.monitor.removeprefix("val_")
        if name.endswith("loss") or name.endswith("error"):
            return False
        if any(word in name for word in _HIGHER_IS_BETTER):
            return True
        raise ValueError(
            f"GroupReduceLROnPlateau cannot tell whether `{self.monitor}` should "
            "go down or up. Pass mode='min' or mode='max'. "
            f"Received: monitor={self.monitor!r}, mode='auto'"
        )

    def on_train_begin(self, logs: Logs = None) -> None:
        self._reset()
        fixed = scheduled_groups(group_optimizers(self.model))
        if fixed:
            raise ValueError(
                f"Groups {fixed} take their learning rate from a "
                "LearningRateSchedule, which GroupReduceLROnPlateau cannot "
                "lower. Use numbers as their learning rates."
            )

    def on_epoch_end(self, epoch: int, logs: Logs = None) -> None:
        logs = logs if logs is not None else {}
        current = logs.get(self.monitor)
        if current is None:
            warnings.warn(
                f"GroupReduceLROnPlateau is conditioned on `{self.monitor}`, "
                f"which is not in the logs. Available: {sorted(logs)}",
                stacklevel=2,
            )
        else:
            current = float(current)
            self._maximize()  # in "auto" mode: raises for a metric of unknown direction
            if self.cooldown_counter > 0:
                self.cooldown_counter -= 1
                self.wait = 0
            if self._improves(current):
                self.best = current
                self.wait = 0
            elif self.cooldown_counter == 0:
                self.wait += 1
                if self.wait >= self.patience and self._reduce(epoch):
                    self.cooldown_counter = self.cooldown
                    self.wait = 0
        if self.log:
            for name, rate in group_learning_rates(self.model).items():
                logs[log_key(name)] = rate

    def _reduce(self, epoch):
        reduced = False
        for name, optimizer in group_optimizers(self.model).items():
            old = float(keras.ops.convert_to_numpy(optimizer.learning_rate))
            if old > np.float32(self.min_lr):
                new = max(old * self.factor, self.min_lr)
                optimizer.learning_rate = new
                reduced = True
                if self.verbose:
                    print(
                        f"\nEpoch {epoch + 1}: GroupReduceLROnPlateau reducing "
                        f"{name} learning rate to {new}."
                    )
        return reduced

    def get_config(self) -> dict[str, Any]:
        return {
            "monitor": self.monitor,
            "factor": self.factor,
            "patience": self.patience,
            "verbose": self.verbose,
            "mode": self.mode,
            "min_delta": self.min_delta,
            "cooldown": self.cooldown,
            "min_lr": self.min_lr,
            "log": self.log,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Self:
        return cls(**config)


_HIGHER_IS_BETTER = ("acc", "auc", "precision", "recall", "f1", "fbeta", "iou", "r2")


def _non_negative_int(value, name):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"`{name}` must be a non-negative integer. Received: {name}={value!r}")
    return int(value)
