"""`kt.optimizer_groups` and `kt.layerwise_lr_decay`: the map they build, their errors, configs.

The maps are checked the way Keras reads them after `load_model`: through
the serialized config (`re.fullmatch` of each key against a variable path),
for the paths Keras gives now and the paths it gives after a reload.
"""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt
from keras_tapeops import _compat
from keras_tapeops.groups import group_optimizers
from keras_tapeops.groups import optimizer_groups
from keras_tapeops.groups import trainable_capable_variables
from keras_tapeops.layerwise_decay import ScaledSchedule
from keras_tapeops.layerwise_decay import layerwise_lr_decay


# MultiOptimizer is new in Keras 3.15 (`make test-oldest` runs Keras 3.10):
# every test but the version message is skipped there (see the end of the file).
requires_multi_optimizer = pytest.mark.skipif(
    _compat.multi_optimizer_class() is None,
    reason="keras.optimizers.MultiOptimizer needs Keras 3.15",
)


# ------------------------------------------------------------------ helpers
def make_net():
    """backbone (nested functional b1 -> b2) -> head."""
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="tanh", name="b1")(inputs)
    h = keras.layers.Dense(8, activation="tanh", name="b2")(h)
    backbone = keras.Model(inputs, h, name="backbone")
    outer = keras.Input((6,))
    outputs = keras.layers.Dense(2, name="head")(backbone(outer))
    return kt.upgrade(keras.Model(outer, outputs, name="net"))


def make_text_net(blocks=3):
    """embedding -> block_0 .. block_{n-1} -> head (a stand-in for a transformer)."""
    inputs = keras.Input((5,), dtype="int32")
    h = keras.layers.Embedding(20, 4, name="embedding")(inputs)
    h = keras.layers.Flatten(name="flatten")(h)
    for i in range(blocks):
        h = keras.layers.Dense(6, activation="tanh", name=f"block_{i}")(h)
    outputs = keras.layers.Dense(2, name="head")(h)
    return kt.upgrade(keras.Model(inputs, outputs, name="text"))


def adam(rate, name):
    return keras.optimizers.Adam(rate, name=name)


def two_groups(model):
    return optimizer_groups(model, [
        ("backbone/*", adam(1e-3, "backbone")), ("head", adam(1e-2, "head"))])


def map_config(optimizer):
    """`(keys -> optimizer name, default name)` from the serialized MultiOptimizer."""
    config = keras.saving.serialize_keras_object(optimizer)["config"]["optimizer_map"]["config"]
    keys = {key: value["config"]["name"] for key, value in config["optimizer_map"].items()}
    return keys, config["default_optimizer"]["config"]["name"]


def group_of(optimizer, path):
    """The group Keras's OptimizerMap gives `path` (its lookup: exact key, else fullmatch)."""
    keys, default = map_config(optimizer)
    if path in keys:
        return keys[path]
    found = [name for key, name in keys.items() if re.fullmatch(key, path)]
    assert len(found) <= 1, (path, found)
    return found[0] if found else default


def assert_unchanged(model, weights):
    for a, b in zip(model.get_weights(), weights):
        np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------ the map itself
def test_returns_a_stock_multi_optimizer_in_group_order():
    model = make_net()
    opt = two_groups(model)
    assert type(opt) is keras.optimizers.MultiOptimizer
    assert [o.name for o in opt.optimizers] == ["backbone", "head"]
    keys, default = map_config(opt)
    # One key per group; the last group is the map's default (never listed twice).
    assert list(keys.values()) == ["backbone"] and default == "head"
    assert group_optimizers(opt) == {o.name: o for o in opt.optimizers}


def test_every_variable_maps_to_its_group():
    model = make_net()
    opt = two_groups(model)
    for v in model.trainable_variables:
        expected = "head" if v.path.startswith("head") else "backbone"
        assert group_of(opt, v.path) == expected, v.path


def test_keys_are_exact_escaped_paths():
    """`a.b` must not catch `aXb` (an unescaped `.` would)."""
    inputs = keras.Input((3,))
    a = keras.layers.Dense(2, name="a.b")
    b = keras.layers.Dense(2, name="aXb")
    model = keras.Model(inputs, a(inputs) + b(inputs))
    opt = optimizer_groups(model, [(a, adam(1e-3, "dots")), (b, adam(1e-2, "xs"))])
    keys, _ = map_config(opt)
    assert all(r"a\.b/kernel" in key for key in keys)
    assert group_of(opt, "aXb/kernel") == "xs"
    assert group_of(opt, "a.b/kernel") == "dots"


