"""`TapeOpsMixin` on JAX: the stock stateless JAX step plus the gradient transforms.

train_step(state, data): unpack -> `jax.value_and_grad` of Keras's own
`compute_loss_and_updates` (forward, compiled loss, loss scaling), or, with
loss terms or `micro_batches`, of `backend/jax/loss.py`'s loss (the forward
pass or the micro-batch scan, the compiled loss, the terms) -> true
gradients (unscaled under mixed precision) -> transform_gradients -> the
optimizer's `stateless_apply` -> metrics. Under
`keras.distribution.DataParallel` the gradient of the global batch is
already the all-reduced one, so the transforms see the true gradients as on
TensorFlow. With no option the step is Keras's own.
"""

from __future__ import annotations

from typing import Any
from typing import Sequence

import jax
import keras
from keras import ops

from keras_tapeops._keras import jax_trainer
from keras_tapeops.accumulation.flush import FlushingFit
from keras_tapeops.accumulation.flush import add_callbacks_first
from keras_tapeops.accumulation.reduction_kinds import check_compile_loss
from keras_tapeops.backend.jax import loss as jax_loss
from keras_tapeops.backend.jax.accumulation import AccumulationWindow
from keras_tapeops.backend.jax.carried import EvaluationStep
from keras_tapeops.backend.jax.carried import TransformVariables
from keras_tapeops.backend.jax.true_gradients import true_transformed
from keras_tapeops.backend.jax import micro_batches
from keras_tapeops.backend.jax import privacy
from keras_tapeops.backend.jax import stops
from keras_tapeops.backend.jax.options import pop_jax_options
from keras_tapeops.hook_overrides import default_hook
from keras_tapeops.hook_overrides import overrides
from keras_tapeops.options import TapeOpsOptions
from keras_tapeops.privacy.dpsgd import DPSGD
from keras_tapeops.options import compile_signature
from keras_tapeops.paths import LayerTree
from keras_tapeops.saving import SavingMethods
from keras_tapeops.split_sizes import static_batch_size
from keras_tapeops.terms.base import Term
from keras_tapeops.terms.base import TermContext
from keras_tapeops.terms.base import weighted_term_values
from keras_tapeops.training_state import TrainingState
from keras_tapeops.training_state import transform_state_items
from keras_tapeops.transforms.base import after_apply_in_order
from keras_tapeops.transforms.base import apply_in_order
from keras_tapeops.transforms.base import keep_step_decision
from keras_tapeops.transforms.base import with_hook


