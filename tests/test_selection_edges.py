"""Edges of sample selection that fit-level tests do not pin, checked on the engine.

- k = ceil(fraction * n) for fractions whose float32 product rounds above an
  integer (0.6 * 25), and the kept examples in batch order;
- `kt.ImportanceSampling`: the kept examples' weights are 1 / (n q_i) with q
  from the losses or from the norm of the loss's gradient with respect to
  the outputs (NumPy oracle), a batch of zero losses is sampled uniformly,
  a negative loss scores 0, the replicas of a MirroredStrategy draw
  different examples, the inverse-CDF draws accept unnormalized weights and
  never reach index n, and the diagnostics log kept / candidates and the
  kept examples' plain mean loss;
- the scoring pass runs in inference mode (no dropout);
- reweighting (`kt.SuperLoss`, `kt.SelfPaced`, `kt.ImportanceSampling`)
  multiplies the sample weights, also per time step (stock Keras's loss
  with the product as sample weight is the oracle), and logs the weighted
  share and the weighted mean loss;
- `kt.SuperLoss`'s running tau (first batch: its mean; then an exponential
  mean with `momentum`), `kt.SelfPaced`'s strict threshold,
  `kt.SelectiveBackprop`'s default fraction 1 / (1 + beta) (Jiang et al.),
  `kt.ReducibleLoss` with a holdout model or a table and sample weights, and the
  optimizer step a `SelectionRule` sees.

No test calls fit: each builds the engine and calls it as the step does.
"""

import math
from fractions import Fraction

import keras
import numpy as np
import pytest
import scipy.special
import scipy.stats
import tensorflow as tf

import keras_tapeops as kt
from keras_tapeops.per_example import per_example_losses
from keras_tapeops.selection import SelectionRule
from tests.selection_oracle import data, tiny_model

pytestmark = pytest.mark.unit


def _engine(option, n=8, model=None):
    model = model or tiny_model()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", sample_selection=option)
    x, y = data(n)
    model.single_pass_gradients(x, y, None)  # builds the compiled loss
    return model, model.tapeops_state.engine


def _mse(model, x, y):
    """Per-example mse of the model's inference-mode predictions (NumPy, float64)."""
    return np.mean((model(x, training=False).numpy().astype(np.float64) - y) ** 2, axis=1)


def _sigma(losses, tau, lam):
    """SuperLoss's confidence, from SciPy's Lambert W (Castells et al.)."""
    z = 0.5 * np.maximum(-2 / math.e, (np.asarray(losses, np.float64) - tau) / lam)
    # W(-1/e) = -1 (SciPy returns nan a rounding step below the branch point).
    w = scipy.special.lambertw(np.maximum(z, -1 / math.e + 1e-15)).real
    return np.exp(-np.where(z <= -1 / math.e, -1.0, w))


def _stock_gradients(model, x, y, sample_weight):
    """Gradients of stock Keras's mse with the given sample weights (a tape)."""
    mse = keras.losses.MeanSquaredError()

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = mse(y, model(x, training=True), sample_weight=sample_weight)
        return tape.gradient(loss, model.trainable_variables)

    return [g.numpy() for g in step()]


def _assert_gradients(actual, expected, tol=1e-6):
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(np.asarray(a), e, rtol=tol, atol=tol)


# ------------------------------------------------------------------ top k
def test_kept_count_is_the_ceiling_of_fraction_times_batch_and_in_batch_order():
    """Exact ceilings (Fraction arithmetic) over a grid of fractions and sizes.

    0.6 * 25 is 15.000001 in float32 (16 by a plain ceiling); 0.3 * 8 = 2.4
    keeps 3 (a rounding keeps 2)."""
    _, engine = _engine(kt.TopLoss(fraction=0.5))
    select = tf.function(
        lambda losses: engine.select(None, None, None, None, losses, None, None)[0],
        input_signature=[tf.TensorSpec([None], tf.float32)],
    )
    rng = np.random.default_rng(0)
    assert float(np.float32(0.6) * np.float32(25)) > 15  # the case the grid must cover
    for fraction in [round(0.05 * i, 2) for i in range(1, 21)]:
        engine.schedule_variable.assign(fraction)
        for n in range(1, 41):
            losses = rng.permutation(n).astype("float32")  # distinct losses
            kept = select(tf.constant(losses)).numpy()
            k = min(n, max(1, math.ceil(Fraction(str(fraction)) * n)))
            assert len(kept) == k, (fraction, n)
            np.testing.assert_array_equal(kept, np.sort(np.argsort(-losses)[:k]))


