"""The package's registration decorator for Keras serialization."""

import keras

PACKAGE = "keras_tapeops"


def register(cls):
    """Registers `cls` with Keras under the `keras_tapeops` package.

    Args:
        cls: a class with `get_config`/`from_config`.

    Returns:
        The class itself, registered as `"keras_tapeops>ClassName"`.

    Example:
    ```python
    @register
    class MyTransform(GradientTransform): ...
    ```
    """
    return keras.saving.register_keras_serializable(package=PACKAGE)(cls)
