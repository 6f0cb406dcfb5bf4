"""Tests of `where=` selector resolution, errors and serialization."""

import keras
import pytest

from keras_tapeops import selectors


def make_model():
    """Functional model with a nested Sequential sub-model named "backbone"."""
    backbone = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(4, name="b1"),
         keras.layers.Dense(4, name="b2")],
        name="backbone",
    )
    inputs = keras.Input((3,))
    outputs = keras.layers.Dense(1, name="head")(backbone(inputs))
    return keras.Model(inputs, outputs, name="net")


def selected_paths(where, model):
    variables = model.trainable_variables
    mask = selectors.select(where, model, variables)
    return [v.path for v, on in zip(variables, mask) if on]


ALL = ["backbone/b1/kernel", "backbone/b1/bias", "backbone/b2/kernel",
       "backbone/b2/bias", "head/kernel", "head/bias"]


def test_paths_are_what_the_tests_assume():
    assert [v.path for v in make_model().trainable_variables] == ALL


def test_none_selects_everything():
    assert selected_paths(None, make_model()) == ALL


@pytest.mark.parametrize(
    "where, expected",
    [
        ("head*", ["head/kernel", "head/bias"]),
        ("backbone", ALL[:4]),  # an enclosing sub-model's name
        ("b2", ["backbone/b2/kernel", "backbone/b2/bias"]),  # nested layer
        ("*/kernel", ["backbone/b1/kernel", "backbone/b2/kernel", "head/kernel"]),
        ("backbone/b1/*", ["backbone/b1/kernel", "backbone/b1/bias"]),
        (["b1", "head"], ["backbone/b1/kernel", "backbone/b1/bias",
                          "head/kernel", "head/bias"]),
        (("*bias",), ["backbone/b1/bias", "backbone/b2/bias", "head/bias"]),
    ],
)
def test_globs(where, expected):
    assert selected_paths(where, make_model()) == expected


def test_glob_does_not_match_a_bare_variable_name():
    """Globs match layer names and whole paths, not the last path part alone."""
    with pytest.raises(ValueError, match="selects no trainable variable"):
        selected_paths("kernel", make_model())


def test_layer_selects_its_variables_nested_included():
    model = make_model()
    assert selected_paths(model.get_layer("backbone"), model) == ALL[:4]
    assert selected_paths(model.get_layer("head"), model) == ALL[4:]


def test_callable():
    model = make_model()
    assert selected_paths(lambda v: v.shape == (4, 4), model) == [
        "backbone/b2/kernel"
    ]


def test_layer_by_name_matches_the_layer():
    model = make_model()
    assert selected_paths(selectors.LayerPath("backbone"), model) == ALL[:4]
    assert selected_paths(selectors.LayerPath("b1"), model) == ALL[:2]


@pytest.mark.parametrize(
    "where, error, message",
    [
        (3, TypeError, r"Received: where=3 of type int"),
        (1.5, TypeError, r"Received: where=1.5"),
        ({"a": 1}, TypeError, r"Received: where=\{'a': 1\}"),
        (["head", 2], TypeError, r"item 1 is 2.*Received: where=\['head', 2\]"),
        ([], ValueError, r"non-empty list.*Received: where=\[\]"),
        ("", ValueError, r"Received: where=''"),
    ],
)
def test_bad_selector_types(where, error, message):
    with pytest.raises(error, match=message):
        selectors.validate_selector(where)


def test_no_match_names_selector_and_lists_layers():
    model = make_model()
    with pytest.raises(ValueError, match=r"where='haed'.*Available layer paths: "
                       r"\['backbone', 'backbone/b1', 'backbone/b2', 'head'\]"):
        selectors.select("haed", model, model.trainable_variables)
    with pytest.raises(ValueError, match=r"where=<Dense name='other'>"):
        selectors.select(
            keras.layers.Dense(1, name="other"), model, model.trainable_variables
        )
    with pytest.raises(ValueError, match=r"LayerPath\('nope'\)"):
        selectors.select(
            selectors.LayerPath("nope"), model, model.trainable_variables
        )
    with pytest.raises(ValueError, match="selects no trainable variable"):
        selectors.select(lambda v: False, model, model.trainable_variables)


@pytest.mark.parametrize("where", [None, "head*", ["a*", "*/bias"]])
def test_globs_serialize_as_they_are(where):
    config = selectors.serialize_selector(where)
    expected = list(where) if isinstance(where, (list, tuple)) else where
    assert config == expected
    restored = selectors.deserialize_selector(config)
    assert (list(restored) if isinstance(restored, tuple) else restored) == expected


def test_layer_serializes_by_its_path_in_the_model_being_saved():
    model = make_model()
    b1 = model.get_layer("backbone").get_layer("b1")
    assert selectors.serialize_selector(b1) == {"layer_path": "b1"}  # no model: name
    with selectors.paths_relative_to(model):
        config = selectors.serialize_selector(b1)
    assert config == {"layer_path": "backbone/b1"}
    restored = selectors.deserialize_selector(config)
    assert restored == selectors.LayerPath("backbone/b1")
    assert selectors.serialize_selector(restored) == config
    # Saves made before paths were stored still load, by name.
    assert selectors.deserialize_selector({"layer_name": "b1"}) == selectors.LayerPath("b1")


def test_unregistered_callable_cannot_be_saved():
    with pytest.raises(ValueError, match=r"register_keras_serializable.*Received: where="):
        selectors.serialize_selector(lambda v: True)


@keras.saving.register_keras_serializable(package="tests_selectors")
def only_bias(variable):
    return variable.path.endswith("bias")


def test_registered_callable_round_trip():
    config = selectors.serialize_selector(only_bias)
    restored = selectors.deserialize_selector(config)
    assert restored is only_bias
    assert selected_paths(restored, make_model()) == [
        "backbone/b1/bias", "backbone/b2/bias", "head/bias"
    ]
