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
from typing import Sequence

import keras

from keras_tapeops.input_gradients import input_gradients
from keras_tapeops.split_sizes import static_batch_size

__all__ = ["batch_size", "input_gradients", "normal", "uniform"]


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
