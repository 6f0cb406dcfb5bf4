"""`compile(micro_batches=k)`: one batch, k sequential forward/backward passes.

Each micro-batch's loss is multiplied by `n_micro / n_batch` before
differentiation (regularization losses and loss terms count once, as per-sample
means), and each output's compiled loss is rescaled so that its share is
`normalizer_micro / normalizer_batch` for its own reduction (see
reductions.py): the summed gradient is the gradient of the whole batch's loss
for every Keras reduction (`"sum_over_batch_size"`, `"mean"`, `"sum"`,
`"mean_with_sample_weight"`), with sample and class weights, uneven splits and
multi-output losses mixing reductions. A mean-reduced output with a Keras mask
is differentiated apart (one more backward pass per such output) and divided
by the batch's number of unmasked entries at the end. The logged loss, the
loss terms and the metrics equal the whole batch's: each micro-batch logs its
(rescaled) loss with weight `n_micro`, and the metrics see the concatenated
predictions (a masked output's share of the logged loss is corrected to the
whole batch's once the loop ends: `reductions.correct_logged_total`).

The forward/backward pass is traced once, as a concrete function whose
outputs say which gradients exist and what the predictions look like; one
`tf.while_loop` (`parallel_iterations=1`) calls it on each micro-batch in
turn. It is traced with a static micro-batch size when the batch's is static
and splits evenly, as stock Keras traces its first step with the batch's.
Under XLA, whose loops need one shape per loop, the `q`- and `(q + 1)`-sized
micro-batches run in two loops calling the same function. Each loop starts
only once the gradients before it are summed: one micro-batch's activations
are alive at a time. Gradients stay per replica (no all-reduce inside the
loop); `apply_optimizer_step` all-reduces the sum once.
"""

from __future__ import annotations

import contextlib

import keras
import tensorflow as tf

from keras_tapeops.accumulation import reduction_kinds
from keras_tapeops.accumulation import reductions
from keras_tapeops.accumulation import splitting
from keras_tapeops.accumulation.batch_norm import LargeBatchStatistics
from keras_tapeops.accumulation.flat import FlatLayout
from keras_tapeops import split_sizes
from keras_tapeops.typing_aliases import Gradient
from keras_tapeops.typing_aliases import Nested


def micro_batch_gradients(
    model: keras.Model, x: Nested, y: Nested, sample_weight: Nested, k: int
) -> tuple[list[Gradient], Nested]:
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
    grads, y_pred, _ = micro_batch_pass(model, x, y, sample_weight, k)
    return grads, y_pred


