"""`input_derivatives`: a function's outputs and their derivatives w.r.t. its inputs.

The building block of physics-informed losses (`kt.PDEResidual`): for a batch
of points `x[b, i]` and a function `y = fn(x)` with outputs `y[b, o]`, it
returns `dy_dx[b, o, i] = d y_o / d x_i` and the diagonal second derivatives
`d2y_dx2[b, o, i] = d2 y_o / d x_i^2` (optionally mixed ones by index pair),
for every point of the batch at once.

`fn` must treat the rows of `x` independently (row `b` of `y` depends on row
`b` of `x` only), as a Keras model without batch-coupled layers does
(BatchNormalization in training mode couples rows): derivatives are taken
of the batch sums, which equal the per-row derivatives under that condition.

Two ways to get the same numbers (they agree to float32 rounding):
- reverse mode (`tf.GradientTape`): one backward pass per output gives every
  first derivative; the second derivatives take one more backward pass per
  (output, input coordinate), through the first one (reverse over reverse):
  `diagonal=[...]` limits them to the coordinates a residual reads;
- forward mode (`tf.autodiff.ForwardAccumulator`): one forward pass per input
  coordinate carries the tangent `e_i` and gives `d y / d x_i` for every
  output; second derivatives push `e_i` through the backward pass (forward
  over reverse), one pass per input coordinate. Forward over forward (nested
  accumulators) is not used: in TF 2.21 a tape over it (the weight gradient
  of a training step) gets wrong gradients, and eager nested accumulators
  can return wrong values (tensorflow/tensorflow#127753).

`mode="auto"` picks, from the CPU times of `bench/pinn.py` (4 tanh layers of
20 units, 1000 and 10000 points, in a training step and alone): reverse mode
for second derivatives (forward over reverse is 1.1x to 2x slower at 1, 2 and
3 inputs), and for first derivatives reverse mode unless the function has
more than twice as many outputs as inputs (4 outputs of 1 input: forward
mode 1.9x faster in a training step; of 2 inputs: a tie in a training step,
forward 1.4x slower alone). The number of outputs is read from a Keras
model's `compute_output_shape`; for another callable it counts as 1.

Both modes can be differentiated again: inside a training step the outer
`tf.GradientTape` (w.r.t. the weights) records the derivative computation.
"""

from __future__ import annotations

import numbers
from typing import Any
from typing import Callable
from typing import Sequence

import numpy as np
import tensorflow as tf

from keras_tapeops import validation
from keras_tapeops.typing_aliases import Nested

MODES = ("auto", "forward", "reverse")

_ZERO = tf.UnconnectedGradients.ZERO


