"""Per-example norms for GroupNormalization from its input and output gradient.

The layer computes `y = x_hat * gamma + beta`, with `x_hat` the input
normalized per example and per group of channels (over the group's channels
and every other non-batch axis; `groups=-1`: instance normalization). One
example's gradients are `sum x_hat * g` (gamma) and `sum g` (beta), summed
over the positions: as small as the parameters, so they are formed per
example directly from the recorded input (normalized again in float32, as
Keras does) and the output gradient, without a second backward pass.
"""

import keras
import tensorflow as tf

from keras_tapeops.layer_records.forwards import float32
from keras_tapeops.layer_records.forwards import output_forward
from keras_tapeops.layer_records.forwards import stock_call
from keras_tapeops.privacy.ghost_layer_norm import affine_parts


class GroupNormRule:
    """Per-example norms for `keras.layers.GroupNormalization`."""

    family = "GroupNormalization"

    @staticmethod
    def applies(layer):
        return stock_call(layer, keras.layers.GroupNormalization) and isinstance(layer.axis, int)

    forward = staticmethod(output_forward)

    @staticmethod
    def clip(site, records, grads, context):
        layer = site.layer
        gamma_rows, beta_rows = [], []
        for record, (gz,) in zip(records, grads):
            x = _channels_last(layer, float32(record["a"]))
            g = _channels_last(layer, float32(gz))
            beta_rows.append(tf.reduce_sum(g, 1))
            if layer.gamma is not None:
                gamma_rows.append(tf.reduce_sum(_normalized(layer, x) * g, 1))
        return affine_parts(layer.gamma, layer.beta, gamma_rows, beta_rows, context.scale)


def _channels_last(layer, tensor):
    """`tensor` as `[B, positions, channels]`, the layer's `axis` last."""
    rank = tensor.shape.rank
    axis = layer.axis % rank
    if axis != rank - 1:
        tensor = tf.transpose(tensor, [0, *(i for i in range(1, rank) if i != axis), axis])
    channels = tensor.shape[-1]
    return tf.reshape(tensor, [tf.shape(tensor)[0], -1, channels])


def _normalized(layer, x):
    """`x` (`[B, T, C]`) normalized per group as Keras's GroupNormalization does."""
    channels = x.shape[-1]
    groups = layer.groups if layer.groups != -1 else channels
    shape = tf.shape(x)
    grouped = tf.reshape(x, [shape[0], shape[1], groups, channels // groups])
    mean, variance = tf.nn.moments(grouped, axes=[1, 3], keepdims=True)
    x_hat = (grouped - mean) * tf.math.rsqrt(variance + layer.epsilon)
    return tf.reshape(x_hat, shape)