def micro_batch_pass(model, x, y, sample_weight, k):
    """`micro_batch_gradients`, plus what the batch's pass saw of its loss.

    Returns:
        `(grads, y_pred, seen)`: `seen` is None when the loss is not read
        (see `reductions.analysable`), else a `PassSummary` (the outputs'
        records, whether regularization losses were present, and the
        batch's normalizer of every masked output).
    """
    data = (x, y, sample_weight)
    if not model.built:
        _build_symbolically(model, x)
    first = next(t for t in tf.nest.flatten(x) if t is not None)
    n = tf.shape(first)[0]
    n_float = tf.cast(n, tf.float32)
    stats = LargeBatchStatistics(model)
    if model.tapeops_options.batch_norm_updates != "large_batch" or not stats.layers:
        stats = None
    bn_before = stats.read() if stats is not None else []
    bn_state = stats.start() if stats is not None else []
    exact = reductions.analysable(model)
    totals = {}
    if exact:
        reductions.build_compiled_loss(model, x, y, sample_weight)
        totals = reductions.weight_totals(model, sample_weight)
    option = reduction_kinds.option_of(model.tapeops_options)
    seen = {}
    variables = model.trainable_variables

    def one_pass(micro, size, bn_state, taped):
        multiplier = tf.cast(size, tf.float32) / n_float
        if not exact:
            grads, y_pred = model.batch_gradients(*micro, loss_multiplier=multiplier)
            masked_grads, masked_sizes, logged, masked_logged = [], [], [], []
        else:
            grads, y_pred, masked_grads, masked_sizes, logged, masked_logged = _exact_pass(
                model, micro, multiplier, n_float, totals, option, seen, taped
            )
        if stats is not None:
            bn_state = stats.add(bn_state, size)
        # One flat sum per dtype for the folded loss's gradients and for each
        # masked output's: the loop carries a few vectors, not one variable
        # per gradient (flat.py).
        parts = [grads] + list(masked_grads)
        seen["present"] = [[g is not None for g in part] for part in parts]
        seen["layouts"] = [
            FlatLayout(
                [v.shape for v, g in zip(variables, part) if g is not None],
                [_dtype(g) for g in part if g is not None],
            )
            for part in parts
        ]
        packed = [
            layout.pack([_dense(g) for g in part if g is not None])
            for layout, part in zip(seen["layouts"], parts)
        ]
        return packed, y_pred, bn_state, masked_sizes, logged, masked_logged

    groups = splitting.groups(data, n, k, static_shapes=bool(model.jit_compile))
    momentum = stats.momentum_zero() if stats is not None else contextlib.nullcontext()
    specs = (
        # XLA's second loop reads (q + 1)-sized micro-batches: no static size.
        _spec(groups[0][2](0), batch=None if model.jit_compile else _even_size(first.shape[0], k)),
        tf.TensorSpec([], tf.int32),
        _spec(bn_state, batch=False),
    )

    def trace(taped):
        # autograph=False: Keras traces its own step functions unconverted
        # (`do_not_convert`), and converting this module's code cost the
        # first epoch about 2 s on MobileNetV2 (bench/first_epoch.py).
        def traced_pass(micro, size, bn_state):
            return one_pass(micro, size, bn_state, taped)

        return tf.function(traced_pass, autograph=False).get_concrete_function(*specs)

    with momentum:
        # The pass is traced without a tape around it; only a masked output's
        # loss (differentiated apart) needs one, and then the pass is traced
        # again with it. A tape around the whole pass also records its
        # backward pass: about 0.8 CPU-seconds of MobileNetV2's first epoch.
        traced = trace(taped=False)
        if exact and any(r.kind == "masked" for r in seen["records"]):
            traced = trace(taped=True)
    _, pred_spec, _, masked_sizes_spec, logged_spec, _ = traced.structured_outputs
    # One (packed) gradient sum for the folded loss, one per masked output.
    present, layouts = seen["present"], seen["layouts"]
    sums = [layout.zeros() for layout in layouts]
    sizes = [tf.constant(0.0) for _ in masked_sizes_spec]
    logged = [tf.constant(0.0) for _ in logged_spec]
    masked_logged = [tf.constant(0.0) for _ in masked_sizes_spec]
    flat_pred_spec = tf.nest.flatten(pred_spec)

    outputs = []
    for count, size_of, take in groups:
        arrays = [
            tf.TensorArray(t.dtype, size=count, element_shape=t.shape, infer_shape=False)
            for t in flat_pred_spec
        ]
        start = _after(tf.constant(0), tf.nest.flatten(sums) + bn_before + bn_state)

        def body(
            i, sums, sizes, logged, masked_logged, arrays, bn_state, size_of=size_of, take=take
        ):
            packed, pred, bn_state, masked_sizes, shares, masked_shares = traced(
                take(i), size_of(i), bn_state
            )
            sums = [[s + t for s, t in zip(ps, pt)] for ps, pt in zip(sums, packed)]
            sizes = [a + b for a, b in zip(sizes, masked_sizes)]
            logged = [a + b for a, b in zip(logged, shares)]
            masked_logged = [a + b for a, b in zip(masked_logged, masked_shares)]
            arrays = [a.write(i, t) for a, t in zip(arrays, tf.nest.flatten(pred))]
            return i + 1, sums, sizes, logged, masked_logged, arrays, bn_state

        _, sums, sizes, logged, masked_logged, arrays, bn_state = tf.while_loop(
            lambda i, *_: i < count,
            body,
            (start, sums, sizes, logged, masked_logged, arrays, bn_state),
            parallel_iterations=1,
        )
        outputs.append([a.concat() for a in arrays])
    if stats is not None:
        stats.finish(bn_before, bn_state, n)

    y_pred = tf.nest.pack_sequence_as(
        pred_spec, [tf.concat(parts, axis=0) for parts in zip(*outputs)]
    )
    grads = _combine([layout.unpack(s) for layout, s in zip(layouts, sums)], sizes, present)
    summary = None
    if exact:
        if model._tapeops_logging:  # not in SAM's second pass
            reductions.log_output_losses(model, seen["records"], logged, sizes)
            reductions.correct_logged_total(
                model, seen["records"], logged, sizes, masked_logged, n_float
            )
        summary = PassSummary(seen["records"], seen["regularized"], sizes)
    return grads, y_pred, summary


