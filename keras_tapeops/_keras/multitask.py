"""The multi-task code's only reads of private Keras (and mixin) attributes.

Keras 3 has no public API for an output's loss value before the weighted
sum, nor for the layers a functional output depends on; each function says
which private name it needs and why, so a Keras upgrade breaks here only.
"""

import contextlib


def compile_loss(model):
    """The model's `CompileLoss` (`model._compile_loss`), or None without `loss=`.

    `CompileLoss.call` computes one value per output and returns only their
    weighted sum; the per-output values (the tasks) are read while it runs
    (see `recording_flat_losses`).
    """
    return getattr(model, "_compile_loss", None)


@contextlib.contextmanager
def recording_flat_losses(loss):
    """Records every per-output loss value `loss` (a `CompileLoss`) computes in this block.

    Keras 3.15's `CompileLoss.call` loops over `self._flat_losses`, a list of
    `CompileLoss.Loss(path, loss, loss_weights, name)` built lazily by
    `build()`; for each entry it computes
    `value = cast(entry.loss(y_true, y_pred, sample_weight), self.dtype)`,
    logs it (unweighted) as `<name>_loss`, multiplies it by
    `entry.loss_weights` and sums. Each entry's loss function is wrapped on
    the instance for the duration of the block (and `build` too, when the
    loss is built inside it), so the recorded tensors are the very values
    the model's total loss is made of: one forward pass, no second loss
    computation.

    Args:
        loss: the model's `CompileLoss`.

    Returns:
        (yields) a list filled with `(name, value, loss_weight)` in call order.
    """
    records = []
    restore = {}

    def wrap():
        restore["flat"] = loss._flat_losses
        loss._flat_losses = [
            entry._replace(loss=_recorder(entry.loss, entry.name, entry.loss_weights, records))
            for entry in restore["flat"]
        ]

    if loss.built:
        wrap()
    else:

        def build(*args, **kwargs):
            type(loss).build(loss, *args, **kwargs)
            wrap()

        loss.build = build
    try:
        yield records
    finally:
        loss.__dict__.pop("build", None)
        if "flat" in restore:
            loss._flat_losses = restore["flat"]


def _recorder(fn, name, weight, records):
    def call(*args, **kwargs):
        value = fn(*args, **kwargs)
        records.append((name, value, weight))
        return value

    return call


def loss_dtype(loss):
    """The dtype `CompileLoss` casts each output's value to (`Loss.dtype`, public)."""
    return loss.dtype


def layers_behind(output):
    """The layers a functional model's output tensor is computed from.

    Walks the Keras graph back from a `KerasTensor` through its
    `_keras_history` (operation, node index) and the nodes'
    `parent_nodes`: Keras exports no function listing the layers between a
    model's inputs and one of its outputs.

    Args:
        output: a `KerasTensor` from `model.outputs`.

    Returns:
        A list of the operations (layers, nested models, ops) reached.
    """
    history = getattr(output, "_keras_history", None)
    if history is None:
        return []
    seen_nodes, operations = set(), {}
    stack = [history.operation._inbound_nodes[history.node_index]]
    while stack:
        node = stack.pop()
        if id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        if node.operation is not None:
            operations[id(node.operation)] = node.operation
        stack.extend(node.parent_nodes)
    return list(operations.values())


def is_evaluating(model):
    """True while `evaluate()` runs on a keras_tapeops model (the mixin's flag)."""
    return bool(getattr(model, "_tapeops_evaluating", False))
