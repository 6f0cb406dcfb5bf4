"""`TaskEngine`: one model's multi-task step (the `task_balancing` engine).

One forward pass inside one persistent tape yields the total loss and the
per-task losses (`task_losses`); then, by the option's `kind`:

- `"weighting"`: one backward pass of `total + sum_k (w_k - 1) L_k` (the
  tasks reweighted, regularization and loss terms unchanged) for every
  variable;
- `"rows"`: the rows `d L_k / d shared` (`keras_tapeops.rows`), plus the
  ordinary gradient of the rest of the loss (regularization, loss terms,
  non-task outputs) on the shared variables and of the whole loss on the
  others; the rows are reduced to one gradient by the option's `weights`
  in `finalize`, once per applied optimizer step;
- `"representation"`: rows of the shared representation (through the heads
  only), MGDA's weights from their Gramian, then one backward pass of the
  weighted loss into the shared variables;
- `"conflict"`: the ordinary step; every `every`-th step the rows are
  computed for the logged norms and cosines.

Semantics with the rest of the step:

- Distribution: rows (and the task losses) are summed over replicas before
  anything is computed from them, so two replicas equal one device. An
  applied step makes two all-reduces: the step's usual one (gradients of
  every variable) and one of the packed rows and losses in `finalize`
  (`MeasureConflict`: only on measured steps; `MGDA(on="representation")`:
  the `K x K` Gramian in the pass instead; `FAMO`: the K losses in the pass).
- Mixed precision: rows come from the loss-scaled losses (no float16
  underflow) and are divided by the loss scale; all aggregation is float32.
  A non-finite step stays non-finite, so the LossScaleOptimizer skips it.
- `micro_batches` / `accumulation_steps`: the rows (and losses) are
  accumulated, sample-weighted, over the passes of an applied step and
  aggregated once: the step equals the one on the large batch. (FAMO
  refuses `micro_batches`; `MGDA(on="representation")` refuses them under a
  multi-replica strategy: their weights need each pass's global losses.)
"""

import contextlib
import random
import threading

import keras
import tensorflow as tf

from keras_tapeops import capture
from keras_tapeops import rows as row_ops
from keras_tapeops import true_gradients
from keras_tapeops.multi_gradient import MultiGradientState
from keras_tapeops.multitask import layerwise
from keras_tapeops.multitask import tasks as task_resolution
from keras_tapeops.multitask.epochs import EpochLosses
from keras_tapeops.multitask.metrics import TaskMetrics
from keras_tapeops.multitask.context import StepContext
from keras_tapeops.multitask.task_losses import recording_task_losses
from keras_tapeops.replicas import batch_size

# How rows are computed: "loop" (one backward pass per task on the
# persistent tape) or "pfor" (one vectorized Jacobian). bench/multi_task.py
# measures both; "loop" was faster on CPU for every K tried (see its table).
JACOBIAN_METHOD = "loop"


