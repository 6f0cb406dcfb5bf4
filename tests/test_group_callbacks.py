"""Callbacks for optimizer groups: per-group schedules, plateau reduction, gradual unfreezing.

`GroupLearningRateScheduler` and `GroupReduceLROnPlateau` are checked against
closed forms and against Keras's own `ReduceLROnPlateau` on a bare
MultiOptimizer (the same reductions at the same epochs), and under mixed
precision, where Keras's callbacks fail on the LossScaleOptimizer around the
MultiOptimizer. `GradualUnfreezing`'s fit results are in test_groups_fit.py;
here: its errors, its bookkeeping and its config.
"""

import keras
import numpy as np
import pytest

import keras_tapeops as kt
from keras_tapeops import _compat
from keras_tapeops.callbacks.gradual_unfreezing import GradualUnfreezing
from keras_tapeops.callbacks.group_learning_rate import GroupLearningRateScheduler
from keras_tapeops.callbacks.group_learning_rate import group_learning_rates
from keras_tapeops.callbacks.group_reduce_lr_on_plateau import GroupReduceLROnPlateau
from keras_tapeops.groups import optimizer_groups
from keras_tapeops.layerwise_decay import layerwise_lr_decay
from keras_tapeops.selectors import LayerPath

# MultiOptimizer is new in Keras 3.15 (`make test-oldest` runs Keras 3.10).
pytestmark = pytest.mark.skipif(
    _compat.multi_optimizer_class() is None,
    reason="keras.optimizers.MultiOptimizer needs Keras 3.15",
)

LR_BACKBONE = 1e-3
LR_HEAD = 1e-2


def make_net():
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="tanh", name="b1")(inputs)
    h = keras.layers.Dense(8, activation="tanh", name="b2")(h)
    backbone = keras.Model(inputs, h, name="backbone")
    outer = keras.Input((6,))
    outputs = keras.layers.Dense(2, name="head")(backbone(outer))
    return kt.upgrade(keras.Model(outer, outputs, name="net"))


def data(n=32):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 6)).astype("float32"), rng.normal(size=(n, 2)).astype("float32")


def compiled(head_lr=LR_HEAD, **compile_kwargs):
    model = make_net()
    optimizer = optimizer_groups(model, [
        ("backbone/*", keras.optimizers.Adam(LR_BACKBONE, name="backbone")),
        ("head", keras.optimizers.Adam(head_lr, name="head")),
    ])
    model.compile(optimizer=optimizer, loss="mse", **compile_kwargs)
    return model


def fit(model, callbacks, epochs=3, verbose=0):
    x, y = data()
    return model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=verbose,
                     callbacks=callbacks)


@keras.saving.register_keras_serializable(package="keras_tapeops_tests")
def halve(epoch, lr):
    return lr * 0.5


@keras.saving.register_keras_serializable(package="keras_tapeops_tests")
def head_by_epoch(epoch, lr):
    return 0.1 * (epoch + 1)


# ------------------------------------------------- GroupLearningRateScheduler
def test_scheduler_sets_named_groups_and_logs_every_group():
    model = compiled()
    history = fit(model, [GroupLearningRateScheduler({"head": head_by_epoch}, log=True)])
    np.testing.assert_allclose(history.history["lr/head"], [0.1, 0.2, 0.3], rtol=1e-6)
    np.testing.assert_allclose(history.history["lr/backbone"], [LR_BACKBONE] * 3, rtol=1e-6)
    assert group_learning_rates(model) == pytest.approx({"backbone": LR_BACKBONE, "head": 0.3})


def test_one_function_for_every_group_keeps_their_ratio():
    model = compiled()
    history = fit(model, [GroupLearningRateScheduler(halve, log=True)])
    head, backbone = (np.array(history.history[k]) for k in ("lr/head", "lr/backbone"))
    np.testing.assert_allclose(head, LR_HEAD * 0.5 ** np.arange(1, 4), rtol=1e-6)
    np.testing.assert_allclose(head / backbone, LR_HEAD / LR_BACKBONE, rtol=1e-5)


