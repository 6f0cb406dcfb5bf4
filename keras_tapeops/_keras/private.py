"""Private Keras attributes of the model and its trainer (see the package docstring).

Keras 3 has no public API for these few things; each function says why it
needs the private name, so that a Keras upgrade breaks in one place only.
The compiled loss, optimizers, model classes and masks have their own
modules beside this one.
"""

import contextlib
import threading

import keras
from keras.src.saving.keras_saveable import KerasSaveable  # noqa: F401

# `KerasSaveable` (above) is the private base class of what `model.save` and
# `save_weights` walk (layers, optimizers, metrics): an attribute of a model
# that is one is saved under the attribute's name with its
# `save_own_variables` and restored with `load_own_variables`. Keras exports
# no public base for saveable state that is neither a layer (whose variables
# would be weights) nor a metric (which `fit` resets every epoch); the
# training state of keras_tapeops options (`training_state.TrainingState`) is one.


def loss_tracker(model):
    """Returns the `Mean` metric behind the logged `loss` (`model._loss_tracker`).

    Stock `train_step` updates it directly; a replacement step must too, or
    `loss` disappears from History and the progress bar.
    """
    return model._loss_tracker


def add_to_mean_total(metric, amount):
    """Adds `amount` to a `keras.metrics.Mean`'s running total, not to its count.

    `Mean.update_state(values, sample_weight)` adds `sum(values *
    sample_weight)` to `metric.total` and `sum(sample_weight)` to
    `metric.count`; a correction of what a step already logged must change
    the total alone. `total` is a `Reduce` metric's attribute, not a
    documented API (checked on Keras 3.10 and 3.15).
    """
    metric.total.assign_add(keras.ops.cast(amount, metric.total.dtype))


def compute_loss(model, x, y, y_pred, sample_weight, training):
    """Calls `model.compute_loss` like stock `train_step` does.

    `Trainer._compute_loss` passes `training=` only to `compute_loss`
    overrides that accept it (the argument is newer than some user code).
    """
    return model._compute_loss(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training
    )


def call_model(model, x, training):
    """Calls the model forward the way stock `train_step` does.

    `_call_has_training_arg` tells whether `call()` accepts `training=`.
    """
    if model._call_has_training_arg:
        return model(x, training=training)
    return model(x)


@contextlib.contextmanager
def optimizer_all_reduce_disabled(optimizer):
    """Stops `optimizer` from all-reducing gradients inside this block.

    The TensorFlow optimizer sums gradients across replicas in
    `_all_reduce_sum_gradients`. keras_tapeops all-reduces once itself
    (gradient transforms must see the aggregated gradient), so the optimizer
    must not do it a second time. Patches the instance (and the inner
    optimizer of a LossScaleOptimizer) and restores it on exit.

    Re-entrant: under MirroredStrategy every replica thread enters this block
    on the same optimizer, and they leave it in any order after the
    optimizer's merge_call; the patch stays until the last one leaves.
    """
    targets = sub_optimizers(optimizer)
    with _PATCH_LOCK:
        for target in targets:
            depth = _PATCH_DEPTH.get(id(target), 0)
            if depth == 0:
                target._all_reduce_sum_gradients = _identity_all_reduce
            _PATCH_DEPTH[id(target)] = depth + 1
    try:
        yield
    finally:
        with _PATCH_LOCK:
            for target in targets:
                depth = _PATCH_DEPTH.pop(id(target)) - 1
                if depth:
                    _PATCH_DEPTH[id(target)] = depth
                else:
                    del target._all_reduce_sum_gradients


_PATCH_LOCK = threading.Lock()
_PATCH_DEPTH: dict[int, int] = {}  # id(optimizer) -> how many blocks are open on it


def _identity_all_reduce(grads_and_vars):
    return list(grads_and_vars)


def logged_metric_names(model, metrics, y=None, y_pred=None):
    """Names stock Keras logs for `model`: loss, compiled metrics, per-output losses.

    The compiled metrics (`model._compile_metrics`, a `CompileMetrics`) are
    built lazily (Keras builds them symbolically before the first step of
    `fit`/`evaluate`, or on their first update) and list their names only
    once built; given `y` and `y_pred` this builds them first, as their
    first update would. keras_tapeops's logged names must not reuse these
    (an entry would overwrite the metric's in History).

    Args:
        model: the compiled model.
        metrics: the model's stock `metrics` list (without keras_tapeops's).
        y, y_pred: optional batch targets and outputs.

    Returns:
        The list of names, or None while the compiled metrics or the
        compiled loss (`model._compile_loss`, whose per-output loss trackers
        appear when it is built) are not built and no `y_pred` is given.
    """
    compiled = model._compile_metrics
    compiled_loss = model._compile_loss
    unbuilt = [c for c in (compiled, compiled_loss) if c is not None and not c.built]
    if unbuilt and y_pred is None:
        return None
    if compiled is not None and not compiled.built:
        compiled.build(y, y_pred)
    names = []
    for metric in metrics:
        if metric is compiled:
            names.extend(m.name for m in compiled.metrics)
        else:
            names.append(metric.name)
    return names


