"""DP-SGD's per-model engine: clipped per-example gradients, then noise once per step.

One (micro-)batch, one forward pass (`batch_gradients`):

1. the model runs forward on a persistent tape while every layer owning
   trainable variables (a "site") records its inputs and its pre-activation
   output `z` (`sites.Recorder`);
2. the per-example losses `l_i` (`keras_tapeops.per_example`) are summed
   (times the loss scale) and ONE backward pass gives the gradient with
   respect to every `z` (not the variables);
3. each site's rule turns its records and output gradients into per-example
   squared norms (ghost norms, or per-example gradients where that is
   cheaper, or the vectorized fallback) and a clip-weighted sum
   `sum_i c_i g_i`, with `c_i = min(1, C / ||g_i||)` from the norms of the
   whole gradient (all variables): the clipped sum is the gradient of
   `sum_i c_i l_i` without a second backward pass (book-keeping);
4. the per-replica clipped sums go through the step's pipeline
   (micro-batches, accumulation windows, the all-reduce) as sums.

An example whose loss or per-example gradient is not finite (a NaN or Inf
input or target) contributes zero: its clip weight is 0, the non-finite
entries of what the rules contract are replaced by zeros (so `0 * nan`
never reaches the sum), and it is counted in the logged metric
`dp_nonfinite_examples` (the epoch's total). The decision depends on that
example alone, so its influence stays bounded. Under a LossScaleOptimizer a
non-finite gradient may be the loss scale's overflow, which the optimizer
must see to skip the step and lower its scale: there nothing is zeroed.

Once per applied step (`finalize`, on true gradients summed over replicas),
Gaussian noise of standard deviation `C * noise_multiplier` is added to the
sum, which is divided by the step's number of samples (rows of the global
batch, or of the accumulation window), and the gradient of the weight
regularizers (data-independent) is added. The gradient transforms and the
optimizer then see it like any gradient.
"""

import math

import keras
import tensorflow as tf

from keras_tapeops import true_gradients
from keras_tapeops._keras import private
from keras_tapeops.layer_records import sites as sites_lib
from keras_tapeops.multi_gradient import MultiGradientState
from keras_tapeops.per_example import per_example_losses
from keras_tapeops.privacy import noise
from keras_tapeops.privacy import refusals
from keras_tapeops.privacy import seeds
from keras_tapeops.privacy.ghost_conv import ConvRule
from keras_tapeops.privacy.ghost_dense import DenseRule
from keras_tapeops.privacy.ghost_dense import EinsumDenseRule
from keras_tapeops.privacy.ghost_depthwise import DepthwiseConvRule
from keras_tapeops.privacy.ghost_depthwise import SeparableConvRule
from keras_tapeops.privacy.ghost_embedding import EmbeddingRule
from keras_tapeops.privacy.ghost_group_norm import GroupNormRule
from keras_tapeops.privacy.ghost_layer_norm import LayerNormRule
from keras_tapeops.privacy.rules import Context
from keras_tapeops.privacy.rules import Part
from keras_tapeops.privacy.rules import finite_or_zero
from keras_tapeops.privacy.rules import registered_rules
from keras_tapeops.privacy.vectorized import VectorizedRule
from keras_tapeops.privacy.vectorized import rows_parts

AUTO_RULES = (
    DenseRule,
    EinsumDenseRule,
    EmbeddingRule,
    ConvRule,
    DepthwiseConvRule,
    SeparableConvRule,
    LayerNormRule,
    GroupNormRule,
)
NONFINITE_METRIC = "dp_nonfinite_examples"
# The report's method for variables read outside their owner's calls
# (`Recorder.foreign`) or by the model itself: per-example rows of the
# whole forward pass (`vectorized.rows_parts`).
GLOBAL = "vectorized (whole model)"


