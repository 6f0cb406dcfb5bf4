"""The loss-term protocol and the per-step context terms read from.

A term is computed inside the training tape, from the same forward pass as the
task loss. The step adds `weight * value` to the loss and logs `weight * value`
under the term's `name` (epoch sample-weighted mean, like `loss`).
"""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING
from typing import Any
from typing import Sequence
from typing import TypeVar

import keras
import numpy as np
from keras import ops

from keras_tapeops import selectors
from keras_tapeops import validation
from keras_tapeops.config_repr import ConfigRepr
from keras_tapeops.paths import LayerTree
from keras_tapeops.typing_aliases import Nested

if TYPE_CHECKING:
    import tensorflow as tf


#: A term's weight: a number, a LearningRateSchedule or a callable step -> number.
Weight = Any


class TermContext:
    """What a term can read during one step.

    Attributes:
        model: the model being trained.
        x, y, sample_weight: the (micro-)batch, unpacked.
        y_pred: the model's output from the step's single forward pass.
        training: True in `train_step`, False in `test_step`.
        state: what the model resolved for the term being computed (the
            value its `bind(model)` returned); set by the step before each
            term's `call`.
    """

    def __init__(
        self,
        model: keras.Model,
        x: Nested,
        y: Nested,
        y_pred: Nested,
        sample_weight: Nested,
        training: bool,
        activations: dict[int, list[Any]],
        input_tape: "tf.GradientTape | None" = None,
        watched_inputs: Any = None,
    ) -> None:
        self.model = model
        self.x = x
        self.y = y
        self.y_pred = y_pred
        self.sample_weight = sample_weight
        self.training = training
        self._activations = activations
        self._input_tape = input_tape
        self._watched_inputs = watched_inputs
        self.state: Any = None

    def activations(self, layer: keras.layers.Layer) -> list[Any]:
        """Returns the list of output tensors `layer` produced in this forward pass.

        Every call of the layer counts, and a layer with several outputs
        contributes each output tensor. Only the layers the compiled terms
        declared are recorded (a term's `layers_to_capture(state)`, or
        `kt.LossTerm(..., layers=[...])`): the forward pass has already run.

        Raises:
            ValueError: `layer` was not declared by any compiled term.
        """
        if id(layer) not in self._activations:
            name = getattr(layer, "name", layer)
            raise ValueError(
                f"activations(): layer {name!r} was not recorded in this forward "
                "pass. A term declares the layers it reads: return them from "
                "its `layers_to_capture(state)` (see `kt.Term`), or use "
                "`kt.LossTerm(fn, layers=[...])`. Received: layer="
                f"{name!r}"
            )
        return list(self._activations[id(layer)])

    def input_gradients(self, target: Any = None) -> Nested:
        """Gradient of `target` (default: sum of all outputs) w.r.t. the inputs.

        Available when the term sets `needs_input_gradients = True`; the
        forward pass then ran under an inner tape watching the float inputs.
        The result has the structure of `x` (None for non-float inputs) and is
        differentiable w.r.t. the weights (the outer tape records it).
        """
        if self._input_tape is None:
            raise ValueError("input_gradients() needs a term with needs_input_gradients=True.")
        import tensorflow as tf  # the input tape exists on TensorFlow only

        if target is None:
            # The outputs the inner tape recorded (a sum computed here, after
            # the forward pass, would not be on the tape); TF sums a list.
            target = [
                t for t in tf.nest.flatten(self.y_pred) if t is not None and t.dtype.is_floating
            ]
        flat = tf.nest.flatten(self.x)
        watched = self._watched_inputs
        grads = self._input_tape.gradient(target, [t for t, w in zip(flat, watched) if w])
        it = iter(grads)
        merged = [next(it) if w else None for w in watched]
        return tf.nest.pack_sequence_as(self.x, merged)


_Term = TypeVar("_Term", bound="Term")


