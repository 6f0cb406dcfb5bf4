"""The one path grammar (issue 10): where=, ActivationPenalty and errors on small models.

Layers are named from the outer model down through nested functional and
Sequential sub-models ("tower_a/b1"). Expected selections are written out by
hand from the models built here (`layer.weights` of the named layers), not
computed with `keras_tapeops.paths`.
"""

import warnings

import keras
import numpy as np
import pytest

import keras_tapeops as kt
from keras_tapeops import selectors


def tower(name):
    inputs = keras.Input((4,))
    h = keras.layers.Dense(5, activation="tanh", name="b1")(inputs)
    h = keras.layers.Dense(3, name="b2")(h)
    return keras.Model(inputs, h, name=name)


def make_towers(upgrade=False):
    """Two functional sub-models that both hold layers named "b1" and "b2"."""
    inputs = keras.Input((4,))
    a, b = tower("tower_a"), tower("tower_b")
    h = keras.layers.Concatenate(name="concat")([a(inputs), b(inputs)])
    outputs = keras.layers.Dense(1, name="head")(h)
    model = keras.Model(inputs, outputs, name="net")
    return kt.upgrade(model) if upgrade else model


def make_nested():
    """A Sequential "encoder" holding a functional "backbone" holding "b1"."""
    inner_in = keras.Input((4,))
    inner = keras.layers.Dense(5, name="b1")(inner_in)
    backbone = keras.Model(inner_in, inner, name="backbone")
    encoder = keras.Sequential(
        [keras.Input((4,)), backbone, keras.layers.Dense(2, name="proj")], name="encoder"
    )
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(1, name="head")(encoder(inputs))
    return keras.Model(inputs, outputs, name="net")


def selected_ids(where, model):
    variables = model.trainable_variables
    state = kt.ClipByNorm(1.0, where=where).bind(model, variables)
    return {id(v) for v, on in zip(variables, state.selected) if on}


def ids(*layers_or_variables):
    out = set()
    for item in layers_or_variables:
        weights = item.weights if isinstance(item, keras.layers.Layer) else [item]
        out |= {id(v) for v in weights}
    return out


def layer(model, path):
    """The layer at `path`, found with Keras's own get_layer, one level at a time."""
    for name in path.split("/"):
        model = model.get_layer(name)
    return model


# ------------------------------------------------------------------ selection
def test_bare_name_shared_by_two_submodels_is_an_error_listing_both_paths():
    model = make_towers()
    with pytest.raises(ValueError) as error:
        selected_ids("b1", model)
    message = str(error.value)
    assert "tower_a/b1" in message and "tower_b/b1" in message, message
    assert "where='b1'" in message, message


def test_a_keras_variable_path_shared_by_two_submodels_is_an_error_listing_both():
    """Keras's variable.path leaves the sub-model out: both towers have "b1/kernel"."""
    model = make_towers()
    kernels = [layer(model, p).kernel for p in ["tower_a/b1", "tower_b/b1"]]
    assert [v.path for v in kernels] == ["b1/kernel", "b1/kernel"]
    with pytest.raises(ValueError) as error:
        selected_ids("b1/kernel", model)
    message = str(error.value)
    assert "tower_a/b1/kernel" in message and "tower_b/b1/kernel" in message, message
    assert selected_ids("tower_b/b1/kernel", model) == ids(kernels[1])


def test_ambiguous_bare_name_fails_at_compile_and_leaves_the_model_uncompiled():
    model = make_towers(upgrade=True)
    with pytest.raises(ValueError, match="tower_a/b1"):
        model.compile(optimizer="sgd", loss="mse",
                      gradient_transforms=[kt.ClipByNorm(1.0, where="b1")])
    assert not model.compiled


@pytest.mark.parametrize("where", ["*b1", "tower_*/b1", "b1*", "*/b1", ["tower_a/b1", "tower_b/b1"]])
def test_a_glob_selects_the_name_in_both_submodels(where):
    model = make_towers()
    expected = ids(layer(model, "tower_a/b1"), layer(model, "tower_b/b1"))
    assert selected_ids(where, model) == expected
    assert len(expected) == 4


@pytest.mark.parametrize("where, expected_paths", [
    ("tower_a/b1", ["tower_a/b1"]),
    ("/tower_b/b2/", ["tower_b/b2"]),
    ("tower_a/*", ["tower_a"]),
    ("tower_a", ["tower_a"]),           # a unique bare name: the sub-model
    ("head", ["head"]),
    ("tower_?/b2", ["tower_a/b2", "tower_b/b2"]),
])
def test_paths_and_globs_select_the_named_layers(where, expected_paths):
    model = make_towers()
    expected = ids(*[layer(model, p) for p in expected_paths])
    assert selected_ids(where, model) == expected


def test_variable_paths_and_kernel_globs():
    model = make_towers()
    a_b1 = layer(model, "tower_a/b1")
    assert selected_ids("tower_a/b1/kernel", model) == ids(a_b1.kernel)
    kernels = [layer(model, p).kernel for p in
               ["tower_a/b1", "tower_a/b2", "tower_b/b1", "tower_b/b2", "head"]]
    assert selected_ids("*/kernel", model) == ids(*kernels)
    assert selected_ids("tower_b/*/bias", model) == ids(
        layer(model, "tower_b/b1").bias, layer(model, "tower_b/b2").bias
    )


def test_paths_through_sequential_and_functional_nesting():
    model = make_nested()
    b1 = layer(model, "encoder/backbone/b1")
    assert selected_ids("encoder/backbone/b1", model) == ids(b1)
    assert selected_ids("b1", model) == ids(b1)  # unique bare name, any depth
    assert selected_ids("encoder/*", model) == ids(b1, layer(model, "encoder/proj"))
    assert selected_ids("encoder/backbone/*", model) == ids(b1)
    state = kt.ActivationPenalty("encoder/backbone/b1", l2=1.0).bind(model)
    assert state is b1