def test_frozen_layers_are_mapped_and_untrainable_state_is_not_unassigned():
    """Variables of a frozen layer get their group (for later unfreezing);
    BatchNormalization's moving statistics are never trained, so they are in
    no group and are not reported as unassigned."""
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, name="b1")(inputs)
    h = keras.layers.BatchNormalization(name="bn")(h)
    outputs = keras.layers.Dense(2, name="head")(h)
    model = keras.Model(inputs, outputs)
    model.get_layer("b1").trainable = False
    capable = trainable_capable_variables(model)
    assert [v.path for v in capable] == [
        "b1/kernel", "b1/bias", "bn/gamma", "bn/beta", "head/kernel", "head/bias"]
    opt = optimizer_groups(model, [
        (["b1", "bn"], adam(1e-3, "low")), ("head", adam(1e-2, "high"))])
    assert group_of(opt, "b1/kernel") == "low"
    assert group_of(opt, "head/kernel") == "high"


@pytest.mark.parametrize("kind", ["sequential", "nested_sequential"])
def test_keys_survive_the_paths_keras_gives_after_loading(kind, tmp_path):
    """Keras names a Sequential in its variables' paths when built from code,
    not after `load_model` ("seq/b1/kernel" -> "b1/kernel"); both map alike."""
    if kind == "sequential":
        model = keras.Sequential([
            keras.Input((6,)), keras.layers.Dense(4, name="b1"),
            keras.layers.Dense(2, name="head")], name="seq")
    else:
        tower = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4, name="b1")], name="tower")
        inputs = keras.Input((6,))
        model = keras.Model(inputs, keras.layers.Dense(2, name="head")(tower(inputs)))
    opt = optimizer_groups(model, [("b1", adam(1e-3, "low")), ("head", adam(1e-2, "high"))])
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    before = [v.path for v in model.trainable_variables]
    after = [v.path for v in loaded.trainable_variables]
    assert before != after  # the premise: Keras changes the paths
    for p, q in zip(before, after):
        assert group_of(opt, p) == group_of(opt, q) == ("low" if "b1" in p else "high")


def test_variables_the_map_cannot_tell_apart_after_loading_are_refused():
    """Two Sequential towers with a layer `d` each: after a reload both
    kernels are "d/kernel", so they cannot be in different groups."""
    towers = [
        keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="d")], name=name)
        for name in ("tower_a", "tower_b")
    ]
    inputs = keras.Input((3,))
    model = keras.Model(inputs, towers[0](inputs) + towers[1](inputs))
    with pytest.raises(ValueError, match=r"tower_[ab]/d/kernel' cannot be told apart from \['tower_[ab]/d/kernel'\]"):
        optimizer_groups(model, [("tower_a", adam(1e-3, "a")), ("tower_b", adam(1e-2, "b"))])
    # In one group they are fine.
    optimizer_groups(model, [(["tower_a", "tower_b"], adam(1e-3, "both"))])


def test_default_takes_the_rest_and_comes_last():
    model = make_net()
    opt = optimizer_groups(model, [("head", adam(1e-2, "head"))],
                           default=keras.optimizers.SGD(0.1, name="rest"))
    assert [o.name for o in opt.optimizers] == ["head", "rest"]
    assert group_of(opt, "b1/kernel") == "rest"
    assert group_of(opt, "head/bias") == "head"


def test_the_same_optimizer_in_two_pairs_is_one_group():
    model = make_net()
    shared = adam(1e-3, "shared")
    opt = optimizer_groups(model, [("b1", shared), ("head", adam(1e-2, "head")), ("b2", shared)])
    assert [o.name for o in opt.optimizers] == ["shared", "head"]
    keys, default = map_config(opt)
    assert len(keys) == 1 and default == "head"
    assert group_of(opt, "b2/kernel") == group_of(opt, "b1/bias") == "shared"


def test_config_round_trip_keeps_groups_and_hyperparameters():
    model = make_net()
    opt = optimizer_groups(model, [
        ("backbone/*", keras.optimizers.AdamW(1e-3, weight_decay=0.01, name="backbone")),
        ("head", keras.optimizers.SGD(0.1, momentum=0.9, name="head"))])
    config = keras.saving.serialize_keras_object(opt)
    restored = keras.saving.deserialize_keras_object(config)
    assert type(restored) is keras.optimizers.MultiOptimizer
    assert [o.get_config() for o in restored.optimizers] == [o.get_config() for o in opt.optimizers]
    assert keras.saving.serialize_keras_object(restored) == config