class JaxModelState:
    """What one model resolved from its options on JAX: transforms, terms, trackers.

    Args:
        model: the model being compiled.
        options: the model's `TapeOpsOptions`.
    """

    def __init__(self, model: keras.Model, options: TapeOpsOptions) -> None:
        self.options = options
        self.transforms: list[Any] = []
        self.sam_selected: list[bool] | None = None  # the SAM option's selection
        self._bound_to: int | None = None
        tree = LayerTree(model)
        self.terms = [(term, term.bind(model, tree)) for term in options.loss_terms]
        self.term_trackers: dict[str, keras.metrics.Mean] = {}
        self.accumulator: AccumulationWindow | None = None  # accumulation_steps > 1
        self.transform_variables: TransformVariables | None = None  # e.g. a skip counter
        self.privacy: privacy.PrivateGradients | None = None  # differential_privacy
        # The step scheduled weights of evaluated terms read (set before evaluating).
        scheduled = any(callable(t.weight) and t.in_validation for t in options.loss_terms)
        self.evaluation_step = EvaluationStep() if scheduled else None
        self.saveable = TrainingState(self)  # the transforms' variables, in files
        if isinstance(options.differential_privacy, DPSGD):  # the only one on JAX
            options.differential_privacy.check_model(model, tree)
            self.privacy = privacy.PrivateGradients(
                options.differential_privacy,
                model,
                options.micro_batches,
                accumulating=options.accumulation_steps > 1,
            )

    @property
    def engine(self) -> privacy.PrivateGradients | None:
        """The DP-SGD engine (None without `differential_privacy`), as on TensorFlow."""
        return self.privacy

    def create_trackers(self) -> None:
        """One `Mean` per term, logged under the term's name (as on TensorFlow)."""
        self.term_trackers = {
            term.name: keras.metrics.Mean(name=term.name) for term, _ in self.terms
        }

    def active_terms(self, training: bool) -> list[tuple[Term, Any]]:
        """`(term, state)` pairs computed in training or in evaluation."""
        if training:
            return list(self.terms)
        return [(t, s) for t, s in self.terms if t.in_validation]

    @property
    def metrics(self) -> list[keras.metrics.Metric]:
        """The term trackers, the bound transforms' metrics, the accumulation window.

        The window logs nothing: it is a metric so that the JAX step carries
        its variables (see `backend/jax/accumulation.py`).
        """
        carried = [
            c
            for c in (self.accumulator, self.transform_variables, self.evaluation_step)
            if c is not None
        ]
        return list(self.term_trackers.values()) + self.training_only_metrics + carried

    def after_apply_hooks(self) -> list[tuple[Any, Any]]:
        """The bound `(transform, state)` pairs with an `after_apply` hook."""
        return with_hook(self.transforms, "after_apply")

    @property
    def training_only_metrics(self) -> list[keras.metrics.Metric]:
        """The transforms' and DP-SGD's metrics (e.g. `kt.LogGradientNorm`): not in evaluation."""
        engine = [] if self.privacy is None else list(self.privacy.metrics.values())
        return [m for _, s in self.transforms for m in s.metrics.values()] + engine

    def bind(self, model: keras.Model, apply: Any = None) -> list[Any]:
        """Binds the transforms (and SAM's selection) to `model`'s trainable variables once.

        With `accumulation_steps > 1` it also creates the window, whose full
        windows go through `apply` (the step's transforms and optimizer).

        Returns:
            The bound `(transform, state)` pairs.
        """
        variables = model.trainable_variables
        if self._bound_to != len(variables):
            tree = LayerTree(model)
            bound = []
            for transform in self.options.gradient_transforms:
                state = transform.bind(model, variables, tree)
                bound.append((transform, state))
            sam = self.options.sharpness_aware
            if sam is not None:
                self.sam_selected = sam.bind(model, variables, tree)
            carried = [v for _, s in bound for v in s.variables.values()]
            self.transform_variables = TransformVariables(carried) if carried else None
            steps = self.options.accumulation_steps
            if steps > 1 and apply is not None:
                self.accumulator = AccumulationWindow(model, steps, model.loss, apply)
            self.transforms, self._bound_to = bound, len(variables)
        return self.transforms

    @property
    def variables_bound(self) -> bool:
        """True once the transforms are bound to the model's trainable variables."""
        return self._bound_to is not None

    def training_state_items(self) -> list[tuple[str, keras.Variable]]:
        """`(key, variable)` of the transforms' training state, keyed as on TensorFlow.

        The keys come from `keras_tapeops.training_state.transform_state_items`,
        so a file saved on either backend restores it on the other.
        """
        return transform_state_items(self.transforms)


