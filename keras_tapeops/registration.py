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


def serialize_all(objects, model):
    """Serializes configuration objects saved with `model`'s compile config.

    Layer selectors inside them are written as their path in `model`, and an
    object whose class is not registered (so `load_model` could not rebuild
    it) is refused now, at save time, rather than when loading.

    Args:
        objects: transforms or terms.
        model: the model whose compile config is being saved.

    Returns:
        A list of Keras serialized configs.

    Raises:
        ValueError: naming the unregistered class.

    Example:
    ```python
    serialize_all(options.transforms, model)
    ```
    """
    from keras_tapeops import selectors

    out = []
    with selectors.paths_relative_to(model):
        for obj in objects:
            cls = type(obj)
            name = keras.saving.get_registered_name(cls)
            if keras.saving.get_registered_object(name) is not cls:
                raise ValueError(
                    f"{cls.__name__} cannot be saved: its class is not "
                    "registered for Keras serialization, so load_model could "
                    "not rebuild it. Decorate the class with "
                    "@keras.saving.register_keras_serializable(package='my_package'). "
                    f"Received: {obj!r}"
                )
            out.append(keras.saving.serialize_keras_object(obj))
    return out
