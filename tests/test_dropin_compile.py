"""Custom compile() and train_step, and every logged name checked (issue 17).

- A subclass with its own `compile()` (the keras.io GAN) loads as in stock
  Keras: not compiled, with Keras's warning.
- A `train_step` override that does not call `super()` gets a warning that
  the compiled options are not applied, and the options' trackers are not in
  `model.metrics` (the custom train_step guide feeds every metric).
- Names logged by terms, transforms and multi-gradient engines are checked
  against compiled metrics, per-output losses, "loss" and "val_" at
  `compile()`, or before the first step for names Keras resolves later.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt
from keras_tapeops.multi_gradient import MultiGradientOption
from keras_tapeops.multi_gradient import MultiGradientState
from keras_tapeops.registration import register

CUSTOM_COMPILE_WARNING = (
    r"`compile\(\)` was not called as part of model loading because the "
    r"model's `compile\(\)` method is custom"
)


def _data(n=8, outputs=1):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(n, 3)).astype("float32"),
            rng.normal(size=(n, outputs)).astype("float32"))


# ------------------------------------------------------- custom compile()
def _gan_class(base, name):
    """The keras.io GAN's shape: its own compile(d_optimizer, g_optimizer)."""

    class GAN(*base):
        def __init__(self, latent_dim=2, **kwargs):
            super().__init__(**kwargs)
            self.latent_dim = latent_dim
            self.generator = keras.Sequential(
                [keras.Input((latent_dim,)), keras.layers.Dense(3)], name="generator")
            self.discriminator = keras.Sequential(
                [keras.Input((3,)), keras.layers.Dense(1)], name="discriminator")

        def call(self, z):
            return self.discriminator(self.generator(z))

        def compile(self, d_optimizer, g_optimizer):
            super().compile()
            self.d_optimizer = d_optimizer
            self.g_optimizer = g_optimizer

        def get_config(self):
            return {**super().get_config(), "latent_dim": self.latent_dim}

    GAN.__name__ = GAN.__qualname__ = name
    return keras.saving.register_keras_serializable(package="test_dropin")(GAN)


GAN = _gan_class((kt.TapeOpsMixin, keras.Model), "DropinGAN")
StockGAN = _gan_class((keras.Model,), "DropinStockGAN")


