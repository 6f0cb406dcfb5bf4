"""The compiled loss of a model, one value per example.

`per_example_losses(model, y, y_pred, sample_weight)` returns a `[batch]`
float32 vector `l` whose mean is the model's compiled loss (`compile(loss=...,
loss_weights=...)`), regularization and `add_loss` losses excluded:

    mean(l) == model.compute_loss(x, y, y_pred, sample_weight)
               - sum(regularization / add_loss losses)      (one device)

Convention (how Keras reduces, example by example):

- every output's loss is computed with no reduction (`Loss.call`), the
  sample weight (class weights arrive as sample weights) and the Keras mask
  of the predictions are applied as Keras applies them, and the values are
  summed over the non-batch axes and divided by their number: a sequence
  output's loss is its mean over time steps;
- the reduction of each loss is kept: for `"sum_over_batch_size"` and
  `"mean"` (the default) `l_i` is example i's mean loss; for `"sum"` it is
  `batch * (example i's sum)` and for `"mean_with_sample_weight"`
  `batch * (example i's weighted sum) / sum(weights)`, so that `mean(l)` is
  the compiled value for every reduction. A masked output under the default
  reduction is normalized by the batch's number of unmasked entries, as
  Keras does (that normalizer is shared by the examples of the batch);
- multi-output losses are multiplied by their `loss_weights` and summed;
- no division by the number of replicas: under `tf.distribute`, Keras's
  per-replica `compute_loss` equals `mean(l) / num_replicas`;
- the per-output loss trackers Keras logs for multi-output models are not
  updated (the function has no side effect).

Example:
```python
import keras
import numpy as np
from keras_tapeops.per_example import per_example_losses

model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
model.compile(optimizer="sgd", loss="mse")
x, y = np.ones((4, 3), "float32"), np.zeros((4, 2), "float32")
losses = per_example_losses(model, y, model(x))   # shape [4]
```
"""

import keras
import tensorflow as tf

from keras_tapeops._keras import compile_loss as keras_loss
from keras_tapeops._keras import masking
from keras_tapeops._keras import private

_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean")
_SUPPORTED_REDUCTIONS = _MEAN_REDUCTIONS + ("sum", "mean_with_sample_weight")


def per_example_losses(model, y, y_pred, sample_weight=None):
    """The compiled loss of `model`, one float32 value per example.

    Args:
        model: a compiled Keras model (its `compile(loss=...)` is used).
        y: the targets, structured as for `model.fit`.
        y_pred: the model's outputs for the batch.
        sample_weight: optional sample weights (a tensor, or a structure
            matching the outputs), as `fit` passes them.

    Returns:
        A `[batch]` float32 tensor whose mean is the compiled loss (see the
        module docstring for the convention).

    Raises:
        ValueError: for a model compiled without a loss, or a loss whose
            reduction is `None`/`"none"` or whose value has no batch axis.
    """
    compile_loss = private.compiled_loss(model)
    if compile_loss is None:
        raise ValueError(
            "per_example_losses needs a model compiled with a `loss`. "
            f"Received: model={model.name!r} with loss=None"
        )
    y, y_pred = _aligned(compile_loss, y, y_pred)
    total = None
    for path, loss_fn, loss_weight, name in keras_loss.flat_losses(compile_loss):
        y_t, y_p = _resolve(path, y), _resolve(path, y_pred)
        weight = sample_weight
        if sample_weight is not None and tf.nest.is_nested(sample_weight):
            weight = _resolve(path, sample_weight)
        value = _one_loss(loss_fn, y_t, y_p, weight, name)
        if loss_weight is not None:
            value = value * tf.cast(loss_weight, value.dtype)
        total = value if total is None else total + value
    if total is None:
        raise ValueError(
            "per_example_losses found no compiled loss for any output. "
            f"Received: model={model.name!r}"
        )
    return total


def _one_loss(loss_fn, y_true, y_pred, sample_weight, name):
    """One output's per-example loss, with the loss's own reduction convention."""
    reduction = getattr(loss_fn, "reduction", "sum_over_batch_size")
    if reduction not in _SUPPORTED_REDUCTIONS:
        raise ValueError(
            f"The loss of output {name!r} has reduction={reduction!r}, which "
            "has no per-example convention; use one of "
            f"{list(_SUPPORTED_REDUCTIONS)}. Received: reduction={reduction!r}"
        )
    dtype = getattr(loss_fn, "dtype", None) or keras.backend.floatx()
    in_mask = masking.keras_mask(y_pred)
    y_pred = tf.nest.map_structure(lambda t: tf.cast(t, dtype), y_pred)
    y_true = tf.nest.map_structure(lambda t: tf.cast(t, dtype), y_true)
    values = loss_fn.call(y_true, y_pred)
    out_mask = masking.keras_mask(values)
    values = tf.convert_to_tensor(values, dtype)
    if values.shape.rank == 0:
        raise ValueError(
            f"The loss of output {name!r} returns a scalar from call(), so it "
            "has no per-example values. Return one value per example. "
            f"Received: {type(loss_fn).__name__} with a scalar value"
        )
    mask = _combine_masks(in_mask, out_mask)
    weights = None
    if mask is not None:
        weights = tf.cast(mask, dtype)
        if reduction in _MEAN_REDUCTIONS:
            # Keras gives valid entries the weight total / valid.
            total = tf.cast(tf.size(weights), dtype)
            weights = weights * tf.math.divide_no_nan(total, tf.reduce_sum(weights))
    if sample_weight is not None:
        sample_weight = tf.cast(sample_weight, dtype)
        if weights is not None:
            weights, sample_weight = _same_rank(weights, sample_weight)
            sample_weight = sample_weight * weights
        weights = sample_weight
    if weights is not None:
        values, weights = _same_rank(values, weights)
        values = values * weights
    values = tf.cast(values, "float32")
    if values.shape.rank == 1 and (
        reduction == "sum_over_batch_size"
        or (reduction == "mean_with_sample_weight" and weights is None)
    ):
        # One entry per example and a mean over the batch: the values are
        # the per-example losses (no `* batch / batch` round trip: about ten
        # small ops a step, and the last bit of each value).
        return values
    batch = tf.shape(values)[0]
    row_sums = tf.reduce_sum(tf.reshape(values, [batch, -1]), axis=1)
    n_batch = tf.cast(batch, "float32")
    if reduction == "sum":
        return row_sums * n_batch
    if reduction == "mean_with_sample_weight" and weights is not None:
        divisor = tf.reduce_sum(tf.cast(weights, "float32"))
        return tf.math.divide_no_nan(row_sums * n_batch, divisor)
    entries = tf.cast(tf.size(values), "float32")
    return tf.math.divide_no_nan(row_sums * n_batch, entries)


