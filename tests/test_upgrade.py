"""kt.upgrade(): same layers, weights, name, inputs and outputs; subclasses keep their class; clear errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

import keras_tapeops as kt
from parity_utils import classification_data
from parity_utils import max_weight_difference
from parity_utils import sequential_model


def test_upgrade_sequential_shares_layers_and_weights():
    model = sequential_model(name="my_seq")
    upgraded = kt.upgrade(model)
    assert isinstance(upgraded, kt.TapeOpsMixin)
    assert isinstance(upgraded, keras.Sequential)
    assert upgraded.name == "my_seq"
    assert all(a is b for a, b in zip(model.layers, upgraded.layers))
    assert len(upgraded.layers) == len(model.layers)
    assert upgraded.inputs[0].shape == model.inputs[0].shape
    x, _ = classification_data(n=8)
    np.testing.assert_array_equal(model.predict(x, verbose=0), upgraded.predict(x, verbose=0))
    # Shared, not copied: changing one changes the other.
    model.layers[0].kernel.assign(np.zeros(model.layers[0].kernel.shape))
    np.testing.assert_array_equal(upgraded.layers[0].kernel.numpy(), 0.0)


def test_upgrade_unbuilt_sequential():
    model = keras.Sequential([keras.layers.Dense(4), keras.layers.Dense(1)])
    upgraded = kt.upgrade(model)
    upgraded.compile(optimizer="sgd", loss="mse")
    x = np.ones((8, 3), "float32")
    upgraded.fit(x, np.ones((8, 1)), verbose=0)
    assert model.layers[0].kernel is upgraded.layers[0].kernel


def test_upgrade_functional_keeps_input_and_output_structure():
    inputs = {
        "a": keras.Input((3,), name="a"),
        "b": keras.Input((2,), name="b"),
    }
    merged = keras.layers.Concatenate()([inputs["a"], inputs["b"]])
    outputs = {"y": keras.layers.Dense(1, name="y")(merged)}
    model = keras.Model(inputs, outputs, name="dict_model")
    upgraded = kt.upgrade(model)
    assert isinstance(upgraded, kt.TapeOpsMixin)
    assert upgraded.name == "dict_model"
    assert set(upgraded.input) == {"a", "b"}
    assert set(upgraded.output) == {"y"}
    assert [w.path for w in upgraded.weights] == [w.path for w in model.weights]
    data = {"a": np.ones((4, 3), "float32"), "b": np.ones((4, 2), "float32")}
    np.testing.assert_array_equal(
        model.predict(data, verbose=0)["y"], upgraded.predict(data, verbose=0)["y"]
    )


def test_upgrade_returns_enabled_model_unchanged():
    upgraded = kt.upgrade(sequential_model())
    assert kt.upgrade(upgraded) is upgraded


def test_upgrade_keeps_trainable_flag():
    model = sequential_model()
    model.trainable = False
    assert kt.upgrade(model).trainable is False


class Plain(keras.Model):
    def __init__(self):
        super().__init__()
        self.d = keras.layers.Dense(1)

    def call(self, x):
        return self.d(x)


def test_upgrade_subclassed_model_says_to_mix_in():
    with pytest.raises(TypeError, match=r"class Plain\(kt.TapeOpsMixin, keras.Model\)"):
        kt.upgrade(Plain())


def test_upgrade_rejects_non_models():
    with pytest.raises(TypeError, match="Received: model="):
        kt.upgrade(keras.layers.Dense(3))


def test_mixin_is_not_a_keras_model():
    assert not issubclass(kt.TapeOpsMixin, keras.Model)


# --------------------------------------------------------------------------
# Functional-built subclasses (issue 10): every keras-hub Task is one.

from keras_tapeops.upgrade import BASE_CLASS_KEY  # noqa: E402


@keras.saving.register_keras_serializable(package="test_upgrade")
class Classifier(keras.Model):
    """A keras.Model subclass built the functional way, with its own hooks."""

    def __init__(self, units=16, classes=3, **kwargs):
        inputs = keras.Input((8,), name="features")
        self.hidden = keras.layers.Dense(units, activation="relu", name="hidden")
        self.head = keras.layers.Dense(classes, name="head")
        outputs = self.head(self.hidden(inputs))
        super().__init__(inputs, outputs, **kwargs)
        self.units = units
        self.classes = classes
        self.label_names = [f"class_{i}" for i in range(classes)]
        # Counts executed train steps (a variable: fit traces train_step once).
        self.train_steps = keras.Variable(0, dtype="int64", trainable=False, name="train_steps")

    def describe(self):
        return f"{self.units} hidden units, labels {self.label_names}"

    def train_step(self, data):
        self.train_steps.assign_add(1)
        return super().train_step(data)

    def get_config(self):
        return {"units": self.units, "classes": self.classes, "name": self.name}


def test_upgrade_functional_subclass_keeps_its_class_in_place():
    model = Classifier(name="clf")
    weights_before = [id(v) for v in model.weights]
    layers_before = list(model.layers)
    upgraded = kt.upgrade(model)

    # The same object, still a Classifier, now with the mixin.
    assert upgraded is model
    assert isinstance(upgraded, Classifier)
    assert isinstance(upgraded, kt.TapeOpsMixin)
    assert type(upgraded).__name__ == "TapeOpsClassifier"
    assert kt.upgrade(upgraded) is upgraded
    # Methods and attributes are intact.
    assert upgraded.describe() == "16 hidden units, labels ['class_0', 'class_1', 'class_2']"
    assert upgraded.hidden is layers_before[1] and upgraded.head is layers_before[2]
    assert upgraded.name == "clf"
    # Same layers and variables (nothing rebuilt).
    assert all(a is b for a, b in zip(upgraded.layers, layers_before))
    assert [id(v) for v in upgraded.weights] == weights_before


def test_upgraded_subclass_mro_puts_the_mixin_before_keras():
    upgraded = kt.upgrade(Classifier())
    mro = type(upgraded).__mro__
    from keras.src.models.functional import Functional

    # As if written `class Classifier(kt.TapeOpsMixin, keras.Model)`: the
    # class's own methods first, then the mixin, then every Keras class.
    assert mro.index(Classifier) < mro.index(kt.TapeOpsMixin)
    assert mro.index(kt.TapeOpsMixin) < mro.index(Functional) < mro.index(keras.Model)
    keras_classes = [c for c in mro if c.__module__.startswith("keras.")]
    assert all(mro.index(kt.TapeOpsMixin) < mro.index(c) for c in keras_classes)
    # The mixin's own bases (saving, metrics, step functions) too.
    parts = [c for c in kt.TapeOpsMixin.__mro__ if c is not object]
    assert all(mro.index(p) < mro.index(c) for p in parts for c in keras_classes)
    # train_step resolves to the class's override, whose super() is the mixin's.
    assert type(upgraded).train_step is Classifier.train_step
    assert mro[mro.index(Classifier) + 1] is kt.TapeOpsMixin


def test_upgraded_class_is_one_per_class():
    a, b = kt.upgrade(Classifier()), kt.upgrade(Classifier(units=4))
    assert type(a) is type(b)
    assert kt.upgrade(Classifier()).__class__ is kt.upgrade(Classifier()).__class__


def test_overridden_train_step_runs_and_reaches_the_mixin_step():
    x, y = classification_data(n=48)
    model = kt.upgrade(Classifier())
    model.compile(
        optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        gradient_transforms=[kt.ClipByNorm(1.0)],
        loss_terms=[kt.LossTerm(lambda m, x, y, p: keras.ops.mean(p**2), name="logits_sq")],
    )
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    # The class's own train_step ran on every step (2 epochs x 3 batches) ...
    assert int(model.train_steps.numpy()) == 6
    # ... and its super().train_step was the mixin's: the loss term is logged.
    assert len(history.history["logits_sq"]) == 2
    assert all(v > 0 for v in history.history["logits_sq"])


def test_upgraded_subclass_without_options_trains_like_stock():
    x, y = classification_data(n=48)
    keras.utils.set_random_seed(3)
    stock = Classifier()
    keras.utils.set_random_seed(3)
    upgraded = kt.upgrade(Classifier())
    histories = []
    for model in (stock, upgraded):
        model.compile(optimizer=keras.optimizers.Adam(1e-2),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        histories.append(model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history)
    assert max_weight_difference(stock, upgraded) == 0.0
    assert histories[0] == histories[1]


def test_upgrade_keeps_compile_and_optimizer_state():
    x, y = classification_data(n=32)
    model = Classifier()
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=16, verbose=0)
    optimizer = model.optimizer
    iterations = int(optimizer.iterations.numpy())
    assert model.train_function is not None
    upgraded = kt.upgrade(model)
    assert upgraded.compiled and upgraded.optimizer is optimizer
    assert int(upgraded.optimizer.iterations.numpy()) == iterations == 2
    # The stock step traced before is dropped; the next fit traces the class's
    # (and the mixin's) step and continues from the same optimizer state.
    assert upgraded.train_function is None
    upgraded.fit(x, y, batch_size=16, verbose=0)
    assert int(optimizer.iterations.numpy()) == 4
    assert int(upgraded.train_steps.numpy()) == 4


def test_upgraded_subclass_config_round_trip_in_process():
    upgraded = kt.upgrade(Classifier(units=5, name="five"))
    config = upgraded.get_config()
    assert config[BASE_CLASS_KEY] == {
        "module": __name__, "class_name": "Classifier",
        "registered_name": "test_upgrade>Classifier",
    }
    clone = type(upgraded).from_config(config)
    assert type(clone) is type(upgraded)
    assert (clone.units, clone.name) == (5, "five")
    assert keras.saving.get_registered_name(type(upgraded)) == "keras_tapeops>UpgradedModel"


LOAD_SCRIPT = r"""
import json, os, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import keras
import keras_tapeops as kt
upgrade_module = sys.modules["keras_tapeops.upgrade"]  # (kt.upgrade is the function)
import test_upgrade  # the user's code: defines and registers Classifier