class DPSGDState(MultiGradientState):
    """What one model resolved from a `kt.DPSGD`: its sites and step counter.

    Args:
        option: the `kt.DPSGD`.
        model: the model being compiled (inside its strategy scope).
    """

    def __init__(self, option, model):
        super().__init__()
        self.option = option
        self.seed = option.seed if option.seed is not None else seeds.fresh_seed()
        self.sites = None
        self.orphans = []
        self.methods = {}  # (path, variable name) -> method, filled at trace time
        # Samples (rows) added since the last applied step, per replica; not
        # saved with the model (it is zero between steps).
        self.samples = tf.Variable(
            0.0,
            trainable=False,
            name="dp_samples",
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.SUM,
        )
        # The sample count of the last applied step (equal on every replica),
        # read by kt.callbacks.PrivacyBudget to infer the sampling rate.
        self.step_samples = tf.Variable(
            0.0,
            trainable=False,
            name="dp_step_samples",
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
        )
        # Examples that contributed zero because their gradient was not finite.
        self.metrics = {NONFINITE_METRIC: keras.metrics.Sum(name=NONFINITE_METRIC)}
        # Set (at trace time) once a batch with a mask of real examples was
        # traced; `mask_refusal` (a message, set by kt.callbacks.PrivacyBudget
        # when it cannot account for masked batches) refuses such a batch.
        self.saw_mask = False
        self.mask_refusal = None

    # ---------------------------------------------------------------- binding
    def bind_variables(self, model, variables, tree):
        rule_for = self._rule_for
        self.sites, self.orphans = sites_lib.discover(model, variables, rule_for, tree)
        self.methods = {}

    def _rule_for(self, layer):
        if self.option.method == "vectorized":
            return VectorizedRule
        candidates = (*registered_rules(), *AUTO_RULES)
        return next((rule for rule in candidates if rule.applies(layer)), VectorizedRule)

    # ------------------------------------------------------------------ batch
    def check_batch(self, model, x, y, sample_weight):
        if sample_weight is not None:
            flat = tf.nest.flatten(sample_weight)
            if len(flat) != 1 or flat[0].dtype != tf.bool:
                dtypes = sorted({t.dtype.name for t in flat})
                raise refusals.sample_weight_refused(
                    dtypes, " (kt.privacy.poisson_batches pads batches with one)"
                )
        options = model.tapeops_options
        if options is not None and options.loss_terms:
            raise refusals.loss_terms_refused([term.name for term in options.loss_terms])
        if y is None:
            raise ValueError(refusals.NO_TARGETS)
        if sample_weight is not None:
            self.saw_mask = True
            if self.mask_refusal is not None:
                message, self.mask_refusal = self.mask_refusal, None
                raise ValueError(message)

    def batch_gradients(self, model, x, y, sample_weight, loss_multiplier=None):
        parts, losses, y_pred = self.forward_parts(model, x, y)
        mask = None if sample_weight is None else tf.cast(sample_weight, tf.float32)
        n = tf.shape(losses)[0]
        factor = self._sum_factor(model, n, loss_multiplier)
        used = [v for v in model.trainable_weights if id(v) in parts]
        zeroing = parts.all_finite is not None

        def clipped_sum(parts):
            squared = tf.add_n([p.squared_norms for p in parts.values()])
            clip = tf.cast(self.option.l2_norm_clip, tf.float32)
            weights = tf.minimum(1.0, clip / tf.sqrt(squared))
            # A non-finite example's norm is +inf (see `_BackwardPass`): weight 0.
            finite = tf.cast(tf.math.is_finite(squared), tf.float32)
            if zeroing:
                weights = weights * finite
            if mask is not None:
                weights = weights * mask
            weights = weights * factor
            return [_as_dtype(parts[id(v)].weighted(weights), v.dtype) for v in used], finite

        if zeroing:
            # Every example finite (the common case): the rules' parts of the
            # records as they are. Otherwise the rules run again on records
            # whose non-finite entries are zeroed, so `0 * nan` never reaches
            # the sum (the same result where every example is finite).
            sums, finite = tf.cond(
                parts.all_finite,
                lambda: clipped_sum(parts),
                lambda: clipped_sum(parts.sanitized()),
            )
            # A non-finite example is left out of the logged loss like a
            # masked row, and counted.
            losses = tf.where(finite > 0, losses, 0.0)
            logged = finite if mask is None else finite * mask
            nonfinite = 1.0 - finite if mask is None else (1.0 - finite) * mask
            self.metrics[NONFINITE_METRIC].update_state(tf.reduce_sum(nonfinite))
        else:
            sums, _ = clipped_sum(parts)
            logged = mask
        self._log_loss(model, losses, logged, n)
        by_id = {id(v): g for v, g in zip(used, sums)}
        grads = [by_id.get(id(variable)) for variable in model.trainable_weights]
        self.samples.assign_add(tf.cast(n, tf.float32))
        return grads, y_pred

    def forward_parts(self, model, x, y):
        """One forward and one backward pass: every variable's per-example `Part`.

        Args:
            model: the compiled model.
            x, y: the (micro-)batch.

        Returns:
            `(parts, losses, y_pred)`: `parts` (a `Parts` dict) maps
            `id(variable)` to its `Part` (per-example squared norms and the
            clip-weighted sum) from the records as they are; the `[B]`
            per-example losses; the model's outputs. Outside a
            LossScaleOptimizer `parts.all_finite` (bool: every example's
            data, loss and squared norm are finite) and `parts.sanitized()`
            (the parts of records whose non-finite entries are zeroed) are
            set; under one they are None.
        """
        if self.sites is None:
            _build(model, x)
        trainable = list(model.trainable_weights)
        scale = _loss_scale(model.optimizer, trainable)
        finite_data = None
        if _zeroes_nonfinite(model.optimizer):
            # Non-finite inputs or targets are zeroed before the forward pass:
            # a NaN row would otherwise reach other rows through backward
            # passes over the whole batch (the vectorized Jacobian: a^T (0 g)).
            finite_data = tf.reduce_all(
                tf.stack(
                    [_finite_rows(t) for t in _floating(tf.nest.flatten((x, y)))]
                    or [tf.ones([tf.shape(tf.nest.flatten(x)[0])[0]], tf.bool)]
                ),
                axis=0,
            )
            x, y = _zeroed_if_nonfinite((x, y), tf.reduce_all(finite_data))
        tape = tf.GradientTape(persistent=True)
        with tape:
            with sites_lib.Recorder(self.sites, trainable) as recorder:
                y_pred = private.call_model(model, x, training=True)
                losses = per_example_losses(model, y, y_pred)
            _check_added_losses(model)
            scaled = losses * scale
            objective = tf.reduce_sum(scaled)
        backward = _BackwardPass(self, model, tape, recorder, objective, scaled, scale)
        parts = Parts(backward.parts())
        if finite_data is not None:
            squared = tf.add_n([p.squared_norms for p in parts.values()])
            parts.all_finite = tf.reduce_all(
                tf.stack(
                    [
                        tf.reduce_all(finite_data),
                        tf.reduce_all(tf.math.is_finite(scaled)),
                        tf.reduce_all(tf.math.is_finite(squared)),
                    ]
                )
            )
            parts.sanitized = lambda: backward.parts(finite_data)
        return parts, losses, y_pred

    def _sum_factor(self, model, n, loss_multiplier):
        """What the clipped sum is multiplied by so the step's pipeline keeps it a sum.

        Without accumulation, micro-batch sums add up to the batch's sum (the
        loss multiplier is not applied to a sum). An accumulation window
        multiplies each batch by its sample count and divides by the
        window's; `finalize` undoes the window's factor.
        """
        options = model.tapeops_options
        if options is None or options.accumulation_steps == 1:
            return tf.constant(1.0)
        multiplier = 1.0 if loss_multiplier is None else tf.cast(loss_multiplier, tf.float32)
        return tf.math.divide_no_nan(multiplier, tf.cast(n, tf.float32))

    def _log_loss(self, model, losses, mask, n):
        """Logs the batch's loss as stock Keras does (mean over rows + regularization)."""
        if not model._tapeops_logging:
            return
        values = losses if mask is None else losses * mask
        mean = tf.math.divide_no_nan(tf.reduce_sum(values), tf.cast(n, tf.float32))
        value = mean + regularization(model.trainable_weights)
        private.loss_tracker(model).update_state(value, sample_weight=n)

    # ------------------------------------------------------------------- step
    def finalize(self, model, grads, variables):
        samples, key = noise.replica_sums(self.samples.read_value(), self.seed)
        self.samples.assign(0.0)
        self.step_samples.assign(samples)
        options = model.tapeops_options
        accumulating = options is not None and options.accumulation_steps > 1
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        inverse = tf.math.divide_no_nan(1.0, samples)
        stddev = self.option.l2_norm_clip * self.option.noise_multiplier
        step_key = noise.step_key(key, model.optimizer.iterations) if stddev > 0 else None
        out = []
        for index, grad in enumerate(grads):
            if grad is None:
                out.append(None)
                continue
            total = tf.cast(tf.convert_to_tensor(grad), tf.float32)
            if accumulating:  # the window's pipeline averaged: back to a sum
                total = total * (samples / float(replicas))
            if stddev > 0:
                total = total + noise.gaussian_at(tf.shape(total), step_key, index, stddev)
            out.append(total * inverse)
        out = _add_regularization(out, variables)
        return [None if g is None else tf.cast(g, v.dtype) for g, v in zip(out, variables)]

    # ----------------------------------------------------------------- report
    def report(self):
        """How each trainable variable's per-example norm is computed.

        Returns:
            A list of `(layer path, variable name, method)` rows. Methods
            chosen from shapes (ghost or per-example) are known once the
            first step has been traced; before that the rule family is shown.
        """
        if self.sites is None:
            return []
        rows = []
        for site in self.sites:
            for variable in site.variables:
                key = (site.path, variable.name)
                method = self.methods.get(key, f"{site.rule.family}: (chosen at the first step)")
                rows.append((site.path, variable.name, method))
        for (path, name), method in self.methods.items():
            if method == GLOBAL:
                rows.append((path, name, method))
        return rows


