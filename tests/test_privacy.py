"""kt.DPSGD's configuration, refusals (before any weight changes) and report."""

import math

import keras
import numpy as np
import pytest

import keras_tapeops as kt
from keras_tapeops.multi_gradient import MultiGradientOption
from keras_tapeops.multi_gradient import MultiGradientState
from keras_tapeops.registration import register


def _model(*layers):
    layers = layers or (keras.layers.Dense(3, activation="relu"), keras.layers.Dense(2))
    return kt.upgrade(keras.Sequential([keras.Input((4,)), *layers]))


def _data(n=8):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 4)).astype("float32"), rng.integers(0, 2, size=(n,))


def _compile(model, **options):
    model.compile(
        optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        **options,
    )


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(l2_norm_clip=0, noise_multiplier=1.0), "Received: l2_norm_clip=0"),
        (dict(l2_norm_clip=-1.0, noise_multiplier=1.0), "Received: l2_norm_clip=-1.0"),
        (dict(l2_norm_clip=1.0, noise_multiplier=-0.5), "Received: noise_multiplier=-0.5"),
        (dict(l2_norm_clip=1.0, noise_multiplier=math.nan), "Received: noise_multiplier=nan"),
        (dict(l2_norm_clip=1.0, noise_multiplier=math.inf), "Received: noise_multiplier=inf"),
        (dict(l2_norm_clip=1.0, noise_multiplier=1.0, seed=-3), "Received: seed=-3"),
        (dict(l2_norm_clip=1.0, noise_multiplier=1.0, method="fast"), "Received: method='fast'"),
    ],
)
def test_bad_values_raise_with_received(kwargs, message):
    with pytest.raises(ValueError, match=message):
        kt.DPSGD(**kwargs)


def test_config_round_trip_and_repr():
    option = kt.DPSGD(l2_norm_clip=0.5, noise_multiplier=1.1, seed=3, method="vectorized")
    config = option.get_config()
    assert config == {"l2_norm_clip": 0.5, "noise_multiplier": 1.1, "seed": 3, "method": "vectorized"}
    again = kt.DPSGD.from_config(config)
    assert again.get_config() == config
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(option))
    assert isinstance(restored, kt.DPSGD) and restored.get_config() == config
    assert repr(option) == "DPSGD(l2_norm_clip=0.5, noise_multiplier=1.1, seed=3, method='vectorized')"


def test_one_option_serves_two_models():
    option = kt.DPSGD(1.0, 0.0, seed=0)
    x, y = _data()
    a, b = _model(), _model()
    _compile(a, differential_privacy=option)
    _compile(b, differential_privacy=option)
    a.fit(x, y, batch_size=4, verbose=0)
    b.fit(x, y, batch_size=4, verbose=0)
    assert a.tapeops_state.engine is not b.tapeops_state.engine


def test_batch_normalization_is_refused_at_compile_naming_it():
    model = _model(keras.layers.Dense(3), keras.layers.BatchNormalization(name="bn"), keras.layers.Dense(2))
    before = model.get_weights()
    with pytest.raises(ValueError, match=r"\['bn'\].*GroupNormalization or LayerNormalization"):
        _compile(model, differential_privacy=kt.DPSGD(1.0, 1.0))
    assert model.tapeops_options is None
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_frozen_batch_normalization_runs_in_inference_mode_and_is_accepted():
    bn = keras.layers.BatchNormalization()
    model = _model(keras.layers.Dense(3), bn, keras.layers.Dense(2))
    bn.trainable = False
    _compile(model, differential_privacy=kt.DPSGD(1.0, 0.0))
    x, y = _data()
    model.fit(x, y, batch_size=4, verbose=0)


def test_sam_is_refused_with_a_reason():
    with pytest.raises(ValueError, match="`differential_privacy` cannot be combined with `sharpness_aware`: SAM takes"):
        _compile(_model(), differential_privacy=kt.DPSGD(1.0, 1.0), sharpness_aware=kt.SAM(0.05))