# --------------------------------------------------------------------- errors
def test_overlap_names_both_groups_and_changes_nothing():
    model = make_net()
    weights = model.get_weights()
    first, second = adam(1e-3, "first"), adam(1e-2, "second")
    with pytest.raises(ValueError, match=(
        r"'head/kernel' is selected by two groups: groups\[0\] \(where='head'\) and "
        r"groups\[1\] \(where='\*/kernel'\).*Received: groups=")):
        optimizer_groups(model, [("head", first), ("*/kernel", second)])
    assert_unchanged(model, weights)
    assert not first.built and not second.built


def test_unassigned_variables_without_default_list_their_layers():
    model = make_net()
    weights = model.get_weights()
    with pytest.raises(ValueError, match=(
        r"in no group and `default` is None\. Unassigned layers: "
        r"\['backbone/b1', 'backbone/b2'\].*Received: groups=\[\('head', 'h'\)\]")):
        optimizer_groups(model, [("head", adam(1e-2, "h"))])
    assert_unchanged(model, weights)


@pytest.mark.parametrize("groups, error, message", [
    (lambda: "adam", TypeError,
     r"`groups` must be a list of \(where, optimizer\) pairs.*Received: groups='adam'"),
    (lambda: [], ValueError, r"at least one.*Received: groups=\[\]"),
    (lambda: [("head",)], TypeError, r"item 0 is not a pair\. Received: groups\[0\]=\('head',\)"),
    (lambda: [("head", "adam")], TypeError,
     r"`groups\[0\]\[1\]` must be a Keras optimizer instance.*Received: groups\[0\]\[1\]='adam'"),
    (lambda: [(3, adam(1e-3, "g"))], TypeError, r"groups\[0\]: `where` must be.*Received: where=3"),
    (lambda: [(None, adam(1e-3, "g"))], ValueError, r"groups\[0\] has where=None"),
])
def test_wrong_groups_raise_naming_the_argument(groups, error, message):
    model = make_net()
    weights = model.get_weights()
    with pytest.raises(error, match=message):
        optimizer_groups(model, groups())
    assert_unchanged(model, weights)


def test_wrong_default_model_and_wrapped_optimizers_raise():
    model = make_net()
    with pytest.raises(TypeError, match=r"`default` must be a Keras optimizer.*Received: default='sgd'"):
        optimizer_groups(model, [("head", adam(1e-2, "h"))], default="sgd")
    with pytest.raises(TypeError, match=r"needs a Keras model.*Received: model=None"):
        optimizer_groups(None, [("head", adam(1e-2, "h"))])
    scaled = keras.optimizers.LossScaleOptimizer(adam(1e-2, "inner"))
    with pytest.raises(TypeError, match=r"cannot be a LossScaleOptimizer.*Received: groups\[0\]\[1\]="):
        optimizer_groups(model, [("head", scaled)], default=adam(1e-3, "d"))
    nested = two_groups(make_net())
    with pytest.raises(TypeError, match=r"cannot be a MultiOptimizer"):
        optimizer_groups(model, [("head", nested)], default=adam(1e-3, "d"))


def test_unknown_selector_built_optimizer_same_names_and_unbuilt_model_raise():
    model = make_net()
    with pytest.raises(ValueError, match=r"Received: where='haed'.*Available layer paths"):
        optimizer_groups(model, [("haed", adam(1e-2, "h"))], default=adam(1e-3, "d"))
    used = adam(1e-2, "used")
    used.build(model.get_layer("head").trainable_variables)
    with pytest.raises(ValueError, match=r"already built.*Received: groups\[0\]\[1\]='used'"):
        optimizer_groups(model, [("head", used)], default=adam(1e-3, "d"))
    with pytest.raises(ValueError, match=r"Two different optimizers are named 'twin'"):
        optimizer_groups(model, [("head", adam(1e-2, "twin")), ("backbone/*", adam(1e-3, "twin"))])

    class Lazy(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, x):
            return self.dense(x)

    with pytest.raises(ValueError, match=r"needs a built model"):
        optimizer_groups(Lazy(), [("dense", adam(1e-2, "h"))])


