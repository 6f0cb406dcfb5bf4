"""The inputs and the output unit an attribution explains."""

import keras
import numpy as np
import tensorflow as tf

from keras_tapeops._keras import private


def check_model(model):
    """Raises TypeError unless `model` is a Keras model (or layer)."""
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(f"`model` must be a Keras model. Received: model={model!r}")


def input_tensor(x):
    """`x` as a floating tensor (float64 becomes float32); one input only.

    Raises:
        TypeError: `x` is a structure of inputs, or not floating point.
    """
    if isinstance(x, (dict, list, tuple)):
        raise TypeError(
            "Attribution takes the one input tensor of a single-input model. "
            f"Received: x of type {type(x).__name__}"
        )
    x = tf.convert_to_tensor(x)
    if x.dtype == tf.float64:
        x = tf.cast(x, tf.float32)
    if not x.dtype.is_floating or x.shape.rank is None or x.shape.rank < 1:
        raise TypeError(
            "`x` must be a batch of floating-point inputs (batch first). "
            f"Received: x with dtype {x.dtype.name} and shape {x.shape}"
        )
    return x


def target_tensor(target, n):
    """`(batch,)` int32 targets; -1 means "the predicted class".

    Args:
        target: None, a non-negative int, or one non-negative int per example.
        n: the batch size.

    Returns:
        An int32 tensor of shape `(n,)`.
    """
    if target is None:
        return tf.fill([n], -1)
    if isinstance(target, (int, np.integer)) and not isinstance(target, bool):
        if target < 0:
            raise ValueError(
                f"`target` must be a non-negative output unit. Received: target={target!r}"
            )
        return tf.fill([n], int(target))
    array = np.asarray(target)
    if array.dtype.kind not in "iu" or array.shape != (n,) or (array < 0).any():
        raise ValueError(
            "`target` must be None (the predicted class), a non-negative int, "
            f"or one non-negative int per example (shape ({n},)). Received: "
            f"target={target!r}"
        )
    return tf.constant(array, tf.int32)


def outputs_of(model, x):
    """The model's output at `x` in inference mode, flattened to `(batch, units)` float32."""
    outputs = private.call_model(model, x, training=False)
    if tf.nest.is_nested(outputs):
        raise ValueError(
            "Attribution explains one output tensor; the model has several. "
            "Wrap the output you want in a model of its own. Received: "
            f"outputs {tf.nest.map_structure(lambda t: t.shape, outputs)}"
        )
    outputs = tf.cast(outputs, tf.float32)
    return tf.reshape(outputs, [tf.shape(outputs)[0], -1])


def selected(outputs, target):
    """`(scores, resolved)`: each example's output at its target unit.

    `target` -1 picks the arg-max. An out-of-range unit is clamped here and
    reported by `check_resolved` after the call.
    """
    units = tf.shape(outputs)[1]
    resolved = tf.where(
        target < 0, tf.argmax(outputs, axis=1, output_type=tf.int32), target
    )
    safe = tf.minimum(resolved, units - 1)
    scores = tf.gather(outputs, safe, axis=1, batch_dims=1)
    return scores, resolved, units


def check_resolved(target, resolved, units):
    """Raises ValueError if a requested unit is not an output of the model."""
    resolved = np.asarray(resolved)
    if (resolved >= int(units)).any():
        raise ValueError(
            f"`target` must name an output unit below {int(units)}. "
            f"Received: target={target!r}"
        )

