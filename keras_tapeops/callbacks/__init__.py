"""Callbacks of keras_tapeops (`kt.callbacks.*`)."""

from keras_tapeops.callbacks.sharpness import Sharpness

__all__ = ["Sharpness"]
