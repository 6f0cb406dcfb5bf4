"""The JAX step's loss: forward pass, compiled loss, loss terms, loss scaling.

One function for every JAX path that changes the loss (micro-batches, loss
terms): `loss_function(model, forward, terms, training)` returns the function
`jax.value_and_grad` differentiates. It runs `forward` (the model's stateless
call, or the micro-batch scan) while recording the layer outputs the terms
declared, computes Keras's compiled loss on the predictions, then the terms
(the model's `compute_terms` hook) inside a `keras.StatelessScope` that maps
the model's and the optimizer's variables to the step's values (so a term
that reads `model.weights`, or a weight scheduled on the optimizer's step,
sees this step's values), and scales the total for mixed precision.
"""

from __future__ import annotations

import contextlib
from typing import Any
from typing import Callable
from typing import Iterator
from typing import Sequence

import jax
import keras
from keras import ops

from keras_tapeops import capture
from keras_tapeops._keras import jax_trainer
from keras_tapeops.backend.jax.micro_batches import LargeBatchStatistics
from keras_tapeops.backend.jax.micro_batches import micro_batch_forward
from keras_tapeops.backend.jax.micro_batches import micro_batch_scan
from keras_tapeops._keras import masking
from keras_tapeops.hook_overrides import overrides
from keras_tapeops.terms.base import Term
from keras_tapeops.terms.base import TermContext

LossFunction = Callable[..., tuple[Any, tuple[Any, ...]]]


def stateless_forward(model: keras.Model, training: bool) -> Callable[..., Any]:
    """`forward(trainable, non_trainable, x) -> (y_pred, non_trainable, losses)`."""
    kwargs = jax_trainer.call_kwargs(model, training)

    def forward(trainable, non_trainable, x):
        return model.stateless_call(trainable, non_trainable, x, return_losses=True, **kwargs)

    return forward


def loss_function(
    model: keras.Model,
    forward: Callable[..., Any],
    terms: Sequence[tuple[Term, Any]],
    training: bool,
    micro_batches: int = 1,
    merge: LargeBatchStatistics | None = None,
) -> LossFunction:
    """The loss to differentiate, with the stock JAX trainer's outputs plus the terms'.

    With `micro_batches > 1` and loss terms, the terms are computed inside
    the micro-batch scan, each on its micro-batch (its inputs, labels,
    predictions and recorded layer outputs) and weighted by `size / n`, as
    the TensorFlow loop differentiates each micro-batch's loss with its terms.

    Args:
        model: the model (its `compute_terms` hook computes the terms).
        forward: `forward(trainable, non_trainable, x)`, see `stateless_forward`
            (the model's own pass: `loss_function` splits it when asked).
        terms: the active `(kt.Term, state)` pairs.
        training: the step's mode (scales the loss for mixed precision when True).
        micro_batches: the compiled `micro_batches` (1: one forward pass).
        merge: with `micro_batches`, the model's `LargeBatchStatistics` for
            `batch_norm_updates="large_batch"` (None: per micro-batch).

    Returns:
        `f(trainable, non_trainable, metrics, x, y, sample_weight,
        optimizer_vars) -> (scaled_loss, (unscaled_loss, y_pred,
        non_trainable, metrics, term_values, output_masks))`.

    Example:
    ```python
    f = loss_function(model, stateless_forward(model, True), state.active_terms(True), True)
    (_, aux), grads = jax.value_and_grad(f, has_aux=True)(*state_and_batch)
    ```
    """
    layers = [layer for term, state in terms for layer in term.layers_to_capture(state)]
    wants_input_gradients = any(term.needs_input_gradients for term, _ in terms)
    with_terms = bool(terms) or overrides(model, "compute_terms")
    per_micro_batch = micro_batches > 1 and with_terms

    def forward_and_terms(trainable, non_trainable, x, y, sample_weight, optimizer_vars):
        """One forward pass and its terms: `(y_pred, non_trainable, losses, values)`."""
        y_pred, new_non_trainable, losses, activations, input_gradients = _recorded_forward(
            forward, layers, wants_input_gradients, trainable, non_trainable, x
        )
        values: list[Any] = []
        if with_terms:
            context = (x, y, y_pred, sample_weight, activations, input_gradients)
            values = _term_values(
                model, terms, training, trainable, new_non_trainable, optimizer_vars, context
            )
        return y_pred, new_non_trainable, losses, values

    def compute(trainable, non_trainable, metrics, x, y, sample_weight, optimizer_vars):
        if per_micro_batch:
            y_pred, new_non_trainable, losses, values = micro_batch_scan(
                forward_and_terms,
                (trainable, non_trainable, optimizer_vars),
                (x, y, sample_weight),
                micro_batches,
                merge,
            )
        elif micro_batches > 1:
            y_pred, new_non_trainable, losses = micro_batch_forward(forward, micro_batches, merge)(
                trainable, non_trainable, x
            )
            values = []
        else:
            y_pred, new_non_trainable, losses, values = forward_and_terms(
                trainable, non_trainable, x, y, sample_weight, optimizer_vars
            )
        loss, new_non_trainable, metrics = jax_trainer.stateless_loss(
            model,
            trainable,
            new_non_trainable,
            metrics,
            x,
            y,
            y_pred,
            sample_weight,
            losses,
            training,
        )
        if values:
            loss = loss + ops.cast(sum(values[1:], values[0]), loss.dtype)
        unscaled = loss
        if training and model.optimizer is not None:
            mapping = list(zip(model.optimizer.variables, optimizer_vars))
            with keras.StatelessScope(state_mapping=mapping):
                loss = model.optimizer.scale_loss(loss)
        aux = (unscaled, y_pred, new_non_trainable, metrics, values[: len(terms)])
        return loss, (*aux, output_masks(y_pred))

    return compute


