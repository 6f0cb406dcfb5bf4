"""The tasks' `K x K` Gramian layer by layer, without forming their rows on Dense layers.

For a shared Dense (or EinsumDense) layer with inputs `A` (`[N, P]`: the batch's examples,
positions and calls flattened) and each task's gradient `G_k` (`[N, O]`)
of its pre-activation output, task k's kernel gradient is `A^T G_k`, and

    <A^T G_k, A^T G_j> = <G_k, (A A^T) G_j>         (TorchJD's layerwise Gramian)

so the Gramian needs the `N x N` matrix `A A^T` and K products with it
(`N^2 P + K N^2 O` multiply-adds) where the rows cost `K N P O` plus
`K^2 P O` for their Gramian. Each layer takes the cheaper of the two for
the batch at hand. The bias rows are `sum_n G_k` (small). The aggregated
kernel gradient is `A^T (sum_k w_k G_k)` where the Gramian was taken
without the rows (one matmul, as in a stock backward pass, instead of K
kernel gradients and their weighted sum), and the rows' weighted sum where
they were formed (for that layer only, kept until the weights are known).

The per-task gradients of the pre-activation outputs come from one
backward pass per task that stops at those outputs (no weight gradient is
computed for the layers done here); the other shared variables (a norm's
scale, a convolution, a Dense whose kernel is also read elsewhere, a Dense
called inside an RNN's loop) keep their rows (`keras_tapeops.rows`), and their Gramians add.

It applies when the pass is the whole step: one replica and no
accumulation. Gramians do not add over replicas or micro-batches (the
rows do), so those steps keep the rows.

Example:
```python
layers = dense_sites(model, variables, shared_mask, tree)
with recording(layers, variables, model) as recorder:
    total, y_pred = model.compute_total_loss(x, y, sample_weight, training=True)
gramian, combine = task_gramian(tape, task_losses, shared, layers, recorder, scale)
shared_grads = combine(weights)    # one per shared variable, true units
```
"""

from __future__ import annotations

import tensorflow as tf

from keras_tapeops import rows as row_ops
from keras_tapeops.layer_records import sites as sites_lib
from keras_tapeops.layer_records.dense import DenseRecording
from keras_tapeops.layer_records.dense import EinsumDenseRecording
from keras_tapeops.layer_records.layouts import einsum_bias_rows
from keras_tapeops.layer_records.layouts import einsum_inputs
from keras_tapeops.layer_records.layouts import einsum_kernel_from_matrix
from keras_tapeops.layer_records.layouts import einsum_outputs
from keras_tapeops.layer_records.layouts import layout

# The layers whose Gramian is taken from their inputs and output gradients.
RULES = (DenseRecording, EinsumDenseRecording)


def dense_sites(model, variables, shared, tree):
    """The shared Dense and EinsumDense layers whose Gramian is computed layer by layer.

    Args:
        model: the built model.
        variables: `model.trainable_weights`.
        shared: bools aligned with `variables` (the task-shared ones).
        tree: `paths.LayerTree(model)`.

    Returns:
        A list of `sites.Site`: stock `keras.layers.Dense` and
        `EinsumDense` layers (no LoRA, not quantized; an EinsumDense whose
        equation reads as `batch + S + C, C + O -> batch + S + O`, as
        MultiHeadAttention's projections do) every trainable variable of
        which is shared.
    """
    shared_ids = {id(v) for v, on in zip(variables, shared) if on}

    def rule(layer):
        return next((r for r in RULES if r.applies(layer)), None)

    found, _ = sites_lib.discover(model, variables, rule, tree)
    return [
        site
        for site in found
        if site.rule is not None
        and all(id(v) in shared_ids for v in site.variables)
        and _kernel_and_bias_only(site)
    ]


def _kernel_and_bias_only(site):
    """False for a subclass that keeps the stock call but owns other weights or its own kernel."""
    layer = site.layer
    own = {id(layer.kernel), id(layer.bias) if layer.bias is not None else None}
    return all(id(v) in own for v in site.variables)


def recording(sites, variables, model):
    """Records each site's inputs and pre-activation outputs during the forward pass.

    Args:
        sites: from `dense_sites`.
        variables: the model's trainable variables (to find reads of a
            site's variables outside its calls during the model's forward
            pass: those keep their rows).
        model: the model (reads while the loss is computed, a kernel
            regularizer's, do not reach the task losses).

    Returns:
        A `sites.Recorder` (a context manager).
    """
    return sites_lib.Recorder(sites, variables, scope=model)


