"""Refusing optimizer options that keras_tapeops options would stack on."""

import keras

from keras_tapeops._keras import private

_OPTIMIZER_CLIPPING = ("clipnorm", "clipvalue", "global_clipnorm")


def check_optimizer_conflicts(optimizer, options):
    """Refuses optimizer options that keras_tapeops options would stack on.

    - the optimizer's `clipnorm`/`clipvalue`/`global_clipnorm` with
      `gradient_transforms`: clip with `kt.ClipByNorm`/`kt.ClipByValue`/
      `kt.ClipByGlobalNorm` in the transform list instead (they act on true
      gradients, in list order);
    - the optimizer's `gradient_accumulation_steps` with `micro_batches`,
      `accumulation_steps` or `gradient_transforms`: use `accumulation_steps`
      (the optimizer would accumulate after the transforms, and windows
      would multiply: 4 x 2 = 8 batches).

    Args:
        optimizer: what was passed to `compile(optimizer=...)` (a name, an
            instance, a LossScaleOptimizer, or None).
        options: the validated `TapeOpsOptions`.

    Returns:
        None. Raises ValueError naming both options.
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        return
    for inner in private.sub_optimizers(optimizer):  # groups of a MultiOptimizer too
        _check_one_optimizer(inner, options)


def _check_one_optimizer(inner, options):
    if options.gradient_transforms:
        for name in _OPTIMIZER_CLIPPING:
            value = getattr(inner, name, None)
            if value is not None:
                raise ValueError(
                    f"The optimizer's `{name}` would clip on top of "
                    "`gradient_transforms`. Put the clipping in the transform "
                    "list instead (kt.ClipByNorm, kt.ClipByValue or "
                    "kt.ClipByGlobalNorm replace clipnorm, clipvalue and "
                    f"global_clipnorm). Received: {name}={value!r}"
                )
    steps = getattr(inner, "gradient_accumulation_steps", None)
    if steps and (options.accumulates or options.gradient_transforms):
        raise ValueError(
            "The optimizer's `gradient_accumulation_steps` cannot be combined "
            "with keras_tapeops' micro_batches, accumulation_steps or "
            "gradient_transforms: compile(accumulation_steps=k) replaces it. "
            f"Received: gradient_accumulation_steps={steps!r}"
        )
