"""Second-order helpers: Hessian-vector products and the top Hessian eigenvalue.

`H` is the Hessian of the model's loss, exactly as `fit` computes it
(`model.compute_loss`: the compiled loss with its sample weights and loss
weights, plus layer regularizers and `add_loss` terms), with respect to
`model.trainable_variables`. keras_tapeops loss terms (`compile(loss_terms=)`)
are not part of it.

`H @ v` is computed exactly (no finite differences) by differentiating twice
(reverse over reverse): the inner tape gives the gradient `g(w)`, the outer
tape differentiates `g(w) . v` with `v` held constant. One product costs about
two gradient evaluations; the step is a `tf.function`, traced once per model
(and again after `compile()` changes the loss).

Both helpers are measurements: the weights, BatchNormalization moving
statistics, seed-generator states and metric trackers are the same before and
after a call (anything the forward pass or `compute_loss` updates is put back),
so they can run from a callback or inside a custom `train_step`.

- Mixed precision: the forward pass runs as in training (float16 compute),
  the loss is taken in float32 and differentiated with respect to the float32
  variables; vectors are cast to the variables' dtype and the products are
  float32. No loss scaling is used, so a loss whose second-order terms fall
  below float16's range loses them (~1e-3 relative agreement with float32).
- Sparse gradients (Embedding): the gradient and the product are densified,
  so every returned tensor is dense and shaped like its variable.
- Under `tf.distribute`, call the helpers outside `strategy.run` (a callback
  does): they compute on one device, with the whole batch.
"""

from __future__ import annotations

import numbers
import weakref
from typing import Any
from typing import Sequence

import keras
import numpy as np
import tensorflow as tf

from keras_tapeops._keras import private
from keras_tapeops import validation
from keras_tapeops.typing_aliases import Data
from keras_tapeops.typing_aliases import Nested


def hessian_vector_product(
    model: keras.Model,
    x: Nested,
    y: Nested,
    vectors: Sequence[Any],
    sample_weight: Nested = None,
    training: bool = False,
) -> list[tf.Tensor]:
    """Returns `H @ v`, `H` the Hessian of the model's loss on one batch.

    Args:
        model: a built, compiled `keras.Model` (any kind, keras_tapeops or
            not). `H` is taken with respect to `model.trainable_variables`.
        x: the batch's inputs (anything the model accepts).
        y: the batch's targets (None for a model whose loss is `add_loss` only).
        vectors: a list with one tensor (or array) per trainable variable,
            shaped like it, in the order of `model.trainable_variables`
            (together, the vector `v`). Cast to the variables' dtype.
        sample_weight: optional sample weights, as `fit` takes them.
        training: the `training` flag of the forward pass. False (the
            default) uses BatchNormalization's moving statistics and no
            dropout; with True, batch statistics and dropout masks are used
            (and the moving statistics and seed states are put back after).

    Returns:
        A list of dense tensors aligned with `model.trainable_variables`
        (`H @ v` split like the variables). Works eagerly and inside a
        `tf.function` (a custom `train_step`).

    Raises:
        TypeError: `model` is not a Keras model; `vectors` is not a list.
        ValueError: the model is not built or not compiled; `vectors` has
            the wrong length or a tensor of the wrong shape.

    Example:
    ```python
    v = [tf.random.normal(w.shape) for w in model.trainable_variables]
    hv = kt.hessian_vector_product(model, x, y, v)
    curvature = sum(tf.reduce_sum(a * b) for a, b in zip(v, hv))   # v^T H v
    ```
    """
    _check_model(model)
    training = validation.boolean(training, "training")
    vectors = _check_vectors(model, vectors)
    x, y, sample_weight = _to_tensors(x, y, sample_weight)
    return _hvp_function(model)(x, y, sample_weight, vectors, training)