def task_gramian(tape, targets, shared, sites, recorder, scale):
    """The tasks' Gramian over `shared` and a function combining their gradients.

    Args:
        tape: the persistent tape of the forward pass.
        targets: K scalar tensors, each task's (loss-scaled) loss.
        shared: the shared variables.
        sites: from `dense_sites`.
        recorder: the `Recorder` that ran during the forward pass.
        scale: the loss scale `targets` carry (float32 scalar).

    Returns:
        `(gramian, combine)`: the `[K, K]` float32 Gramian of the tasks'
        gradients with respect to `shared`, in true units, and
        `combine(weights)`: `sum_k weights_k d L_k / d v` for each shared
        variable `v` (true units, the variable's dtype).
    """
    candidates = [
        site
        for site in sites
        if recorder.invocations[id(site.layer)]
        and not any(id(v) in recorder.foreign for v in site.variables)
    ]
    outputs = [
        [z for record in recorder.invocations[id(site.layer)] for z in record["z"]]
        for site in candidates
    ]
    flat = [z for zs in outputs for z in zs]
    # One backward pass per task, to the recorded outputs and to the shared
    # variables no candidate layer owns. (Asking for the candidates' own
    # variables too would build their K kernel gradients: 1.49x the floor at K=8.)
    candidate_ids = {id(v) for site in candidates for v in site.variables}
    others = [v for v in shared if id(v) not in candidate_ids]
    none = tf.UnconnectedGradients.NONE
    per_task = [tape.gradient(t, flat + others, unconnected_gradients=none) for t in targets]
    k = len(targets)

    def true_units(gradient, like):
        if gradient is None:
            return tf.zeros(like.shape, tf.float32)
        return tf.cast(tf.convert_to_tensor(gradient), tf.float32) / scale

    layers, fallen = [], []
    start = 0
    for site, zs in zip(candidates, outputs):
        positions = range(start, start + len(zs))
        start += len(zs)
        if not all(any(grads[i] is not None for grads in per_task) for i in positions):
            # A recorded output no task's loss depends on: the loss was taken
            # through another copy of the call (TimeDistributed's vectorized
            # map, a recomputed or custom-gradient call). Its rows are formed.
            fallen.extend(site.variables)
            continue
        # One `z` per call: per task, the calls' output gradients in call order.
        task_grads = [[true_units(grads[i], flat[i]) for i in positions] for grads in per_task]
        records = recorder.invocations[id(site.layer)]
        layers.append(_kernel_layer(site, [r["a"] for r in records], task_grads))
    rest = others + fallen  # the variables that keep their rows
    rest_grads = [grads[len(flat) :] for grads in per_task]
    if fallen:  # rare: a second backward pass for those layers' variables
        rest_grads = [
            grads + tape.gradient(t, fallen, unconnected_gradients=none)
            for grads, t in zip(rest_grads, targets)
        ]
    rest_parts = [
        tf.stack([true_units(grads[i], v) for grads in rest_grads]) for i, v in enumerate(rest)
    ]
    gramians = [layer.gramian() for layer in layers]
    if rest_parts:
        gramians.append(row_ops.gramian_of_parts(rest_parts))
    gramian = tf.add_n(gramians) if gramians else tf.zeros([k, k])

    def combine(weights):
        weights = tf.cast(weights, tf.float32)
        by_id = {}
        for layer in layers:
            by_id.update(layer.combine(weights))
        for variable, part in zip(rest, row_ops.combine_parts(weights, rest_parts)):
            by_id[id(variable)] = part
        return [tf.cast(by_id[id(v)], v.dtype) for v in shared]

    return gramian, combine


def ghost_is_cheaper(n, p, k, o):
    """True (a bool tensor) when `<G_k, (A A^T) G_j>` costs fewer multiply-adds than the rows.

    Args:
        n: the number of rows of `A` (examples x positions x calls), an int
            or a scalar tensor.
        p, o: the layer's input and output features.
        k: the number of tasks.

    Returns:
        `N^2 (P + K O) + K^2 N O < K N P O + K^2 P O` as a scalar bool tensor.
    """
    n = tf.cast(n, tf.float32)
    ghost = n * n * (p + k * o) + k * k * n * o
    rows = k * n * p * o + k * k * p * o
    return ghost < rows


def _matrix(tensor, features):
    """`tensor` (`[..., features]`) as float32 `[N, features]`."""
    return tf.reshape(tf.cast(tensor, tf.float32), [-1, features])


def _kernel_layer(site, inputs, task_grads):
    """A `_KernelLayer` from a site's inputs (one per call) and each task's output gradients.

    Args:
        site: a Dense or EinsumDense `Site`.
        inputs: the layer's input of each call.
        task_grads: per task, the float32 gradient (true units) of each
            call's pre-activation output.
    """
    layer = site.layer
    k = len(task_grads)
    if site.rule is EinsumDenseRecording:
        return _einsum_layer(site, inputs, task_grads)
    p, o = layer.kernel.shape
    a = tf.concat([_matrix(x, p) for x in inputs], 0)
    g = tf.stack([tf.concat([_matrix(t, o) for t in grads], 0) for grads in task_grads])
    bias_rows = tf.reduce_sum(g, 1) if layer.bias is not None else tf.zeros([k, 0])
    return _KernelLayer(layer, site.variables, a, g, lambda matrix: matrix, bias_rows)