class Parts(dict):
    """`id(variable) -> Part`, with the non-finite handling of `forward_parts` as attributes."""

    all_finite = None
    sanitized = None


class _BackwardPass:
    """The gradients of the objective with respect to every recorded `z`, and the rules' parts.

    The gradients are taken once; `parts` may run the rules twice (on the
    records as they are, and on zeroed ones for the layers whose parts are
    not row-local: see `Part.sanitized`).
    """

    def __init__(self, engine, model, tape, recorder, objective, scaled, scale):
        self.engine, self.model, self.tape = engine, model, tape
        self.recorder, self.scaled, self.scale = recorder, scaled, scale
        self.called = [s for s in engine.sites if recorder.invocations[id(s.layer)]]
        flat_z = [
            z
            for s in self.called
            for record in recorder.invocations[id(s.layer)]
            for z in record["z"]
        ]
        self.flat_grads = tape.gradient(
            objective, flat_z, unconnected_gradients=tf.UnconnectedGradients.ZERO
        )
        self.first_parts = {}  # id(site) -> its parts of the records as they are

    def parts(self, finite_data=None):
        """`id(variable) -> Part` for every trainable variable the forward pass used.

        With `finite_data` (outside a LossScaleOptimizer, when some example
        is not finite), an example whose data (`finite_data` False: its
        inputs or targets, zeroed by `forward_parts`), loss, recorded layer
        inputs or output gradients are not finite gets the squared norm +inf
        (its clip weight is then 0), and the rules see those tensors with
        non-finite entries replaced by zeros, so its zero-weighted row adds
        exactly zero to the clipped sum.
        """
        engine, model, tape, recorder = self.engine, self.model, self.tape, self.recorder
        scaled, scale = self.scaled, self.scale
        sanitize = finite_data is not None
        global_variables = list(engine.orphans) + [
            v for v in recorder.foreign.values() if all(v is not o for o in engine.orphans)
        ]
        global_ids = {id(v) for v in global_variables}
        context = Context(tape, scale, bool(model.jit_compile), sanitize=sanitize)
        finite_rows = [finite_data, tf.math.is_finite(scaled)] if sanitize else []
        parts = {}
        position = 0
        for site in self.called:
            records = recorder.invocations[id(site.layer)]
            grads = []
            for record in records:
                grads.append(self.flat_grads[position : position + len(record["z"])])
                position += len(record["z"])
            kept = self.first_parts.get(id(site))
            if sanitize and kept and all(p.cleanable for p in kept.values()):
                # Row-local parts: a non-finite example's entries are in its
                # own rows (and make its norm non-finite), so the rows are
                # cleaned instead of running the rule on zeroed records, and
                # the records are not kept for this branch.
                site_parts = {vid: part.sanitized() for vid, part in kept.items()}
                finite_rows.extend(tf.math.is_finite(p.squared_norms) for p in kept.values())
            elif sanitize:
                finite_rows.extend(
                    _finite_rows(t) for record in records for t in _floating([record.get("a")])
                )
                finite_rows.extend(_finite_rows(g) for gz in grads for g in _floating(gz))
                records = [_zeroed_record(record) for record in records]
                grads = [[finite_or_zero(g) for g in gz] for gz in grads]
                site_parts = site.rule.clip(site, records, grads, context)
            else:
                site_parts = self.first_parts[id(site)] = site.rule.clip(
                    site, records, grads, context
                )
            for vid, part in site_parts.items():
                if vid in global_ids:
                    continue
                parts[vid] = part
                engine.methods[(site.path, _name_of(site, vid))] = (
                    f"{site.rule.family}: {part.method}"
                )
        if global_variables:
            used = [v for v in global_variables if any(v is t for t in model.trainable_weights)]
            for vid, part in rows_parts(
                tape, scaled, used, scale, GLOBAL, sanitize=sanitize
            ).items():
                parts[vid] = part
            for v in used:
                engine.methods[("(read outside its layer)", v.path)] = GLOBAL
        if not parts:
            raise ValueError(
                "DPSGD found no trainable variable used by the forward pass. "
                f"Received: model={model.name!r}"
            )
        if sanitize:
            finite = tf.reduce_all(tf.stack(finite_rows), axis=0)
            first = next(iter(parts))
            part = parts[first]
            parts[first] = Part(
                tf.where(finite, part.squared_norms, math.inf), part.weighted, part.method
            )
        return parts


