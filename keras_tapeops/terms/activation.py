"""`ActivationPenalty`: an L1/L2 penalty on a layer's outputs from the same forward pass."""

import numbers

import keras
import tensorflow as tf

from keras_tapeops import _keras_private as private
from keras_tapeops.registration import register
from keras_tapeops.terms.base import Term


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
        layer: the layer's name (searched at any depth), a path through
            nested sub-models and layers such as `"backbone/dense_1"`, or the
            layer object itself.
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
        kt.ActivationPenalty("backbone/dense", l1=1e-4),
    ])
    ```
    """

    def __init__(
        self, layer, l1=0.0, l2=0.0, name=None, in_validation=True, weight=1.0
    ):
        self._layer_object = None
        if isinstance(layer, keras.layers.Layer):
            self._layer_object = layer
            layer = layer.name
        if not isinstance(layer, str) or not layer.strip("/"):
            raise TypeError(
                "`layer` must be a layer name, a path such as "
                f"'backbone/dense', or a keras Layer. Received: layer={layer!r}"
            )
        self.layer = layer.strip("/")
        self.l1 = _validate_coefficient(l1, "l1")
        self.l2 = _validate_coefficient(l2, "l2")
        if self.l1 == 0 and self.l2 == 0:
            raise ValueError(
                "ActivationPenalty needs a positive `l1` or `l2`. "
                f"Received: l1={l1!r}, l2={l2!r}"
            )
        if name is None:
            name = "activation_penalty_" + self.layer.replace("/", "_")
        super().__init__(weight=weight, name=name, in_validation=in_validation)
        self._resolved = None

    def build(self, model):
        """Finds the layer in `model`; raises ValueError listing the layer names."""
        if self._layer_object is not None:
            path = find_path(model, self._layer_object)
            if path is None:
                raise ValueError(
                    f"ActivationPenalty {self.name!r}: the given layer "
                    f"{self._layer_object.name!r} is not part of the model "
                    f"{model.name!r}. Available layers: {layer_paths(model)}. "
                    f"Received: layer={self._layer_object!r}"
                )
            self.layer = path
            self._resolved = self._layer_object
        else:
            self._resolved = find_layer(model, self.layer, self.name)

    def layers_to_capture(self):
        return [self._resolved] if self._resolved is not None else []

    def call(self, context):
        outputs = [
            t for t in context.activations(self._resolved)
            if tf.as_dtype(t.dtype).is_floating
        ]
        if not outputs:
            raise ValueError(
                f"ActivationPenalty {self.name!r}: layer {self.layer!r} produced "
                "no floating-point output in the forward pass (is it used by "
                f"the model's call()?). Received: layer={self.layer!r}"
            )
        total = tf.constant(0.0, "float32")
        for tensor in outputs:
            a = tf.cast(tensor, "float32")
            if self.l1:
                total += self.l1 * tf.reduce_mean(tf.abs(a))
            if self.l2:
                total += self.l2 * tf.reduce_mean(tf.square(a))
        return total

    def get_config(self):
        config = super().get_config()
        config.update({"layer": self.layer, "l1": self.l1, "l2": self.l2})
        return config


def find_layer(model, spec, term_name="ActivationPenalty"):
    """Returns the layer `spec` (a name or a "/"-separated path) of `model`.

    Args:
        model: the model to search.
        spec: a layer name (matched at any depth; must be unique) or a path
            of names from the model down, e.g. `"backbone/block/dense"`.
        term_name: used in error messages.

    Returns:
        The layer. Raises ValueError listing the available layer paths when
        nothing (or more than one layer, for a bare name) matches.

    Example:
    ```python
    find_layer(model, "backbone/dense_1")
    ```
    """
    paths = _all_paths(model)
    if "/" in spec:
        matches = [layer for path, layer in paths if path == spec]
    else:
        matches = [layer for path, layer in paths if layer.name == spec]
        unique = {id(layer): layer for layer in matches}
        matches = list(unique.values())
    if len(matches) == 1:
        return matches[0]
    available = [path for path, _ in paths]
    if not matches:
        raise ValueError(
            f"Loss term {term_name!r}: no layer {spec!r} in model "
            f"{model.name!r}. Available layers: {available}. "
            f"Received: layer={spec!r}"
        )
    found = [path for path, layer in paths if layer.name == spec]
    raise ValueError(
        f"Loss term {term_name!r}: several layers are named {spec!r} "
        f"({found}); give the path instead. Received: layer={spec!r}"
    )


def find_path(model, target):
    """Returns the "/"-separated path of layer `target` in `model`, or None."""
    for path, layer in _all_paths(model):
        if layer is target:
            return path
    return None


def layer_paths(model):
    """Returns the paths of every layer in `model`, depth first."""
    return [path for path, _ in _all_paths(model)]


def _all_paths(model):
    out = []
    seen = set()

    def visit(layer, prefix):
        for child in _children(layer):
            if isinstance(child, keras.layers.InputLayer) or id(child) in seen:
                continue
            seen.add(id(child))
            path = f"{prefix}{child.name}"
            out.append((path, child))
            visit(child, path + "/")

    visit(model, "")
    return out


def _children(layer):
    if isinstance(layer, keras.Model):
        return list(layer.layers)
    return private.direct_sublayers(layer)


def _validate_coefficient(value, name):
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not value >= 0
        or value == float("inf")
    ):
        raise ValueError(
            f"`{name}` must be a non-negative finite number. "
            f"Received: {name}={value!r}"
        )
    return float(value)
