"""`evaluate_robustness`: clean and adversarial loss and accuracy of a classifier."""

from __future__ import annotations

from typing import Any
import weakref

import keras
import numpy as np
import tensorflow as tf

from keras_tapeops._keras import private
from keras_tapeops import replicas
from keras_tapeops import second_order
from keras_tapeops import validation
from keras_tapeops.attacks import objectives
from keras_tapeops.attacks.base import Attack
from keras_tapeops.attacks.base import check_attack


def evaluate_robustness(
    model: keras.Model,
    data: tf.data.Dataset | tuple[Any, ...],
    attack: Attack,
    batch_size: int | None = None,
) -> dict[str, float]:
    """Returns clean and robust (under `attack`) loss and accuracy over `data`.

    Each batch is attacked at the model's current weights (inference mode),
    then the model is evaluated on the clean and on the adversarial batch.
    Accuracy is the sample-weighted fraction of correct predictions: arg-max
    against integer labels or one-hot targets, or `p > 0.5` for a single
    output unit. The loss is the compiled loss (else the attack's `loss`),
    averaged over batches weighted by their size, as `evaluate()` reports it.
    The batch function is traced once per call.

    Args:
        model: a single-output classifier, compiled with a loss unless the
            attack has its own `loss`.
        data: a finite `tf.data.Dataset` of `(x, y[, sample_weight])`
            batches, or a tuple `(x, y[, sample_weight])` of arrays.
        attack: a `kt.attacks` attack (a seeded random start keys its draw
            by the batch's index, so the result is deterministic).
        batch_size: for a tuple: None (one batch) or a positive int.

    Returns:
        A dict of Python floats: `loss`, `accuracy`, `robust_loss`,
        `robust_accuracy`.

    Example:
    ```python
    attack = kt.attacks.PGD(0.1, steps=10, clip=(0.0, 1.0), seed=0)
    kt.attacks.evaluate_robustness(model, (x, y), attack, batch_size=32)
    # {'loss': ..., 'accuracy': ..., 'robust_loss': ..., 'robust_accuracy': ...}
    ```
    """
    return RobustnessEvaluator(attack)(model, data, batch_size)


class RobustnessEvaluator:
    """`evaluate_robustness` with its traced batch function kept between calls.

    Used by `kt.callbacks.RobustAccuracy`, which evaluates every epoch.

    Args:
        attack: a `kt.attacks` attack.

    Example:
    ```python
    evaluator = RobustnessEvaluator(kt.attacks.PGD(0.1, steps=20))
    evaluator(model, (x, y), batch_size=64)["robust_accuracy"]
    ```
    """

    def __init__(self, attack):
        self.attack = check_attack(attack)
        self._functions = weakref.WeakKeyDictionary()  # model -> (loss, fn)

    def __call__(self, model, data, batch_size=None):
        if not isinstance(model, keras.Model):
            raise TypeError(f"`model` must be a keras.Model. Received: model={model!r}")
        batches = _batches(data, batch_size)
        function = self._function(model)
        totals = np.zeros(6)
        for index, (x, y, sample_weight) in enumerate(batches()):
            if sample_weight is None:
                sample_weight = tf.ones(tf.shape(tf.nest.flatten(x)[0])[:1])
            values = function(x, y, sample_weight, tf.constant(index, tf.int64))
            totals += np.array([float(v) for v in values])
        n, weight, loss, robust_loss, correct, robust_correct = totals
        return {
            "loss": float(loss / n),
            "accuracy": float(correct / weight),
            "robust_loss": float(robust_loss / n),
            "robust_accuracy": float(robust_correct / weight),
        }

    def _function(self, model):
        loss = private.compiled_loss(model)
        cached = self._functions.get(model)
        if cached is not None and cached[0] is loss:
            return cached[1]
        attack = self.attack
        ref = weakref.ref(model)

        def batch(x, y, sample_weight, index):
            model = ref()
            objective = objectives.loss_objective(model, attack.loss, y)
            x_adv = attack.perturb(model, x, objective, step=index)
            n = tf.cast(tf.shape(sample_weight)[0], tf.float32)
            weight = tf.cast(tf.reshape(sample_weight, [-1]), tf.float32)
            losses, corrects = [], []
            for inputs in (x, x_adv):
                y_pred = private.call_model(model, inputs, training=False)
                losses.append(n * _mean_loss(model, attack.loss, y, y_pred, sample_weight))
                corrects.append(tf.reduce_sum(weight * correct_predictions(y, y_pred)))
            return [n, tf.reduce_sum(weight)] + losses + corrects

        function = tf.function(batch, reduce_retracing=True)
        self._functions[model] = (loss, function)
        return function


def correct_predictions(y, y_pred):
    """1.0 where a classifier's prediction is right, else 0.0: shape `(batch,)`.

    Args:
        y: integer labels `(batch,)`/`(batch, 1)`, one-hot targets, or 0/1
            targets for a single output unit.
        y_pred: the single output tensor `(batch, classes)` or `(batch, 1)`.

    Returns:
        A float32 tensor.
    """
    if tf.nest.is_nested(y_pred):
        raise ValueError(
            "Robust accuracy needs a single-output classifier. Received: "
            f"outputs {tf.nest.map_structure(lambda t: t.shape, y_pred)}"
        )
    y_pred = tf.cast(y_pred, tf.float32)
    if y_pred.shape[-1] == 1:
        predicted = tf.cast(tf.reshape(y_pred, [-1]) > 0.5, tf.float32)
        return tf.cast(tf.equal(predicted, tf.cast(tf.reshape(y, [-1]), tf.float32)), tf.float32)
    predicted = tf.argmax(y_pred, axis=-1, output_type=tf.int64)
    y = tf.convert_to_tensor(y)
    if y.shape.rank == y_pred.shape.rank and y.shape[-1] == y_pred.shape[-1]:
        labels = tf.argmax(y, axis=-1, output_type=tf.int64)
    else:
        labels = tf.cast(tf.reshape(y, [-1]), tf.int64)
    return tf.cast(tf.equal(predicted, labels), tf.float32)


def _mean_loss(model, loss, y, y_pred, sample_weight):
    """The batch loss as `evaluate()` computes it (compiled loss, else `loss`)."""
    # Keras's losses divide by the number of replicas inside a strategy's
    # scope (a callback may run there); undo it: this is one device's value.
    if private.compiled_loss(model) is not None:
        value = replicas.unscale_for_distribution(
            objectives.compiled_loss_value(model, y, y_pred, sample_weight)
        )
    else:
        function = keras.losses.get(loss) if isinstance(loss, str) else loss
        if isinstance(function, keras.losses.Loss):
            value = replicas.unscale_for_distribution(
                function(y, y_pred, sample_weight=sample_weight)
            )
        else:
            per_example = tf.cast(function(y, y_pred), tf.float32)
            weight = tf.cast(tf.reshape(sample_weight, [-1]), tf.float32)
            per_example = tf.reshape(per_example, [tf.shape(weight)[0], -1])
            value = tf.reduce_mean(per_example * weight[:, None])
    return tf.cast(value, tf.float32)


def _batches(data, batch_size):
    """A callable giving `(x, y, sample_weight)` batches of `data`."""
    if batch_size is not None:
        batch_size = validation.positive_int(batch_size, "batch_size")
        if isinstance(data, (tuple, list)) and len(data) in (2, 3):
            data = tf.data.Dataset.from_tensor_slices(tuple(data)).batch(batch_size)
    return second_order._check_data(data)
