"""`gradient_penalty`: the WGAN-GP penalty as one differentiable function.

The penalty needs the gradient of the critic w.r.t. its input (an inner tape
on TensorFlow, `jax.grad` on JAX) inside the training step's own gradient,
so the weights' gradient is a gradient of a gradient (double backprop). The
norm is computed safely: a zero input gradient gives a finite value and
finite weight gradients. Written with `keras.ops`; the input gradient is
the backend's (`keras_tapeops.input_gradients`).
"""

from __future__ import annotations

import numbers
from typing import Any
from typing import Callable
from typing import Sequence

import keras
from keras import ops

from keras_tapeops.input_gradients import input_gradients
from keras_tapeops.penalty_norm import per_sample_norm
from keras_tapeops.penalty_norm import validate_target
from keras_tapeops.typing_aliases import Nested


def gradient_penalty(
    critic: Callable[..., Any],
    real: Nested,
    fake: Nested,
    alpha: Any = None,
    target: float = 1.0,
    training: bool = True,
    seed: int | keras.random.SeedGenerator | None = None,
) -> Any:
    """WGAN-GP penalty `mean((||grad_x critic(x_hat)||_2 - target)^2)`.

    `x_hat = real + alpha * (fake - real)`, one interpolation per sample. The
    norm runs over all non-batch axes of all input tensors jointly (for dict
    or tuple inputs it is the norm of the concatenated per-sample gradient).
    Call it inside the function you differentiate (a `tf.GradientTape` on
    TensorFlow; on JAX the function given to `jax.grad`, with the critic's
    weights mapped by a `keras.StatelessScope` or called through
    `stateless_call`): the result is differentiable w.r.t. the critic's
    weights.

    Args:
        critic: a callable model or layer mapping inputs shaped like `real`
            to scores (any output structure; the outputs are summed). It is
            called as `critic(x_hat, training=training)`.
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
        seed: the seed of the `alpha=None` draw: None (TensorFlow's global
            generator; on JAX Keras's global seed, which a jitted function
            refuses), an int or a `keras.random.SeedGenerator` (what a jitted
            JAX step needs, e.g. one the model owns).

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
    _validate(critic, real, fake, alpha, target, training, seed)
    if alpha is None:
        alpha = _uniform_per_sample(ops.convert_to_tensor(keras.tree.flatten(real)[0]), seed)
    return interpolated_penalty(critic, real, fake, alpha, target, training, _statistics(critic))


def interpolated_penalty(
    critic: Callable[..., Any],
    real: Nested,
    fake: Nested,
    alpha: Any,
    target: float,
    training: bool,
    restore: Sequence[Any] = (),
) -> Any:
    """`gradient_penalty` without its checks, for a given `alpha` (`kt.WGANGradientPenalty`).

    Args:
        critic, real, fake, alpha, target, training: as in `gradient_penalty`
            (`alpha` is not None).
        restore: variables whose updates in the critic's pass are dropped on
            JAX (see `keras_tapeops.input_gradients`).

    Returns:
        A float32 scalar tensor.
    """
    flat_real = [ops.convert_to_tensor(t) for t in keras.tree.flatten(real)]
    flat_fake = [
        ops.cast(ops.convert_to_tensor(f), r.dtype)
        for r, f in zip(flat_real, keras.tree.flatten(fake))
    ]
    interpolated = [r + _shape_alpha(alpha, r) * (f - r) for r, f in zip(flat_real, flat_fake)]

    def scores(flat: list[Any]) -> Any:
        return critic(keras.tree.pack_sequence_as(real, flat), training=training)

    norm = per_sample_norm(input_gradients(scores, interpolated, restore))
    return ops.mean(ops.square(norm - ops.cast(target, "float32")))


def _uniform_per_sample(tensor: Any, seed: Any) -> Any:
    """`U[0, 1)` float32 draws, one per sample of `tensor` (batch first)."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        n = tf.shape(tensor)[0]
        if seed is None:  # TensorFlow's global generator, as before `seed` existed
            return tf.random.uniform([n], 0.0, 1.0)
        return keras.random.uniform(ops.expand_dims(n, 0), seed=seed)
    return keras.random.uniform((tensor.shape[0],), seed=seed)


def _statistics(critic: Any) -> list[Any]:
    """The critic's non-trainable variables: on JAX its penalty pass leaves them as they were."""
    if keras.backend.backend() != "jax":
        return []
    return list(getattr(critic, "non_trainable_variables", []))


def _rank(tensor: Any) -> int | None:
    shape = tensor.shape
    rank = getattr(shape, "rank", None)  # a TensorFlow shape may not know its rank
    if rank is None and getattr(shape, "dims", ()) is None:
        return None
    return len(shape) if rank is None else rank


def _shape_alpha(alpha: Any, tensor: Any) -> Any:
    """Makes `alpha` broadcast against `tensor` (a `(batch,)` alpha per sample)."""
    alpha = ops.cast(ops.convert_to_tensor(alpha), tensor.dtype)
    rank = _rank(tensor)
    if len(alpha.shape) == 1 and rank is not None and rank > 1:
        alpha = ops.reshape(alpha, (-1,) + (1,) * (rank - 1))
    return alpha


def _validate(critic, real, fake, alpha, target, training, seed):
    if not callable(critic):
        raise TypeError(f"`critic` must be a callable model or layer. Received: critic={critic!r}")
    flat_real = keras.tree.flatten(real)
    if not flat_real or any(t is None for t in flat_real):
        raise ValueError(
            f"`real` must be a tensor or a dict/tuple/list of tensors. Received: real={real!r}"
        )
    try:
        keras.tree.assert_same_structure(real, fake)
    except (ValueError, TypeError):
        raise ValueError(
            "`fake` must have the same structure as `real`. "
            f"Received: real={_describe(real)}, fake={_describe(fake)}"
        ) from None
    for r, f in zip(flat_real, keras.tree.flatten(fake)):
        r_dtype = getattr(r, "dtype", None)
        if r_dtype is None or not keras.backend.is_float_dtype(
            keras.backend.standardize_dtype(r_dtype)
        ):
            raise TypeError(
                f"`real` must hold floating-point tensors. Received: real with dtype {r_dtype}"
            )
        r_shape, f_shape = _shape(r), _shape(f)
        if r_shape == ():
            raise ValueError("`real` needs a batch dimension. Received: real of shape ()")
        if not _compatible(r_shape, f_shape):
            raise ValueError(
                "`real` and `fake` must have the same shapes. "
                f"Received: real.shape={_shape_text(r_shape)}, fake.shape={_shape_text(f_shape)}"
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
    valid_seed = seed is None or isinstance(seed, keras.random.SeedGenerator)
    valid_seed = valid_seed or (isinstance(seed, numbers.Integral) and not isinstance(seed, bool))
    if not valid_seed:
        raise TypeError(
            f"`seed` must be None, an int or a keras.random.SeedGenerator. Received: seed={seed!r}"
        )


def _shape(tensor: Any) -> tuple[int | None, ...] | None:
    """The static shape as a tuple (None: unknown rank)."""
    if _rank(tensor) is None:
        return None
    return tuple(None if d is None else int(d) for d in tensor.shape)


def _compatible(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return True
    return len(a) == len(b) and all(x is None or y is None or x == y for x, y in zip(a, b))


def _shape_text(shape: Any) -> str:
    if shape is None:
        return "<unknown>"
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def _describe(value):
    return keras.tree.map_structure(
        lambda t: f"<{type(t).__name__} shape={getattr(t, 'shape', None)}>", value
    )
