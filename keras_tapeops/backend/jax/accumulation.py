"""`compile(accumulation_steps=k)` on JAX: k consecutive batches, one optimizer step.

The same window as on TensorFlow (`keras_tapeops.accumulation.cross_batch`):
each batch adds `d_j * grad_j` (its gradient times its normalizer `d_j`) and
`d_j` to the window; when the window holds k batches, the step applies
`sum_j d_j grad_j / sum_j d_j` through the gradient transforms and the
optimizer: the step stock Keras takes on the concatenated batches. `d_j` is the
batch's sample count for the mean reductions (regularizers and loss terms
count as per-sample means), 1 for `"sum"` (the gradients are summed).
`optimizer.iterations` (and so learning-rate schedules) count applied steps.

The window state rides in the stateless JAX step as metric variables (an
`AccumulationWindow` is a `carried.CarriedState`: listed in `model.metrics`,
never logged, not weights, so weight files stay stock). Under
`DataParallel` the gradient of the global batch is already the all-reduced
one, so the window holds the global batches' gradients.

`fit()` adds `AccumulationFlush`, as on TensorFlow: a window cut short by the
end of an epoch is applied (averaged over its samples) before validation and
before the other callbacks' `on_epoch_end`, and every epoch starts a fresh
window.

A `"mean_with_sample_weight"` loss with sample weights and a masked output
weight their batches by the sum of the weights and the unmasked entries (one
output, one loss). What the window cannot weight exactly is refused by name
while the first step is traced, before any weight changes: those next to
another output, loss terms or DP-SGD, and a `"sum"` loss with regularization
losses (its normalizer is known only after the window's last batch, as on
TensorFlow).
"""

from __future__ import annotations

from typing import Any
from typing import Callable
from typing import Sequence

import jax
import keras
from keras import ops

from keras_tapeops._keras import jax_trainer
from keras_tapeops.accumulation.reduction_kinds import MEAN_REDUCTIONS
from keras_tapeops.accumulation.reduction_kinds import named_losses
from keras_tapeops.accumulation.reduction_kinds import refuse_mixed_window
from keras_tapeops.backend.jax.carried import CarriedState
from keras_tapeops.hook_overrides import overrides
from keras_tapeops.split_sizes import static_batch_size

#: `apply(grads, trainable, optimizer_vars, metrics_vars, samples) ->
#: (trainable, optimizer_vars, metrics_vars)`: the step's transforms and
#: optimizer; `samples` is the window's sample count (DP-SGD's noise is
#: divided by it).
ApplyFunction = Callable[[list[Any], list[Any], list[Any], list[Any], Any], tuple[Any, Any, Any]]


def window_kind(loss: Any) -> str:
    """`"unit"` when every compiled loss is reduced by `"sum"`, else `"samples"`.

    Args:
        loss: the `loss` argument given to `compile()` (`check_compile_loss`
            has refused unreduced losses and `"sum"` next to a mean).

    Returns:
        The window's normalizer kind.
    """
    reductions = [reduction for _, reduction in named_losses(loss)]
    return "unit" if reductions and all(r == "sum" for r in reductions) else "samples"


