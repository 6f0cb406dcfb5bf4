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

from __future__ import annotations

import math
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from keras_tapeops import fit_callbacks
from keras_tapeops import validation
from keras_tapeops.privacy import seeds
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
    log_pmf = _log_choose(n, k) + k * math.log(q) + (n - k) * math.log1p(-q)
    return float(np.exp(log_pmf).sum())


def poisson_batches(
    dataset: tf.data.Dataset | tuple[Any, Any],
    sampling_rate: float,
    seed: int | None = None,
    max_batch_size: int | None = None,
    steps: int | None = None,
    model: keras.Model | None = None,
) -> tf.data.Dataset:
    """Poisson-sampled, padded batches `(x, y, mask)` for `fit` with `kt.DPSGD`.

    Each pass over the returned dataset (one `fit` epoch) draws new batches.
    Batch `i` of a pass is drawn from the key `(seed, pass key, i)`:

    - with `model`, the pass key is `model.optimizer.iterations` when the
      pass starts. That counter is saved with the model's weights, so a run
      resumed from a checkpoint (`keras.callbacks.BackupAndRestore`, or
      `load_model` and `fit` again) draws exactly the batches the
      uninterrupted run drew at the same step, never the first epoch's again;
    - without `model`, the pass key counts the passes over this dataset object
      in this process (0, 1, 2, ...): a new process starts again at 0, so a
      run resumed with the same `seed` replays the first epoch's batches.
      Pass `model=` (or `seed=None`) when training may be resumed.

    Args:
        dataset: the training examples: an unbatched, finite
            `tf.data.Dataset` of `(x, y)` pairs, or a tuple `(x, y)` of
            arrays (x and y may be nested structures with the examples on
            the first axis; all of the same length). It is held in memory.
        sampling_rate: the probability q that an example is in a batch, in
            (0, 1].
        seed: None (a fresh random seed drawn from the operating system) or
            a non-negative int: the same seed gives the same batches.
        max_batch_size: the padded batch size M (default: mean + 7 standard
            deviations of the batch size, rounded up to a multiple of 8).
        steps: batches per epoch (default `round(1 / q)`: one pass over the
            data in expectation).
        model: None, or the model that trains on the batches (its optimizer's
            step counter keys each epoch's draw, see above).

    Returns:
        A `tf.data.Dataset` of `(x, y, mask)`: `M` rows each, `mask` a bool
        `[M]` vector marking the sampled examples.

    Example:
    ```python
    model.compile(optimizer="sgd", loss="categorical_crossentropy",
                  differential_privacy=kt.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.1))
    batches = kt.privacy.poisson_batches((x, y), sampling_rate=0.25, seed=0, model=model)
    model.fit(batches, epochs=1, shuffle=False, verbose=0)
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
    seed = seeds.check_seed(seed)
    if seed is None:
        seed = seeds.fresh_seed()
    if model is not None and not hasattr(model, "optimizer"):
        raise ValueError(
            "`model` must be the Keras model that trains on the batches. "
            f"Received: model of type {type(model).__name__}"
        )
    seed_key = tf.constant(seeds.seed_halves(seed), tf.int64)
    clock = _PassClock(model)

    def draw(pass_key, index):
        key = tf.random.experimental.stateless_fold_in(seed_key, pass_key, alg="philox")
        key = tf.random.experimental.stateless_fold_in(key, index, alg="philox")
        chosen = tf.random.stateless_uniform([n], key, alg="philox") < q
        picked = tf.random.experimental.stateless_shuffle(
            tf.where(chosen)[:, 0],
            tf.random.experimental.stateless_fold_in(key, 1, alg="philox"),
            alg="philox",
        )[:max_batch_size]
        count = tf.shape(picked)[0]
        batch = tf.nest.map_structure(lambda t: _padded(tf.gather(t, picked), max_batch_size), data)
        mask = tf.range(max_batch_size) < count
        return (*batch, mask)

    def one_pass(_):
        # Runs once per pass, when its first batch is drawn.
        pass_key = tf.py_function(clock.next_key, [], tf.int64)
        pass_key = tf.ensure_shape(pass_key, [])
        return tf.data.Dataset.range(steps).map(lambda index: draw(pass_key, index))

    batches = tf.data.Dataset.range(1).flat_map(one_pass)
    batches = batches.apply(tf.data.experimental.assert_cardinality(steps))
    if model is not None:
        batches = fit_callbacks.attach(batches, lambda: _EpochClock(clock))
    return batches


class _PassClock:
    """The key of each pass over a `poisson_batches` dataset (see there).

    Args:
        model: None (count the passes) or the training model (read its
            optimizer's step counter).
    """

    def __init__(self, model):
        self._model = model
        self._passes = 0
        self.epoch_key = None  # set by `_EpochClock` while `fit` runs

    def step(self):
        """The model's optimizer step count now (0 without an optimizer)."""
        optimizer = getattr(self._model, "optimizer", None)
        return 0 if optimizer is None else int(optimizer.iterations.numpy())

    def next_key(self):
        """The key of the pass that starts now (an int64 NumPy scalar).

        With a model, inside `TapeOpsMixin.fit` it is the step count when the
        epoch began (`_EpochClock`): tf.data may run this function late (its
        prefetch thread, after the epoch's first steps), so reading the
        counter here would make the batches depend on thread timing.
        """
        if self._model is not None:
            key = self.epoch_key if self.epoch_key is not None else self.step()
            return np.int64(key)
        key, self._passes = self._passes, self._passes + 1
        return np.int64(key)


class _EpochClock(keras.callbacks.Callback):
    """Records the optimizer's step count when each epoch begins (`_PassClock.epoch_key`).

    `TapeOpsMixin.fit()` adds it (before the user's callbacks) when `x` is a
    `poisson_batches(model=...)` dataset. `BackupAndRestore` restores the
    counter in `on_train_begin`, before the first `on_epoch_begin`.
    """

    def __init__(self, clock):
        super().__init__()
        self._clock = clock

    def on_epoch_begin(self, epoch, logs=None):
        self._clock.epoch_key = self._clock.step()

    def on_train_end(self, logs=None):
        self._clock.epoch_key = None


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
    x, y = tuple(tf.nest.map_structure(tf.convert_to_tensor, tuple(dataset)))
    _check_lengths(x, y)
    return x, y


def _check_lengths(x, y):
    """Raises ValueError unless every array of x and y has the same number of examples."""

    def lengths(structure):
        return sorted(
            {None if t.shape.rank == 0 else int(t.shape[0]) for t in tf.nest.flatten(structure)},
            key=str,
        )

    x_lengths, y_lengths = lengths(x), lengths(y)
    if len(x_lengths) != 1 or x_lengths != y_lengths or x_lengths[0] is None:

        def describe(found):
            return " or ".join("no example axis" if v is None else str(v) for v in found)

        raise ValueError(
            "poisson_batches needs x and y with the same number of examples "
            "(the first axis of every array). Received: x has "
            f"{describe(x_lengths)} samples and y has {describe(y_lengths)}"
        )


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
