"""Gradient transforms for `compile(gradient_transforms=[...])`."""

from keras_tapeops.transforms.adaptive import AdaptiveClip
from keras_tapeops.transforms.adaptive import CentralizeGradients
from keras_tapeops.transforms.base import GradientTransform
from keras_tapeops.transforms.clipping import ClipByGlobalNorm
from keras_tapeops.transforms.clipping import ClipByNorm
from keras_tapeops.transforms.clipping import ClipByValue
from keras_tapeops.transforms.finite import SkipNonFinite
from keras_tapeops.transforms.observe import LogGradientNorm
from keras_tapeops.transforms.update_ratio import LogUpdateRatio

__all__ = [
    "AdaptiveClip",
    "CentralizeGradients",
    "ClipByGlobalNorm",
    "ClipByNorm",
    "ClipByValue",
    "GradientTransform",
    "LogGradientNorm",
    "LogUpdateRatio",
    "SkipNonFinite",
]
