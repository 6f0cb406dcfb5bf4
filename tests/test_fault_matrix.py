"""The fault matrix (issue 28): every option and model class through every fault.

Rows: `fault_matrix_cases.CASES` (the compile options of rounds 1-3, each
task-balancing method, DP-SGD, each sample selection, adversarial and
gradient-penalty terms, MetaLearner and Meta-SGD, WGAN-GP). Columns, and
what each cell must show (its reference and tolerance):

- `save_load`: 1 epoch, `.keras` save, load, 1 more epoch equals 2 epochs
  uninterrupted (1e-6).
- `mirrored`: MirroredStrategy over two logical CPUs equals one device (1e-5).
- `jit`: `jit_compile=True` equals graph mode (1e-5).
- `steps_per_execution`: 2 equals 1 (1e-6).
- `mixed_overflow`: under `mixed_float16` with Keras's default loss scaling,
  a step whose scaled gradients overflow changes no weight (bit-identical),
  leaves every weight finite and halves the loss scale, as stock Keras does.
- `empty_batch`: an epoch with an empty batch in the middle equals the epoch
  without it (1e-6; plain SGD, so a zero gradient is no update).
- `batch_of_one`: an epoch ending in a batch of one example trains and stays
  finite.
- `nan_example`: one NaN input makes the weights non-finite, as with stock
  Keras, except where the option promises otherwise (DP-SGD zeroes the
  example, SkipNonFinite skips the step): those stay finite.
- `zero_weight`: examples with sample weight 0 have no influence: replacing
  their inputs and labels changes nothing (1e-6).

`fault_matrix_cases.EXPECTED` lists the cells with another outcome and why
(docs/faults.md shows the table). Crash-and-resume from `BackupAndRestore`
in a new process is `test_crash_and_resume_in_a_new_process`, for every row
at once. A refused cell would have to raise before any weight changes.
"""

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from fault_matrix_cases import CASES
from fault_matrix_cases import CONDITIONS
from fault_matrix_cases import expected

BY_NAME = {case.name: case for case in CASES}
N = 16
SIZES = [8, 8]

pytestmark = pytest.mark.slow


# ------------------------------------------------------------------ helpers
def _slices(structure, start, stop):
    return tf.nest.map_structure(lambda a: a[start:stop], structure)


def make_dataset(x, y, sizes, sample_weight=None):
    """Consecutive batches of the given sizes (0 allowed), in order."""
    parts, start = [], 0
    for size in sizes:
        item = [_slices(x, start, start + size)]
        if y is not None:
            item.append(_slices(y, start, start + size))
        if sample_weight is not None:
            item.append(_slices(sample_weight, start, start + size))
        parts.append(tf.data.Dataset.from_tensors(tuple(item) if len(item) > 1 else item[0]))
        start += size
    dataset = parts[0]
    for part in parts[1:]:
        dataset = dataset.concatenate(part)
    return dataset


def train(model, case, sizes=SIZES, epochs=1, x=None, y=None, sample_weight=None, **kwargs):
    if x is None:
        x, y = case.data(sum(sizes))
    return model.fit(make_dataset(x, y, sizes, sample_weight), epochs=epochs,
                     shuffle=False, verbose=0, **kwargs)


def weights(model):
    return [np.array(w) for w in model.get_weights()]


def assert_equal_weights(actual, reference, atol, cell):
    assert len(actual) == len(reference), cell
    for i, (a, b) in enumerate(zip(actual, reference)):
        np.testing.assert_allclose(a, b, rtol=0, atol=atol, err_msg=f"{cell}: weight {i}")


def all_finite(values):
    return all(np.all(np.isfinite(v)) for v in values)


class WeightsAtEpochEnd(keras.callbacks.Callback):
    """Keeps the weights at the end of each epoch (`by_epoch[1]` after the first)."""

    def __init__(self):
        super().__init__()
        self.by_epoch = {}

    def on_epoch_end(self, epoch, logs=None):
        self.by_epoch[epoch + 1] = weights(self.model)


@functools.lru_cache(maxsize=None)
def _references(name):
    # One uninterrupted 2-epoch run gives both references: for every row the
    # weights after its first epoch equal a 1-epoch run's (measured exact),
    # and an option acting at the end of `fit` would fail the empty-batch
    # cell here, not pass it.
    case = BY_NAME[name]
    kept = WeightsAtEpochEnd()
    train(case.build(), case, epochs=2, callbacks=[kept])
    return kept.by_epoch


