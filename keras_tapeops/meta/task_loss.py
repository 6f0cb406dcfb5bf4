"""The loss of one task: the compiled loss, as a number independent of `tf.distribute`.

Keras's losses divide a mean-reduced value by the number of replicas (so
that summing gradients over replicas gives the global mean). A task's inner
loop must see the task's own loss, so `TaskLoss` multiplies that factor back;
the learner divides the outer loss by the global number of tasks itself.
"""

import keras
import tensorflow as tf

from keras_tapeops import replicas

# Reductions after which Keras divides the loss by the number of replicas
# (keras.src.losses.loss.reduce_values).
_SCALED_REDUCTIONS = ("sum_over_batch_size", "mean", "mean_with_sample_weight")


class TaskLoss:
    """`(y_true, y_pred) -> float32 scalar`: one task's loss, never replica-scaled.

    Args:
        loss: what `compile(loss=...)` takes for a single-output model: a
            name (`"mse"`), a loss function, or a `keras.losses.Loss`.

    Raises:
        ValueError: `loss` is None, a dict or a list (one loss for one
            output), or not a loss Keras knows.

    Example:
    ```python
    TaskLoss("mse")(y, y_pred)   # mean squared error over the task's examples
    ```
    """

    def __init__(self, loss):
        if loss is None:
            raise ValueError(
                "MetaLearner.compile() needs `loss` (the inner loop minimizes "
                "it on the support set, the outer loop on the query set). "
                "Received: loss=None"
            )
        if isinstance(loss, (dict, list, tuple)):
            raise ValueError(
                f"MetaLearner supports models with one output and one loss. Received: loss={loss!r}"
            )
        try:
            resolved = keras.losses.get(loss)
        except (ValueError, TypeError) as error:
            raise ValueError(
                f"`loss` must be a Keras loss, its name or a loss function. Received: loss={loss!r}"
            ) from error
        # A loss function (what a name resolves to) is reduced here, as
        # compile() reduces it ("sum_over_batch_size": the mean over the
        # task's examples), with fewer operations than wrapping it in a
        # `keras.losses.Loss`: the inner loop differentiates them twice.
        self.function = None if isinstance(resolved, keras.losses.Loss) else resolved
        self.loss = _FunctionLoss(resolved) if self.function is not None else resolved

    def __call__(self, y_true, y_pred):
        self._check_single(y_true, y_pred)
        if self.function is not None and getattr(y_pred, "_keras_mask", None) is None:
            y_pred = tf.cast(y_pred, "float32")
            return tf.reduce_mean(self.function(tf.cast(y_true, "float32"), y_pred))
        value = self.loss(y_true, y_pred)
        if getattr(self.loss, "reduction", None) in _SCALED_REDUCTIONS:
            value = replicas.unscale_for_distribution(value)
        return tf.cast(value, "float32")

    def summed(self, y_true, y_pred):
        """The sum of the per-example loss values (`inner_loss_reduction="sum"`).

        What `tape.gradient` differentiates when given the vector
        `keras.losses.sparse_categorical_crossentropy(y, y_pred)` (the
        keras.io Reptile step): the loss function's values summed over the
        mini-batch (and over any other axis it leaves), float32. A
        `keras.losses.Loss` contributes its unreduced values (`loss.call`),
        masked by the predictions' Keras mask if they have one; it is never
        replica-scaled.
        """
        self._check_single(y_true, y_pred)
        y_true_32, y_pred_32 = tf.cast(y_true, "float32"), tf.cast(y_pred, "float32")
        if self.function is not None:
            values = self.function(y_true_32, y_pred_32)
        else:
            values = self.loss.call(y_true_32, y_pred_32)
        values = tf.cast(values, "float32")
        mask = getattr(y_pred, "_keras_mask", None)
        if mask is not None:
            values = values * tf.cast(mask, "float32")
        return tf.reduce_sum(values)

    def _check_single(self, y_true, y_pred):
        if tf.nest.is_nested(y_pred) or tf.nest.is_nested(y_true):
            raise ValueError(
                "MetaLearner supports models with one output (one tensor of "
                "predictions and one of targets). Received: y_pred="
                f"{_structure(y_pred)}, y_true={_structure(y_true)}"
            )


class _FunctionLoss(keras.losses.Loss):
    """A loss function as a mean-reduced `keras.losses.Loss` (as `compile` wraps it)."""

    def __init__(self, fn):
        super().__init__(name=getattr(fn, "__name__", "loss"))
        self.fn = fn

    def call(self, y_true, y_pred):
        return self.fn(y_true, y_pred)


def _structure(value):
    return tf.nest.map_structure(lambda t: tuple(getattr(t, "shape", ())), value)
