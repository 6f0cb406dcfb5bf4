"""`LossTerm`: a user function `fn(model, x, y, y_pred) -> scalar` added to the loss."""

from __future__ import annotations

from typing import Any
from typing import Callable
from typing import Sequence
from typing import TYPE_CHECKING

import keras
from keras import ops

from keras_tapeops import paths
from keras_tapeops import selectors
from keras_tapeops.paths import LayerTree
from keras_tapeops.registration import register
from keras_tapeops.terms.base import Term
from keras_tapeops.terms.base import TermContext
from keras_tapeops.terms.base import Weight

if TYPE_CHECKING:
    from typing_extensions import Self


@register
class LossTerm(Term):
    """Adds `weight * fn(model, x, y, y_pred)` to the loss inside the training tape.

    `fn` sees the step's batch and the outputs of its single forward pass, so
    it can combine predictions, labels, inputs and the model's variables. Its
    value is cast to float32.

    Args:
        fn: a callable `fn(model, x, y, y_pred) -> scalar tensor`. To save a
            model compiled with this term, register `fn` with
            `@keras.saving.register_keras_serializable(package=...)`.
        weight: a number, a `keras.optimizers.schedules.LearningRateSchedule`
            or a callable `step -> number` of the optimizer step.
        name: the name logged in History and the progress bar (default: the
            function's name, or `"loss_term"`).
        in_validation: whether validation/`evaluate()` computes the term,
            logs it as `val_<name>` and counts it in `val_loss`.
        layers: None, or a list of layer paths (`"encoder/z_mean"`, or a bare
            name found at any depth) whose outputs `fn` also receives, in
            that order, after `y_pred`: `fn(model, x, y, y_pred, *outputs)`.
            They are recorded during the step's single forward pass (the
            layers are not called again): a layer's output tensor, or a list
            of tensors for a layer called several times or with several
            outputs. An unknown path raises ValueError listing the model's
            layer paths when training starts.

    Returns:
        A term for `compile(loss_terms=[...])`.

    Example:
    ```python
    @keras.saving.register_keras_serializable(package="my_project")
    def smoothness(model, x, y, y_pred):
        return keras.ops.mean(keras.ops.square(y_pred[:, 1:] - y_pred[:, :-1]))

    model.compile(optimizer="adam", loss="mse",
                  loss_terms=[kt.LossTerm(smoothness, weight=0.1)])

    # The keras.io VAE's KL term, from the encoder's two heads:
    def kl_divergence(model, x, y, y_pred, z_mean, z_log_var):
        kl = -0.5 * (1 + z_log_var - z_mean**2 - keras.ops.exp(z_log_var))
        return keras.ops.mean(keras.ops.sum(kl, axis=1))

    kl_term = kt.LossTerm(kl_divergence, layers=["z_mean", "z_log_var"])
    # vae.compile(optimizer="adam", loss=reconstruction, loss_terms=[kl_term])
    # (the whole VAE: docs/terms.md)
    ```
    """

    layers = None  # the layer paths whose outputs `fn` receives (see `layers=`)

    def __init__(
        self,
        fn: Callable[..., Any],
        weight: Weight = 1.0,
        name: str | None = None,
        in_validation: bool = True,
        layers: Sequence[str | keras.layers.Layer] | None = None,
    ) -> None:
        if not callable(fn):
            raise TypeError(
                f"`fn` must be a callable fn(model, x, y, y_pred) -> scalar. Received: fn={fn!r}"
            )
        if layers is not None and (
            isinstance(layers, str)
            or not isinstance(layers, (list, tuple))
            or not all(isinstance(path, str) and path for path in layers)
        ):
            raise TypeError(
                "`layers` must be None or a list of layer paths (strings), "
                f"e.g. ['z_mean', 'z_log_var']. Received: layers={layers!r}"
            )
        self.fn = fn
        if name is None:
            fn_name = getattr(fn, "__name__", "")
            name = fn_name if fn_name.isidentifier() else "loss_term"
        super().__init__(weight=weight, name=name, in_validation=in_validation)
        if layers is not None:  # an instance attribute only when given (repr, config)
            self.layers = list(layers)

    def bind(
        self, model: keras.Model, tree: LayerTree | None = None
    ) -> tuple[keras.layers.Layer, ...]:
        """Checks the weight and finds `layers` in `model`; returns them (a tuple)."""
        super().bind(model, tree)
        if not self.layers:
            return ()
        tree = tree or paths.LayerTree(model)
        found = []
        for path in self.layers:
            try:
                found.append(tree.resolve_layer(path))
            except ValueError as error:
                raise ValueError(
                    f"LossTerm {self.name!r}: {error}. Received: layers={self.layers!r}"
                ) from None
        return tuple(found)

    def layers_to_capture(self, state: Any) -> list[Any]:
        return list(state or ())

    def call(self, context: TermContext) -> Any:
        outputs = []
        for path, layer in zip(self.layers or (), context.state or ()):
            tensors = context.activations(layer)
            if not tensors:
                raise ValueError(
                    f"LossTerm {self.name!r}: layer {path!r} produced no output "
                    "in the forward pass (is it used by the model's call()?). "
                    f"Received: layers={self.layers!r}"
                )
            outputs.append(tensors[0] if len(tensors) == 1 else tensors)
        value = self.fn(context.model, context.x, context.y, context.y_pred, *outputs)
        value = ops.convert_to_tensor(value)
        if len(value.shape) != 0:
            raise ValueError(
                f"LossTerm {self.name!r}: `fn` must return a scalar. "
                f"Received: a value of shape {value.shape}"
            )
        return ops.cast(value, "float32")

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config["fn"] = selectors.serialize_callable(self.fn, "fn", owner=f"LossTerm {self.name!r}")
        if self.layers is not None:
            config["layers"] = list(self.layers)
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Self:
        config = dict(config)
        config["fn"] = keras.saving.deserialize_keras_object(config["fn"])
        return super().from_config(config)
