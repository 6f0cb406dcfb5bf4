"""Loss terms in the progress bar and in TensorBoard (issue 4: "each term appears
in History, the progress bar and TensorBoard under its name").

The oracle is NumPy: a callback records the weights before every training
batch and at every epoch's end; the epoch's sample-weighted mean of each term
(and of `val_<name>`, `val_loss`) is recomputed from them by a NumPy forward
pass. 40 training samples in batches of 16 (a short last batch of 8) and 25
validation samples in batches of 10 (last batch 5), so the sample weighting
matters.
"""

import glob
import inspect
import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt

N, BATCH, NV, VAL_BATCH, EPOCHS = 40, 16, 25, 10, 2
BETA, GAMMA = 0.5, 0.1
# Before Keras 3.15 the progress bar prints the mean of the per-batch running
# means, for stock `loss` too (fixed when keras.utils.Progbar gained
# `stateless_metrics`); there only the presence of each key is checked.
PROGBAR_PRINTS_LOGGED_VALUES = (
    "stateless_metrics" in inspect.signature(keras.utils.Progbar).parameters
)


def make_data(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype("float32")
    y = rng.integers(0, 3, size=(n,)).astype("int32")
    return x, y


def make_model():
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="relu", name="hidden")(inputs)
    return kt.upgrade(keras.Model(inputs, keras.layers.Dense(3, name="out")(hidden)))


def terms():
    return [
        kt.ActivationPenalty("hidden", l2=BETA, name="act"),
        kt.ActivationPenalty("out", l1=GAMMA, name="train_only", in_validation=False),
    ]


def compile_model(model, optimizer, with_terms=True):
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        loss_terms=terms() if with_terms else None,
    )


class RecordWeights(keras.callbacks.Callback):
    """Weights before each training batch and at each epoch's end."""

    def __init__(self):
        super().__init__()
        self.batches = [[] for _ in range(EPOCHS)]
        self.epoch_end = []
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        self.batches[self.epoch].append(self.model.get_weights())

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_end.append(self.model.get_weights())


# ------------------------------------------------------------ NumPy oracle
def forward(weights, x):
    w1, b1, w2, b2 = weights
    hidden = np.maximum(x @ w1 + b1, 0.0)
    return hidden, hidden @ w2 + b2


def cross_entropy(logits, y):
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return -np.mean(log_probs[np.arange(len(y)), y])


def batch_values(weights, x, y, beta=BETA):
    """Per-batch (loss, act, train_only) of the training step, in float64."""
    hidden, logits = forward([w.astype("float64") for w in weights], x)
    act = beta * np.mean(np.square(hidden))
    train_only = GAMMA * np.mean(np.abs(logits))
    return cross_entropy(logits, y) + act + train_only, act, train_only


def epoch_means(per_batch_weights, x, y, batch, beta=BETA):
    """Sample-weighted epoch means of loss, act, train_only."""
    rows, sizes = [], []
    for i, weights in enumerate(per_batch_weights):
        xb, yb = x[i * batch : (i + 1) * batch], y[i * batch : (i + 1) * batch]
        rows.append(batch_values(weights, xb, yb, beta))
        sizes.append(len(xb))
    assert sum(sizes) == len(x)
    return dict(zip(["loss", "act", "train_only"],
                    np.average(np.array(rows), axis=0, weights=sizes)))


def validation_means(weights, x, y, beta=BETA):
    """val_loss (without the training-only term) and val_act."""
    starts = range(0, len(x), VAL_BATCH)
    rows = []
    for s in starts:
        loss, act, train_only = batch_values(
            weights, x[s : s + VAL_BATCH], y[s : s + VAL_BATCH], beta
        )
        rows.append((loss - train_only, act))
    sizes = [len(x[s : s + VAL_BATCH]) for s in starts]
    loss, act = np.average(np.array(rows), axis=0, weights=sizes)
    return {"val_loss": loss, "val_act": act}


def oracle_history(recorder, x, y, xv, yv, beta=BETA):
    out = {}
    for epoch in range(EPOCHS):
        values = epoch_means(recorder.batches[epoch], x, y, BATCH, beta)
        values.update(validation_means(recorder.epoch_end[epoch], xv, yv, beta))
        for key, value in values.items():
            out.setdefault(key, []).append(value)
    return out


def train(optimizer, callbacks, verbose=0, with_terms=True):
    x, y = make_data(N, 0)
    xv, yv = make_data(NV, 1)
    model = make_model()
    compile_model(model, optimizer, with_terms)
    recorder = RecordWeights()
    history = model.fit(
        x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=verbose,
        validation_data=(xv, yv), validation_batch_size=VAL_BATCH,
        callbacks=[recorder, *callbacks],
    ).history
    return history, oracle_history(recorder, x, y, xv, yv), recorder


