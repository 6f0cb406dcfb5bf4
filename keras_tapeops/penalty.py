"""`gradient_penalty`: the WGAN-GP penalty as one differentiable function.

The penalty needs the gradient of the critic w.r.t. its input (an inner tape)
inside the training tape, so the weights' gradient is a gradient of a
gradient (double backprop). The norm is computed safely: a zero input
gradient gives a finite value and finite weight gradients.
"""

from __future__ import annotations

import numbers
from typing import Any
from typing import Callable

import tensorflow as tf

from keras_tapeops.penalty_norm import per_sample_norm
from keras_tapeops.penalty_norm import validate_target
from keras_tapeops.typing_aliases import Nested


def gradient_penalty(
    critic: Callable[..., Any],
    real: Nested,
    fake: Nested,
    alpha: float | tf.Tensor | None = None,
    target: float = 1.0,
    training: bool = True,
) -> tf.Tensor:
    """WGAN-GP penalty `mean((||grad_x critic(x_hat)||_2 - target)^2)`.

    `x_hat = real + alpha * (fake - real)`, one interpolation per sample. The
    norm runs over all non-batch axes of all input tensors jointly (for dict
    or tuple inputs it is the norm of the concatenated per-sample gradient).
    Call it inside your training tape: the result is differentiable w.r.t.
    the critic's weights.

    Args:
        critic: a callable model or layer mapping inputs shaped like `real`
            to scores (any output structure; the outputs are summed).
        real: a float tensor (any rank >= 1, batch first), or a dict/tuple/list
            of them.
        fake: the same structure and shapes as `real`.
        alpha: None (default) draws `U[0, 1]` per sample, shared by all input
            tensors of a sample. Otherwise a number or a tensor: shape
            `(batch,)` is one value per sample; any other shape must
            broadcast against every input tensor.
        target: the gradient norm the penalty pulls towards (1.0 for
            WGAN-GP, 0.0 for a zero-centred penalty). A non-negative number.
        training: passed to `critic(x_hat, training=training)`.

    Returns:
        A float32 scalar tensor.

    Example:
    ```python
    real, noise = real_images[:64], tf.random.normal((64, 128))
    with tf.GradientTape() as tape:
        fake = generator(noise, training=True)
        critic_loss = (tf.reduce_mean(critic(fake)) - tf.reduce_mean(critic(real))
                       + 10.0 * kt.gradient_penalty(critic, real, fake))
    grads = tape.gradient(critic_loss, critic.trainable_variables)
    ```
    """
    _validate(critic, real, fake, alpha, target, training)
    flat_real = [tf.convert_to_tensor(t) for t in tf.nest.flatten(real)]
    flat_fake = [
        tf.cast(tf.convert_to_tensor(f), r.dtype) for r, f in zip(flat_real, tf.nest.flatten(fake))
    ]
    n = tf.shape(flat_real[0])[0]
    if alpha is None:
        alpha = tf.random.uniform([n], 0.0, 1.0)
    interpolated = [r + _shape_alpha(alpha, r) * (f - r) for r, f in zip(flat_real, flat_fake)]
    with tf.GradientTape() as tape:
        tape.watch(interpolated)
        scores = critic(tf.nest.pack_sequence_as(real, interpolated), training=training)
    # A list of targets is differentiated as their sum.
    grads = tape.gradient(tf.nest.flatten(scores), interpolated)
    norm = per_sample_norm(grads)
    return tf.reduce_mean(tf.square(norm - tf.cast(target, "float32")))


def _shape_alpha(alpha, tensor):
    """Makes `alpha` broadcast against `tensor` (a `(batch,)` alpha per sample)."""
    alpha = tf.cast(tf.convert_to_tensor(alpha), tensor.dtype)
    rank = tensor.shape.rank
    if alpha.shape.rank == 1 and rank is not None and rank > 1:
        alpha = tf.reshape(alpha, [-1] + [1] * (rank - 1))
    return alpha


def _validate(critic, real, fake, alpha, target, training):
    if not callable(critic):
        raise TypeError(f"`critic` must be a callable model or layer. Received: critic={critic!r}")
    flat_real = tf.nest.flatten(real)
    if not flat_real or any(t is None for t in flat_real):
        raise ValueError(
            f"`real` must be a tensor or a dict/tuple/list of tensors. Received: real={real!r}"
        )
    try:
        tf.nest.assert_same_structure(real, fake)
    except (ValueError, TypeError):
        raise ValueError(
            "`fake` must have the same structure as `real`. "
            f"Received: real={_describe(real)}, fake={_describe(fake)}"
        ) from None
    for r, f in zip(flat_real, tf.nest.flatten(fake)):
        r_dtype = getattr(r, "dtype", None)
        if r_dtype is None or not tf.as_dtype(r_dtype).is_floating:
            raise TypeError(
                f"`real` must hold floating-point tensors. Received: real with dtype {r_dtype}"
            )
        r_shape, f_shape = tf.TensorShape(r.shape), tf.TensorShape(f.shape)
        if r_shape.rank == 0:
            raise ValueError("`real` needs a batch dimension. Received: real of shape ()")
        if not r_shape.is_compatible_with(f_shape):
            raise ValueError(
                "`real` and `fake` must have the same shapes. "
                f"Received: real.shape={r_shape}, fake.shape={f_shape}"
            )
    if isinstance(alpha, numbers.Number) and not isinstance(alpha, bool):
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"`alpha` must be in [0, 1]. Received: alpha={alpha}")
    elif alpha is not None and (isinstance(alpha, bool) or not hasattr(alpha, "dtype")):
        raise TypeError(
            f"`alpha` must be None, a number in [0, 1] or a tensor. Received: alpha={alpha!r}"
        )
    validate_target(target)
    if not isinstance(training, bool):
        raise TypeError(f"`training` must be a bool. Received: training={training!r}")


def _describe(value):
    return tf.nest.map_structure(
        lambda t: f"<{type(t).__name__} shape={getattr(t, 'shape', None)}>", value
    )
