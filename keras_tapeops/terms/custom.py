"""`LossTerm`: a user function `fn(model, x, y, y_pred) -> scalar` added to the loss."""

import keras
import tensorflow as tf

from keras_tapeops import selectors
from keras_tapeops.registration import register
from keras_tapeops.terms.base import Term


@register
class LossTerm(Term):
    """Adds `weight * fn(model, x, y, y_pred)` to the loss inside the training tape.

    `fn` sees the step's batch and the outputs of its single forward pass, so
    it can combine predictions, labels, inputs and the model's variables. Its
    value is cast to float32.

    Args:
        fn: a callable `fn(model, x, y, y_pred) -> scalar tensor`. To save a
            model compiled with this term, register `fn` with
            `@keras.saving.register_keras_serializable(package=...)`.
        weight: a number, a `keras.optimizers.schedules.LearningRateSchedule`
            or a callable `step -> number` of the optimizer step.
        name: the name logged in History and the progress bar (default: the
            function's name, or `"loss_term"`).
        in_validation: whether validation/`evaluate()` computes the term,
            logs it as `val_<name>` and counts it in `val_loss`.

    Returns:
        A term for `compile(loss_terms=[...])`.

    Example:
    ```python
    @keras.saving.register_keras_serializable(package="my_project")
    def smoothness(model, x, y, y_pred):
        return keras.ops.mean(keras.ops.square(y_pred[:, 1:] - y_pred[:, :-1]))

    model.compile(optimizer="adam", loss="mse",
                  loss_terms=[kt.LossTerm(smoothness, weight=0.1)])
    ```
    """

    def __init__(self, fn, weight=1.0, name=None, in_validation=True):
        if not callable(fn):
            raise TypeError(
                "`fn` must be a callable fn(model, x, y, y_pred) -> scalar. "
                f"Received: fn={fn!r}"
            )
        self.fn = fn
        if name is None:
            fn_name = getattr(fn, "__name__", "")
            name = fn_name if fn_name.isidentifier() else "loss_term"
        super().__init__(weight=weight, name=name, in_validation=in_validation)

    def call(self, context):
        value = self.fn(context.model, context.x, context.y, context.y_pred)
        value = tf.convert_to_tensor(value)
        if value.shape.rank != 0:
            raise ValueError(
                f"LossTerm {self.name!r}: `fn` must return a scalar. "
                f"Received: a value of shape {value.shape}"
            )
        return tf.cast(value, "float32")

    def get_config(self):
        config = super().get_config()
        config["fn"] = selectors.serialize_callable(
            self.fn, "fn", owner=f"LossTerm {self.name!r}"
        )
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["fn"] = keras.saving.deserialize_keras_object(config["fn"])
        return super().from_config(config)
