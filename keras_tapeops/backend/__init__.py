"""Backend seam: which Keras backend runs, and each backend's gradient code.

Everything outside this package that is shared by both backends is written
with `keras.ops` and NumPy; what needs `tf.GradientTape` or `jax` lives in
the backend's own modules (`keras_tapeops.backend.jax` for JAX; the
TensorFlow step is `keras_tapeops.mixin`).
"""

from __future__ import annotations

import keras


def name() -> str:
    """The Keras backend in use, e.g. `"tensorflow"` or `"jax"`.

    Returns:
        `keras.backend.backend()`.

    Example:
    ```python
    from keras_tapeops import backend
    backend.name()  # "tensorflow"
    ```
    """
    return keras.backend.backend()


def is_jax() -> bool:
    """True when Keras runs on the JAX backend.

    Returns:
        A bool.
    """
    return name() == "jax"