def _einsum_layer(site, inputs, task_grads):
    """An EinsumDense's `[N, C]` inputs and `[K, N, O]` output gradients (`layouts.layout`)."""
    layer = site.layer
    pieces_a, pieces_g, bias_rows = [], [[] for _ in task_grads], []
    spec = None
    for i, x in enumerate(inputs):
        x = tf.cast(x, tf.float32)
        spec = layout(layer.equation, x.shape.rank)
        a = einsum_inputs(spec, x)
        pieces_a.append(tf.reshape(a, [-1, a.shape[-1]]))
        for task, grads in enumerate(task_grads):
            g = einsum_outputs(spec, grads[i])
            pieces_g[task].append(tf.reshape(g, [-1, g.shape[-1]]))
        if layer.bias is not None:
            bias_rows.append(
                tf.stack(
                    [
                        tf.reduce_sum(einsum_bias_rows(spec, layer.bias_axes, grads[i]), 0)
                        for grads in task_grads
                    ]
                )
            )
    a = tf.concat(pieces_a, 0)
    g = tf.stack([tf.concat(pieces, 0) for pieces in pieces_g])
    bias = tf.add_n(bias_rows) if bias_rows else tf.zeros([len(task_grads), 0])
    kernel_from_matrix = einsum_kernel_from_matrix(spec, layer.kernel)
    return _KernelLayer(layer, site.variables, a, g, kernel_from_matrix, bias)


class _KernelLayer:
    """A layer whose task-k kernel gradient is `A^T G_k`, and its bias rows.

    Args:
        layer: the Dense or EinsumDense layer.
        variables: its trainable variables.
        a: `[N, P]` float32 inputs.
        g: `[K, N, O]` float32 output gradients, true units.
        kernel_from_matrix: `[P, O]` matrix -> kernel-shaped tensor.
        bias_rows: `[K, bias size]` float32: each task's bias gradient.
    """

    def __init__(self, layer, variables, a, g, kernel_from_matrix, bias_rows):
        self.layer = layer
        self.variables = list(variables)
        self.ids = {id(v) for v in variables}
        self.a = a
        self.g = g
        self.kernel_from_matrix = kernel_from_matrix
        self.bias_rows = bias_rows
        self.ghost = None  # set by `gramian`: whether the kernel's Gramian skipped its rows
        self.kernel_rows = None  # `[K, P, O]` where the rows were formed, else `[K, 0, O]`

    def gramian(self) -> tf.Tensor:
        """`[K, K]`: the kernel's Gramian (ghost or rows, the cheaper) plus the bias's."""
        a, g = self.a, self.g
        k, o, p = g.shape[0], g.shape[2], a.shape[-1]

        def inner_products(x, y):  # [K, ...] x [K, ...] -> [K, K]
            return tf.matmul(tf.reshape(x, [k, -1]), tf.reshape(y, [k, -1]), transpose_b=True)

        def ghost():  # <G_k, (A A^T) G_j>: K products with the N x N matrix
            m = tf.matmul(a, a, transpose_b=True)
            return inner_products(g, tf.matmul(m[tf.newaxis], g)), tf.zeros([k, 0, o])

        def rows():  # the K kernel gradients A^T G_k, kept for `combine`
            j = tf.matmul(a[tf.newaxis], g, transpose_a=True)
            return inner_products(j, j), j

        gramian = tf.zeros([k, k])
        if id(self.layer.kernel) in self.ids:
            self.ghost = ghost_is_cheaper(tf.shape(a)[0], p, k, o)
            gramian, self.kernel_rows = tf.cond(self.ghost, ghost, rows)
        bias = self.layer.bias
        if bias is not None and id(bias) in self.ids:
            gramian += tf.matmul(self.bias_rows, self.bias_rows, transpose_b=True)
        return gramian

    def combine(self, weights) -> dict[int, tf.Tensor]:
        """`id(variable) -> sum_k w_k d L_k / d variable` for this layer's variables.

        Where the kernel's rows were formed for the Gramian, their weighted
        sum (`K P O` multiply-adds); else `A^T (sum_k w_k G_k)` (`N P O`).
        """
        out = {}
        kernel, bias = self.layer.kernel, self.layer.bias
        if id(kernel) in self.ids:
            matrix_shape = [self.a.shape[-1], self.g.shape[-1]]

            def from_outputs():
                weighted = tf.tensordot(weights, self.g, 1)  # [N, O]
                return tf.matmul(self.a, weighted, transpose_a=True)

            def from_rows():
                return tf.reshape(tf.tensordot(weights, self.kernel_rows, 1), matrix_shape)

            # `gramian()` ran first (`task_gramian`) and chose between the two.
            matrix = tf.cond(self.ghost, from_outputs, from_rows)
            out[id(kernel)] = self.kernel_from_matrix(matrix)
        if bias is not None and id(bias) in self.ids:
            out[id(bias)] = tf.reshape(tf.tensordot(weights, self.bias_rows, 1), bias.shape)
        return out
