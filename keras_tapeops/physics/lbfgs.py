"""`lbfgs`: refine a compiled model by L-BFGS on exactly the objective `fit` minimizes.

Physics-informed networks are usually trained with Adam first and a
quasi-Newton method after (Raissi et al. 2019 use L-BFGS throughout), which
reaches residuals Adam does not in the same time. L-BFGS needs a deterministic
objective and a line search (several evaluations per step), which a Keras
optimizer cannot do inside `fit`, so this is a separate call after `fit`:

    model.fit(...)                              # Adam, with the terms
    kt.physics.lbfgs(model, x, y, iterations=2000)

The objective is the model's training loss as `fit` computes it, through the
mixin's `compute_total_loss`: the compiled loss on `(x, y)` (one batch, the
whole array), plus every loss term (`kt.PDEResidual`, `kt.ConditionLoss`, ...)
with its weight at the optimizer's current step. The optimizer does not step
during the refinement, so a `kt.physics.BoxSampler` keeps the points of that
step: the objective is fixed. Nothing is logged in the model's metrics; the
optimizer's state is untouched; the weights end at the last (lowest) point.

The algorithm: the two-loop recursion over the last `history_size` curvature
pairs (pairs with non-positive curvature are skipped), the initial Hessian
scaled by `s.y / y.y`, and a backtracking Armijo line search from step 1.
Vectors are float64 NumPy arrays; the loss and its gradient come from one
`tf.function` (with `jit_compile` if the model was compiled with it).
"""

from __future__ import annotations

from typing import Any
from typing import Callable

import keras
import numpy as np
import tensorflow as tf

from keras_tapeops import validation
from keras_tapeops.typing_aliases import Nested


def lbfgs(
    model: keras.Model,
    x: Nested,
    y: Nested = None,
    sample_weight: Nested = None,
    iterations: int = 1000,
    history_size: int = 50,
    tolerance: float = 1e-9,
    callback: Callable[[int, float], Any] | None = None,
) -> dict[str, Any]:
    """Minimizes the model's training objective by L-BFGS, from its current weights.

    Args:
        model: a compiled keras_tapeops model (`kt.upgrade` or the mixin),
            built, on one device (call it outside a distribution scope).
        x, y, sample_weight: the data of the compiled loss, as one batch.
        iterations: the maximum number of L-BFGS iterations (>= 1).
        history_size: curvature pairs kept (>= 1).
        tolerance: stop when the gradient's max-norm falls below it, or when
            an iteration lowers the loss by less than `tolerance * |loss|`
            twice in a row (the first time the curvature history is dropped
            and the search restarts from the gradient) (>= 0).
        callback: optional `callback(iteration, loss)`, called after every
            iteration (e.g. to print progress or evaluate the model).

    Returns:
        A dict: `loss` (per iteration, the first entry before any step),
        `evaluations` (objective evaluations) and `stopped` (why it
        stopped: "iterations", "gradient", "no_progress" or "line_search").

    Raises:
        ValueError: the model is not compiled, not built, not a keras_tapeops
            model, or an argument is out of range ("Received: ...").

    Example:
    ```python
    import keras, numpy as np
    import keras_tapeops as kt
    net = kt.upgrade(keras.Sequential([keras.Input((1,)), keras.layers.Dense(8, activation="tanh"),
                                       keras.layers.Dense(1)]))
    net.compile(optimizer="adam", loss="mse")
    x = np.linspace(-1, 1, 64, dtype="float32")[:, None]
    history = kt.physics.lbfgs(net, x, np.sin(3 * x), iterations=50)
    history["loss"][-1] < history["loss"][0]   # True
    ```
    """
    iterations = validation.positive_int(iterations, "iterations")
    history_size = validation.positive_int(history_size, "history_size")
    tolerance = validation.non_negative_number(tolerance, "tolerance")
    if callback is not None and not callable(callback):
        raise TypeError(
            "`callback` must be None or a callable (iteration, loss). "
            f"Received: callback={callback!r}"
        )
    _check_model(model)
    objective = _objective(model, x, y, sample_weight)
    variables = model.trainable_variables
    start = np.concatenate([np.ravel(v.numpy()) for v in variables]).astype("float64")

    def evaluate(flat):
        loss, grad = objective(tf.constant(flat, "float32"))
        return float(loss), grad.numpy().astype("float64")

    w = start
    loss, grad = evaluate(w)
    pairs: list[Any] = []
    stalled = False
    history: dict[str, Any] = {"loss": [loss], "evaluations": 1, "stopped": "iterations"}
    for iteration in range(iterations):
        if not np.isfinite(loss) or np.max(np.abs(grad)) <= tolerance:
            history["stopped"] = "gradient"
            break
        direction = -_two_loop(grad, pairs)
        slope = float(grad @ direction)
        if slope >= 0:  # not a descent direction: restart from the gradient
            pairs.clear()
            direction, slope = -grad, -float(grad @ grad)
        step = 1.0 if pairs else min(1.0, 1.0 / max(np.sum(np.abs(grad)), 1e-12))
        for _ in range(30):
            candidate = w + step * direction
            new_loss, new_grad = evaluate(candidate)
            history["evaluations"] += 1
            if np.isfinite(new_loss) and new_loss <= loss + 1e-4 * step * slope:
                break
            step *= 0.5
        else:
            history["stopped"] = "line_search"
            break
        s, g_change = candidate - w, new_grad - grad
        curvature = float(s @ g_change)
        if curvature > 1e-10 * float(g_change @ g_change):
            pairs.append((s, g_change, 1.0 / curvature))
            if len(pairs) > history_size:
                pairs.pop(0)
        change = loss - new_loss
        w, loss, grad = candidate, new_loss, new_grad
        history["loss"].append(loss)
        if callback is not None:
            callback(iteration + 1, loss)
        if change > tolerance * abs(loss):
            stalled = False
        elif stalled:
            history["stopped"] = "no_progress"
            break
        else:  # a first stall: restart from the gradient
            stalled = True
            pairs.clear()
    _assign(variables, w)  # the Armijo search only accepts decreases: w is the best
    return history