assert len(upgrade_module._UPGRADED_CLASSES) == 0, "upgraded class made before loading"
model = keras.models.load_model(sys.argv[2])
options = model.tapeops_options
np.savez(sys.argv[3], *model.get_weights())
print(json.dumps({
    "class": type(model).__name__,
    # (the mixin's own bases, its saving/metrics/step-function parts, left out)
    "mro": [c.__name__ for c in type(model).__mro__ if c not in kt.TapeOpsMixin.__mro__[1:]][:5],
    "is_classifier": isinstance(model, test_upgrade.Classifier),
    "is_mixin": isinstance(model, kt.TapeOpsMixin),
    "describe": model.describe(),
    "transforms": [repr(t) for t in options.gradient_transforms],
    "micro_batches": options.micro_batches,
    "iterations": int(model.optimizer.iterations.numpy()),
    "train_steps": int(model.train_steps.numpy()),
}))
x, y = test_upgrade.classification_data(n=32)
model.fit(x, y, batch_size=16, verbose=0)
print(json.dumps({"train_steps_after_fit": int(model.train_steps.numpy())}))
"""


def run_fresh_python(script, *args):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow")
    out = subprocess.run(
        [sys.executable, "-c", script, *map(str, args)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def test_upgraded_subclass_saves_and_loads_in_a_fresh_process(tmp_path):
    x, y = classification_data(n=32)
    model = kt.upgrade(Classifier(units=6))
    model.compile(
        optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        gradient_transforms=[kt.ClipByNorm(1.0)], micro_batches=2,
    )
    model.fit(x, y, batch_size=16, verbose=0)
    path = tmp_path / "classifier.keras"
    model.save(path)

    loaded, after = run_fresh_python(
        LOAD_SCRIPT, Path(__file__).resolve().parent, path, tmp_path / "weights.npz"
    )
    assert loaded == {
        "class": "TapeOpsClassifier",
        "mro": ["TapeOpsClassifier", "_UpgradedModel", "Classifier", "TapeOpsMixin", "Functional"],
        "is_classifier": True,
        "is_mixin": True,
        "describe": "6 hidden units, labels ['class_0', 'class_1', 'class_2']",
        "transforms": [repr(kt.ClipByNorm(1.0))],
        "micro_batches": 2,
        "iterations": 2,
        "train_steps": 2,
    }
    saved = np.load(tmp_path / "weights.npz")
    expected = model.get_weights()
    assert len(saved.files) == len(expected)
    for i, w in enumerate(expected):
        np.testing.assert_array_equal(saved[f"arr_{i}"], w)
    # The reloaded model trains through the class's own step.
    assert after == {"train_steps_after_fit": 4}


class LocalClassifier(keras.Model):
    """Not registered: loading needs custom_objects, as with stock Keras."""

    def __init__(self, **kwargs):
        inputs = keras.Input((3,))
        super().__init__(inputs, keras.layers.Dense(1)(inputs), **kwargs)

    def get_config(self):
        return {"name": self.name}


def test_loading_needs_the_original_class(tmp_path):
    model = kt.upgrade(LocalClassifier())
    model.compile(optimizer="sgd", loss="mse", gradient_transforms=[kt.ClipByValue(0.5)])
    path = tmp_path / "local.keras"
    model.save(path)
    with pytest.raises(TypeError, match=r"original class 'LocalClassifier'.*register_keras_serializable.*custom_objects"):
        keras.models.load_model(path)
    loaded = keras.models.load_model(path, custom_objects={"LocalClassifier": LocalClassifier})
    assert isinstance(loaded, LocalClassifier) and isinstance(loaded, kt.TapeOpsMixin)
    assert type(loaded) is type(model)
    assert repr(loaded.tapeops_options.gradient_transforms[0]) == repr(kt.ClipByValue(0.5))


class MySequential(keras.Sequential):
    def n_layers(self):
        return len(self.layers)


def test_upgrade_sequential_subclass_keeps_its_class(tmp_path):
    model = MySequential([keras.Input((4,)), keras.layers.Dense(2), keras.layers.Dense(1)])
    kernel = model.layers[0].kernel
    upgraded = kt.upgrade(model)
    assert upgraded is model
    assert isinstance(upgraded, MySequential) and isinstance(upgraded, kt.TapeOpsMixin)
    assert upgraded.n_layers() == 2 and upgraded.layers[0].kernel is kernel
    mro = type(upgraded).__mro__
    assert mro.index(MySequential) < mro.index(kt.TapeOpsMixin) < mro.index(keras.Sequential)
    upgraded.compile(optimizer="sgd", loss="mse", gradient_transforms=[kt.ClipByNorm(1.0)])
    upgraded.fit(np.ones((8, 4), "float32"), np.ones((8, 1), "float32"), verbose=0)
    path = tmp_path / "seq.keras"
    upgraded.save(path)
    loaded = keras.models.load_model(path, custom_objects={"MySequential": MySequential})
    assert isinstance(loaded, MySequential) and loaded.tapeops_options.gradient_transforms


class Base(keras.Model):
    pass


class Subclassed(Base):
    def __init__(self):
        super().__init__()
        self.d = keras.layers.Dense(1)

    def call(self, x):
        return self.d(x)


def test_truly_subclassed_model_error_names_its_own_bases():
    with pytest.raises(TypeError) as info:
        kt.upgrade(Subclassed())
    message = str(info.value)
    assert "cannot rebuild a subclassed model (one with its own `call()`)" in message
    assert "`class Subclassed(kt.TapeOpsMixin, Base): ...`" in message
    assert "Received: model of type Subclassed" in message


def test_upgraded_subclass_pickles():
    import pickle

    x, y = classification_data(n=16)
    model = kt.upgrade(Classifier(units=4))
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  gradient_transforms=[kt.ClipByNorm(1.0)])
    model.fit(x, y, batch_size=8, verbose=0)
    copy = pickle.loads(pickle.dumps(model))
    assert type(copy) is type(model) and copy.units == 4
    assert repr(copy.tapeops_options.gradient_transforms[0]) == repr(kt.ClipByNorm(1.0))
    np.testing.assert_array_equal(copy.predict(x, verbose=0), model.predict(x, verbose=0))
