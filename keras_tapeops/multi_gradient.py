"""Options that take more than one gradient per step, and their per-model state.

`task_balancing` (per-task rows), `differential_privacy` (per-example rows)
and `sample_selection` (per-example losses) change how one batch becomes one
gradient. Each is immutable configuration (`MultiGradientOption`); what a model
resolves from it is a `MultiGradientState`, the step's "gradient engine":

- `batch_gradients(model, x, y, sample_weight, loss_multiplier)` replaces the
  single forward/backward pass of `TapeOpsMixin.batch_gradients`. It returns
  `(grads, y_pred)` exactly as that hook does: one gradient per trainable
  variable, of the optimizer-scaled loss, per replica, such that the sum over
  replicas is the step's gradient (micro-batches, SAM and accumulation call it
  like the stock pass);
- `finalize(model, grads, variables)` runs once per applied optimizer step on
  the true gradients (unscaled, summed over replicas), before the gradient
  transforms: e.g. DP-SGD's noise;
- `metrics` (logged in History in training only) and `variables` (training
  state saved with the model, not listed in `model.weights`).

Rows (a Jacobian of a vector of objectives) are computed in one place,
`keras_tapeops.rows`; small aggregators reduce them.
"""

from __future__ import annotations

from typing import Any
from typing import TYPE_CHECKING

import keras

from keras_tapeops.config_repr import ConfigRepr
from keras_tapeops.paths import LayerTree

if TYPE_CHECKING:
    from typing_extensions import Self

# The compile() arguments that take a `MultiGradientOption`, in pipeline order.
MULTI_GRADIENT_OPTIONS = ("task_balancing", "differential_privacy", "sample_selection")


class MultiGradientOption(ConfigRepr):
    """Base class of `task_balancing`, `differential_privacy` and `sample_selection`.

    Subclasses set `option_name` (the `compile()` argument they are given as),
    validate their arguments in `__init__`, and implement `bind` and
    `get_config`.

    Example:
    ```python
    class Plain(MultiGradientOption):
        option_name = "task_balancing"
        def bind(self, model, tree):
            return MultiGradientState()
    ```
    """

    option_name: str | None = None

    def bind(self, model: keras.Model, tree: LayerTree) -> MultiGradientState:
        """Returns this option's `MultiGradientState` for `model`.

        Called once per compilation, inside the model's strategy scope and
        before stock `compile()` (raise here to refuse the model; nothing is
        changed yet). Variables may not exist yet: see
        `MultiGradientState.bind_variables`.

        Args:
            model: the model being compiled.
            tree: `paths.LayerTree(model)`.

        Returns:
            A `MultiGradientState`.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement bind().")

    def combines_with(self, name: str, value: Any) -> str | None:
        """Whether this option may be compiled together with option `name`.

        Args:
            name: another compile option that is set (`"sharpness_aware"`, or
                one of `MULTI_GRADIENT_OPTIONS`).
            value: its value.

        Returns:
            None if the combination is supported, else a short reason (str).
            The default refuses every other multi-gradient option and SAM.
        """
        return "both change how one batch becomes one gradient; that combination is not supported"

    def get_config(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Self:
        return cls(**config)


def require_override(option, kind, method, default, does, argument):
    """Refuses (at `compile()`) a user subclass that leaves `method` unimplemented.

    Args:
        option: the option being bound (an instance of a user subclass).
        kind: the public base's name, e.g. `"Aggregator"`.
        method: the method's signature as shown, e.g. `"weights(gramian, context)"`.
        default: the base's unimplemented function the subclass must replace.
        does: what the method returns, for the message.
        argument: the compile argument the option was passed as.

    Raises:
        TypeError: naming the class, the method and the compile argument.
    """
    name = method.split("(")[0]
    if getattr(type(option), name, None) is default:
        raise TypeError(
            f"{type(option).__name__} is a {kind} but does not implement "
            f"`{method}`, which {does}. Received: {argument}={option!r}"
        )


class MultiGradientState:
    """What one model resolved from a `MultiGradientOption` (its gradient engine).

    Attributes:
        metrics: dict logged name -> `keras.metrics.Metric`, logged in training
            (a metric whose `result()` is a dict appears under each name it logs).
        variables: list of variables saved as the model's training state.
    """

    def __init__(self):
        self.metrics = {}
        self.variables = []

    def bind_variables(self, model, variables, tree):
        """Called when the model's trainable variables are known or change."""

    def check_batch(self, model, x, y, sample_weight):
        """Raises for a batch this option cannot use (runs at trace time)."""

    def batch_gradients(self, model, x, y, sample_weight, loss_multiplier=None):
        """One (micro-)batch -> `(grads, y_pred)`, as `TapeOpsMixin.batch_gradients`."""
        return model.single_pass_gradients(x, y, sample_weight, loss_multiplier)

    def finalize(self, model, grads, variables):
        """True gradients of one applied step -> the gradients transforms see."""
        return grads


def check_combinations(options):
    """Refuses unsupported pairs of multi-gradient options (and SAM).

    Args:
        options: a `TapeOpsOptions` whose multi-gradient options are set.

    Returns:
        None. Raises ValueError naming both options and what was received.
    """
    present = [
        (name, getattr(options, name))
        for name in MULTI_GRADIENT_OPTIONS
        if getattr(options, name) is not None
    ]
    others = list(present)
    if options.sharpness_aware is not None:
        others.append(("sharpness_aware", options.sharpness_aware))
    for name, option in present:
        for other_name, other in others:
            if other_name == name:
                continue
            reason = option.combines_with(other_name, other)
            if reason is not None:
                raise ValueError(
                    f"`{name}` cannot be combined with `{other_name}`: {reason}. "
                    f"Received: {name}={option!r}, {other_name}={other!r}"
                )
