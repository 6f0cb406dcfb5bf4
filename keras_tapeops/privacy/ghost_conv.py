"""Mixed ghost clipping for Conv1D and Conv2D (padding, strides, dilation).

A convolution is a matmul over patches: with `A` the example's input
patches (`[T, k_h * k_w * C_in]`, T output positions, as
`tf.image.extract_patches` lays them out: the kernel's own order) and `G` its
output gradients (`[T, C_out]`), the kernel gradient is `A^T G`. The norm is
then the Dense rule's (`ghost_dense.matmul_parts`): ghost Gramians (`T x T`)
when `2 T^2 < P O`, else the per-example gradients, chosen per layer from its
shapes (mixed ghost clipping, Bu et al. 2022). The clipped sum is one
matmul over the patches with the clip-weighted output gradients.

`padding="causal"` (Conv1D) pads on the left as Keras does; channels-first
inputs are transposed. Grouped convolutions (`groups > 1`) use the
vectorized fallback.
"""

import keras
import tensorflow as tf

from keras_tapeops.privacy.ghost_dense import matmul_parts
from keras_tapeops.privacy.ghost_dense import per_example_part
from keras_tapeops.privacy.ghost_dense import static_product
from keras_tapeops.privacy.rules import float32
from keras_tapeops.privacy.rules import pre_activation_forward
from keras_tapeops.privacy.rules import stock_call

_CONVOLUTIONS = (keras.layers.Conv1D, keras.layers.Conv2D)


class ConvRule:
    """Mixed ghost clipping for `keras.layers.Conv1D` and `keras.layers.Conv2D`."""

    family = "Conv"

    @staticmethod
    def applies(layer):
        return (
            any(stock_call(layer, kind) for kind in _CONVOLUTIONS)
            and getattr(layer, "groups", 1) == 1
            and layer.padding in ("valid", "same", "causal")
        )

    forward = staticmethod(pre_activation_forward)

    @staticmethod
    def clip(site, records, grads, context):
        layer = site.layer
        kernel = layer.kernel
        filters = kernel.shape[-1]
        a = tf.concat([_patches(layer, r["a"]) for r in records], axis=1)
        g = tf.concat([_positions(layer, gz[0], filters) for gz in grads], axis=1)
        parts = {
            id(kernel): matmul_parts(a, g, context.scale, lambda m: tf.reshape(m, kernel.shape))
        }
        if layer.bias is not None:
            parts[id(layer.bias)] = per_example_part(
                tf.reduce_sum(g, 1), context.scale, layer.bias.shape
            )
        return parts


def _channels_last(layer, tensor):
    if layer.data_format == "channels_first":
        rank = tensor.shape.rank
        return tf.transpose(tensor, [0] + list(range(2, rank)) + [1])
    return tensor


def _patches(layer, inputs):
    """`[B, T, k_h * k_w * C_in]` float32 input patches, in the kernel's order."""
    x = _channels_last(layer, float32(inputs))
    padding = layer.padding
    if padding == "causal":
        left = layer.dilation_rate[0] * (layer.kernel_size[0] - 1)
        x = tf.pad(x, [[0, 0], [left, 0], [0, 0]])
        padding = "valid"
    if layer.rank == 1:
        x = x[:, None]
        sizes = [1, 1, layer.kernel_size[0], 1]
        strides = [1, 1, layer.strides[0], 1]
        rates = [1, 1, layer.dilation_rate[0], 1]
    else:
        sizes = [1, *layer.kernel_size, 1]
        strides = [1, *layer.strides, 1]
        rates = [1, *layer.dilation_rate, 1]
    patches = tf.image.extract_patches(x, sizes, strides, rates, padding.upper())
    positions = static_product(patches.shape[1:3])
    return tf.reshape(
        patches, [tf.shape(patches)[0], positions if positions else -1, patches.shape[-1]]
    )


def _positions(layer, grad, filters):
    g = _channels_last(layer, float32(grad))
    positions = static_product(g.shape[1:-1])
    return tf.reshape(g, [tf.shape(g)[0], positions if positions else -1, filters])
