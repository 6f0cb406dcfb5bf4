"""task_balancing options: config round trips, argument checks, compile-time refusals, saving."""

import keras
import numpy as np
import pytest

import keras_tapeops as kt
from test_multi_task import build_model
from test_multi_task import compile_and_fit
from test_multi_task import make_data

ALL = [
    kt.PCGrad(shared="trunk/*", seed=3),
    kt.MGDA(shared=["trunk"], on="representation", representation="trunk", normalization="loss+"),
    kt.CAGrad(c=0.5, rescale=2, shared="trunk", tasks=["a", "b"]),
    kt.IMTLG(shared="trunk"),
    kt.AlignedMTL(scale_mode="median", shared="trunk"),
    kt.UPGrad(norm_eps=1e-3, reg_eps=1e-5, shared="trunk"),
    kt.UncertaintyWeighting(learning_rate=0.05, initial_log_variance=0.0, tasks=["a", "b"]),
    kt.DWA(temperature=1.5),
    kt.GradNorm(alpha=0.5, learning_rate=0.1, shared="trunk"),
    kt.FAMO(learning_rate=0.01, weight_decay=0.0),
    kt.MeasureConflict(every=5, shared="trunk"),
]


def test_get_config_round_trip():
    for option in ALL:
        config = option.get_config()
        again = type(option).from_config(config)
        assert again.get_config() == config, option
        assert repr(again) == repr(option)
        restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(option))
        assert type(restored) is type(option) and restored.get_config() == config
        assert type(option).option_name == "task_balancing"


BAD_ARGUMENTS = [
    (lambda: kt.CAGrad(c=-1), "Received: c=-1"),
    (lambda: kt.CAGrad(rescale=3), "Received: rescale=3"),
    (lambda: kt.MGDA(on="rep"), "Received: on='rep'"),
    (lambda: kt.MGDA(normalization="max"), "Received: normalization='max'"),
    (lambda: kt.MGDA(representation="trunk"), "on='representation'.*Received: representation='trunk'"),
    (lambda: kt.AlignedMTL(scale_mode="mean"), "Received: scale_mode='mean'"),
    (lambda: kt.UPGrad(reg_eps=0), "Received: reg_eps=0"),
    (lambda: kt.DWA(temperature=0), "Received: temperature=0"),
    (lambda: kt.GradNorm(alpha=-1), "Received: alpha=-1"),
    (lambda: kt.FAMO(learning_rate=0), "Received: learning_rate=0"),
    (lambda: kt.MeasureConflict(every=0), "Received: every=0"),
    (lambda: kt.PCGrad(seed=1.5), "Received: seed=1.5"),
    (lambda: kt.PCGrad(shared=""), "`shared`.*Received: shared=''"),
    (lambda: kt.PCGrad(tasks="a"), "Received: tasks='a'"),
    (lambda: kt.PCGrad(tasks=["a"]), r"Received: tasks=\['a'\]"),
    (lambda: kt.PCGrad(tasks=["a", "a"]), "distinct"),
]


def test_bad_arguments_are_refused_with_received():
    for make, message in BAD_ARGUMENTS:
        with pytest.raises((TypeError, ValueError), match=message):
            make()


@pytest.mark.parametrize("option, message", [
    (kt.PCGrad(shared="nope*"), "`shared` selects no trainable variable.*Received: shared='nope\\*'"),
    (kt.PCGrad(shared="nope"), "selects no trainable variable.*Received: shared='nope'.*'trunk'"),
    (kt.PCGrad(shared="*"), "covers every trainable variable.*Received: shared='\\*'"),
    (kt.UncertaintyWeighting(tasks=["a", "zzz"]), "are not outputs.*Received: tasks=\\['a', 'zzz'\\]"),
    (kt.MGDA(shared=["trunk", "a"], on="representation"), "Received: representation=None"),
])
def test_bad_configurations_are_refused_at_compile_before_any_weight_changes(option, message):
    model = build_model(2)
    before = model.get_weights()
    with pytest.raises(ValueError, match=message):
        model.compile(optimizer="sgd", loss={"a": "mse", "b": "mse"}, task_balancing=option)
    assert model.tapeops_options is None
    for a, b in zip(model.get_weights(), before):
        np.testing.assert_array_equal(a, b)


def test_single_output_model_is_refused_at_compile():
    model = kt.upgrade(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="trunk"),
                                         keras.layers.Dense(1, name="head")]))
    with pytest.raises(ValueError, match="at least two outputs.*Received: task_balancing=PCGrad"):
        model.compile(optimizer="sgd", loss="mse", task_balancing=kt.PCGrad(shared="trunk"))


