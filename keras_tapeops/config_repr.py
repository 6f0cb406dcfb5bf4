"""`repr()` for configuration objects: the class name and its arguments.

Options, transforms and terms are immutable configuration whose public
attributes are their arguments; printing one shows them, like a Keras
object's config: `ClipByNorm(where='head*', clip_norm=1.0)`.
"""

import keras


class ConfigRepr:
    """Mixin: `repr()` lists the public attributes (the validated arguments).

    Example:
    ```python
    class Scale(ConfigRepr):
        def __init__(self, factor):
            self.factor = factor
    repr(Scale(2.0))  # "Scale(factor=2.0)"
    ```
    """

    def __repr__(self):
        arguments = ", ".join(
            f"{key}={_show(value)}" for key, value in vars(self).items() if not key.startswith("_")
        )
        return f"{type(self).__name__}({arguments})"


def _show(value):
    if isinstance(value, keras.layers.Layer):
        return f"<{type(value).__name__} name={value.name!r}>"
    if isinstance(value, tuple):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    if isinstance(value, ConfigRepr):
        return repr(value)
    if isinstance(value, keras.optimizers.schedules.LearningRateSchedule) or (
        callable(value)
        and not isinstance(value, type)
        and not hasattr(value, "__name__")
        and hasattr(value, "get_config")
    ):
        # A schedule (or other serializable callable object): its class and
        # config, not the default `<... object at 0x...>`.
        arguments = ", ".join(f"{key}={_show(item)}" for key, item in value.get_config().items())
        return f"{type(value).__name__}({arguments})"
    if callable(value) and hasattr(value, "__name__"):
        return value.__name__
    return repr(value)