# ---------------------------------------------------- importance sampling
@pytest.mark.parametrize("score", ["loss", "gradient_bound"])
def test_importance_sampling_weights_are_one_over_n_q(score):
    """q_i = (1 - a) s_i / sum(s) + a / n, s_i the weighted loss or the norm
    of its gradient with respect to the outputs: for mse over d outputs,
    w_i * 2 (p_i - y_i) / d (NumPy). Every kept example weighs 1 / (n q_i)."""
    n, smoothing = 8, 0.2
    model, engine = _engine(
        kt.ImportanceSampling(fraction=1.0, score=score, smoothing=smoothing, seed=2), n=n
    )
    x, y = data(n)
    y[:2] *= 6.0  # far from uniform
    sample_weight = np.linspace(0.5, 2.0, n).astype("float32")
    y_pred = model(x, training=False)
    losses = per_example_losses(model, y, y_pred, sample_weight)
    indices, weights = tf.function(
        lambda: engine.select(model, x, y, tf.constant(sample_weight), losses, None, y_pred)
    )()
    residual = y_pred.numpy().astype(np.float64) - y
    if score == "loss":
        s = sample_weight * np.mean(residual**2, axis=1)
    else:
        s = np.linalg.norm(sample_weight[:, None] * 2.0 * residual / y.shape[1], axis=1)
    q = (1 - smoothing) * s / s.sum() + smoothing / n
    indices = indices.numpy()
    assert len(indices) == n
    np.testing.assert_allclose(weights.numpy(), 1.0 / (n * q[indices]), rtol=1e-5)
    # Companion: the other score gives other probabilities for these examples.
    other = np.mean(residual**2, axis=1) if score == "gradient_bound" else np.sqrt(s)
    q_other = (1 - smoothing) * other / other.sum() + smoothing / n
    assert np.abs(q_other - q).max() > 1e-2


def test_importance_sampling_of_zero_losses_is_uniform_with_unit_weights():
    """All scores 0 (a fitted batch): q is uniform, every weight 1 (not 1 / a, nor inf)."""
    n = 8
    model, engine = _engine(kt.ImportanceSampling(fraction=0.5, smoothing=0.0, seed=1), n=n)
    indices, weights = engine.select(model, None, None, None, tf.zeros([n]), None, None)
    assert indices.shape == (4,)
    np.testing.assert_array_equal(weights.numpy(), np.ones(4, "float32"))


def test_importance_sampling_logs_kept_over_candidates_and_the_kept_mean():
    n = 8
    model, engine = _engine(kt.ImportanceSampling(fraction=0.25, seed=3), n=n)
    x, y = data(n)
    y[:2] *= 6.0
    engine.diagnostics.reset_state()
    tf.function(lambda: engine.batch_gradients(model, x, y, None))()
    logged = {name: float(value) for name, value in engine.diagnostics.result().items()}
    losses = _mse(model, x, y)
    engine.seeds.counter.assign(0)  # the same (stateless) draw again
    indices = engine.select(model, x, y, None, tf.constant(losses, tf.float32), None, None)[0]
    assert logged["selection_fraction"] == 0.25
    np.testing.assert_allclose(
        logged["selection_kept_loss"], losses[indices.numpy()].mean(), rtol=1e-5
    )
    np.testing.assert_allclose(logged["selection_batch_loss"], losses.mean(), rtol=1e-5)


def test_importance_sampling_replicas_draw_different_examples(mirrored):
    """Each replica of a MirroredStrategy draws from its own seed: two replicas
    with the same losses keep different examples (equal draws of 16 indices
    out of 16 by chance: below 1e-15)."""
    n = 16
    with mirrored.scope():
        model = tiny_model()
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss="mse",
            sample_selection=kt.ImportanceSampling(fraction=1.0, seed=5),
        )
    engine = model.tapeops_state.engine
    losses = tf.constant(np.linspace(0.1, 2.0, n), tf.float32)

    @tf.function
    def draws():
        return mirrored.run(lambda: engine.select(model, None, None, None, losses, None, None)[0])

    per_replica = mirrored.experimental_local_results(draws())
    assert len(per_replica) == 2
    assert not np.array_equal(per_replica[0].numpy(), per_replica[1].numpy())


def test_importance_sampling_clamps_negative_losses_to_zero_scores():
    """A loss can be negative (cosine similarity): its score is 0, so it is
    drawn with probability a / n only and every probability stays positive."""
    n, smoothing = 5, 0.2
    model, engine = _engine(kt.ImportanceSampling(fraction=1.0, smoothing=smoothing, seed=3), n=n)
    losses = np.array([-1.0, 0.5, -0.2, 1.5, 0.0], "float32")
    indices, weights = engine.select(model, None, None, None, tf.constant(losses), None, None)
    s = np.maximum(losses.astype(np.float64), 0.0)
    q = (1 - smoothing) * s / s.sum() + smoothing / n
    np.testing.assert_allclose(weights.numpy(), 1.0 / (n * q[indices.numpy()]), rtol=1e-6)


