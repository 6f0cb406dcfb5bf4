"""Per-example norms for DepthwiseConv1D/2D and SeparableConv1D/2D.

A depthwise convolution filters every input channel `c` on its own, with
`M = depth_multiplier` filters; output channel `c * M + m` is filter `m` of
channel `c`. With `P` one example's input patches (`[T, C, K]`: T output
positions, K kernel offsets, from `ghost_conv.channel_patches`) and `G` its
output gradients (`[T, C * M]`), the kernel's gradient is

    dW[k, c, m] = sum_t P[t, c, k] G[t, c * M + m]

as small as the kernel (`K * C * M`): it is formed per example directly
(one einsum), and the clipped sum weights those rows. The bias's gradient is
`sum_t G_t`.

A separable convolution is a depthwise convolution followed by a pointwise
(1x1) one; Keras runs both in one op. The rule runs them as two ops, with the
same strides, padding, dilation and data format, and records both outputs:
the depthwise kernel's gradient comes from the input patches and the
gradient with respect to the depthwise output, as above, and the pointwise
kernel's is a matmul over positions (`ghost_dense.matmul_parts`: ghost
Gramians or per-example, whichever is smaller for the layer's shapes).

Strides together with dilation (which Keras computes as a stride-1 dilated
convolution, subsampled) take the same route here. Channels-first inputs are
transposed.
"""

import keras
import tensorflow as tf

from keras_tapeops.layer_records.forwards import first_input
from keras_tapeops.layer_records.forwards import float32
from keras_tapeops.layer_records.forwards import pre_activation_forward
from keras_tapeops.layer_records.forwards import stock_call
from keras_tapeops.layer_records.layouts import positions
from keras_tapeops.layer_records.layouts import static_product
from keras_tapeops.privacy.ghost_conv import channel_patches
from keras_tapeops.privacy.ghost_conv import channels_last
from keras_tapeops.privacy.ghost_dense import matmul_parts
from keras_tapeops.privacy.ghost_dense import per_example_part
from keras_tapeops.privacy.rules import finite_or_zero

_DEPTHWISE = (keras.layers.DepthwiseConv1D, keras.layers.DepthwiseConv2D)
_SEPARABLE = (keras.layers.SeparableConv1D, keras.layers.SeparableConv2D)
_PADDINGS = ("valid", "same")  # what Keras's TensorFlow depthwise_conv runs


class DepthwiseConvRule:
    """Per-example norms for `keras.layers.DepthwiseConv1D` and `DepthwiseConv2D`."""

    family = "DepthwiseConv"

    @staticmethod
    def applies(layer):
        return any(stock_call(layer, kind) for kind in _DEPTHWISE) and layer.padding in _PADDINGS

    forward = staticmethod(pre_activation_forward)

    @staticmethod
    def clip(site, records, grads, context):
        layer = site.layer
        kernel = layer.kernel
        patches = tf.concat([_patches(layer, r["a"]) for r in records], axis=1)
        g = tf.concat([_positions(layer, gz[0]) for gz in grads], axis=1)
        parts = {id(kernel): depthwise_part(patches, g, kernel.shape, context.scale)}
        if layer.bias is not None:
            rows = tf.add_n([_bias_rows(layer, gz[0]) for gz in grads])
            parts[id(layer.bias)] = per_example_part(rows, context.scale, layer.bias.shape)
        return parts


class SeparableConvRule:
    """Per-example norms for `keras.layers.SeparableConv1D` and `SeparableConv2D`."""

    family = "SeparableConv"

    @staticmethod
    def applies(layer):
        return any(stock_call(layer, kind) for kind in _SEPARABLE) and layer.padding in _PADDINGS

    @staticmethod
    def forward(layer, original, args, kwargs):
        """The stock call in two stages: records the depthwise and the pre-activation outputs."""
        inputs = first_input(args, kwargs)
        depthwise = keras.ops.depthwise_conv(
            inputs,
            layer.depthwise_kernel,
            strides=layer.strides,
            padding=layer.padding,
            data_format=layer.data_format,
            dilation_rate=layer.dilation_rate,
        )
        z = keras.ops.conv(
            depthwise,
            layer.pointwise_kernel,
            strides=1,
            padding="valid",
            data_format=layer.data_format,
        )
        if layer.use_bias:
            if layer.data_format == "channels_last":
                bias_shape = (1,) * (layer.rank + 1) + (layer.filters,)
            else:
                bias_shape = (1, layer.filters) + (1,) * layer.rank
            z = keras.ops.add(z, keras.ops.reshape(layer.bias, bias_shape))
        outputs = layer.activation(z) if layer.activation is not None else z
        return outputs, {"a": inputs, "z": [depthwise, z]}

    @staticmethod
    def clip(site, records, grads, context):
        layer = site.layer
        depthwise_kernel = layer.depthwise_kernel
        pointwise_kernel = layer.pointwise_kernel
        patches = tf.concat([_patches(layer, r["a"]) for r in records], axis=1)
        intermediate = []
        for record in records:
            d = _positions(layer, record["z"][0])
            if context.sanitize:  # the engine cleans `a`, not what it recorded in `z`
                d = finite_or_zero(d)
            intermediate.append(d)
        d = tf.concat(intermediate, axis=1)
        g_d = tf.concat([_positions(layer, gz[0]) for gz in grads], axis=1)
        g = tf.concat([_positions(layer, gz[1]) for gz in grads], axis=1)
        parts = {
            id(depthwise_kernel): depthwise_part(
                patches, g_d, depthwise_kernel.shape, context.scale
            ),
            id(pointwise_kernel): matmul_parts(
                d, g, context.scale, lambda m: tf.reshape(m, pointwise_kernel.shape)
            ),
        }
        if layer.bias is not None:
            rows = tf.add_n([_bias_rows(layer, gz[1]) for gz in grads])
            parts[id(layer.bias)] = per_example_part(rows, context.scale, layer.bias.shape)
        return parts


