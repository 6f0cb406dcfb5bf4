"""The `GradientTransform` protocol: immutable configuration plus per-model state.

A transform object is configuration: its arguments are validated once and
never change, so one object can be compiled into several models. What a
model resolves from it lives with that model:

- `bind(model, variables)` resolves the transform against one model's
  trainable variables and returns a `TransformState` (at least `selected`,
  a list of bools aligned with `variables`). It raises for a selector that
  names nothing in the model. The step keeps the state; the transform keeps
  nothing.
- `transform(grads, variables, state)` maps a list of gradients (one per
  variable, `None` and `tf.IndexedSlices` allowed) to a new list of the same
  length. Gradients are always true gradients: unscaled under mixed
  precision and summed over replicas under `tf.distribute`.

Three optional parts make a transform stateful or observable (the built-in
`SkipNonFinite` and `LogGradientNorm` use them):

- In `bind`, `state.add_variable(...)` creates a training-state variable
  (created in the model's strategy scope; like the optimizer's state it is
  not in `model.weights`, so `get_weights`/`set_weights` and weight files
  stay the stock model's, but `model.save`, `save_weights` and
  `BackupAndRestore` write it and loading restores it: see
  `keras_tapeops.training_state.TrainingState`), and `state.add_metric(...)`
  a metric logged in History, the progress bar and TensorBoard under its
  name (updated in the graph: no host synchronization per step).
- `keep_step(grads, variables, state)` returns None (the default) or a
  scalar bool tensor: False skips the whole optimizer step. Every gate sees
  the true gradients before any transform; they are equal on every replica,
  so every replica takes the same decision.
- `after_apply(variables, previous, state)` runs after the optimizer step
  (when `needs_previous_values` is True, `previous` holds the selected
  variables' values before it; else None).
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from typing import Any
from typing import Sequence
from typing import TypeVar

import keras

from keras_tapeops import selectors
from keras_tapeops.config_repr import ConfigRepr
from keras_tapeops.paths import LayerTree

if TYPE_CHECKING:
    import tensorflow as tf


class TransformState:
    """What one model resolved for one transform.

    Attributes:
        selected: list of bools aligned with the variables the transform
            was bound to: which ones it acts on.

    Subclasses of `GradientTransform` may return a subclass with more fields.

    Example:
    ```python
    state = kt.ClipByNorm(1.0, where="head*").bind(model, model.trainable_variables)
    state.selected  # [False, False, True, True]
    ```
    """

    def __init__(self, selected: Sequence[bool]) -> None:
        self.selected = list(selected)
        self.variables: dict[str, Any] = {}  # name -> keras.Variable: training state, not weights
        self.metrics: dict[str, Any] = {}  # name -> keras.metrics.Metric, logged

    def add_variable(self, name: str, initial_value: Any, dtype: str = "float32") -> Any:
        """Creates a training-state variable saved with the model; returns it.

        It is not one of `model.weights`; it is saved by `model.save` and
        `save_weights` (so `BackupAndRestore`) under the key
        `"<position in gradient_transforms>.<class>.<name>"`.

        Call from `bind` (the model's strategy scope is active there). Under
        `tf.distribute` every replica computes the same value from the same
        true gradients, so the first replica's write is kept.

        Args:
            name: a name unique within this transform.
            initial_value: a number or array.
            dtype: the variable's dtype.

        Returns:
            A `keras.Variable`.
        """
        variable = keras.Variable(
            initial_value,
            dtype=dtype,
            trainable=False,
            name=name,
            aggregation="only_first_replica",
        )
        self.variables[name] = variable
        return variable

    def add_metric(self, metric: Any) -> Any:
        """Registers a `keras.metrics.Metric` logged under `metric.name`; returns it."""
        self.metrics[metric.name] = metric
        return metric

    def __repr__(self) -> str:
        return f"TransformState(selected={self.selected})"


_Transform = TypeVar("_Transform", bound="GradientTransform")


class GradientTransform(ConfigRepr):
    """Base class for gradient transforms passed to `compile(gradient_transforms=)`.

    Subclasses implement `transform(grads, variables, state)` and extend
    `get_config()`; `bind` may be extended to resolve more per-model state.

    Args:
        where: selector of the variables this transform acts on (see
            `keras_tapeops.selectors`). None selects every trainable variable.

    Example:
    ```python
    class Scale(kt.GradientTransform):
        def __init__(self, factor, where=None):
            super().__init__(where=where)
            self.factor = factor

        def transform(self, grads, variables, state):
            return [g * self.factor if on and g is not None else g
                    for g, on in zip(grads, state.selected)]

        def get_config(self):
            return {"factor": self.factor, **super().get_config()}
    ```
    """

    needs_previous_values = False  # after_apply gets the pre-step values

    def __init__(self, where: selectors.Selector = None) -> None:
        self.where = selectors.validate_selector(where)

    def bind(
        self, model: keras.Model, variables: Sequence[keras.Variable], tree: LayerTree | None = None
    ) -> TransformState:
        """Resolves `where=` against `model` and its trainable `variables`.

        Args:
            model: the Keras model being trained.
            variables: the list of trainable variables, in gradient order.
            tree: optional `keras_tapeops.paths.LayerTree(model)` to reuse.

        Returns:
            A `TransformState` for this model. `self` is not changed.
        """
        return TransformState(selectors.select(self.where, model, variables, tree))

    def keep_step(
        self, grads: Sequence[Any], variables: Sequence[keras.Variable], state: TransformState
    ) -> tf.Tensor | None:
        """None, or a scalar bool tensor: False skips this optimizer step."""
        return None

    def after_apply(
        self, variables: Sequence[keras.Variable], previous: Any, state: TransformState
    ) -> None:
        """Runs after the optimizer step (e.g. to log the update). Returns None."""
        return None

    def transform(
        self, grads: Sequence[Any], variables: Sequence[keras.Variable], state: TransformState
    ) -> list[Any]:
        """Returns the transformed list of gradients (same length as `grads`)."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement transform(grads, variables, state)."
        )

    def __call__(
        self,
        grads: Sequence[Any],
        variables: Sequence[keras.Variable],
        state: TransformState | None = None,
    ) -> list[Any]:
        """Applies the transform. Without `state`, only `where=None` works (all selected)."""
        if state is None:
            if self.where is not None:
                raise ValueError(
                    f"{type(self).__name__} with where={selectors.describe(self.where)} "
                    "needs the state of a model: call "
                    "transform(grads, variables, transform.bind(model, variables))."
                )
            state = TransformState([True] * len(grads))
        if len(state.selected) != len(grads):
            raise ValueError(
                f"{type(self).__name__} was bound to {len(state.selected)} "
                f"variables but received {len(grads)} gradients."
            )
        return self.transform(grads, variables, state)

    def get_config(self) -> dict[str, Any]:
        """Returns the constructor arguments; `where` must be serializable."""
        return {"where": selectors.serialize_selector(self.where)}

    @classmethod
    def from_config(cls: type[_Transform], config: dict[str, Any]) -> _Transform:
        """Rebuilds the transform from `get_config()` output."""
        config = dict(config)
        if "where" in config:
            config["where"] = selectors.deserialize_selector(config["where"])
        return cls(**config)