def symbolic_build(model, data):
    """Builds `model`'s compiled metrics and loss on symbolic tensors of `data`.

    Keras does this (`Trainer._symbolic_build`, private) before the first
    step under a distribution strategy and otherwise when it traces the
    step. An eagerly run step (`run_eagerly=True`) calls it before its
    forward pass so that the names Keras logs are known before anything
    (BatchNormalization statistics included) changes.
    """
    model._symbolic_build(data_batch=data)


def build_compiled_loss(model, data):
    """Builds `model`'s compiled loss (`_compile_loss`, private) for the batch `data`.

    For a functional model whose `call` is Keras's own, the loss is built
    from its `output` (public: the structure it was built with) and `y`,
    which is what Keras's symbolic build passes (`Functional.compute_output_spec`
    packs the outputs into that structure; a one-element list stays a list;
    Keras 3.10 to 3.15), without tracing the model. Any other model goes
    through Keras's symbolic build, which traces its forward pass (about half
    a second of MobileNetV2's first epoch, bench/first_epoch.py).
    """
    compile_loss = compiled_loss(model)
    if compile_loss is None or compile_loss.built:
        return
    from keras_tapeops._keras.models import functional_class

    if is_functional(model) and type(model).call is functional_class().call:
        compile_loss.build(data[1], model.output)
        return
    symbolic_build(model, data)


def is_loss_scale_optimizer(optimizer):
    """True for Keras's `LossScaleOptimizer` (public class, checked here for clarity)."""
    return isinstance(optimizer, keras.optimizers.LossScaleOptimizer)


def is_functional(model):
    """True for a model built from inputs/outputs (`keras.src.models.Functional`).

    Keras exports no public name for the functional model class.
    """
    from keras_tapeops._keras.models import functional_class

    return isinstance(model, functional_class())


def direct_sublayers(layer):
    """Returns the layers directly tracked by `layer` (`layer._flatten_layers`).

    `Model.layers` is public, but a plain custom `Layer` that owns other layers
    exposes them only through this private helper; loss terms need it to
    resolve paths such as "block/dense" into layers nested in custom layers.
    """
    return list(layer._flatten_layers(include_self=False, recursive=False))


def all_layers(model):
    """Every layer inside `model`, nested ones included, without `model` itself.

    Keras 3 has no public recursive layer walk (`model.layers` lists only the
    direct children); `_flatten_layers` is what Keras itself uses to collect
    weights. Used by `where=` selectors (issue 3) to find nested layers.
    """
    return list(model._flatten_layers(include_self=False, recursive=True))


def in_symbolic_build():
    """True while Keras traces a layer symbolically (`in_symbolic_scope()`).

    Keras builds an unbuilt layer by running its `call` once on placeholders
    in a scratch graph inside `keras.SymbolicScope` (public), but only the
    private `in_symbolic_scope()` tells whether that scope is active. Layer
    outputs produced there are not part of the step's forward pass and must
    not be recorded for loss terms.
    """
    from keras.src.backend.common.symbolic_scope import in_symbolic_scope

    return in_symbolic_scope()


def own_variables(layer):
    """The variables `layer` itself tracks (not its sublayers'), as Keras saves them.

    `Layer.save_own_variables` writes `layer._trainable_variables +
    layer._non_trainable_variables` (private lists) as "0", "1", ...; reading
    a file whose model-level entry has more of them needs the same list.
    """
    return list(layer._trainable_variables) + list(layer._non_trainable_variables)


def maybe_symbolic_build(model, iterator, data_batch, stock):
    """Keras's `_maybe_symbolic_build`, working under MultiWorkerMirroredStrategy.

    keras-team/keras#20585: before the first step Keras builds the model from
    the first batch; with a multi-worker strategy that batch is a
    `PerReplica` value and Keras's `strategy.reduce("MEAN", ...)` of it
    fails ("Attempt to convert a value (PerReplica...)"). Only the shapes and
    dtypes matter for the build, so the local replica's batch is used.
    Under MirroredStrategy Keras's MEAN reduce of that batch also fails on a
    boolean tensor (`kt.privacy.poisson_batches`' mask), so every strategy
    with more than one replica builds from the local replica's batch.
    Every other strategy takes Keras's own path (`stock`).
    """
    import tensorflow as tf

    strategy = model.distribute_strategy
    several = _is_multi_worker(strategy) or strategy.num_replicas_in_sync > 1
    if iterator is None or not several:
        stock(iterator=iterator, data_batch=data_batch)
        _build_multi_output_loss(model, iterator, data_batch)
        return
    for item in iterator:
        # Keras 3.15 yields (begin, end, iterator), Keras 3.10 (step, iterator).
        data_batch = next(item[-1])
        break
    data_batch = tf.nest.map_structure(
        lambda v: (
            strategy.experimental_local_results(v)[0]
            if isinstance(v, tf.distribute.DistributedValues)
            else v
        ),
        data_batch,
    )
    with strategy.scope():
        model._symbolic_build(data_batch=data_batch)


