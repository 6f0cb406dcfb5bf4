"""sample_selection under faults (issue 28): empty batches, bad example ids, jit.

- An empty batch adds nothing: `fit` on batches of sizes [4, 0, 4, 4]
  equals `fit` on [4, 4, 4] (weights 1e-6, History, the method's state),
  as stock Keras, for every selection method; no NaN anywhere.
- `kt.ReducibleLoss` refuses float ids, negative and out-of-range ids with
  messages naming `example_id`, before any weight changes; it refuses
  `jit_compile=True` with an id table (XLA cannot raise at run time).
- `kt.ImportanceSampling` trains under `jit_compile=True`, equal to the same
  fit without jit and to a hand-written loop (inverse-CDF draws from the
  same stateless uniforms, NumPy probabilities, SGD), 1e-6.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tapeops as kt
from tests.selection_oracle import data, tiny_model

LR = 0.1


def batches_dataset(x, y, sizes):
    """Consecutive slices of `x` (a dict or an array) and `y` of the given sizes (0 allowed)."""
    parts, start = [], 0
    for size in sizes:
        part = slice(start, start + size)
        xs = {k: v[part] for k, v in x.items()} if isinstance(x, dict) else x[part]
        parts.append(tf.data.Dataset.from_tensors((xs, y[part])))
        start += size
    dataset = parts[0]
    for more in parts[1:]:
        dataset = dataset.concatenate(more)
    return dataset


def _state(model):
    engine = model.tapeops_state.engine
    return {v.name: v.numpy() for v in engine.variables}


METHODS = {
    "TopLoss": lambda: kt.TopLoss(fraction=0.5),
    "ReducibleLoss": lambda: kt.ReducibleLoss(
        irreducible=np.linspace(0.0, 1.0, 12, dtype="float32"), fraction=0.5),
    "SelectiveBackprop": lambda: kt.SelectiveBackprop(beta=1.0, seed=3),
    "ImportanceSampling": lambda: kt.ImportanceSampling(fraction=0.5, seed=4),
    "ImportanceSampling_gradient_bound": lambda: kt.ImportanceSampling(
        fraction=0.5, score="gradient_bound", seed=4),
    "SelfPaced": lambda: kt.SelfPaced(threshold_schedule=1.0),
    "SuperLoss": lambda: kt.SuperLoss(lam=1.0),
}


@pytest.mark.parametrize("name", sorted(METHODS))
def test_empty_batch_adds_nothing(name):
    """Old: SuperLoss's running tau became nan (every weight nan after);
    TopLoss/ReducibleLoss/SelectiveBackprop logged a nan `selection_batch_loss`;
    ImportanceSampling raised a raw StatelessMultinomial error."""
    x, y = data(12)
    if name == "ReducibleLoss":
        x = {"x": x, "example_id": np.arange(12)}
    runs = []
    for sizes in ([4, 0, 4, 4], [4, 4, 4]):
        model = tiny_model()
        model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse",
                      sample_selection=METHODS[name]())
        history = model.fit(batches_dataset(x, y, sizes), epochs=2, shuffle=False, verbose=0)
        runs.append((model, history.history))
    (with_empty, h_empty), (without, h_plain) = runs
    for actual, want in zip(with_empty.get_weights(), without.get_weights()):
        assert np.all(np.isfinite(actual))
        np.testing.assert_allclose(actual, want, rtol=1e-6, atol=1e-6)
    assert set(h_empty) == set(h_plain)
    for key, values in h_empty.items():
        assert np.all(np.isfinite(values)), (key, values)
        np.testing.assert_allclose(values, h_plain[key], rtol=1e-6, atol=1e-6, err_msg=key)
    plain_state = _state(without)
    for key, value in _state(with_empty).items():
        assert np.all(np.isfinite(value)), key
        np.testing.assert_allclose(value, plain_state[key], rtol=1e-6, atol=1e-6, err_msg=key)
    # Companion: training happened (the comparison is not of two untouched models).
    assert np.abs(with_empty.get_weights()[0] - tiny_model().get_weights()[0]).max() > 1e-3


def test_selective_backprop_keeps_nan_losses_out_of_its_history():
    """A NaN example's loss is not written to the ring buffer (it would make
    its percentile comparisons false for `history_size` more losses)."""
    model = tiny_model()
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse",
                  sample_selection=kt.SelectiveBackprop(beta=1.0, history_size=16, seed=0))
    model.single_pass_gradients(*data(4), None)  # builds the compiled loss
    engine = model.tapeops_state.engine
    p = engine.keep_probabilities(tf.constant([0.5, np.nan, 2.0, 1.0])).numpy()
    assert int(engine.seen.numpy()) == 3
    np.testing.assert_array_equal(engine.history.numpy()[:3], [0.5, 2.0, 1.0])
    np.testing.assert_allclose(p, [1 / 3, 0.0, 1.0, 2 / 3], rtol=1e-6)
    assert np.all(np.isfinite(engine.history.numpy()))


# --------------------------------------------------- ReducibleLoss's example ids
def _reducible(jit_compile=False):
    model = tiny_model()
    model.compile(optimizer=keras.optimizers.Adam(0.1), loss="mse", jit_compile=jit_compile,
                  sample_selection=kt.ReducibleLoss(irreducible=np.zeros(16), fraction=0.5))
    return model


def _unchanged(model):
    for actual, want in zip(model.get_weights(), tiny_model().get_weights()):
        np.testing.assert_array_equal(actual, want)


def test_reducible_loss_refuses_float_ids_naming_example_id():
    """Old: float ids were truncated (3.7 -> 3) and trained silently."""
    x, y = data(16)
    model = _reducible()
    ids = np.arange(16, dtype="float32") + 0.7
    with pytest.raises(ValueError, match="integer example ids.*Received: example_id with dtype float32"):
        model.fit({"x": x, "example_id": ids}, y, batch_size=8, verbose=0)
    _unchanged(model)


@pytest.mark.parametrize("bad", [-1, 16, 1000])
def test_reducible_loss_refuses_out_of_range_ids_before_any_weight_changes(bad):
    """Old: a raw GatherV2 error that never named `example_id`."""
    x, y = data(16)
    ids = np.arange(16)
    ids[2] = bad  # in the first batch
    model = _reducible()
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=rf"every example_id must index the irreducible table, in \[0, 16\)\. "
                             rf"Received: example_id=.*{bad}"):
        model.fit({"x": x, "example_id": ids}, y, batch_size=8, shuffle=False, verbose=0)
    _unchanged(model)
    # Adam's moments are untouched too. (Its `iterations` counter is not
    # ordered after the check inside the traced step and may count the
    # failed step: it holds no gradient information.)
    slots = [v for v in model.optimizer.variables
             if "momentum" in v.path or "velocity" in v.path]
    assert slots and all(not np.any(v.numpy()) for v in slots)


def test_reducible_loss_with_a_table_refuses_jit_compile():
    """Old: under XLA an out-of-range id was clamped and trained silently."""
    x, y = data(16)
    ids = np.arange(16)
    ids[3] = 99
    model = _reducible(jit_compile=True)
    with pytest.raises(ValueError, match="XLA.*jit_compile=False.*Received: jit_compile=True"):
        model.fit({"x": x, "example_id": ids}, y, batch_size=8, verbose=0)
    _unchanged(model)


def test_reducible_loss_valid_ids_still_train():
    """Companion: the checks pass valid int32 and int64 ids (same weights)."""
    x, y = data(16)
    results = []
    for dtype in ("int32", "int64"):
        model = _reducible()
        model.fit({"x": x, "example_id": np.arange(16, dtype=dtype)}, y,
                  batch_size=8, shuffle=False, verbose=0)
        results.append(model.get_weights())
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)
    assert np.abs(results[0][0] - tiny_model().get_weights()[0]).max() > 1e-3


# ---------------------------------------------- ImportanceSampling under jit
SEED = 5
FRACTION = 0.5
SMOOTHING = 0.1


def importance_sampling_loop(model, x, y, batch, jit_compile=False):
    """The hand-written loop: NumPy probabilities, inverse-CDF draws, SGD.

    The uniforms come from `tf.random.stateless_uniform` with the step's seed,
    run under XLA when `jit_compile` (XLA's Philox gives other numbers than
    the TF kernel for the same seed).
    """
    variables = model.trainable_weights
    uniforms = tf.function(lambda k, seed: tf.random.stateless_uniform([k], seed),
                           jit_compile=jit_compile)

    @tf.function
    def step(xb, yb, indices, weights):
        with tf.GradientTape() as tape:
            pred = model(tf.gather(xb, indices), training=True)
            per_example = tf.reduce_mean(tf.square(pred - tf.gather(yb, indices)), axis=1)
            loss = tf.reduce_sum(weights * per_example) / tf.cast(tf.size(indices), tf.float32)
        for v, g in zip(variables, tape.gradient(loss, variables)):
            v.assign_sub(LR * g)

    for count, start in enumerate(range(0, len(x), batch)):
        xb, yb = x[start:start + batch], y[start:start + batch]
        losses = np.mean((model(xb, training=False).numpy() - yb) ** 2, axis=1).astype(np.float64)
        n = len(xb)
        q = (1 - SMOOTHING) * losses / losses.sum() + SMOOTHING / n
        k = int(np.ceil(FRACTION * n))
        u = uniforms(k, tf.constant([SEED, count], tf.int64)).numpy()
        cumulative = np.cumsum(q.astype(np.float32))
        indices = np.minimum(np.searchsorted(cumulative, u * cumulative[-1], side="right"), n - 1)
        weights = (1.0 / (n * q[indices])).astype(np.float32)
        step(tf.constant(xb), tf.constant(yb), tf.constant(indices, tf.int32), tf.constant(weights))
    return model


@pytest.mark.parametrize("jit_compile", [True, False], ids=["jit", "no_jit"])
def test_importance_sampling_equals_the_hand_written_loop(jit_compile):
    """Old: jit_compile=True failed in XLA conversion (StatelessMultinomial)."""
    x, y = data(16)
    y[:3] *= 5.0  # far from uniform sampling
    model = tiny_model()
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse", jit_compile=jit_compile,
                  sample_selection=kt.ImportanceSampling(
                      fraction=FRACTION, smoothing=SMOOTHING, seed=SEED))
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    oracle = importance_sampling_loop(tiny_model(), x, y, batch=8, jit_compile=jit_compile)
    for actual, want in zip(model.get_weights(), oracle.get_weights()):
        np.testing.assert_allclose(actual, want, rtol=1e-5, atol=1e-6)
    # Companion: the full-batch step ends elsewhere.
    stock = tiny_model()
    stock.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    stock.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert np.abs(stock.get_weights()[0] - oracle.get_weights()[0]).max() > 1e-3


@pytest.mark.unit
def test_draws_follow_the_probabilities_and_accept_an_empty_batch():
    """Inverse-CDF draws: frequencies match q (chi-square, false failure 1e-3);
    zero draws from an empty batch."""
    import scipy.stats

    from keras_tapeops.selection.importance_sampling import draw_with_replacement

    q = tf.constant([0.5, 0.1, 0.0, 0.3, 0.1])
    picks = draw_with_replacement(q, tf.constant(5000), tf.constant([1, 2], tf.int64)).numpy()
    counts = np.bincount(picks, minlength=5)
    assert counts[2] == 0
    keep = [0, 1, 3, 4]
    assert scipy.stats.chisquare(counts[keep], 5000 * q.numpy()[keep]).pvalue > 1e-3
    empty = draw_with_replacement(tf.zeros([0]), tf.constant(0), tf.constant([1, 2], tf.int64))
    assert empty.shape == (0,)


# ------------------------- documentation check: accumulation with a "sum" loss
def test_accumulation_steps_with_a_sum_loss_equals_micro_batches_and_stock():
    """README and docs/accumulation.md said `accumulation_steps` refuses a
    plain `"sum"` loss: it accepts it (one normalizer, 1, for the window) and
    two batches of 4 make the step of one batch of 8, as `micro_batches=2`
    and stock Keras on that batch (SGD, 3 steps, 1e-6)."""
    x, y = data(24)
    sample_weight = np.random.default_rng(2).uniform(0.5, 1.5, size=24).astype("float32")
    loss = keras.losses.MeanSquaredError(reduction="sum")
    results = {}
    for name, batch, options in (("stock", 8, None), ("micro", 8, {"micro_batches": 2}),
                                 ("window", 4, {"accumulation_steps": 2})):
        model = tiny_model()
        if options is None:  # a stock model with the same layers and weights
            model = keras.Sequential(model.layers)
            options = {}
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss, **options)
        model.fit(x, y, sample_weight=sample_weight, batch_size=batch,
                  shuffle=False, verbose=0)
        results[name] = model.get_weights()
    for name in ("micro", "window"):
        for actual, want in zip(results[name], results["stock"]):
            np.testing.assert_allclose(actual, want, rtol=1e-6, atol=1e-6, err_msg=name)
    # Companion: six steps on batches of 4 end elsewhere.
    small = tiny_model()
    small.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss)
    small.fit(x, y, sample_weight=sample_weight, batch_size=4, shuffle=False, verbose=0)
    assert np.abs(small.get_weights()[0] - results["stock"][0]).max() > 1e-4
