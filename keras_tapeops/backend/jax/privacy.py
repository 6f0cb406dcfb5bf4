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

With `micro_batches=k` the per-example gradients are computed, clipped and
summed one micro-batch at a time (a `jax.lax.scan`; the micro-batches cut
as on TensorFlow), so only one micro-batch's rows exist at once; the clipped
sum, the noise and the division are the batch's, as without micro-batches.

With `accumulation_steps=k` each batch gives the window its clipped mean
(no noise); the window's step adds the noise of that step once, divided by
the window's samples, and the regularizers' gradient (`finish_window`), as
the TensorFlow engine's `finalize`: k batches of b examples make the step of
one batch of k * b (with the same noise).

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
from keras_tapeops.backend.jax.micro_batches import stacked
from keras_tapeops.backend.jax.micro_batches import unstacked
from keras_tapeops.privacy import seeds
from keras_tapeops.privacy import refusals
from keras_tapeops.privacy.dpsgd import DPSGD
from keras_tapeops.split_sizes import equal_size_groups
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
        micro_batches: the compiled `micro_batches`: the per-example
            gradients of that many micro-batches are computed and clipped
            one micro-batch at a time (the same clipped sum).
        accumulating: True with `accumulation_steps > 1`: each batch gives
            its clipped mean to the accumulation window, and the noise, the
            division by the window's samples and the regularizers' gradient
            come once per applied step (`finish_window`).
    """

    def __init__(
        self,
        option: DPSGD,
        model: keras.Model,
        micro_batches: int = 1,
        accumulating: bool = False,
    ) -> None:
        self.option = option
        self.micro_batches = micro_batches
        self.accumulating = accumulating
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
        unit = ops.ones((), "float32") if scale is None else scale

        def clipped_sum(xs, ys, mask_part):
            return self._clipped_sum(per_example, unit, scale, xs, ys, mask_part)

        if self.micro_batches > 1:
            clipped, nonfinite, values, y_pred, new_non_trainable = _in_micro_batches(
                clipped_sum, (x, y, mask), n, self.micro_batches, (trainable, non_trainable)
            )
        else:
            clipped, nonfinite, values, y_pred, new_non_trainable = clipped_sum(x, y, mask)
        if scale is None:  # outside mixed precision a non-finite example counts zero
            with updating_metrics(model, metrics_vars, optimizer_state) as metrics_vars:
                self.metrics[NONFINITE_METRIC].update_state(nonfinite)
        regularization, reg_grads = _regularization(model, trainable)
        loss = ops.sum(values) / float(n) + regularization
        if self.accumulating:  # the window weights it by n: its sum; noise at the step
            out = [ops.cast(g / float(n), v.dtype) for g, v in zip(clipped, trainable)]
            return out, loss, y_pred, new_non_trainable, metrics_vars
        with updating_metrics(model, metrics_vars, optimizer_state) as metrics_vars:
            samples = float(n) if mask is None else ops.sum(mask)
            self.step_samples.assign(ops.cast(samples, "float32"))
        out = self._finished(model, clipped, float(n), step, reg_grads)
        return out, loss, y_pred, new_non_trainable, metrics_vars

    def finish_window(
        self,
        model: keras.Model,
        grads: list[Any],
        samples: Any,
        scale: Any,
        state: tuple[list[Any], list[Any], list[Any]],
    ) -> tuple[list[Any], list[Any]]:
        """An accumulation window's private gradient, once per applied step.

        Args:
            model: the compiled model.
            grads: the window's gradient: the sum of its clipped per-example
                gradients divided by its samples (times the loss scale).
            samples: the window's number of examples.
            scale: the loss scale of this step (or None).
            state: `(trainable, optimizer_vars, metrics_vars)` values.

        Returns:
            `(grads, metrics_vars)`: with the noise of this step divided by
            the window's samples and the regularizers' gradient (times the
            loss scale), and `dp_step_samples` set to the window's samples.
        """
        trainable, optimizer_vars, metrics_vars = state
        optimizer_state = list(zip(model.optimizer.variables, optimizer_vars))
        with keras.StatelessScope(state_mapping=optimizer_state):
            step = ops.convert_to_tensor(model.optimizer.iterations)
        with updating_metrics(model, metrics_vars, optimizer_state) as metrics_vars:
            self.step_samples.assign(ops.cast(samples, "float32"))
        unit = ops.ones((), "float32") if scale is None else ops.cast(scale, "float32")
        sums = [ops.cast(g, "float32") / unit * samples for g in grads]
        _, reg_grads = _regularization(model, trainable)
        out = self._finished(model, sums, samples, step, reg_grads)
        return [g * ops.cast(unit, g.dtype) for g in out], metrics_vars

    def _finished(
        self, model: keras.Model, sums: list[Any], samples: Any, step: Any, reg_grads: list[Any]
    ) -> list[Any]:
        """The clipped sums plus noise, divided by `samples`, plus the regularizers' `reg_grads`."""
        noised = self._noised(sums, step)
        divided = [g / samples for g in noised]
        out = [c if r is None else c + r for c, r in zip(divided, reg_grads)]
        return [ops.cast(g, v.dtype) for g, v in zip(out, model.trainable_variables)]

    def _clipped_sum(
        self, per_example: Any, unit: Any, scale: Any, x: Any, y: Any, mask: Any
    ) -> tuple[list[Any], Any, Any, Any, list[Any]]:
        """The clipped sum of the examples of `x` (the batch or one micro-batch).

        Returns:
            `(sums, nonfinite, losses, y_pred, non_trainable)`: one float32
            sum per trainable variable, the number of non-finite examples
            zeroed (0 under a LossScaleOptimizer), the per-example losses to
            log (zero where not counted), the outputs and the first
            example's non-trainable values.
        """
        m = static_batch_size(x)
        grads, losses, y_pred, new_non_trainable = jax.vmap(per_example, in_axes=(0, 0, None))(
            x, y, unit
        )
        grads = [ops.cast(g, "float32") for g in grads]
        if scale is not None:
            grads = [g / scale for g in grads]
        y_pred = keras.tree.map_structure(lambda t: t[:, 0], y_pred)
        new_non_trainable = [v[0] for v in new_non_trainable]
        squared = sum(ops.sum(ops.reshape(ops.square(g), (m, -1)), axis=1) for g in grads)
        weights = ops.minimum(1.0, self.option.l2_norm_clip / ops.sqrt(squared))
        logged = mask
        nonfinite = ops.zeros((), "float32")
        if scale is None:  # outside mixed precision a non-finite example counts zero
            finite = ops.logical_and(ops.isfinite(squared), ops.isfinite(losses))
            finite = ops.logical_and(finite, _finite_rows((x, y), m))
            grads = [ops.where(_rows(finite, g), g, 0.0) for g in grads]
            weights = ops.where(finite, weights, 0.0)
            losses = ops.where(finite, losses, 0.0)
            finite = ops.cast(finite, "float32")
            logged = finite if mask is None else finite * mask
            nonfinite = ops.sum(1.0 - finite if mask is None else (1.0 - finite) * mask)
        if mask is not None:
            weights = weights * mask
        sums = [ops.tensordot(weights, g, axes=1) for g in grads]
        values = losses if logged is None else losses * logged
        return sums, nonfinite, values, y_pred, new_non_trainable

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


