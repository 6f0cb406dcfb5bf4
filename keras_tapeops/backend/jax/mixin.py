"""`TapeOpsMixin` on JAX: the stock stateless JAX step plus the gradient transforms.

train_step(state, data): unpack -> `jax.value_and_grad` of Keras's own
`compute_loss_and_updates` (forward, compiled loss, loss scaling; with
`micro_batches` the forward pass is the micro-batch scan) -> true
gradients (unscaled under mixed precision) -> transform_gradients -> the
optimizer's `stateless_apply` -> metrics. Under
`keras.distribution.DataParallel` the gradient of the global batch is
already the all-reduced one, so the transforms see the true gradients as on
TensorFlow. With no option the step is Keras's own.
"""

from __future__ import annotations

from typing import Any
from typing import Sequence

import functools

import jax
import keras
from keras import ops

from keras_tapeops._keras import jax_trainer
from keras_tapeops.backend.jax import micro_batches
from keras_tapeops.backend.jax.options import check_bound_state
from keras_tapeops.backend.jax.options import pop_jax_options
from keras_tapeops.hook_overrides import default_hook
from keras_tapeops.hook_overrides import overrides
from keras_tapeops.options import TapeOpsOptions
from keras_tapeops.options import compile_signature
from keras_tapeops.paths import LayerTree
from keras_tapeops.saving import SavingMethods
from keras_tapeops.transforms.base import apply_in_order


class JaxModelState:
    """What one model resolved from its options on JAX: the bound transforms.

    Args:
        options: the model's `TapeOpsOptions`.
    """

    saveable = None  # no training state on JAX yet (stateful transforms are refused)

    def __init__(self, options: TapeOpsOptions) -> None:
        self.options = options
        self.transforms: list[Any] = []
        self._bound_to: int | None = None

    def bind(self, model: keras.Model) -> list[Any]:
        """Binds the transforms to `model`'s trainable variables once; returns them."""
        variables = model.trainable_variables
        if self._bound_to != len(variables):
            tree = LayerTree(model)
            bound = []
            for transform in self.options.gradient_transforms:
                state = transform.bind(model, variables, tree)
                check_bound_state(transform, state)
                bound.append((transform, state))
            self.transforms, self._bound_to = bound, len(variables)
        return self.transforms

    def training_state_items(self) -> list[Any]:
        """No training state on JAX (see `keras_tapeops.saving`)."""
        return []


class TapeOpsMixin(SavingMethods):
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
            batch_norm_updates: `"per_micro_batch"` (needed on JAX when
                the model has BatchNormalization layers and
                `micro_batches > 1`).

        Returns:
            None. Raises ValueError naming an option the JAX step does not
            support yet, before changing anything.
        """
        kwargs = dict(kwargs)
        options = pop_jax_options(kwargs)
        if self.built:
            micro_batches.check_batch_norm(self, options.micro_batches, options.batch_norm_updates)
        super().compile(*args, **kwargs)
        self._tapeops = options
        self._tapeops_state = JaxModelState(options)

    @property
    def tapeops_options(self) -> TapeOpsOptions | None:
        """The validated keras_tapeops options of the last `compile()` (or None)."""
        return getattr(self, "_tapeops", None)

    @property
    def tapeops_state(self) -> JaxModelState | None:
        """This model's `JaxModelState` (or None before `compile()`)."""
        return getattr(self, "_tapeops_state", None)

    def _tapeops_changes_step(self) -> bool:
        options = self.tapeops_options
        has_transforms = options is not None and bool(options.gradient_transforms)
        split = options is not None and options.micro_batches > 1
        return has_transforms or split or overrides(self, "transform_gradients")

    def _loss_and_updates(self) -> Any:
        """`f(trainable, non_trainable, metrics, x, y, sample_weight, optimizer_vars)`.

        Keras's own `compute_loss_and_updates` in training mode, or, with
        `micro_batches > 1`, the same loss over the micro-batch scan.
        """
        options = self.tapeops_options
        if options is None or options.micro_batches <= 1:

            def stock(trainable, non_trainable, metrics, x, y, sample_weight, optimizer_vars):
                return self.compute_loss_and_updates(
                    trainable,
                    non_trainable,
                    metrics,
                    x,
                    y,
                    sample_weight,
                    training=True,
                    optimizer_variables=optimizer_vars,
                )

            return stock
        micro_batches.check_batch_norm(self, options.micro_batches, options.batch_norm_updates)
        forward = micro_batches.micro_batch_forward(self, options.micro_batches)
        return functools.partial(jax_trainer.compute_loss_and_updates, self, forward)

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
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        grad_fn = jax.value_and_grad(self._loss_and_updates(), has_aux=True)
        (_, aux), grads = grad_fn(
            trainable, non_trainable, metrics_vars, x, y, sample_weight, optimizer_vars
        )
        unscaled_loss, y_pred, non_trainable, metrics_vars = aux
        grads = self._true_transformed(list(grads), list(trainable), optimizer_vars)
        trainable, optimizer_vars = self.optimizer.stateless_apply(optimizer_vars, grads, trainable)
        logs, metrics_vars = jax_trainer.update_metrics_variables(
            self, metrics_vars, unscaled_loss, x, y, y_pred, sample_weight
        )
        return logs, (trainable, non_trainable, optimizer_vars, metrics_vars)

    def _true_transformed(self, grads, values, optimizer_vars):
        """Unscales (mixed precision), transforms, and rescales the gradients.

        The LossScaleOptimizer divides by its scale again in `stateless_apply`
        and skips a non-finite step, as on TensorFlow; the scale is a power
        of two, so unscaling and rescaling are exact.
        """
        scale = None
        if isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer):
            mapping = list(zip(self.optimizer.variables, optimizer_vars))
            with keras.StatelessScope(state_mapping=mapping):
                scale = ops.convert_to_tensor(self.optimizer.dynamic_scale)
            grads = [g if g is None else g / ops.cast(scale, g.dtype) for g in grads]
        grads = self.transform_gradients(grads, values)
        if scale is not None:
            grads = [g if g is None else g * ops.cast(scale, g.dtype) for g in grads]
        return grads

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
