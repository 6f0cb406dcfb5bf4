"""`integrated_gradients`: path integral of the gradient from a baseline.

Sundararajan et al. 2017. Several baselines (keras.io's random baselines)
are averaged: the result is the mean of the per-baseline attributions.
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
from keras_tapeops.attribution.gradients import _groups_per_pass
from keras_tapeops.attribution.gradients import batched_gradients
from keras_tapeops.typing_aliases import Array
from keras_tapeops.typing_aliases import Nested


def integrated_gradients(
    model: keras.Model,
    x: Nested,
    baseline: float | Array | None = None,
    target: int | Sequence[int] | Array | None = None,
    steps: int = 50,
    batch_size: int | None = None,
    baselines: Array | Sequence[float | Array] | None = None,
    num_random_baselines: int | None = None,
    random_baseline_range: tuple[float, float] = (0.0, 1.0),
    seed: int | None = None,
    input_name: str | int | None = None,
    output_name: str | int | None = None,
) -> np.ndarray:
    """Integrated Gradients with the trapezoid rule over `steps` intervals.

    `IG = (x - baseline) * mean_k (g(a_k) + g(a_{k+1})) / 2`, `g(a)` the
    gradient of the target output at `baseline + a * (x - baseline)` and
    `a_k = k / steps`. The `steps + 1` points of every example (for every
    baseline) go through the model together (one traced function;
    `batch_size` chunks them inside a `tf.map_fn`), not one gradient call per
    point. Completeness: `IG.sum() ~= f(x) - f(baseline)` for the target
    unit, closer with more steps. With several baselines the result is the
    mean of the per-baseline attributions (keras.io's "random baselines").

    Args:
        model: a Keras model (Sequential, functional, subclassed, nested);
            called with `training=False`.
        x: a batch of inputs; for a model with several inputs, all of them as
            a list/tuple or dict (the others are held fixed along the path).
        baseline: None (zeros), a number, or an array shaped like one example
            or like `x` (the chosen input).
        target: None (each example's predicted unit at `x`), an int, or one
            int per example. Attributions are of the outputs as they are
            (logits, if the model outputs logits).
        steps: positive int, the number of intervals (`steps + 1` points).
        batch_size: None (all points in one pass) or a positive int: the
            largest number of points per forward pass.
        baselines: None, or several baselines to average over: a list of
            baselines (each as `baseline` takes), or an array whose first
            axis indexes them.
        num_random_baselines: None, or a positive int `k`: average over `k`
            baselines drawn uniformly from `random_baseline_range`, each
            shaped like one example: `numpy.random.default_rng(seed).uniform(
            low, high, (k,) + example_shape)` in float32.
        random_baseline_range: `(low, high)` for random baselines (keras.io
            draws from `(0, 255)` for 8-bit images).
        seed: None (fresh random baselines on every call) or a non-negative
            int; only with `num_random_baselines`.
        input_name: the input to attribute to when the model has several (a
            name or an index; see `saliency`).
        output_name: the output to explain when the model has several (a
            name or an index; see `saliency`).

    Returns:
        A NumPy float32 array shaped like `x` (the chosen input).

    Example:
    ```python
    ig = kt.attribution.integrated_gradients(model, x[:4], steps=32)
    ig.sum(axis=1)   # ~ f_t(x) - f_t(0) per example (completeness)
    averaged = kt.attribution.integrated_gradients(
        model, x[:4], steps=32, num_random_baselines=4, seed=0)
    ```
    """
    targets.check_model(model)
    x, rest, position = targets.split_inputs(model, x, input_name)
    targets.check_output_name(model, output_name)
    steps = validation.positive_int(steps, "steps")
    base = _baselines(baseline, baselines, num_random_baselines, random_baseline_range, seed, x)
    per_pass = _groups_per_pass(batch_size, x.shape[0])
    wanted = targets.target_tensor(target, x.shape[0])

    def build(ref):
        def run(x, rest, base, wanted):
            forward = targets.Forward(ref(), rest, position, output_name)
            _, resolved, units = targets.selected(forward(x), wanted)
            count = base.shape[0]  # static: the number of baselines is in the key
            alphas = tf.linspace(0.0, 1.0, steps + 1)
            alphas = tf.reshape(tf.cast(alphas, x.dtype), [1, -1] + [1] * x.shape.rank)
            points = base[:, None] + alphas * (x[None] - base)[:, None]
            points = tf.reshape(points, tf.concat([[count * (steps + 1)], tf.shape(x)], 0))
            grads = batched_gradients(forward, points, resolved, per_pass)
            grads = tf.reshape(grads, tf.concat([[count, steps + 1], tf.shape(x)], 0))
            average = tf.reduce_sum(grads[:, :-1] + grads[:, 1:], axis=1) / (2.0 * steps)
            return tf.reduce_mean((x[None] - base) * average, axis=0), resolved, units

        return run

    key = ("integrated_gradients", steps, per_pass, int(base.shape[0]))
    key += targets.choice_key(position, output_name)
    ig, resolved, units = compiled.traced(model, key, build)(x, rest, base, wanted)
    targets.check_resolved(target, resolved, units)
    return np.asarray(ig, np.float32)


def _baselines(baseline, baselines, count, value_range, seed, x):
    """`(m, *x.shape)`: the baselines to average over (m = 1 for one baseline)."""
    given = [
        f"{name}={value!r}" if name != "baselines" else "baselines=..."
        for name, value in (
            ("baseline", baseline),
            ("baselines", baselines),
            ("num_random_baselines", count),
        )
        if value is not None
    ]
    if len(given) > 1:
        raise ValueError(
            "Give at most one of `baseline`, `baselines` and `num_random_baselines`. "
            f"Received: {', '.join(given)}"
        )
    if seed is not None and count is None:
        raise ValueError(
            "`seed` draws random baselines: it needs `num_random_baselines`. "
            f"Received: seed={seed!r}, num_random_baselines=None"
        )
    if count is not None:
        count = validation.positive_int(count, "num_random_baselines")
        seed = attack_noise.validate_seed(seed)
        low, high = _range(value_range)
        draws = np.random.default_rng(seed).uniform(low, high, (count,) + tuple(x.shape[1:]))
        baselines = draws.astype(np.float32)
    if baselines is None:
        return _baseline(baseline, x)[None]
    if isinstance(baselines, (list, tuple)):
        entries = list(baselines)
    else:
        array = np.asarray(baselines)
        if array.ndim == 0:
            raise ValueError(
                "`baselines` must be a list of baselines or an array whose first "
                f"axis indexes them. Received: baselines of shape {array.shape}"
            )
        entries = list(array)
    if not entries:
        raise ValueError("`baselines` must hold at least one baseline. Received: baselines=[]")
    return tf.stack([_baseline(entry, x, "baselines[i]") for entry in entries])


def _range(value_range):
    try:
        low, high = (float(v) for v in value_range)
    except (TypeError, ValueError):
        low, high = np.nan, np.nan
    if not (np.isfinite(low) and np.isfinite(high) and low <= high):
        raise ValueError(
            "`random_baseline_range` must be `(low, high)` with finite low <= high. "
            f"Received: random_baseline_range={value_range!r}"
        )
    return low, high


def _baseline(baseline, x, argument="baseline"):
    """The baseline broadcast to `x`'s shape and dtype."""
    if baseline is None:
        return tf.zeros_like(x)
    array = np.asarray(baseline, dtype=np.float64)
    shape = tuple(x.shape)
    if array.shape not in ((), shape, shape[1:]):
        raise ValueError(
            f"`{argument}` must be None, a number, or shaped like one example "
            f"{shape[1:]} or like `x` {shape}. Received: {argument} of shape {array.shape}"
        )
    return tf.cast(tf.broadcast_to(array, shape), x.dtype)
