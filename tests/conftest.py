"""Test setup: two logical CPU devices (for MirroredStrategy) and quiet logs."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

_cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(
    _cpus[0],
    [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()],
)


@pytest.fixture(autouse=True)
def _clean_keras_state():
    keras.config.set_dtype_policy("float32")
    keras.utils.set_random_seed(1234)
    yield
    keras.config.set_dtype_policy("float32")
    keras.backend.clear_session()


@pytest.fixture(scope="session")
def mirrored():
    """One MirroredStrategy over the two logical CPU devices, per process.

    Every MirroredStrategy numbers its collective all-reduce instances from
    the same start, and TensorFlow 2.21's process-wide collective executor
    remembers instance keys: a second strategy in the same process re-uses
    instance 100 with another shape and aborts ("Shape mismatch in the
    collective instance 100"), with stock Keras as well as with ours. A user
    process has one strategy; the tests share one too.
    """
    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


@pytest.fixture
def rng():
    return np.random.default_rng(0)