# ------------------------------------------------------------ progress bar
def final_progbar_lines(text):
    """The finalized progress-bar line of each epoch (the one with val_loss)."""
    lines = [line for line in re.split(r"[\r\n]", text) if "val_loss:" in line]
    assert len(lines) == EPOCHS, text
    return lines


def progbar_value(line, key):
    match = re.search(rf"(?:^|\s){re.escape(key)}: (\S+)", line)
    return None if match is None else match.group(1)


def keras_format(value):
    """How keras.utils.Progbar prints a logged value."""
    return f"{value:.4f}" if abs(value) > 1e-3 else f"{value:.4e}"


def test_progress_bar_shows_each_term_and_its_validation_value(capsys):
    capsys.readouterr()
    history, oracle, _ = train(keras.optimizers.Adam(0.01), [], verbose=1)
    lines = final_progbar_lines(capsys.readouterr().out)
    for epoch, line in enumerate(lines):
        for key in ("act", "train_only", "loss", "val_act", "val_loss"):
            printed = progbar_value(line, key)
            assert printed is not None, (key, line)
            if not PROGBAR_PRINTS_LOGGED_VALUES:
                continue
            assert printed == keras_format(history[key][epoch]), (key, line)
            # The printed value is the oracle's, to the 4 printed decimals.
            assert abs(float(printed) - oracle[key][epoch]) <= 0.5e-4 + 1e-6, key
        # A training-only term has no validation value.
        assert progbar_value(line, "val_train_only") is None
    # The values move between epochs, so a stale line would be caught.
    assert progbar_value(lines[0], "act") != progbar_value(lines[1], "act")


def test_progress_bar_without_terms_shows_no_term(capsys):
    """Companion: the look-up above finds nothing when no term is compiled."""
    capsys.readouterr()
    history, _, _ = train(keras.optimizers.Adam(0.01), [], verbose=1, with_terms=False)
    for line in final_progbar_lines(capsys.readouterr().out):
        assert progbar_value(line, "loss") is not None
        for key in ("act", "train_only", "val_act"):
            assert progbar_value(line, key) is None
    assert sorted(history) == ["loss", "val_loss"]


# ------------------------------------------------------------- TensorBoard
def read_scalars(log_dir):
    """{tag: {step: value}} of every scalar summary written under `log_dir`."""
    scalars = {}
    for path in sorted(glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                number = float(tf.make_ndarray(value.tensor))
                scalars.setdefault(value.tag, {})[event.step] = number
    return scalars


def test_tensorboard_writes_each_term_equal_to_history(tmp_path):
    board = keras.callbacks.TensorBoard(log_dir=str(tmp_path))
    history, oracle, _ = train(keras.optimizers.Adam(0.01), [board])
    train_scalars = read_scalars(str(tmp_path / "train"))
    val_scalars = read_scalars(str(tmp_path / "validation"))
    assert {"epoch_act", "epoch_train_only", "epoch_loss"} <= set(train_scalars)
    assert {"epoch_act", "epoch_loss"} <= set(val_scalars)
    assert "epoch_train_only" not in val_scalars
    steps = list(range(EPOCHS))
    for key in ("act", "train_only", "loss"):
        assert sorted(train_scalars[f"epoch_{key}"]) == steps
        logged = [train_scalars[f"epoch_{key}"][s] for s in steps]
        np.testing.assert_allclose(logged, history[key], atol=1e-6, rtol=0)
        np.testing.assert_allclose(logged, oracle[key], rtol=1e-5)
    for key in ("act", "loss"):
        assert sorted(val_scalars[f"epoch_{key}"]) == steps
        logged = [val_scalars[f"epoch_{key}"][s] for s in steps]
        np.testing.assert_allclose(logged, history[f"val_{key}"], atol=1e-6, rtol=0)
        np.testing.assert_allclose(logged, oracle[f"val_{key}"], rtol=1e-5)
        # Keras also writes the validation value against the optimizer step.
        per_step = val_scalars[f"evaluation_{key}_vs_iterations"]
        np.testing.assert_allclose(
            [per_step[k] for k in sorted(per_step)], history[f"val_{key}"],
            atol=1e-6, rtol=0,
        )


def test_tensorboard_checks_can_fail(tmp_path):
    """Companion: no term tags without terms; a 1% wrong beta leaves the tolerance."""
    board = keras.callbacks.TensorBoard(log_dir=str(tmp_path))
    train(keras.optimizers.Adam(0.01), [board], with_terms=False)
    tags = set(read_scalars(str(tmp_path / "train")))
    assert "epoch_loss" in tags
    assert not {"epoch_act", "epoch_train_only"} & tags

    history, _, recorder = train(keras.optimizers.Adam(0.01), [])
    x, y = make_data(N, 0)
    xv, yv = make_data(NV, 1)
    wrong = oracle_history(recorder, x, y, xv, yv, beta=1.01 * BETA)
    for key in ("act", "val_act", "val_loss"):
        with pytest.raises(AssertionError):
            np.testing.assert_allclose(history[key], wrong[key], rtol=1e-5)