class PassSummary:
    """What one batch's pass saw of its loss (Python facts, batch-level tensors).

    Attributes:
        records: the outputs' `reductions.Record`s of the traced pass (their
            tensors belong to that trace: read only the Python fields).
        regularized: whether regularization or `add_loss` losses were present.
        masked_sizes: the batch's normalizer of each masked output, in
            record order (tensors of the caller's graph).
    """

    def __init__(self, records, regularized, masked_sizes):
        self.records = list(records)
        self.regularized = regularized
        self.masked_sizes = list(masked_sizes)


def _exact_pass(model, micro, multiplier, n, totals, option, seen, taped):
    """One micro-batch's pass with every output's share rescaled (see reductions.py).

    Args:
        taped: record the pass on a tape, to differentiate the masked
            outputs' losses (without one, `masked_grads` is empty).

    Returns:
        `(grads, y_pred, masked_grads, masked_sizes, logged, masked_logged)`:
        the folded loss's gradients; for each masked output the gradient of
        its summed loss and its normalizer in this micro-batch; each output's
        share of its logged loss for the batch (Keras's own per-output
        logging is muted, so it is logged once per batch, as stock Keras
        does); and what the micro-batch's logged `loss` holds of each masked
        output (corrected once per batch, `reductions.correct_logged_total`).
    """
    tape = tf.GradientTape(persistent=True) if taped else contextlib.nullcontext()
    with tape:
        with reductions.intercepted(
            model,
            lambda r: reductions.folded_value(r, n, totals),
            option,
            mute_output_trackers=True,
            on_other=lambda r: reductions.folded_other(r, n, totals),
        ) as records:
            grads, y_pred = model.batch_gradients(*micro, loss_multiplier=multiplier)
        masked = [r for r in records if r.kind == "masked"] if taped else []
        pieces = [reductions.numerator(r) for r in masked]
        if model.optimizer is not None:
            pieces = [model.optimizer.scale_loss(p) for p in pieces]
    variables = model.trainable_weights
    masked_grads = [tape.gradient(p, variables) for p in pieces]
    del tape
    seen["records"] = list(records)
    seen["regularized"] = bool(model.losses)
    logged = [reductions.logged_share(r, multiplier, n, totals) for r in records]
    masked_logged = [reductions.logged_masked_share(r) for r in masked]
    return grads, y_pred, masked_grads, [r.denominator for r in masked], logged, masked_logged


def _combine(sums, sizes, present):
    """The folded sum plus each masked output's sum over its normalizer."""
    out = []
    iters = [iter(s) for s in sums]
    for j in range(len(present[0])):
        total = None
        for part, (it, on_list) in enumerate(zip(iters, present)):
            if not on_list[j]:
                continue
            value = next(it)
            if part > 0:
                value = tf.math.divide_no_nan(value, tf.cast(sizes[part - 1], value.dtype))
            total = value if total is None else total + value
        out.append(total)
    return out


def _build_symbolically(model, x):
    """Creates an unbuilt model's variables from `x`'s shapes, before the loop.

    The traced pass must not create variables; calling the model on
    `keras.KerasTensor`s builds it the way Keras's own symbolic build does.
    """
    model(tf.nest.map_structure(lambda t: keras.KerasTensor(t.shape, t.dtype.name), x))


def _even_size(n, k):
    """Every micro-batch's size when the batch's (`n`) is static and splits evenly, else None.

    Keras traces the first step with the batch's static size (and the
    last, smaller batch with an unknown one), so a micro-batch pass traced
    with a static size is the graph stock Keras builds: the gradients of
    BatchNormalization's means, for one, are a few constant-shaped ops
    instead of a dozen shape computations each (MobileNetV2: about 800 of
    6700 ops; bench/first_epoch.py).
    """
    if n is None:
        return None
    sizes = split_sizes.micro_batch_sizes(n, k)
    return sizes[0] if sizes[0] == sizes[-1] else None


def _spec(structure, batch):
    """TensorSpecs of `structure` (None leaves kept).

    Args:
        batch: False to keep the first axis, None to make it unknown, or
            its static size.
    """

    def spec(t):
        if t is None:
            return None
        shape = t.shape.as_list()
        if batch is not False and shape:
            shape[0] = batch
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
