"""`kt.privacy.poisson_batches`: Poisson subsampling, as the accountant assumes.

Each step includes every example independently with probability
`sampling_rate`, so batch sizes vary. To keep one traced step (and one XLA
program), every batch is padded to a fixed `max_batch_size` with masked rows:
the batch's `sample_weight` is a boolean mask, which `kt.DPSGD` reads as
"real example" (a masked row gets clip weight 0; metrics and the logged loss
ignore it, as a zero sample weight). The update is the noisy clipped sum
divided by `max_batch_size`, a public constant: dividing by the realized
batch size would make the normalization depend on the data.

A batch larger than `max_batch_size` keeps a random subset of that size
(truncated Poisson sampling). The default size makes that an event of
probability below 1e-9 per step (see `truncation_probability`).
"""

import math

import numpy as np
import tensorflow as tf

from keras_tapeops import validation
from keras_tapeops.privacy import noise
from keras_tapeops.privacy.accounting import check_sampling_rate

_STD_MARGIN = 7.0  # standard deviations of the batch size above its mean


def default_max_batch_size(dataset_size, sampling_rate):
    """The padded batch size: mean + 7 standard deviations, rounded up to a multiple of 8.

    Args:
        dataset_size: number of examples N.
        sampling_rate: q.

    Returns:
        An int, at most N rounded up to a multiple of 8.
    """
    mean = dataset_size * sampling_rate
    size = math.ceil(mean + _STD_MARGIN * math.sqrt(mean * (1 - sampling_rate)) + 1)
    return _round_up(min(size, dataset_size), 8)


def truncation_probability(dataset_size, sampling_rate, max_batch_size):
    """P(Binomial(N, q) > max_batch_size): the chance a step's sample is truncated.

    Example:
    ```python
    kt.privacy.poisson.truncation_probability(60000, 0.004, 392)   # < 1e-9
    ```
    """
    n, q, m = int(dataset_size), float(sampling_rate), int(max_batch_size)
    if m >= n:
        return 0.0
    if q >= 1:
        return 1.0
    k = np.arange(m + 1, n + 1)
    log_pmf = (
        _log_choose(n, k) + k * math.log(q) + (n - k) * math.log1p(-q)
    )
    return float(np.exp(log_pmf).sum())


def poisson_batches(dataset, sampling_rate, seed=None, max_batch_size=None, steps=None):
    """Poisson-sampled, padded batches `(x, y, mask)` for `fit` with `kt.DPSGD`.

    Args:
        dataset: the training examples: an unbatched, finite
            `tf.data.Dataset` of `(x, y)` pairs, or a tuple `(x, y)` of
            arrays (x and y may be nested structures). It is held in memory.
        sampling_rate: the probability q that an example is in a batch, in
            (0, 1].
        seed: None (fresh randomness) or a non-negative int: the same seed gives the same
            batches; each epoch draws new ones.
        max_batch_size: the padded batch size M (default: mean + 7 standard
            deviations of the batch size, rounded up to a multiple of 8).
        steps: batches per epoch (default `round(1 / q)`: one pass over the
            data in expectation).

    Returns:
        A `tf.data.Dataset` of `(x, y, mask)`: `M` rows each, `mask` a bool
        `[M]` vector marking the sampled examples.

    Example:
    ```python
    batches = kt.privacy.poisson_batches((x, y), sampling_rate=0.25, seed=0)
    model.compile(optimizer="sgd", loss="categorical_crossentropy",
                  differential_privacy=kt.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.1))
    model.fit(batches, epochs=1, verbose=0)
    ```
    """
    q = check_sampling_rate(sampling_rate)
    data = _in_memory(dataset)
    n = int(tf.shape(tf.nest.flatten(data)[0])[0])
    if n == 0:
        raise ValueError("`dataset` has no examples. Received: dataset of 0 examples")
    if max_batch_size is None:
        max_batch_size = default_max_batch_size(n, q)
    max_batch_size = validation.positive_int(max_batch_size, "max_batch_size")
    if steps is None:
        steps = max(1, round(1 / q))
    steps = validation.positive_int(steps, "steps")
    seed = noise.check_seed(seed)

    def draw(key):
        key = tf.stack([key, tf.constant(0, tf.int64)])
        chosen = tf.random.stateless_uniform([n], key) < q
        picked = tf.random.experimental.stateless_shuffle(
            tf.where(chosen)[:, 0], tf.random.experimental.stateless_fold_in(key, 1)
        )[:max_batch_size]
        count = tf.shape(picked)[0]
        batch = tf.nest.map_structure(lambda t: _padded(tf.gather(t, picked), max_batch_size), data)
        mask = tf.range(max_batch_size) < count
        return (*batch, mask)

    keys = tf.data.Dataset.random(seed=seed, rerandomize_each_iteration=True).take(steps)
    return keys.map(draw, deterministic=True)


def _in_memory(dataset):
    """`(x, y)` as tensors with the examples on the first axis."""
    if isinstance(dataset, tf.data.Dataset):
        spec = dataset.element_spec
        if not isinstance(spec, tuple) or len(spec) != 2:
            raise ValueError(
                "poisson_batches needs unbatched `(x, y)` examples (no sample "
                f"weights: DPSGD refuses them). Received: element_spec={spec}"
            )
        cardinality = int(dataset.cardinality())
        if cardinality < 0:
            raise ValueError(
                "poisson_batches needs a finite dataset of known size. "
                f"Received: dataset.cardinality()={cardinality}"
            )
        return dataset.batch(max(cardinality, 1)).get_single_element()
    if not isinstance(dataset, (tuple, list)) or len(dataset) != 2:
        raise ValueError(
            "`dataset` must be a tf.data.Dataset of (x, y) examples or a "
            f"tuple (x, y) of arrays. Received: dataset of type {type(dataset).__name__}"
        )
    return tuple(tf.nest.map_structure(tf.convert_to_tensor, tuple(dataset)))


def _padded(tensor, size):
    count = tf.shape(tensor)[0]
    padding = [[0, size - count]] + [[0, 0]] * (tensor.shape.rank - 1)
    out = tf.pad(tensor, padding)
    return tf.ensure_shape(out, [size] + tensor.shape.as_list()[1:])


def _round_up(value, multiple):
    return int(math.ceil(value / multiple) * multiple)


def _log_choose(n, k):
    from math import lgamma

    return np.array([lgamma(n + 1) - lgamma(j + 1) - lgamma(n - j + 1) for j in np.atleast_1d(k)])