def test_scheduler_works_under_mixed_precision_where_stock_fails():
    keras.config.set_dtype_policy("mixed_float16")
    model = compiled()
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    history = fit(model, [GroupLearningRateScheduler({"head": head_by_epoch}, log=True)])
    np.testing.assert_allclose(history.history["lr/head"], [0.1, 0.2, 0.3], rtol=1e-6)
    # Keras's own scheduler reads optimizer.learning_rate, which the
    # MultiOptimizer inside the LossScaleOptimizer refuses.
    with pytest.raises(ValueError, match="learning_rate"):
        fit(compiled(), [keras.callbacks.LearningRateScheduler(halve)], epochs=1)


def test_progress_bar_shows_the_group_rates(capsys):
    fit(compiled(), [GroupLearningRateScheduler(log=True)], epochs=1, verbose=2)
    out = capsys.readouterr().out
    assert "lr/backbone: 0.0010" in out and "lr/head: 0.0100" in out


def test_scheduler_errors_come_before_any_weight_changes():
    model = compiled()
    weights = model.get_weights()
    with pytest.raises(ValueError, match=r"groups \['haed'\].*Groups: \['backbone', 'head'\]"):
        fit(model, [GroupLearningRateScheduler({"haed": halve})])
    with pytest.raises(ValueError, match=r"must return a float\. Received: 'fast'"):
        fit(model, [GroupLearningRateScheduler({"head": lambda epoch, lr: "fast"})])
    for a, b in zip(model.get_weights(), weights):
        np.testing.assert_array_equal(a, b)
    scheduled = make_net()
    scheduled.compile(loss="mse", optimizer=optimizer_groups(scheduled, [
        ("backbone/*", keras.optimizers.Adam(1e-3, name="backbone")),
        ("head", keras.optimizers.Adam(
            keras.optimizers.schedules.ExponentialDecay(1e-2, 10, 0.9), name="head"))]))
    with pytest.raises(ValueError, match=r"Groups \['head'\] take their learning rate from a LearningRateSchedule"):
        fit(scheduled, [GroupLearningRateScheduler(halve)])
    # Only the backbone: allowed.
    fit(scheduled, [GroupLearningRateScheduler({"backbone": halve})], epochs=1)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"schedule": 3}, TypeError, r"`schedule` must be None, a callable.*Received: schedule=3"),
    ({"schedule": {"head": 3}}, TypeError, r"map group names \(str\) to callables.*Received: schedule="),
    ({"schedule": {}}, ValueError, r"at least one group\. Received: schedule=\{\}"),
    ({"log": "yes"}, TypeError, r"`log` must be a bool\. Received: log='yes'"),
    ({"verbose": 2}, ValueError, r"`verbose` must be 0 or 1\. Received: verbose=2"),
])
def test_scheduler_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        GroupLearningRateScheduler(**kwargs)


@pytest.mark.parametrize("schedule", [None, halve, {"head": head_by_epoch, "backbone": halve}])
def test_scheduler_config_round_trip(schedule):
    callback = GroupLearningRateScheduler(schedule, log=True, verbose=1)
    config = keras.saving.serialize_keras_object(callback)
    restored = keras.saving.deserialize_keras_object(config)
    assert isinstance(restored, GroupLearningRateScheduler)
    assert restored.schedule == schedule and restored.log and restored.verbose == 1
    assert restored.get_config() == callback.get_config()


def test_scheduler_with_a_lambda_cannot_be_saved():
    with pytest.raises(ValueError, match=r"`schedule` cannot be saved.*register_keras_serializable"):
        GroupLearningRateScheduler(lambda epoch, lr: lr).get_config()


# ----------------------------------------------------- GroupReduceLROnPlateau
LOSSES = [1.0, 0.9, 0.95, 0.96, 0.97, 0.8, 0.85, 0.86, 0.87, 0.88]


def drive(callback, model, losses=LOSSES):
    """Feeds the callback a loss sequence; returns each group's rate after each epoch."""
    callback.set_model(model)
    callback.on_train_begin()
    out = []
    for epoch, loss in enumerate(losses):
        callback.on_epoch_end(epoch, {"loss": loss})
        out.append(group_learning_rates(model))
    return out


def built(model):
    model.optimizer.build(model.trainable_variables)
    return model


@pytest.mark.parametrize("kwargs", [
    {"patience": 1}, {"patience": 2, "cooldown": 2}, {"patience": 0, "min_lr": 2e-4},
    {"patience": 1, "min_delta": 0.2}, {"patience": 1, "mode": "max"},
])
def test_plateau_reductions_equal_keras_on_a_bare_multi_optimizer(kwargs):
    ours = drive(GroupReduceLROnPlateau(monitor="loss", factor=0.5, **kwargs), built(compiled()))
    stock = drive(keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, **kwargs), built(compiled()))
    assert len({tuple(r.values()) for r in ours}) > 1  # some reduction happened
    for a, b in zip(ours, stock):
        assert a == pytest.approx(b, rel=1e-6)