def top_hessian_eigenvalue(
    model: keras.Model,
    data: Data,
    iterations: int = 20,
    seed: int | None = None,
    tolerance: float = 1e-4,
) -> float:
    """Returns the largest-magnitude eigenvalue of the loss Hessian, by power iteration.

    `H` is the Hessian of the loss over all of `data`: each batch's product is
    weighted by its number of samples, so `H` is the Hessian of the
    sample-count-weighted mean of the batch losses (the `loss` that `fit`
    reports for an epoch), with regularizers counted once. The forward pass
    uses `training=False` (BatchNormalization's moving statistics, no
    dropout); nothing in the model changes.

    Power iteration finds the eigenvalue of largest absolute value: `v <-
    H v / ||H v||` from a random start, reporting the Rayleigh quotient
    `v . H v` (so the sign is kept: a negative result means the most curved
    direction is one of negative curvature). It converges like
    `(|lambda_2| / |lambda_1|)^(2k)`, so a small spectral gap needs more
    iterations.

    Args:
        model: a built, compiled `keras.Model`.
        data: a finite `tf.data.Dataset` of `(x, y)` or
            `(x, y, sample_weight)` batches (iterated once per iteration;
            it should give the same batches each time), or a tuple
            `(x, y)` / `(x, y, sample_weight)` used as one batch.
        iterations: positive int, the maximum number of Hessian-vector
            products over `data`.
        seed: None or a non-negative int: the random start vector. With a
            seed the result is deterministic.
        tolerance: non-negative number: stop when the estimate changes by at
            most `tolerance * |estimate|` between two iterations (0: run all
            `iterations`).

    Returns:
        The eigenvalue as a Python float (0.0 if `H v` is exactly zero).

    Raises:
        TypeError, ValueError: naming the bad argument ("Received: ...").

    Example:
    ```python
    val = dataset.batch(256).take(4)   # a fixed, finite sample
    print(kt.top_hessian_eigenvalue(model, val, iterations=20, seed=0))
    ```
    """
    _check_model(model)
    batches = _check_data(data)
    iterations = validation.positive_int(iterations, "iterations")
    tolerance = validation.non_negative_number(tolerance, "tolerance")
    seed = _check_seed(seed)
    variables = model.trainable_variables
    rng = np.random.default_rng(seed)
    v = _normalized(
        [tf.constant(rng.standard_normal(tuple(var.shape)), dtype=var.dtype) for var in variables]
    )
    fn = _hvp_function(model)
    estimate = None
    for _ in range(iterations):
        hv = _mean_hvp(fn, batches, v)
        new = float(_dot(v, hv))
        norm = float(tf.linalg.global_norm(hv))
        if norm == 0.0:
            return 0.0
        v = [h / norm for h in hv]
        converged = estimate is not None and abs(new - estimate) <= tolerance * abs(new)
        estimate = new
        if converged:
            break
    assert estimate is not None  # iterations >= 1
    return estimate


# --- The traced product -------------------------------------------------------

# model -> (what the trace baked in, tf.function). The function holds only a
# weak reference to the model, so the cache never keeps one alive.
_FUNCTIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _hvp_function(model):
    """The model's cached `tf.function(x, y, sample_weight, vectors, training)`.

    A trace bakes in the compiled loss and the variable lists; a new
    `compile()` or a change of `layer.trainable` gets a new function (a
    tf.function would not retrace by itself when the new trainable variables
    have the same shapes as the old ones).
    """
    key = (
        private.compiled_loss(model),
        tuple(id(v) for v in model.trainable_variables),
        tuple(id(v) for v in model.non_trainable_variables),
        tuple(id(v) for v in model.metrics_variables),
    )
    cached = _FUNCTIONS.get(model)
    if cached is not None and _same_key(cached[0], key):
        return cached[1]
    ref = weakref.ref(model)

    def hvp(x, y, sample_weight, vectors, training):
        return _hvp(ref(), x, y, sample_weight, vectors, training)

    fn = tf.function(hvp, reduce_retracing=True)
    _FUNCTIONS[model] = (key, fn)
    return fn


def _same_key(a, b):
    return a[0] is b[0] and a[1:] == b[1:]