class AccumulationWindow(CarriedState):
    """The window's per-variable gradient sums and counts, as metric variables.

    A metric so that the stateless JAX step carries it (see the module
    docstring); it logs nothing and `reset_metrics()` leaves it alone: the
    window starts afresh at `fit()`'s epoch boundaries (`AccumulationFlush`).

    Args:
        model: the built model (one sum per trainable variable).
        steps: batches per optimizer step (int >= 2).
        loss: `compile()`'s `loss` argument (its reductions).
        apply: the step's `ApplyFunction` (transforms, optimizer).

    Example:
    ```python
    model.compile(optimizer="sgd", loss="mse", accumulation_steps=4)
    model.fit(x, y, batch_size=16)  # on JAX: one step per 4 batches
    ```
    """

    def __init__(self, model: keras.Model, steps: int, loss: Any, apply: ApplyFunction) -> None:
        super().__init__(name="tapeops_accumulation_window")
        self.steps = steps
        self.kind = window_kind(loss)
        self.named_reductions = named_losses(loss)
        self._apply = apply
        self.sums = [
            self.add_variable(
                shape=tuple(v.shape), initializer="zeros", dtype=v.dtype, name=f"accumulated_{i}"
            )
            for i, v in enumerate(model.trainable_variables)
        ]
        self.samples = self.add_variable((), "zeros", "float32", name="accumulated_samples")
        self.normalizer = self.add_variable((), "zeros", "float32", name="accumulated_normalizer")
        self.batches = self.add_variable((), "zeros", "float32", name="accumulated_batches")

    @property
    def window_variables(self) -> list[keras.Variable]:
        """The sums, then the sample count, the normalizer and the batch count."""
        return [*self.sums, self.samples, self.normalizer, self.batches]

    def reset(self) -> None:
        """Discards the current window (eager; what `AccumulationFlush` calls)."""
        for variable in self.window_variables:
            variable.assign(ops.zeros(variable.shape, variable.dtype))

    # ------------------------------------------------------------ train step
    def batch_normalizer(
        self,
        model: keras.Model,
        state: tuple[Any, Any],
        x: Any,
        sample_weight: Any,
        y_pred: Any,
        masks: Sequence[Any],
    ) -> Any:
        """The batch's normalizer `d_j`, what Keras divides its loss by (up to a constant).

        The sample count for the mean reductions; 1 for `"sum"`; the sum of
        the sample weights for a `"mean_with_sample_weight"` loss with
        sample weights; the number of unmasked entries for a masked output
        (as TensorFlow's window reads them). The last two are taken for a
        model with one output and one loss, without loss terms or DP-SGD
        (their pieces would need two normalizers); otherwise, and for a
        `"sum"` loss with regularization losses, raises ValueError while the
        first step is traced, before any weight changes.

        Args:
            model: the model (its forward pass is probed for regularization
                losses when the window sums).
            state: the step's `(trainable, non_trainable)` values.
            x: the batch's inputs.
            sample_weight: the batch's sample weights (or None).
            y_pred: the batch's predictions.
            masks: the outputs' Keras masks (None for an unmasked output),
                read inside the traced loss (`jax_loss.output_masks`).

        Returns:
            A float or a float32 scalar tensor.
        """
        named = dict(self.named_reductions)
        if self.kind == "unit":
            if _has_forward_losses(model, state, x):
                raise refuse_mixed_window(self.steps, named, "regularization losses")
            return 1.0
        outputs = [t for t in keras.tree.flatten(y_pred) if t is not None]
        reductions = set(named.values())
        weighted = sample_weight is not None and "mean_with_sample_weight" in reductions
        masked = any(m is not None for m in masks)
        if not (weighted or masked):
            return float(static_batch_size(x))
        what = (
            "a masked output (normalized by its unmasked entries)"
            if masked
            else "a 'mean_with_sample_weight' loss with sample weights (normalized by the "
            "sum of the weights)"
        )
        state_ = getattr(model, "tapeops_state", None)
        terms = bool(model.tapeops_options.loss_terms) or overrides(model, "compute_terms")
        private = state_ is not None and state_.privacy is not None
        if len(outputs) != 1 or len(named) != 1 or terms or private or (weighted and masked):
            others = "more than one output or loss, loss terms, DP-SGD, or sample weights too"
            raise _refuse(self.steps, named, f"{what} next to {others}")
        if weighted:
            (weights,) = [w for w in keras.tree.flatten(sample_weight) if w is not None]
            return ops.sum(ops.cast(weights, "float32"))
        valid = ops.sum(ops.cast(masks[0], "float32"))
        # Keras divides a mean-reduced masked loss by `valid + epsilon`.
        return valid + keras.backend.epsilon() if reductions <= set(MEAN_REDUCTIONS) else valid

    def step(
        self,
        model: keras.Model,
        grads: Sequence[Any],
        n: int,
        weight: Any,
        trainable: list[Any],
        optimizer_vars: list[Any],
        metrics_vars: list[Any],
    ) -> tuple[list[Any], list[Any], list[Any]]:
        """Adds one batch's gradients; applies and clears the window when it is full.

        Args:
            model: the model (its `metrics_variables` hold the window's).
            grads: the batch's (loss-scaled, global) gradients.
            n: the batch's sample count.
            weight: the batch's normalizer (`batch_normalizer`).
            trainable, optimizer_vars, metrics_vars: the step's state values.

        Returns:
            `(trainable, optimizer_vars, metrics_vars)` after the step.
        """
        positions = _positions(model, self.window_variables)
        current = [metrics_vars[i] for i in positions]
        sums, (samples, normalizer, batches) = current[:-3], current[-3:]
        sums = [
            s if g is None else s + ops.cast(g, s.dtype) * ops.cast(weight, s.dtype)
            for s, g in zip(sums, grads)
        ]
        samples, normalizer, batches = samples + n, normalizer + weight, batches + 1.0
        full = batches > self.steps - 0.5
        present = [g is not None for g in grads]
        self._present = present  # trace time: which variables get gradients (for flush)

        def apply(operands):
            trainable, optimizer_vars, metrics_vars = operands
            window = self._window_gradients(sums, normalizer, present)
            return self._apply(window, trainable, optimizer_vars, metrics_vars, samples)

        trainable, optimizer_vars, metrics_vars = jax.lax.cond(
            full & (samples > 0),
            apply,
            lambda operands: operands,
            (list(trainable), list(optimizer_vars), list(metrics_vars)),
        )
        metrics_vars = list(metrics_vars)
        for i, value in zip(positions, [*sums, samples, normalizer, batches]):
            metrics_vars[i] = ops.where(full, ops.zeros_like(value), value)
        return list(trainable), list(optimizer_vars), metrics_vars

    def _window_gradients(self, sums, normalizer, present):
        if self.kind == "unit":
            return [s if on else None for s, on in zip(sums, present)]
        factor = ops.where(normalizer > 0, 1.0 / ops.maximum(normalizer, 1e-30), 0.0)
        return [s * ops.cast(factor, s.dtype) if on else None for s, on in zip(sums, present)]

    # ------------------------------------------------------------- epoch end
    def pending_batches(self) -> int:
        """Batches in the current window (eager; 0 when empty)."""
        return int(round(float(ops.convert_to_numpy(self.batches.value))))

    def flush(self, model: keras.Model) -> bool:
        """Applies a partial window now (averaged over its samples), if any.

        Called eagerly between steps (end of epoch, before validation), with
        the variables holding the epoch's final state.

        Args:
            model: the model.

        Returns:
            True if a step was applied.
        """
        if self.pending_batches() == 0:
            return False
        if float(ops.convert_to_numpy(self.samples.value)) == 0:
            self.reset()
            return False
        present = getattr(self, "_present", [True] * len(self.sums))
        sums = [v.value for v in self.sums]
        window = self._window_gradients(sums, self.normalizer.value, present)
        trainable, optimizer_vars, metrics_vars = self._apply(
            window,
            [v.value for v in model.trainable_variables],
            [v.value for v in model.optimizer.variables],
            [v.value for v in model.metrics_variables],
            self.samples.value,
        )
        for group, values in [
            (model.trainable_variables, trainable),
            (model.optimizer.variables, optimizer_vars),
            (model.metrics_variables, metrics_vars),
        ]:
            for variable, value in zip(group, values):
                variable.assign(value)
        self.reset()
        return True


