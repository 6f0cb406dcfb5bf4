"""get_config -> from_config round trips of every public keras_tapeops class.

For each class exported by `keras_tapeops/__init__.py` that has a config:
it is registered as `"keras_tapeops>ClassName"`, the round-tripped object's
`get_config()` equals the original's, and it behaves the same: terms give the
same value as the original and as NumPy, transforms the same gradients as
NumPy, models the same outputs as a NumPy forward pass. The abstract bases
`Term` and `GradientTransform` are checked through a minimal registered user
subclass and `keras.saving.serialize_keras_object`. Companion tests show that
the behaviour checks catch a `get_config` that forgets an argument, which the
config comparison alone cannot.
"""

import copy

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt
from keras_tapeops.selectors import LayerPath

PACKAGE = "keras_tapeops_config_tests"


@keras.saving.register_keras_serializable(package=PACKAGE)
def mean_abs_prediction(model, x, y, y_pred):
    return tf.reduce_mean(tf.abs(y_pred))


@keras.saving.register_keras_serializable(package=PACKAGE)
def is_kernel(variable):
    return variable.path.endswith("kernel")


def roundtrip(obj):
    """`type(obj).from_config(obj.get_config())`, checking the config is stable."""
    config = obj.get_config()
    # Keras's functional from_config consumes the dict it is given.
    again = type(obj).from_config(copy.deepcopy(config))
    assert type(again) is type(obj)
    assert again.get_config() == config
    return again


# ------------------------------------------------------------ registration
CONFIG_CLASSES = [
    kt.ActivationPenalty, kt.LossTerm, kt.GradientPenalty, kt.ClipByValue,
    kt.ClipByNorm, kt.ClipByGlobalNorm, kt.WGANGP, kt.TapeOpsSequential,
    kt.TapeOpsFunctional, kt.SkipNonFinite, kt.LogGradientNorm, kt.SAM,
    kt.AdaptiveClip, kt.CentralizeGradients, kt.LogUpdateRatio,
    # Fourth round: kt.GAN and its penalties (behaviour: tests/test_gan_general.py).
    kt.GAN, kt.R1Penalty, kt.WGANGradientPenalty,
    # Third round: each has its behavioural round trip in its own test file.
    kt.AdversarialLoss, kt.TRADES, kt.DPSGD, kt.MetaLearner, kt.PDEResidual,
    kt.ConditionLoss, kt.PCGrad, kt.MGDA, kt.CAGrad, kt.IMTLG, kt.AlignedMTL,
    kt.UPGrad, kt.UncertaintyWeighting, kt.DWA, kt.GradNorm, kt.FAMO,
    kt.MeasureConflict, kt.TopLoss, kt.ReducibleLoss, kt.SelectiveBackprop,
    kt.ImportanceSampling, kt.SelfPaced, kt.SuperLoss,
]


@pytest.mark.parametrize("obj", [
    kt.SkipNonFinite(max_consecutive=np.int64(3), where="out*", name="skips"),
    kt.LogGradientNorm(where=["hid*"], name="hidden_norm", log_max=True),
    kt.SAM(rho=0.2, adaptive=True, where="hidden"),
], ids=lambda o: type(o).__name__)
def test_round_trip_of_the_newer_config_classes(obj):
    again = roundtrip(obj)
    assert repr(again) == repr(obj)
    via_keras = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(obj))
    assert via_keras.get_config() == obj.get_config()


@pytest.mark.parametrize("cls", CONFIG_CLASSES, ids=lambda c: c.__name__)
def test_registered_under_the_package_name(cls):
    name = keras.saving.get_registered_name(cls)
    assert name == f"keras_tapeops>{cls.__name__}"
    assert keras.saving.get_registered_object(name) is cls


def test_every_public_class_with_a_config_is_covered():
    public = {
        name for name in kt.__all__
        if isinstance(getattr(kt, name), type) and hasattr(getattr(kt, name), "get_config")
    }
    # Checked through user subclasses (tests/test_extending.py for the last three).
    abstract = {"Term", "GradientTransform", "Aggregator", "LossWeighting", "SelectionRule"}
    assert public == {c.__name__ for c in CONFIG_CLASSES} | abstract