def test_inverse_cdf_draws_accept_unnormalized_weights_and_stay_in_range():
    """Weights need not sum to 1 (chi-square, false failure 1e-3); and when the
    float32 cumulative sum falls short of the total (1 + 4000 x 1e-8: the
    small terms vanish in the running sum), no index reaches n and the last
    example is not drawn in their place."""
    from keras_tapeops.selection.importance_sampling import draw_with_replacement

    weights = tf.constant([5.0, 1.0, 0.0, 3.0, 1.0])
    picks = draw_with_replacement(weights, tf.constant(5000), tf.constant([3, 4], tf.int64))
    counts = np.bincount(picks.numpy(), minlength=5)
    assert counts[2] == 0
    keep = [0, 1, 3, 4]
    expected = 5000 * weights.numpy()[keep] / 10.0
    assert scipy.stats.chisquare(counts[keep], expected).pvalue > 1e-3

    skewed = np.r_[1.0, np.full(4000, 1e-8)].astype("float32")
    assert tf.reduce_sum(skewed).numpy() > tf.cumsum(skewed)[-1].numpy()  # the case
    picks = draw_with_replacement(
        tf.constant(skewed), tf.constant(2_000_000), tf.constant([1, 2], tf.int64)
    ).numpy()
    assert picks.min() >= 0 and picks.max() <= len(skewed) - 1
    # Scaled by the running sum's last value, no draw lands past it: the last
    # example is not drawn (its share, 1e-8, is below float32's resolution
    # here). Scaled by `reduce_sum`, about 4e-5 of the draws (80) landed on it.
    assert np.count_nonzero(picks == len(skewed) - 1) == 0


def test_scoring_pass_runs_in_inference_mode():
    """Dropout is off in the scoring pass: the predictions the engine returns
    (for the compiled metrics) and ranks by are `model(x, training=False)`."""
    keras.utils.set_random_seed(0)
    model = kt.upgrade(
        keras.Sequential(
            [
                keras.Input((4,)),
                keras.layers.Dense(16),
                keras.layers.Dropout(0.5),
                keras.layers.Dense(2),
            ]
        )
    )
    model, engine = _engine(kt.TopLoss(fraction=0.5), model=model)
    x, y = data(8)
    y_pred = tf.function(lambda: engine.batch_gradients(model, x, y, None)[1])()
    np.testing.assert_allclose(y_pred.numpy(), model(x, training=False).numpy(), rtol=1e-6)
    # Companion: the training-mode pass drops units.
    assert np.abs(model(x, training=True).numpy() - y_pred.numpy()).max() > 1e-3


# -------------------------------------------------------------- reweighting
def test_super_loss_weights_multiply_the_sample_weights():
    """The step's gradient is stock Keras's with sample weights w_i * sigma_i
    (sigma from SciPy); sigma is computed from the weighted losses."""
    n, tau, lam = 8, 0.8, 0.5
    model, engine = _engine(kt.SuperLoss(lam=lam, tau=tau), n=n)
    x, y = data(n)
    sample_weight = np.linspace(0.25, 3.0, n).astype("float32")
    ours = tf.function(lambda: engine.batch_gradients(model, x, y, tf.constant(sample_weight)))()[0]
    sigma = _sigma(sample_weight * _mse(model, x, y), tau, lam)
    expected = _stock_gradients(model, x, y, (sample_weight * sigma).astype("float32"))
    _assert_gradients(ours, expected, tol=1e-5)
    # Companion: the sample weights alone give another step.
    alone = _stock_gradients(model, x, y, sample_weight)
    assert max(np.abs(a - e).max() for a, e in zip(alone, expected)) > 1e-3


def test_importance_sampling_weights_multiply_the_sample_weights():
    """Kept example i trains with weight w_i / (n q_i): stock Keras on the kept rows."""
    n, smoothing = 8, 0.1
    model, engine = _engine(kt.ImportanceSampling(fraction=0.5, smoothing=smoothing, seed=7), n=n)
    x, y = data(n)
    y[:3] *= 4.0
    sample_weight = np.linspace(3.0, 0.25, n).astype("float32")
    ours = tf.function(lambda: engine.batch_gradients(model, x, y, tf.constant(sample_weight)))()[0]
    engine.seeds.counter.assign(0)  # the draw the step made
    losses = sample_weight * _mse(model, x, y)
    indices = engine.select(model, x, y, None, tf.constant(losses, tf.float32), None, None)[0]
    indices = indices.numpy()
    q = (1 - smoothing) * losses / losses.sum() + smoothing / n
    kept_weight = (sample_weight[indices] / (n * q[indices])).astype("float32")
    expected = _stock_gradients(model, x[indices], y[indices], kept_weight)
    _assert_gradients(ours, expected, tol=1e-5)