class Term(ConfigRepr):
    """Base class of everything passed to `compile(loss_terms=[...])`.

    Subclasses implement `call(context) -> scalar` (the unweighted value) and
    extend `get_config()`. A term is immutable configuration; what it
    resolves in one model (a layer, say) is returned by `bind(model)`, kept
    by that model, and handed back as `context.state`. One term object can
    be compiled into several models.

    Args:
        weight: a number, a `keras.optimizers.schedules.LearningRateSchedule`,
            or a callable `step -> number`, evaluated at the optimizer's step.
        name: the name logged in History and the progress bar.
        in_validation: whether `evaluate()`/validation computes the term,
            logs it as `val_<name>` and counts it in `val_loss`.

    Example:
    ```python
    class MeanOutput(kt.Term):
        def call(self, context):
            return keras.ops.mean(context.y_pred)
    ```
    """

    needs_input_gradients = False

    def __init__(
        self, weight: Weight = 1.0, name: str | None = None, in_validation: bool = True
    ) -> None:
        self.weight = validate_weight(weight)
        if name is None:
            name = _default_name(type(self).__name__)
        if not isinstance(name, str) or not name:
            raise ValueError(f"`name` must be a non-empty string. Received: name={name!r}")
        self.name = name
        self.in_validation = validation.boolean(in_validation, "in_validation")

    def bind(self, model: keras.Model, tree: LayerTree | None = None) -> Any:
        """Resolves what the term needs from `model`; returns this model's state.

        Raises ValueError (before any weight changes) if the model lacks
        something the term needs. The base term needs nothing: it checks that
        a schedule or callable weight gives a finite number at step 0.

        Args:
            model: the model the term is compiled into.
            tree: optional `keras_tapeops.paths.LayerTree(model)` to reuse.

        Returns:
            The state handed back as `context.state` (None here).
        """
        if callable(self.weight):
            value = self.weight(0)
            try:
                validation.finite_number(float(value), "weight(0)")
            except (TypeError, ValueError) as error:
                raise ValueError(
                    f"Loss term {self.name!r}: its weight schedule must give a "
                    f"finite number. Received: weight(0)={value!r}"
                ) from error
        return None

    def layers_to_capture(self, state: Any) -> list[Any]:
        """Layers whose outputs the forward pass must record, given `state`."""
        return []

    def call(self, context: TermContext) -> Any:
        """Returns the unweighted scalar value of the term."""
        raise NotImplementedError(f"{type(self).__name__} must implement call().")

    def weight_at(self, step: Any) -> Any:
        """Returns the weight at optimizer step `step` as a float32 tensor."""
        weight = self.weight
        if isinstance(weight, keras.optimizers.schedules.LearningRateSchedule) or (
            callable(weight)
        ):
            weight = weight(step)
        return ops.cast(weight, "float32")

    def get_config(self) -> dict[str, Any]:
        return {
            "weight": serialize_weight(self.weight),
            "name": self.name,
            "in_validation": self.in_validation,
        }

    @classmethod
    def from_config(cls: type[_Term], config: dict[str, Any]) -> _Term:
        config = dict(config)
        config["weight"] = deserialize_weight(config["weight"])
        return cls(**config)


def weighted_term_values(
    terms: Sequence[tuple[Term, Any]], context: TermContext, step: Any
) -> list[Any]:
    """`weight * value` (float32 scalar) of each term, in order (any backend).

    Args:
        terms: the active `(kt.Term, state)` pairs.
        context: the step's `kt.TermContext` (its `state` is set per term).
        step: the optimizer's step (for scheduled weights).

    Returns:
        A list of float32 scalars.
    """
    values = []
    for term, state in terms:
        context.state = state
        values.append(
            ops.cast(term.weight_at(step), "float32") * ops.cast(term.call(context), "float32")
        )
    context.state = None
    return values


def validate_weight(weight: Any) -> Weight:
    """Checks a term weight: a finite number (NumPy too), a schedule or a callable."""
    if callable(weight) and not isinstance(weight, (numbers.Number, np.generic)):
        return weight
    if isinstance(weight, (bool, np.bool_)) or not isinstance(weight, numbers.Real):
        raise TypeError(
            "`weight` must be a number, a LearningRateSchedule or a callable "
            f"step -> number. Received: weight={weight!r}"
        )
    return validation.finite_number(weight, "weight")


def serialize_weight(weight: Weight) -> Any:
    """A number as is; a schedule or callable through Keras (must load back)."""
    if isinstance(weight, (int, float)):
        return weight
    return selectors.serialize_callable(weight, "weight")


def deserialize_weight(config: Any) -> Weight:
    if isinstance(config, (int, float)):
        return config
    return keras.saving.deserialize_keras_object(config)


def _default_name(class_name):
    out = []
    for i, ch in enumerate(class_name):
        if ch.isupper() and i:
            out.append("_")
        out.append(ch.lower())
    return "".join(out)
