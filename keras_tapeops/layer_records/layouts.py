"""A recorded layer's inputs and output gradients as `[B, T, features]` matrices.

Ghost norms and layer-by-layer Gramians read a layer's call as a matmul per
example: inputs `A` (`[T, P]`: T positions, P features) and output
gradients `G` (`[T, O]`). `positions` flattens a Dense layer's (or a
convolution's patches') positions; `layout` reads an EinsumDense equation
as `batch + S + C, C + O -> batch + S + O` (S: positions kept, C: contracted
features, O: output features), and the `einsum_*` functions lay its tensors
out that way and map a `[C, O]` matrix back to the kernel's shape.

Example:
```python
spec = layout("abc,cde->abde", input_rank=3)    # b S C, C O -> b S O
a = einsum_inputs(spec, x)                       # [B, T, C]
g = einsum_outputs(spec, output_gradient)        # [B, T, O]
matrix = tf.matmul(a[0], g[0], transpose_a=True)  # example 0's [C, O] gradient
kernel_gradient = einsum_kernel_from_matrix(spec, layer.kernel)(matrix)
```
"""

from __future__ import annotations

import tensorflow as tf

from keras_tapeops.layer_records.forwards import float32


def positions(tensor, features):
    """`tensor` (`[B, ..., features]`) as float32 `[B, T, features]`, T static if known."""
    t = static_product(tensor.shape[1:-1])
    shape = [tf.shape(tensor)[0], t if t is not None else -1, features]
    return tf.reshape(float32(tensor), shape)


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
    """The product of `dims`, or None if one of them is not static."""
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
