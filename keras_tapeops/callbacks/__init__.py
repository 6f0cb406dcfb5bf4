"""Callbacks of keras_tapeops (`kt.callbacks.*`).

On the JAX backend only `PrivacyBudget` is available (the others read or
change model state between steps, which the JAX step does not support yet).
"""

import keras

from keras_tapeops.callbacks.privacy_budget import PrivacyBudget

__all__ = ["PrivacyBudget"]

if keras.backend.backend() == "tensorflow":
    from keras_tapeops.callbacks.gradual_unfreezing import GradualUnfreezing
    from keras_tapeops.callbacks.group_learning_rate import GroupLearningRateScheduler
    from keras_tapeops.callbacks.group_reduce_lr_on_plateau import GroupReduceLROnPlateau
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
