"""`compile(micro_batches=k)`: one batch, k sequential forward/backward passes.

Each micro-batch's loss is multiplied by `n_micro / n_batch` before
differentiation, so the summed gradient is the gradient of the whole batch's
loss under Keras's default `"sum_over_batch_size"` reduction (sample and class
weights included, regularization losses counted once). The logged loss, the
loss terms and the metrics equal the whole batch's: each micro-batch logs its
loss with weight `n_micro`, and the metrics see the concatenated predictions.

The loop is a `tf.while_loop` with `parallel_iterations=1`, and each loop
starts only once the gradients before it are summed: one micro-batch's
activations are alive at a time. Gradients stay per replica (no all-reduce
inside the loop); `apply_optimizer_step` all-reduces the sum once.
"""

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
    n = tf.shape(next(t for t in tf.nest.flatten(x) if t is not None))[0]
    q, r, n_small = splitting.plan(n, k)
    small, large = splitting.stack_groups(
        data, q, r, n_small, pad_empty=bool(model.jit_compile)
    )
    n_float = tf.cast(n, tf.float32)

    options = model.tapeops_options
    stats = None
    if options is not None and options.batch_norm_updates == "large_batch":
        stats = LargeBatchStatistics(model)
        if not stats.layers:
            stats = None
    bn_state = stats.start() if stats is not None else []
    momentum = stats.momentum_zero() if stats is not None else _no_context()

    def one_pass(micro, size, bn_state):
        grads, y_pred = model.batch_gradients(
            *micro, loss_multiplier=tf.cast(size, tf.float32) / n_float
        )
        if stats is not None:
            bn_state = stats.add(bn_state, size)
        return grads, y_pred, bn_state

    with momentum:
        # The first micro-batch runs outside the loops: it fixes which
        # gradients are None and the predictions' structure and dtypes.
        grads, y_pred, bn_state = one_pass(
            splitting.take(data, small, 0), q, bn_state
        )
        present = [g is not None for g in grads]
        sums = [_dense(g) for g in grads if g is not None]
        flat_pred = tf.nest.flatten(y_pred)

        def run_group(stacked, count, size, start, sums, bn_state, first):
            arrays = [
                tf.TensorArray(
                    t.dtype, size=count, element_shape=[None] + t.shape[1:].as_list()
                )
                for t in flat_pred
            ]
            if first is not None:
                arrays = [a.write(0, t) for a, t in zip(arrays, first)]
            start = _after(start, sums + tf.nest.flatten(bn_state))

            def body(i, sums, arrays, bn_state):
                g, pred, bn_state = one_pass(
                    splitting.take(data, stacked, i), size, bn_state
                )
                g = [_dense(t) for t, on in zip(g, present) if on]
                sums = [s + t for s, t in zip(sums, g)]
                arrays = [
                    a.write(i, t) for a, t in zip(arrays, tf.nest.flatten(pred))
                ]
                return i + 1, sums, arrays, bn_state

            _, sums, arrays, bn_state = tf.while_loop(
                lambda i, *_: i < count,
                body,
                (start, sums, arrays, bn_state),
                parallel_iterations=1,
            )
            outputs = [
                splitting.unstack_group(a.stack(), t) for a, t in zip(arrays, flat_pred)
            ]
            return sums, outputs, bn_state

        sums, preds_small, bn_state = run_group(
            small, n_small, q, tf.constant(1), sums, bn_state, flat_pred
        )
        sums, preds_large, bn_state = run_group(
            large, r, q + 1, tf.constant(0), sums, bn_state, None
        )
    if stats is not None:
        stats.finish(bn_state, n)

    y_pred = tf.nest.pack_sequence_as(
        y_pred,
        [tf.concat([a, b], axis=0) for a, b in zip(preds_small, preds_large)],
    )
    it = iter(sums)
    grads = [next(it) if on else None for on in present]
    return grads, y_pred


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


class _no_context:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