def reference(name, epochs):
    """The weights after `epochs` (1 or 2) uninterrupted epochs of the row's model."""
    return _references(name)[epochs]


def build(case, **compile_extra):
    return case.build(**compile_extra)


def cells():
    for case in CASES:
        for condition in CONDITIONS:
            outcome = expected(case, condition, "default")
            marks = []
            if outcome == "n/a":
                marks = [pytest.mark.skip(reason="does not apply")]
            elif outcome.startswith("xfail:"):
                marks = [pytest.mark.xfail(strict=True, reason=outcome[6:].strip())]
            yield pytest.param(case.name, condition, id=f"{case.name}-{condition}", marks=marks)


# ------------------------------------------------------------------ cells
@pytest.mark.parametrize("name, condition", list(cells()))
def test_cell(name, condition, tmp_path, mirrored):
    case = BY_NAME[name]
    cell = f"{name} x {condition}"
    outcome = expected(case, condition, "default")
    if outcome.startswith("refused:"):
        with pytest.raises(Exception, match=outcome[len("refused:"):].strip()):
            CHECKS[condition](case, outcome, cell, tmp_path=tmp_path, mirrored=mirrored)
        return
    CHECKS[condition](case, outcome, cell, tmp_path=tmp_path, mirrored=mirrored)


def check_save_load(case, outcome, cell, tmp_path, **_):
    model = case.build()
    train(model, case)
    model.save(tmp_path / "model.keras")
    reloaded = keras.models.load_model(tmp_path / "model.keras")
    train(reloaded, case)
    assert_equal_weights(weights(reloaded), reference(case.name, 2), 1e-6, cell)


def check_mirrored(case, outcome, cell, mirrored, **_):
    with mirrored.scope():
        model = case.build()
    train(model, case, epochs=2)
    if outcome == "runs":
        assert all_finite(weights(model)), cell
        return
    assert_equal_weights(weights(model), reference(case.name, 2), 1e-5, cell)


def check_jit(case, outcome, cell, **_):
    model = build(case, jit_compile=True)
    train(model, case, epochs=2)
    if outcome == "runs":
        assert all_finite(weights(model)), cell
        return
    assert_equal_weights(weights(model), reference(case.name, 2), 1e-5, cell)


def check_steps_per_execution(case, outcome, cell, **_):
    model = build(case, steps_per_execution=2)
    train(model, case, epochs=2)
    assert_equal_weights(weights(model), reference(case.name, 2), 1e-6, cell)


