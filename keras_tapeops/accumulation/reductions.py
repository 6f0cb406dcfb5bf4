"""How each compiled loss normalizes a batch, so accumulated steps stay exact.

Every Keras loss reduction divides a sum over the batch by a normalizer:

- `"sum_over_batch_size"` / `"mean"`: the number of loss entries (samples
  times entries per sample), or, for an output with a Keras mask, the
  number of unmasked entries;
- `"mean_with_sample_weight"`: the sum of the sample weights (of the mask
  when there are no weights; the number of entries when neither is given);
- `"sum"`: nothing (the normalizer is 1).

One step on a large batch divides each output's summed loss by the large
batch's normalizer. Accumulation is exact when every piece (a micro-batch or a
batch of the window) contributes `its normalizer / the large batch's
normalizer` times the gradient of its own loss. Each output is a "component"
of one of four kinds, named after its normalizer:

- `"samples"`: proportional to the number of samples (the default
  reductions without a mask; `"mean_with_sample_weight"` without weights),
  like regularization losses and loss terms, which count as per-sample means;
- `"unit"`: `"sum"` (every piece counts in full);
- `"weights"`: `"mean_with_sample_weight"` with sample weights;
- `"masked"`: a mean reduction of a masked output (the number of unmasked
  entries is known only after the forward pass).

`micro_batches` knows the whole batch before its loop, so the first three
kinds are folded into one gradient (each output's loss is rescaled while the
micro-batch's loss is computed); a masked output is differentiated apart and
divided by its unmasked count at the end. `accumulation_steps` cannot know
the window's normalizers before its last batch, so its window must have a
single kind (see `window_group`); other mixes are refused before any step.

`None` / `"none"` (no reduction) has no normalizer and is refused.
"""

from __future__ import annotations

import collections
import contextlib

import keras
import tensorflow as tf

from keras_tapeops._keras import compile_loss as keras_loss
from keras_tapeops._keras import masking
from keras_tapeops._keras import private
from keras_tapeops.per_example import _resolve
from keras_tapeops.per_example import _same_rank
from keras_tapeops import hook_overrides
from keras_tapeops.replicas import batch_size
from keras_tapeops.accumulation.reduction_kinds import UNREDUCED
from keras_tapeops.accumulation.reduction_kinds import kind_of
from keras_tapeops.accumulation.reduction_kinds import refuse_mixed_window
from keras_tapeops.accumulation.reduction_kinds import refuse_unreduced


# What one output's loss did in one traced pass.
Record = collections.namedtuple(
    "Record",
    ["index", "name", "reduction", "kind", "key", "value", "weight", "size", "denominator"],
)


# ---------------------------------------------------------------- analysis
def analysable(model):
    """True when the step's loss is the compiled loss this module can read.

    Not for a model overriding `compute_loss` (its loss is its own), a model
    compiled without a loss, or a multi-gradient engine (which computes
    per-example losses itself): those keep the per-sample weighting.
    """
    if private.compiled_loss(model) is None:
        return False
    if type(model).compute_loss is not keras.Model.compute_loss:
        return False
    state = model.tapeops_state
    return state is None or getattr(state, "engine", None) is None


def window_group(records, model, regularized, steps):
    """The single group `(kind, key)` of an `accumulation_steps` window.

    Args:
        records: the `Record`s of one batch's pass.
        model: the model (its loss terms count as per-sample means).
        regularized: whether the pass had regularization or `add_loss`
            losses (they count once per step, as per-sample means).
        steps: `accumulation_steps`, for the message.

    Returns:
        `(kind, key)`. Raises ValueError if the batch needs two normalizers.
    """
    keys = {}
    for record in records:
        keys.setdefault(record.key, record)
    terms = bool(model.tapeops_options.loss_terms) or _overrides_terms(model)
    kinds = {record.kind for record in keys.values()}
    if len(keys) == 1:
        ((key, record),) = keys.items()
        if record.kind == "samples":
            return record.kind, key
        if not terms and (record.kind != "unit" or not regularized):
            return record.kind, key
    elif not keys:
        return "samples", ("samples",)
    extra = []
    if terms and kinds != {"samples"}:
        extra.append("loss terms")
    if regularized and "unit" in kinds:
        extra.append("regularization losses")
    reductions = {r.name: _with_kind(r) for r in records}
    raise refuse_mixed_window(steps, reductions, " and ".join(extra) or None)


