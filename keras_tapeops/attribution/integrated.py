"""`integrated_gradients`: path integral of the gradient from a baseline.

Sundararajan et al. 2017.
"""

from typing import Any

import numpy as np
import tensorflow as tf

from keras_tapeops import validation
from keras_tapeops.attribution import compiled
from keras_tapeops.attribution import targets
from keras_tapeops.attribution.gradients import _groups_per_pass
from keras_tapeops.attribution.gradients import batched_gradients


def integrated_gradients(
    model: Any, x: Any, baseline: Any = None, target: Any = None, steps: int = 50,
    batch_size: int | None = None,
) -> np.ndarray:
    """Integrated Gradients with the trapezoid rule over `steps` intervals.

    `IG = (x - baseline) * mean_k (g(a_k) + g(a_{k+1})) / 2`, `g(a)` the
    gradient of the target output at `baseline + a * (x - baseline)` and
    `a_k = k / steps`. The `steps + 1` points of every example go through the
    model together (one traced function; `batch_size` chunks them inside a
    `tf.map_fn`), not one gradient call per point. Completeness:
    `IG.sum() ~= f(x) - f(baseline)` for the target unit, closer with more
    steps.

    Args:
        model: a single-input, single-output Keras model (Sequential,
            functional, subclassed, nested); called with `training=False`.
        x: a batch of inputs.
        baseline: None (zeros), a number, or an array shaped like one example
            or like `x`.
        target: None (each example's predicted unit at `x`), an int, or one
            int per example. Attributions are of the outputs as they are
            (logits, if the model outputs logits).
        steps: positive int, the number of intervals (`steps + 1` points).
        batch_size: None (all `(steps + 1) * batch` points in one pass) or a
            positive int: the largest number of points per forward pass.

    Returns:
        A NumPy float32 array shaped like `x`.

    Example:
    ```python
    ig = kt.attribution.integrated_gradients(model, x[:4], steps=32)
    ig.sum(axis=1)   # ~ f_t(x) - f_t(0) per example (completeness)
    ```
    """
    targets.check_model(model)
    x = targets.input_tensor(x)
    steps = validation.positive_int(steps, "steps")
    base = _baseline(baseline, x)
    per_pass = _groups_per_pass(batch_size, x.shape[0])
    wanted = targets.target_tensor(target, x.shape[0])

    def build(ref):
        def run(x, base, wanted):
            model = ref()
            _, resolved, units = targets.selected(targets.outputs_of(model, x), wanted)
            alphas = tf.linspace(0.0, 1.0, steps + 1)
            alphas = tf.reshape(tf.cast(alphas, x.dtype), [-1] + [1] * x.shape.rank)
            points = base[None] + alphas * (x - base)[None]
            grads = batched_gradients(model, points, resolved, per_pass)
            average = tf.reduce_sum(grads[:-1] + grads[1:], axis=0) / (2.0 * steps)
            return (x - base) * average, resolved, units

        return run

    key = ("integrated_gradients", steps, per_pass)
    ig, resolved, units = compiled.traced(model, key, build)(x, base, wanted)
    targets.check_resolved(target, resolved, units)
    return np.asarray(ig, np.float32)


def _baseline(baseline, x):
    """The baseline broadcast to `x`'s shape and dtype."""
    if baseline is None:
        return tf.zeros_like(x)
    array = np.asarray(baseline, dtype=np.float64)
    shape = tuple(x.shape)
    if array.shape not in ((), shape, shape[1:]):
        raise ValueError(
            "`baseline` must be None, a number, or shaped like one example "
            f"{shape[1:]} or like `x` {shape}. Received: baseline of shape {array.shape}"
        )
    return tf.cast(tf.broadcast_to(array, shape), x.dtype)
