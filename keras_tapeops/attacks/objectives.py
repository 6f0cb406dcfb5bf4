"""What an attack ascends: the model's compiled loss, a given loss, or a KL divergence.

An objective is a function `objective(y_pred) -> float32 scalar`. Attacks only
use the direction of its input gradient (signed or normalized per example),
so a loss is ascended as its sum over the batch: the mean times the batch
size, which keeps the per-example gradients away from float16's underflow
under mixed precision.
"""

import keras
import tensorflow as tf

from keras_tapeops._keras import compile_loss as keras_loss
from keras_tapeops._keras import private
from keras_tapeops import selectors


def validate_loss(loss):
    """None, a Keras loss name, a `keras.losses.Loss` or a callable `(y_true, y_pred)`."""
    if loss is None or isinstance(loss, keras.losses.Loss):
        return loss
    if isinstance(loss, str):
        try:
            keras.losses.get(loss)
        except (ValueError, TypeError):
            raise ValueError(f"`loss` is not a Keras loss name. Received: loss={loss!r}") from None
        return loss
    if callable(loss):
        return loss
    raise TypeError(
        "`loss` must be None (the model's compiled loss), a Keras loss, its "
        f"name, or a function (y_true, y_pred). Received: loss={loss!r}"
    )


def serialize_loss(loss):
    """The config form of a validated `loss` (names as is; objects through Keras)."""
    if loss is None or isinstance(loss, str):
        return loss
    return selectors.serialize_callable(loss, "loss")


def deserialize_loss(config):
    if config is None or isinstance(config, str):
        return config
    return keras.saving.deserialize_keras_object(config)


def loss_objective(model, loss, y):
    """The objective `sum over the batch of loss(y, y_pred)`.

    Args:
        model: the model; its compiled loss is used when `loss` is None.
        loss: None or a validated loss.
        y: the targets.

    Returns:
        `objective(y_pred) -> float32 scalar`.

    Raises:
        ValueError: `loss` is None and the model has no compiled loss.
    """
    if loss is None:
        if private.compiled_loss(model) is None:
            raise ValueError(
                f"The attack ascends the compiled loss, but model "
                f"{model.name!r} was not compiled with a loss. Compile it with "
                "a loss or give the attack its own `loss=`. Received: loss=None"
            )

        def value_of(y_pred):
            return compiled_loss_value(model, y, y_pred)
    else:
        function = keras.losses.get(loss) if isinstance(loss, str) else loss

        def value_of(y_pred):
            return function(y, y_pred)

    def objective(y_pred):
        value = tf.cast(value_of(y_pred), tf.float32)
        if value.shape.rank:
            return tf.reduce_sum(value)
        n = tf.shape(tf.nest.flatten(y_pred)[0])[0]
        return value * tf.cast(n, tf.float32)

    return objective


def compiled_loss_value(model, y, y_pred, sample_weight=None):
    """The model's compiled loss on `(y, y_pred)`, without touching its trackers.

    Like stock `compute_loss` without the regularization losses (those do
    not depend on the inputs): sample weights and per-output loss weights
    apply; under `tf.distribute` the value is divided by the number of
    replicas, as Keras's losses are.

    Args:
        model: a compiled model.
        y, y_pred, sample_weight: as stock `compute_loss` takes them.

    Returns:
        The loss, a scalar tensor.
    """
    compiled = private.compiled_loss(model)
    if tf.nest.is_nested(y) or tf.nest.is_nested(y_pred):
        with _per_output_trackers_muted(compiled):
            return compiled(y, y_pred, sample_weight)
    return compiled(y, y_pred, sample_weight)


def _per_output_trackers_muted(compiled):
    """Stops a built `CompileLoss` from updating its per-output loss trackers.

    For a multi-output model, calling the compiled loss object
    (`model._compile_loss`; Keras has no public handle on it) also records
    each output's loss in the `Mean` trackers behind the `<output>_loss`
    logs (`if metric: metric.update_state`). An attack's or adversarial
    term's extra calls must not be logged as the model's losses, so the
    trackers are replaced by as many `None`s for the call
    (`_keras.compile_loss.output_trackers_muted`).
    No cross-replica call happens inside the block, so MirroredStrategy's
    replica threads (which run one at a time between such calls) never see
    the muted list. An unbuilt loss (first call, outside a training step) is
    called as is: it builds its trackers, which `fit`/`evaluate` reset.
    """
    return keras_loss.output_trackers_muted(compiled)


def log_probabilities(outputs, from_logits):
    """Float32 log-probabilities of classification outputs, over the last axis.

    A single unit (`(batch, 1)`) is a Bernoulli output: sigmoid of a logit,
    or a probability; it becomes the two classes `[1 - p, p]`.

    Args:
        outputs: `(batch, classes)` or `(batch, 1)` logits or probabilities.
        from_logits: whether `outputs` are logits.

    Returns:
        A float32 tensor `(batch, classes)` (2 classes for a single unit).
    """
    outputs = tf.cast(outputs, tf.float32)
    if outputs.shape[-1] == 1:
        if from_logits:
            return tf.concat([tf.math.log_sigmoid(-outputs), tf.math.log_sigmoid(outputs)], -1)
        outputs = tf.concat([1.0 - outputs, outputs], -1)
    if from_logits:
        return tf.nn.log_softmax(outputs, axis=-1)
    return tf.math.log(tf.clip_by_value(outputs, 1e-12, 1.0))


def kl_per_example(log_p, log_q):
    """`KL(p || q)` per example from log-probabilities: shape `(batch,)`."""
    return tf.reduce_sum(tf.exp(log_p) * (log_p - log_q), axis=-1)


def kl_objective(clean_log_p, from_logits):
    """The TRADES attack objective: `sum_i KL(p_clean_i || p(x_adv)_i)`.

    Args:
        clean_log_p: log-probabilities at the clean inputs, held constant.
        from_logits: whether the model's outputs are logits.

    Returns:
        `objective(y_pred) -> float32 scalar`.
    """
    clean_log_p = tf.stop_gradient(clean_log_p)

    def objective(y_pred):
        return tf.reduce_sum(kl_per_example(clean_log_p, log_probabilities(y_pred, from_logits)))

    return objective
