"""The public DP-SGD extension point: a clipping rule for a layer of your own.

Oracle: the same model clipped by the vectorized fallback (one gradient per
example, `method="vectorized"`); with a registered rule, `method="auto"`
must give the same weights (the clipped sum and the noise are the same).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt
from keras_tapeops.privacy import rules


@keras.saving.register_keras_serializable(package="test_privacy_rules")
class Scale(keras.layers.Layer):
    """y = x * w (one weight per feature)."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="w")

    def call(self, x):
        return x * self.w


class ScaleRule(kt.privacy.ClippingRule):
    family = "Scale"

    @staticmethod
    def applies(layer):
        return isinstance(layer, Scale)

    @staticmethod
    def clip(site, records, grads, context):
        w = site.layer.w
        rows = tf.add_n([tf.cast(r["a"], "float32") * tf.cast(g[0], "float32")
                         for r, g in zip(records, grads)])
        return {id(w): kt.privacy.per_example_part(rows, context.scale, w.shape)}


class WrongScaleRule(ScaleRule):
    """Twice the true per-example gradient: what the oracle must catch."""

    @staticmethod
    def clip(site, records, grads, context):
        w = site.layer.w
        rows = tf.add_n([2.0 * r["a"] * g[0] for r, g in zip(records, grads)])
        return {id(w): kt.privacy.per_example_part(rows, context.scale, w.shape)}


@pytest.fixture
def registry(monkeypatch):
    monkeypatch.setattr(rules, "_REGISTERED_RULES", [])
    return rules._REGISTERED_RULES


def train(method, noise=0.5):
    keras.utils.set_random_seed(0)
    model = kt.upgrade(keras.Sequential([keras.Input((4,)), Scale(name="scale"),
                                         keras.layers.Dense(3, name="head")]))
    model.compile(optimizer=keras.optimizers.SGD(0.5),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  differential_privacy=kt.DPSGD(0.1, noise, seed=3, method=method))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype("float32") * 3
    y = rng.integers(0, 3, 32)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return model


def report(model):
    return {(path, name): method for path, name, method in model.tapeops_state.engine.report()}


def test_registered_rule_clips_its_layer_as_the_per_example_oracle(registry):
    assert kt.privacy.register_clipping_rule(ScaleRule) is ScaleRule
    auto = train("auto")
    oracle = train("vectorized")
    assert report(auto)[("scale", "w")] == "Scale: per-example"
    for a, b in zip(auto.get_weights(), oracle.get_weights()):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_without_the_rule_the_layer_falls_back(registry):
    assert "Scale" not in report(train("auto"))[("scale", "w")]


def test_a_wrong_rule_is_caught_by_the_oracle(registry):
    kt.privacy.register_clipping_rule(WrongScaleRule)
    wrong = train("auto", noise=0.0)
    oracle = train("vectorized", noise=0.0)
    difference = max(float(np.max(np.abs(a - b)))
                     for a, b in zip(wrong.get_weights(), oracle.get_weights()))
    assert difference > 1e-4


@pytest.mark.unit
def test_later_registrations_are_tried_first_and_bad_rules_are_refused(registry):
    kt.privacy.register_clipping_rule(ScaleRule)
    kt.privacy.register_clipping_rule(WrongScaleRule)
    kt.privacy.register_clipping_rule(ScaleRule)  # already there: not added twice
    assert rules.registered_rules() == (WrongScaleRule, ScaleRule)
    with pytest.raises(TypeError, match=r"register_clipping_rule\(\) takes a "
                       r"kt.privacy.ClippingRule subclass .*missing: \['clip'\]. "
                       r"Received: rule="):
        kt.privacy.register_clipping_rule(type("NoClip", (), {
            "family": "x", "applies": staticmethod(bool), "forward": staticmethod(bool)}))
    with pytest.raises(NotImplementedError, match="applies"):
        kt.privacy.ClippingRule.applies(None)