class TapeOpsMixin(SavingMethods, FlushingFit):
    """Mix into a Keras model (first base) to get keras_tapeops options in `compile()`.

    The JAX backend's mixin: Keras's stateless JAX step with the compiled
    gradient transforms applied to the true gradients. Options that the JAX
    step does not support yet are refused by `compile()` with their name.

    Example:
    ```python
    class Net(kt.TapeOpsMixin, keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1)

        def call(self, x):
            return self.dense(x)

    net = Net()
    net.compile(optimizer="adam", loss="mse",
                gradient_transforms=[kt.ClipByNorm(1.0)])
    net.fit(x, y)
    ```
    """

    @default_hook
    def compile(self, *args: Any, **kwargs: Any) -> None:
        """Stock `compile()` plus the keras_tapeops options JAX supports.

        Args:
            *args, **kwargs: everything stock `keras.Model.compile` takes.
            gradient_transforms: list of `kt.GradientTransform`, applied in
                order to the true (unscaled, all-reduced) gradients.
            micro_batches: int >= 1; every batch's gradient is computed in
                this many rematerialized forward passes (one optimizer step).
            accumulation_steps: int >= 1; this many consecutive batches make
                one optimizer step (a window cut short by the epoch's end is
                applied before validation).
            batch_norm_updates: `"per_micro_batch"` (needed on JAX when
                the model has BatchNormalization layers and
                `micro_batches > 1`).
            sharpness_aware: None or a `kt.SAM`: two passes per step, the
                second at the perturbed weights.
            differential_privacy: None or a `kt.DPSGD`: per-example
                gradients by `jax.vmap`, clipped, summed, noised once per
                step (also with micro_batches and accumulation_steps: once per applied step).
            loss_terms: list of `kt.LossTerm`, `kt.ActivationPenalty` or
                your own `kt.Term`, added to the loss from the same forward
                pass and logged under their names.

        Returns:
            None. Raises ValueError naming an option the JAX step does not
            support yet, before changing anything.
        """
        kwargs = dict(kwargs)
        options = pop_jax_options(kwargs)
        loss = kwargs.get("loss", args[1] if len(args) > 1 else None)
        check_compile_loss(options, loss)
        if options.differential_privacy is not None:
            privacy.check_losses(loss)
        state = JaxModelState(self, options)  # binds the terms: raises before compiling
        super().compile(*args, **kwargs)
        state.create_trackers()
        self._tapeops = options
        self._tapeops_state = state

    def fit(self, *args: Any, **kwargs: Any) -> keras.callbacks.History:
        """Stock `fit()`; with `SkipNonFinite(max_consecutive=...)` it can stop with an error.

        The check runs between steps (`backend/jax/stops.py`): its callback
        runs first, before the user's. Everything else is `FlushingFit.fit`.
        """
        if stops.stops_requested(self.tapeops_options):
            args, kwargs = add_callbacks_first(
                self,
                args,
                kwargs,
                [stops.ConsecutiveSkipsStop()],
                "With kt.SkipNonFinite(max_consecutive=...) on JAX",
            )
        return super().fit(*args, **kwargs)

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        """Stock `evaluate()` (also `fit`'s validation); scheduled term weights read the step.

        With a term whose weight is a schedule and `in_validation=True`, the
        optimizer's current step is copied into a variable the evaluation
        step carries (it has no optimizer state), as TensorFlow's reads
        `optimizer.iterations`.
        """
        self._set_evaluation_step()
        return super().evaluate(*args, **kwargs)

    def test_on_batch(self, *args: Any, **kwargs: Any) -> Any:
        """Stock `test_on_batch()`; scheduled term weights read the step (see `evaluate`)."""
        self._set_evaluation_step()
        return super().test_on_batch(*args, **kwargs)

    def _set_evaluation_step(self) -> None:
        state = self.tapeops_state
        if state is not None and state.evaluation_step is not None and self.optimizer is not None:
            iterations = ops.convert_to_numpy(self.optimizer.iterations)
            state.evaluation_step.step.assign(float(iterations))

    def train_on_batch(self, *args: Any, **kwargs: Any) -> Any:
        """Stock `train_on_batch()`; with `SkipNonFinite(max_consecutive=...)` it can raise.

        As in `fit` (`backend/jax/stops.py`): the count is checked after the
        step, and a count left at the limit by a stop is lowered first.
        """
        if not stops.stops_requested(self.tapeops_options):
            return super().train_on_batch(*args, **kwargs)
        stops.resume(self)
        result = super().train_on_batch(*args, **kwargs)
        stops.raise_if_stopped(self)
        return result

    @property
    def tapeops_options(self) -> TapeOpsOptions | None:
        """The validated keras_tapeops options of the last `compile()` (or None)."""
        return getattr(self, "_tapeops", None)

    @property
    def tapeops_state(self) -> JaxModelState | None:
        """This model's `JaxModelState` (or None before `compile()`)."""
        return getattr(self, "_tapeops_state", None)

    @property
    def metrics(self) -> list[keras.metrics.Metric]:
        """Stock metrics, then the loss terms' trackers."""
        metrics = super().metrics
        state = self.tapeops_state
        if state is not None and self.compiled:
            metrics = metrics + state.metrics
        return metrics

    def build_tapeops(self) -> JaxModelState | None:
        """Binds this model's state to its variables once they exist; returns it."""
        self._tapeops_bind()
        return self.tapeops_state

    def _tapeops_changes_step(self) -> bool:
        options = self.tapeops_options
        has_transforms = options is not None and bool(options.gradient_transforms)
        split = options is not None and (options.micro_batches > 1 or options.accumulates)
        sam = options is not None and options.sharpness_aware is not None
        private = options is not None and options.differential_privacy is not None
        return (
            has_transforms
            or private
            or split
            or sam
            or self._tapeops_changes_loss(training=True)
            or overrides(self, "transform_gradients")
        )

    def _tapeops_changes_loss(self, training: bool) -> bool:
        state = self.tapeops_state
        has_terms = state is not None and bool(state.active_terms(training))
        return has_terms or overrides(self, "compute_terms")

    def _loss_function(self, training: bool) -> jax_loss.LossFunction:
        """`f(trainable, non_trainable, metrics, x, y, sample_weight, optimizer_vars)`.

        Keras's own `compute_loss_and_updates`, or, with loss terms or
        `micro_batches > 1` (training), `backend/jax/loss.py`'s loss over
        the forward pass or the micro-batch scan. Its aux output ends with
        the terms' weighted values and the outputs' Keras masks.
        """
        options = self.tapeops_options
        split = training and options is not None and options.micro_batches > 1
        if not split and not self._tapeops_changes_loss(training):

            def stock(trainable, non_trainable, metrics, x, y, sample_weight, optimizer_vars):
                loss, aux = self.compute_loss_and_updates(
                    trainable,
                    non_trainable,
                    metrics,
                    x,
                    y,
                    sample_weight,
                    training=training,
                    optimizer_variables=optimizer_vars,
                )
                return loss, (*aux, [], jax_loss.output_masks(aux[1]))

            return stock
        k, merge = 1, None
        if split and options is not None:
            k = options.micro_batches
            if options.batch_norm_updates == "large_batch":
                merge = micro_batches.LargeBatchStatistics(self)
        forward = jax_loss.stateless_forward(self, training)
        terms = self.tapeops_state.active_terms(training) if self.tapeops_state else []
        return jax_loss.loss_function(self, forward, terms, training, micro_batches=k, merge=merge)

    def make_train_function(self, force: bool = False) -> Any:
        """Binds the transforms (their metrics join the JAX state), then Keras's."""
        self._tapeops_bind()
        super().make_train_function(force)
        function = _restoring_state_on_error(self, getattr(self, "train_function"))
        self.train_function = function
        return function

    def make_test_function(self, force: bool = False) -> Any:
        """Binds the transforms (their metrics join the JAX state), then Keras's."""
        self._tapeops_bind()
        super().make_test_function(force)
        function = _restoring_state_on_error(self, getattr(self, "test_function"))
        self.test_function = function
        return function

    def _tapeops_bind(self) -> None:
        state = self.tapeops_state
        if state is not None and self.built:
            state.bind(self, self._apply_window)
            state.saveable.restore_pending()  # training state loaded before binding

    def _log(self, metrics_vars, loss, x, y, y_pred, sample_weight, values, training):
        """Term trackers, then Keras's own loss tracker and compiled metrics."""
        if values:
            trackers = self.tapeops_state.term_trackers
            names = [term.name for term, _ in self.tapeops_state.active_terms(training)]
            metrics_vars = jax_loss.update_term_trackers(
                self, metrics_vars, [trackers[name] for name in names], values, static_batch_size(x)
            )
        logs, metrics_vars = jax_trainer.update_metrics_variables(
            self, metrics_vars, loss, x, y, y_pred, sample_weight
        )
        if not training:
            logs = self._without_training_only(logs)
        return logs, metrics_vars

    def _without_training_only(self, logs: dict[str, Any]) -> dict[str, Any]:
        """Evaluation logs without what only a training step computes.

        A term with `in_validation=False` and the transforms' metrics (as
        gradient norms) are not updated in evaluation: no `val_<name>`.
        """
        state = self.tapeops_state
        if state is None:
            return logs
        logs = dict(logs)
        for term, _ in state.terms:
            if not term.in_validation:
                logs.pop(term.name, None)
        for metric in state.training_only_metrics:
            logs.pop(metric.name, None)
        return logs

    @default_hook
    def train_step(self, state: Any, data: Any) -> tuple[dict[str, Any], Any]:
        """The stateless JAX step: `(logs, new_state)` for one batch.

        Args:
            state: `(trainable, non_trainable, optimizer, metrics)` variable values.
            data: the batch.

        Returns:
            `(logs, state)` as Keras's JAX trainer expects.
        """
        if not self._tapeops_changes_step():
            return super().train_step(state, data)  # the stock step, exactly
        trainable, non_trainable, optimizer_vars, metrics_vars = state
        statistics = non_trainable  # put back if a gate skips the step
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        engine = self.tapeops_state.privacy if self.tapeops_state is not None else None
        if engine is not None:
            scale = self._loss_scale(optimizer_vars)
            if scale is not None:
                scale = ops.cast(scale, "float32")
            grads, unscaled_loss, y_pred, non_trainable, metrics_vars = engine.gradients(
                self,
                jax_loss.stateless_forward(self, training=True),
                (trainable, non_trainable, metrics_vars, optimizer_vars),
                scale,
                x,
                y,
                sample_weight,
            )
            if scale is not None:  # the rest of the step expects scaled gradients
                grads = [g * ops.cast(scale, g.dtype) for g in grads]
            values: list[Any] = []
            masks: list[Any] = []  # DP-SGD refuses masked outputs
        else:
            grad_fn = jax.value_and_grad(self._loss_function(training=True), has_aux=True)
            (_, aux), grads = grad_fn(
                trainable, non_trainable, metrics_vars, x, y, sample_weight, optimizer_vars
            )
            unscaled_loss, y_pred, non_trainable, metrics_vars, values, masks = aux
        if self.tapeops_options is not None and self.tapeops_options.sharpness_aware is not None:
            grads = self._sharpness_aware_gradients(
                grad_fn, grads, (trainable, non_trainable, metrics_vars, optimizer_vars), data
            )
        window = self.tapeops_state.accumulator if self.tapeops_state is not None else None
        if engine is not None and engine.accumulating and window is None:
            # The engine left the noise to the window's step: never apply without it.
            raise RuntimeError(
                "DPSGD with accumulation_steps on JAX has no accumulation window bound "
                "(the step would apply gradients without noise); call fit() or "
                "make_train_function() first."
            )
        if window is not None:
            weight = window.batch_normalizer(
                self, (trainable, non_trainable), x, sample_weight, y_pred, masks
            )
            trainable, optimizer_vars, metrics_vars = window.step(
                self,
                grads,
                static_batch_size(x),
                weight,
                list(trainable),
                optimizer_vars,
                metrics_vars,
            )
        else:
            trainable, optimizer_vars, metrics_vars, keep = self._apply_gradients(
                list(grads), list(trainable), optimizer_vars, metrics_vars
            )
            if keep is not None:  # a skipped step keeps the moving statistics too
                non_trainable = [
                    ops.where(keep, new, old) for new, old in zip(non_trainable, statistics)
                ]
        logs, metrics_vars = self._log(
            metrics_vars, unscaled_loss, x, y, y_pred, sample_weight, values, training=True
        )
        return logs, (trainable, non_trainable, optimizer_vars, metrics_vars)

    @default_hook
    def test_step(self, state: Any, data: Any) -> tuple[dict[str, Any], Any]:
        """The stateless JAX evaluation step, with the `in_validation` loss terms.

        Args:
            state: `(trainable, non_trainable, metrics)` variable values.
            data: the batch.

        Returns:
            `(logs, state)` as Keras's JAX trainer expects.
        """
        if not self._tapeops_changes_loss(training=False):
            logs, state = super().test_step(state, data)  # the stock step, exactly
            return self._without_training_only(logs), state
        trainable, non_trainable, metrics_vars = state
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        _, aux = self._loss_function(training=False)(
            trainable,
            non_trainable,
            metrics_vars,
            x,
            y,
            sample_weight,
            self._evaluation_step_of(metrics_vars),
        )
        loss, y_pred, non_trainable, metrics_vars, values, _ = aux
        logs, metrics_vars = self._log(
            metrics_vars, loss, x, y, y_pred, sample_weight, values, training=False
        )
        return logs, (trainable, non_trainable, metrics_vars)

    def _evaluation_step_of(self, metrics_vars: Sequence[Any]) -> Any:
        """`[(optimizer.iterations, its value in evaluation)]`, or None without a schedule.

        What the evaluation step maps the optimizer's step counter to (the
        carried `EvaluationStep`), in place of the optimizer state it lacks.
        """
        state = self.tapeops_state
        if state is None or state.evaluation_step is None or self.optimizer is None:
            return None
        index = [id(v) for v in self.metrics_variables].index(id(state.evaluation_step.step))
        iterations = self.optimizer.iterations
        return [(iterations, ops.cast(metrics_vars[index], iterations.dtype))]

    @default_hook
    def compute_terms(self, terms: Sequence[tuple[Term, Any]], context: TermContext) -> list[Any]:
        """Returns `weight * value` (float32 scalar) of each term, in order.

        Override to add terms computed from `context` without a Term class:
        call `super()` and append scalars; the first `len(terms)` values are
        logged under the terms' names, any extra value is only added to the
        loss. On JAX it runs inside a `keras.StatelessScope`: reading the
        model's weights gives this step's values.

        Args:
            terms: the active `(kt.Term, state)` pairs.
            context: the step's `kt.TermContext`.

        Returns:
            A list of float32 scalars.
        """
        step = self.optimizer.iterations if self.optimizer is not None else 0
        return weighted_term_values(terms, context, step)

    def _sharpness_aware_gradients(self, grad_fn, grads, state, data):
        """SAM's second pass: the gradient at the perturbed weights (see `kt.SAM`).

        The perturbation `e` comes from the first pass's true gradients
        (unscaled under mixed precision; the global batch's under
        `DataParallel`); the second pass runs from the first pass's
        non-trainable state and what it updates (moving statistics,
        metrics, term trackers) is dropped: nothing is logged twice.
        The optimizer then applies the second gradient to the unperturbed
        weights.
        """
        trainable, non_trainable, metrics_vars, optimizer_vars = state
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        scale = self._loss_scale(optimizer_vars)
        true = list(grads)
        if scale is not None:
            true = [g if g is None else g / ops.cast(scale, g.dtype) for g in true]
        tapeops_state = self.tapeops_state
        self._tapeops_bind()
        perturbation = self.tapeops_options.sharpness_aware.perturbation(
            true, list(trainable), tapeops_state.sam_selected
        )
        perturbed = [w if e is None else w + e for w, e in zip(trainable, perturbation)]
        _, second = grad_fn(
            perturbed, non_trainable, metrics_vars, x, y, sample_weight, optimizer_vars
        )
        return second

    def _apply_window(self, grads, trainable, optimizer_vars, metrics_vars, samples):
        """An accumulation window's step: DP-SGD's noise first (if any), then `_apply_gradients`.

        Returns `(trainable, optimizer_vars, metrics_vars)`.
        """
        engine = self.tapeops_state.privacy if self.tapeops_state is not None else None
        if engine is not None:
            scale = self._loss_scale(optimizer_vars)
            grads, metrics_vars = engine.finish_window(
                self, grads, samples, scale, (trainable, optimizer_vars, metrics_vars)
            )
        return self._apply_gradients(grads, trainable, optimizer_vars, metrics_vars)[:3]

    def _apply_gradients(self, grads, trainable, optimizer_vars, metrics_vars):
        """The transforms on the true gradients, then the optimizer (stateless).

        A gate (`keep_step`, e.g. `kt.SkipNonFinite`) that says False skips
        the step: weights and optimizer state stay as they were (under a
        LossScaleOptimizer the step reaches it as an overflow, as on
        TensorFlow).

        Returns `(trainable, optimizer_vars, metrics_vars, keep)`; `keep` is
        None without gates.
        """
        grads, metrics_vars, keep, halt = self._true_transformed(
            list(grads), list(trainable), optimizer_vars, metrics_vars
        )
        new_trainable, new_optimizer_vars = self.optimizer.stateless_apply(
            optimizer_vars, grads, trainable
        )
        if halt is not None:  # SkipNonFinite stopped training before: not even the scale moves
            going = ops.logical_not(halt)
            keep = going if keep is None else ops.logical_and(keep, going)
            new_optimizer_vars = [
                ops.where(halt, o, n) for n, o in zip(new_optimizer_vars, optimizer_vars)
            ]
        if keep is not None and not isinstance(
            self.optimizer, keras.optimizers.LossScaleOptimizer
        ):  # a LossScaleOptimizer skips it itself (an overflow)
            new_trainable = [ops.where(keep, n, o) for n, o in zip(new_trainable, trainable)]
            new_optimizer_vars = [
                ops.where(keep, n, o) for n, o in zip(new_optimizer_vars, optimizer_vars)
            ]
        metrics_vars = self._after_apply(new_trainable, trainable, new_optimizer_vars, metrics_vars)
        return new_trainable, new_optimizer_vars, metrics_vars, keep

    def _after_apply(self, new_values, old_values, optimizer_vars, metrics_vars):
        """Runs the bound transforms' `after_apply` hooks on the step's new values.

        `previous` holds the selected variables' values before the step for
        a transform with `needs_previous_values` (e.g. `kt.LogUpdateRatio`);
        what the hooks log is updated statelessly. Returns `metrics_vars`.
        """
        state = self.tapeops_state
        hooked = [] if state is None else state.after_apply_hooks()
        if not hooked:
            return metrics_vars
        optimizer_state = list(zip(self.optimizer.variables, optimizer_vars))
        with jax_loss.updating_metrics(self, metrics_vars, optimizer_state) as metrics_vars:
            after_apply_in_order(hooked, new_values, old_values)
        return metrics_vars

    def _loss_scale(self, optimizer_vars):
        """The factor the loss was multiplied by in this step (`jax_loss.loss_scale`), or None."""
        return jax_loss.loss_scale(self.optimizer, optimizer_vars)

    def _true_transformed(self, grads, values, optimizer_vars, metrics_vars):
        """Unscales (mixed precision, a static `loss_scale_factor`), transforms, rescales.

        Returns `(grads, metrics_vars, keep, halt)`: the transforms' metrics
        (a `kt.LogGradientNorm`) and training state (carried as metric
        variables) are updated statelessly; `keep` is the AND of the gates'
        decisions on the true gradients (None without gates); `halt` is True
        once a `SkipNonFinite(max_consecutive)` stopped training (None
        without one; `backend/jax/stops.py`).

        The unscaling, the overflow rule and the rescaling are
        `backend/jax/true_gradients.true_transformed`'s.
        """
        scale = self._loss_scale(optimizer_vars)
        optimizer_state = list(zip(self.optimizer.variables, optimizer_vars))
        with jax_loss.updating_metrics(self, metrics_vars, optimizer_state) as metrics_vars:
            halt = stops.halted(self)  # the count before this step's gates
            new_grads, keep = true_transformed(
                self.optimizer, scale, grads, values, self._keep_step, self.transform_gradients
            )
        return new_grads, metrics_vars, keep, halt

    def _keep_step(self, grads, values):
        """The AND of the bound gates' `keep_step` decisions, or None without gates."""
        state = self.tapeops_state
        if state is None:
            return None
        return keep_step_decision(state.bind(self), grads, values)

    @default_hook
    def transform_gradients(self, grads: Sequence[Any], variables: Sequence[Any]) -> list[Any]:
        """Applies the compiled gradient transforms in list order.

        Override in a subclass to change gradients without rewriting the step.

        Args:
            grads: list of true gradients (unscaled, all-reduced), one per
                trainable variable.
            variables: the trainable variables' current values (arrays, in
                the same order; the JAX step is stateless).

        Returns:
            The list of transformed gradients.
        """
        state = self.tapeops_state
        if state is None:
            return list(grads)
        bound = state.bind(self)
        if not bound:
            return list(grads)
        return apply_in_order(bound, grads, variables)