class TaskEngine(MultiGradientState):
    """The per-model state of a `task_balancing` option.

    Args:
        option: the `TaskBalancing` option.
        model: the model being compiled (its tasks are resolved now).
        tree: `paths.LayerTree(model)`.

    Attributes:
        task_names: the tasks, in order.
        shared: bools aligned with `model.trainable_weights` once bound.
        state: dict name -> learned variable (saved training state).
    """

    def __init__(self, option, model, tree):
        super().__init__()
        self.option = option
        self.task_names = task_resolution.resolve_task_names(model, option)
        k = len(self.task_names)
        if option.max_tasks is not None and k > option.max_tasks:
            raise ValueError(
                f"{type(option).__name__} solves its sub-problem exactly over "
                f"2^K task subsets and supports at most {option.max_tasks} tasks. "
                f"Received: {k} tasks ({self.task_names})"
            )
        seed = getattr(option, "seed", None)
        self.seed = int(seed) if seed is not None else random.randrange(2**31 - 1)
        self.state = {
            name: keras.Variable(
                value,
                trainable=False,
                name=f"task_balancing_{name}",
                aggregation="only_first_replica",
            )
            for name, value in option.initial_state(k).items()
        }
        self.epochs = EpochLosses(k) if option.needs_epochs else None
        self.variables = list(self.state.values()) + (
            self.epochs.variables if self.epochs is not None else []
        )
        self.task_metrics = TaskMetrics(
            self.task_names,
            model,
            weights=option.logs_weights,
            gradients=option.kind in ("rows", "representation", "conflict"),
            epochs=self.epochs,
        )
        self.metrics = {self.task_metrics.name: self.task_metrics}
        self.shared = None
        self.dense_sites = []
        self.representation = (  # layers exist before the model is built
            option.representation_layer(model, tree) if option.kind == "representation" else None
        )
        self.jacobian_method = JACOBIAN_METHOD
        # False: every step keeps the rows (bench/multi_task.py compares both).
        self.layer_by_layer = True
        self._handover = threading.local()
        self._sums = None
        self._sum_structure = None

    # ------------------------------------------------------------- binding
    def bind_variables(self, model, variables, tree):
        self.shared = task_resolution.shared_mask(
            self.option, model, variables, tree, self.task_names
        )
        self.dense_sites = (
            layerwise.dense_sites(model, variables, self.shared, tree)
            if self.option.kind in ("rows", "conflict")
            else []
        )
        self._sums = None  # re-created (lazily) for the new variables

    def check_batch(self, model, x, y, sample_weight):
        options = model.tapeops_options
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        reason = self.option.micro_batch_refusal(replicas)
        if reason is not None and options.micro_batches > 1:
            raise ValueError(
                f"`task_balancing={self.option!r}` cannot be combined with "
                f"`micro_batches`: {reason}. Received: micro_batches={options.micro_batches}"
            )

    # ----------------------------------------------------------- the pass
    def batch_gradients(self, model, x, y, sample_weight, loss_multiplier=None):
        kind = self.option.kind
        layers = [self.representation] if kind == "representation" else []
        # The factor the stock step multiplies its loss by (a LossScaleOptimizer's
        # dynamic scale, a static `loss_scale_factor`, or 1).
        scaled = model.optimizer is not None and (
            isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
            or model.optimizer.loss_scale_factor is not None
        )
        scale = model.optimizer.scale_loss(tf.constant(1.0)) if scaled else None
        by_layer = self._by_layer(model)
        recorder = (
            layerwise.recording(self.dense_sites, model.trainable_weights, model)
            if by_layer
            else contextlib.nullcontext()
        )
        with tf.GradientTape(persistent=True) as tape:
            with recording_task_losses(model) as record:
                with capture.recording_outputs(layers) as captured, recorder:
                    total, y_pred = model.compute_total_loss(x, y, sample_weight, training=True)
            value_list = record.value_list(self.task_names)
            values = tf.stack(value_list)
            total = tf.cast(total, tf.float32)
            variables = list(model.trainable_weights)
            if self.shared is None or len(self.shared) != len(variables):
                model.build_tapeops()  # a model built by this forward pass binds now
            shared = list(self.shared)
            # The backward passes below differentiate `combined` with a
            # cotangent: (c_1..c_K, c_total) gives sum_k c_k L_k + c_total L.
            combined = tf.concat([values, total[tf.newaxis]], axis=0)
            s = tf.cast(scale, tf.float32) if scale is not None else tf.constant(1.0)
            targets = rest = None  # the scalars whose rows are taken (loss-scaled)
            if kind in ("rows", "conflict", "representation"):
                targets = [v * s for v in value_list]
                if self.jacobian_method != "loop":
                    targets = tf.stack(targets)  # pfor needs the stack on the tape
                if kind == "rows" and self._has_rest(model, record):
                    rest = (total - tf.add_n(value_list)) * s
        n = tf.cast(batch_size(x), tf.float32)
        m = tf.cast(loss_multiplier, tf.float32) if loss_multiplier is not None else 1.0
        pass_ = _Pass(self, model, tape, variables, shared, values, combined, targets, s, m, n)
        pass_.captured = captured
        pass_.recorder = recorder if by_layer else None
        pass_.rest = rest
        pass_.unscale = (lambda t: t / s) if scaled else (lambda t: t)
        grads = getattr(pass_, kind)()
        return grads, y_pred

    def _by_layer(self, model):
        """True when this step's Gramian is taken layer by layer (`layerwise`).

        That needs the pass to be the whole step (one replica, no
        accumulation: Gramians do not add over replicas or passes), the
        tasks differentiated one by one, and a shared Dense layer.
        """
        return bool(
            self.layer_by_layer
            and self.dense_sites
            and self.jacobian_method == "loop"
            and tf.distribute.get_strategy().num_replicas_in_sync == 1
            and not self.accumulating(model)
        )

    def _has_rest(self, model, record):
        """True unless the loss is exactly the sum of the tasks (trace-time check)."""
        state = model.tapeops_state
        return bool(
            model.losses
            or (state is not None and state.active_terms(True))
            or type(model).compute_loss is not keras.Model.compute_loss
            or set(record.names()) != set(self.task_names)
        )

    # ----------------------------------------------------------- handover
    def accumulating(self, model):
        options = model.tapeops_options
        return options.micro_batches > 1 or options.accumulation_steps > 1

    def hand_over(self, model, pending, n, condition=None):
        """Passes this pass's rows and losses (`pending`, a nest of tensors) to `finalize`.

        Without accumulation they are kept as they are (one pass per applied
        step); with it, `n * pending` and `n` are added to per-replica sums.
        """
        if not self.accumulating(model):
            self._handover.pending = pending
            return
        flat = tf.nest.flatten(pending) + [n]
        self._sum_structure = tf.nest.map_structure(lambda _: 0, pending)
        sums = self._accumulators(flat)

        def add():
            for total, value in zip(sums, flat[:-1]):
                total.assign_add(value * n)
            sums[-1].assign_add(n)
            return tf.constant(True)

        if condition is None:
            add()
        else:
            tf.cond(condition, add, lambda: tf.constant(False))
        self._handover.pending = None

    def _accumulators(self, like):
        if self._sums is None:
            # Created on the first traced pass of an accumulating model (the
            # only time they are needed), outside the graph.
            with tf.init_scope():
                self._sums = [
                    tf.Variable(
                        tf.zeros(value.shape, tf.float32),
                        trainable=False,
                        name=f"task_sum_{i}",
                        synchronization=tf.VariableSynchronization.ON_READ,
                        aggregation=tf.VariableAggregation.SUM,
                    )
                    for i, value in enumerate(like)
                ]
        return self._sums

    def _take_global(self, model, condition):
        """The step's rows and losses: summed over replicas (and passes, averaged).

        Without accumulation: this pass's values summed over replicas (as the
        step's gradients are). With accumulation: `R sum n x / sum n` over
        the window's passes and the replicas (as `CrossBatchAccumulator`).
        """
        pending = getattr(self._handover, "pending", None)
        self._handover.pending = None
        accumulated = pending is None
        if accumulated:
            flat = [v.read_value() for v in self._sums]
            for variable in self._sums:
                variable.assign(tf.zeros_like(variable))
        else:
            flat = tf.nest.flatten(pending)
        if condition is None:
            flat = true_gradients.sum_over_replicas(flat)[0]
        else:
            flat = row_ops.sum_over_replicas_if(condition, flat)
        if accumulated:
            replicas = tf.distribute.get_strategy().num_replicas_in_sync
            factor = replicas / tf.maximum(flat[-1], 1e-12)
            flat = [value * factor for value in flat[:-1]]
            return tf.nest.pack_sequence_as(self._sum_structure, flat)
        return tf.nest.pack_sequence_as(pending, flat)

    # ------------------------------------------------------------ finalize
    def finalize(self, model, grads, variables):
        kind = self.option.kind
        if kind == "representation":
            return grads
        condition = self._condition(model) if kind == "conflict" else None
        step = self._take_global(model, condition)
        context = self.context(model, step["losses"])
        grads = list(grads)
        if kind == "rows":
            combine = getattr(self._handover, "combine", None)
            self._handover.combine = None
            if combine is None:  # the rows: per shared variable, [K, *shape]
                rows = step["rows"]
                gramian = row_ops.gramian_of_parts(rows)
                weights = self.option.weights(gramian, context)
                parts = iter(row_ops.combine_parts(weights, rows))
            else:  # taken layer by layer in the pass (`layerwise`)
                gramian = step["gramian"]
                weights = self.option.weights(gramian, context)
                parts = iter(combine(weights))
            grads = [
                g + tf.cast(next(parts), g.dtype) if on else g for g, on in zip(grads, self.shared)
            ]
            self.task_metrics.update(weights=weights, gramian=gramian)
            self.option.update(context, gramian=gramian)
        elif kind == "weighting":
            self.task_metrics.update(weights=self.option.pass_weights(context))
            self.option.update(context)
        elif kind == "conflict":
            k = len(self.task_names)
            gramian = step.get("gramian")
            if gramian is None:
                gramian = tf.cond(
                    condition,
                    lambda: row_ops.gramian_of_parts(step["rows"]),
                    lambda: tf.zeros([k, k]),
                )
            self.task_metrics.update(gramian=gramian, sample_weight=tf.cast(condition, tf.float32))
        if self.epochs is not None:
            finite = tf.reduce_all(tf.math.is_finite(step["losses"]))
            self.epochs.add(tf.where(finite, step["losses"], 0.0) * tf.cast(finite, tf.float32))
        return grads

    def _condition(self, model):
        every = self.option.every
        return tf.equal(model.optimizer.iterations % every, 0)

    def context(self, model, losses):
        """The `StepContext` for this model's current step."""
        return StepContext(
            len(self.task_names),
            losses=losses,
            state=self.state,
            step=model.optimizer.iterations,
            seed=self.seed,
            epochs=self.epochs,
        )


