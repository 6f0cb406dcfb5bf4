"""Importing on a Keras backend other than TensorFlow or JAX fails with one clear sentence.

The JAX backend itself is tested in its own processes: tests/test_jax_backend.py.
"""

import importlib

import keras
import pytest

from keras_tapeops import backend_check

pytestmark = pytest.mark.unit


def test_other_backend_is_refused_with_one_sentence(monkeypatch):
    monkeypatch.setattr(keras.backend, "backend", lambda: "torch")
    with pytest.raises(ImportError) as info:
        backend_check.require_supported_backend()
    message = str(info.value)
    assert "keras_tapeops needs the TensorFlow or the JAX backend" in message
    assert "current backend is 'torch'" in message
    assert message.count(". ") == 0  # one sentence


def test_package_import_runs_the_check(monkeypatch):
    import keras_tapeops

    monkeypatch.setattr(keras.backend, "backend", lambda: "torch")
    with pytest.raises(ImportError, match="current backend is 'torch'"):
        importlib.reload(keras_tapeops)


@pytest.mark.parametrize("name", ["tensorflow", "jax"])
def test_tensorflow_and_jax_are_accepted(monkeypatch, name):
    monkeypatch.setattr(keras.backend, "backend", lambda: name)
    assert backend_check.require_supported_backend() == name
