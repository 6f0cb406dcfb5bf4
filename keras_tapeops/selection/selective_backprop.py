"""`kt.SelectiveBackprop`: probabilistic selection by loss percentile (Jiang et al. 2019)."""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from keras_tapeops import validation
from keras_tapeops.paths import LayerTree
from keras_tapeops.registration import register
from keras_tapeops.selection import batch as batches
from keras_tapeops.selection.base import SelectionOption
from keras_tapeops.selection.base import SelectionState
from keras_tapeops.selection.base import fraction_argument
from keras_tapeops.selection.randomness import StepSeeds
from keras_tapeops.selection.randomness import seed_argument


@register
class SelectiveBackprop(SelectionOption):
    """Keeps examples with probability percentile(loss)^beta, at a fixed batch size.

    Jiang et al. keep example i with probability `p_i = P(loss_i)^beta`,
    where `P(loss_i)` is the share of the last `history_size` losses that
    are <= loss_i (the current batch's losses are added to the history
    first). To keep the step's shapes fixed, each call keeps exactly
    k = ceil(fraction * batch) examples, drawn without replacement with
    probabilities proportional to `p_i` (Gumbel top-k): the first draw picks
    i with probability `p_i / sum(p)`. `fraction` defaults to `1 / (1 + beta)`,
    the expected kept share of Jiang et al.'s Bernoulli rule when the
    percentiles are uniform.

    Args:
        beta: the selectivity exponent (> 0; larger keeps fewer low losses).
        history_size: number of recent losses the percentile is taken over.
        fraction: share of each batch kept, in (0, 1], or None for
            `1 / (1 + beta)`.
        seed: None (random) or an int for reproducible draws.

    Returns:
        An option for `compile(sample_selection=...)`.

    Example:
    ```python
    import keras, numpy as np, keras_tapeops as kt
    model = kt.upgrade(keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]))
    model.compile(optimizer="sgd", loss="mse", sample_selection=kt.SelectiveBackprop(beta=1.0))
    model.fit(np.random.rand(16, 4), np.zeros((16, 1)), batch_size=8, verbose=0)
    ```
    """

    def __init__(
        self,
        beta: float = 1.0,
        history_size: int = 1024,
        fraction: float | None = None,
        seed: int | None = None,
    ) -> None:
        self.beta = validation.positive_number(beta, "beta")
        self.history_size = validation.positive_int(history_size, "history_size")
        self.fraction = None if fraction is None else fraction_argument(fraction)
        self.seed = seed_argument(seed)

    @property
    def kept_fraction(self) -> float:
        return self.fraction if self.fraction is not None else 1.0 / (1.0 + self.beta)

    def bind(self, model: keras.Model, tree: LayerTree) -> SelectiveBackpropState:
        return SelectiveBackpropState(self)

    def get_config(self) -> dict[str, Any]:
        return {
            "beta": self.beta,
            "history_size": self.history_size,
            "fraction": self.fraction,
            "seed": self.seed,
        }


class SelectiveBackpropState(SelectionState):
    """Loss history (a ring buffer) and the per-step draws."""

    def __init__(self, option):
        super().__init__(option.kept_fraction)
        self.beta = option.beta
        self.seeds = StepSeeds(option.seed)
        first_replica = tf.VariableAggregation.ONLY_FIRST_REPLICA
        self.history = tf.Variable(
            tf.zeros([option.history_size]),
            trainable=False,
            name="selection_loss_history",
            aggregation=first_replica,
        )
        self.seen = tf.Variable(
            0,
            dtype="int64",
            trainable=False,
            name="selection_losses_seen",
            aggregation=first_replica,
        )
        self.variables += [self.history, self.seen, self.seeds.counter]

    def keep_probabilities(self, losses):
        """Adds the finite `losses` to the history; returns `P(loss_i)^beta` (float32 `[n]`).

        A non-finite loss (a NaN example) is not written to the history (it
        would stay there for `history_size` losses) and gets keep probability
        0 (no loss in the history is <= nan); an empty batch writes nothing.
        """
        losses = tf.cast(losses, "float32")
        size = tf.shape(self.history, out_type="int64")[0]
        finite = tf.math.is_finite(losses)
        written = tf.cast(finite, "int64")
        seen = self.seen.read_value()
        # Finite losses take consecutive ring slots; the others go to a spare
        # slot past the end, dropped below.
        slots = tf.where(finite, tf.math.floormod(seen + tf.cumsum(written) - 1, size), size)
        padded = tf.concat([self.history.read_value(), tf.zeros([1])], axis=0)
        history = tf.tensor_scatter_nd_update(
            padded, slots[:, None], tf.where(finite, losses, 0.0)
        )[:-1]
        count = tf.reduce_sum(written)
        with tf.control_dependencies([history]):
            self.history.assign(history)
            self.seen.assign_add(count)
        valid = tf.minimum(seen + count, size)
        mask = tf.cast(tf.range(size) < valid, "float32")
        below = tf.cast(history[None, :] <= losses[:, None], "float32") * mask[None, :]
        percentile = tf.math.divide_no_nan(tf.reduce_sum(below, axis=1), tf.cast(valid, "float32"))
        return tf.pow(percentile, self.beta)

    def select(self, model, x, y, sample_weight, losses, ids, y_pred):
        p = self.keep_probabilities(losses)
        n = tf.shape(losses)[0]
        k = batches.kept_count(self.schedule_variable, n)
        uniform = tf.random.stateless_uniform(
            tf.shape(p), self.seeds.next(advance=n > 0), minval=1e-12, maxval=1.0
        )
        gumbel = -tf.math.log(-tf.math.log(uniform))
        keys = tf.math.log(tf.maximum(p, 1e-30)) + gumbel
        return tf.sort(tf.math.top_k(keys, k=k, sorted=False).indices), None
