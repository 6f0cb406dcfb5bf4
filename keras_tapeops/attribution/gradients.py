"""Input gradients of one output unit: `saliency` and `smoothgrad`.

Everything runs in one traced function per model and setting: a batch of
points (noisy copies, interpolations) goes through the model in one forward
and backward pass, or in chunks of `batch_size` points inside a
`tf.map_fn` (one trace, no Python loop over points).
"""

from __future__ import annotations

from typing import Sequence

import keras
import numpy as np
import tensorflow as tf

from keras_tapeops import validation
from keras_tapeops.attacks import noise as attack_noise
from keras_tapeops.attribution import compiled
from keras_tapeops.attribution import targets
from keras_tapeops.typing_aliases import Array
from keras_tapeops.typing_aliases import Nested


def saliency(
    model: keras.Model,
    x: Nested,
    target: int | Sequence[int] | Array | None = None,
    absolute: bool = True,
    input_name: str | int | None = None,
    output_name: str | int | None = None,
) -> np.ndarray:
    """The gradient of the target output with respect to the input (Simonyan et al. 2014).

    Args:
        model: a Keras model (Sequential, functional, subclassed, nested);
            called with `training=False`.
        x: a batch of inputs (array or tensor, batch first); for a model with
            several inputs, all of them as a list/tuple or dict.
        target: None (each example's predicted unit, the arg-max of its
            output), an int (the same unit for all), or one int per example.
            Outputs of rank > 2 are flattened: units index the flattened
            output. Attributions are of the outputs as they are (logits,
            if the model outputs logits).
        absolute: return `|gradient|` (True) or the signed gradient.
        input_name: which input to attribute to when the model has several:
            its name (a key of a dict `x`, or the name of the functional
            model's `keras.Input`) or its index; the other inputs are held
            fixed as given. None: the model's only input.
        output_name: which output to explain when the model has several: its
            name (a key of a dict output, or one of `model.output_names`) or
            its index; `target` indexes its units. None: the only output.

    Returns:
        A NumPy float32 array shaped like the chosen input. For an image,
        the usual map is its maximum over channels.

    Example:
    ```python
    maps = kt.attribution.saliency(model, x[:4])        # shaped like x[:4]
    signed = kt.attribution.saliency(model, x[:4], target=2, absolute=False)
    ```
    """
    targets.check_model(model)
    x, rest, position = targets.split_inputs(model, x, input_name)
    targets.check_output_name(model, output_name)
    absolute = validation.boolean(absolute, "absolute")
    wanted = targets.target_tensor(target, x.shape[0])

    def build(ref):
        def run(x, rest, wanted):
            with tf.GradientTape() as tape:
                tape.watch(x)
                forward = targets.Forward(ref(), rest, position, output_name)
                scores, resolved, units = targets.selected(forward(x), wanted)
            return tape.gradient(scores, x), resolved, units

        return run

    key = ("saliency",) + targets.choice_key(position, output_name)
    grads, resolved, units = compiled.traced(model, key, build)(x, rest, wanted)
    targets.check_resolved(target, resolved, units)
    grads = np.asarray(grads, np.float32)
    return np.abs(grads) if absolute else grads


