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

Extension point: a user rule subclasses `SelectionRule` and implements one
method, `select(losses, context) -> [batch] weights` (see
`docs/extending.md`); `SelectionOption`/`SelectionState` are the
library's own machinery and need not be touched.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from keras_tapeops._keras import private
from keras_tapeops import validation
from keras_tapeops.paths import LayerTree
from keras_tapeops.replicas import batch_size
from keras_tapeops.multi_gradient import MultiGradientOption
from keras_tapeops.multi_gradient import MultiGradientState
from keras_tapeops.multi_gradient import require_override
from keras_tapeops.per_example import per_example_losses
from keras_tapeops.selection import batch as batches
from keras_tapeops.typing_aliases import Nested

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
        "SAM's second gradient would be taken on a batch selected at other weights"
    ),
}


def fraction_argument(value, name="fraction"):
    """A float in (0, 1], else ValueError with "Received:"."""
    value = validation.finite_number(value, name)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"`{name}` must be in (0, 1]. Received: {name}={value!r}")
    return value


class SelectionOption(MultiGradientOption):
    """Base class of the `compile(sample_selection=...)` methods (internal).

    A user-defined rule subclasses `SelectionRule` instead: it needs no
    engine of its own.
    """

    option_name = "sample_selection"

    def combines_with(self, name: str, value: Any) -> str | None:
        return _REASONS.get(name, "both change how one batch becomes one gradient")


class SelectionDiagnostics(keras.metrics.Metric):
    """The three logged selection diagnostics, each the epoch's mean, as one metric.

    `selection_fraction`, `selection_kept_loss` and `selection_batch_loss`
    are what three `keras.metrics.Mean` would log (the same sums, the same
    division), from one `[3]` total and one count: two variable updates a
    step instead of six. On `bench/selection.py`'s ReducibleLoss step, which
    keeps 32 of 320 candidates, the three Means were about 50 of the step
    graph's 370 ops and 2-5% of its time. `result()` returns the three by
    name, which Keras logs as three entries.
    """

    NAMES = ("selection_fraction", "selection_kept_loss", "selection_batch_loss")

    def __init__(self, name: str = "selection_diagnostics", dtype: Any = None) -> None:
        super().__init__(name=name, dtype=dtype)
        self.totals = self.add_variable(
            shape=(len(self.NAMES),), initializer="zeros", name="totals"
        )
        self.count = self.add_variable(shape=(), initializer="zeros", name="count")

    def update_state(self, fraction, kept_loss, batch_loss, present):
        """Adds one batch's three values, weighted by `present` (0 for an empty batch)."""
        values = tf.cast(tf.stack([fraction, kept_loss, batch_loss]), self.dtype)
        present = tf.cast(present, self.dtype)
        self.totals.assign_add(values * present)
        self.count.assign_add(present)

    def result(self):
        means = tf.math.divide_no_nan(self.totals, self.count)
        return {name: means[i] for i, name in enumerate(self.NAMES)}


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
                float(value),
                dtype="float32",
                trainable=False,
                name=f"selection_{value_name}",
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
            )
            self.variables.append(self.schedule_variable)
        self.diagnostics = SelectionDiagnostics()
        self.metrics = {name: self.diagnostics for name in SelectionDiagnostics.NAMES}

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
        self._log(
            n, tf.shape(kept_losses)[0], losses, kept_losses, weights if indices is None else None
        )
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
        self.diagnostics.update_state(share, kept_loss, _mean_or_zero(losses), present)


class SelectionContext:
    """What a `SelectionRule` sees, besides the per-example losses.

    Attributes:
        model: the model being trained.
        x: the candidate batch's inputs (the model's inputs).
        y: its targets, or None.
        sample_weight: its sample weights (already in `losses`), or None.
        y_pred: the scoring pass's predictions (inference mode, no tape).
        step: the optimizer's applied-step count (int64 tensor).
    """

    def __init__(
        self,
        model: keras.Model,
        x: Nested,
        y: Nested,
        sample_weight: Nested,
        y_pred: Nested,
        step: tf.Tensor,
    ) -> None:
        self.model = model
        self.x = x
        self.y = y
        self.sample_weight = sample_weight
        self.y_pred = y_pred
        self.step = step


