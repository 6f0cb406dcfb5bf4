"""DP-SGD on JAX: per-example gradients by `jax.vmap`, clipped, summed, noised once per step.

`PrivateGradients(option, model).gradients(...)` replaces the step's single
`jax.value_and_grad` when `compile(differential_privacy=kt.DPSGD(...))`:

1. `jax.vmap` of `jax.grad` of one example's compiled loss (the model's
   stateless call on a batch of one, Keras's compiled loss with its
   per-output trackers muted, times the loss scale under mixed precision)
   gives every example's gradient over all trainable variables, in float32
   after unscaling;
2. each example's clip weight is `min(1, C / ||g_i||)` over all variables;
   an example whose data, loss or gradient is not finite gets weight 0 and
   its row is zeroed (counted in `dp_nonfinite_examples`), except under a
   LossScaleOptimizer, which must see an overflow to skip the step and lower
   its scale; rows a boolean `sample_weight` masks out get weight 0;
3. the clipped sum gets Gaussian noise of standard deviation
   `C * noise_multiplier`, drawn once per step from a key of `(seed,
   optimizer.iterations, variable index)`, is divided by the batch's number
   of rows and gets the gradient of the weight regularizers
   (data-independent: not clipped, not noised), as on TensorFlow.

Under `keras.distribution.DataParallel` the step sees the global batch, so
the per-example gradients, the noise and the division are the global ones:
two devices equal one. The TensorFlow engine (`keras_tapeops.privacy.engine`)
does the same math with ghost norms; with the noise off the two backends
agree to float32 rounding. JAX's noise comes from JAX's PRNG, so a seeded
run is reproducible on JAX but draws other noise than on TensorFlow.
"""

from __future__ import annotations

from typing import Any

import jax
import keras
from keras import ops

from keras_tapeops._keras import compile_loss as keras_loss
from keras_tapeops._keras import masking
from keras_tapeops._keras import private
from keras_tapeops.accumulation.reduction_kinds import named_losses
from keras_tapeops.backend.jax.carried import CarriedState
from keras_tapeops.backend.jax.loss import updating_metrics
from keras_tapeops.privacy import seeds
from keras_tapeops.privacy import refusals
from keras_tapeops.privacy.dpsgd import DPSGD
from keras_tapeops.split_sizes import static_batch_size

NONFINITE_METRIC = "dp_nonfinite_examples"
STEP_SAMPLES = "dp_step_samples"


class StepSamples(CarriedState):
    """The number of examples in the last step (mask entries set, or rows).

    Carried by the JAX step (nothing logged); `kt.callbacks.PrivacyBudget`
    reads it to infer the sampling rate, as the TensorFlow engine's
    `step_samples` variable.

    Example:
    ```python
    samples = StepSamples()
    samples.count   # the variable
    ```
    """

    def __init__(self) -> None:
        super().__init__(name=STEP_SAMPLES)
        self.count = self.add_variable((), "zeros", "float32", name="count")


_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean")


def check_losses(loss: Any) -> None:
    """Refuses at `compile()` a loss whose per-example value depends on the batch.

    On JAX an example's loss is the compiled loss of a batch of one, which is
    TensorFlow's per-example loss only for mean-reduced losses.

    Args:
        loss: `compile()`'s `loss` argument.
    """
    other = {name: r for name, r in named_losses(loss) if r not in _MEAN_REDUCTIONS}
    if other:
        raise ValueError(
            "On the JAX backend, DPSGD needs mean-reduced losses "
            "(reduction='sum_over_batch_size', the default): an example's "
            "loss is the compiled loss of a batch of one. Received: loss "
            f"reductions {other}"
        )


