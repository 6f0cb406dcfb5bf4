"""DP-SGD's noise: std C * sigma / batch, once per applied step, reproducible by seed."""

import keras
import numpy as np
import pytest

import keras_tapeops as kt

CLIP, SIGMA = 0.7, 1.3


def _zero_gradient_model(strategy=None):
    """A Dense layer at zero with targets zero: every gradient is zero at the start."""
    def build():
        model = kt.upgrade(keras.Sequential([keras.Input((40,)), keras.layers.Dense(50)]))
        model.set_weights([np.zeros((40, 50), "float32"), np.zeros(50, "float32")])
        return model

    if strategy is None:
        return build()
    with strategy.scope():
        return build()


def _one_step(model, batch, seed, strategy=None, n=None, **options):
    n = batch if n is None else n
    x = np.random.default_rng(1).normal(size=(n, 40)).astype("float32")
    y = np.zeros((n, 50), "float32")
    scope = strategy.scope() if strategy is not None else _Null()
    with scope:
        model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse",
                      differential_privacy=kt.DPSGD(CLIP, SIGMA, seed=seed), **options)
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    return np.concatenate([w.ravel() for w in model.get_weights()])


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_update_std_is_clip_times_sigma_over_batch():
    """2050 independent normals; the sample std's relative standard error is
    1/sqrt(2 * 2050) = 1.6%. Bounds at 5 standard errors (std within 7.8%,
    mean within 5 sigma / sqrt(2050)) fail by chance with probability < 1e-6."""
    update = _one_step(_zero_gradient_model(), batch=8, seed=3)
    expected = CLIP * SIGMA / 8
    assert abs(update.std() / expected - 1) < 5 / np.sqrt(2 * update.size)
    assert abs(update.mean()) < 5 * expected / np.sqrt(update.size)


def test_same_seed_same_run_other_seed_other_noise():
    a = _one_step(_zero_gradient_model(), batch=8, seed=5)
    b = _one_step(_zero_gradient_model(), batch=8, seed=5)
    c = _one_step(_zero_gradient_model(), batch=8, seed=6)
    np.testing.assert_array_equal(a, b)
    assert np.abs(a - c).max() > 0.1 * CLIP * SIGMA / 8


def test_no_seed_draws_fresh_noise_per_compile():
    a = _one_step(_zero_gradient_model(), batch=8, seed=None)
    b = _one_step(_zero_gradient_model(), batch=8, seed=None)
    assert np.abs(a - b).max() > 0.1 * CLIP * SIGMA / 8


def test_noise_once_per_step_with_micro_batches_and_accumulation():
    single = _one_step(_zero_gradient_model(), batch=8, seed=9)
    micro = _one_step(_zero_gradient_model(), batch=8, seed=9, micro_batches=4)
    # Two batches of 4 make one step: the same noise, divided by the window's 8 samples.
    window = _one_step(_zero_gradient_model(), batch=4, seed=9, n=8, accumulation_steps=2)
    np.testing.assert_allclose(micro, single, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(window, single, rtol=1e-6, atol=1e-7)


def test_two_replicas_draw_the_noise_of_one_device(mirrored):
    single = _one_step(_zero_gradient_model(), batch=8, seed=11)
    replicated = _one_step(_zero_gradient_model(mirrored), batch=8, seed=11, strategy=mirrored)
    np.testing.assert_allclose(replicated, single, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("seed", [None, 2])
def test_noise_is_not_saved_with_the_model(tmp_path, seed):
    model = _zero_gradient_model()
    _one_step(model, batch=8, seed=seed)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.tapeops_options.differential_privacy.seed == seed
    assert loaded.tapeops_state.engine.variables == []


# The generator itself (Box-Muller over Philox uniforms, `noise.gaussian_at`).
def _draws(size, index=0, step=0, seed=(4, 2)):
    import tensorflow as tf

    from keras_tapeops.privacy import noise

    key = noise.step_key(tf.constant(seed, tf.int64), step)
    return tf.function(lambda: noise.gaussian_at([size], key, index, 1.0))().numpy()


@pytest.mark.unit
def test_generator_draws_standard_normals():
    """Kolmogorov-Smirnov against N(0, 1) on 200k draws, and on each Box-Muller half.

    Each p-value is above 1e-4 unless the draws are not standard normal
    (chance of a false alarm: 3e-4); the check can fail: uniforms (the
    generator's inputs) or draws scaled by 1.02 are rejected."""
    from scipy import stats

    size = 200_001  # odd: the last pair is cut
    draws = _draws(size)
    assert draws.shape == (size,) and draws.dtype == np.float32
    for sample in (draws, draws[: size // 2], draws[size // 2 + 1:]):
        assert stats.kstest(sample, "norm").pvalue > 1e-4
    assert stats.kstest(draws * 1.02, "norm").pvalue < 1e-4
    assert stats.kstest(np.random.default_rng(0).uniform(-2, 2, size), "norm").pvalue < 1e-4
    # The tails reach past 4 standard deviations as often as a normal's (2 * 3.2e-5 * size = 13).
    assert 3 <= np.sum(np.abs(draws) > 4) <= 30


@pytest.mark.unit
def test_generator_draws_are_independent_across_halves_variables_and_steps():
    """Correlations of 100k pairs are within 5 standard errors (5 / sqrt(100k) = 0.016) of 0."""
    size = 200_000
    draws = _draws(size)
    radius_pairs = (draws[: size // 2], draws[size // 2:])  # cos and sin of one pair
    squared_pairs = (radius_pairs[0] ** 2, radius_pairs[1] ** 2)  # dependent if r is shared badly
    other_variable = _draws(size, index=1)
    other_step = _draws(size, step=1)
    bound = 5 / np.sqrt(size // 2)
    for a, b in (radius_pairs, squared_pairs, (draws, other_variable), (draws, other_step)):
        assert abs(np.corrcoef(a, b)[0, 1]) < bound
    np.testing.assert_array_equal(_draws(size), draws)  # keyed: the same key draws the same
    assert np.abs(_draws(size, seed=(4, 3)) - draws).max() > 1
