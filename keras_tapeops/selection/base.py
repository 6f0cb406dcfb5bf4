"""The `sample_selection` option and its engine: score, keep, step on the kept.

Every selection method is a `SelectionOption` (immutable config given to
`compile(sample_selection=...)`) whose `bind` returns a `SelectionState`,
the model's engine. The engine replaces the single forward/backward pass:

1. one forward pass of the whole (candidate) batch without a tape, in
   inference mode (`training=False`: no dropout noise, BatchNormalization
   uses its moving statistics), and the compiled loss per example
   (`keras_tapeops.per_example.per_example_losses`: sample and class
   weights applied);
2. the method's `select(...)` returns the indices to keep (a fixed number k
   per call) and optional per-example weights;
3. the stock forward/backward pass (`single_pass_gradients`: loss terms,
   regularization, loss logging, mixed precision loss scaling, replica
   scaling) runs on the kept examples only, their weights multiplying the
   sample weights.

Semantics: selection is per replica under `tf.distribute` and per
micro-batch with `micro_batches` (each slice the step differentiates keeps
its own top k); loss terms see the kept examples; compiled metrics see the
whole candidate batch (inference-mode predictions). Logged diagnostics:
`selection_fraction` (kept / candidates), `selection_kept_loss` and
`selection_batch_loss` (mean per-example loss of the kept examples and of
all candidates, from the scoring pass).
"""

import keras
import tensorflow as tf

from keras_tapeops._keras import private
from keras_tapeops import validation
from keras_tapeops.replicas import batch_size
from keras_tapeops.multi_gradient import MultiGradientOption
from keras_tapeops.multi_gradient import MultiGradientState
from keras_tapeops.per_example import per_example_losses
from keras_tapeops.selection import batch as batches

# Options a selection composes with (besides the options outside the
# multi-gradient family, which always compose).
_REASONS = {
    "differential_privacy": (
        "which examples contribute depends on the whole batch's losses, so "
        "the privacy analysis of DP-SGD no longer holds"
    ),
    "task_balancing": (
        "task balancing reweights per-task gradients of the whole batch; "
        "selecting examples by their total loss first is not defined"
    ),
    "sharpness_aware": (
        "SAM's second gradient would be taken on a batch selected at other "
        "weights"
    ),
}


def fraction_argument(value, name="fraction"):
    """A float in (0, 1], else ValueError with "Received:"."""
    value = validation.finite_number(value, name)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"`{name}` must be in (0, 1]. Received: {name}={value!r}")
    return value


class SelectionOption(MultiGradientOption):
    """Base class of the `compile(sample_selection=...)` methods."""

    option_name = "sample_selection"

    def combines_with(self, name, value):
        return _REASONS.get(name, "both change how one batch becomes one gradient")


class SelectionState(MultiGradientState):
    """A model's selection engine (see the module docstring).

    Args:
        value: the initial value of the engine's `schedule_variable` (the
            fraction kept, or a threshold) that
            `kt.callbacks.SelectionSchedule` assigns; None for none.
        value_name: the name of that value, for messages.
    """

    def __init__(self, value=None, value_name="fraction"):
        super().__init__()
        self.value_name = value_name
        self.schedule_variable = None
        if value is not None:
            self.schedule_variable = tf.Variable(
                float(value), dtype="float32", trainable=False,
                name=f"selection_{value_name}",
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
            )
            self.variables.append(self.schedule_variable)
        self.metrics = {
            "selection_fraction": keras.metrics.Mean(name="selection_fraction"),
            "selection_kept_loss": keras.metrics.Mean(name="selection_kept_loss"),
            "selection_batch_loss": keras.metrics.Mean(name="selection_batch_loss"),
        }

    # ---------------------------------------------------------- the method
    def select(self, model, x, y, sample_weight, losses, ids, y_pred):
        """Returns `(indices, weights)`: int32 `[k]` rows to keep, float32 `[k]` or None.

        Args:
            losses: the `[batch]` per-example losses of the scoring pass.
            ids: the example ids (`kt.ReducibleLoss`), else None.
            y_pred: the scoring pass's predictions.

        `indices=None` keeps every example in order (reweighting only).
        """
        raise NotImplementedError

    def split_inputs(self, x):
        """`(x_for_the_model, ids)`; only `kt.ReducibleLoss` reads ids."""
        return x, None

    def scoring_predictions(self, model, x):
        """The forward pass that scores the candidates (no tape, inference mode)."""
        return tf.stop_gradient(private.call_model(model, x, training=False))

    # ---------------------------------------------------------- the engine
    def batch_gradients(self, model, x, y, sample_weight, loss_multiplier=None):
        x, ids = self.split_inputs(x)
        y_pred = self.scoring_predictions(model, x)
        losses = tf.stop_gradient(per_example_losses(model, y, y_pred, sample_weight))
        indices, weights = self.select(model, x, y, sample_weight, losses, ids, y_pred)
        n = batch_size(x)
        if indices is None:
            kept_x, kept_y, kept_w, kept_losses = x, y, sample_weight, losses
        else:
            kept_x = batches.gather(x, indices)
            kept_y = batches.gather(y, indices)
            kept_w = batches.gather(sample_weight, indices)
            kept_losses = tf.gather(losses, indices)
        if weights is not None:
            kept_w = weights if kept_w is None else _times(kept_w, weights)
        self._log(n, tf.shape(kept_losses)[0], losses, kept_losses,
                  weights if indices is None else None)
        grads, _ = model.single_pass_gradients(kept_x, kept_y, kept_w, loss_multiplier)
        return grads, y_pred

    def _log(self, n, k, losses, kept_losses, weights):
        """Logs the diagnostics; `weights` only for reweighting without selection.

        Each non-empty batch counts once in the epoch's means; an empty batch
        (zero candidates) adds nothing, as it adds nothing to stock Keras's
        logged loss (its means over zero examples would be nan).
        """
        present = tf.cast(n > 0, "float32")
        if weights is not None:
            # Reweighting: the weighted share of the batch that trains.
            share = tf.reduce_sum(weights) / tf.cast(tf.maximum(n, 1), "float32")
            # The weighted mean: what the weights keep.
            kept_loss = tf.math.divide_no_nan(
                tf.reduce_sum(weights * kept_losses), tf.reduce_sum(weights)
            )
        else:
            share = tf.cast(k, "float32") / tf.cast(tf.maximum(n, 1), "float32")
            kept_loss = _mean_or_zero(kept_losses)
        self.metrics["selection_fraction"].update_state(share, sample_weight=present)
        self.metrics["selection_batch_loss"].update_state(
            _mean_or_zero(losses), sample_weight=present
        )
        self.metrics["selection_kept_loss"].update_state(kept_loss, sample_weight=present)


def _mean_or_zero(values):
    """The mean of a `[m]` tensor, 0 when `m = 0` (not nan)."""
    count = tf.cast(tf.shape(values)[0], "float32")
    return tf.math.divide_no_nan(tf.reduce_sum(values), count)


def _times(sample_weight, weights):
    """Sample weights (a tensor or a structure per output) times `[k]` weights."""
    def one(w):
        if w is None:
            return None
        w = tf.cast(w, "float32")
        extra = w.shape.rank - 1 if w.shape.rank is not None else 0
        return w * tf.reshape(weights, [-1] + [1] * max(extra, 0))
    return tf.nest.map_structure(one, sample_weight)
