"""The Keras mask a tensor carries, isolated here.

A masking layer (`Embedding(mask_zero=True)`, `Masking`) attaches its mask to
its output tensor; Keras's losses read it to weight the masked positions out.
On TensorFlow the mask is the tensor's `_keras_mask` attribute; a JAX array
takes no attribute, so Keras keeps its mask in a table keyed by the array
(`keras.src.backend.common.tensor_attributes`). Keras 3 exports no public
reader: `keras.src.backend.common.masking.get_keras_mask` (Keras 3.6 and
later, checked on 3.10 and 3.15) reads both.
"""

from keras.src.backend.common.masking import get_keras_mask
from keras.src.backend.common.masking import set_keras_mask


def keras_mask(tensor):
    """The Keras mask carried by `tensor`, or None.

    Read as Keras 3.10-3.15 read it in `CompileLoss` and `Loss.__call__`, so a
    per-example loss masks the same positions as the compiled loss does.
    """
    return get_keras_mask(tensor)


def with_keras_mask(tensor, mask):
    """`tensor`, now carrying `mask` as its Keras mask (nothing when `mask` is None).

    For outputs rebuilt from pieces (the JAX micro-batch scan concatenates
    each micro-batch's predictions, which drops their masks): the compiled
    loss then reads the mask as it would on the whole batch's output.
    `keras.src.backend.common.masking.set_keras_mask`, checked on Keras
    3.10 and 3.15 (no public writer either).
    """
    if mask is not None:
        set_keras_mask(tensor, mask)
    return tensor
