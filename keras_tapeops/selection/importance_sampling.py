"""`kt.ImportanceSampling`: sampling by loss or gradient-norm bound, unbiased.

Katharopoulos & Fleuret 2018.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from keras_tapeops import validation
from keras_tapeops.paths import LayerTree
from keras_tapeops.per_example import per_example_losses
from keras_tapeops.registration import register
from keras_tapeops.selection import batch as batches
from keras_tapeops.selection.base import SelectionOption
from keras_tapeops.selection.base import SelectionState
from keras_tapeops.selection.base import fraction_argument
from keras_tapeops.selection.randomness import StepSeeds
from keras_tapeops.selection.randomness import seed_argument

SCORES = ("loss", "gradient_bound")


@register
class ImportanceSampling(SelectionOption):
    """Draws k examples with probability q_i and reweights them by 1 / (n q_i).

    q_i = (1 - smoothing) * s_i / sum(s) + smoothing / n, where s_i is the
    example's loss (`score="loss"`) or the norm of the loss's gradient with
    respect to the model's outputs (`score="gradient_bound"`, the upper bound
    of Katharopoulos & Fleuret, from the scoring pass: no backward pass
    through the weights). k = ceil(fraction * n) indices are drawn with
    replacement (inverse-CDF sampling from stateless uniforms, so it
    compiles under `jit_compile=True`, where XLA's generator gives other
    draws than graph mode for the same seed; an empty batch draws nothing
    and does not advance the seed) and each kept example's sample weight is
    multiplied by 1 / (n q_i): the expected gradient equals the whole batch's gradient
    (for the default mean reduction; loss terms see the kept examples,
    unweighted).

    Args:
        fraction: k / n, in (0, 1].
        score: `"loss"` or `"gradient_bound"`.
        smoothing: share of the uniform distribution mixed in, in [0, 1]
            (> 0 keeps every example reachable).
        seed: None (random) or an int for reproducible draws.

    Returns:
        An option for `compile(sample_selection=...)`.

    Example:
    ```python
    import keras, numpy as np, keras_tapeops as kt
    model = kt.upgrade(keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]))
    model.compile(optimizer="sgd", loss="mse",
                  sample_selection=kt.ImportanceSampling(fraction=0.5, score="gradient_bound"))
    model.fit(np.random.rand(16, 4), np.zeros((16, 1)), batch_size=8, verbose=0)
    ```
    """

    def __init__(
        self,
        fraction: float = 0.25,
        score: str = "loss",
        smoothing: float = 0.1,
        seed: int | None = None,
    ) -> None:
        self.fraction = fraction_argument(fraction)
        self.score = validation.choice(score, "score", SCORES)
        self.smoothing = validation.non_negative_number(smoothing, "smoothing")
        if self.smoothing > 1.0:
            raise ValueError(f"`smoothing` must be in [0, 1]. Received: smoothing={smoothing!r}")
        self.seed = seed_argument(seed)

    def bind(self, model: keras.Model, tree: LayerTree) -> ImportanceSamplingState:
        return ImportanceSamplingState(self)

    def get_config(self) -> dict[str, Any]:
        return {
            "fraction": self.fraction,
            "score": self.score,
            "smoothing": self.smoothing,
            "seed": self.seed,
        }


class ImportanceSamplingState(SelectionState):
    def __init__(self, option):
        super().__init__(option.fraction)
        self.option = option
        self.seeds = StepSeeds(option.seed)
        self.variables.append(self.seeds.counter)

    def scores(self, model, y, sample_weight, losses, y_pred):
        if self.option.score == "loss":
            return tf.maximum(losses, 0.0)
        outputs = tf.nest.flatten(y_pred)
        with tf.GradientTape() as tape:
            tape.watch(outputs)
            packed = tf.nest.pack_sequence_as(y_pred, outputs)
            total = tf.reduce_sum(per_example_losses(model, y, packed, sample_weight))
        grads = tape.gradient(total, outputs)
        # Summed over every axis but the first (a reshape to [n, -1] cannot
        # infer its size for an empty batch).
        squares = [
            tf.reduce_sum(tf.square(tf.cast(g, "float32")), axis=list(range(1, g.shape.rank)))
            if g.shape.rank > 1
            else tf.square(tf.cast(g, "float32"))
            for g in grads
            if g is not None
        ]
        return tf.sqrt(tf.add_n(squares))

    def probabilities(self, scores):
        n = tf.cast(tf.shape(scores)[0], "float32")
        total = tf.reduce_sum(scores)
        share = tf.where(total > 0, scores / tf.where(total > 0, total, 1.0), 1.0 / n)
        a = self.option.smoothing
        return (1.0 - a) * share + a / n

    def select(self, model, x, y, sample_weight, losses, ids, y_pred):
        q = self.probabilities(self.scores(model, y, sample_weight, losses, y_pred))
        n = tf.shape(q)[0]
        k = batches.kept_count(self.schedule_variable, n)
        indices = draw_with_replacement(q, k, self.seeds.next(advance=n > 0))
        weights = 1.0 / (tf.cast(n, "float32") * tf.gather(q, indices))
        return indices, weights


def draw_with_replacement(probabilities, k, seed):
    """`k` indices drawn with replacement, index i with probability `probabilities[i]`.

    Inverse-CDF sampling with stateless uniforms: `u ~ U[0, total)`, the
    index is the first one whose cumulative sum exceeds `u`. Unlike
    `tf.random.stateless_categorical` it compiles under XLA and accepts an
    empty batch (`k = 0` draws nothing).

    Args:
        probabilities: float32 `[n]`, non-negative (need not sum to one).
        k: int32 scalar, the number of draws.
        seed: `[2]` int64 seed of `tf.random.stateless_uniform`.

    Returns:
        int32 `[k]` indices in `[0, n)`.
    """
    cumulative = tf.cumsum(tf.cast(probabilities, "float32"))
    # The scale is the running sum's last value (0 for an empty batch), not
    # `reduce_sum`: in float32 the two differ, and draws past the running
    # sum would all land on the last index (with q = [1, 1e-8 x 4000] the
    # last example was drawn about 4e-5 of the time instead of 1e-8).
    total = tf.reduce_sum(cumulative[-1:])
    uniform = tf.random.stateless_uniform(tf.reshape(k, [1]), seed, dtype="float32")
    indices = tf.searchsorted(cumulative, uniform * total, side="right", out_type="int32")
    # u * total rounds up to total at worst: clamp to the last index.
    n = tf.shape(probabilities)[0]
    return tf.minimum(indices, tf.maximum(n - 1, 0))