def test_registration_check_can_fail():
    """Companion: an unregistered subclass keeps its plain class name."""

    class Unregistered(kt.ClipByNorm):
        pass

    assert keras.saving.get_registered_name(Unregistered) == "Unregistered"


# ------------------------------------------------------------------ terms
def linear_model():
    """x -> hidden (linear, 4 -> 5) -> out (5 -> 3); fixed weights."""
    rng = np.random.default_rng(3)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(5, name="hidden")(inputs)
    model = kt.upgrade(keras.Model(inputs, keras.layers.Dense(3, name="out")(hidden)))
    model.set_weights([rng.normal(size=w.shape).astype("float32")
                       for w in model.get_weights()])
    return model


def data():
    rng = np.random.default_rng(4)
    return (rng.normal(size=(6, 4)).astype("float32"),
            rng.normal(size=(6, 3)).astype("float32"))


def term_value(term, model=None):
    """The term's logged value in `evaluate()` on fixed weights and data."""
    model = model or linear_model()
    x, y = data()
    model.compile(optimizer="sgd", loss="mse", loss_terms=[term])
    logs = model.evaluate(x, y, batch_size=len(x), verbose=0, return_dict=True)
    return logs[term.name]


def numpy_forward(x):
    w1, b1, w2, b2 = [w.astype("float64") for w in linear_model().get_weights()]
    hidden = x @ w1 + b1
    return hidden, hidden @ w2 + b2, (w1, w2)


def numpy_term(kind, x, **kw):
    hidden, out, (w1, w2) = numpy_forward(x)
    if kind == "activation":
        return kw["l1"] * np.mean(np.abs(hidden)) + kw["l2"] * np.mean(hidden**2)
    if kind == "loss_term":
        return np.mean(np.abs(out))
    # d sum(out) / dx = w1 @ w2 @ 1 for every sample (a linear model).
    norm = np.linalg.norm(w1 @ w2.sum(axis=1))
    return (norm - kw["target"]) ** 2


SCHEDULE = keras.optimizers.schedules.PiecewiseConstantDecay([2], [0.5, 3.0])


def term_cases():
    """name -> (term, NumPy value, the model the original term must run on)."""
    owner = linear_model()  # a layer-object term only works on its own model
    return {
        "activation_penalty": (
            kt.ActivationPenalty("hidden", l1=0.2, l2=0.3, name="act", weight=1.5,
                                 in_validation=True),
            1.5 * numpy_term("activation", data()[0], l1=0.2, l2=0.3), None,
        ),
        "activation_penalty_layer_object": (
            kt.ActivationPenalty(owner.get_layer("hidden"), l2=0.3, name="act_obj"),
            0.3 * np.mean(numpy_forward(data()[0])[0] ** 2), owner,
        ),
        "loss_term_registered_fn": (
            kt.LossTerm(mean_abs_prediction, weight=SCHEDULE, name="mean_abs"),
            0.5 * numpy_term("loss_term", data()[0]), None,
        ),
        "gradient_penalty": (
            kt.GradientPenalty(weight=2.0, target=1.0, name="gp", in_validation=True),
            2.0 * numpy_term("gradient_penalty", data()[0], target=1.0), None,
        ),
    }


@pytest.mark.parametrize("case", list(term_cases()))
def test_term_round_trip(case):
    term, expected, owner = term_cases()[case]
    again = roundtrip(term)
    via_keras = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(term)
    )
    assert via_keras.get_config() == term.get_config()
    for step in (0, 2, 3):  # the weight (number or schedule) came back
        assert float(again.weight_at(step)) == float(term.weight_at(step))
    assert again.in_validation is True
    value = term_value(again)
    np.testing.assert_allclose(value, expected, rtol=1e-5)
    np.testing.assert_allclose(value, term_value(term, owner), rtol=1e-6)


def test_loss_term_fn_and_layer_object_come_back_by_name():
    again = roundtrip(kt.LossTerm(mean_abs_prediction, name="m"))
    assert again.fn is mean_abs_prediction
    model = linear_model()
    term = kt.ActivationPenalty(model.get_layer("hidden"), l2=1.0)
    assert term.bind(model) is model.get_layer("hidden")
    assert roundtrip(term).layer == "hidden"