def regularization(variables):
    """The sum of the variables' weight regularizers (float32), as Keras adds them."""
    values = [
        tf.cast(tf.reduce_sum(v.regularizer(v)), tf.float32)
        for v in variables
        if getattr(v, "regularizer", None) is not None
    ]
    return tf.add_n(values) if values else tf.constant(0.0)


def _add_regularization(grads, variables):
    """Adds the gradient of the weight regularizers (data-independent: no clipping, no noise)."""
    regularized = [
        i for i, v in enumerate(variables) if getattr(v, "regularizer", None) is not None
    ]
    if not regularized:
        return grads
    with tf.GradientTape() as tape:
        total = regularization([variables[i] for i in regularized])
    extra = tape.gradient(total, [variables[i] for i in regularized])
    out = list(grads)
    for i, g in zip(regularized, extra):
        if g is None:
            continue
        g = tf.cast(tf.convert_to_tensor(g), tf.float32)
        out[i] = g if out[i] is None else out[i] + g
    return out


def _zeroes_nonfinite(optimizer):
    """True unless the optimizer scales the loss (then overflows must reach it)."""
    return optimizer is None or true_gradients.loss_scale(optimizer) is None


def _floating(tensors):
    """The dense or ragged floating-point tensors among `tensors`."""
    return [
        t
        for t in tensors
        if (tf.is_tensor(t) or isinstance(t, tf.RaggedTensor)) and t.dtype.is_floating
    ]


