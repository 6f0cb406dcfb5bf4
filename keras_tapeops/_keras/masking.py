"""The Keras mask a tensor carries, isolated here.

A masking layer (`Embedding(mask_zero=True)`, `Masking`) attaches its mask to
its output tensor as the attribute `_keras_mask`; Keras's losses read it to
weight the masked positions out. Keras 3 exports no public reader:
`keras.src.backend.common.masking.get_keras_mask` is private (Keras 3.6 and
later) and the attribute name has stayed `_keras_mask` through Keras 3.15.
"""


def keras_mask(tensor):
    """The Keras mask carried by `tensor` (its `_keras_mask` attribute), or None.

    Read as Keras 3.10-3.15 read it in `CompileLoss` and `Loss.__call__`, so a
    per-example loss masks the same positions as the compiled loss does.
    """
    return getattr(tensor, "_keras_mask", None)