def _build_multi_output_loss(model, iterator, data_batch):
    """Builds a multi-output model's compiled loss before the step is traced.

    Without a strategy scope Keras 3.10-3.15 defers the build to the first
    trace of `train_function`. A multi-output `CompileLoss` then creates its
    per-output `Mean` trackers (variables) inside that trace, so
    `tf.function` traces the whole step twice: the first `fit` of every
    multi-output model (every task-balancing model) pays for two traces.
    Keras's own symbolic build (the one it runs under a strategy) from the
    dataset's `element_spec` creates them first; nothing is read from the
    data, and every other model keeps Keras's deferred build.
    """
    loss = getattr(model, "_compile_loss", None)
    outputs = getattr(model, "outputs", None) or ()
    if loss is None or loss.built or len(outputs) < 2:
        return
    if data_batch is None:
        dataset = getattr(iterator, "_distributed_dataset", None)
        data_batch = getattr(dataset, "element_spec", None)
        if data_batch is None:
            return
    model._symbolic_build(data_batch=data_batch)


def _is_multi_worker(strategy):
    import tensorflow as tf

    return isinstance(
        strategy,
        (
            tf.distribute.MultiWorkerMirroredStrategy,
            tf.distribute.experimental.MultiWorkerMirroredStrategy,
        ),
    )


def with_multi_worker_logs(model, function):
    """`function` (a Keras train/test function), fixed for multi-worker logs.

    Keras averages each step's logs over replicas with
    `strategy.reduce("MEAN", value, axis=0)` under a multi-worker strategy,
    which fails for the scalar logs every model returns ("Invalid reduction
    dimension 0 for input with 0 dimensions"; the second failure reported
    with keras-team/keras#20585). While this model's function runs (and so
    while it is traced), the module's `reduce_per_replica` reduces scalars
    with `axis=None`; other strategies, other reductions and other models
    keep Keras's code. Returns `function` itself for other strategies.
    """
    if function is None or not _is_multi_worker(model.distribute_strategy):
        return function
    if getattr(function, "_tapeops_multi_worker", False):
        return function

    def call(*args, **kwargs):
        with _multi_worker_mean():
            return function(*args, **kwargs)

    call._tapeops_multi_worker = True
    return call


@contextlib.contextmanager
def _multi_worker_mean():
    import tensorflow as tf
    from keras.src.backend.tensorflow import trainer as tf_trainer

    stock = tf_trainer.reduce_per_replica

    def reduce_per_replica(values, strategy, reduction):
        if reduction not in ("auto", "mean") or not _is_multi_worker(strategy):
            return stock(values, strategy, reduction)

        def mean(value):
            local = strategy.experimental_local_results(value)[0]
            axis = 0 if tf.convert_to_tensor(local).shape.rank else None
            return strategy.reduce("MEAN", value, axis=axis)

        return tf.nest.map_structure(mean, values)

    tf_trainer.reduce_per_replica = reduce_per_replica
    try:
        yield
    finally:
        tf_trainer.reduce_per_replica = stock


def compiled_loss(model):
    """The loss object `compile()` built (`model._compile_loss`), or None.

    Keras has no public handle on it. The traced Hessian-vector product
    bakes it in, so a new `compile()` (a new object here) must retrace.
    """
    return getattr(model, "_compile_loss", None)


def sub_optimizers(optimizer):
    """`optimizer` and every optimizer it delegates to, outermost first.

    A `LossScaleOptimizer` wraps one (`inner_optimizer`, public); a Keras 3.15
    `MultiOptimizer` holds one per group (`optimizers`, public). Each of them
    would all-reduce or clip the gradients it receives.
    """
    found = [optimizer]
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None:
        found += sub_optimizers(inner)
    multi = getattr(keras.optimizers, "MultiOptimizer", None)
    if multi is not None and isinstance(optimizer, multi):
        for sub in optimizer.optimizers:
            found += sub_optimizers(sub)
    return found


def trainable_capable_variables(model):
    """Every variable of `model` created trainable, frozen now or not.

    A layer frozen with `layer.trainable = False` sets its variables'
    `trainable` to False, so the public flags cannot tell a frozen kernel from
    a moving mean. Keras keeps the variables a layer created as trainable in
    the private store `layer._trainable_variables` (its own `trainable`
    setter walks it). Used by selectors (a rule on frozen layers warns) and
    optimizer groups (frozen groups are mapped too).

    Returns:
        The variables in `model.weights` order.
    """
    capable = set()
    for layer in [model] + all_layers(model):
        for variable in created_trainable_variables(layer):
            capable.add(id(variable))
    seen = set()
    out = []
    for variable in model.weights:
        if id(variable) in capable and id(variable) not in seen:
            seen.add(id(variable))
            out.append(variable)
    return out


def created_trainable_variables(layer):
    """The variables `layer` itself created trainable, frozen now or not.

    Keras keeps them in the private list `layer._trainable_variables` (Keras
    3.10 to 3.15), the one its `trainable` setter walks; sublayers' variables
    are not in it. No public API lists a layer's own variables apart from its
    sublayers', nor tells a frozen kernel from a non-trainable one (see
    `trainable_capable_variables`). An object without the list gives [].
    """
    return list(getattr(layer, "_trainable_variables", []))