def _finite_rows(tensor):
    """`[B]` bool: True where every entry of the example's row is finite."""
    finite = tf.math.is_finite(tensor)
    if finite.shape.rank == 1:
        return finite
    return tf.reduce_all(finite, axis=list(range(1, finite.shape.rank)))


def _zeroed_if_nonfinite(data, all_finite):
    """`data` with non-finite entries zeroed, copied only in a batch that has one.

    The dense floating tensors go through one `tf.cond` (a batch of finite
    data, the common case, passes as it is: on the bench's CNN the
    element-wise select cost about 1 ms a step); ragged ones are zeroed.
    """
    flat = tf.nest.flatten(data)
    dense = [i for i, t in enumerate(flat) if isinstance(t, tf.Tensor) and t.dtype.is_floating]
    if dense:
        picked = [flat[i] for i in dense]
        zeroed = tf.cond(
            all_finite,
            lambda: [tf.identity(t) for t in picked],
            lambda: [finite_or_zero(t) for t in picked],
        )
        for i, tensor, before in zip(dense, zeroed, picked):
            flat[i] = tf.ensure_shape(tensor, before.shape)
    flat = [finite_or_zero(t) if isinstance(t, tf.RaggedTensor) else t for t in flat]
    return tf.nest.pack_sequence_as(data, flat)


def _zeroed_record(record):
    """A site's record with the non-finite entries of its input `a` replaced by zeros.

    `z` stays as recorded: the vectorized rule differentiates through it on
    the tape (its rows are cleaned in `rows_parts`).
    """
    if not _floating([record.get("a")]):
        return record
    return {**record, "a": finite_or_zero(record["a"])}


def _check_added_losses(model):
    """Refuses losses added in the forward pass (`add_loss`, activity regularizers)."""
    regularized = sum(
        1 for v in model.trainable_weights if getattr(v, "regularizer", None) is not None
    )
    extra = len(model.losses) - regularized
    if extra > 0:
        raise refusals.added_losses_refused(extra, model.name)


def _name_of(site, variable_id):
    for variable in site.variables:
        if id(variable) == variable_id:
            return variable.name
    return "?"


def _loss_scale(optimizer, variables):
    """The factor the optimizer scales the loss by (1 without one), as a float32 tensor."""
    if optimizer is None:
        return tf.constant(1.0)
    if not optimizer.built:  # a LossScaleOptimizer creates its scale in build()
        optimizer.build(variables)
    scale = true_gradients.loss_scale(optimizer)
    return tf.constant(1.0) if scale is None else tf.cast(scale, tf.float32)


def _as_dtype(grad, dtype):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(tf.cast(grad.values, dtype), grad.indices, grad.dense_shape)
    return tf.cast(grad, dtype)


def _build(model, x):
    """Builds a model not built yet from `x`'s shapes, then binds the engine."""
    if not model.built:
        model(tf.nest.map_structure(lambda t: keras.KerasTensor(t.shape, t.dtype.name), x))
    state = model.build_tapeops()
    engine = state.engine if state is not None else None
    if engine is None or engine.sites is None:
        raise ValueError(
            "DPSGD could not find the model's variables before its first "
            f"step. Build the model first. Received: model={model.name!r}"
        )
