"""Mixed ghost clipping for Conv1D, Conv2D and Conv3D (padding, strides, dilation).

A convolution is a matmul over patches: with `A` the example's input
patches (`[T, C_in * K]`, T output positions, K kernel offsets) and `G` its
output gradients (`[T, C_out]`), the kernel gradient is `A^T G`. Its norm is
the Dense rule's (`ghost_dense.matmul_squared_norms`): ghost Gramians
(`T x T`) when `2 T^2 < P O`, else the per-example gradients, chosen per
layer from its shapes (mixed ghost clipping, Bu et al. 2022).

Patches are `K` times the layer's input, so the norms are computed over
chunks of the batch in sequence (`chunked_norms`: at most `CHUNK_ELEMENTS`
floats of patches and per-example gradients at a time), and nothing
per-example is kept: the clipped sum `sum_i c_i A_i^T G_i` is the
convolution's own filter gradient of the clip-weighted output gradients
(`Conv*DBackpropFilter` of the input and `c * G`; book-keeping, Bu et al.
2023: no second backward pass).

The patches of a 1D or 2D convolution come from one depthwise convolution
with one-hot filters (`channel_patches`: every input channel times each
kernel offset), in `(channel, offset)` order: on CPU about 6x faster than
`tf.image.extract_patches` for 3 input channels and 1.3x for 32 (fp32, batch
64), and the same numbers. Conv3D uses `tf.extract_volume_patches`.

`padding="causal"` (Conv1D) pads on the left as Keras does; channels-first
inputs are transposed. Grouped convolutions (`groups > 1`) and dilated
Conv3D use the vectorized fallback.
"""

import keras
import tensorflow as tf

from keras_tapeops.layer_records.forwards import float32
from keras_tapeops.layer_records.forwards import pre_activation_forward
from keras_tapeops.layer_records.forwards import stock_call
from keras_tapeops.layer_records.layouts import positions
from keras_tapeops.layer_records.layouts import static_product
from keras_tapeops.privacy.ghost_dense import matmul_method
from keras_tapeops.privacy.ghost_dense import matmul_squared_norms
from keras_tapeops.privacy.ghost_dense import per_example_part
from keras_tapeops.privacy.rules import Part

_CONVOLUTIONS = (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D)


class ConvRule:
    """Mixed ghost clipping for `keras.layers.Conv1D`, `Conv2D` and `Conv3D`."""

    family = "Conv"

    @staticmethod
    def applies(layer):
        return (
            any(stock_call(layer, kind) for kind in _CONVOLUTIONS)
            and getattr(layer, "groups", 1) == 1
            and layer.padding in ("valid", "same", "causal")
            # tf.extract_volume_patches has no dilation
            and (layer.rank < 3 or max(layer.dilation_rate) == 1)
        )

    forward = staticmethod(pre_activation_forward)

    @staticmethod
    def clip(site, records, grads, context):
        layer = site.layer
        kernel = layer.kernel
        inputs = [_padded_input(layer, r["a"]) for r in records]
        outputs = [channels_last(layer, float32(gz[0])) for gz in grads]

        sizes = [static_product(g.shape[1:-1]) for g in outputs]
        position_count = None if None in sizes else sum(sizes)
        patch_size = static_product(kernel.shape[:-1])
        filters = kernel.shape[-1]
        method = matmul_method(position_count, patch_size, filters)
        # Per-example gradients smaller than the output gradients (few input
        # channels, many positions: a first layer) are kept for the clipped
        # sum, so the output gradients are freed once the norms are known.
        # (Keeping them whenever they are smaller than the layer's input and
        # output gradient together, as the second convolution of
        # bench/privacy.py's CNN, took its step 1.65x -> 1.55x stock but its
        # step memory 34 -> 41 MiB: the stacked chunks are copied once.)
        keep_rows = (
            method == "per-example" and position_count is not None and patch_size < position_count
        )

        def norms(xs, gs):
            a = tf.concat([_patches(layer, x) for x in xs], axis=1)
            g = tf.concat([positions(g, filters) for g in gs], axis=1)
            if keep_rows:
                rows = tf.einsum("btp,bto->bpo", a, g)
                rows = tf.reshape(rows, [-1, patch_size * filters])
                return [tf.reduce_sum(rows * rows, 1), rows]
            return [matmul_squared_norms(a, g)[0]]

        if position_count is None:  # spatial sizes known only at run time: one chunk
            results = norms(inputs, outputs)
        else:
            # patches and output gradients, then two Gramians or the gradients
            per_example = position_count * (patch_size + filters) + (
                2 * position_count**2 if method == "ghost" else patch_size * filters
            )
            shapes = [(), (patch_size * filters,)] if keep_rows else [()]
            results = chunked_norms(norms, inputs, outputs, per_example, shapes)
        squared = results[0] / (context.scale * context.scale)

        def from_rows(rows, c):
            matrix = tf.linalg.matvec(rows, c, transpose_a=True)
            return _kernel_from_matrix(layer, tf.reshape(matrix, [patch_size, filters]))

        def weighted(c):
            return tf.add_n(
                [
                    _filter_gradient(layer, x, g * _along_batch(c, g))
                    for x, g in zip(inputs, outputs)
                ]
            )

        if keep_rows:
            part = Part.of_rows(squared, results[1], from_rows, method)
        else:
            part = Part(squared, weighted, method)
        parts = {id(kernel): part}
        if layer.bias is not None:
            bias_rows = tf.add_n(
                [tf.reduce_sum(g, list(range(1, g.shape.rank - 1))) for g in outputs]
            )
            parts[id(layer.bias)] = per_example_part(bias_rows, context.scale, layer.bias.shape)
        return parts