def test_self_paced_weights_broadcast_over_time_steps():
    """Per-time-step sample weights [n, T] times the per-example 0/1 weights."""
    n, steps = 6, 4
    rng = np.random.default_rng(3)
    model = kt.upgrade(keras.Sequential([keras.Input((steps, 3)), keras.layers.Dense(2)]))
    model.set_weights([rng.normal(size=w.shape).astype("float32") for w in model.get_weights()])
    x = rng.normal(size=(n, steps, 3)).astype("float32")
    y = rng.normal(size=(n, steps, 2)).astype("float32")
    sample_weight = rng.uniform(0.2, 2.0, size=(n, steps)).astype("float32")
    per_step = np.mean((model(x).numpy().astype(np.float64) - y) ** 2, axis=2)
    losses = np.mean(sample_weight * per_step, axis=1)  # Keras: the mean over time steps
    threshold = float(np.median(losses))
    keep = (losses < threshold).astype("float32")
    assert keep.sum() == n // 2
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss="mse",
        sample_selection=kt.SelfPaced(threshold_schedule=threshold),
    )
    model.single_pass_gradients(x, y, None)  # builds the compiled loss
    engine = model.tapeops_state.engine
    ours = tf.function(lambda: engine.batch_gradients(model, x, y, tf.constant(sample_weight)))()[0]
    expected = _stock_gradients(model, x, y, sample_weight * keep[:, None])
    _assert_gradients(ours, expected)


def test_super_loss_logs_the_weighted_share_and_the_weighted_mean_loss():
    n, tau, lam = 8, 0.8, 0.5
    model, engine = _engine(kt.SuperLoss(lam=lam, tau=tau), n=n)
    x, y = data(n)
    engine.diagnostics.reset_state()
    tf.function(lambda: engine.batch_gradients(model, x, y, None))()
    logged = {name: float(value) for name, value in engine.diagnostics.result().items()}
    losses = _mse(model, x, y)
    sigma = _sigma(losses, tau, lam)
    np.testing.assert_allclose(logged["selection_fraction"], sigma.sum() / n, rtol=1e-5)
    np.testing.assert_allclose(
        logged["selection_kept_loss"], (sigma * losses).sum() / sigma.sum(), rtol=1e-5
    )
    np.testing.assert_allclose(logged["selection_batch_loss"], losses.mean(), rtol=1e-5)
    assert abs((sigma * losses).sum() / sigma.sum() - losses.mean()) > 1e-2  # the check can fail


def test_super_loss_running_tau_is_the_batch_mean_then_an_exponential_mean():
    """tau_1 = mean(l_1), tau_t = m tau_(t-1) + (1 - m) mean(l_t); an empty batch
    changes nothing. The weights are sigma(l, tau_t) (SciPy)."""
    lam, m = 1.0, 0.7
    _, engine = _engine(kt.SuperLoss(lam=lam, momentum=m))
    select = tf.function(
        lambda losses: engine.select(None, None, None, None, losses, None, None)[1],
        input_signature=[tf.TensorSpec([None], tf.float32)],
    )
    rng = np.random.default_rng(4)
    tau = None
    for size in (6, 0, 6, 6):
        losses = rng.exponential(2.0, size=size).astype("float32")
        weights = select(tf.constant(losses)).numpy()
        if size == 0:
            assert weights.shape == (0,)
            continue
        mean = losses.astype(np.float64).mean()
        tau = mean if tau is None else m * tau + (1 - m) * mean
        np.testing.assert_allclose(weights, _sigma(losses, tau, lam), rtol=1e-5)
        np.testing.assert_allclose(float(engine.tau.numpy()), tau, rtol=1e-6)


def test_self_paced_threshold_is_strict():
    """v_i = 1 if l_i < lambda else 0 (Kumar et al.; a loss equal to lambda is left out)."""
    model, engine = _engine(kt.SelfPaced(threshold_schedule=1.0))
    losses = tf.constant([0.5, 1.0, 1.5, 0.999, 1.001])
    weights = engine.select(model, None, None, None, losses, None, None)[1]
    np.testing.assert_array_equal(weights.numpy(), [1.0, 0.0, 0.0, 1.0, 0.0])


