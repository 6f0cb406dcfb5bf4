"""`compile(micro_batches=k)`: one batch, k sequential forward/backward passes.

Each micro-batch's loss is multiplied by `n_micro / n_batch` before
differentiation, so the summed gradient is the gradient of the whole batch's
loss under Keras's default `"sum_over_batch_size"` reduction (sample and class
weights included, regularization losses counted once). The logged loss, the
loss terms and the metrics equal the whole batch's: each micro-batch logs its
loss with weight `n_micro`, and the metrics see the concatenated predictions.

The forward/backward pass is traced once, as a concrete function whose
outputs say which gradients exist and what the predictions look like; one
`tf.while_loop` (`parallel_iterations=1`) calls it on each micro-batch in
turn. Under XLA, whose loops need one shape per loop, the `q`- and
`(q + 1)`-sized micro-batches run in two loops calling the same function.
Each loop starts only once the gradients before it are summed: one
micro-batch's activations are alive at a time. Gradients stay per replica
(no all-reduce inside the loop); `apply_optimizer_step` all-reduces the sum
once.
"""

import contextlib

import keras
import tensorflow as tf

from keras_tapeops.accumulation import splitting
from keras_tapeops.accumulation.batch_norm import LargeBatchStatistics


def micro_batch_gradients(model, x, y, sample_weight, k):
    """Gradients of one batch computed over `k` micro-batches, one at a time.

    Args:
        model: a keras_tapeops model (its `batch_gradients` hook is used).
        x, y, sample_weight: the (per-replica) batch.
        k: requested number of micro-batches (a batch smaller than k uses
            one micro-batch per sample).

    Returns:
        `(grads, y_pred)`: the summed (optimizer-scaled, per-replica)
        gradients, one per trainable variable (None where the loss does not
        depend on it; sparse gradients are densified), and the predictions
        for the whole batch, in sample order.

    Example:
    ```python
    model.compile(optimizer="sgd", loss="mse", micro_batches=4)
    model.fit(x, y, batch_size=64)  # 4 passes of 16 samples, 1 step
    ```
    """
    data = (x, y, sample_weight)
    if not model.built:
        _build_symbolically(model, x)
    n = tf.shape(next(t for t in tf.nest.flatten(x) if t is not None))[0]
    n_float = tf.cast(n, tf.float32)
    stats = LargeBatchStatistics(model)
    if model.tapeops_options.batch_norm_updates != "large_batch" or not stats.layers:
        stats = None
    bn_state = stats.start() if stats is not None else []

    def one_pass(micro, size, bn_state):
        grads, y_pred = model.batch_gradients(
            *micro, loss_multiplier=tf.cast(size, tf.float32) / n_float
        )
        if stats is not None:
            bn_state = stats.add(bn_state, size)
        return grads, y_pred, bn_state

    groups = splitting.groups(data, n, k, static_shapes=bool(model.jit_compile))
    momentum = stats.momentum_zero() if stats is not None else contextlib.nullcontext()
    with momentum:
        traced = tf.function(one_pass).get_concrete_function(
            _spec(groups[0][2](0), batch=True), tf.TensorSpec([], tf.int32),
            _spec(bn_state, batch=False),
        )
    grads_spec, pred_spec, _ = traced.structured_outputs
    present = [g is not None for g in grads_spec]
    variables = model.trainable_variables
    sums = [
        tf.zeros(v.shape, _dtype(g)) for v, g, on in zip(variables, grads_spec, present) if on
    ]
    flat_pred_spec = tf.nest.flatten(pred_spec)

    outputs = []
    for count, size_of, take in groups:
        arrays = [
            tf.TensorArray(
                t.dtype, size=count, element_shape=t.shape, infer_shape=False
            )
            for t in flat_pred_spec
        ]
        start = _after(tf.constant(0), sums + tf.nest.flatten(bn_state))

        def body(i, sums, arrays, bn_state, size_of=size_of, take=take):
            g, pred, bn_state = traced(take(i), size_of(i), bn_state)
            g = [_dense(t) for t, on in zip(g, present) if on]
            sums = [s + t for s, t in zip(sums, g)]
            arrays = [a.write(i, t) for a, t in zip(arrays, tf.nest.flatten(pred))]
            return i + 1, sums, arrays, bn_state

        _, sums, arrays, bn_state = tf.while_loop(
            lambda i, *_: i < count, body, (start, sums, arrays, bn_state),
            parallel_iterations=1,
        )
        outputs.append([a.concat() for a in arrays])
    if stats is not None:
        stats.finish(bn_state, n)

    y_pred = tf.nest.pack_sequence_as(
        pred_spec, [tf.concat(parts, axis=0) for parts in zip(*outputs)]
    )
    it = iter(sums)
    grads = [next(it) if on else None for on in present]
    return grads, y_pred


def _build_symbolically(model, x):
    """Creates an unbuilt model's variables from `x`'s shapes, before the loop.

    The traced pass must not create variables; calling the model on
    `keras.KerasTensor`s builds it the way Keras's own symbolic build does.
    """
    model(tf.nest.map_structure(
        lambda t: keras.KerasTensor(t.shape, t.dtype.name), x
    ))


def _spec(structure, batch):
    """TensorSpecs of `structure` (None leaves kept); `batch`: first axis unknown."""
    def spec(t):
        if t is None:
            return None
        shape = t.shape.as_list()
        if batch and shape:
            shape[0] = None
        return tf.TensorSpec(shape, t.dtype)

    return tf.nest.map_structure(spec, structure)


def _dtype(grad):
    return grad.values.dtype if isinstance(grad, tf.IndexedSlices) else grad.dtype


def _after(start, tensors):
    """`start`, available only once `tensors` are computed.

    Outside XLA a while loop's variables enter it one by one, so the next
    micro-batch's forward pass (which needs only the loop index) could start
    while the previous pass's backward pass still holds its activations: two
    micro-batches in memory at once. Making the index wait for the gradient
    sums keeps one micro-batch alive at a time (measured in
    bench/accumulation.py: the step's peak drops by about one micro-batch).
    """
    with tf.control_dependencies(tensors):
        return tf.identity(start)


def _dense(grad):
    if isinstance(grad, tf.IndexedSlices):
        return tf.convert_to_tensor(grad)
    return grad
