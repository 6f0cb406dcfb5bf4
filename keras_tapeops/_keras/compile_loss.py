"""Reads and writes of Keras's compiled loss (`CompileLoss`), isolated here.

`compile(loss=...)` builds a `keras.src.trainers.compile_utils.CompileLoss`
(`model._compile_loss`, see `private.compiled_loss`). Keras 3 has no public
per-output view of it: `CompileLoss.call` restructures `y_true`/`y_pred`,
loops over one entry per output, logs each output's loss in a `Mean` tracker
and returns only the weighted sum. keras_tapeops's per-example losses,
accumulation reductions and attack objectives need what that loop sees, so
they read (and, for one block, replace) the private attributes below. Every
attribute is set in `CompileLoss.__init__` and filled by `CompileLoss.build`,
checked on Keras 3.10 to 3.15.
"""

import contextlib


def flat_losses(compile_loss):
    """The per-output entries `CompileLoss.call` iterates (`_flat_losses`), as a list.

    Each entry is a `CompileLoss.Loss(path, loss, loss_weights, name)`
    namedtuple built by `build()` (None before). No public API lists an
    output's loss function, weight and path in the order the loss sums them.
    """
    return list(compile_loss._flat_losses)


def set_flat_losses(compile_loss, entries):
    """Replaces the per-output entries `CompileLoss.call` iterates (`_flat_losses`).

    Used to wrap each output's loss function for one block (and to put the
    original list back after it); Keras offers no hook around one output's
    loss.
    """
    compile_loss._flat_losses = list(entries)


def y_pred_build_structure(compile_loss):
    """The structure of `y_pred` the loss was built with (`_y_pred_build_structure`).

    `CompileLoss.call` repacks a `y_pred` of another structure (a list for a
    dict, say) into this one before pairing it with the losses; a reader of
    the per-output values must pair them the same way. Set by `build()`.
    """
    return compile_loss._y_pred_build_structure


def y_true_build_structure(compile_loss):
    """The structure of `y_true` the loss was built with (`_y_true_build_structure`).

    The counterpart of `y_pred_build_structure`, repacked the same way by
    `CompileLoss.call`. Set by `build()`.
    """
    return compile_loss._y_true_build_structure


def user_loss(compile_loss):
    """The `loss=` argument as `compile()` received it (`_user_loss`).

    `CompileLoss.call` uses its structure (with `None` for an output without
    a loss) to place the targets of a model whose `y` lists fewer values than
    it has outputs; `compile()` keeps no public copy of the argument.
    """
    return compile_loss._user_loss


def output_trackers(compile_loss):
    """The per-output loss trackers `CompileLoss.call` updates (`_metrics`), or None.

    One `Mean` per output behind the `<output>_loss` logs of a multi-output
    model; `call` updates each with `if metric: metric.update_state(...)`.
    The public `metrics` property returns the same trackers but not the list
    `call` reads, which is what `set_output_trackers` replaces.
    """
    return getattr(compile_loss, "_metrics", None)


def set_output_trackers(compile_loss, trackers):
    """Replaces the per-output trackers `CompileLoss.call` updates (`_metrics`).

    `None`s in place of the trackers mute them (see `output_trackers`): an
    extra call of the compiled loss is then not logged as the model's loss.
    """
    compile_loss._metrics = list(trackers)


@contextlib.contextmanager
def output_trackers_muted(compile_loss):
    """Stops a built `CompileLoss` from updating its per-output trackers in this block.

    Replaces its `_metrics` list (see `output_trackers`) by as many `None`s
    and puts the trackers back on exit. An unbuilt loss, or one without
    trackers, is left as is (its first call builds the trackers, which
    `fit`/`evaluate` reset).
    """
    trackers = output_trackers(compile_loss)
    if not getattr(compile_loss, "built", False) or not trackers:
        yield
        return
    compile_loss._metrics = [None] * len(trackers)
    try:
        yield
    finally:
        compile_loss._metrics = trackers