@pytest.mark.parametrize("where", ["tower_c/b1", "tower_a/b9", "b9", "towr_*"])
def test_a_selector_naming_no_layer_is_an_error(where):
    model = make_towers()
    with pytest.raises(ValueError) as error:
        selected_ids(where, model)
    message = str(error.value)
    assert repr(where) in message and "tower_a/b1" in message, message


# ------------------------------------------------------- ActivationPenalty paths
def test_activation_penalty_resolves_the_layer_the_selector_path_names():
    model = make_towers()
    for path in ["tower_a/b1", "tower_b/b1", "head"]:
        bound = kt.ActivationPenalty(path, l2=1.0).bind(model)
        assert bound is layer(model, path)
        assert selected_ids(path, model) == ids(bound)


def test_activation_penalty_with_an_ambiguous_bare_name_lists_both_paths():
    model = make_towers(upgrade=True)
    with pytest.raises(ValueError) as error:
        model.compile(optimizer="sgd", loss="mse",
                      loss_terms=[kt.ActivationPenalty("b1", l2=1.0)])
    assert "tower_a/b1" in str(error.value) and "tower_b/b1" in str(error.value)


def test_activation_penalty_by_path_penalizes_that_towers_output():
    """The logged term equals mean(b1(x)^2) of tower_b's b1, computed by hand."""
    model = make_towers(upgrade=True)
    x = np.random.default_rng(0).normal(size=(8, 4)).astype("float32")
    y = np.zeros((8, 1), "float32")
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse",
                  loss_terms=[kt.ActivationPenalty("tower_b/b1", l2=1.0, name="pen")])
    logged = model.fit(x, y, batch_size=8, epochs=1, verbose=0).history["pen"][0]

    def by_hand(path):
        dense = layer(model, path)
        return float(np.mean(np.tanh(x @ np.array(dense.kernel) + np.array(dense.bias)) ** 2))

    assert logged == pytest.approx(by_hand("tower_b/b1"), abs=1e-6)
    assert abs(by_hand("tower_a/b1") - by_hand("tower_b/b1")) > 1e-3  # the other tower differs


# ------------------------------------------------------------ frozen layers
def frozen_warnings(caught, where):
    return [w for w in caught if repr(where) in str(w.message) and "frozen" in str(w.message)]


@pytest.mark.parametrize("where", ["tower_a/*", "tower_a/b1", "tower_a", "tower_a/b2/kernel"])
def test_a_selector_naming_only_frozen_layers_warns_and_selects_nothing(where):
    model = make_towers()
    model.get_layer("tower_a").trainable = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert selected_ids(where, model) == set()
    assert len(frozen_warnings(caught, where)) == 1, [str(w.message) for w in caught]


def test_a_frozen_layer_object_warns_and_selects_nothing():
    model = make_towers()
    tower_a = model.get_layer("tower_a")
    tower_a.trainable = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert selected_ids(tower_a, model) == set()
    assert len([w for w in caught if "frozen" in str(w.message)]) == 1


def test_a_glob_over_frozen_and_trainable_layers_selects_the_trainable_ones():
    model = make_towers()
    model.get_layer("tower_a").trainable = False
    assert selected_ids("*b1", model) == ids(layer(model, "tower_b/b1"))


def test_a_missing_layer_stays_an_error_when_others_are_frozen():
    model = make_towers()
    model.get_layer("tower_a").trainable = False
    with pytest.raises(ValueError, match="tower_c"):
        selected_ids("tower_c/*", model)


def test_fit_with_a_frozen_selector_warns_once_and_trains_the_rest():
    model = make_towers(upgrade=True)
    tower_a = model.get_layer("tower_a")
    tower_a.trainable = False
    before = {name: [np.array(w) for w in model.get_layer(name).get_weights()]
              for name in ["tower_a", "tower_b", "head"]}
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 4)).astype("float32"), rng.normal(size=(32, 1)).astype("float32")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse",
                      gradient_transforms=[kt.ClipByGlobalNorm(0.1, where="tower_a/*"),
                                           kt.ClipByNorm(0.1, where="tower_b/*")])
        model.fit(x, y, batch_size=8, epochs=2, verbose=0, validation_data=(x, y))
        model.evaluate(x, y, verbose=0)
    assert len(frozen_warnings(caught, "tower_a/*")) == 1, [str(w.message) for w in caught]
    assert not frozen_warnings(caught, "tower_b/*")
    changed = {name: any(not np.array_equal(a, b) for a, b in
                         zip(before[name], model.get_layer(name).get_weights()))
               for name in before}
    assert changed == {"tower_a": False, "tower_b": True, "head": True}


# --------------------------------------------------------------------- repr
def test_repr_shows_the_arguments():
    text = repr(kt.ClipByGlobalNorm(1.0, where="backbone/*"))
    assert text.startswith("ClipByGlobalNorm(") and "clip_norm=1.0" in text
    assert "where='backbone/*'" in text
    text = repr(kt.ActivationPenalty("backbone/block_16_project", l2=1e-3))
    assert "layer='backbone/block_16_project'" in text and "l2=0.001" in text
    assert "where=['tower_a/b1', 'tower_b/b1']" in repr(
        kt.ClipByValue(0.5, where=["tower_a/b1", "tower_b/b1"]))


def test_selectors_module_docstring_example_holds():
    """`select` returns one bool per variable (the public helper the docs name)."""
    model = make_towers()
    mask = selectors.select("tower_a/b1", model, model.trainable_variables)
    assert len(mask) == len(model.trainable_variables) and sum(mask) == 2