def input_derivatives(
    fn: Callable[[Any], Any],
    x: Nested,
    order: int = 1,
    mode: str = "auto",
    mixed: Sequence[Sequence[int]] | None = None,
    diagonal: Sequence[int] | None = None,
) -> tuple[tf.Tensor, ...]:
    """Returns `fn(x)` and its derivatives w.r.t. each input coordinate, per row.

    Args:
        fn: a callable `x -> y`, e.g. a Keras model, with `x` of shape
            `(batch, n_in)` and `y` of shape `(batch, n_out)` or `(batch,)`.
            Rows must be independent (row `b` of `y` depends on row `b` of
            `x` only).
        x: a floating tensor or array of shape `(batch, n_in)`, `n_in` known.
        order: 1 (first derivatives) or 2 (also the diagonal second ones).
        mode: `"auto"`, `"forward"` (`tf.autodiff.ForwardAccumulator`) or
            `"reverse"` (`tf.GradientTape`): same values, different cost;
            `"auto"` picks the one measured cheaper (module docstring):
            reverse, or forward for first derivatives of a Keras model
            with more than twice as many outputs as inputs.
        mixed: None, or (with `order=2`) a list of index pairs `(i, j)`:
            also return the mixed second derivatives `d2 y_o / dx_i dx_j`.
        diagonal: None (every coordinate), or (with `order=2`) the list of
            input coordinates whose `d2 y / d x_i^2` are computed. Each costs
            one more backward pass (and its weight gradient as much again),
            so asking only for the ones used (`[0]` for `u_xx` of `u(x, t)`)
            halves the cost of a 2-D problem; the entries not asked for
            are NaN, so reading one by mistake shows at once.

    Returns:
        `(y, dy_dx)` for `order=1`, `(y, dy_dx, d2y_dx2)` for `order=2`, and a
        fourth tensor `d2y_mixed` when `mixed` is given:
        - `y`: `(batch, n_out)` (a `(batch,)` output gets `n_out = 1`),
        - `dy_dx[b, o, i] = d y_o / d x_i`: `(batch, n_out, n_in)`,
        - `d2y_dx2[b, o, i] = d2 y_o / d x_i^2`: `(batch, n_out, n_in)`,
        - `d2y_mixed[b, o, k] = d2 y_o / d x_i d x_j` for `(i, j) = mixed[k]`.
        Half-precision outputs (mixed_float16) are cast to float32 before
        differentiating, so every result is float32 (the model itself still
        computes in float16: see docs/physics_informed.md).

    Raises:
        TypeError: `fn` is not callable, `x` is not floating, `fn` returns
            something other than one floating tensor.
        ValueError: bad `order`, `mode`, `mixed` or `diagonal`; `x` not of
            rank 2.

    Example:
    ```python
    import keras, numpy as np
    import keras_tapeops as kt
    net = keras.Sequential([keras.Input((2,)), keras.layers.Dense(8, activation="tanh"),
                            keras.layers.Dense(1)])
    x = np.random.uniform(-1, 1, (5, 2)).astype("float32")
    u, du, d2u = kt.input_derivatives(net, x, order=2)
    laplacian = d2u[:, 0, 0] + d2u[:, 0, 1]
    ```
    """
    if not callable(fn):
        raise TypeError(f"`fn` must be a callable x -> y (e.g. a Keras model). Received: fn={fn!r}")
    order = check_order(order)
    mode = validation.choice(mode, "mode", MODES)
    x = check_points(x, "x")
    n_in = int(x.shape[-1])
    pairs = check_mixed(mixed, order, n_in)
    diagonal = check_diagonal(diagonal, order, n_in, pairs)
    if resolve_mode(mode, order, n_in, _known_outputs(fn, x)) == "forward":
        return _forward(fn, x, order, diagonal, pairs)
    return _reverse(fn, x, order, diagonal, pairs)


def resolve_mode(mode, order, n_in, n_out=1):
    """The mode `"auto"` stands for (see the module docstring); others as given.

    Args:
        mode: `"auto"`, `"forward"` or `"reverse"`.
        order: 1 or 2.
        n_in: number of input coordinates.
        n_out: number of outputs (only first derivatives look at it; 1 if
            unknown before calling `fn`).

    Returns:
        `"forward"` or `"reverse"`.
    """
    if mode != "auto":
        return mode
    if order == 1 and n_out > 2 * n_in:
        return "forward"
    return "reverse"


def _known_outputs(fn, x):
    """Number of outputs of a Keras layer or model `fn` for `x`, else 1."""
    compute = getattr(fn, "compute_output_shape", None)
    if compute is None:
        return 1
    try:
        shape = compute(tuple(x.shape))
        return int(shape[-1]) if len(shape) == 2 and shape[-1] is not None else 1
    except Exception:  # a model that cannot say; reverse mode is the default
        return 1


def check_order(order):
    """Returns `order` (1 or 2) or raises naming it."""
    if isinstance(order, (bool, np.bool_)) or not isinstance(order, numbers.Integral):
        raise TypeError(f"`order` must be 1 or 2. Received: order={order!r}")
    if order not in (1, 2):
        raise ValueError(f"`order` must be 1 or 2. Received: order={order!r}")
    return int(order)