def _in_micro_batches(
    clipped_sum: Any,
    batch: tuple[Any, Any, Any],
    n: int,
    k: int,
    variables: tuple[Any, Any],
) -> tuple[list[Any], Any, Any, Any, list[Any]]:
    """`clipped_sum` over `k` micro-batches in a `jax.lax.scan`, the sums added up.

    Only one micro-batch's per-example gradients exist at a time. The
    micro-batches are cut as on TensorFlow (`split_sizes.equal_size_groups`).

    Args:
        clipped_sum: `(x, y, mask) -> (sums, nonfinite, losses, y_pred,
            non_trainable)` of a (micro-)batch, see `_clipped_sum`.
        batch: `(x, y, mask)` of the whole batch (mask may be None).
        n: the batch's number of rows.
        k: requested number of micro-batches.
        variables: `(trainable, non_trainable)` values (their shapes).

    Returns:
        What `clipped_sum` returns for the whole batch (outputs and losses
        in sample order, the first example's non-trainable values).
    """
    trainable, non_trainable = variables
    sums = [ops.zeros(v.shape, "float32") for v in trainable]
    nonfinite = ops.zeros((), "float32")
    first: list[Any] | None = None
    values, outputs = [], []
    for start, count, size in equal_size_groups(n, k):
        group = jax.tree_util.tree_map(lambda t: stacked(t, start, count, size), batch)
        # The first micro-batch's non-trainable values ride in the carry (not
        # a scan output: that would keep one copy per micro-batch).
        kept = [ops.zeros(v.shape, v.dtype) for v in non_trainable] if first is None else first
        taken = ops.array(first is not None)

        def body(carry, micro):
            sums, nonfinite, kept, taken = carry
            part, part_nonfinite, part_values, y_pred, new_non_trainable = clipped_sum(*micro)
            sums = [a + b for a, b in zip(sums, part)]
            kept = [ops.where(taken, a, b) for a, b in zip(kept, new_non_trainable)]
            carry = (sums, nonfinite + part_nonfinite, kept, ops.array(True))
            return carry, (part_values, y_pred)

        (sums, nonfinite, first, _), (part_values, y_pred) = jax.lax.scan(
            body, (sums, nonfinite, kept, taken), group
        )
        values.append(unstacked(part_values))
        outputs.append(jax.tree_util.tree_map(unstacked, y_pred))
    y_pred = jax.tree_util.tree_map(lambda *p: jax.numpy.concatenate(p, axis=0), *outputs)
    return sums, nonfinite, jax.numpy.concatenate(values, axis=0), y_pred, first or []


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
