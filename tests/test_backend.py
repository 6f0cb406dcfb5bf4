"""Importing or compiling on a non-TensorFlow Keras backend fails with one clear sentence."""

import importlib

import keras
import pytest

from keras_tapeops import backend_check


def test_other_backend_is_refused_with_one_sentence(monkeypatch):
    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
    with pytest.raises(ImportError) as info:
        backend_check.require_tensorflow_backend()
    message = str(info.value)
    assert "keras_tapeops needs the TensorFlow backend" in message
    assert "current backend is 'jax'" in message
    assert message.count(". ") == 0  # one sentence


def test_package_import_runs_the_check(monkeypatch):
    import keras_tapeops

    monkeypatch.setattr(keras.backend, "backend", lambda: "torch")
    with pytest.raises(ImportError, match="current backend is 'torch'"):
        importlib.reload(keras_tapeops)


def test_tensorflow_backend_is_accepted():
    assert backend_check.require_tensorflow_backend() is None