class SelectionRule(SelectionOption):
    """Public base of a user-defined `compile(sample_selection=...)` rule.

    Implement one method, `select(losses, context)`, returning one float
    weight per candidate example. An example whose weight is `<= 0` (or not
    finite) is left out of the step; every other example trains with its
    sample weight multiplied by its weight. The forward and backward pass run
    on the kept examples only, so with Keras's default reduction the step's
    loss is `sum(weight * loss) / kept`: weights of 1 on the top half of the
    batch is exactly `kt.TopLoss(0.5)`, and weights of 1 everywhere the stock
    step. The scoring pass, logging (`selection_fraction`,
    `selection_kept_loss`, `selection_batch_loss`), loss terms, mixed
    precision, micro-batches and distribution (selection per replica) are the
    library's, as for `kt.TopLoss`.

    A rule is immutable configuration: validate arguments in `__init__` and
    return them from `get_config()` (the default `from_config` calls
    `cls(**config)`); register the class with
    `keras.saving.register_keras_serializable` so `load_model` restores it.

    Example:
    ```python
    import keras
    import numpy as np
    import tensorflow as tf
    import keras_tapeops as kt
    from keras_tapeops.selection import SelectionRule

    @keras.saving.register_keras_serializable(package="my_rules")
    class AboveMean(SelectionRule):
        def select(self, losses, context):
            return tf.cast(losses >= tf.reduce_mean(losses), "float32")

    model = kt.upgrade(keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]))
    model.compile(optimizer="sgd", loss="mse", sample_selection=AboveMean())
    model.fit(np.random.rand(16, 4), np.random.rand(16, 1), batch_size=8, verbose=0)
    ```
    """

    def select(self, losses: tf.Tensor, context: SelectionContext) -> tf.Tensor:
        """The per-example weights of the candidate batch.

        Args:
            losses: `[batch]` float32 per-example compiled losses of the
                scoring pass (sample and class weights applied; no gradient).
            context: a `SelectionContext` (model, x, y, sample_weight,
                y_pred, step).

        Returns:
            A `[batch]` float tensor: 0 (or less) leaves an example out, a
            positive value keeps it with that weight.
        """
        raise NotImplementedError(
            f"{type(self).__name__} must implement select(losses, context) -> [batch] weights."
        )

    def bind(self, model: keras.Model, tree: LayerTree) -> SelectionRuleState:
        require_override(
            self,
            "SelectionRule",
            "select(losses, context)",
            SelectionRule.select,
            "returns one weight per example (0 leaves it out)",
            "sample_selection",
        )
        return SelectionRuleState(self)


class SelectionRuleState(SelectionState):
    """The engine of a `SelectionRule`: keeps the examples of positive weight."""

    def __init__(self, rule):
        super().__init__()
        self.rule = rule

    def select(self, model, x, y, sample_weight, losses, ids, y_pred):
        optimizer = getattr(model, "optimizer", None)
        step = optimizer.iterations if optimizer is not None else tf.constant(0, tf.int64)
        context = SelectionContext(model, x, y, sample_weight, y_pred, step)
        name = type(self.rule).__name__
        weights = self.rule.select(losses, context)
        if weights is None:
            raise ValueError(
                f"{name}.select(losses, context) must return a [batch] tensor of "
                "per-example weights. Received: None"
            )
        weights = tf.cast(tf.convert_to_tensor(weights), "float32")
        if weights.shape.rank is not None and weights.shape.rank != 1:
            raise ValueError(
                f"{name}.select(losses, context) must return a [batch] tensor of "
                f"per-example weights (rank 1). Received: shape={weights.shape}"
            )
        if (
            weights.shape[0] is not None
            and losses.shape[0] is not None
            and (weights.shape[0] != losses.shape[0])
        ):
            raise ValueError(
                f"{name}.select(losses, context) must return one weight per "
                f"example ({losses.shape[0]}). Received: shape={weights.shape}"
            )
        indices = tf.cast(tf.reshape(tf.where(weights > 0.0), [-1]), "int32")
        return indices, tf.gather(weights, indices)


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