@register
class _Tolerant(MultiGradientOption):
    """Accepts every combination, so DPSGD's own reason is the one raised."""

    option_name = "task_balancing"

    def bind(self, model, tree):
        return MultiGradientState()

    def combines_with(self, name, value):
        return None


@register
class _TolerantSelection(_Tolerant):
    option_name = "sample_selection"


@pytest.mark.parametrize(
    "name,option,reason",
    [("task_balancing", _Tolerant(), "task balancing reweights"),
     ("sample_selection", _TolerantSelection(), "selecting the largest losses")],
)
def test_multi_gradient_options_are_refused_with_a_reason(name, option, reason):
    with pytest.raises(ValueError, match=f"cannot be combined with `{name}`: {reason}"):
        _compile(_model(), differential_privacy=kt.DPSGD(1.0, 1.0), **{name: option})


@pytest.mark.parametrize("weights", ["sample_weight", "class_weight"])
def test_weights_are_refused_on_the_first_batch_before_any_change(weights):
    model = _model()
    _compile(model, differential_privacy=kt.DPSGD(1.0, 1.0))
    before = model.get_weights()
    x, y = _data()
    extra = {"sample_weight": np.ones(8, "float32")} if weights == "sample_weight" else {"class_weight": {0: 1.0, 1: 2.0}}
    with pytest.raises(ValueError, match="does not support sample_weight or class_weight.*Received: sample_weight of dtype"):
        model.fit(x, y, batch_size=4, verbose=0, **extra)
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert int(model.optimizer.iterations) == 0


def test_loss_terms_and_added_losses_are_refused():
    model = _model()
    _compile(model, differential_privacy=kt.DPSGD(1.0, 1.0),
             loss_terms=[kt.ActivationPenalty("dense", l2=0.1)])
    x, y = _data()
    with pytest.raises(ValueError, match="cannot be combined with `loss_terms`.*Received: loss_terms"):
        model.fit(x, y, batch_size=4, verbose=0)
    active = _model(keras.layers.Dense(3, activity_regularizer="l2"), keras.layers.Dense(2))
    _compile(active, differential_privacy=kt.DPSGD(1.0, 1.0))
    with pytest.raises(ValueError, match="losses added in the forward pass.*Received: 1 added"):
        active.fit(x, y, batch_size=4, verbose=0)


def test_weight_regularizers_are_added_after_the_noise():
    """Noise 0, a clip that never binds: DP-SGD equals stock SGD, L2 regularizer included."""
    x, y = _data()
    stock = _model(keras.layers.Dense(2, kernel_regularizer=keras.regularizers.L2(0.3)))
    ours = _model(keras.layers.Dense(2, kernel_regularizer=keras.regularizers.L2(0.3)))
    ours.set_weights(stock.get_weights())
    _compile(stock)
    _compile(ours, differential_privacy=kt.DPSGD(1e6, 0.0))
    h1 = stock.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    h2 = ours.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    for a, b in zip(stock.get_weights(), ours.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(h1.history["loss"], h2.history["loss"], rtol=1e-6)


def test_report_lists_the_method_of_every_variable():
    model = _model(keras.layers.Dense(3, name="d"), keras.layers.Reshape((3, 1)),
                   keras.layers.PReLU(name="prelu"), keras.layers.Flatten(),  # no rule
                   keras.layers.Dense(2, name="head"))
    _compile(model, differential_privacy=kt.DPSGD(1.0, 0.0))
    engine = model.tapeops_state.engine
    assert ("d", "kernel", "Dense: (chosen at the first step)") in engine.report()
    x, y = _data()
    model.fit(x, y, batch_size=4, verbose=0)
    report = {(path, name): method for path, name, method in engine.report()}
    assert report[("d", "kernel")] == "Dense: ghost"
    assert report[("prelu", "alpha")] == "any layer: vectorized"
    assert len(report) == len(model.trainable_weights)
