"""Gradient transforms for `compile(gradient_transforms=[...])`."""

from keras_tapeops.transforms.base import GradientTransform
from keras_tapeops.transforms.clipping import ClipByGlobalNorm
from keras_tapeops.transforms.clipping import ClipByNorm
from keras_tapeops.transforms.clipping import ClipByValue

__all__ = ["ClipByGlobalNorm", "ClipByNorm", "ClipByValue", "GradientTransform"]