def _positions(model: keras.Model, variables: Sequence[keras.Variable]) -> list[int]:
    """Where each of `variables` sits in `model.metrics_variables`."""
    index = {id(v): i for i, v in enumerate(model.metrics_variables)}
    return [index[id(v)] for v in variables]


def _has_forward_losses(model: keras.Model, state: tuple[Any, Any], x: Any) -> bool:
    """Whether the forward pass adds losses (regularizers, `add_loss`): traced, not run."""
    found: list[int] = []
    kwargs = jax_trainer.call_kwargs(model, training=True)

    def probe(trainable, non_trainable, x):
        _, _, losses = model.stateless_call(
            trainable, non_trainable, x, return_losses=True, **kwargs
        )
        found.append(len(losses))
        return 0

    def shape_of(tree):
        return jax.tree_util.tree_map(lambda t: jax.ShapeDtypeStruct(t.shape, t.dtype), tree)

    jax.eval_shape(probe, *shape_of((list(state[0]), list(state[1]), x)))
    return bool(found and found[0])


def _refuse(steps: int, named: dict[str, Any], what: str) -> ValueError:
    return ValueError(
        f"`accumulation_steps={steps}` on the JAX backend cannot make this loss exact: "
        f"{what}. Use micro_batches (exact for every loss), or KERAS_BACKEND=tensorflow, "
        f"whose window reads each batch's normalizer. Received: reduction={named!r}"
    )