def with_hook(
    bound: Sequence[tuple[GradientTransform, TransformState]], method: str
) -> list[tuple[GradientTransform, TransformState]]:
    """The bound pairs whose transform overrides `method` (`"keep_step"`, `"after_apply"`).

    Args:
        bound: `(transform, state)` pairs.
        method: the name of a `GradientTransform` hook.

    Returns:
        The pairs, in order, whose class defines its own `method`.

    Example:
    ```python
    gates = with_hook(bound, "keep_step")  # e.g. [(kt.SkipNonFinite(), state)]
    ```
    """
    return [
        (t, s)
        for t, s in bound
        if getattr(type(t), method) is not getattr(GradientTransform, method)
    ]


def apply_in_order(
    bound: Sequence[tuple[GradientTransform, TransformState]],
    grads: Sequence[Any],
    variables: Sequence[keras.Variable],
) -> list[Any]:
    """Applies bound transforms to `grads` one after another, in list order.

    Args:
        bound: a list of `(transform, state)` pairs (states from `bind`).
        grads: list of gradients, one per variable (None allowed).
        variables: the matching variables.

    Returns:
        The list of transformed gradients.

    Example:
    ```python
    clips = [kt.ClipByNorm(1.0), kt.ClipByValue(0.5, where="head")]
    bound = [(t, t.bind(model, variables)) for t in clips]
    grads = apply_in_order(bound, grads, variables)
    ```
    """
    grads = list(grads)
    for transform, state in bound:
        grads = list(transform(grads, variables, state))
    return grads


def keep_step_decision(
    bound: Sequence[tuple[GradientTransform, TransformState]],
    grads: Sequence[Any],
    variables: Sequence[Any],
) -> Any:
    """The AND of the bound gates' `keep_step` decisions (any backend).

    Args:
        bound: `(transform, state)` pairs (only those with a gate decide).
        grads: the true gradients, one per variable.
        variables: the matching variables (or their values).

    Returns:
        A scalar bool tensor, or None when no gate decides.

    Example:
    ```python
    keep = keep_step_decision(bound, grads, variables)  # e.g. kt.SkipNonFinite's
    ```
    """
    keep = None
    for transform, state in with_hook(bound, "keep_step"):
        decision = transform.keep_step(grads, variables, state)
        if decision is not None:
            decision = keras.ops.cast(decision, "bool")
            keep = decision if keep is None else keras.ops.logical_and(keep, decision)
    return keep


def after_apply_in_order(
    bound: Sequence[tuple[GradientTransform, TransformState]],
    new_values: Sequence[Any],
    old_values: Sequence[Any],
) -> None:
    """Runs the bound transforms' `after_apply` hooks on a stateless step's values.

    Args:
        bound: `(transform, state)` pairs (only those with a hook run).
        new_values: the selected variables' values after the step.
        old_values: their values before it (handed, selected, to a transform
            with `needs_previous_values`).

    Example:
    ```python
    after_apply_in_order(bound, new_trainable, trainable)  # e.g. kt.LogUpdateRatio
    ```
    """
    for transform, state in with_hook(bound, "after_apply"):
        previous = None
        if transform.needs_previous_values:
            previous = [w if on else None for w, on in zip(old_values, state.selected)]
        transform.after_apply(list(new_values), previous, state)