# ------------------------------------------------------------ interception
class ReducedLoss:
    """Stands in for one output's loss while a pass is traced.

    Calls the original loss (so the value is Keras's own), works out the
    component's kind and normalizer for this piece, and hands both to
    `on_value(index, record_fields...)`, which returns the value Keras uses.
    """

    def __init__(self, index, name, loss, loss_weight, on_value, option):
        self.index = index
        self.name = name
        self.loss = loss
        self.loss_weight = loss_weight
        self.on_value = on_value
        self.option = option

    def __call__(self, y_true, y_pred, sample_weight=None):
        reduction = getattr(self.loss, "reduction", "sum_over_batch_size")
        if reduction in UNREDUCED:
            raise refuse_unreduced(*self.option, self.name, reduction)
        value = self.loss(y_true, y_pred, sample_weight)
        mask = _keras_mask(y_pred)
        kind = kind_of(reduction, sample_weight is not None, mask is not None)
        size = tf.cast(batch_size(y_pred), tf.float32)
        record = Record(
            self.index,
            self.name,
            reduction,
            kind,
            _key(kind, self.index, sample_weight),
            value,
            self.loss_weight,
            size,
            denominator(kind, reduction, size, sample_weight, mask),
        )
        return self.on_value(record)


def denominator(kind, reduction, size, sample_weight, mask):
    """This piece's normalizer for `kind` (float32 scalar; see the module docstring).

    `"samples"` uses the piece's sample count `size`: the number of loss
    entries is proportional to it, and only ratios of normalizers matter.
    """
    if kind == "unit":
        return tf.constant(1.0)
    if kind == "samples":
        return size
    if kind == "weights":
        return tf.reduce_sum(tf.cast(sample_weight, tf.float32))
    mask = tf.cast(mask, tf.float32)
    if reduction == "mean_with_sample_weight" and sample_weight is not None:
        mask, weights = _same_rank(mask, tf.cast(sample_weight, tf.float32))
        return tf.reduce_sum(mask * weights)
    return tf.reduce_sum(mask)


@contextlib.contextmanager
def intercepted(model, on_value, option, mute_output_trackers=False, on_other=None):
    """Routes every compiled output loss through `on_value` while the block is traced.

    The model's own loss is the first call of each output's loss in the
    block's graph; later calls (an adversarial term's loss at the attacked
    inputs, an attack's loop) are not recorded and go through `on_other`.

    Args:
        model: the model whose compiled loss is built (`build_compiled_loss`).
        on_value: `Record -> value`: what Keras adds for that output.
        option: `(name, value)` of the accumulation option, for messages.
        on_other: `Record -> value` for the other calls (default: Keras's
            own value).
        mute_output_trackers: stop Keras from logging each output's loss
            (the `<output>_loss` trackers of a multi-output model) in the
            block; the caller logs the batch's values itself
            (`log_output_losses`). No cross-replica call may happen inside
            the block: MirroredStrategy's replica threads run one at a time
            between such calls, so none sees the muted list.

    Yields:
        The list the `Record`s are appended to, in call order.
    """
    compile_loss = private.compiled_loss(model)
    original = keras_loss.flat_losses(compile_loss)
    trackers = output_trackers(model) if mute_output_trackers else []
    records = []
    home = tf.compat.v1.get_default_graph()
    on_other = on_other or (lambda record: record.value)

    def recorded(record):
        first = record.index not in {r.index for r in records}
        if first and tf.compat.v1.get_default_graph() is home:
            records.append(record)
            return on_value(record)
        return on_other(record)

    wrapped = [
        entry._replace(
            loss=ReducedLoss(
                i, entry.name, _unwrapped(entry.loss), entry.loss_weights, recorded, option
            )
        )
        for i, entry in enumerate(original)
    ]
    keras_loss.set_flat_losses(compile_loss, wrapped)
    if trackers:
        keras_loss.set_output_trackers(compile_loss, [None] * len(trackers))
    try:
        yield records
    finally:
        keras_loss.set_flat_losses(compile_loss, original)
        if trackers:
            keras_loss.set_output_trackers(compile_loss, trackers)