def _hvp(model, x, y, sample_weight, vectors, training):
    variables = model.trainable_variables
    # A measurement: put back what the pass updates (BatchNormalization
    # moving statistics and seed states when training=True; the loss trackers
    # compute_loss updates for multi-output models).
    state = list(model.non_trainable_variables) + list(model.metrics_variables)
    saved = [tf.identity(v) for v in state]
    with tf.GradientTape() as outer:
        with tf.GradientTape() as inner:
            y_pred = private.call_model(model, x, training)
            loss = private.compute_loss(model, x, y, y_pred, sample_weight, training)
            loss = tf.cast(loss, "float32")
        grads = inner.gradient(loss, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        dot = tf.add_n(
            [
                tf.reduce_sum(tf.cast(tf.convert_to_tensor(g), "float32") * tf.cast(v, "float32"))
                for g, v in zip(grads, vectors)
            ]
        )
    products = outer.gradient(dot, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)
    products = [tf.cast(tf.convert_to_tensor(p), var.dtype) for p, var in zip(products, variables)]
    with tf.control_dependencies(products):
        restores = [v.assign(s) for v, s in zip(state, saved)]
    with tf.control_dependencies(restores):
        return [tf.identity(p) for p in products]


def _mean_hvp(fn, batches, v):
    """`sum_b n_b H_b v / sum_b n_b` over the batches of `data`."""
    total, count = None, 0
    for x, y, sample_weight in batches():
        n = int(tf.shape(tf.nest.flatten(x)[0])[0])
        if n == 0:
            continue
        hv = fn(x, y, sample_weight, v, False)
        weighted = [h * n for h in hv]
        total = weighted if total is None else [a + b for a, b in zip(total, weighted)]
        count += n
    if total is None:
        raise ValueError(
            "`data` gave no samples: top_hessian_eigenvalue needs at least one non-empty batch."
        )
    return [t / count for t in total]


def _dot(a, b):
    return tf.add_n([tf.reduce_sum(p * q) for p, q in zip(a, b)])


def _normalized(vectors):
    norm = tf.linalg.global_norm(vectors)
    return [v / norm for v in vectors]


# --- Argument checks ----------------------------------------------------------


def _check_model(model):
    if not isinstance(model, keras.Model):
        raise TypeError(
            "`model` must be a keras.Model. "
            f"Received: model={model!r} of type {type(model).__name__}"
        )
    if not model.built or not model.trainable_variables:
        raise ValueError(
            "`model` must be built and have trainable variables (the vectors "
            "are shaped like them): call it on a batch or fit it first. "
            f"Received: model={_model_name(model)} with "
            f"{len(model.trainable_variables)} trainable variables"
        )
    if not getattr(model, "compiled", False):
        raise ValueError(
            "`model` must be compiled: H is the Hessian of the loss passed to "
            "compile() (plus regularizers and add_loss). Call "
            "model.compile(loss=...) first. "
            f"Received: model={_model_name(model)}, which is not compiled"
        )


def _model_name(model):
    return f"<{type(model).__name__} name={model.name}>"


def _check_vectors(model, vectors):
    variables = model.trainable_variables
    if not isinstance(vectors, (list, tuple)):
        raise TypeError(
            "`vectors` must be a list with one tensor per trainable variable "
            f"({len(variables)} for this model), shaped like them. "
            f"Received: vectors={_describe(vectors)}"
        )
    if len(vectors) != len(variables):
        raise ValueError(
            f"`vectors` must have one tensor per trainable variable: "
            f"{len(variables)} (shapes {[tuple(v.shape) for v in variables]}). "
            f"Received: vectors={_describe(vectors)} ({len(vectors)} tensors)"
        )
    out = []
    for i, (vector, var) in enumerate(zip(vectors, variables)):
        try:
            tensor = tf.convert_to_tensor(vector)
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"`vectors[{i}]` is not a tensor: {e}. Received: vectors={_describe(vectors)}"
            ) from None
        if not (tensor.dtype.is_floating or tensor.dtype.is_integer):
            raise TypeError(
                f"`vectors[{i}]` must be numeric; its dtype is {tensor.dtype.name}. "
                f"Received: vectors={_describe(vectors)}"
            )
        if not tensor.shape.is_compatible_with(var.shape) or tensor.shape.rank != len(var.shape):
            raise ValueError(
                f"`vectors[{i}]` must have the shape of "
                f"model.trainable_variables[{i}] ('{var.path}'): "
                f"{tuple(var.shape)}; it has {_shape(tensor)}. "
                f"Received: vectors={_describe(vectors)}"
            )
        out.append(tf.cast(tensor, var.dtype))
    return out


def _shape(tensor):
    return tuple(tensor.shape.as_list()) if tensor.shape.rank is not None else "unknown rank"


def _describe(value):
    """A short description: tensors by shape, not by value."""
    if isinstance(value, (list, tuple)):
        items = ", ".join(_describe(v) for v in value[:8])
        more = ", ..." if len(value) > 8 else ""
        open_, close = ("[", "]") if isinstance(value, list) else ("(", ")")
        return f"{open_}{items}{more}{close}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_describe(v)}" for k, v in value.items()) + "}"
    shape = getattr(value, "shape", None)
    if shape is not None and not isinstance(value, numbers.Number):
        dtype = getattr(value, "dtype", None)
        name = getattr(dtype, "name", dtype)
        return f"<{type(value).__name__} shape={tuple(shape)} dtype={name}>"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _to_tensors(x, y, sample_weight):
    def convert(t):
        return t if t is None or tf.is_tensor(t) else tf.convert_to_tensor(t)

    return tuple(tf.nest.map_structure(convert, s) for s in (x, y, sample_weight))


def _check_data(data):
    """Returns a callable giving the batches of `data` as `(x, y, sw)` tuples."""
    if isinstance(data, tf.data.Dataset):
        cardinality = int(data.cardinality())
        if cardinality == int(tf.data.INFINITE_CARDINALITY):
            raise ValueError(
                "`data` must be a finite dataset (it is iterated once per "
                "power iteration); take a fixed sample, e.g. "
                f"dataset.take(n). Received: data={data!r} (infinite)"
            )
        if cardinality == 0:
            raise ValueError(f"`data` has no batches. Received: data={data!r}")

        def batches():
            for element in data:
                yield keras.utils.unpack_x_y_sample_weight(element)

        return batches
    if isinstance(data, (tuple, list)) and len(data) in (2, 3):
        batch = _to_tensors(*(tuple(data) + (None,) * (3 - len(data))))

        def one_batch():
            yield batch

        return one_batch
    raise TypeError(
        "`data` must be a tf.data.Dataset of (x, y) or (x, y, sample_weight) "
        "batches, or a tuple (x, y) or (x, y, sample_weight) used as one batch. "
        f"Received: data={_describe(data)}"
    )


def _check_seed(seed):
    if seed is None:
        return None
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise ValueError(f"`seed` must be None or a non-negative integer. Received: seed={seed!r}")
    return int(seed)
