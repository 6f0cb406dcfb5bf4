"""`LayerTree.resolve_layer`: the one layer lookup of grad_cam and ActivationPenalty.

Expected layers are taken from the models built here (`get_layer`), not
computed with `keras_tapeops.paths`.
"""

import keras
import pytest

import keras_tapeops as kt
from keras_tapeops.paths import LayerTree


def make_model():
    """`outer` holds a Sequential `backbone` (layers `d`, `hidden`) and a Dense `d`."""
    backbone = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(4, name="d"), keras.layers.Dense(4, name="hidden")],
        name="backbone",
    )
    inputs = keras.Input((3,))
    outputs = keras.layers.Dense(2, name="d")(backbone(inputs))
    return keras.Model(inputs, outputs, name="outer")


def test_resolves_a_path_a_bare_name_and_a_layer_object():
    model = make_model()
    backbone = model.get_layer("backbone")
    tree = LayerTree(model)
    assert tree.resolve_layer("backbone/d") is backbone.get_layer("d")
    assert tree.resolve_layer("hidden") is backbone.get_layer("hidden")
    assert tree.resolve_layer("/backbone/hidden/") is backbone.get_layer("hidden")
    assert tree.resolve_layer(backbone.get_layer("hidden")) is backbone.get_layer("hidden")
    assert tree.resolve_layer(model.layers[-1]) is model.layers[-1]


def test_errors_name_the_layer_and_list_the_paths():
    tree = LayerTree(make_model())
    paths = r"\['backbone', 'backbone/d', 'backbone/hidden', 'd'\]"
    with pytest.raises(
        ValueError,
        match=r"^The layer 'stray' is not part of the model 'outer'\. "
        rf"Available layer paths: {paths}$",
    ):
        tree.resolve_layer(keras.layers.Dense(1, name="stray"))
    with pytest.raises(
        ValueError, match=rf"^No layer 'nope' in model 'outer'\. Available layer paths: {paths}$"
    ):
        tree.resolve_layer("nope")
    with pytest.raises(ValueError, match=r"Several layers .* are named 'd' \(\['backbone/d', 'd'\]\)"):
        tree.resolve_layer("d")
    with pytest.raises(TypeError, match=r"Received: ref=3$"):
        tree.resolve_layer(3)


def test_callers_add_their_own_received():
    model = make_model()
    stray = keras.layers.Dense(1, name="stray")
    with pytest.raises(
        ValueError,
        match=r"^ActivationPenalty 'act': The layer 'stray' is not part of the model 'outer'\. "
        r"Available layer paths: .*\. Received: layer=<Dense name='stray'>$",
    ):
        kt.ActivationPenalty(stray, l2=1.0, name="act").bind(model)
    with pytest.raises(
        ValueError,
        match=r"^The layer 'stray' is not part of the model 'outer'\. .*Received: layer=<Dense",
    ):
        kt.attribution.grad_cam(model, keras.ops.ones((1, 3)), layer=stray)
