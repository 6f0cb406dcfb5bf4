"""Input gradients of one output unit: `saliency` and `smoothgrad`.

Everything runs in one traced function per model and setting: a batch of
points (noisy copies, interpolations) goes through the model in one forward
and backward pass, or in chunks of `batch_size` points inside a
`tf.map_fn` (one trace, no Python loop over points).
"""

from typing import Any

import numpy as np
import tensorflow as tf

from keras_tapeops import validation
from keras_tapeops.attacks import noise as attack_noise
from keras_tapeops.attribution import compiled
from keras_tapeops.attribution import targets


def saliency(model: Any, x: Any, target: Any = None, absolute: bool = True) -> np.ndarray:
    """The gradient of the target output with respect to the input (Simonyan et al. 2014).

    Args:
        model: a single-input, single-output Keras model (Sequential,
            functional, subclassed, nested); called with `training=False`.
        x: a batch of inputs (array or tensor, batch first).
        target: None (each example's predicted unit, the arg-max of its
            output), an int (the same unit for all), or one int per example.
            Outputs of rank > 2 are flattened: units index the flattened
            output. Attributions are of the outputs as they are (logits,
            if the model outputs logits).
        absolute: return `|gradient|` (True) or the signed gradient.

    Returns:
        A NumPy float32 array shaped like `x`. For an image, the usual map
        is its maximum over channels.

    Example:
    ```python
    maps = kt.attribution.saliency(model, x[:4])        # shaped like x[:4]
    signed = kt.attribution.saliency(model, x[:4], target=2, absolute=False)
    ```
    """
    targets.check_model(model)
    x = targets.input_tensor(x)
    absolute = validation.boolean(absolute, "absolute")
    wanted = targets.target_tensor(target, x.shape[0])

    def build(ref):
        def run(x, wanted):
            with tf.GradientTape() as tape:
                tape.watch(x)
                scores, resolved, units = targets.selected(
                    targets.outputs_of(ref(), x), wanted
                )
            return tape.gradient(scores, x), resolved, units

        return run

    grads, resolved, units = compiled.traced(model, ("saliency",), build)(x, wanted)
    targets.check_resolved(target, resolved, units)
    grads = np.asarray(grads, np.float32)
    return np.abs(grads) if absolute else grads


def smoothgrad(
    model: Any, x: Any, target: Any = None, samples: int = 25, noise: float = 0.15,
    absolute: bool = True, seed: int | None = None, batch_size: int | None = None,
) -> np.ndarray:
    """The gradient averaged over noisy copies of the input (Smilkov et al. 2017).

    Each example gets `samples` copies `x + N(0, sigma^2)` with
    `sigma = noise * (max(x) - min(x))` over that example; the map is the
    mean of their gradients for the example's target (its predicted unit at
    the clean input by default), and `|mean|` with `absolute=True`.

    Args:
        model: a single-input, single-output Keras model.
        x: a batch of inputs.
        target: None, an int, or one int per example (see `saliency`).
        samples: positive int, noisy copies per example.
        noise: non-negative noise level, a fraction of each example's range.
        absolute: return the absolute value of the mean gradient.
        seed: None (fresh noise on every call) or a non-negative int
            (the same noise for the same batch shape).
        batch_size: None (all `samples * batch` copies in one pass) or a
            positive int: the largest number of copies per forward pass.

    Returns:
        A NumPy float32 array shaped like `x`.

    Example:
    ```python
    maps = kt.attribution.smoothgrad(model, x[:4], samples=10, noise=0.15, seed=0)
    ```
    """
    targets.check_model(model)
    x = targets.input_tensor(x)
    samples = validation.positive_int(samples, "samples")
    noise = validation.non_negative_number(noise, "noise")
    absolute = validation.boolean(absolute, "absolute")
    seed = attack_noise.validate_seed(seed)
    per_pass = _groups_per_pass(batch_size, x.shape[0])
    wanted = targets.target_tensor(target, x.shape[0])

    def build(ref):
        def run(x, wanted, noise):
            model = ref()
            _, resolved, units = targets.selected(targets.outputs_of(model, x), wanted)
            axes = list(range(1, x.shape.rank))
            spread = tf.reduce_max(x, axes, keepdims=True) - tf.reduce_min(x, axes, keepdims=True)
            shape = tf.concat([[samples], tf.shape(x)], 0)
            if seed is None:
                draws = tf.random.normal(shape, dtype=x.dtype)
            else:
                draws = tf.random.stateless_normal(shape, [seed, 0], dtype=x.dtype)
            points = x[None] + noise * spread[None] * draws
            grads = batched_gradients(model, points, resolved, per_pass)
            return tf.reduce_mean(grads, axis=0), resolved, units

        return run

    key = ("smoothgrad", samples, seed, per_pass)
    grads, resolved, units = compiled.traced(model, key, build)(
        x, wanted, tf.constant(noise, x.dtype)
    )
    targets.check_resolved(target, resolved, units)
    grads = np.asarray(grads, np.float32)
    return np.abs(grads) if absolute else grads


def batched_gradients(model, points, target, per_pass=None):
    """Input gradients of each point's target output, for `K` groups of a batch.

    Args:
        model: the model (inference mode).
        points: `(K, batch, ...)`: `K` versions of the batch.
        target: `(batch,)` resolved int32 units (the same for every group).
        per_pass: None (all `K * batch` points in one pass) or the number of
            groups per forward pass (chunks run in a `tf.map_fn`).

    Returns:
        The gradients, shaped like `points`.
    """
    k = points.shape[0]
    if per_pass is None or per_pass >= k:
        return _group_gradients(model, points, target)
    chunks = -(-k // per_pass)
    padded = tf.concat(
        [points, tf.repeat(points[-1:], chunks * per_pass - k, axis=0)], 0
    )
    shaped = tf.reshape(padded, tf.concat([[chunks, per_pass], tf.shape(points)[1:]], 0))
    grads = tf.map_fn(
        lambda chunk: _group_gradients(model, chunk, target), shaped,
        fn_output_signature=tf.TensorSpec(shaped.shape[1:], points.dtype),
    )
    return tf.reshape(grads, tf.concat([[chunks * per_pass], tf.shape(points)[1:]], 0))[:k]


def _group_gradients(model, points, target):
    k = tf.shape(points)[0]
    flat = tf.reshape(points, tf.concat([[-1], tf.shape(points)[2:]], 0))
    tiled = tf.tile(target, [k])
    with tf.GradientTape() as tape:
        tape.watch(flat)
        scores, _, _ = targets.selected(targets.outputs_of(model, flat), tiled)
    grads = tape.gradient(scores, flat)
    return tf.reshape(grads, tf.shape(points))


def _groups_per_pass(batch_size, n):
    """How many groups of `n` points fit in `batch_size` points per pass (at least 1)."""
    if batch_size is None:
        return None
    batch_size = validation.positive_int(batch_size, "batch_size")
    return max(1, batch_size // max(int(n), 1))
