"""Ghost norms for Dense and EinsumDense (sequence inputs included).

For one example with inputs `A` (`[T, P]`: T positions, P input features)
and output gradients `G` (`[T, O]`), the kernel's gradient is `A^T G` and

    ||A^T G||_F^2 = <A A^T, G G^T>          (the "ghost" norm: T x T Gramians)

which never forms the `P x O` per-example gradient. With one position (an
MLP) it is `||a||^2 ||g||^2`. When `2 T^2 >= P O` the per-example gradient
is smaller than the Gramians, and the rule materializes it instead (mixed
ghost clipping, Bu et al. 2022), per layer, from its static shapes.

The clipped sum is computed from the same tensors (book-keeping, Bu et al.
2023): `sum_i c_i A_i^T G_i = A^T (c * G)`, one matmul, no second backward
pass. Biases are materialized per example (`sum_t G_t`: small).

EinsumDense equations are read as `batch + S + C, C + O -> batch + S + O`
(S: positions kept, C: contracted features, O: output features), which
covers Keras's and MultiHeadAttention's projections; another layout uses the
vectorized fallback.
"""

from __future__ import annotations

from typing import Callable
from typing import Sequence

import tensorflow as tf

from keras_tapeops.layer_records.dense import DenseRecording
from keras_tapeops.layer_records.dense import EinsumDenseRecording
from keras_tapeops.layer_records.forwards import float32
from keras_tapeops.layer_records.layouts import einsum_bias_rows
from keras_tapeops.layer_records.layouts import einsum_inputs
from keras_tapeops.layer_records.layouts import einsum_kernel_from_matrix
from keras_tapeops.layer_records.layouts import einsum_outputs
from keras_tapeops.layer_records.layouts import layout
from keras_tapeops.layer_records.layouts import positions
from keras_tapeops.privacy.rules import Part


def matmul_parts(a, g, scale, kernel_from_matrix):
    """The kernel `Part` of a layer whose per-example kernel gradient is `A^T G`.

    Args:
        a: `[B, T, P]` float32 inputs (positions flattened).
        g: `[B, T, O]` float32 gradients of the loss-scaled objective.
        scale: the loss scale (float32 scalar).
        kernel_from_matrix: callable `[P, O] matrix -> kernel-shaped tensor`.

    Returns:
        A `Part`: ghost (two `T x T` Gramians per example) when `2 T^2 < P O`,
        else the per-example `P x O` gradients: whichever holds less memory
        per example for these static shapes (Bu et al.'s mixed rule).
    """
    t, p, o = a.shape[1], a.shape[2], g.shape[2]
    if matmul_method(t, p, o) == "per-example":
        # The per-example gradients exist: the clipped sum weights them
        # (no second pass over the positions).
        rows = tf.einsum("btp,bto->bpo", a, g)
        return per_example_part(rows, scale, [p, o], finish=kernel_from_matrix)
    squared, method = matmul_squared_norms(a, g)
    squared = squared / (scale * scale)

    def weighted(c):
        flat_a = tf.reshape(a, [-1, p])
        flat_g = tf.reshape(g * c[:, None, None], [-1, o])
        return kernel_from_matrix(tf.matmul(flat_a, flat_g, transpose_a=True))

    return Part(squared, weighted, method)


def matmul_method(positions, inputs, outputs):
    """`"ghost"` when two `T x T` Gramians hold less than a `P x O` gradient, else `"per-example"`.

    Args:
        positions: T (None when not static: per example).
        inputs, outputs: P and O.

    Returns:
        The method Bu et al.'s mixed rule picks for these static shapes.
    """
    if positions == 1 or (positions is not None and 2 * positions * positions < inputs * outputs):
        return "ghost"
    return "per-example"


