"""The inner loop: SGD on a task's support set (or its mini-batches), with functional weights.

The model is called with `model.stateless_call`: its weights are tensors
passed in, never its variables, so the inner loop writes nothing (weights,
BatchNormalization statistics and seed states are read, not updated). Each
step differentiates the support loss with a tape of its own; when an outer
tape is recording, the update is recorded too, so the outer gradient flows
through it (second order) unless the inner gradients are held constant
(`first_order=True`).

By default every step sees the whole support set and the update is plain
SGD; `batch_size` cuts the support set into mini-batches, in order (the last
one smaller when `batch_size` does not divide it), step `s` taking mini-batch
`s mod ceil(K / batch_size)`; an `InnerSGD` with momentum keeps one velocity
per adapted weight for the task's steps.
"""

import tensorflow as tf

from keras_tapeops.meta.inner_optimizer import InnerSGD


class FunctionalLoss:
    """The compiled loss of `model` at given weights: `loss(weights, x, y)`.

    The value is `loss_fn(y, model(x))` in float32 plus the model's
    regularization and `add_loss` losses at those weights, as `fit` adds them.

    Args:
        model: a built Keras model.
        loss_fn: callable `(y_true, y_pred) -> scalar` (the compiled loss).
        non_trainable: the model's non-trainable variables' values (tensors),
            aligned with `model.non_trainable_variables`.
        training: the `training` flag of the forward passes.

    Example:
    ```python
    loss = FunctionalLoss(model, keras.losses.MeanSquaredError(), [], True)
    value, y_pred = loss([v.value for v in model.trainable_variables], x, y)
    ```
    """

    def __init__(self, model, loss_fn, non_trainable, training):
        self.model = model
        self.loss_fn = loss_fn
        self.non_trainable = list(non_trainable)
        self.training = training

    def predict(self, weights, x):
        """`model(x)` at `weights`; returns `(y_pred, additional_losses)`."""
        y_pred, _, losses = self.model.stateless_call(
            list(weights),
            self.non_trainable,
            x,
            training=self.training,
            return_losses=True,
        )
        return y_pred, losses

    def __call__(self, weights, x, y):
        """Returns `(loss, y_pred)`: the float32 loss and the predictions."""
        y_pred, losses = self.predict(weights, x)
        value = tf.cast(self.loss_fn(y, y_pred), "float32")
        for extra in losses:
            value = value + tf.cast(tf.reduce_sum(extra), "float32")
        return value, y_pred


def sgd_steps(
    loss, weights, x, y, adapted, rates, steps, first_order, batch_size=None, optimizer=None
):
    """Returns the weights after `steps` of SGD on `loss(weights, x, y)`.

    Args:
        loss: a `FunctionalLoss` (or any `(weights, x, y) -> (loss, _)`).
        weights: tensors aligned with `model.trainable_variables` (the start).
        x, y: one task's support set.
        adapted: indices of the adapted weights (the others stay).
        rates: one inner rate per adapted weight: a float or a tensor of the
            weight's shape (Meta-SGD).
        steps: int >= 1 (unrolled: each step is part of the graph).
        first_order: hold each inner gradient constant for outer tapes.
        batch_size: None (every step on the whole support set) or an int:
            step `s` uses mini-batch `s mod ceil(K / batch_size)` (see
            `mini_batch`).
        optimizer: None (plain SGD) or an `InnerSGD`.

    Returns:
        The adapted weights, a list aligned with `weights`.

    Example:
    ```python
    adapted = sgd_steps(loss, weights, sx, sy, adapted=[2, 3], rates=[0.01, 0.01],
                        steps=1, first_order=False)
    ```
    """
    weights = list(weights)
    optimizer = optimizer or InnerSGD()
    slots = optimizer.init([weights[i] for i in adapted])
    for step in range(steps):
        batch_x, batch_y = mini_batch(x, y, step, batch_size)
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            watched = [weights[i] for i in adapted]
            tape.watch(watched)
            value, _ = loss(weights, batch_x, batch_y)
        grads = tape.gradient(value, watched)
        for k, (i, g, rate) in enumerate(zip(adapted, grads, rates)):
            if g is None:  # the weight does not reach the loss
                continue
            if first_order:
                g = tf.stop_gradient(g)
            weights[i], slots[k] = optimizer.update(weights[i], g, tf.cast(rate, g.dtype), slots[k])
    return weights


def mini_batch(x, y, step, batch_size):
    """The examples of inner step `step`: `(x, y)` cut along the example axis.

    With `batch_size=None` the whole support set. Otherwise the support set
    of K examples is cut in order into `ceil(K / batch_size)` mini-batches,
    the last one smaller when `batch_size` does not divide K (as
    `tf.data.Dataset.batch` cuts it), and step `s` takes mini-batch
    `s mod ceil(K / batch_size)`: `steps = r * ceil(K / batch_size)` are `r`
    passes over the support set. K is read from the first tensor of `x`
    (statically when known, so the slices keep static shapes).

    Example:
    ```python
    mini_batch(x, y, step=5, batch_size=4)   # K = 10: examples 4..7
    ```
    """
    if batch_size is None:
        return x, y
    count = tf.nest.flatten(x)[0].shape[0]
    if count is not None:
        batches = -(-count // batch_size)
        start = (step % batches) * batch_size
        end = min(start + batch_size, count)
    else:
        count = tf.shape(tf.nest.flatten(x)[0])[0]
        batches = (count + batch_size - 1) // batch_size
        start = (step % batches) * batch_size
        end = tf.minimum(start + batch_size, count)

    def cut(t):
        return t[start:end]

    return tf.nest.map_structure(cut, x), tf.nest.map_structure(cut, y)