def test_plateau_keeps_layerwise_ratios_and_works_under_mixed_precision():
    keras.config.set_dtype_policy("mixed_float16")
    model = make_net()
    model.compile(loss="mse", optimizer=layerwise_lr_decay(
        model, keras.optimizers.SGD(0.1, name="s"), 0.5, ["backbone/b1", "backbone/b2", "head"]))
    history = fit(model, [GroupReduceLROnPlateau(monitor="loss", factor=0.5, patience=0,
                                                 min_delta=10.0, log=True)])
    top = np.array(history.history["lr/s_2"])
    # The first epoch sets the reference; every later one is a plateau.
    np.testing.assert_allclose(top, 0.1 * 0.5 ** np.arange(0, 3), rtol=1e-6)
    for i, ratio in ((0, 0.25), (1, 0.5)):
        np.testing.assert_allclose(np.array(history.history[f"lr/s_{i}"]) / top, ratio, rtol=1e-5)
    with pytest.raises(AttributeError, match="Learning rate cannot be accessed on a MultiOptimizer"):
        fit(compiled(), [keras.callbacks.ReduceLROnPlateau(monitor="loss")], epochs=1)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"factor": 1.0}, ValueError, r"`factor` must be in \(0, 1\)\. Received: factor=1\.0"),
    ({"factor": 0}, ValueError, r"Received: factor=0"),
    ({"patience": -1}, ValueError, r"`patience` must be a non-negative integer\. Received: patience=-1"),
    ({"mode": "up"}, ValueError, r"`mode` must be one of \['auto', 'min', 'max'\]\. Received: mode='up'"),
    ({"min_lr": -1.0}, ValueError, r"Received: min_lr=-1\.0"),
    ({"monitor": ""}, ValueError, r"Received: monitor=''"),
    ({"log": 1}, TypeError, r"Received: log=1"),
])
def test_plateau_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        GroupReduceLROnPlateau(**kwargs)


def test_plateau_auto_mode_refuses_a_metric_of_unknown_direction():
    callback = GroupReduceLROnPlateau(monitor="val_custom")
    callback.set_model(built(compiled()))
    callback.on_train_begin()
    with pytest.raises(ValueError, match=r"cannot tell whether `val_custom`.*mode='min' or mode='max'"):
        callback.on_epoch_end(0, {"val_custom": 1.0})


def test_plateau_config_round_trip():
    callback = GroupReduceLROnPlateau(monitor="loss", factor=0.3, patience=2, verbose=1,
                                      mode="min", min_delta=0.01, cooldown=1, min_lr=1e-5, log=True)
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(callback))
    assert isinstance(restored, GroupReduceLROnPlateau)
    assert restored.get_config() == callback.get_config()


