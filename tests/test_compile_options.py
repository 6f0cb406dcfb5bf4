"""compile() validates keras_tapeops options before changing anything."""

import keras
import numpy as np
import pytest

import keras_tapeops as kt
from parity_utils import classification_data
from parity_utils import sequential_model


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"micro_batches": 0}, ValueError, r"micro_batches.*Received: micro_batches=0"),
        ({"micro_batches": -2}, ValueError, r"Received: micro_batches=-2"),
        ({"micro_batches": 2.5}, TypeError, r"Received: micro_batches=2.5"),
        ({"micro_batches": True}, TypeError, r"Received: micro_batches=True"),
        ({"accumulation_steps": 0}, ValueError, r"Received: accumulation_steps=0"),
        ({"accumulation_steps": "4"}, TypeError, r"Received: accumulation_steps='4'"),
        ({"gradient_transforms": "clip"}, TypeError, r"Received: gradient_transforms='clip'"),
        ({"gradient_transforms": [1.0]}, TypeError, r"Received: gradient_transforms\[0\]=1.0"),
        ({"loss_terms": [lambda m: 0.0]}, TypeError, r"Received: loss_terms\[0\]="),
    ],
)
def test_bad_options_raise_clear_errors(kwargs, error, message):
    model = kt.upgrade(sequential_model())
    with pytest.raises(error, match=message):
        model.compile(optimizer="sgd", loss="mse", **kwargs)


def test_unknown_option_is_rejected_by_compile():
    model = kt.upgrade(sequential_model())
    with pytest.raises(TypeError, match="clip_everything"):
        model.compile(optimizer="sgd", loss="mse", clip_everything=True)


def test_failed_compile_leaves_model_and_weights_untouched():
    x, y = classification_data()
    model = kt.upgrade(sequential_model())
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    before = [w.copy() for w in model.get_weights()]
    optimizer = model.optimizer
    with pytest.raises(ValueError):
        model.compile(optimizer="adam", loss="mse", micro_batches=0)
    assert model.optimizer is optimizer
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)
    model.fit(x, y, verbose=0, epochs=1)  # the earlier compile still works


def test_options_are_visible_after_compile():
    model = kt.upgrade(sequential_model())
    model.compile(optimizer="sgd", loss="mse", micro_batches=3, accumulation_steps=2)
    assert model.tapeops_options.micro_batches == 3
    assert model.tapeops_options.accumulation_steps == 2
    assert model.get_compile_config()["micro_batches"] == 3