def test_keras_without_multi_optimizer_gets_a_clear_error(monkeypatch):
    """Runs on every Keras (on Keras < 3.15 the patch changes nothing)."""
    monkeypatch.setattr(_compat, "multi_optimizer_class", lambda: None)
    with pytest.raises(RuntimeError, match=r"MultiOptimizer, which Keras added in version 3\.15"):
        optimizer_groups(make_net(), [("head", adam(1e-2, "h"))])
    with pytest.raises(RuntimeError, match=r"kt\.layerwise_lr_decay needs"):
        layerwise_lr_decay(make_net(), adam(1e-2, "h"), 0.5, ["head"])


# ---------------------------------------------------------- layer-wise decay
def rates(optimizer, step=None):
    out = {}
    for o in optimizer.optimizers:
        if step is not None:
            o.iterations.assign(step)
        out[o.name] = float(keras.ops.convert_to_numpy(o.learning_rate))
    return out


def test_layerwise_rates_equal_the_closed_form():
    model = make_text_net(blocks=3)
    layers = ["block_0", "block_1", "block_2", "head"]
    base, decay, n = 2e-3, 0.8, 4
    opt = layerwise_lr_decay(model, keras.optimizers.AdamW(base, name="base"), decay, layers)
    got = rates(opt)
    assert list(got) == ["base_0", "base_1", "base_2", "base_3", "base_rest"]
    for i in range(n):
        np.testing.assert_allclose(got[f"base_{i}"], decay ** (n - 1 - i) * base, rtol=1e-6)
    # The embedding (in no block) is the lowest: one step below block_0.
    np.testing.assert_allclose(got["base_rest"], decay**n * base, rtol=1e-6)
    assert group_of(opt, "embedding/embeddings") == "base_rest"
    assert group_of(opt, "block_1/kernel") == "base_1"
    assert group_of(opt, "head/bias") == "base_3"


def test_layerwise_clones_keep_every_hyperparameter_and_leave_the_base_alone():
    model = make_text_net(blocks=2)
    base = keras.optimizers.AdamW(1e-3, weight_decay=0.05, beta_1=0.8, epsilon=1e-6, name="base")
    base.exclude_from_weight_decay(var_names=["bias"])
    opt = layerwise_lr_decay(model, base, 0.5, ["block_0", "block_1", "head"])
    assert all(o is not base for o in opt.optimizers) and not base.built
    for o in opt.optimizers:
        config, expected = o.get_config(), base.get_config()
        for key in ("weight_decay", "beta_1", "beta_2", "epsilon", "amsgrad"):
            assert config[key] == expected[key], key
    bias = model.get_layer("head").bias
    kernel = model.get_layer("head").kernel
    top = opt.optimizers[2]
    assert not top._use_weight_decay(bias) and top._use_weight_decay(kernel)


def test_layerwise_rest_options():
    model = make_text_net(blocks=2)
    layers = ["block_0", "block_1", "head"]
    opt = layerwise_lr_decay(model, adam(1.0, "b"), 0.5, layers, rest=0.01)
    np.testing.assert_allclose(rates(opt)["b_rest"], 0.01, rtol=1e-6)
    with pytest.raises(ValueError, match=r"rest='error'\. Unassigned layers: \['embedding'\]"):
        layerwise_lr_decay(model, adam(1.0, "b"), 0.5, layers, rest="error")
    # Every variable listed: no rest group, the top block is the map's default.
    opt = layerwise_lr_decay(model, adam(1.0, "c"), 0.5, ["embedding", *layers], rest="error")
    assert [o.name for o in opt.optimizers] == ["c_0", "c_1", "c_2", "c_3"]
    assert map_config(opt)[1] == "c_3"


def test_layerwise_scales_a_schedule_and_saves_it():
    model = make_text_net(blocks=2)
    schedule = keras.optimizers.schedules.PolynomialDecay(1e-3, decay_steps=100, end_learning_rate=1e-5)
    layers = ["block_0", "block_1", "head"]
    opt = layerwise_lr_decay(model, adam(schedule, "s"), 0.5, layers)
    assert isinstance(opt.optimizers[0].get_config()["learning_rate"], dict)
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(opt))
    for optimizer in (opt, restored):
        for step in (0, 10, 100):
            got = rates(optimizer, step)
            base = float(schedule(step))
            for i in range(3):
                np.testing.assert_allclose(got[f"s_{i}"], 0.5 ** (2 - i) * base, rtol=1e-6)
            np.testing.assert_allclose(got["s_rest"], 0.5**3 * base, rtol=1e-6)