TapeOpsMixin.compile.__signature__ = compile_signature(TapeOpsMixin.compile)


def _restoring_state_on_error(model: keras.Model, function: Any) -> Any:
    """`function(state, data)` that puts `state` back into the variables if it raises.

    Keras's JAX `fit`/`evaluate` detach the variables' values while an
    epoch runs and pass them to the step as `state`; a step that raises
    while it is traced (a refusal by name, a shape error) would leave the
    model without its weights. This wrapper reattaches the values the step
    received, so a refused option changes nothing. (Buffers already donated
    to a step that ran are left alone.)
    """
    if function is None or getattr(function, "_tapeops_restores", False):
        return function

    def groups() -> list[list[Any]]:
        # The state's layout: (trainable, non_trainable[, optimizer], metrics).
        out = [model.trainable_variables, model.non_trainable_variables]
        return out + [model.optimizer.variables] if model.optimizer is not None else out

    def guarded(state: Any, data: Any) -> Any:
        try:
            return function(state, data)
        except Exception:
            references = groups()
            if len(state) == 3:  # the test step carries no optimizer state
                references = references[:2]
            for variables, values in zip(references + [model.metrics_variables], state):
                for variable, value in zip(variables, values):
                    deleted = getattr(value, "is_deleted", lambda: False)()
                    if not deleted:
                        variable.assign(value)
            raise

    guarded._tapeops_restores = True  # type: ignore[attr-defined]
    return guarded
