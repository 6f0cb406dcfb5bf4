"""Per-example norms for LayerNormalization from its input and output gradient.

The layer computes `y = x_hat * gamma + beta` with `x_hat` the input
normalized over `axis`. One example's gradients are `sum x_hat * g` (gamma)
and `sum g` (beta), summed over the axes that are neither the batch nor
`axis`: as small as the parameters, so they are formed per example directly
from the recorded input (normalized again, in float32, as Keras does) and the
output gradient, without a second backward pass. With the deprecated
`rms_scaling=True`, Keras ignores beta; so does this rule.
"""

import keras
import tensorflow as tf

from keras_tapeops.layer_records.forwards import float32
from keras_tapeops.layer_records.forwards import output_forward
from keras_tapeops.layer_records.forwards import stock_call
from keras_tapeops.privacy.ghost_dense import per_example_part


class LayerNormRule:
    """Per-example norms for `keras.layers.LayerNormalization`."""

    family = "LayerNormalization"

    @staticmethod
    def applies(layer):
        return stock_call(layer, keras.layers.LayerNormalization)

    forward = staticmethod(output_forward)

    @staticmethod
    def clip(site, records, grads, context):
        layer = site.layer
        gamma_rows, beta_rows = [], []
        for record, (gz,) in zip(records, grads):
            x = float32(record["a"])
            g = float32(gz)
            rank = x.shape.rank
            layer_axes = layer.axis if isinstance(layer.axis, (list, tuple)) else [layer.axis]
            axes = sorted(a % rank for a in layer_axes)
            summed = [i for i in range(1, rank) if i not in axes]
            beta_rows.append(tf.reduce_sum(g, summed) if summed else g)
            if layer.gamma is not None:
                x_hat = _normalized(layer, x, axes)
                gamma_rows.append(tf.reduce_sum(x_hat * g, summed) if summed else x_hat * g)
        beta = None if layer.rms_scaling else layer.beta
        return affine_parts(layer.gamma, beta, gamma_rows, beta_rows, context.scale)


def affine_parts(gamma, beta, gamma_rows, beta_rows, scale):
    """The `Part`s of a normalization's scale and offset from their per-call rows.

    Args:
        gamma, beta: the variables (None when the layer has none, or ignores it).
        gamma_rows, beta_rows: per call of the layer, `[B, ...]` per-example
            gradients shaped like the variable.
        scale: the loss scale.

    Returns:
        `{id(variable): Part}`, each call's rows summed.
    """
    parts = {}
    for variable, rows in ((gamma, gamma_rows), (beta, beta_rows)):
        if variable is not None:
            parts[id(variable)] = per_example_part(tf.add_n(rows), scale, variable.shape)
    return parts


def _normalized(layer, x, axes):
    """`x` normalized as `keras.ops.layer_normalization` does, without gamma and beta."""
    if layer.rms_scaling:
        variance = tf.math.reduce_variance(x, axis=axes, keepdims=True)
        return x * tf.math.rsqrt(variance + layer.epsilon)
    mean, variance = tf.nn.moments(x, axes=axes, keepdims=True)
    return (x - mean) * tf.math.rsqrt(variance + layer.epsilon)
