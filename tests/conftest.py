"""Test setup: two logical CPU devices (for MirroredStrategy) and quiet logs."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
# XLA (jit_compile=True here, every step on JAX) compiles at LLVM
# optimization level 0 in the test processes and the ones they start: for
# the tiny models here compilation, not execution, is the cost (about a third
# of the JAX cases' CPU time and of the fault matrix's jit column). Every
# comparison is within a run, and the suite passes at either level.
XLA_TEST_FLAGS = "--xla_backend_optimization_level=0"
if XLA_TEST_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {XLA_TEST_FLAGS}".strip()

# Under pytest-xdist (make test: three workers on two cores) each worker, and
# every process it starts (the JAX cases, multi-worker jobs, fresh-process
# reloads), runs one intra-op and one inter-op TensorFlow thread instead of
# one per core each: the other workers keep the cores busy, and the threads
# only contend (six fit-test files with three workers: 154 s wall and 273 s
# user CPU with TensorFlow's defaults, 144 s and 254 s with one thread each;
# the multi-worker file alone 129 s and 120 s). Results do not depend on it:
# every test compares runs made in its own process.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("TF_NUM_INTRAOP_THREADS", "1")
    os.environ.setdefault("TF_NUM_INTEROP_THREADS", "1")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

_cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(
    _cpus[0],
    [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()],
)


# Garbage collection: `keras.backend.clear_session()` runs a full
# `gc.collect()`, which walks every object the process holds (TensorFlow's and
# Keras's modules: about 450k objects, 0.3-0.6 s a test, as long as a small
# fit). The objects alive now are never garbage, so they are frozen out of the
# collector (`gc.freeze`); each test's teardown collects what was created
# since, then freezes the survivors too, and every 50 tests one full
# collection (unfrozen) frees cycles among survivors.
import gc  # noqa: E402
import inspect  # noqa: E402

# `free_memory` (Keras >= 3.8 or so; `make test-oldest` may lack it): the
# collection below replaces the one clear_session would run.
_CLEAR = (
    {"free_memory": False}
    if "free_memory" in inspect.signature(keras.backend.clear_session).parameters
    else {}
)
gc.collect()
gc.freeze()
_FULL_COLLECTION_EVERY = 50
_tests_since_full_collection = 0


@pytest.fixture(autouse=True)
def _clean_keras_state():
    global _tests_since_full_collection
    keras.config.set_dtype_policy("float32")
    keras.utils.set_random_seed(1234)
    yield
    keras.config.set_dtype_policy("float32")
    keras.backend.clear_session(**_CLEAR)
    _tests_since_full_collection += 1
    if _tests_since_full_collection >= _FULL_COLLECTION_EVERY:
        _tests_since_full_collection = 0
        gc.unfreeze()
    gc.collect()
    gc.freeze()


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


# ------------------------------------------------------------------ tiers
# tests/tiers.json lists the measured tiers (see CONTRIBUTING.md): `unit`
# (the fast tier: no fit/evaluate/predict, seconds each), `smoke` (a few quick
# fits that `make test-fast` adds), `slow` (examples, docs site, packaging,
# multi-process, keras-hub, over 30 s). A test marked `unit` in its file or
# in the list may not train: `_unit_tests_do_not_train` fails it if it does.
import functools  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

_TIERS = json.loads((Path(__file__).parent / "tiers.json").read_text())
_UNIT = set(_TIERS["unit"])
_SMOKE = set(_TIERS["smoke"])
_SLOW = set(_TIERS["slow"])
_SLOW_FILES = set(_TIERS["slow_files"])


def pytest_configure(config):
    config.addinivalue_line("markers", "smoke: a quick fit that `make test-fast` runs")


def pytest_collection_modifyitems(config, items):
    for item in items:
        node = item.nodeid
        if node in _UNIT:
            item.add_marker(pytest.mark.unit)
        if node in _SMOKE:
            item.add_marker(pytest.mark.smoke)
        if node in _SLOW or node.split("::")[0] in _SLOW_FILES:
            item.add_marker(pytest.mark.slow)


_TRAINING_METHODS = (
    "fit", "evaluate", "predict", "train_on_batch", "test_on_batch", "predict_on_batch",
)


@pytest.fixture(autouse=True)
def _unit_tests_do_not_train(request, monkeypatch):
    """A `unit` test that calls fit/evaluate/predict fails: it belongs in the fit tier."""
    if request.node.get_closest_marker("unit") is None:
        yield
        return

    def refuse(name):
        @functools.wraps(getattr(keras.Model, name))  # keeps the signature code inspects
        def refused(self, *args, **kwargs):
            raise AssertionError(
                f"{request.node.nodeid} is in the unit tier but calls Model.{name}(); "
                "remove it from tests/tiers.json (unit) or its @pytest.mark.unit."
            )
        return refused

    for name in _TRAINING_METHODS:
        monkeypatch.setattr(keras.Model, name, refuse(name))
    yield