def check_points(x, name):
    """Returns `x` as a floating tensor of rank 2 with a known last dimension."""
    if not tf.is_tensor(x):
        array = np.asarray(x)
        if not np.issubdtype(array.dtype, np.floating):
            raise TypeError(
                f"`{name}` must be floating point (e.g. float32). "
                f"Received: {name} of dtype {array.dtype}"
            )
        x = tf.convert_to_tensor(array)
    if not x.dtype.is_floating:
        raise TypeError(
            f"`{name}` must be floating point (e.g. float32). "
            f"Received: {name} of dtype {x.dtype.name}"
        )
    if x.shape.rank != 2 or x.shape[-1] is None:
        raise ValueError(
            f"`{name}` must have shape (batch, n_in) with n_in known. "
            f"Received: {name} of shape {x.shape}"
        )
    return x


def check_diagonal(diagonal, order, n_in, pairs=()):
    """Returns `diagonal` as a sorted tuple of coordinates (None: all of them)."""
    if diagonal is None:
        return tuple(range(n_in)) if order == 2 else ()
    if order != 2:
        raise ValueError(
            "`diagonal` second derivatives need `order=2`. "
            f"Received: order={order!r}, diagonal={diagonal!r}"
        )
    ok = isinstance(diagonal, (list, tuple)) and all(
        isinstance(i, numbers.Integral) and not isinstance(i, (bool, np.bool_)) and 0 <= i < n_in
        for i in diagonal
    )
    if not ok:
        raise ValueError(
            f"`diagonal` must be a list of input coordinates in [0, {n_in}). "
            f"Received: diagonal={diagonal!r}"
        )
    if not diagonal and not pairs:
        raise ValueError(
            "`diagonal=[]` asks for no second derivative: give `mixed` pairs, "
            "or use `order=1`. Received: diagonal=[], mixed=None"
        )
    return tuple(sorted({int(i) for i in diagonal}))


def check_mixed(mixed, order, n_in=None):
    """Returns `mixed` as a tuple of `(i, j)` int pairs, or raises naming it."""
    if mixed is None:
        return ()
    if order != 2:
        raise ValueError(
            f"`mixed` second derivatives need `order=2`. Received: order={order!r}, mixed={mixed!r}"
        )
    if not isinstance(mixed, (list, tuple)) or not mixed:
        raise ValueError(
            f"`mixed` must be a non-empty list of (i, j) index pairs. Received: mixed={mixed!r}"
        )
    pairs = []
    for pair in mixed:
        ok = (
            isinstance(pair, (list, tuple))
            and len(pair) == 2
            and all(
                isinstance(i, numbers.Integral)
                and not isinstance(i, (bool, np.bool_))
                and i >= 0
                and (n_in is None or i < n_in)
                for i in pair
            )
        )
        if not ok:
            bound = f" below n_in={n_in}" if n_in is not None else ""
            raise ValueError(
                f"`mixed` must hold (i, j) pairs of input indices >= 0{bound}. "
                f"Received: mixed={mixed!r}"
            )
        pairs.append((int(pair[0]), int(pair[1])))
    return tuple(pairs)


def _outputs(fn, x):
    """`fn(x)` as a float `(batch, n_out)` tensor; half precision -> float32."""
    y = fn(x)
    if not tf.is_tensor(y) and not hasattr(y, "dtype"):
        raise TypeError(
            "`fn` must return one tensor of shape (batch, n_out) (a model with "
            f"several outputs: wrap it to return one). Received: {type(y).__name__}"
        )
    y = tf.convert_to_tensor(y)
    if not y.dtype.is_floating:
        raise TypeError(f"`fn` must return a floating tensor. Received: dtype {y.dtype.name}")
    if y.dtype in (tf.float16, tf.bfloat16):
        y = tf.cast(y, "float32")
    if y.shape.rank == 1:
        y = y[:, None]
    if y.shape.rank != 2 or y.shape[-1] is None:
        raise ValueError(
            "`fn` must return a tensor of shape (batch, n_out) or (batch,) with "
            f"n_out known. Received: a tensor of shape {y.shape}"
        )
    return y


def _unit(like, index):
    """A tensor shaped like `like` that is one in column `index`, zero elsewhere."""
    n = int(like.shape[-1])
    return tf.zeros_like(like) + tf.one_hot(index, n, dtype=like.dtype)