def _combine_masks(in_mask, out_mask):
    if in_mask is not None and out_mask is not None:
        return tf.logical_and(tf.cast(in_mask, "bool"), tf.cast(out_mask, "bool"))
    return in_mask if in_mask is not None else out_mask


def _same_rank(x1, x2):
    """Squeezes or expands a trailing axis of size 1, as Keras's losses do.

    Mirrors `keras.src.losses.loss.squeeze_or_expand_to_same_rank` (not
    public): a `[B]` weight meets `[B, 1]` values, a `[B, 1]` weight `[B]`.
    """
    r1, r2 = x1.shape.rank, x2.shape.rank
    if r1 == r2:
        return x1, x2
    if r1 == r2 + 1 and x1.shape[-1] == 1:
        if r2 == 1:
            x2 = tf.expand_dims(x2, -1)
        else:
            x1 = tf.squeeze(x1, -1)
    if r2 == r1 + 1 and x2.shape[-1] == 1:
        if r1 == 1:
            x1 = tf.expand_dims(x1, -1)
        else:
            x2 = tf.squeeze(x2, -1)
    return x1, x2


def _resolve(path, structure):
    for key in path:
        structure = structure[key]
    return structure


# ------------------------------------------------------- the compiled loss
# Keras has no public per-output view of the compiled loss. The helpers below
# restructure the batch the way `CompileLoss.call` does in Keras 3.10-3.15,
# reading its private attributes through `_keras.compile_loss`.


def _aligned(compile_loss, y_true, y_pred):
    """`(y_true, y_pred)` restructured like `CompileLoss.call` does; builds it once.

    Building creates Keras's per-output loss trackers, as the first stock
    `compute_loss` would.
    """
    if not tf.nest.is_nested(y_true) and not tf.nest.is_nested(y_pred):
        if not compile_loss.built:
            compile_loss.build(y_true, y_pred)
        return y_true, y_pred
    y_true = _match_structure(compile_loss, y_true, y_pred)
    if not compile_loss.built:
        compile_loss.build(y_true, y_pred)
    y_pred = _repack(keras_loss.y_pred_build_structure(compile_loss), y_pred)
    y_true = _repack(keras_loss.y_true_build_structure(compile_loss), y_true)
    return y_true, y_pred


def _repack(structure, values):
    try:
        keras.tree.assert_same_structure(structure, values)
        return values
    except ValueError:
        return keras.tree.pack_sequence_as(structure, keras.tree.flatten(values))


def _match_structure(compile_loss, y_true, y_pred):
    """`y_true` packed like `y_pred` (the cases `CompileLoss.call` accepts)."""
    try:
        keras.tree.assert_same_structure(y_pred, y_true)
        return y_true
    except ValueError:
        pass
    if not tf.nest.is_nested(y_true) and hasattr(y_pred, "__len__") and len(y_pred) == 1:
        y_true = [y_true]
    elif isinstance(y_pred, (list, tuple)) and isinstance(y_true, dict):
        names = compile_loss.output_names
        if names and set(names) == set(y_true.keys()):
            y_true = [y_true[name] for name in names]
    try:
        return keras.tree.pack_sequence_as(y_pred, y_true)
    except Exception:  # noqa: BLE001 - Keras tries the next layout the same way
        pass
    try:
        keras.tree.assert_same_paths(y_true, y_pred)
        return keras.tree.pack_sequence_as(y_pred, keras.tree.flatten(y_true))
    except Exception:  # noqa: BLE001
        pass
    flat_true = keras.tree.flatten(y_true)
    user_loss = keras_loss.user_loss(compile_loss)
    flat_loss = keras.tree.flatten(user_loss)
    present = [i for i, loss in enumerate(flat_loss) if loss is not None]
    if len(flat_true) != len(present):
        raise ValueError(
            "y_true and y_pred have different structures. Received: "
            f"{len(flat_true)} targets for {len(present)} compiled losses"
        )
    filled = [None] * len(flat_loss)
    for value, i in zip(flat_true, present):
        filled[i] = value
    return keras.tree.pack_sequence_as(user_loss, filled)


__all__ = ["per_example_losses"]
