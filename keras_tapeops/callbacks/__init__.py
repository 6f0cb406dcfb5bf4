"""Callbacks of keras_tapeops (`kt.callbacks.*`).

On the JAX backend `PrivacyBudget`, `GroupLearningRateScheduler` and
`GroupReduceLROnPlateau` are available (the others read or change model
state between steps in ways the JAX step does not support yet).
"""

import keras

from keras_tapeops.callbacks.group_learning_rate import GroupLearningRateScheduler
from keras_tapeops.callbacks.group_reduce_lr_on_plateau import GroupReduceLROnPlateau
from keras_tapeops.callbacks.privacy_budget import PrivacyBudget

__all__ = ["GroupLearningRateScheduler", "GroupReduceLROnPlateau", "PrivacyBudget"]

if keras.backend.backend() == "tensorflow":
    from keras_tapeops.callbacks.gradual_unfreezing import GradualUnfreezing
    from keras_tapeops.callbacks.robust_accuracy import RobustAccuracy
    from keras_tapeops.callbacks.selection_schedule import SelectionSchedule
    from keras_tapeops.callbacks.sharpness import Sharpness

    __all__ = [
        "GradualUnfreezing",
        "GroupLearningRateScheduler",
        "GroupReduceLROnPlateau",
        "PrivacyBudget",
        "RobustAccuracy",
        "SelectionSchedule",
        "Sharpness",
    ]
else:
    _TENSORFLOW_ONLY = (
        "GradualUnfreezing",
        "RobustAccuracy",
        "SelectionSchedule",
        "Sharpness",
    )

    def __getattr__(name: str) -> object:
        if name in _TENSORFLOW_ONLY:
            raise AttributeError(
                f"kt.callbacks.{name} is not available on the {keras.backend.backend()} "
                "backend yet; it needs KERAS_BACKEND=tensorflow. Available: "
                + ", ".join(f"kt.callbacks.{n}" for n in __all__)
                + ". See docs/backends.md."
            )
        raise AttributeError(f"module 'keras_tapeops.callbacks' has no attribute {name!r}")