def output_masks(y_pred: Any) -> list[Any]:
    """The Keras mask of each output (None where it has none), read inside the trace.

    A JAX array's mask lives in a table keyed by the array, so it is lost
    once the predictions leave `jax.value_and_grad` as aux values; the step
    returns the masks themselves (the accumulation window's normalizer
    counts their unmasked entries).
    """
    return [masking.keras_mask(t) for t in keras.tree.flatten(y_pred) if t is not None]


def _recorded_forward(forward, layers, wants_input_gradients, trainable, non_trainable, x):
    """`forward` recording the terms' layer outputs (and the input VJP when asked).

    Returns:
        `(y_pred, non_trainable, losses, activations, input_gradients)`;
        `input_gradients` is None unless `wants_input_gradients`.
    """
    if wants_input_gradients:
        return _input_vjp(forward, layers, trainable, non_trainable, x)
    with capture.recording_outputs(layers) as activations:
        y_pred, new_non_trainable, losses = forward(trainable, non_trainable, x)
    return y_pred, new_non_trainable, losses, activations, None


def _term_values(model, terms, training, trainable, non_trainable, optimizer_vars, context):
    """The `compute_terms` hook's float32 values, with this step's variable values.

    It runs inside a `keras.StatelessScope` mapping the model's and the
    optimizer's variables to `trainable`, `non_trainable` and
    `optimizer_vars` (in evaluation: None, or the `(variable, value)` pairs
    of `TapeOpsMixin._evaluation_step_of`); `context` is `(x, y, y_pred, sample_weight,
    activations, input_gradients)` of the pass.
    """
    x, y, y_pred, sample_weight, activations, input_gradients = context
    mapping = list(zip(model.trainable_variables, trainable))
    mapping += list(zip(model.non_trainable_variables, non_trainable))
    if optimizer_vars is not None and model.optimizer is not None:
        if training:
            mapping += list(zip(model.optimizer.variables, optimizer_vars))
        else:  # evaluation: `(variable, value)` pairs (the step scheduled weights read)
            mapping += list(optimizer_vars)
    with keras.StatelessScope(state_mapping=mapping):
        term_context = JaxTermContext(
            model, x, y, y_pred, sample_weight, training, activations, input_gradients
        )
        return [ops.cast(v, "float32") for v in model.compute_terms(list(terms), term_context)]


class JaxTermContext(TermContext):
    """`kt.TermContext` on JAX: input gradients come from a `jax.vjp` of the forward pass.

    Args:
        model, x, y, y_pred, sample_weight, training, activations: as
            `kt.TermContext`.
        input_gradients: `cotangent -> gradient w.r.t. x` (the forward
            pass's VJP over its float inputs), or None when no term asked.
    """

    def __init__(
        self,
        model: keras.Model,
        x: Any,
        y: Any,
        y_pred: Any,
        sample_weight: Any,
        training: bool,
        activations: dict[int, list[Any]],
        input_gradients: Callable[[Any], Any] | None,
    ) -> None:
        super().__init__(model, x, y, y_pred, sample_weight, training, activations)
        self._input_gradients_fn = input_gradients

    def input_gradients(self, target: Any = None) -> Any:
        """Gradient of the sum of `target` (default: all outputs) w.r.t. the inputs.

        On JAX `target` is the model's outputs or some of them (tensors of
        `context.y_pred`), or None for all float outputs; the gradient is
        differentiable w.r.t. the weights (double backprop).
        """
        if self._input_gradients_fn is None:
            raise ValueError("input_gradients() needs a term with needs_input_gradients=True.")
        leaves = keras.tree.flatten(self.y_pred)
        floats = [t for t in leaves if t is not None and keras.backend.is_float_dtype(t.dtype)]
        chosen = floats if target is None else keras.tree.flatten(target)
        for tensor in chosen:
            if not any(tensor is leaf for leaf in leaves):
                raise ValueError(
                    "On the JAX backend, input_gradients(target) takes the model's "
                    "outputs (tensors of context.y_pred), or None for all of them. "
                    f"Received: target={target!r}"
                )
        cotangent = [
            None
            if t is None
            else (ops.ones_like(t) if any(t is c for c in chosen) else ops.zeros_like(t))
            for t in leaves
        ]
        return self._input_gradients_fn(keras.tree.pack_sequence_as(self.y_pred, cotangent))


