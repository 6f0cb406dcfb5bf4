"""What `kt.GAN`'s shared code needs from the backend: batch size, draws, input gradients.

The GAN's configuration, losses, penalties and hooks are written once with
`keras.ops`; these four functions are where the backends differ. On
TensorFlow they are the ops the GAN has always used (`tf.random.normal`,
`tf.GradientTape`, the dynamic batch size), so its results are unchanged;
on JAX the draws come from the step's key (`backend/jax/gan.py`) and input
gradients from `jax.grad`.
"""

from __future__ import annotations

from typing import Any
from typing import Callable
from typing import Sequence

import keras

from keras_tapeops.split_sizes import static_batch_size


def _on_jax() -> bool:
    return keras.backend.backend() == "jax"


def batch_size(x: Any) -> Any:
    """The number of samples in `x` (first dimension of its first tensor)."""
    if _on_jax():  # a JAX batch's size is static
        return static_batch_size(x)
    from keras_tapeops import replicas

    return replicas.batch_size(x)


def normal(model: keras.Model, shape: Sequence[Any]) -> Any:
    """`N(0, 1)` draws of `shape` (float32) for one update of `model`'s step."""
    if _on_jax():
        from keras_tapeops.backend.jax import gan as jax_gan

        return jax_gan.normal(model, shape)
    import tensorflow as tf

    return tf.random.normal(shape)


def uniform(model: keras.Model, shape: Sequence[Any]) -> Any:
    """`U[0, 1]` draws of `shape` (float32) for one update of `model`'s step."""
    if _on_jax():
        from keras_tapeops.backend.jax import gan as jax_gan

        return jax_gan.uniform(model, shape)
    import tensorflow as tf

    return tf.random.uniform(shape, 0.0, 1.0)


def input_gradients(
    function: Callable[[list[Any]], Any], inputs: list[Any], restore: Sequence[Any] = ()
) -> list[Any]:
    """The gradients of the sum of `function(inputs)`'s outputs w.r.t. `inputs`.

    Differentiable w.r.t. the weights `function` reads (double backprop).

    Args:
        function: maps the list `inputs` to a tensor or a structure of tensors.
        inputs: a list of float tensors.
        restore: variables whose updates inside `function` are dropped on
            JAX (the discriminator's moving statistics: the penalty's own
            forward pass does not train them there).

    Returns:
        One gradient per input (None where the outputs do not depend on it).
    """
    if _on_jax():
        from keras_tapeops.backend.jax import gan as jax_gan

        return jax_gan.input_gradients(function, inputs, restore)
    import tensorflow as tf

    flat = [tf.convert_to_tensor(t) for t in inputs]
    with tf.GradientTape() as tape:
        tape.watch(flat)
        outputs = function(flat)
    # A list of targets is differentiated as their sum.
    return tape.gradient(tf.nest.flatten(outputs), flat)
