"""The tasks' `K x K` Gramian layer by layer, without forming their rows on Dense layers.

For a shared Dense layer with inputs `A` (`[N, P]`: the batch's examples,
positions and calls flattened) and each task's gradient `G_k` (`[N, O]`)
of its pre-activation output, task k's kernel gradient is `A^T G_k`, and

    <A^T G_k, A^T G_j> = <G_k, (A A^T) G_j>         (TorchJD's layerwise Gramian)

so the Gramian needs the `N x N` matrix `A A^T` and K products with it
(`N^2 P + K N^2 O` multiply-adds) where the rows cost `K N P O` plus
`K^2 P O` for their Gramian. Each layer takes the cheaper of the two for
the batch at hand (the rows are then formed for that layer only, and freed
once their Gramian is taken). The bias rows are `sum_n G_k` (small). The
aggregated gradient is `A^T (sum_k w_k G_k)`: one matmul, as in a stock
backward pass, instead of K kernel gradients and their weighted sum.

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
with recording(layers, variables) as recorder:
    total, y_pred = model.compute_total_loss(x, y, sample_weight, training=True)
gramian, combine = task_gramian(tape, task_losses, shared, layers, recorder, scale)
shared_grads = combine(weights)    # one per shared variable, true units
```
"""

from __future__ import annotations

import tensorflow as tf

from keras_tapeops import rows as row_ops
from keras_tapeops.privacy import sites as sites_lib
from keras_tapeops.privacy.ghost_dense import DenseRule


def dense_sites(model, variables, shared, tree):
    """The shared Dense layers whose Gramian is computed layer by layer.

    Args:
        model: the built model.
        variables: `model.trainable_weights`.
        shared: bools aligned with `variables` (the task-shared ones).
        tree: `paths.LayerTree(model)`.

    Returns:
        A list of `sites.Site`: stock `keras.layers.Dense` layers (no LoRA,
        not quantized) every trainable variable of which is shared.
    """
    shared_ids = {id(v) for v, on in zip(variables, shared) if on}

    def rule(layer):
        return DenseRule if DenseRule.applies(layer) else None

    found, _ = sites_lib.discover(model, variables, rule, tree)
    return [
        site
        for site in found
        if site.rule is not None and all(id(v) in shared_ids for v in site.variables)
    ]


def recording(sites, variables):
    """Records each site's inputs and pre-activation outputs during the forward pass.

    Args:
        sites: from `dense_sites`.
        variables: the model's trainable variables (to find reads of a
            site's variables outside its calls: those keep their rows).

    Returns:
        A `sites.Recorder` (a context manager).
    """
    return sites_lib.Recorder(sites, variables)


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
    layered = [
        site
        for site in sites
        if recorder.invocations[id(site.layer)]
        and not any(id(v) in recorder.foreign for v in site.variables)
    ]
    covered = {id(v) for site in layered for v in site.variables}
    rest = [v for v in shared if id(v) not in covered]
    outputs = [
        [z for record in recorder.invocations[id(site.layer)] for z in record["z"]]
        for site in layered
    ]
    sources = [z for zs in outputs for z in zs] + rest
    zero = tf.UnconnectedGradients.ZERO
    per_task = [tape.gradient(t, sources, unconnected_gradients=zero) for t in targets]
    k = len(targets)

    def stacked(position, features=None):
        """Source `position`'s gradient for every task: `[K, ...]`, float32, true units."""
        grads = [tf.cast(tf.convert_to_tensor(g[position]), tf.float32) for g in per_task]
        if features is not None:
            grads = [tf.reshape(g, [-1, features]) for g in grads]
        return tf.stack(grads) / scale

    layers = []
    start = 0
    for site, zs in zip(layered, outputs):
        layer = site.layer
        p, o = layer.kernel.shape
        a = tf.concat([_matrix(record["a"], p) for record in recorder.invocations[id(layer)]], 0)
        # [K, N, O]: the calls' output gradients, in the order of their inputs in `a`.
        g = tf.concat([stacked(start + i, o) for i in range(len(zs))], 1)
        start += len(zs)
        layers.append(_DenseLayer(layer, site.variables, a, g))
    rest_parts = [stacked(start + i) for i in range(len(rest))]
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


class _DenseLayer:
    """One Dense layer's inputs `a` (`[N, P]`) and tasks' output gradients `g` (`[K, N, O]`)."""

    def __init__(self, layer, variables, a, g):
        self.layer = layer
        self.ids = {id(v) for v in variables}
        self.a = a
        self.g = g

    def gramian(self) -> tf.Tensor:
        """`[K, K]`: the kernel's Gramian (ghost or rows, the cheaper) plus the bias's."""
        a, g = self.a, self.g
        k, o, p = g.shape[0], g.shape[2], a.shape[-1]

        def inner_products(x, y):  # [K, ...] x [K, ...] -> [K, K]
            return tf.matmul(tf.reshape(x, [k, -1]), tf.reshape(y, [k, -1]), transpose_b=True)

        def ghost():  # <G_k, (A A^T) G_j>: K products with the N x N matrix
            m = tf.matmul(a, a, transpose_b=True)
            return inner_products(g, tf.matmul(m[tf.newaxis], g))

        def rows():  # the K kernel gradients A^T G_k, freed after this
            j = tf.matmul(a[tf.newaxis], g, transpose_a=True)
            return inner_products(j, j)

        gramian = tf.zeros([k, k])
        if id(self.layer.kernel) in self.ids:
            gramian = tf.cond(ghost_is_cheaper(tf.shape(a)[0], p, k, o), ghost, rows)
        bias = self.layer.bias
        if bias is not None and id(bias) in self.ids:
            sums = tf.reduce_sum(g, 1)  # [K, O]
            gramian += tf.matmul(sums, sums, transpose_b=True)
        return gramian

    def combine(self, weights) -> dict[int, tf.Tensor]:
        """`id(variable) -> sum_k w_k d L_k / d variable` for this layer's variables."""
        weighted = tf.tensordot(weights, self.g, 1)  # [N, O]
        out = {}
        kernel, bias = self.layer.kernel, self.layer.bias
        if id(kernel) in self.ids:
            out[id(kernel)] = tf.matmul(self.a, weighted, transpose_a=True)
        if bias is not None and id(bias) in self.ids:
            out[id(bias)] = tf.reduce_sum(weighted, 0)
        return out
