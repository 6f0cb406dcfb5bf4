"""`ActivationPenalty`: an L1/L2 penalty on a layer's outputs from the same forward pass."""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

from keras_tapeops import paths
from keras_tapeops import selectors
from keras_tapeops import validation
from keras_tapeops.paths import LayerTree
from keras_tapeops.registration import register
from keras_tapeops.terms.base import Term
from keras_tapeops.terms.base import TermContext
from keras_tapeops.terms.base import Weight


@register
class ActivationPenalty(Term):
    """Penalizes the outputs of one layer: `l1 * mean(|a|) + l2 * mean(a^2)`.

    The outputs are recorded during the step's single forward pass (the layer
    is never run a second time) and the penalty is computed in float32, also
    under mixed precision.

    Every output tensor the layer produces in the pass counts: a layer with
    several outputs, or one called several times (a shared layer), contributes
    one `l1 * mean(|a|) + l2 * mean(a^2)` per output tensor (each mean taken
    over that tensor's elements) and these are summed.

    Args:
        layer: the layer's path from the outer model (`"backbone/dense_1"`,
            the grammar of `keras_tapeops.paths`), a bare name found at any
            depth (it must name one layer), or the layer object itself.
        l1: non-negative coefficient of `mean(|a|)`.
        l2: non-negative coefficient of `mean(a^2)`. `l1` and `l2` cannot
            both be zero.
        name: the name logged in History and the progress bar (default:
            `"activation_penalty_<layer>"`).
        in_validation: whether validation/`evaluate()` computes the term,
            logs it as `val_<name>` and counts it in `val_loss`.
        weight: an extra factor: a number, a `LearningRateSchedule` or a
            callable `step -> number` of the optimizer step.

    Returns:
        A term for `compile(loss_terms=[...])`. The layer is resolved when
        training starts; an unknown layer raises ValueError listing the
        available layer names before any weight changes.

    Example:
    ```python
    model.compile(optimizer="adam", loss="mse", loss_terms=[
        kt.ActivationPenalty("dense_1", l2=1e-3, name="act_l2"),
        kt.ActivationPenalty("backbone/block_1", l1=1e-4),
    ])
    ```
    """

    def __init__(
        self,
        layer: str | keras.layers.Layer,
        l1: float = 0.0,
        l2: float = 0.0,
        name: str | None = None,
        in_validation: bool = True,
        weight: Weight = 1.0,
    ) -> None:
        if not (
            isinstance(layer, keras.layers.Layer) or isinstance(layer, str) and layer.strip("/")
        ):
            raise TypeError(
                "`layer` must be a layer name, a path such as "
                f"'backbone/dense', or a keras Layer. Received: layer={layer!r}"
            )
        if isinstance(layer, str):
            layer = layer.strip("/")
        if isinstance(layer, str) and paths.is_glob(layer):
            raise ValueError(f"`layer` must name one layer, not a glob. Received: layer={layer!r}")
        self.layer = layer
        self.l1 = validation.non_negative_number(l1, "l1")
        self.l2 = validation.non_negative_number(l2, "l2")
        if self.l1 == 0 and self.l2 == 0:
            raise ValueError(
                f"ActivationPenalty needs a positive `l1` or `l2`. Received: l1={l1!r}, l2={l2!r}"
            )
        if name is None:
            label = layer.name if isinstance(layer, keras.layers.Layer) else layer
            name = "activation_penalty_" + label.replace("/", "_")
        super().__init__(weight=weight, name=name, in_validation=in_validation)

    def bind(self, model: keras.Model, tree: LayerTree | None = None) -> keras.layers.Layer:
        """Finds the layer in `model`; returns it (the term's state for `model`).

        Raises ValueError listing the layer paths if the layer is not in
        `model` (or a bare name is shared by several layers).
        """
        super().bind(model, tree)
        tree = tree or paths.LayerTree(model)
        try:
            return tree.resolve_layer(self.layer)
        except ValueError as error:
            layer = self.layer
            received = (
                f"<{type(layer).__name__} name={layer.name!r}>"
                if isinstance(layer, keras.layers.Layer)
                else repr(layer)
            )
            raise ValueError(
                f"ActivationPenalty {self.name!r}: {error}. Received: layer={received}"
            ) from None

    def layers_to_capture(self, state: Any) -> list[Any]:
        return [state]

    def call(self, context: TermContext) -> Any:
        layer = context.state
        outputs = [t for t in context.activations(layer) if keras.backend.is_float_dtype(t.dtype)]
        if not outputs:
            raise ValueError(
                f"ActivationPenalty {self.name!r}: layer {layer.name!r} produced "
                "no floating-point output in the forward pass (is it used by "
                f"the model's call()?). Received: layer={self.layer!r}"
            )
        total = ops.zeros((), "float32")
        for tensor in outputs:
            a = ops.cast(tensor, "float32")
            if self.l1:
                total += self.l1 * ops.mean(ops.abs(a))
            if self.l2:
                total += self.l2 * ops.mean(ops.square(a))
        return total

    def get_config(self) -> dict[str, Any]:
        """The layer is saved by its path in the model being saved (or its name)."""
        config = super().get_config()
        layer = self.layer
        if isinstance(layer, keras.layers.Layer):
            layer = selectors.serialize_selector(layer)["layer_path"]
        config.update({"layer": layer, "l1": self.l1, "l2": self.l2})
        return config