# ----------------------------------------------------------- GradualUnfreezing
class Flags(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.trainable = []

    def on_epoch_begin(self, epoch, logs=None):
        self.trainable.append(len(self.model.trainable_weights))


def test_unfreezing_by_epoch_and_restoring_flags_at_the_end(capsys):
    model = compiled()
    flags = Flags()
    fit(model, [GradualUnfreezing([("backbone/b1", 2), ("backbone/b2", 1)], verbose=1), flags],
        epochs=3)
    assert flags.trainable == [2, 4, 6]
    assert "GradualUnfreezing at epoch 1: 2 variables unfrozen" in capsys.readouterr().out
    # A fit that ends while something is still frozen puts the flags back.
    model = compiled()
    fit(model, [GradualUnfreezing({"backbone/*": 5})], epochs=1)
    assert all(v.trainable for v in model.trainable_variables) and len(model.trainable_variables) == 6
    fit(model, [], epochs=1)  # and a plain fit trains everything again


def test_a_group_frozen_when_the_optimizer_was_built_is_built_and_unfrozen():
    """Keras builds the optimizer before `fit` under a distribution strategy
    (without one, in the first step; then GradualUnfreezing builds it first,
    on every variable). Built while the backbone was frozen, the
    MultiOptimizer has no state for the backbone's group: GradualUnfreezing
    builds that group and trains it from epoch 1."""
    model = compiled()
    model.get_layer("backbone").trainable = False
    model.optimizer.build(model.trainable_variables)
    subs = {o.name: o for o in model.optimizer.optimizers}
    assert not subs["backbone"].built
    backbone_weights = [w.copy() for w in model.get_layer("backbone").get_weights()]
    flags = Flags()
    fit(model, [GradualUnfreezing([("backbone/*", 1)]), flags], epochs=2)
    assert flags.trainable == [2, 6]
    assert int(subs["backbone"].iterations.numpy()) == 4
    assert int(subs["head"].iterations.numpy()) == 8
    assert any(
        not np.array_equal(a, b)
        for a, b in zip(model.get_layer("backbone").get_weights(), backbone_weights)
    )


def test_an_optimizer_built_without_a_scheduled_variable_is_refused():
    """A plain optimizer (or one group) built while part of it was frozen
    cannot grow: the message says what to do, and nothing has changed."""
    model = make_net()
    model.get_layer("backbone").trainable = False
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    fit(model, [], epochs=1)  # builds the optimizer on the head only
    weights = model.get_weights()
    with pytest.raises(ValueError, match=r"cannot unfreeze \['b1/kernel'.*built while they were frozen"):
        fit(model, [GradualUnfreezing([("backbone/*", 1)])])
    for a, b in zip(model.get_weights(), weights):
        np.testing.assert_array_equal(a, b)
    # A group only partly built (b1 frozen, b2 trainable when it was built).
    model = compiled()
    model.get_layer("backbone").get_layer("b1").trainable = False
    model.optimizer.build(model.trainable_variables)
    with pytest.raises(ValueError, match=r"cannot unfreeze \['b1/kernel', 'b1/bias'\]"):
        fit(model, [GradualUnfreezing([("backbone/*", 1)])])


def test_an_unbuilt_optimizer_is_built_on_the_frozen_variables_too():
    """Without a strategy Keras builds the optimizer in the first step, on the
    trainable variables of that moment; GradualUnfreezing builds it first."""
    model = make_net()
    model.get_layer("backbone").trainable = False
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    flags = Flags()
    fit(model, [GradualUnfreezing([("backbone/*", 1)]), flags], epochs=2)
    assert flags.trainable == [2, 6]


def test_overlapping_unfreezing_entries_are_refused():
    with pytest.raises(ValueError, match=r"'b1/kernel' is in two entries.*0 and 1"):
        fit(compiled(), [GradualUnfreezing([("backbone/*", 1), ("*/kernel", 2)])])


@pytest.mark.parametrize("kwargs, error, message", [
    ({"schedule": "backbone"}, TypeError, r"non-empty list of \(where, at\) pairs.*Received: schedule='backbone'"),
    ({"schedule": []}, TypeError, r"Received: schedule=\[\]"),
    ({"schedule": [("b1",)]}, TypeError, r"item 0 is not a pair"),
    ({"schedule": [("b1", -1)]}, ValueError, r"`at` must be a non-negative integer.*schedule\[0\]=\('b1', -1\)"),
    ({"schedule": [("b1", True)]}, ValueError, r"`at` must be a non-negative integer"),
    ({"schedule": [("b1", 1.5)]}, ValueError, r"`at` must be a non-negative integer"),
    ({"schedule": [(None, 1)]}, ValueError, r"where=None"),
    ({"schedule": [(3, 1)]}, TypeError, r"schedule\[0\]: `where` must be"),
    ({"schedule": [("b1", 1)], "unit": "batch"}, ValueError, r"`unit` must be one of \['epoch', 'step'\]\. Received: unit='batch'"),
])
def test_unfreezing_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        GradualUnfreezing(**kwargs)


def test_unfreezing_config_round_trip():
    callback = GradualUnfreezing(
        [("backbone/b1", 2), (["head"], 1), (LayerPath("backbone/b2"), 3)], unit="step", verbose=1)
    config = keras.saving.serialize_keras_object(callback)
    restored = keras.saving.deserialize_keras_object(config)
    assert isinstance(restored, GradualUnfreezing)
    assert restored.schedule == [("backbone/b1", 2), (("head",), 1), (LayerPath("backbone/b2"), 3)]
    assert restored.unit == "step" and restored.verbose == 1
    assert restored.get_config() == callback.get_config()