def depthwise_part(patches, g, kernel_shape, scale):
    """The depthwise kernel's `Part` from per-example gradients (as small as the kernel).

    Args:
        patches: `[B, T, C * K]` float32 input patches, `(channel, offset)` order.
        g: `[B, T, C * M]` float32 output gradients (loss-scaled).
        kernel_shape: `[*kernel_size, C, M]`.
        scale: the loss scale.
    """
    channels, multiplier = kernel_shape[-2], kernel_shape[-1]
    offsets = static_product(kernel_shape[:-2])
    batch = tf.shape(patches)[0]
    p = tf.reshape(patches, [batch, -1, channels, offsets])
    g = tf.reshape(g, [batch, -1, channels, multiplier])
    rows = tf.einsum("btck,btcm->bkcm", p, g)
    return per_example_part(rows, scale, kernel_shape)


def _bias_rows(layer, grad):
    """`[B, channels]`: per example, the gradient summed over the axes the bias is broadcast on.

    Channels first, Keras (3.15, TensorFlow) adds the bias with
    `keras.ops.add`, which reads a `(1, C, 1...)` bias as a `tf.nn.bias_add`
    on the LAST axis when the output's last size is also C: then the bias is
    added along that (spatial) axis, and its gradient is summed accordingly.
    """
    g = float32(grad)
    rank = g.shape.rank
    channels = layer.bias.shape[0]
    axis = rank - 1
    if layer.data_format == "channels_first" and g.shape[-1] != channels:
        axis = 1
    return tf.reduce_sum(g, [i for i in range(1, rank) if i != axis])


def _positions(layer, tensor):
    """`[B, T, channels]` float32, channels last, T static where known."""
    x = channels_last(layer, float32(tensor))
    return positions(x, x.shape[-1])


def _patches(layer, inputs):
    """`[B, T, C * K]` float32 input patches of the layer's depthwise stage, `(channel, offset)`.

    As Keras's TensorFlow backend, strides together with dilation are a
    stride-1 dilated convolution (after the explicit "same" padding),
    subsampled.
    """
    x = channels_last(layer, float32(inputs))
    kernel_size = tuple(layer.kernel_size)
    strides = tuple(layer.strides)
    dilation = tuple(layer.dilation_rate)
    if layer.rank == 1:
        x = x[:, None]
        kernel_size, strides, dilation = (1, *kernel_size), (1, *strides), (1, *dilation)
    if max(strides) > 1 and max(dilation) > 1:
        if layer.padding == "same":
            x = _pad_same(x, kernel_size, strides, dilation)
        patches = channel_patches(x, kernel_size, (1, 1), dilation, "valid")
        patches = patches[:, :: strides[0], :: strides[1]]
    else:
        patches = channel_patches(x, kernel_size, strides, dilation, layer.padding)
    return positions(patches, patches.shape[-1])


def _pad_same(x, kernel_size, strides, dilation):
    """`x` (`[B, H, W, C]`) padded as TensorFlow's "same" for these strides and dilation."""
    paddings = [[0, 0]]
    for axis, (k, s, d) in enumerate(zip(kernel_size, strides, dilation)):
        n = x.shape[axis + 1]
        if n is None:  # a dynamic size: the same arithmetic on tensors
            n = tf.shape(x)[axis + 1]
            total = tf.maximum(((n + s - 1) // s - 1) * s + (k - 1) * d + 1 - n, 0)
        else:
            total = max(((n + s - 1) // s - 1) * s + (k - 1) * d + 1 - n, 0)
        paddings.append([total // 2, total - total // 2])
    paddings.append([0, 0])
    return tf.pad(x, paddings)