def output_trackers(model):
    """The `Mean` trackers behind the `<output>_loss` logs, in output order (or [])."""
    return list(private.compiled_loss(model).metrics)


def folded_other(record, n, totals):
    """`folded_value` for a later call of an output's loss in a micro-batch pass.

    A loss term built on the compiled loss (e.g. at adversarial inputs) then
    shares the output's exact weighting; a masked output's value is left as
    Keras computes it (weighted like a per-sample mean), so gradients through
    it (an attack's) are kept.
    """
    if record.kind == "masked":
        return record.value
    return folded_value(record, n, totals)


def logged_share(record, multiplier, n, totals):
    """This micro-batch's part of its output's logged loss for the whole batch.

    Summed over the micro-batches: the output's loss on the whole batch (a
    masked output's sum is divided by its unmasked count at the end).
    """
    if record.kind == "masked":
        return tf.cast(record.value, tf.float32) * record.denominator
    folded = folded_value(record, n, totals)
    return tf.cast(multiplier, tf.float32) * tf.cast(folded, tf.float32)


def log_output_losses(model, records, sums, masked_sizes):
    """Logs each output's loss on the whole batch, once, as stock `compute_loss` does.

    Args:
        model: the model (its `<output>_loss` trackers, multi-output only).
        records: the outputs' `Record`s (Python fields only).
        sums: `logged_share` summed over the micro-batches, per record.
        masked_sizes: the batch's normalizer of each masked record, in order.

    Returns:
        None.
    """
    trackers = output_trackers(model)
    if not trackers:
        return
    sizes = iter(masked_sizes)
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    for record, total in zip(records, sums):
        if record.kind == "masked":
            total = tf.math.divide_no_nan(total, next(sizes))
        # Keras logs each output's loss multiplied back by the replicas.
        trackers[record.index].update_state(total * float(replicas))


def logged_masked_share(record):
    """What this micro-batch's logged `loss` holds of a masked output (per replica).

    The step logs each micro-batch's loss with its sample count as weight;
    a masked output's part of it is its loss on the micro-batch.
    """
    return tf.cast(record.value, tf.float32) * record.size


def correct_logged_total(model, records, sums, masked_sizes, logged_masked, n):
    """Makes the batch's logged `loss` hold each masked output's loss on the whole batch.

    Each micro-batch logged its own masked mean with weight `n_micro`, so
    the running total holds `sum_m n_m l_m` where the whole batch's loss is
    `n sum_m s_m / sum_m d_m` (`s` the summed loss, `d` the unmasked count):
    the difference, times the loss weight, is added to the total alone
    (the count already holds `n`).

    Args:
        model: the model (its `loss` tracker).
        records: the outputs' `Record`s (Python fields only).
        sums: `logged_share` summed over the micro-batches, per record.
        masked_sizes: the batch's normalizer of each masked record, in order.
        logged_masked: `logged_masked_share` summed over the micro-batches,
            one per masked record, in order.
        n: the batch's sample count (float32 scalar).
    """
    masked = [(r, s) for r, s in zip(records, sums) if r.kind == "masked"]
    if not masked:
        return
    replicas = float(tf.distribute.get_strategy().num_replicas_in_sync)
    corrections = []
    for (record, total), size, logged in zip(masked, masked_sizes, logged_masked):
        exact = n * tf.math.divide_no_nan(total, size)
        weight = 1.0 if record.weight is None else tf.cast(record.weight, tf.float32)
        corrections.append(weight * (exact - logged) * replicas)
    private.add_to_mean_total(private.loss_tracker(model), tf.add_n(corrections))