# ------------------------------------------------------------- transforms
def grads_and_variables():
    model = linear_model()
    variables = model.trainable_variables
    rng = np.random.default_rng(5)
    grads = [(3.0 * rng.normal(size=v.shape)).astype("float32") for v in variables]
    return model, variables, grads


# Variables in order: hidden/kernel, hidden/bias, out/kernel, out/bias.
SELECTORS = {
    "all": (None, [True, True, True, True]),
    "glob": ("out*", [False, False, True, True]),
    "glob_list": (["hid*", "*/bias"], [True, True, False, True]),
    "layer": ("layer:hidden", [True, True, False, False]),
    "registered_callable": (is_kernel, [True, False, True, False]),
}


def numpy_transform(cls, threshold, grads, mask):
    grads = [g.astype("float64") for g in grads]
    if cls is kt.ClipByValue:
        return [np.clip(g, -threshold, threshold) if m else g
                for g, m in zip(grads, mask)]
    if cls is kt.ClipByNorm:
        return [g * threshold / max(np.linalg.norm(g), threshold) if m else g
                for g, m in zip(grads, mask)]
    norm = np.sqrt(sum(np.sum(g**2) for g, m in zip(grads, mask) if m))
    return [g * threshold / max(norm, threshold) if m else g
            for g, m in zip(grads, mask)]


def apply(transform, model, variables, grads):
    state = transform.bind(model, variables)
    out = transform([tf.constant(g) for g in grads], variables, state)
    return [np.asarray(g) for g in out]


@pytest.mark.parametrize("selector", list(SELECTORS))
@pytest.mark.parametrize(
    "cls", [kt.ClipByValue, kt.ClipByNorm, kt.ClipByGlobalNorm], ids=lambda c: c.__name__
)
def test_transform_round_trip(cls, selector):
    model, variables, grads = grads_and_variables()
    where, mask = SELECTORS[selector]
    if where == "layer:hidden":
        where = model.get_layer("hidden")
    transform = cls(1.5, where=where)
    again = roundtrip(transform)
    if selector == "layer":
        assert again.where == LayerPath("hidden")
    via_keras = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(transform)
    )
    assert via_keras.get_config() == transform.get_config()
    expected = numpy_transform(cls, 1.5, grads, mask)
    for got, want, orig in zip(
        apply(again, model, variables, grads), expected,
        apply(transform, model, variables, grads),
    ):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(got, orig, rtol=1e-6, atol=0)


# ----------------------------------------------------------------- models
def numpy_dense_stack(weights, x):
    out = x.astype("float64")
    for kernel, bias in zip(weights[::2], weights[1::2]):
        out = out @ kernel + bias
    return out


def test_tapeops_sequential_round_trip():
    model = kt.upgrade(keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(5, name="a"), keras.layers.Dense(2, name="b")],
        name="seq",
    ))
    again = roundtrip(model)
    assert [layer.name for layer in again.layers] == ["a", "b"]
    again.set_weights(model.get_weights())
    x = data()[0]
    np.testing.assert_allclose(
        again.predict(x, verbose=0), numpy_dense_stack(model.get_weights(), x),
        rtol=1e-5, atol=1e-6,
    )


def test_tapeops_functional_round_trip():
    model = linear_model()
    again = roundtrip(model)
    assert isinstance(again, kt.TapeOpsMixin)
    assert [layer.name for layer in again.layers[1:]] == ["hidden", "out"]
    again.set_weights(model.get_weights())
    x = data()[0]
    np.testing.assert_allclose(
        again.predict(x, verbose=0), numpy_forward(x)[1], rtol=1e-5, atol=1e-6
    )


def test_wgangp_round_trip_with_sub_models():
    generator = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(4, name="g1"), keras.layers.Dense(2, name="g2")],
        name="generator",
    )
    critic = keras.Sequential(
        [keras.Input((2,)), keras.layers.Dense(4, name="c1"), keras.layers.Dense(1, name="c2")],
        name="critic",
    )
    gan = kt.WGANGP(generator, critic, latent_dim=3, critic_steps=2, gp_weight=4.0,
                    name="gan")
    again = roundtrip(gan)
    assert (again.latent_dim, again.critic_steps, again.gp_weight) == (3, 2, 4.0)
    assert again.generator is not generator
    assert again.generator.get_config() == generator.get_config()
    assert again.critic.get_config() == critic.get_config()
    via_keras = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(gan)
    )
    assert via_keras.get_config() == gan.get_config()
    again.generator.set_weights(generator.get_weights())
    again.critic.set_weights(critic.get_weights())
    z = np.random.default_rng(6).normal(size=(5, 3)).astype("float32")
    fake = numpy_dense_stack(generator.get_weights(), z)
    np.testing.assert_allclose(again.generator(z), fake, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        again.critic(fake.astype("float32")),
        numpy_dense_stack(critic.get_weights(), fake), rtol=1e-5, atol=1e-5,
    )