def test_selective_backprop_default_fraction_is_the_expected_bernoulli_share():
    """Jiang et al. keep example i with probability P_i^beta; with uniform
    percentiles the expected share is the integral of u^beta, 1 / (1 + beta)."""
    beta = 3.0
    expected = np.mean(((np.arange(100_000) + 0.5) / 100_000) ** beta)  # midpoint rule
    model, engine = _engine(kt.SelectiveBackprop(beta=beta, seed=0))
    np.testing.assert_allclose(float(engine.schedule_variable.numpy()), expected, rtol=1e-6)
    indices = engine.select(model, None, None, None, tf.linspace(0.1, 1.0, 8), None, None)[0]
    assert indices.shape == (2,)  # ceil(8 / 4)


# ----------------------------------------------------------- reducible loss
def test_reducible_loss_with_a_holdout_model_ranks_the_weighted_difference():
    """reducible_i = compiled loss (sample weights applied) of the model minus
    that of the holdout model: w_i (l_i - l_irr_i); top k in batch order."""
    n = 8
    holdout = tiny_model(seed=7)
    model, engine = _engine(kt.ReducibleLoss(irreducible=holdout, fraction=0.25), n=n)
    x, y = data(n)
    sample_weight = np.array([0.1, 3.0, 1.0, 0.2, 2.5, 1.0, 0.5, 4.0], "float32")
    y_pred = model(x, training=False)
    losses = per_example_losses(model, y, y_pred, sample_weight)
    indices = engine.select(model, x, y, tf.constant(sample_weight), losses, None, y_pred)[0]
    reducible = sample_weight * (_mse(model, x, y) - _mse(holdout, x, y))
    expected = np.sort(np.argsort(-reducible)[:2])
    np.testing.assert_array_equal(indices.numpy(), expected)
    # Companion: subtracting the unweighted holdout loss ranks other examples.
    other = sample_weight * _mse(model, x, y) - _mse(holdout, x, y)
    assert not np.array_equal(np.sort(np.argsort(-other)[:2]), expected)


def test_reducible_loss_with_a_table_subtracts_its_values_as_they_are():
    """A table's values are not weighted: reducible_i = w_i l_i - table[id_i].
    A table of weighted holdout losses ranks as the holdout model does."""
    n = 8
    holdout = tiny_model(seed=7)
    x, y = data(n)
    sample_weight = np.array([0.1, 3.0, 1.0, 0.2, 2.5, 1.0, 0.5, 4.0], "float32")
    irreducible = _mse(holdout, x, y).astype("float32")
    ids = tf.constant(np.arange(n)[::-1].copy(), tf.int32)  # ids are not batch positions

    def kept(table):
        model, engine = _engine(kt.ReducibleLoss(irreducible=table, fraction=0.25), n=n)
        y_pred = model(x, training=False)
        losses = per_example_losses(model, y, y_pred, sample_weight)
        return model, engine.select(model, x, y, tf.constant(sample_weight), losses, ids, y_pred)[0]

    by_id = np.empty(n, "float32")
    by_id[ids.numpy()] = irreducible  # table[id_i] is example i's value
    model, indices = kept(by_id)
    plain = sample_weight * _mse(model, x, y) - irreducible
    np.testing.assert_array_equal(indices.numpy(), np.sort(np.argsort(-plain)[:2]))

    weighted = np.empty(n, "float32")
    weighted[ids.numpy()] = sample_weight * irreducible
    model, indices = kept(weighted)
    reducible = sample_weight * (_mse(model, x, y) - irreducible)
    expected = np.sort(np.argsort(-reducible)[:2])
    np.testing.assert_array_equal(indices.numpy(), expected)
    assert not np.array_equal(np.sort(np.argsort(-plain)[:2]), expected)  # the two differ


# ------------------------------------------------------------ user rules
class _FirstStepPlusOne(SelectionRule):
    """Keeps the first `step + 1` examples (reads the optimizer's step)."""

    def select(self, losses, context):
        n = tf.shape(losses)[0]
        return tf.cast(tf.range(n, dtype=tf.int64) <= context.step, "float32")


def test_selection_rule_sees_the_optimizer_step():
    model, engine = _engine(_FirstStepPlusOne())
    losses = tf.ones([8])
    for step in (0, 2, 5):
        model.optimizer.iterations.assign(step)
        indices = engine.select(model, None, None, None, losses, None, None)[0]
        np.testing.assert_array_equal(indices.numpy(), np.arange(step + 1))