def test_layerwise_fit_equals_per_block_sgd_by_hand():
    """One SGD step per batch, each block at its closed-form rate."""
    keras.utils.set_random_seed(5)
    model = make_text_net(blocks=2)
    weights = model.get_weights()
    rng = np.random.default_rng(0)
    x = rng.integers(0, 20, size=(32, 5)).astype("int32")
    y = rng.normal(size=(32, 2)).astype("float32")
    layers = ["block_0", "block_1", "head"]
    model.compile(optimizer=layerwise_lr_decay(model, keras.optimizers.SGD(0.1), 0.5, layers), loss="mse")
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)

    hand = make_text_net(blocks=2)
    hand.set_weights(weights)
    multiplier = {"block_0": 0.25, "block_1": 0.5, "head": 1.0, "embedding": 0.125}
    variables = hand.trainable_variables
    lrs = [0.1 * multiplier[v.path.split("/")[0]] for v in variables]

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(hand(xb, training=True) - yb))
        for v, g, lr in zip(variables, tape.gradient(loss, variables), lrs):
            v.assign_sub(lr * tf.convert_to_tensor(g))

    for start in (0, 16):
        step(x[start:start + 16], y[start:start + 16])
    for a, b in zip(model.get_weights(), hand.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"decay": 0.0}, ValueError, r"`decay` must be a positive finite number\. Received: decay=0\.0"),
    ({"decay": 1.5}, ValueError, r"`decay` must be in \(0, 1\]\. Received: decay=1\.5"),
    ({"decay": "x"}, TypeError, r"Received: decay='x'"),
    ({"layers": "head"}, TypeError, r"`layers` must be a list.*Received: layers='head'"),
    ({"layers": []}, ValueError, r"at least one block\. Received: layers=\[\]"),
    ({"layers": ["block_0", "block_*"]}, ValueError,
     r"'block_0/kernel' is in two blocks: layers\[0\] \('block_0'\) and layers\[1\] \('block_\*'\)"),
    ({"rest": "top"}, ValueError, r"`rest` must be one of \['lowest', 'error'\]\. Received: rest='top'"),
    ({"rest": 2.0}, ValueError, r"Received: rest=2\.0"),
    ({"base_optimizer": "adam"}, TypeError, r"Received: base_optimizer='adam'"),
])
def test_layerwise_bad_arguments_raise(kwargs, error, message):
    model = make_text_net(blocks=1)
    arguments = {"base_optimizer": adam(1e-3, "b"), "decay": 0.5, "layers": ["block_0", "head"]}
    arguments.update(kwargs)
    weights = model.get_weights()
    with pytest.raises(error, match=message):
        layerwise_lr_decay(model, **arguments)
    assert_unchanged(model, weights)


def test_layerwise_refuses_a_plain_callable_rate():
    model = make_text_net(blocks=1)
    with pytest.raises(TypeError, match=r"learning rate must be a number or a.*LearningRateSchedule"):
        layerwise_lr_decay(model, keras.optimizers.Adam(lambda: 0.1), 0.5, ["head"])


# -------------------------------------------------------------- ScaledSchedule
def test_scaled_schedule_values_config_round_trip_and_errors():
    base = keras.optimizers.schedules.CosineDecay(1e-3, decay_steps=50, warmup_steps=5, warmup_target=2e-3)
    scaled = ScaledSchedule(base, 0.25)
    for step in (0, 3, 20, 60):
        np.testing.assert_allclose(float(scaled(step)), 0.25 * float(base(step)), rtol=1e-6)
    config = keras.saving.serialize_keras_object(scaled)
    assert config["registered_name"] == "keras_tapeops>ScaledSchedule"
    restored = keras.saving.deserialize_keras_object(config)
    assert isinstance(restored, ScaledSchedule) and restored.factor == 0.25
    assert restored.get_config() == scaled.get_config()
    assert float(restored(20)) == pytest.approx(float(scaled(20)))
    with pytest.raises(TypeError, match=r"Received: schedule=0\.1"):
        ScaledSchedule(0.1, 0.5)
    with pytest.raises(ValueError, match=r"Received: factor=0"):
        ScaledSchedule(base, 0)


for _name, _test in list(globals().items()):
    if _name.startswith("test_") and _name != "test_keras_without_multi_optimizer_gets_a_clear_error":
        globals()[_name] = requires_multi_optimizer(_test)