# ------------------------------------------- abstract bases, via subclasses
@keras.saving.register_keras_serializable(package=PACKAGE)
class ScaledOutputMean(kt.Term):
    """A minimal user term: `scale * mean(y_pred)`."""

    def __init__(self, scale=1.0, **kwargs):
        super().__init__(**kwargs)
        self.scale = scale

    def call(self, context):
        return self.scale * tf.reduce_mean(tf.cast(context.y_pred, "float32"))

    def get_config(self):
        return {**super().get_config(), "scale": self.scale}


@keras.saving.register_keras_serializable(package=PACKAGE)
class ScaleGradients(kt.GradientTransform):
    """A minimal user transform: multiplies the selected gradients by `factor`."""

    def __init__(self, factor, where=None):
        super().__init__(where=where)
        self.factor = factor

    def transform(self, grads, variables, state):
        return [g * self.factor if on and g is not None else g
                for g, on in zip(grads, state.selected)]

    def get_config(self):
        return {"factor": self.factor, **super().get_config()}


@keras.saving.register_keras_serializable(package=PACKAGE)
class ForgetfulTerm(ScaledOutputMean):
    """Broken on purpose: `get_config` leaves `scale` out."""

    def get_config(self):
        return kt.Term.get_config(self)


@keras.saving.register_keras_serializable(package=PACKAGE)
class ForgetfulTransform(ScaleGradients):
    """Broken on purpose: `get_config` leaves `where` out."""

    def get_config(self):
        return {"factor": self.factor}


def keras_roundtrip(obj):
    config = keras.saving.serialize_keras_object(obj)
    assert config["registered_name"] == f"{PACKAGE}>{type(obj).__name__}"
    again = keras.saving.deserialize_keras_object(config)
    assert type(again) is type(obj)
    assert again.get_config() == obj.get_config()
    return again


def test_user_term_subclass_round_trips_through_keras_serialization():
    term = ScaledOutputMean(scale=2.5, weight=0.4, name="scaled", in_validation=True)
    again = keras_roundtrip(term)
    expected = 0.4 * 2.5 * np.mean(numpy_forward(data()[0])[1])
    np.testing.assert_allclose(term_value(again), expected, rtol=1e-5)


def test_user_transform_subclass_round_trips_through_keras_serialization():
    model, variables, grads = grads_and_variables()
    again = keras_roundtrip(ScaleGradients(0.5, where="out*"))
    got = apply(again, model, variables, grads)
    for g, out, selected in zip(grads, got, [False, False, True, True]):
        np.testing.assert_allclose(out, 0.5 * g if selected else g, rtol=1e-6)


def test_base_classes_are_abstract():
    with pytest.raises(NotImplementedError, match="Term must implement call"):
        kt.Term(name="t").call(None)
    with pytest.raises(NotImplementedError, match=r"GradientTransform must implement transform"):
        kt.GradientTransform().transform([], [], None)


def test_behaviour_checks_catch_a_config_that_forgets_an_argument():
    """Companion: the config comparison passes, the value comparison does not."""
    term = ForgetfulTerm(scale=2.5, name="forgetful")
    again = keras_roundtrip(term)  # configs are equal: scale is in neither
    expected = 2.5 * np.mean(numpy_forward(data()[0])[1])
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(term_value(again), expected, rtol=1e-5)

    model, variables, grads = grads_and_variables()
    again = keras_roundtrip(ForgetfulTransform(0.5, where="out*"))
    got = apply(again, model, variables, grads)
    with pytest.raises(AssertionError):  # where= was lost: every gradient scaled
        np.testing.assert_allclose(got[0], grads[0], rtol=1e-6)
