"""Refuses to run on a Keras backend keras_tapeops does not support."""

import keras

SUPPORTED_BACKENDS = ("tensorflow", "jax")


def require_supported_backend() -> str:
    """Returns the Keras backend; raises ImportError unless TensorFlow or JAX.

    Returns:
        `"tensorflow"` or `"jax"`.

    Example:
    ```python
    require_supported_backend()  # "tensorflow" with KERAS_BACKEND=tensorflow
    ```
    """
    backend = keras.backend.backend()
    if backend not in SUPPORTED_BACKENDS:
        raise ImportError(
            "keras_tapeops needs the TensorFlow or the JAX backend of Keras 3 (set "
            f"KERAS_BACKEND=tensorflow or KERAS_BACKEND=jax); the current backend is '{backend}'."
        )
    return backend