@pytest.mark.parametrize("cls", [GAN, StockGAN], ids=["mixin", "stock"])
def test_custom_compile_loads_like_stock(cls, tmp_path):
    model = cls()
    model(np.zeros((1, 2), "float32"))
    model.compile(d_optimizer=keras.optimizers.Adam(), g_optimizer=keras.optimizers.Adam())
    model.save(tmp_path / "gan.keras")
    with pytest.warns(UserWarning, match=CUSTOM_COMPILE_WARNING):
        loaded = keras.models.load_model(tmp_path / "gan.keras")
    # Keras sets `compiled` after compile_from_config even when it skipped it.
    assert type(loaded) is cls and not hasattr(loaded, "d_optimizer")
    assert getattr(loaded, "optimizer", None) is None
    assert getattr(loaded, "tapeops_options", None) is None
    for a, b in zip(loaded.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    loaded.compile(d_optimizer=keras.optimizers.Adam(), g_optimizer=keras.optimizers.Adam())
    assert isinstance(loaded.d_optimizer, keras.optimizers.Adam)


@keras.saving.register_keras_serializable(package="test_dropin")
class PassThroughCompile(kt.TapeOpsMixin, keras.Model):
    """Keras's own test case: compile(*args, **kwargs) overridden, then super()."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(1)

    def call(self, x):
        return self.dense(x)

    def compile(self, *args, **kwargs):
        super().compile(*args, **kwargs)


@keras.saving.register_keras_serializable(package="test_dropin")
class MixinOnly(kt.TapeOpsMixin, keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(1)

    def call(self, x):
        return self.dense(x)


@pytest.mark.parametrize("cls", [PassThroughCompile, MixinOnly])
def test_only_the_mixins_compile_is_replayed_on_load(cls, tmp_path):
    """An overridden compile() is skipped with Keras's warning even if it would
    accept the arguments (stock semantics); the mixin's own is replayed with
    the keras_tapeops options (companion)."""
    model = cls()
    model(np.zeros((1, 3), "float32"))
    model.compile(optimizer="sgd", loss="mse", gradient_transforms=[kt.ClipByNorm(1.0)])
    model.save(tmp_path / "m.keras")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = keras.models.load_model(tmp_path / "m.keras")
    custom = [w for w in caught if "method is custom" in str(w.message)]
    if cls is PassThroughCompile:
        assert custom and getattr(loaded, "optimizer", None) is None
        assert loaded.tapeops_options is None
    else:
        assert not custom and isinstance(loaded.optimizer, keras.optimizers.SGD)
        assert repr(loaded.tapeops_options.gradient_transforms[0]) == repr(kt.ClipByNorm(1.0))


@keras.saving.register_keras_serializable(package="test_dropin")
class TaskLike(keras.Model):
    """keras-hub's Task shape: built functionally, compile() with defaults that
    passes everything else on to super()."""

    def __init__(self, **kwargs):
        inputs = keras.Input((3,))
        super().__init__(inputs, keras.layers.Dense(1)(inputs), **kwargs)

    def compile(self, optimizer="auto", loss="auto", **kwargs):
        super().compile(optimizer="sgd" if optimizer == "auto" else optimizer,
                        loss="mse" if loss == "auto" else loss, **kwargs)

    def get_config(self):
        return {"name": self.name}


@keras.saving.register_keras_serializable(package="test_dropin")
class LearningRateTask(TaskLike):
    """A compile() whose signature does not take the saved arguments."""

    def compile(self, learning_rate, **kwargs):
        super().compile(optimizer=keras.optimizers.SGD(learning_rate), **kwargs)


@pytest.mark.parametrize("cls", [TaskLike, LearningRateTask])
def test_upgraded_class_replays_a_compile_that_takes_the_saved_arguments(cls, tmp_path):
    """`kt.upgrade` promises upgraded models load compiled with their options:
    through a compile() that takes the saved arguments (keras-hub's Tasks);
    one that does not is skipped with Keras's warning, as stock."""
    model = kt.upgrade(cls())
    if cls is TaskLike:
        model.compile(micro_batches=2)
    else:
        model.compile(0.1, micro_batches=2)
    model.save(tmp_path / "task.keras")
    if cls is TaskLike:
        loaded = keras.models.load_model(tmp_path / "task.keras")
        assert loaded.tapeops_options.micro_batches == 2
    else:
        with pytest.warns(UserWarning, match=CUSTOM_COMPILE_WARNING):
            loaded = keras.models.load_model(tmp_path / "task.keras")
        assert getattr(loaded, "optimizer", None) is None
    assert isinstance(loaded, cls) and isinstance(loaded, kt.TapeOpsMixin)


# ------------------------------------------------- custom train_step
def _guide_train_step(self, data):
    """The keras.io "customizing what happens in fit()" step (no super())."""
    x, y = data
    with tf.GradientTape() as tape:
        y_pred = self(x, training=True)
        loss = self.compute_loss(y=y, y_pred=y_pred)
    grads = tape.gradient(loss, self.trainable_variables)
    self.optimizer.apply(grads, self.trainable_variables)
    for metric in self.metrics:
        if metric.name == "loss":
            metric.update_state(loss)
        else:
            metric.update_state(y, y_pred)
    return {m.name: m.result() for m in self.metrics}


def _calling_super(self, data):
    return super(type(self), self).train_step(data)


def _net(train_step, mixin=True):
    bases = (kt.TapeOpsMixin, keras.Model) if mixin else (keras.Model,)
    cls = type("CustomStep", bases, {
        "__init__": lambda self, **kw: (
            super(cls, self).__init__(**kw),
            setattr(self, "hidden", keras.layers.Dense(2, name="hidden")),
            setattr(self, "head", keras.layers.Dense(1, name="head")),
        )[0],
        "call": lambda self, x: self.head(self.hidden(x)),
        "train_step": train_step,
    })
    model = cls()
    model(np.zeros((1, 3), "float32"))
    model.set_weights([np.full((3, 2), 0.3, "float32"), np.zeros(2, "float32"),
                       np.full((2, 1), -0.2, "float32"), np.zeros(1, "float32")])
    return model


OPTIONS = dict(
    loss_terms=[kt.ActivationPenalty("hidden", l2=1.0, name="pen")],
    gradient_transforms=[kt.ClipByValue(1e-6), kt.LogGradientNorm()],
)


def test_train_step_without_super_warns_once_and_hides_the_options_metrics():
    x, y = _data()
    model = _net(_guide_train_step)
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse", metrics=["mae"], **OPTIONS)
    with pytest.warns(UserWarning, match=(
        r"CustomStep.train_step does not call super\(\).train_step\(data\), so the "
        r"keras_tapeops options compiled into this model \(gradient_transforms, "
        r"loss_terms\) are not applied")):
        history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0).history
    assert sorted(history) == ["loss", "mae"]
    assert [m.name for m in model.metrics] == ["loss", "compile_metrics"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.fit(x, y, batch_size=4, shuffle=False, verbose=0)  # warned once
    # The step is the override's own: the same weights as without the mixin.
    stock = _net(_guide_train_step, mixin=False)
    stock.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse", metrics=["mae"])
    stock.fit(x, y, batch_size=4, epochs=3, shuffle=False, verbose=0)
    for a, b in zip(model.get_weights(), stock.get_weights()):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_train_step_calling_super_applies_and_logs_the_options():
    """Companion: through super() the options apply (ClipByValue(1e-6) with SGD(1)
    moves each weight by at most 2e-6 in two steps), log, and nothing warns."""
    x, y = _data()
    model = _net(_calling_super)
    before = model.get_weights()
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse", metrics=["mae"], **OPTIONS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        history = model.fit(x, y, batch_size=4, shuffle=False, verbose=0).history
    assert sorted(history) == ["grad_norm", "loss", "mae", "pen"]
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(model.get_weights(), before))
    assert 0 < moved <= 2e-6 + 1e-7  # float32 rounding of weights near 0.3


def test_custom_train_step_without_options_does_not_warn():
    x, y = _data()
    model = _net(_guide_train_step)
    model.compile(optimizer="sgd", loss="mse")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.fit(x, y, batch_size=4, shuffle=False, verbose=0)


# --------------------------------------------------------- name checks
@register
class _NamedMetricSelection(MultiGradientOption):
    """Test engine that logs one metric named `name`."""

    option_name = "sample_selection"

    def __init__(self, name="selected"):
        self.name = name

    def bind(self, model, tree):
        state = MultiGradientState()
        state.metrics = {self.name: keras.metrics.Sum(name=self.name)}
        return state

    def get_config(self):
        return {"name": self.name}


def _sequential():
    return kt.upgrade(keras.Sequential([
        keras.Input((3,)), keras.layers.Dense(2, name="hidden"), keras.layers.Dense(1, name="o"),
    ]))


@pytest.mark.parametrize("options, name", [
    ({"gradient_transforms": [kt.LogGradientNorm(name="mae")]}, "mae"),
    ({"gradient_transforms": [kt.SkipNonFinite(name="mae")]}, "mae"),
    ({"gradient_transforms": [kt.LogUpdateRatio(name="loss")]}, "loss"),
    ({"gradient_transforms": [kt.LogGradientNorm(name="val_loss")]}, "val_loss"),
    ({"gradient_transforms": [kt.LogGradientNorm(name="g", log_max=True)],
      "loss_terms": [kt.ActivationPenalty("hidden", l2=1.0, name="g_max")]}, "g_max"),
    ({"sample_selection": _NamedMetricSelection("mae")}, "mae"),
    ({"sample_selection": _NamedMetricSelection("val_picked")}, "val_picked"),
])
def test_logged_name_clash_fails_at_compile_keeping_the_old_compilation(options, name):
    model = _sequential()
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    with pytest.raises(ValueError, match=rf"Received: name={name!r}"):
        model.compile(optimizer="sgd", loss="mse", metrics=["mae"], **options)
    assert isinstance(model.optimizer, keras.optimizers.Adam)
    assert model.tapeops_options.is_stock


def _two_outputs():
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(2, name="hidden")(inputs)
    return kt.upgrade(keras.Model(inputs, {
        "o1": keras.layers.Dense(1, name="o1")(hidden),
        "o2": keras.layers.Dense(1, name="o2")(hidden),
    }))


@pytest.mark.parametrize("option", ["transform", "engine"])
def test_name_keras_resolves_later_fails_before_the_first_update(option):
    """A list loss names its per-output losses only when Keras builds it: a
    transform or engine metric named so fails before any weight changes."""
    x, _ = _data()
    targets = [x[:, :1], x[:, 1:2]]
    model = _two_outputs()
    options = (
        {"gradient_transforms": [kt.LogGradientNorm(name="o1_loss")]} if option == "transform"
        else {"sample_selection": _NamedMetricSelection("o1_loss")}
    )
    model.compile(optimizer="sgd", loss=["mse", "mse"], **options)
    before = model.get_weights()
    with pytest.raises(ValueError, match=r"metric name 'o1_loss' clashes with a metric of "
                                         r"the model \(.*'o1_loss'.*\)\. Received: name='o1_loss'"):
        model.fit(x, targets, verbose=0)
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert int(model.optimizer.iterations) == 0
    # Companion: a free name trains and is logged next to the per-output losses.
    model.compile(optimizer="sgd", loss=["mse", "mse"],
                  gradient_transforms=[kt.LogGradientNorm(name="norm")])
    history = model.fit(x, targets, verbose=0).history
    assert {"norm", "o1_loss", "o2_loss", "loss"} <= set(history)


@pytest.mark.parametrize("run_eagerly", [False, True])
def test_unbuilt_model_checks_transform_names_before_its_first_update(run_eagerly):
    """A model built by its first batch binds its transforms then: their metric
    names are checked against the compiled metrics before any update (an
    eager step checks before its forward pass: BatchNormalization unchanged)."""
    x, y = _data()
    model = kt.upgrade(keras.Sequential([
        keras.layers.Dense(2, name="h"), keras.layers.BatchNormalization(name="bn"),
        keras.layers.Dense(1, name="o"),
    ]))
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"], run_eagerly=run_eagerly,
                  gradient_transforms=[kt.LogGradientNorm(name="mae")])
    with pytest.raises(ValueError, match=r"LogGradientNorm metric name 'mae' clashes with "
                                         r"a metric of the model \(\['loss', 'mae'\]\)"):
        model.fit(x, y, verbose=0)
    assert int(model.optimizer.iterations) == 0
    if not run_eagerly:
        return  # the trace failed: nothing ran (variables built in it are not even set)
    bn = model.get_layer("bn")
    np.testing.assert_array_equal(bn.moving_mean.numpy(), np.zeros(2, "float32"))
    np.testing.assert_array_equal(bn.moving_variance.numpy(), np.ones(2, "float32"))