def matmul_squared_norms(a, g):
    """`(squared, method)`: `||A_i^T G_i||_F^2` per example, by `matmul_method`'s choice.

    Args:
        a: `[B, T, P]` float32.
        g: `[B, T, O]` float32.

    Returns:
        `[B]` float32 squared norms (in the units of `a` and `g`) and the
        method name.
    """
    t, p, o = a.shape[1], a.shape[2], g.shape[2]
    method = matmul_method(t, p, o)
    if t == 1:
        squared = tf.reduce_sum(a * a, [1, 2]) * tf.reduce_sum(g * g, [1, 2])
    elif method == "ghost":
        gram_a = tf.einsum("btp,bsp->bts", a, a)
        gram_g = tf.einsum("bto,bso->bts", g, g)
        squared = tf.reduce_sum(gram_a * gram_g, [1, 2])
    else:
        rows = tf.einsum("btp,bto->bpo", a, g)
        squared = tf.reduce_sum(rows * rows, [1, 2])
    return squared, method


def per_example_part(
    rows: tf.Tensor,
    scale: tf.Tensor | float,
    shape: Sequence[int] | tf.TensorShape,
    method: str = "per-example",
    finish: Callable[[tf.Tensor], tf.Tensor] | None = None,
    row_local: bool = True,
) -> Part:
    """A row-local `Part` from materialized per-example gradients `rows` (`[B, ...]`, loss-scaled).

    Args:
        rows: `[B, ...]` per-example gradients (in loss-scaled units).
        scale: the loss scale.
        shape: the shape of the clipped sum before `finish`.
        method: the name shown in the report.
        finish: optional callable applied to the clipped sum (e.g. a kernel
            layout).
        row_local: whether each row depends on its own example's records
            only (computed example by example, as `A_i^T G_i`). False for
            rows taken from a backward pass over the whole batch (a
            per-example Jacobian: `A^T (e_i G)` multiplies another example's
            NaN by 0), which the non-finite branch must compute again from
            zeroed records.

    Returns:
        A `Part` with `rows` (see `Part.sanitized`).

    Example:
    ```python
    kt.privacy.per_example_part(tf.ones([4, 3]), 1.0, [3]).weighted(tf.ones([4]))  # [4, 4, 4]
    ```
    """
    flat = tf.reshape(rows, [tf.shape(rows)[0], -1])
    squared = tf.reduce_sum(flat * flat, 1) / (scale * scale)

    def from_rows(flat, c):
        summed = tf.reshape(tf.linalg.matvec(flat, c, transpose_a=True), shape)
        return summed if finish is None else finish(summed)

    return Part.of_rows(squared, flat, from_rows, method, row_local)


class DenseRule(DenseRecording):
    """Ghost norms for `keras.layers.Dense` (any input rank)."""

    @staticmethod
    def clip(site, records, grads, context):
        layer = site.layer
        d_in, d_out = layer.kernel.shape
        a = tf.concat([positions(r["a"], d_in) for r in records], axis=1)
        g = tf.concat([positions(gz[0], d_out) for gz in grads], axis=1)
        parts = {}
        kernel = layer.kernel
        parts[id(kernel)] = matmul_parts(a, g, context.scale, lambda m: m)
        if layer.bias is not None:
            parts[id(layer.bias)] = per_example_part(
                tf.reduce_sum(g, 1), context.scale, layer.bias.shape
            )
        return parts


class EinsumDenseRule(EinsumDenseRecording):
    """Ghost norms for `keras.layers.EinsumDense` (MultiHeadAttention's projections)."""

    @staticmethod
    def clip(site, records, grads, context):
        layer = site.layer
        kernel = layer.kernel
        pieces_a, pieces_g, bias_rows = [], [], []
        spec = None
        for record, (gz,) in zip(records, grads):
            a, g = float32(record["a"]), float32(gz)
            spec = layout(layer.equation, a.shape.rank)
            pieces_a.append(einsum_inputs(spec, a))
            pieces_g.append(einsum_outputs(spec, g))
            if layer.bias is not None:
                bias_rows.append(einsum_bias_rows(spec, layer.bias_axes, g))
        kernel_from_matrix = einsum_kernel_from_matrix(spec, kernel)
        a = tf.concat(pieces_a, axis=1)
        g = tf.concat(pieces_g, axis=1)
        parts = {id(kernel): matmul_parts(a, g, context.scale, kernel_from_matrix)}
        if layer.bias is not None:
            parts[id(layer.bias)] = per_example_part(
                tf.add_n(bias_rows), context.scale, layer.bias.shape
            )
        return parts