def smoothgrad(
    model: keras.Model,
    x: Nested,
    target: int | Sequence[int] | Array | None = None,
    samples: int = 25,
    noise: float = 0.15,
    absolute: bool = True,
    seed: int | None = None,
    batch_size: int | None = None,
    input_name: str | int | None = None,
    output_name: str | int | None = None,
) -> np.ndarray:
    """The gradient averaged over noisy copies of the input (Smilkov et al. 2017).

    Each example gets `samples` copies `x + N(0, sigma^2)` with
    `sigma = noise * (max(x) - min(x))` over that example; the map is the
    mean of their gradients for the example's target (its predicted unit at
    the clean input by default), and `|mean|` with `absolute=True`.

    Args:
        model: a Keras model.
        x: a batch of inputs (a list/tuple or dict for several inputs).
        target: None, an int, or one int per example (see `saliency`).
        samples: positive int, noisy copies per example.
        noise: non-negative noise level, a fraction of each example's range.
        absolute: return the absolute value of the mean gradient.
        seed: None (fresh noise on every call) or a non-negative int
            (the same noise for the same batch shape).
        batch_size: None (all `samples * batch` copies in one pass) or a
            positive int: the largest number of copies per forward pass.
        input_name: the input to attribute to (see `saliency`); the noise is
            added to it only.
        output_name: the output to explain (see `saliency`).

    Returns:
        A NumPy float32 array shaped like the chosen input.

    Example:
    ```python
    maps = kt.attribution.smoothgrad(model, x[:4], samples=10, noise=0.15, seed=0)
    ```
    """
    targets.check_model(model)
    x, rest, position = targets.split_inputs(model, x, input_name)
    targets.check_output_name(model, output_name)
    samples = validation.positive_int(samples, "samples")
    noise = validation.non_negative_number(noise, "noise")
    absolute = validation.boolean(absolute, "absolute")
    seed = attack_noise.validate_seed(seed)
    per_pass = _groups_per_pass(batch_size, x.shape[0])
    wanted = targets.target_tensor(target, x.shape[0])

    def build(ref):
        def run(x, rest, wanted, noise):
            forward = targets.Forward(ref(), rest, position, output_name)
            _, resolved, units = targets.selected(forward(x), wanted)
            axes = list(range(1, x.shape.rank))
            spread = tf.reduce_max(x, axes, keepdims=True) - tf.reduce_min(x, axes, keepdims=True)
            shape = tf.concat([[samples], tf.shape(x)], 0)
            if seed is None:
                draws = tf.random.normal(shape, dtype=x.dtype)
            else:
                draws = tf.random.stateless_normal(shape, [seed, 0], dtype=x.dtype)
            points = x[None] + noise * spread[None] * draws
            grads = batched_gradients(forward, points, resolved, per_pass)
            return tf.reduce_mean(grads, axis=0), resolved, units

        return run

    key = ("smoothgrad", samples, seed, per_pass) + targets.choice_key(position, output_name)
    grads, resolved, units = compiled.traced(model, key, build)(
        x, rest, wanted, tf.constant(noise, x.dtype)
    )
    targets.check_resolved(target, resolved, units)
    grads = np.asarray(grads, np.float32)
    return np.abs(grads) if absolute else grads


def batched_gradients(forward, points, target, per_pass=None):
    """Input gradients of each point's target output, for `K` groups of a batch.

    Args:
        forward: a `targets.Forward`: `forward(inputs, copies)` gives the
            chosen output for `copies` stacked versions of the batch.
        points: `(K, batch, ...)`: `K` versions of the batch.
        target: `(batch,)` resolved int32 units (the same for every group).
        per_pass: None (all `K * batch` points in one pass) or the number of
            groups per forward pass (chunks run in a `tf.map_fn`).

    Returns:
        The gradients, shaped like `points`.
    """
    k = points.shape[0]
    if per_pass is None or per_pass >= k:
        return _group_gradients(forward, points, target)
    chunks = -(-k // per_pass)
    padded = tf.concat([points, tf.repeat(points[-1:], chunks * per_pass - k, axis=0)], 0)
    shaped = tf.reshape(padded, tf.concat([[chunks, per_pass], tf.shape(points)[1:]], 0))
    grads = tf.map_fn(
        lambda chunk: _group_gradients(forward, chunk, target),
        shaped,
        fn_output_signature=tf.TensorSpec(shaped.shape[1:], points.dtype),
    )
    return tf.reshape(grads, tf.concat([[chunks * per_pass], tf.shape(points)[1:]], 0))[:k]


def _group_gradients(forward, points, target):
    k = points.shape[0]
    flat = tf.reshape(points, tf.concat([[-1], tf.shape(points)[2:]], 0))
    tiled = tf.tile(target, [k])
    with tf.GradientTape() as tape:
        tape.watch(flat)
        scores, _, _ = targets.selected(forward(flat, k), tiled)
    grads = tape.gradient(scores, flat)
    return tf.reshape(grads, tf.shape(points))


def _groups_per_pass(batch_size, n):
    """How many groups of `n` points fit in `batch_size` points per pass (at least 1)."""
    if batch_size is None:
        return None
    batch_size = validation.positive_int(batch_size, "batch_size")
    return max(1, batch_size // max(int(n), 1))