def _input_vjp(forward, layers, trainable, non_trainable, x):
    """The forward pass under `jax.vjp` over the float inputs (for input gradients).

    Returns:
        `(y_pred, non_trainable, losses, activations, input_gradients)`:
        the recorded layer outputs come back as the VJP's auxiliary output,
        and `input_gradients(cotangent)` has `x`'s structure (None for
        non-float inputs).
    """
    flat = keras.tree.flatten(x)
    watched = [t is not None and keras.backend.is_float_dtype(t.dtype) for t in flat]

    def run(*inputs):
        given = iter(inputs)
        xx = keras.tree.pack_sequence_as(
            x, [next(given) if w else t for t, w in zip(flat, watched)]
        )
        with capture.recording_outputs(layers) as records:
            y_pred, new_non_trainable, losses = forward(trainable, non_trainable, xx)
        return y_pred, (new_non_trainable, losses, {k: list(v) for k, v in records.items()})

    primals = [t for t, w in zip(flat, watched) if w]
    y_pred, vjp, (new_non_trainable, losses, activations) = jax.vjp(run, *primals, has_aux=True)

    def input_gradients(cotangent):
        grads = iter(vjp(cotangent))
        return keras.tree.pack_sequence_as(x, [next(grads) if w else None for w in watched])

    return y_pred, new_non_trainable, losses, activations, input_gradients


@contextlib.contextmanager
def updating_metrics(
    model: keras.Model, metrics_variables: Sequence[Any], read: Sequence[tuple[Any, Any]] = ()
) -> Iterator[list[Any]]:
    """Metric updates inside the block are stateless; yields their new values.

    Inside the block the model's metrics variables read `metrics_variables`
    (a `keras.StatelessScope`), so `metric.update_state(...)` works in the
    jitted step; the yielded list holds the new values of
    `model.metrics_variables`, in order, once the block ends.

    Args:
        model: the model (its `metrics_variables` are the reference variables).
        metrics_variables: their current values.
        read: more `(variable, value)` pairs the block reads (e.g. the
            optimizer's loss scale); their updates are dropped.

    Yields:
        A list, filled with the new values when the block exits.

    Example:
    ```python
    with updating_metrics(model, metrics_vars) as new_metrics_vars:
        tracker.update_state(value)
    ```
    """
    references = model.metrics_variables
    new_values = list(metrics_variables)
    mapping = list(zip(references, metrics_variables)) + list(read)
    with keras.StatelessScope(state_mapping=mapping) as scope:
        yield new_values
    for i, reference in enumerate(references):
        value = scope.get_current_value(reference)
        if value is not None:
            new_values[i] = value


def update_term_trackers(
    model: keras.Model,
    metrics_variables: Sequence[Any],
    trackers: Sequence[Any],
    values: Sequence[Any],
    n: int,
) -> list[Any]:
    """The metrics variables after each term tracker saw its value (weight `n`).

    Args:
        model: the model (its `metrics_variables` are the reference variables).
        metrics_variables: their current values.
        trackers: the terms' `Mean` trackers, in term order.
        values: the terms' weighted values, in the same order.
        n: the batch's number of samples (each value's weight, as `loss`'s).

    Returns:
        The new values of `model.metrics_variables`, in order.
    """
    with updating_metrics(model, metrics_variables) as new_values:
        for tracker, value in zip(trackers, values):
            tracker.update_state(value, sample_weight=n)
    return new_values


def loss_scale(optimizer: Any, optimizer_values: Sequence[Any]) -> Any:
    """The factor the loss was multiplied by in this step, or None.

    A LossScaleOptimizer's current dynamic scale, or another optimizer's
    static `loss_scale_factor` (its `scale_loss` multiplies the loss by it and
    its `apply` divides the gradients by it), as `true_gradients.loss_scale`
    on TensorFlow.

    Args:
        optimizer: the optimizer.
        optimizer_values: its variables' values in this step, in order.

    Returns:
        A scalar tensor, or None.
    """
    if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        factor = getattr(optimizer, "loss_scale_factor", None)
        return None if factor is None else ops.convert_to_tensor(factor, "float32")
    mapping = list(zip(optimizer.variables, optimizer_values))
    with keras.StatelessScope(state_mapping=mapping):
        return ops.convert_to_tensor(optimizer.dynamic_scale)