def _split_outputs(y):
    """`y`'s outputs one by one, sliced under the active tapes (`[y]` for one).

    Slicing a target (rather than weighting it by a one-hot
    `output_gradients`) keeps the weight gradient of the derivatives cheap:
    measured 25% faster in a training step.
    """
    n_out = int(y.shape[-1])
    return [y] if n_out == 1 else [y[:, o] for o in range(n_out)]


def _reverse_rows(tape, outputs, x):
    """`[d y_o / d x]` for each output `o` (each `(batch, n_in)`), one pass each."""
    return [tape.gradient(t, x, unconnected_gradients=_ZERO) for t in outputs]


def _reverse(fn, x, order, diagonal, pairs):
    if order == 1:
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            y = _outputs(fn, x)
            outputs = _split_outputs(y)
        rows = _reverse_rows(tape, outputs, x)
        del tape
        return y, tf.stack(rows, axis=1)
    lines = _hessian_lines(diagonal, pairs)
    with tf.GradientTape(persistent=True) as outer:
        outer.watch(x)
        with tf.GradientTape(persistent=True) as inner:
            inner.watch(x)
            y = _outputs(fn, x)
            outputs = _split_outputs(y)
        rows = _reverse_rows(inner, outputs, x)  # recorded by `outer`
        targets = [{i: row[:, i] for i in lines} for row in rows]
    del inner
    # Row i of output o's Hessian: d/dx (d y_o / d x_i), one backward pass.
    hessian = [
        {i: outer.gradient(t[i], x, unconnected_gradients=_ZERO) for i in lines} for t in targets
    ]
    del outer
    return _second_order_results(x, y, rows, hessian, diagonal, pairs)


def _forward(fn, x, order, diagonal, pairs):
    n_in = int(x.shape[-1])
    if order == 1:
        columns = []
        for i in range(n_in):
            with tf.autodiff.ForwardAccumulator(x, _unit(x, i)) as acc:
                y = _outputs(fn, x)
            columns.append(acc.jvp(y, unconnected_gradients=_ZERO))
        return y, tf.stack(columns, axis=-1)
    # Forward over reverse: the tangent e_i pushed through the backward pass
    # gives column i of every output's Hessian. (Forward over forward, nested
    # accumulators, is not used: differentiating it again w.r.t. the weights
    # gives wrong gradients in TF 2.21, and eager nested accumulators can give
    # wrong second derivatives, tensorflow/tensorflow#127753.)
    columns = {}
    for i in _hessian_lines(diagonal, pairs):
        with tf.autodiff.ForwardAccumulator(x, _unit(x, i)) as acc:
            with tf.GradientTape(persistent=True) as tape:
                tape.watch(x)
                y = _outputs(fn, x)
                outputs = _split_outputs(y)
            rows = _reverse_rows(tape, outputs, x)
            del tape
        columns[i] = [acc.jvp(row, unconnected_gradients=_ZERO) for row in rows]
    hessian = [{i: columns[i][o] for i in columns} for o in range(len(rows))]
    return _second_order_results(x, y, rows, hessian, diagonal, pairs)


def _hessian_lines(diagonal, pairs):
    """The Hessian rows (columns) to compute: one pass each."""
    return sorted(set(diagonal) | {i for i, _ in pairs})


def _second_order_results(x, y, rows, hessian, diagonal, pairs):
    """`(y, dy_dx, d2y_dx2[, d2y_mixed])` from the Hessian rows `hessian[o][i]`.

    Diagonal entries not in `diagonal` were not computed: they are NaN.
    """
    n_in = int(x.shape[-1])
    missing = tf.fill(tf.shape(x)[:1], tf.constant(float("nan"), rows[0].dtype))
    d2 = tf.stack(
        [
            tf.stack([h[i][:, i] if i in diagonal else missing for i in range(n_in)], axis=-1)
            for h in hessian
        ],
        axis=1,
    )
    results = (y, tf.stack(rows, axis=1), d2)
    if pairs:
        results += (
            tf.stack([tf.stack([h[i][:, j] for i, j in pairs], axis=-1) for h in hessian], axis=1),
        )
    return results
