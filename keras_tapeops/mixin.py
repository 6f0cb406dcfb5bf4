"""`TapeOpsMixin`: the keras_tapeops training step as a pipeline of hooks.

train_step:  unpack -> compute_gradients (forward in tape, loss + terms, track,
             scale, gradient; split into micro-batches if asked)
             -> update_weights (accumulate across batches if asked)
             -> apply_optimizer_step (aggregate -> transform_gradients -> apply)
             -> compute_metrics
test_step:   unpack -> compute_total_loss (forward, loss + terms, track)
             -> compute_metrics

With no keras_tapeops option every hook reduces to the stock Keras step.
"""

from __future__ import annotations

import warnings
from typing import Any
from typing import Callable
from typing import ContextManager
from typing import Sequence
from typing import cast

import keras
import tensorflow as tf

from keras_tapeops import accumulation
from keras_tapeops import adversarial_training
from keras_tapeops import forward
from keras_tapeops import groups
from keras_tapeops import name_checks
from keras_tapeops import sam_step
from keras_tapeops import step_gate
from keras_tapeops import step_watch
from keras_tapeops import true_gradients
from keras_tapeops._keras import private
from keras_tapeops.custom_step import CustomStepMethods
from keras_tapeops.hook_overrides import default_hook
from keras_tapeops.model_metrics import MetricsMethods
from keras_tapeops.saving import SavingMethods
from keras_tapeops.step_functions import StepFunctionMethods
from keras_tapeops.hook_overrides import overrides
from keras_tapeops.optimizer_checks import check_optimizer_conflicts
from keras_tapeops.options import TapeOpsOptions
from keras_tapeops.options import compile_signature
from keras_tapeops.replicas import batch_size
from keras_tapeops.state import ModelState
from keras_tapeops.terms.base import Term
from keras_tapeops.terms.base import TermContext
from keras_tapeops.terms.base import weighted_term_values
from keras_tapeops.transforms.base import apply_in_order
from keras_tapeops.typing_aliases import Gradient
from keras_tapeops.typing_aliases import Nested


