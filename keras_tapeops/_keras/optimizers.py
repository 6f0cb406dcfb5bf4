"""Private reads and writes of Keras optimizers, isolated here.

Keras 3 optimizers keep which variables they were built with, and the
arguments of `exclude_from_weight_decay()`, only in private attributes of
`keras.src.optimizers.base_optimizer.BaseOptimizer` (checked on Keras 3.10 to
3.15). keras_tapeops's optimizer groups and gradual unfreezing must know the
first (a `MultiOptimizer` applies exactly the variables it was built with),
and layer-wise learning-rate decay must copy the second onto the optimizers
it clones (`get_config()` does not carry them).
"""


def variable_key(optimizer, variable):
    """The key `optimizer` indexes `variable` by (`BaseOptimizer._var_key`).

    Keras indexes an optimizer's slots and its built-variable index by this
    key (the variable's path in Keras 3.15); no public API computes it.
    """
    return optimizer._var_key(variable)


def built_variable_keys(optimizer):
    """Keys (`variable_key`) of the variables a built `optimizer` applies.

    `BaseOptimizer.build` records them only in the private index
    `_trainable_variables_indices`, the one `apply` checks its gradients
    against (`_check_variables_are_known`, and `MultiOptimizer.apply` counts
    them); no public API lists the variables an optimizer was built with.

    Returns:
        A set of keys.
    """
    return set(optimizer._trainable_variables_indices)


def was_built_with(optimizer, variable):
    """True if `optimizer` (one optimizer, not a wrapper) is built and applies `variable`.

    Looks `variable_key(optimizer, variable)` up in the private index
    `_trainable_variables_indices` (see `built_variable_keys`).
    """
    return bool(
        optimizer.built and optimizer._var_key(variable) in optimizer._trainable_variables_indices
    )


def copy_weight_decay_exclusions(source, target):
    """Makes `target` exclude from weight decay what `source` excludes.

    `BaseOptimizer.exclude_from_weight_decay(var_list, var_names)` keeps its
    arguments only in the private attributes `_exclude_from_weight_decay`
    (variable keys) and `_exclude_from_weight_decay_pattern` (a compiled
    regex of the names), with a per-variable answer cache
    `_exclude_from_weight_decay_cache`; `get_config()` carries none of them,
    so an optimizer rebuilt from its config decays everything. Copies the
    first two where `source` has them and empties `target`'s cache.
    """
    for attribute in ("_exclude_from_weight_decay", "_exclude_from_weight_decay_pattern"):
        if hasattr(source, attribute):
            setattr(target, attribute, getattr(source, attribute))
    target._exclude_from_weight_decay_cache = {}