# Floats of patches and per-example gradients (or Gramians) one chunk of the
# batch may hold (1 MiB). On the bench's CNN (batch 64; bench/privacy.py) the
# step's peak memory was 70 MiB with 4 MiB chunks, 28-30 MiB with 1 MiB or
# 0.5 MiB ones, against 24-30 MiB for stock `fit` (the allocator's peak varies
# by a few MiB between runs with the order the threads run the ops in).
CHUNK_ELEMENTS = 2**18


def chunked_norms(norms, inputs, outputs, per_example, shapes=((),)):
    """`norms(inputs, outputs)` computed over chunks of the batch, one after another.

    Args:
        norms: callable `(inputs, outputs) -> list of [b, ...] tensors` for a
            chunk of `b` examples (the squared norms first).
        inputs, outputs: lists of `[B, ...]` tensors (the layer's calls).
        per_example: floats `norms` allocates per example (static).
        shapes: the static shape of one example's entry of each result.

    Returns:
        The list of float32 results, each `[B, ...]`. A `tf.while_loop` with
        `parallel_iterations=1` bounds the memory to one chunk's. Every
        chunk is a view of the inputs (a slice along the batch axis); the
        last one ends at the batch's end and overlaps the one before it
        when the chunk size does not divide the batch, and its repeated
        rows are dropped. (Padding the batch to whole chunks instead copied
        the inputs and output gradients whenever the chunk size did not
        divide the batch: 5 MiB a step for the third convolution of
        bench/privacy.py's CNN.) A batch no larger than a chunk (static
        size) is one call.

    Example:
    ```python
    chunked_norms(lambda xs, gs: [tf.reduce_sum(xs[0] ** 2, 1)], [x], [g], per_example=4)
    ```
    """
    chunk = max(1, CHUNK_ELEMENTS // max(1, per_example))
    static_batch = inputs[0].shape[0]
    if static_batch is not None and static_batch <= chunk:
        return norms(inputs, outputs)
    batch = tf.shape(inputs[0])[0]
    # A batch smaller than a chunk is padded to one (a copy of fewer than
    # `chunk` examples); a zero padding is no copy.
    filled = tf.maximum(batch, chunk)
    count = (filled + chunk - 1) // chunk

    def fill(tensor):
        return tf.pad(tensor, [[0, filled - batch]] + [[0, 0]] * (tensor.shape.rank - 1))

    xs, gs = [fill(x) for x in inputs], [fill(g) for g in outputs]

    def pick(i, tensors):
        # A range of the first axis: on CPU a view of the chunk, where
        # `tf.gather` copied it (about 3.6 ms of the bench's CNN step).
        start = tf.minimum(i * chunk, filled - chunk)
        return [
            tf.slice(t, [start] + [0] * (t.shape.rank - 1), [chunk] + [-1] * (t.shape.rank - 1))
            for t in tensors
        ]

    arrays = [
        tf.TensorArray(tf.float32, size=count, element_shape=[chunk, *shape]) for shape in shapes
    ]

    def body(i, arrays):
        values = norms(pick(i, xs), pick(i, gs))
        return i + 1, [array.write(i, value) for array, value in zip(arrays, values)]

    _, arrays = tf.while_loop(
        lambda i, _: i < count, body, [tf.constant(0), arrays], parallel_iterations=1
    )
    # The last chunk ends at the end and repeats `repeated` examples of the
    # one before it: example `j` is row `j` before the last chunk's
    # repeats, row `j + repeated` from them on.
    cut = (count - 1) * chunk
    repeated = count * chunk - filled
    example = tf.range(batch)
    rows = example + repeated * tf.cast(example >= cut, tf.int32)
    return [
        tf.gather(tf.reshape(array.stack(), [-1, *shape]), rows)
        for array, shape in zip(arrays, shapes)
    ]


def _along_batch(c, tensor):
    """`c` (`[B]`) shaped to broadcast along `tensor`'s batch axis."""
    return tf.reshape(c, [-1] + [1] * (tensor.shape.rank - 1))


def _filter_gradient(layer, x, g):
    """`sum_i x_i^T g_i` over the patches: the kernel gradient of output gradient `g`.

    `x` is the channels-last float32 input (causal padding applied), `g`
    the channels-last output gradient; one native backprop-filter op.
    """
    kernel_shape = layer.kernel.shape
    padding = "VALID" if layer.padding == "causal" else layer.padding.upper()
    if layer.rank == 3:
        return tf.compat.v1.nn.conv3d_backprop_filter_v2(
            x, kernel_shape, g, [1, *layer.strides, 1], padding
        )
    if layer.rank == 1:
        gradient = tf.compat.v1.nn.conv2d_backprop_filter(
            x[:, None],
            [1, *kernel_shape],
            g[:, None],
            [1, 1, layer.strides[0], 1],
            padding,
            dilations=[1, 1, layer.dilation_rate[0], 1],
        )
        return tf.reshape(gradient, kernel_shape)
    return tf.compat.v1.nn.conv2d_backprop_filter(
        x,
        kernel_shape,
        g,
        [1, *layer.strides, 1],
        padding,
        dilations=[1, *layer.dilation_rate, 1],
    )


def channels_last(layer, tensor):
    """`tensor` with a `data_format="channels_first"` layer's channel axis moved last."""
    if layer.data_format == "channels_first":
        rank = tensor.shape.rank
        return tf.transpose(tensor, [0] + list(range(2, rank)) + [1])
    return tensor


def _kernel_from_matrix(layer, matrix):
    """A `[patch features, filters]` matrix (`_patches`' order) in the kernel's shape."""
    kernel_shape = layer.kernel.shape
    if layer.rank == 3:  # extract_volume_patches: (offsets..., channel), the kernel's order
        return tf.reshape(matrix, kernel_shape)
    # channel_patches: (channel, offsets...) -> (offsets..., channel)
    spatial = list(kernel_shape[:-2])
    by_channel = [kernel_shape[-2], *spatial, kernel_shape[-1]]
    perm = [*range(1, len(spatial) + 1), 0, len(spatial) + 1]
    return tf.transpose(tf.reshape(matrix, by_channel), perm)


def _padded_input(layer, inputs):
    """The layer's input as channels-last float32, with causal padding applied."""
    x = channels_last(layer, float32(inputs))
    if layer.padding == "causal":
        left = layer.dilation_rate[0] * (layer.kernel_size[0] - 1)
        x = tf.pad(x, [[0, 0], [left, 0], [0, 0]])
    return x


def _patches(layer, x):
    """`[B, T, C_in * K]` float32 patches of `_padded_input` (Conv3D: `K * C_in`)."""
    padding = "valid" if layer.padding == "causal" else layer.padding
    if layer.rank == 3:
        patches = tf.extract_volume_patches(
            x, [1, *layer.kernel_size, 1], [1, *layer.strides, 1], padding.upper()
        )
    elif layer.rank == 1:
        patches = channel_patches(
            x[:, None],
            (1, *layer.kernel_size),
            (1, *layer.strides),
            (1, *layer.dilation_rate),
            padding,
        )
    else:
        patches = channel_patches(x, layer.kernel_size, layer.strides, layer.dilation_rate, padding)
    return positions(patches, patches.shape[-1])


def channel_patches(x, kernel_size, strides, dilation_rate, padding):
    """The 2D patches of `x` (`[B, H, W, C]`), `[B, H', W', C * K]` in `(channel, offset)` order.

    One depthwise convolution whose filter for offset `k` of the
    `kernel_size` window is one-hot at `k`, for every channel: entry
    `c * K + k` of a position is the input under offset `k` in channel `c`
    (the order `tf.nn.depthwise_conv2d` lays its channel multiplier out in).

    Args:
        x: `[B, H, W, C]` float32, channels last.
        kernel_size, strides, dilation_rate: pairs of ints (strides and
            dilation are not both above 1, as Keras requires).
        padding: `"valid"` or `"same"`.

    Returns:
        `[B, H', W', C * K]` float32, `K = kernel_size[0] * kernel_size[1]`.

    Example:
    ```python
    channel_patches(tf.ones([2, 5, 5, 3]), (3, 3), (1, 1), (1, 1), "same")  # [2, 5, 5, 27]
    ```
    """
    offsets = kernel_size[0] * kernel_size[1]
    one_hot = tf.reshape(tf.eye(offsets, dtype=x.dtype), [*kernel_size, 1, offsets])
    filters = tf.tile(one_hot, [1, 1, x.shape[-1], 1])
    return tf.nn.depthwise_conv2d(
        x,
        filters,
        strides=[1, *strides, 1],
        padding=padding.upper(),
        dilations=dilation_rate if max(dilation_rate) > 1 else None,
    )