class _Pass:
    """The backward part of one pass, by kind (see the module docstring)."""

    def __init__(
        self,
        engine,
        model,
        tape,
        variables,
        shared,
        values,
        combined,
        targets,
        scale,
        multiplier,
        n,
    ):
        self.engine = engine
        self.model = model
        self.tape = tape
        self.variables = variables
        self.shared = shared
        self.values = values
        self.combined = combined
        self.targets = targets
        self.scale = scale
        self.multiplier = multiplier
        self.n = n
        self.k = len(engine.task_names)

    def _gradient(self, variables, task_coefficients):
        """Gradient of `scale * m * (sum_k c_k L_k + L)` for `variables`."""
        if not variables:
            return []
        seed = tf.concat([task_coefficients, [1.0]], axis=0) * self.scale * self.multiplier
        return self.tape.gradient(self.combined, variables, output_gradients=seed)

    def _split(self, shared_grads, other_grads):
        shared, others = iter(shared_grads), iter(other_grads)
        return [next(shared) if on else next(others) for on in self.shared]

    def _by_group(self):
        shared = [v for v, on in zip(self.variables, self.shared) if on]
        others = [v for v, on in zip(self.variables, self.shared) if not on]
        return shared, others

    def weighting(self):
        engine = self.engine
        losses = self.values
        if engine.option.needs_global_losses:
            losses = true_gradients.sum_over_replicas([losses])[0][0]
        context = engine.context(self.model, losses)
        weights = tf.stop_gradient(engine.option.pass_weights(context))
        grads = self._gradient(self.variables, weights - 1.0)
        engine.hand_over(self.model, {"losses": self.values}, self.n)
        return grads

    def rows(self):
        engine = self.engine
        shared, others = self._by_group()
        context = engine.context(self.model, self.values)
        weights = engine.option.pass_weights(context)
        coefficients = (
            tf.stop_gradient(weights) - 1.0 if weights is not None else tf.zeros([self.k])
        )
        other_grads = self._gradient(others, coefficients)
        if self.recorder is not None:
            gramian, combine = self._layerwise(shared)
            pending = {"gramian": gramian, "losses": self.values}
        else:
            combine = None
            pending = {"rows": self._parts(shared), "losses": self.values}
        if self.rest is not None:  # the rest of the loss: its ordinary gradient
            shared_grads = [
                g * self.multiplier
                for g in self.tape.gradient(
                    self.rest, shared, unconnected_gradients=tf.UnconnectedGradients.ZERO
                )
            ]
        else:
            shared_grads = [tf.zeros_like(v) for v in shared]
        engine.hand_over(self.model, pending, self.n)
        engine._handover.combine = combine
        return self._split(shared_grads, other_grads)

    def _layerwise(self, shared):
        """`(gramian, combine)` of the tasks over `shared`, Dense layers without rows."""
        return layerwise.task_gramian(
            self.tape, self.targets, shared, self.engine.dense_sites, self.recorder, self.scale
        )

    def _parts(self, sources):
        parts = row_ops.task_rows(self.tape, self.targets, sources, self.engine.jacobian_method)
        return [self.unscale(p) for p in parts]

    def conflict(self):
        engine = self.engine
        shared, _ = self._by_group()
        measured = engine._condition(self.model)
        grads = self._gradient(self.variables, tf.zeros([self.k]))
        one_replica = tf.distribute.get_strategy().num_replicas_in_sync == 1
        if one_replica and not engine.accumulating(self.model):
            # This pass's rows are the step's: only their Gramian leaves the
            # branch, and unmeasured steps compute nothing.
            if self.recorder is not None:
                measure = lambda: self._layerwise(shared)[0]  # noqa: E731
            else:
                measure = lambda: row_ops.gramian_of_parts(self._parts(shared))  # noqa: E731
            gramian = tf.cond(measured, measure, lambda: tf.zeros([self.k, self.k]))
            pending = {"gramian": gramian, "losses": self.values}
        else:  # rows are summed over replicas (or passes) before their Gramian
            parts = tf.cond(
                measured,
                lambda: self._parts(shared),
                lambda: [tf.zeros([self.k, *v.shape]) for v in shared],
            )
            pending = {"rows": parts, "losses": self.values}
        engine.hand_over(self.model, pending, self.n, condition=measured)
        return grads

    def representation(self):
        engine = self.engine
        shared, others = self._by_group()
        outputs = [t for ts in self._captured() for t in ts]
        gramian = row_ops.gramian_of_parts(self._parts(outputs))
        gramian, losses = true_gradients.sum_over_replicas([gramian, self.values])[0]
        context = engine.context(self.model, losses)
        weights = engine.option.weights(gramian, context)
        engine.task_metrics.update(weights=weights, gramian=gramian)
        shared_grads = self._gradient(shared, tf.stop_gradient(weights) - 1.0)
        other_grads = self._gradient(others, tf.zeros([self.k]))
        return self._split(shared_grads, other_grads)

    def _captured(self):
        layer = self.engine.representation
        outputs = self.captured.get(id(layer), [])
        if not outputs:
            raise ValueError(
                f"MGDA(on='representation') recorded no output of layer "
                f"{layer.name!r} in the forward pass. Received: representation={layer.name!r}"
            )
        return [outputs]
