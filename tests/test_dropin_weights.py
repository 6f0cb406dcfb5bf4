"""Weight files are interchangeable with stock Keras, with any option compiled (issue 17).

`model.weights`, `get_weights`/`set_weights` and `.weights.h5` files of an
upgraded model are the stock model's; the options' training state (stateful
transforms, the multi-gradient engine) is saved apart, under
`_tapeops_training_state`, by `.keras` files and `save_weights` (so
`BackupAndRestore`), and a stock model never reads it.
"""

import warnings

import h5py
import keras
import numpy as np
import pytest

import keras_tapeops as kt
from keras_tapeops.multi_gradient import MultiGradientOption
from keras_tapeops.multi_gradient import MultiGradientState
from keras_tapeops.registration import register

STATE_GROUP = "_tapeops_training_state"


@register
class _CountingSelection(MultiGradientOption):
    """Test engine: plain gradients, counts applied steps in a saved variable."""

    option_name = "sample_selection"

    def bind(self, model, tree):
        return _CountingState()


class _CountingState(MultiGradientState):
    def __init__(self):
        super().__init__()
        self.count = keras.Variable(0.0, trainable=False, name="applied")
        self.variables = [self.count]
        self.metrics = {"applied": keras.metrics.Sum(name="applied")}

    def finalize(self, model, grads, variables):
        self.count.assign_add(1.0)
        self.metrics["applied"].update_state(1.0)
        return grads


def _transforms():
    return [kt.SkipNonFinite(max_consecutive=9), kt.LogGradientNorm(log_max=True),
            kt.LogUpdateRatio(), kt.AdaptiveClip(0.5), kt.CentralizeGradients(),
            kt.ClipByGlobalNorm(10.0)]


# Every option, in the combinations compile() accepts.
CONFIGS = {
    "none": {},
    "transforms_terms_micro_accumulation": dict(
        gradient_transforms=_transforms(),
        loss_terms=[kt.ActivationPenalty("h", l2=1e-3, name="act")],
        micro_batches=2, accumulation_steps=2,
    ),
    "sam": dict(gradient_transforms=_transforms(), sharpness_aware=kt.SAM(rho=0.05)),
    "engine": dict(gradient_transforms=_transforms(), sample_selection=_CountingSelection()),
}


def _net(seed=1):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((3,)),
        keras.layers.Dense(4, activation="tanh", name="h"),
        keras.layers.BatchNormalization(name="bn"),
        keras.layers.Dense(1, name="o"),
    ])


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(8, 3)).astype("float32"), rng.normal(size=(8, 1)).astype("float32")


def _stock(seed=1):
    model = _net(seed)
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.5), loss="mse")
    return model


def _upgraded(config, seed=2):
    model = kt.upgrade(_net(seed))
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.5), loss="mse",
                  **CONFIGS[config])
    return model


def _fit(model, epochs=1):
    x, y = _data()
    return model.fit(x, y, batch_size=4, epochs=epochs, shuffle=False, verbose=0)


def _state(model):
    return {k: float(np.asarray(v)) for k, v in model.tapeops_state.training_state_items()}


def _h5_paths(path, skip=STATE_GROUP):
    found = []
    with h5py.File(path, "r") as f:
        f.visit(found.append)
    return sorted(p for p in found if not p.startswith(skip))


def _built_optimizer(model):
    model.optimizer.build(model.trainable_variables)
    return model


