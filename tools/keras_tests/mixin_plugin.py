"""pytest plugin: run Keras's own test files with `TapeOpsMixin` in every model.

Loaded with `-p mixin_plugin` (this directory on `PYTHONPATH`; see
`run.py`). Options:

- `--keras-tapeops=mixin` inserts `kt.TapeOpsMixin` into `keras.Model`'s bases,
  right before Keras's `TensorFlowTrainer`, so every `keras.Model`,
  `keras.Sequential`, functional model and subclass a test builds gets the
  mixin's `compile`, `train_step`, `test_step`, ... (the same MRO as
  `class Net(kt.TapeOpsMixin, keras.Model)`). `--keras-tapeops=stock` changes
  nothing (the baseline run).
- `--keras-tapeops-report=PATH` writes a JSON file: every test's outcome, and
  how many times the mixin's `train_step`/`test_step` ran in it, so that the
  runner can show the mixin really trained the models.

It also does what Keras's repository `conftest.py` does for these files: it
declares the `requires_trainable_backend` and `multi_device` markers and skips
`multi_device` tests (one CPU device here).

Example:
```bash
PYTHONPATH=tools/keras_tests python -m pytest -p mixin_plugin \
    --keras-tapeops=mixin --keras-tapeops-report=mixin.json \
    .venv/lib/python3.11/site-packages/keras/src/models/sequential_test.py
```
"""

import collections
import importlib.util
import json
import os
import sys
import types

import pytest

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

#: Calls of the mixin's steps during the current test (reset per test).
STEP_CALLS = collections.Counter()


def pytest_addoption(parser):
    group = parser.getgroup("keras_tapeops")
    group.addoption(
        "--keras-tapeops", choices=("stock", "mixin"), default="stock",
        help="'mixin': insert kt.TapeOpsMixin into keras.Model's bases.",
    )
    group.addoption(
        "--keras-tapeops-report", default=None,
        help="Write every test's outcome and mixin step count to this JSON file.",
    )


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "requires_trainable_backend: needs a backend that trains"
    )
    config.addinivalue_line("markers", "multi_device: needs several devices")
    if config.getoption("--keras-tapeops") == "mixin":
        insert_mixin()
    config._tapeops_results = {}


def insert_mixin():
    """Puts `TapeOpsMixin` before `TensorFlowTrainer` in `keras.Model.__bases__`.

    keras_tapeops's own classes list the mixin themselves
    (`class TapeOpsSequential(TapeOpsMixin, keras.Sequential)`); with the
    mixin also in `keras.Model`'s bases their MRO would be inconsistent, so
    the mixin is first removed from their bases (they get it through
    `keras.Model`). Also counts the mixin's step calls.

    Returns:
        None. Raises AssertionError if the MRO does not come out as intended.
    """
    import keras
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    from keras_tapeops.mixin import TapeOpsMixin

    for cls in _subclasses(TapeOpsMixin):
        if TapeOpsMixin in cls.__bases__ and issubclass(cls, keras.Model):
            cls.__bases__ = tuple(b for b in cls.__bases__ if b is not TapeOpsMixin)
    bases = list(keras.Model.__bases__)
    if TapeOpsMixin not in bases:
        bases.insert(bases.index(TensorFlowTrainer), TapeOpsMixin)
        keras.Model.__bases__ = tuple(bases)
    mro = keras.Sequential.__mro__
    assert mro.index(TapeOpsMixin) < mro.index(TensorFlowTrainer), mro
    for name in ("train_step", "test_step"):
        _count_calls(TapeOpsMixin, name)


def _subclasses(cls):
    found = []
    for sub in cls.__subclasses__():
        found.append(sub)
        found.extend(_subclasses(sub))
    return found


def _count_calls(cls, name):
    original = getattr(cls, name)

    def counted(self, data):
        STEP_CALLS[name] += 1
        return original(self, data)

    counted.__name__ = name
    counted.__doc__ = original.__doc__
    counted.__wrapped__ = original
    setattr(cls, name, counted)


#: Test files that import jax at the top (they use it only in jax cases).
IMPORTS_JAX = ("trainer_test.py",)
HAS_JAX = importlib.util.find_spec("jax") is not None


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """Lets a file that imports jax be collected when jax is not installed.

    `trainers/trainer_test.py` does `import jax` at the top but uses it only
    in jax-backend tests and in data-generator cases named `jax` (skipped
    in `pytest_collection_modifyitems`). While that file is imported an empty `jax` module stands in;
    it is removed right after, so nothing else sees it.
    """
    stub = (
        not HAS_JAX
        and isinstance(collector, pytest.Module)
        and collector.path.name in IMPORTS_JAX
    )
    if stub:
        sys.modules["jax"] = types.ModuleType("jax")
    try:
        yield
    finally:
        if stub:
            sys.modules.pop("jax", None)


#: Optional packages some tests use, by the word in their test id: a test
#: whose id names a package that is not installed is skipped (it would fail
#: alike with and without the mixin).
OPTIONAL_PACKAGES = ("jax", "orbax", "grain", "torch", "scipy")


def _installed(name):
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def pytest_collection_modifyitems(config, items):
    several_devices = pytest.mark.skip(reason="Requires multiple devices")
    missing = [name for name in OPTIONAL_PACKAGES if not _installed(name)]
    for item in items:
        if "multi_device" in item.keywords:
            item.add_marker(several_devices)
        for name in missing:
            if name in item.nodeid.lower():
                item.add_marker(pytest.mark.skip(reason=f"Needs {name} (not installed)"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when == "setup":
        STEP_CALLS.clear()
    report.user_properties.append(("tapeops_steps", dict(STEP_CALLS)))


def pytest_runtest_logreport(report):
    """Collects outcomes (on the xdist controller, or the only process)."""
    config = _CONFIG.get("config")
    if config is None or hasattr(config, "workerinput"):
        return
    results = config._tapeops_results
    entry = results.setdefault(report.nodeid, {"outcome": "passed", "steps": {}})
    if report.failed:
        entry["outcome"] = "failed" if report.when == "call" else "error"
    elif report.skipped and report.when in ("setup", "call"):
        entry["outcome"] = "skipped"
    for key, value in report.user_properties:
        if key == "tapeops_steps":
            for name, count in value.items():
                entry["steps"][name] = max(entry["steps"].get(name, 0), count)


_CONFIG = {}


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    _CONFIG["config"] = session.config


def pytest_sessionfinish(session):
    config = session.config
    path = config.getoption("--keras-tapeops-report")
    if path is None or hasattr(config, "workerinput"):
        return
    with open(path, "w") as f:
        json.dump(
            {"mode": config.getoption("--keras-tapeops"),
             "results": config._tapeops_results},
            f, indent=1, sort_keys=True,
        )
