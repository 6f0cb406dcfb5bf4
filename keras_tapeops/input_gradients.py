"""Gradients of a function's outputs w.r.t. its inputs, on either backend.

`input_gradients` is the one seam the input-gradient penalties need
(`kt.gradient_penalty`, the GAN penalties): a `tf.GradientTape` on
TensorFlow, `jax.grad` on JAX (`backend/jax/gan.py`). Both results are
differentiable w.r.t. the weights the function reads (double backprop).
"""

from __future__ import annotations

from typing import Any
from typing import Callable
from typing import Sequence

import keras


def input_gradients(
    function: Callable[[list[Any]], Any], inputs: list[Any], restore: Sequence[Any] = ()
) -> list[Any]:
    """The gradients of the sum of `function(inputs)`'s outputs w.r.t. `inputs`.

    Differentiable w.r.t. the weights `function` reads (double backprop).

    Args:
        function: maps the list `inputs` to a tensor or a structure of tensors.
        inputs: a list of float tensors.
        restore: variables whose updates inside `function` are dropped on
            JAX (a critic's moving statistics: a value traced inside
            `jax.grad` must not leak into a variable).

    Returns:
        One gradient per input (None where the outputs do not depend on it
        on TensorFlow; zeros on JAX).

    Example:
    ```python
    (g,) = input_gradients(lambda xs: keras.ops.sum(xs[0] ** 2), [x])   # 2 * x
    ```
    """
    if keras.backend.backend() == "jax":
        from keras_tapeops.backend.jax import gan as jax_gan

        return jax_gan.input_gradients(function, inputs, restore)
    import tensorflow as tf

    flat = [tf.convert_to_tensor(t) for t in inputs]
    with tf.GradientTape() as tape:
        tape.watch(flat)
        outputs = function(flat)
    # A list of targets is differentiated as their sum.
    return tape.gradient(tf.nest.flatten(outputs), flat)