def _assert_same(a, b):
    assert len(a) == len(b)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_weights_and_weight_files_are_the_stock_models(config, tmp_path):
    stock, upgraded = _stock(), _upgraded(config)
    _fit(stock)
    _fit(upgraded)
    def layout(model):  # variable paths within the model, and shapes
        return [(v.path.split("/", 1)[1], v.shape) for v in model.weights]

    assert layout(upgraded) == layout(stock)
    assert len(upgraded.get_weights()) == len(stock.get_weights()) == 8
    # Options with state keep it apart from the weights.
    has_state = bool(CONFIGS[config].get("gradient_transforms"))
    assert bool(upgraded.tapeops_state.training_state_items()) == has_state

    # .weights.h5: the same layout, plus the training state's own group.
    stock.save_weights(tmp_path / "stock.weights.h5")
    upgraded.save_weights(tmp_path / "upgraded.weights.h5")
    assert _h5_paths(tmp_path / "upgraded.weights.h5") == _h5_paths(tmp_path / "stock.weights.h5")
    with h5py.File(tmp_path / "upgraded.weights.h5", "r") as f:
        assert (STATE_GROUP in f) == has_state

    # Both directions, with set_weights and with files; nothing warns (the
    # optimizers are built, else Keras warns that it skips their state).
    trained_stock, trained_upgraded = stock.get_weights(), upgraded.get_weights()
    fresh, other = _built_optimizer(_upgraded(config, seed=3)), _built_optimizer(_stock(seed=4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh.set_weights(trained_stock)
        _assert_same(fresh.get_weights(), trained_stock)
        fresh.load_weights(tmp_path / "upgraded.weights.h5")
        _assert_same(fresh.get_weights(), trained_upgraded)
        fresh.load_weights(tmp_path / "stock.weights.h5")
        _assert_same(fresh.get_weights(), trained_stock)
        other.set_weights(trained_upgraded)
        _assert_same(other.get_weights(), trained_upgraded)
        other.set_weights(trained_stock)
        other.load_weights(tmp_path / "upgraded.weights.h5")
        _assert_same(other.get_weights(), trained_upgraded)


def test_stock_model_reads_an_upgraded_keras_file_whole(tmp_path):
    """A stock model loads the weights of an upgraded `.keras` file and of one
    of its `.weights.h5` files without error (none of it half-applied)."""
    upgraded = _upgraded("engine")
    _fit(upgraded)
    upgraded.save(tmp_path / "upgraded.keras")
    stock = _stock(seed=5)
    stock.load_weights(tmp_path / "upgraded.keras")
    _assert_same(stock.get_weights(), upgraded.get_weights())
    # Companion: a file that does not match the stock model fails to load.
    wider = keras.Sequential([keras.Input((3,)), keras.layers.Dense(5, name="h"),
                              keras.layers.BatchNormalization(name="bn"),
                              keras.layers.Dense(1, name="o")])
    with pytest.raises(ValueError):
        wider.load_weights(tmp_path / "upgraded.keras")


def test_weight_files_move_between_models_compiled_with_other_options(tmp_path):
    """Weights load between two upgraded models whatever their options; training
    state saved for other options is skipped with a warning, state that matches
    by key (the same transform at the same position) is restored."""
    first = _upgraded("sam")
    _fit(first)
    first.save_weights(tmp_path / "first.weights.h5")
    second = _upgraded("engine", seed=6)
    _fit(second)
    second_state = _state(second)
    with pytest.warns(UserWarning, match=r"training state.*sample_selection\._CountingSelection\.0"):
        second.load_weights(tmp_path / "first.weights.h5")
    _assert_same(second.get_weights(), first.get_weights())
    assert _state(second) == {**second_state, **_state(first)}
    second.save_weights(tmp_path / "second.weights.h5")
    plain = _upgraded("none", seed=7)
    with pytest.warns(UserWarning, match=r"0\.SkipNonFinite\.consecutive_skips"):
        plain.load_weights(tmp_path / "second.weights.h5")
    _assert_same(plain.get_weights(), second.get_weights())


def test_training_state_is_saved_in_keras_files_not_in_weights(tmp_path):
    model = _upgraded("engine")
    _fit(model, epochs=2)
    state = _state(model)
    assert state["sample_selection._CountingSelection.0"] == 4.0
    model.tapeops_state.transforms[0][1].variables["consecutive_skips"].assign(2.0)
    state = _state(model)
    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    assert _state(loaded) == state
    assert len(loaded.weights) == len(_stock().weights)
    _assert_same(loaded.get_weights(), model.get_weights())
    # Companion: a freshly compiled model starts from zero.
    assert set(_state(_upgraded("engine")).values()) == {0.0}


def test_stock_weight_file_leaves_the_training_state_as_it_was(tmp_path):
    stock = _stock()
    stock.save_weights(tmp_path / "stock.weights.h5")
    model = _upgraded("engine")
    _fit(model)
    before = _state(model)
    assert before["sample_selection._CountingSelection.0"] == 2.0
    model.load_weights(tmp_path / "stock.weights.h5")
    assert _state(model) == before
    _assert_same(model.get_weights(), stock.get_weights())


class _Interrupt(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 1:
            raise RuntimeError("interrupted")


def test_backup_and_restore_resumes_the_training_state(tmp_path):
    """A run interrupted after epoch 1 and resumed equals an uninterrupted one:
    weights, optimizer and the engine's and transforms' state."""
    uninterrupted = _upgraded("engine")
    _fit(uninterrupted, epochs=2)
    backup = str(tmp_path / "backup")
    first = _upgraded("engine")
    x, y = _data()
    with pytest.raises(RuntimeError, match="interrupted"):
        first.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0,
                  callbacks=[keras.callbacks.BackupAndRestore(backup), _Interrupt()])
    resumed = _upgraded("engine")
    resumed.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0,
                callbacks=[keras.callbacks.BackupAndRestore(backup)])
    _assert_same(resumed.get_weights(), uninterrupted.get_weights())
    _assert_same([v.numpy() for v in resumed.optimizer.variables],
                 [v.numpy() for v in uninterrupted.optimizer.variables])
    assert _state(resumed) == _state(uninterrupted)
    assert _state(resumed)["sample_selection._CountingSelection.0"] == 4.0


def test_state_loaded_before_the_transforms_are_bound_is_restored_when_they_are():
    """A model compiled before it is built binds its transforms at its first
    step: state loaded earlier waits for them."""
    model = kt.upgrade(_net())
    unbuilt = keras.Sequential([keras.layers.Dense(2, name="h")])
    model = kt.upgrade(unbuilt)
    model.compile(optimizer="sgd", loss="mse", gradient_transforms=[kt.SkipNonFinite()])
    assert not model.tapeops_state.variables_bound
    model._tapeops_training_state.load_own_variables(
        {"0.SkipNonFinite.consecutive_skips": np.array(3.0, "float32")}
    )
    model(np.zeros((1, 3), "float32"))
    model.build_tapeops()
    assert _state(model) == {"0.SkipNonFinite.consecutive_skips": 3.0}


def test_mirrored_training_state_is_saved_apart_and_read_by_stock(mirrored, tmp_path):
    """Under MirroredStrategy: the same weights layout, a stock model (one device)
    reads the weights file, an upgraded mirrored model restores the state."""
    with mirrored.scope():
        model = _upgraded("transforms_terms_micro_accumulation")
    _fit(model)
    skips = model.tapeops_state.transforms[0][1].variables["consecutive_skips"]
    skips.assign(2.0)
    model.save_weights(tmp_path / "mirrored.weights.h5")
    stock = _built_optimizer(_stock(seed=8))
    stock.load_weights(tmp_path / "mirrored.weights.h5")
    _assert_same(stock.get_weights(), model.get_weights())
    with mirrored.scope():
        again = _upgraded("transforms_terms_micro_accumulation", seed=9)
    _fit(again)
    assert _state(again)["0.SkipNonFinite.consecutive_skips"] == 0.0
    again.load_weights(tmp_path / "mirrored.weights.h5")
    assert _state(again)["0.SkipNonFinite.consecutive_skips"] == 2.0
    _assert_same(again.get_weights(), model.get_weights())


def test_files_saved_before_issue_17_still_load(tmp_path):
    """Earlier versions saved the training state as the model's own variables
    (model-level entry "vars/0" ...): such a file restores it."""
    old_layout = _stock()
    old_layout.consecutive_skips = keras.Variable(2.0, trainable=False, name="consecutive_skips")
    _fit(old_layout)
    old_layout.save_weights(tmp_path / "old.weights.h5")
    with h5py.File(tmp_path / "old.weights.h5", "r") as f:
        assert list(f["vars"]) == ["0"]
    model = _upgraded("sam")
    model.load_weights(tmp_path / "old.weights.h5")
    assert _state(model) == {"0.SkipNonFinite.consecutive_skips": 2.0}
    _assert_same(model.get_weights(), old_layout.get_weights()[1:])  # own variables first
