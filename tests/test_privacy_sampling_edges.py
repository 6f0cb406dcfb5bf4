"""Edges of `kt.privacy.poisson_batches` and of DP-SGD's seeds.

- the default padded size is the smallest multiple of 8 above mean + 7
  standard deviations of Binomial(N, q) (+1), capped at N (SciPy's std);
- `truncation_probability` is the binomial tail P(X > M) (SciPy), 1 for q = 1;
- the default number of steps is round(1 / q);
- a truncated batch keeps a uniformly random subset of the sampled examples
  (not the first ones of the dataset);
- seeds keep all 52 bits: seeds that differ above bit 26 draw other batches,
  fresh seeds use the 52 bits, and a bool is refused as a seed.

No test calls fit.
"""

import math

import numpy as np
import pytest
import scipy.stats
import tensorflow as tf

import keras_tapeops as kt
from keras_tapeops.privacy import poisson
from keras_tapeops.privacy import seeds

pytestmark = pytest.mark.unit


def _arrays(n):
    x = np.arange(n, dtype="float32")[:, None] + 1.0  # row i holds i + 1 (never 0)
    return x, np.arange(n)


def _batches(dataset):
    return [tuple(t.numpy() for t in element) for element in dataset]


@pytest.mark.parametrize("n,q", [(1000, 0.5), (60000, 0.004), (200, 0.1), (8, 0.5), (50, 0.9)])
def test_default_max_batch_size_is_mean_plus_seven_binomial_stds_capped_at_n(n, q):
    binomial = scipy.stats.binom(n, q)
    bound = min(math.ceil(binomial.mean() + 7 * binomial.std() + 1), n)
    expected = 8 * math.ceil(bound / 8)
    assert poisson.default_max_batch_size(n, q) == expected
    assert binomial.sf(expected) < 1e-9  # what the size is for


def test_default_batch_is_at_most_the_dataset_rounded_up_to_eight():
    """Mean 4 + 7 std 1.4 would be 15 rows: 8 examples fill at most 8."""
    ((x, _, mask),) = _batches(kt.privacy.poisson_batches(_arrays(8), 0.5, seed=0, steps=1))
    assert x.shape == (8, 1) and mask.shape == (8,)


@pytest.mark.parametrize(
    "n,q,m", [(100, 0.5, 50), (100, 0.5, 60), (1000, 0.01, 20), (60000, 0.004, 300), (10, 1.0, 5)]
)
def test_truncation_probability_is_the_binomial_tail(n, q, m):
    expected = scipy.stats.binom.sf(m, n, q)  # P(X > m)
    np.testing.assert_allclose(poisson.truncation_probability(n, q, m), expected, rtol=1e-6)


@pytest.mark.parametrize("q,steps", [(0.15, 7), (0.35, 3), (0.1, 10), (0.7, 1)])
def test_default_steps_are_one_over_q_rounded(q, steps):
    batches = kt.privacy.poisson_batches(_arrays(40), q, seed=0)
    assert int(batches.cardinality()) == steps == max(1, round(1 / q))


def test_truncated_batches_keep_a_uniform_subset_of_the_sample():
    """20 examples, q = 0.5 (about 10 sampled), 2 kept: each example is kept
    with the same probability. Over 200 batches (400 picks) the lower half of
    the indices gets 200 picks in expectation, standard deviation below 10:
    the bounds (6 sd) fail by chance with probability below 1e-8. Keeping
    the first sampled examples would give the lower half almost all 400."""
    n, steps = 20, 200
    batches = kt.privacy.poisson_batches(_arrays(n), 0.5, seed=1, max_batch_size=2, steps=steps)
    picks = np.concatenate([y[mask] for _, y, mask in _batches(batches)])
    assert len(picks) == 2 * steps  # P(fewer than 2 sampled) = 21 / 2**20 per batch
    counts = np.bincount(picks, minlength=n)
    assert 140 <= counts[: n // 2].sum() <= 260
    assert counts.min() >= 1  # every example reachable (each misses: 0.9**200 = 7e-10)


def test_seeds_keep_their_high_bits():
    """Seeds that differ only above bit 26 (below 2**52) draw other batches."""
    low = 12345
    for high in (1 << 26, 1 << 40, (1 << 52) - (1 << 27)):
        a = _batches(kt.privacy.poisson_batches(_arrays(50), 0.3, seed=low, steps=4))
        b = _batches(kt.privacy.poisson_batches(_arrays(50), 0.3, seed=low + high, steps=4))
        assert any(not np.array_equal(u[2], v[2]) for u, v in zip(a, b)), high
    assert seeds.seed_halves((5 << 26) + 7) == (5, 7)


def test_fresh_seeds_use_52_bits():
    """20 fresh seeds: all below 2**52 and, unless the generator has fewer
    bits, one above 2**48 (all below: probability 16**-20)."""
    drawn = [seeds.fresh_seed() for _ in range(20)]
    assert all(0 <= s < 2**52 for s in drawn)
    assert max(drawn) >= 2**48
    assert len(set(drawn)) == 20


@pytest.mark.parametrize("seed", [True, False, np.bool_(True)])
def test_a_bool_is_not_a_seed(seed):
    with pytest.raises(ValueError, match="Received: seed="):
        kt.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0, seed=seed)
    with pytest.raises(ValueError, match="Received: seed="):
        kt.privacy.poisson_batches(_arrays(8), 0.5, seed=seed)


@pytest.mark.parametrize("seed", [2**52, 2**52 + 5, 2**63])
def test_a_seed_of_2_to_the_52_or_more_is_refused(seed):
    """It would travel as its low 52 bits: `2**52 + 5` would draw what `5` draws."""
    assert seeds.seed_halves(2**52 + 5) == seeds.seed_halves(5)  # why it is refused
    message = r"\[0, 2\*\*52\)\. Received: seed="
    with pytest.raises(ValueError, match=message):
        kt.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0, seed=seed)
    with pytest.raises(ValueError, match=message):
        kt.privacy.poisson_batches(_arrays(8), 0.5, seed=seed)
    assert kt.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0, seed=2**52 - 1).seed == 2**52 - 1


def test_noise_generator_seed_halves_reach_the_key():
    """The noise key of two seeds that differ only above bit 26 differs."""
    from keras_tapeops.privacy import noise

    def draw(seed):
        key = tf.constant(seeds.seed_halves(seed), tf.int64)
        return noise.gaussian([64], key, step=0, index=0, stddev=1.0).numpy()

    assert np.abs(draw(3) - draw(3 + (1 << 30))).max() > 0.1