def flat_losses(model):
    """The built compiled loss's per-output entries `(path, loss, loss_weights, name)`."""
    return keras_loss.flat_losses(private.compiled_loss(model))


def build_compiled_loss(model, x, y, sample_weight):
    """Builds the compiled loss (its per-output list) before a pass is intercepted.

    Keras builds it lazily on its first call, which without a distribution
    strategy is inside the first traced step; the per-output list must
    exist before it can be intercepted (`private.build_compiled_loss`).
    """
    private.build_compiled_loss(model, (x, y, sample_weight))


def weight_totals(model, sample_weight):
    """The sum of each output's sample weights over the whole batch, by output index.

    Used by `micro_batches` for `"mean_with_sample_weight"` outputs (None
    when the batch has no sample weights).
    """
    if sample_weight is None:
        return {}
    totals = {}
    for i, entry in enumerate(keras_loss.flat_losses(private.compiled_loss(model))):
        weights = sample_weight
        if tf.nest.is_nested(sample_weight):
            weights = _resolve(entry.path, sample_weight)
        if weights is not None:
            totals[i] = tf.reduce_sum(tf.cast(weights, tf.float32))
    return totals


def folded_value(record, n, totals):
    """The value a micro-batch's output loss contributes, for one gradient pass.

    The micro-batch's whole loss is multiplied by `n_micro / n` (regular
    losses and terms are per-sample means); this rescales each output so that
    its share is `normalizer_micro / normalizer_batch` instead. A masked
    output's normalizer is unknown until the loop ends: its value is passed
    without gradient (logged, not differentiated) and differentiated apart.

    Args:
        record: the output's `Record` for this micro-batch.
        n: the batch's sample count (scalar tensor).
        totals: `weight_totals` of the batch.

    Returns:
        The value Keras adds to the micro-batch's loss.
    """
    value = record.value
    if record.kind == "samples":
        return value
    if record.kind == "masked":
        return tf.stop_gradient(value)
    n = tf.cast(n, tf.float32)
    if record.kind == "unit":
        factor = n / record.size
    else:  # weights: (D_micro / D_batch) / (n_micro / n)
        factor = tf.math.divide_no_nan(n * record.denominator, record.size * totals[record.index])
    return value * tf.cast(factor, value.dtype)


def numerator(record):
    """A masked output's summed loss in this piece (weighted, per replica), to differentiate."""
    value = tf.cast(record.value, tf.float32)
    if record.weight is not None:
        value = value * tf.cast(record.weight, tf.float32)
    return value * record.denominator


# ----------------------------------------------------------------- helpers
def _with_kind(record):
    if record.kind == "weights":
        return f"{record.reduction} with sample weights"
    if record.kind == "masked":
        return f"{record.reduction} of a masked output"
    return record.reduction


def _overrides_terms(model):
    return hook_overrides.overrides(model, "compute_terms")


def _key(kind, index, sample_weight):
    if kind in ("unit", "samples"):
        return (kind,)
    if kind == "weights" and not tf.nest.is_nested(sample_weight):
        return (kind,)  # one weight vector for every output: one normalizer
    return (kind, index)


def _unwrapped(loss):
    while isinstance(loss, ReducedLoss):
        loss = loss.loss
    return loss


# ------------------------------------------------------- the compiled loss
# Keras has no public per-output view of the compiled loss (`CompileLoss`,
# `model._compile_loss`): its per-output list, its trackers, the Keras mask
# a tensor carries and Keras's symbolic build are read and replaced through
# `keras_tapeops._keras` (`compile_loss`, `masking`, `private`).


def _keras_mask(tensor):
    """The Keras mask a prediction carries, or None (also for a structure)."""
    if tf.nest.is_nested(tensor):
        return None
    return masking.keras_mask(tensor)