class PrivateGradients:
    """What one model resolved from a `kt.DPSGD` on JAX: its seed and its metric.

    Args:
        option: the `kt.DPSGD`.
        model: the model being compiled.
    """

    def __init__(self, option: DPSGD, model: keras.Model) -> None:
        self.option = option
        self.seed = option.seed if option.seed is not None else seeds.fresh_seed()
        self.metrics = {
            NONFINITE_METRIC: keras.metrics.Sum(name=NONFINITE_METRIC),
            STEP_SAMPLES: StepSamples(),
        }
        # As the TensorFlow engine: set (at trace time) once a batch with a
        # mask of real examples was traced; `mask_refusal` (a message set by
        # kt.callbacks.PrivacyBudget, which cannot infer the rate of masked
        # batches) refuses such a batch.
        self.saw_mask = False
        self.mask_refusal: str | None = None

    @property
    def step_samples(self) -> keras.Variable:
        """The variable holding the last step's number of examples."""
        return self.metrics[STEP_SAMPLES].count

    def gradients(
        self,
        model: keras.Model,
        forward: Any,
        state: tuple[Any, Any, Any, Any],
        scale: Any,
        x: Any,
        y: Any,
        sample_weight: Any,
    ) -> tuple[list[Any], Any, Any, Any, Any]:
        """The step's private gradient (true, float32, one per trainable variable).

        Args:
            model: the compiled model.
            forward: `forward(trainable, non_trainable, x) -> (y_pred,
                non_trainable, losses)` (the model's stateless call).
            state: `(trainable, non_trainable, metrics_vars, optimizer_vars)` values.
            scale: the LossScaleOptimizer's scale in this step (float32), or
                None without one.
            x, y, sample_weight: the batch; `sample_weight` may only be a
                boolean mask of real examples.

        Returns:
            `(grads, loss, y_pred, non_trainable, metrics_vars)`: the noisy
            mean of the clipped per-example gradients plus the regularizers'
            gradient, the loss to log (mean over rows plus regularization),
            the outputs, the non-trainable values after the forward pass,
            and the metrics values with `dp_nonfinite_examples` updated.
        """
        trainable, non_trainable, metrics_vars, optimizer_vars = state
        mask = _check_batch(model, y, sample_weight)
        if mask is not None:
            self.saw_mask = True
            if self.mask_refusal is not None:
                message, self.mask_refusal = self.mask_refusal, None
                raise ValueError(message)
        n = static_batch_size(x)
        optimizer_state = list(zip(model.optimizer.variables, optimizer_vars))
        with keras.StatelessScope(state_mapping=optimizer_state):
            step = ops.convert_to_tensor(model.optimizer.iterations)
        per_example = _per_example_function(model, forward, trainable, non_trainable)
        grads, losses, y_pred, new_non_trainable = jax.vmap(per_example, in_axes=(0, 0, None))(
            x, y, ops.ones((), "float32") if scale is None else scale
        )
        grads = [ops.cast(g, "float32") for g in grads]
        if scale is not None:
            grads = [g / scale for g in grads]
        y_pred = keras.tree.map_structure(lambda t: t[:, 0], y_pred)
        new_non_trainable = [v[0] for v in new_non_trainable]
        squared = sum(ops.sum(ops.reshape(ops.square(g), (n, -1)), axis=1) for g in grads)
        weights = ops.minimum(1.0, self.option.l2_norm_clip / ops.sqrt(squared))
        logged = mask
        if scale is None:  # outside mixed precision a non-finite example counts zero
            finite = ops.logical_and(ops.isfinite(squared), ops.isfinite(losses))
            finite = ops.logical_and(finite, _finite_rows((x, y), n))
            grads = [ops.where(_rows(finite, g), g, 0.0) for g in grads]
            weights = ops.where(finite, weights, 0.0)
            losses = ops.where(finite, losses, 0.0)
            finite = ops.cast(finite, "float32")
            logged = finite if mask is None else finite * mask
            nonfinite = 1.0 - finite if mask is None else (1.0 - finite) * mask
            with updating_metrics(model, metrics_vars, optimizer_state) as metrics_vars:
                self.metrics[NONFINITE_METRIC].update_state(ops.sum(nonfinite))
        if mask is not None:
            weights = weights * mask
        with updating_metrics(model, metrics_vars, optimizer_state) as metrics_vars:
            samples = float(n) if mask is None else ops.sum(mask)
            self.step_samples.assign(ops.cast(samples, "float32"))
        clipped = [ops.tensordot(weights, g, axes=1) for g in grads]
        clipped = self._noised(clipped, step)
        clipped = [g / float(n) for g in clipped]
        regularization, reg_grads = _regularization(model, trainable)
        out = [c if r is None else c + r for c, r in zip(clipped, reg_grads)]
        out = [ops.cast(g, v.dtype) for g, v in zip(out, model.trainable_variables)]
        values = losses if logged is None else losses * logged
        loss = ops.sum(values) / float(n) + regularization
        return out, loss, y_pred, new_non_trainable, metrics_vars

    def _noised(self, sums: list[Any], step: Any) -> list[Any]:
        """Adds `N(0, (C sigma)^2)` to each sum, keyed by `(seed, step, index)`."""
        stddev = self.option.l2_norm_clip * self.option.noise_multiplier
        if stddev == 0:
            return sums
        high, low = seeds.seed_halves(self.seed)
        key = jax.random.fold_in(jax.random.key(high), low)
        key = jax.random.fold_in(key, ops.cast(step, "uint32"))
        return [
            s + stddev * jax.random.normal(jax.random.fold_in(key, index), s.shape, "float32")
            for index, s in enumerate(sums)
        ]


