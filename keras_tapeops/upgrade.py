"""`upgrade(model)`: the keras_tapeops-enabled twin of a Sequential or functional model."""

import keras

from keras_tapeops import _keras_private as private
from keras_tapeops.mixin import TapeOpsMixin
from keras_tapeops.registration import register


@register
class TapeOpsSequential(TapeOpsMixin, keras.Sequential):
    """A `keras.Sequential` with the keras_tapeops training step.

    Example:
    ```python
    model = kt.TapeOpsSequential([keras.Input((4,)), keras.layers.Dense(1)])
    ```
    """


@register
class TapeOpsFunctional(TapeOpsMixin, keras.Model):
    """A functional model (built from `inputs=`/`outputs=`) with the keras_tapeops step.

    Keras swaps `keras.Model` for its functional class in this class's bases
    when it is constructed with inputs and outputs; use it only that way.

    Example:
    ```python
    inputs = keras.Input((4,))
    model = kt.TapeOpsFunctional(inputs, keras.layers.Dense(1)(inputs))
    ```
    """


def upgrade(model):
    """Returns a keras_tapeops-enabled model sharing `model`'s layers and weights.

    Args:
        model: a `keras.Sequential` or functional `keras.Model`. A model that
            already has the mixin is returned unchanged.

    Returns:
        A `TapeOpsSequential` or `TapeOpsFunctional` with the same layers
        (shared, not copied), weights, name, inputs and outputs. Compile it
        as usual, adding any keras_tapeops options.

    Example:
    ```python
    model = kt.upgrade(keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)]))
    model.compile(optimizer="adam", loss="mse",
                  gradient_transforms=[kt.ClipByGlobalNorm(1.0)])
    ```
    """
    if isinstance(model, TapeOpsMixin):
        return model
    if not isinstance(model, keras.Model):
        raise TypeError(
            "upgrade() takes a keras.Sequential or functional keras.Model. "
            f"Received: model={model!r} of type {type(model).__name__}"
        )
    if isinstance(model, keras.Sequential):
        new = _upgrade_sequential(model)
    elif private.is_functional(model):
        new = TapeOpsFunctional(
            inputs=model.input, outputs=model.output, name=model.name,
            trainable=model.trainable,
        )
    else:
        raise TypeError(
            "upgrade() cannot rebuild a subclassed model. Put the mixin first "
            f"in its bases instead: `class {type(model).__name__}"
            "(kt.TapeOpsMixin, keras.Model): ...`. "
            f"Received: model of type {type(model).__name__}"
        )
    return new


def _upgrade_sequential(model):
    layers = list(model.layers)
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):
        inputs = None
    if inputs:
        spec = inputs[0]
        layers = [keras.Input(batch_shape=spec.shape, dtype=spec.dtype)] + layers
    new = TapeOpsSequential(layers=layers, name=model.name, trainable=model.trainable)
    return new
