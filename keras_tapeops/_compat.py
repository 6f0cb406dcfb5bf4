"""Differences between the Keras versions keras_tapeops supports.

The floors are in pyproject.toml (`make test-oldest` runs the suite on them).
Each helper here names the Keras version that made it necessary, so that
raising a floor shows what can be deleted.
"""

import keras


def batch_norm_renorm(layer):
    """Whether BatchNormalization `layer` uses batch renormalization.

    `BatchNormalization(renorm=...)` is new in Keras 3.14; on older Keras
    the layer has no `renorm` attribute and never renormalizes.
    """
    return bool(getattr(layer, "renorm", False))


def multi_optimizer_class():
    """`keras.optimizers.MultiOptimizer`, or None before Keras 3.15."""
    return getattr(keras.optimizers, "MultiOptimizer", None)