def _check_batch(model: keras.Model, y: Any, sample_weight: Any) -> Any:
    """The batch's boolean mask as float32 (None without one); refuses what DPSGD cannot clip."""
    if y is None:
        raise ValueError(refusals.NO_TARGETS)
    if sample_weight is None:
        return None
    flat = keras.tree.flatten(sample_weight)
    if len(flat) != 1 or keras.backend.standardize_dtype(flat[0].dtype) != "bool":
        dtypes = sorted({keras.backend.standardize_dtype(t.dtype) for t in flat})
        raise refusals.sample_weight_refused(dtypes)
    return ops.cast(flat[0], "float32")


def _per_example_function(
    model: keras.Model, forward: Any, trainable: Any, non_trainable: Any
) -> Any:
    """`f(x_i, y_i, scale) -> (grads, loss, y_pred, non_trainable)` for one example."""
    compiled = private.compiled_loss(model)
    regularized = sum(1 for v in model.trainable_variables if _regularizer(v) is not None)

    def one(x_i, y_i, scale):
        x1 = keras.tree.map_structure(lambda t: t[None], x_i)
        y1 = keras.tree.map_structure(lambda t: t[None], y_i)

        def loss_of(values):
            y_pred, new_non_trainable, added = forward(values, non_trainable, x1)
            if len(added) > regularized:
                raise refusals.added_losses_refused(len(added) - regularized, model.name)
            if any(masking.keras_mask(t) is not None for t in keras.tree.flatten(y_pred)):
                raise ValueError(
                    "On the JAX backend, DPSGD cannot train a model whose outputs "
                    "carry a Keras mask (the compiled loss normalizes masked "
                    "outputs over the whole batch). Received: a masked output "
                    f"in model {model.name!r}"
                )
            with keras_loss.output_trackers_muted(compiled):
                loss = ops.cast(compiled(y1, y_pred), "float32")
            return loss * scale, (loss, y_pred, new_non_trainable)

        grads, (loss, y_pred, new_non_trainable) = jax.grad(loss_of, has_aux=True)(trainable)
        return grads, loss, y_pred, new_non_trainable

    return one


def _regularizer(variable: Any) -> Any:
    return getattr(variable, "regularizer", None)


def _regularization(model: keras.Model, trainable: Any) -> tuple[Any, list[Any]]:
    """`(value, grads)` of the weight regularizers at `trainable` (grads None where none)."""
    variables = model.trainable_variables
    regularized = [i for i, v in enumerate(variables) if _regularizer(v) is not None]
    if not regularized:
        return 0.0, [None for _ in variables]

    def total(values):
        return sum(
            ops.cast(ops.sum(_regularizer(variables[i])(v)), "float32")
            for i, v in zip(regularized, values)
        )

    value, grads = jax.value_and_grad(total)([trainable[i] for i in regularized])
    out: list[Any] = [None] * len(variables)
    for i, g in zip(regularized, grads):
        out[i] = ops.cast(g, "float32")
    return value, out


def _finite_rows(structure: Any, n: int) -> Any:
    """`[n]` bool: True where every floating entry of the example's row is finite."""
    finite = ops.ones((n,), "bool")
    for t in keras.tree.flatten(structure):
        if t is None or "float" not in keras.backend.standardize_dtype(t.dtype):
            continue
        rows = ops.reshape(ops.isfinite(t), (n, -1))
        finite = ops.logical_and(finite, ops.all(rows, axis=1))
    return finite


def _rows(flags: Any, like: Any) -> Any:
    """`flags` (`[n]`) broadcastable against `like` (`[n, ...]`)."""
    return ops.reshape(flags, (-1,) + (1,) * (len(like.shape) - 1))