class TapeOpsMixin(SavingMethods, MetricsMethods, StepFunctionMethods, CustomStepMethods):
    """Mix into a Keras model (first base) to get keras_tapeops options in `compile()`.

    The mixin is a plain class, not a `keras.Model`, so Keras can still build
    functional models from a class that lists it before `keras.Model`.

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

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # A base class's own train_step/test_step is kept, not replaced.
        step_watch.keep_own_steps(cls, TapeOpsMixin)

    # ------------------------------------------------------------------ compile
    @default_hook
    def compile(self, *args: Any, **kwargs: Any) -> None:
        """Stock `compile()` plus the keras_tapeops options.

        The options are the rows of `keras_tapeops.options.OPTIONS` (this
        method's signature is built from that table), all keyword-only.

        Args:
            *args, **kwargs: everything stock `keras.Model.compile` takes.
            gradient_transforms: list of `kt.GradientTransform`, applied in
                order to the true (unscaled, replica-aggregated) gradients.
            loss_terms: list of loss terms added inside the training tape.
            micro_batches: split every batch into this many micro-batches.
            accumulation_steps: batches per optimizer step.
            batch_norm_updates: `"large_batch"` or `"per_micro_batch"`: how
                BatchNormalization moving statistics follow `micro_batches`.
            sharpness_aware: None or a `kt.SAM`: sharpness-aware
                minimization (two forward/backward passes per step).
            task_balancing: None or a multi-task aggregator or loss
                weighting (e.g. `kt.PCGrad(shared="trunk/*")`).
            differential_privacy: None or a `kt.DPSGD`.
            sample_selection: None or a loss-based selection (e.g.
                `kt.TopLoss(fraction=0.25)`).
            adversarial_training: None or a `kt.attacks` attack: the step
                trains on the attacked inputs only (Madry et al.).

        Returns:
            None. Raises before changing anything if an option is invalid.
        """
        kwargs = dict(kwargs)
        options = TapeOpsOptions.pop_from(kwargs)
        optimizer = kwargs.get("optimizer", args[0] if args else None)
        check_optimizer_conflicts(optimizer, options)
        groups.check_reused_optimizer(self, optimizer)
        accumulation.check_compile_loss(
            options, kwargs.get("loss", args[1] if len(args) > 1 else None)
        )
        # Resolve everything against this model before touching the previous
        # compilation: a bad option leaves the model as it was.
        state = ModelState(self, options)
        state.check_names_against(
            name_checks.compile_arg_names(args, kwargs),
            "a metric or loss passed to compile()",
        )
        super().compile(*args, **kwargs)
        state.create_trackers()
        # Plain object attributes: Keras's tracker ignores them, so the term
        # and transform metrics are listed once, through `metrics` below, and
        # the options' variables are not weights (see `_tapeops_training_state`).
        self._tapeops = options
        self._tapeops_state = state

    @property
    def tapeops_options(self) -> TapeOpsOptions | None:
        """The validated keras_tapeops options of the last `compile()` (or None)."""
        return getattr(self, "_tapeops", None)

    @property
    def tapeops_state(self) -> ModelState | None:
        """This model's `ModelState`: what it resolved from its options (or None)."""
        return getattr(self, "_tapeops_state", None)

    def build_tapeops(self) -> ModelState | None:
        """Binds this model's state to its variables once they exist; returns it.

        Called before the first step (`make_train_function`) and inside the
        first traced step, after the forward pass has built a lazily built
        model. Returns None for a model compiled without the mixin's compile.
        """
        state = self.tapeops_state
        if state is not None and self.built:
            state.bind_variables(self)
            state.saveable.restore_pending()
        return state

    # -------------------------------------------------------------- the steps
    @default_hook
    def train_step(self, data: Nested) -> dict[str, Any]:
        step_watch.mark_step_ran(self)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        state = self.build_tapeops()
        self._check_logged_names_before_forward(data)
        x = adversarial_training.adversarial_inputs(self, x, y)
        statistics = step_gate.batch_norm_snapshot(self, state)
        grads, y_pred = self.compute_gradients(x, y, sample_weight)
        self.build_tapeops()  # binds now if the forward pass built the model
        self._check_logged_names(y, y_pred)
        if self.trainable_weights:
            keep = self.update_weights(grads, batch_size(x))
            step_gate.restore_unless(keep, statistics)
        else:
            warnings.warn("The model does not have any trainable weights.")
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    @default_hook
    def test_step(self, data: Nested) -> dict[str, Any]:
        step_watch.mark_step_ran(self)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        self.build_tapeops()
        self._check_logged_names_before_forward(data)
        _, y_pred = self.compute_total_loss(x, y, sample_weight, training=False)
        self._check_logged_names(y, y_pred)
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    # ------------------------------------------------------------------ hooks
    def compute_gradients(
        self, x: Nested, y: Nested, sample_weight: Nested
    ) -> tuple[list[Gradient], Nested]:
        """Returns `(gradients, y_pred)` for one batch (split if `micro_batches`).

        Gradients are those of the optimizer-scaled loss, per replica, one per
        trainable variable.
        """
        options = self.tapeops_options

        def gradient_pass():
            if options is not None and options.accumulation_steps > 1:
                return accumulation.window_gradients(self, x, y, sample_weight)
            if options is not None and options.micro_batches > 1:
                return accumulation.micro_batch_gradients(
                    self, x, y, sample_weight, options.micro_batches
                )
            return self.batch_gradients(x, y, sample_weight)

        if options is not None and options.sharpness_aware is not None:
            return sam_step.sharpness_aware_gradients(
                self,
                options.sharpness_aware,
                # Compiled with the mixin's compile, so the state exists.
                lambda: cast(ModelState, self.build_tapeops()).sam_selected,
                gradient_pass,
            )
        return gradient_pass()

    def tapeops_unlogged(self) -> ContextManager[None]:
        """Forward passes traced inside this block update no loss or term tracker.

        Used for SAM's second pass: the step logs the loss at the weights,
        not at the perturbed point.
        """
        return self._flag_set("_tapeops_logging", False)

    def batch_gradients(
        self,
        x: Nested,
        y: Nested,
        sample_weight: Nested,
        loss_multiplier: tf.Tensor | float | None = None,
    ) -> tuple[list[Gradient], Nested]:
        """One (micro-)batch's gradient pass: returns `(gradients, y_pred)`.

        With a multi-gradient option (`task_balancing`,
        `differential_privacy`, `sample_selection`) its engine computes the
        rows and reduces them; otherwise `single_pass_gradients`.

        Args:
            x, y, sample_weight: the (micro-)batch.
            loss_multiplier: optional scalar the loss is multiplied by before
                differentiation (after logging), e.g. `n_micro / n_batch`.
        """
        state = self.tapeops_state
        engine = state.engine if state is not None else None
        if engine is not None:
            engine.check_batch(self, x, y, sample_weight)
            return engine.batch_gradients(self, x, y, sample_weight, loss_multiplier)
        return self.single_pass_gradients(x, y, sample_weight, loss_multiplier)

    def single_pass_gradients(
        self,
        x: Nested,
        y: Nested,
        sample_weight: Nested,
        loss_multiplier: tf.Tensor | float | None = None,
    ) -> tuple[list[Gradient], Nested]:
        """One forward/backward pass of the total loss: `(gradients, y_pred)`.

        Args:
            x, y, sample_weight: the (micro-)batch.
            loss_multiplier: optional scalar the loss is multiplied by before
                differentiation (after logging).
        """
        with tf.GradientTape() as tape:
            loss, y_pred = self.compute_total_loss(x, y, sample_weight, training=True)
            if loss_multiplier is not None:
                loss = loss * tf.cast(loss_multiplier, loss.dtype)
            if self.optimizer is not None:
                loss = self.optimizer.scale_loss(loss)
        grads = tape.gradient(loss, self.trainable_weights)
        return grads, y_pred

    def compute_total_loss(
        self, x: Nested, y: Nested, sample_weight: Nested, training: bool
    ) -> tuple[tf.Tensor, Nested]:
        """Forward pass, `compute_loss` plus loss terms, and loss logging.

        Also a building block for a custom `train_step` (see
        `keras_tapeops.custom_step`): it logs the loss and the terms.

        Returns:
            `(loss, y_pred)`: the replica-scaled total loss (not yet
            optimizer-scaled) and the model's outputs.
        """
        if not training:  # a custom train step is marked by apply_gradients_with_options
            step_watch.mark_step_ran(self)
        return forward.forward_and_loss(
            self,
            x,
            y,
            sample_weight,
            training,
            self.compute_terms,
            log=self._tapeops_logging,
        )

    @default_hook
    def compute_terms(
        self, terms: Sequence[tuple[Term, Any]], context: TermContext
    ) -> list[tf.Tensor]:
        """Returns `weight * value` (float32 scalar) of each term, in order.

        Called on every step, also when no term is compiled (`terms` empty).
        Override to add terms computed from `context` without a Term class:
        call `super()` and append scalars; the first `len(terms)` values are
        logged under the terms' names, any extra value is only added to the
        loss (and so to the logged `loss`).

        Args:
            terms: the active `(kt.Term, state)` pairs (training, or
                `in_validation` ones); `state` is what the term's
                `bind(model)` returned for this model.
            context: the step's `kt.TermContext`.

        Returns:
            A list of float32 scalars.

        Example:
        ```python
        class Net(kt.TapeOpsMixin, keras.Model):
            def compute_terms(self, terms, context):
                values = super().compute_terms(terms, context)
                return values + [0.1 * keras.ops.mean(context.y_pred ** 2)]
        ```
        """
        step = self.optimizer.iterations if self.optimizer is not None else 0
        return weighted_term_values(terms, context, step)

    def update_weights(
        self, grads: Sequence[Gradient], n_samples: int | tf.Tensor
    ) -> tf.Tensor | None:
        """Applies `grads` now, or adds them to the cross-batch window.

        Returns:
            The step's keep decision (a scalar bool tensor) when a gating
            transform such as `kt.SkipNonFinite` decided it now, else None.
        """
        state = self.tapeops_state
        if state is not None and state.accumulator is not None:
            state.accumulator.add(self, grads, n_samples)
            return None
        return self.apply_optimizer_step(grads, self.trainable_weights)

    def apply_optimizer_step(
        self, grads: Sequence[Gradient], variables: Sequence[keras.Variable]
    ) -> tf.Tensor | None:
        """Aggregates, transforms and applies `grads` with the optimizer.

        Without gradient transforms this is the stock `apply_gradients` call.
        With them, transforms see unscaled (mixed precision) gradients summed
        over replicas (one all-reduce; the optimizer's own is skipped), and a
        non-finite step still reaches the LossScaleOptimizer as non-finite
        (see `keras_tapeops.true_gradients`).
        """
        state = self.tapeops_state
        has_transforms = state is not None and state.options.gradient_transforms
        engine = state.engine if state is not None else None
        if not has_transforms and engine is None and not self._overrides_gradient_hooks():
            self.optimizer.apply_gradients(zip(grads, variables))
            return None
        bound = state.transforms if state is not None else []
        transform: Callable[..., list[Gradient]] = self.transform_gradients
        if engine is not None:

            def finalize_then_transform(true_grads, variables):
                finalized = engine.finalize(self, true_grads, variables)
                return self.transform_gradients(finalized, variables)

            transform = finalize_then_transform
        return true_gradients.apply_transformed(
            self.optimizer,
            grads,
            variables,
            transform=transform,
            aggregate=self.aggregate_gradients,
            keep_step=step_gate.keep_step_function(bound),
            after_apply=step_gate.after_apply_function(bound, variables),
        )

    @default_hook
    def aggregate_gradients(self, grads: Sequence[Gradient]) -> tuple[list[Gradient], bool]:
        """Sums `grads` over replicas once; returns `(grads, was_reduced)`.

        Runs when gradient transforms are compiled or a subclass overrides
        `transform_gradients` or this hook; otherwise the optimizer
        all-reduces as in stock Keras.
        """
        return true_gradients.sum_over_replicas(grads)

    def _overrides_gradient_hooks(self):
        return overrides(self, "transform_gradients") or overrides(self, "aggregate_gradients")

    @default_hook
    def transform_gradients(
        self, grads: Sequence[Gradient], variables: Sequence[keras.Variable]
    ) -> list[Gradient]:
        """Applies the compiled gradient transforms in list order.

        Override in a subclass to change gradients without rewriting the step:
        the override sees true gradients (unscaled, summed over replicas),
        like the compiled transforms, also when none is compiled.

        Args:
            grads: list of true gradients (None and IndexedSlices allowed).
            variables: the matching trainable variables.

        Returns:
            The list of transformed gradients.
        """
        state = self.tapeops_state
        if state is None or not state.transforms:
            return list(grads)
        return apply_in_order(state.transforms, grads, variables)

    # ---------------------------------------------------------------- helpers
    def _check_logged_names_before_forward(self, data):
        """The name check, before an eager step's forward pass changes anything."""
        if name_checks.needs_eager_build(self):
            private.symbolic_build(self, data)  # builds the model too, if needed
            self.build_tapeops()
        self._check_logged_names()


TapeOpsMixin.compile.__signature__ = compile_signature(TapeOpsMixin.compile)
