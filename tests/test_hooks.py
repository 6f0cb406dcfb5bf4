"""Overriding one hook of the step (docs/concepts.md's example) works without compiled options."""

import keras
import numpy as np

import keras_tapeops as kt
from parity_utils import assert_weights_close
from parity_utils import classification_data
from parity_utils import max_weight_difference

LR = 0.1
CE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class Plain(kt.TapeOpsMixin, keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(16, activation="relu", name="hidden")
        self.head = keras.layers.Dense(3, name="head")

    def call(self, x):
        return self.head(self.hidden(x))


class HalvedGradients(Plain):
    """The docs/concepts.md example: halves every gradient after the compiled transforms."""

    def transform_gradients(self, grads, variables):
        grads = super().transform_gradients(grads, variables)
        return [None if g is None else g * 0.5 for g in grads]


class SummedTwice(HalvedGradients):
    """Overrides aggregate_gradients too (the transform stays the halving one)."""

    def aggregate_gradients(self, grads):
        grads, reduced = super().aggregate_gradients(grads)
        return [None if g is None else g * 2.0 for g in grads], reduced


def fit(cls, weights, lr, strategy=None, **compile_kwargs):
    x, y = classification_data()
    scope = strategy.scope() if strategy is not None else _null()
    with scope:
        model = cls()
        model(x[:1])
        model.set_weights(weights)
        model.compile(optimizer=keras.optimizers.SGD(lr), loss=CE, **compile_kwargs)
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return model


def initial_weights():
    keras.utils.set_random_seed(3)
    model = Plain()
    model(np.zeros((1, 8), "float32"))
    return model.get_weights()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_transform_override_runs_without_compiled_transforms():
    """SGD on halved gradients equals SGD with half the learning rate."""
    weights = initial_weights()
    ours = fit(HalvedGradients, weights, LR)
    oracle = fit(Plain, weights, LR / 2)
    assert_weights_close(ours, oracle, atol=1e-6)


def test_transform_override_check_can_fail():
    weights = initial_weights()
    ours = fit(HalvedGradients, weights, LR)
    full_step = fit(Plain, weights, LR)
    assert max_weight_difference(ours, full_step) > 1e-3


def test_transform_override_follows_compiled_transforms():
    """The override runs after the compiled transforms (super() first)."""
    weights = initial_weights()
    ours = fit(HalvedGradients, weights, LR, gradient_transforms=[kt.ClipByValue(0.01)])
    oracle = fit(Plain, weights, LR / 2, gradient_transforms=[kt.ClipByValue(0.01)])
    assert_weights_close(ours, oracle, atol=1e-6)


def test_aggregate_override_runs_too():
    weights = initial_weights()
    ours = fit(SummedTwice, weights, LR)
    oracle = fit(Plain, weights, LR)  # x2 then x0.5
    assert_weights_close(ours, oracle, atol=1e-6)


def test_transform_override_sees_summed_gradients_under_mirrored(mirrored):
    weights = initial_weights()
    ours = fit(HalvedGradients, weights, LR, strategy=mirrored)
    oracle = fit(Plain, weights, LR / 2)
    assert_weights_close(ours, oracle, atol=1e-5)
