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

import keras
import tensorflow as tf

from keras_tapeops.privacy.rules import Part
from keras_tapeops.privacy.rules import float32
from keras_tapeops.privacy.rules import pre_activation_forward
from keras_tapeops.privacy.rules import stock_call


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


def positions(tensor, features):
    """`tensor` (`[B, ..., features]`) as float32 `[B, T, features]`, T static if known."""
    t = static_product(tensor.shape[1:-1])
    shape = [tf.shape(tensor)[0], t if t is not None else -1, features]
    return tf.reshape(float32(tensor), shape)


class DenseRule:
    """Ghost norms for `keras.layers.Dense` (any input rank)."""

    family = "Dense"

    @staticmethod
    def applies(layer):
        return stock_call(layer, keras.layers.Dense)

    forward = staticmethod(pre_activation_forward)

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


class EinsumDenseRule:
    """Ghost norms for `keras.layers.EinsumDense` (MultiHeadAttention's projections)."""

    family = "EinsumDense"

    @staticmethod
    def applies(layer):
        return (
            stock_call(layer, keras.layers.EinsumDense) and layout(layer.equation, None) is not None
        )

    forward = staticmethod(pre_activation_forward)

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


def einsum_inputs(spec, a):
    """An EinsumDense call's input `a` as `[B, T, C]` (T: kept positions, C: contracted)."""
    order = [spec.inp.index(x) for x in spec.batch + spec.kept + spec.contracted]
    return _flatten_groups(tf.transpose(a, order), len(spec.kept), len(spec.contracted))


def einsum_outputs(spec, g):
    """The gradient `g` of an EinsumDense call's output as `[B, T, O]` (O: produced)."""
    order = [spec.out.index(x) for x in spec.batch + spec.kept + spec.produced]
    return _flatten_groups(tf.transpose(g, order), len(spec.kept), len(spec.produced))


def einsum_bias_rows(spec, bias_axes, g):
    """Each example's bias gradient, `[B, bias size]`, from the output gradient `g`."""
    axes = [i for i, x in enumerate(spec.out) if i > 0 and x not in bias_axes]
    rows = tf.reduce_sum(g, axes) if axes else g
    return tf.reshape(rows, [tf.shape(g)[0], -1])


def einsum_kernel_from_matrix(spec, kernel):
    """`[C, O] matrix -> kernel-shaped tensor` for the layout `spec`."""
    order = spec.contracted + spec.produced
    dims = [kernel.shape[spec.ker.index(x)] for x in order]
    perm = [order.index(x) for x in spec.ker]

    def kernel_from_matrix(matrix):
        return tf.transpose(tf.reshape(matrix, dims), perm)

    return kernel_from_matrix


def _flatten_groups(tensor, n_kept, n_features):
    """`[B, kept..., features...]` -> `[B, prod(kept), prod(features)]` (static where known)."""
    shape = tensor.shape
    kept = static_product(shape[1 : 1 + n_kept])
    features = static_product(shape[1 + n_kept : 1 + n_kept + n_features])
    return tf.reshape(tensor, [tf.shape(tensor)[0], kept if kept is not None else -1, features])


def static_product(dims):
    out = 1
    for dim in dims:
        if dim is None:
            return None
        out *= dim
    return out


class _Layout:
    def __init__(self, inp, ker, out, batch, kept, contracted, produced):
        self.inp, self.ker, self.out = inp, ker, out
        self.batch, self.kept = batch, kept
        self.contracted, self.produced = contracted, produced


def layout(equation, input_rank):
    """Reads an EinsumDense equation as `b S C, C O -> b S O`, or None if it is not one.

    Args:
        equation: e.g. `"abc,cde->abde"` or `"...b,bc->...c"`.
        input_rank: the input's rank (to expand `...`), or None to check the
            form only.

    Returns:
        A layout with strings `inp`, `ker`, `out` (ellipsis expanded) and
        the letter groups `batch`, `kept` (S), `contracted` (C), `produced` (O).
    """
    inp, rest = equation.replace(" ", "").split(",")
    ker, out = rest.split("->")
    if "..." in ker:
        return None
    if "..." in inp or "..." in out:
        if "..." not in inp or "..." not in out:
            return None
        n = 1 if input_rank is None else input_rank - (len(inp) - 3)
        free = [x for x in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if x not in equation][:n]
        inp = inp.replace("...", "".join(free))
        out = out.replace("...", "".join(free))
    if not inp or len(set(inp)) != len(inp) or len(set(out)) != len(out):
        return None
    batch = inp[0]
    if batch not in out or batch in ker:
        return None
    contracted = "".join(x for x in inp if x in ker and x not in out)
    kept = "".join(x for x in inp if x in out and x not in ker and x != batch)
    produced = "".join(x for x in ker if x in out and x not in inp)
    if (
        set(inp) != set(batch + kept + contracted)
        or set(ker) != set(contracted + produced)
        or set(out) != set(batch + kept + produced)
        or len(set(ker)) != len(ker)
    ):
        return None
    return _Layout(inp, ker, out, batch, kept, contracted, produced)
