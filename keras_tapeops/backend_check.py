"""Refuses to run on a Keras backend other than TensorFlow."""

import keras


def require_tensorflow_backend():
    """Raises ImportError unless Keras runs on the TensorFlow backend.

    Returns:
        None.

    Example:
    ```python
    require_tensorflow_backend()  # no-op with KERAS_BACKEND=tensorflow
    ```
    """
    backend = keras.backend.backend()
    if backend != "tensorflow":
        raise ImportError(
            "keras_tapeops needs the TensorFlow backend of Keras 3 (set "
            f"KERAS_BACKEND=tensorflow); the current backend is '{backend}'."
        )