def test_a_task_without_a_loss_is_refused_on_the_first_batch():
    model = build_model(3)
    before = model.get_weights()
    x, ys, _ = make_data(3)
    model.compile(optimizer="sgd", loss={"a": "mse", "b": "mse", "c": None},
                  task_balancing=kt.PCGrad(shared="trunk"))
    with pytest.raises(ValueError, match=r"tasks \['c'\] have no loss.*Received: tasks=\['a', 'b', 'c'\]"):
        model.fit(x, {"a": ys["a"], "b": ys["b"]}, batch_size=8, epochs=1, verbose=0)
    for a, b in zip(model.get_weights(), before):
        np.testing.assert_array_equal(a, b)


def test_shared_none_finds_the_layers_two_outputs_depend_on():
    model = build_model(2)
    model.compile(optimizer="sgd", loss={"a": "mse", "b": "mse"}, task_balancing=kt.PCGrad())
    engine = model.tapeops_state.engine
    shared = [v.path for v, on in zip(model.trainable_variables, engine.shared) if on]
    assert shared == ["trunk/kernel", "trunk/bias"]
    assert engine.task_names == ["a", "b"]


@pytest.mark.parametrize("make", [
    lambda: kt.UncertaintyWeighting(learning_rate=0.1),
    lambda: kt.GradNorm(shared="trunk", learning_rate=0.1),
], ids=["UncertaintyWeighting", "GradNorm"])
def test_learned_weights_survive_save_and_load(tmp_path, make):
    model = build_model(2)
    compile_and_fit(model, 2, epochs=2, task_balancing=make())
    state = {k: v.numpy() for k, v in model.tapeops_state.engine.state.items()}
    assert not np.allclose(state[next(iter(state))], make().initial_state(2)[next(iter(state))])
    assert not any(v is w for v in model.tapeops_state.engine.variables for w in model.weights)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded.tapeops_options.task_balancing) is type(make())
    for name, value in state.items():
        np.testing.assert_array_equal(loaded.tapeops_state.engine.state[name].numpy(), value)
    epochs = model.tapeops_state.engine.epochs
    if epochs is not None:
        np.testing.assert_array_equal(loaded.tapeops_state.engine.epochs.first.numpy(), epochs.first.numpy())


class _StopAtEpoch(keras.callbacks.Callback):
    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError("interrupted")


@pytest.mark.parametrize("make", [
    lambda: kt.UncertaintyWeighting(learning_rate=0.1),
    lambda: kt.GradNorm(shared="trunk", learning_rate=0.1),
], ids=["UncertaintyWeighting", "GradNorm"])
def test_learned_weights_survive_backup_and_restore(tmp_path, make):
    x, ys, sw = make_data(2)

    def fit(model, callbacks):
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss={"a": "mse", "b": "mse"},
                      task_balancing=make())
        model.fit(x, ys, sample_weight=sw, batch_size=8, epochs=3, shuffle=False,
                  verbose=0, callbacks=callbacks)

    straight = build_model(2)
    fit(straight, [])
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    interrupted = build_model(2)
    with pytest.raises(RuntimeError, match="interrupted"):
        fit(interrupted, [backup, _StopAtEpoch(2)])
    resumed = build_model(2)  # a fresh process would start from scratch
    fit(resumed, [backup])
    for a, b in zip(resumed.get_weights(), straight.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    for name, variable in straight.tapeops_state.engine.state.items():
        np.testing.assert_allclose(
            resumed.tapeops_state.engine.state[name].numpy(), variable.numpy(), rtol=1e-6, atol=1e-7
        )


class SubclassedNet(kt.TapeOpsMixin, keras.Model):
    def __init__(self):
        super().__init__()
        self.trunk = keras.layers.Dense(4, activation="tanh", name="trunk",
                                        kernel_regularizer=keras.regularizers.L2(0.01))
        self.a = keras.layers.Dense(1, name="a")
        self.b = keras.layers.Dense(2, name="b")

    def call(self, x):
        h = self.trunk(x)
        return {"a": self.a(h), "b": self.b(h)}


def test_subclassed_model_needs_tasks_and_then_equals_the_functional_model():
    with pytest.raises(ValueError, match="subclassed model.*Received: tasks=None"):
        SubclassedNet().compile(optimizer="sgd", loss={"a": "mse", "b": "mse"},
                              task_balancing=kt.PCGrad(shared="trunk"))
    functional = build_model(2)
    subclassed = SubclassedNet()  # built lazily, inside the first traced step
    compile_and_fit(subclassed, 2, task_balancing=kt.PCGrad(shared="trunk", tasks=["a", "b"], seed=0))
    subclassed.set_weights(functional.get_weights())  # same start, then one more epoch each
    compile_and_fit(subclassed, 2, task_balancing=kt.PCGrad(shared="trunk", tasks=["a", "b"], seed=0))
    compile_and_fit(functional, 2, task_balancing=kt.PCGrad(shared="trunk", seed=0))
    for a, b in zip(subclassed.get_weights(), functional.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