def check_mixed_overflow(case, outcome, cell, **_):
    keras.config.set_dtype_policy("mixed_float16")
    model = case.build()
    optimizers = [v for v in vars(model).values()
                  if isinstance(v, keras.optimizers.LossScaleOptimizer)]
    assert optimizers, f"{cell}: no LossScaleOptimizer under mixed_float16"
    for optimizer in optimizers:  # every scaled gradient overflows float16
        if optimizer.built:  # e.g. MetaLearner builds its optimizer at compile()
            optimizer.dynamic_scale.assign(1e38)
        else:
            optimizer.initial_scale = 1e38
    x, y = case.data(8)
    before = None

    class Snapshot(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            nonlocal before
            before = weights(self.model)

    train(model, case, sizes=[8], x=x, y=y, callbacks=[Snapshot()])
    after = weights(model)
    assert all_finite(after), cell
    for a, b in zip(after, before):
        np.testing.assert_array_equal(a, b, err_msg=cell)
    for optimizer in optimizers:  # halved once per skipped optimizer step
        assert float(optimizer.dynamic_scale.numpy()) <= 0.5e38 * (1 + 1e-6), cell


def check_empty_batch(case, outcome, cell, **_):
    x, y = case.data(N)
    model = case.build()
    history = train(model, case, sizes=[8, 0, 8], x=x, y=y).history
    assert all(np.isfinite(v).all() for v in history.values()), (cell, history)
    if outcome == "runs":
        assert all_finite(weights(model)), cell
        return
    assert_equal_weights(weights(model), reference(case.name, 1), 1e-6, cell)


def check_batch_of_one(case, outcome, cell, **_):
    model = case.build()
    x, y = case.data(9)
    history = train(model, case, sizes=[8, 1], x=x, y=y).history
    assert all_finite(weights(model)), cell
    assert all(np.isfinite(v).all() for v in history.values()), (cell, history)


def check_nan_example(case, outcome, cell, **_):
    x, y = case.data(N)
    x = x.copy()
    x[3, 0] = np.nan
    model = case.build()
    train(model, case, x=x, y=y)
    finite = all_finite(weights(model))
    if outcome == "finite":
        assert finite, f"{cell}: the option promises finite weights"
    else:
        assert not finite, f"{cell}: stock Keras turns the weights non-finite; this did not"


def check_zero_weight(case, outcome, cell, **_):
    x, y = case.data(N)
    weight = np.ones(N, "float32")
    weight[[1, 5, 12]] = 0.0
    sample_weight = {k: weight for k in y} if isinstance(y, dict) else weight
    other_x, other_y = case.data(N, seed=9)
    x2 = x.copy()
    x2[[1, 5, 12]] = other_x[[1, 5, 12]] * 3.0
    y2 = tf.nest.map_structure(np.copy, y)
    for mine, theirs in zip(tf.nest.flatten(y2), tf.nest.flatten(other_y)):
        mine[[1, 5, 12]] = theirs[[1, 5, 12]]
    results = []
    for inputs, labels in ((x, y), (x2, y2)):
        model = case.build()
        before = weights(model)
        try:
            train(model, case, x=inputs, y=labels, sample_weight=sample_weight)
        except Exception:
            for a, b in zip(weights(model), before):  # refused before any change
                np.testing.assert_array_equal(a, b, err_msg=cell)
            raise
        results.append(weights(model))
    assert all_finite(results[0]), cell
    if outcome == "runs":
        return
    assert_equal_weights(results[1], results[0], 1e-6, cell)


CHECKS = {
    "save_load": check_save_load,
    "mirrored": check_mirrored,
    "jit": check_jit,
    "steps_per_execution": check_steps_per_execution,
    "mixed_overflow": check_mixed_overflow,
    "empty_batch": check_empty_batch,
    "batch_of_one": check_batch_of_one,
    "nan_example": check_nan_example,
    "zero_weight": check_zero_weight,
}


def test_every_condition_has_a_check():
    assert sorted(CHECKS) == sorted(CONDITIONS)


def test_a_cell_can_fail():
    """A wrong reference (one epoch instead of two) is caught."""
    case = BY_NAME["transforms"]
    model = case.build()
    train(model, case, epochs=2)
    with pytest.raises(AssertionError):
        assert_equal_weights(weights(model), reference(case.name, 1), 1e-6, "can fail")


def test_crash_and_resume_in_a_new_process(tmp_path):
    """Every row: a crash mid-epoch here, then a new process resumes from BackupAndRestore."""
    import fault_matrix_script

    fault_matrix_script.main("crash", str(tmp_path))
    script = Path(__file__).parent / "fault_matrix_script.py"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).parent.parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script), "resume", str(tmp_path)],
                          capture_output=True, text=True, timeout=400, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    for case in CASES:
        saved = np.load(tmp_path / f"{case.name}.npz")
        resumed = [saved[f"arr_{i}"] for i in range(len(saved.files))]
        assert_equal_weights(resumed, reference(case.name, 2), 1e-6, f"{case.name} x resume")


def expected_table():
    """The Markdown rows of docs/faults.md's table, from `EXPECTED`."""
    from fault_matrix_cases import EXPECTED

    rows = []
    for name in sorted(EXPECTED):
        for condition in CONDITIONS:
            if condition in EXPECTED[name]:
                outcome, reason = EXPECTED[name][condition]
                rows.append(f"| `{name}` | `{condition}` | {outcome} | {reason} |")
    return rows


@pytest.mark.unit
def test_expected_cells_are_known_and_in_the_docs():
    from fault_matrix_cases import EXPECTED

    outcomes = ("runs", "nan", "finite", "n/a", "refused:", "xfail:")
    for name, cells_ in EXPECTED.items():
        assert name in BY_NAME, name
        for condition, (outcome, reason) in cells_.items():
            assert condition in CONDITIONS, condition
            assert outcome.startswith(outcomes) and reason, (name, condition)
    page = (Path(__file__).parent.parent / "docs" / "faults.md").read_text()
    missing = [row for row in expected_table() if row not in page]
    assert not missing, "docs/faults.md lacks:\n" + "\n".join(missing)