def _two_loop(grad, pairs):
    """`H @ grad` for the L-BFGS inverse-Hessian estimate `H` of `pairs`."""
    q = grad.copy()
    alphas = []
    for s, y, rho in reversed(pairs):
        alpha = rho * float(s @ q)
        alphas.append(alpha)
        q -= alpha * y
    if pairs:
        s, y, _ = pairs[-1]
        q *= float(s @ y) / float(y @ y)
    for (s, y, rho), alpha in zip(pairs, reversed(alphas)):
        beta = rho * float(y @ q)
        q += (alpha - beta) * s
    return q


def _objective(model, x, y, sample_weight):
    """A `tf.function` flat weights -> (training loss, flat gradient)."""
    variables = model.trainable_variables
    shapes = [tuple(v.shape) for v in variables]
    sizes = [int(np.prod(s)) for s in shapes]
    x, y, sample_weight = (
        tf.nest.map_structure(tf.convert_to_tensor, t) if t is not None else None
        for t in (x, y, sample_weight)
    )

    def value_and_gradient(flat):
        for variable, part, shape in zip(variables, tf.split(flat, sizes), shapes):
            variable.assign(tf.cast(tf.reshape(part, shape), variable.dtype))
        with tf.GradientTape() as tape:
            loss, _ = model.compute_total_loss(x, y, sample_weight, training=True)
        grads = tape.gradient(loss, variables)
        grads = [tf.zeros(s) if g is None else tf.cast(g, "float32") for g, s in zip(grads, shapes)]
        return tf.cast(loss, "float32"), tf.concat([tf.reshape(g, [-1]) for g in grads], 0)

    function = tf.function(value_and_gradient, jit_compile=bool(model.jit_compile))
    with model.tapeops_unlogged():  # traced now: no tracker update in the graph
        return function.get_concrete_function(tf.TensorSpec([sum(sizes)], "float32"))


def _assign(variables, flat):
    offset = 0
    for variable in variables:
        size = int(np.prod(variable.shape))
        variable.assign(flat[offset : offset + size].reshape(variable.shape).astype(variable.dtype))
        offset += size


def _check_model(model):
    if not hasattr(model, "compute_total_loss") or not hasattr(model, "tapeops_unlogged"):
        raise ValueError(
            "kt.physics.lbfgs needs a keras_tapeops model (kt.upgrade(model) or "
            f"the mixin). Received: model={type(model).__name__}"
        )
    if not model.compiled or not model.built:
        raise ValueError(
            "kt.physics.lbfgs needs a built and compiled model (compile it, and "
            "call it or fit it once). Received: model with "
            f"compiled={model.compiled}, built={model.built}"
        )
