"""Which compile options the JAX step supports, and the refusal of the others."""

from __future__ import annotations

from typing import Any

from keras_tapeops.options import OPTIONS
from keras_tapeops.options import TapeOpsOptions
from keras_tapeops.transforms.adaptive import AdaptiveClip
from keras_tapeops.transforms.adaptive import CentralizeGradients
from keras_tapeops.transforms.base import GradientTransform
from keras_tapeops.transforms.clipping import ClipByGlobalNorm
from keras_tapeops.transforms.clipping import ClipByNorm
from keras_tapeops.transforms.clipping import ClipByValue

#: The compile options the JAX step applies (the others are refused).
JAX_OPTIONS = ("gradient_transforms", "micro_batches", "batch_norm_updates")

#: The built-in transforms available on JAX; a user's own `kt.GradientTransform`
#: is too when it keeps no training state and gates no step.
JAX_TRANSFORMS = (ClipByNorm, ClipByGlobalNorm, ClipByValue, AdaptiveClip, CentralizeGradients)


def _refuse(name: str, value: Any, what: str = "") -> None:
    raise ValueError(
        f"`{name}`{what} is not available on the JAX backend yet; on JAX, "
        "keras_tapeops supports micro_batches, kt.optimizer_groups, "
        "kt.layerwise_lr_decay and gradient_transforms with "
        + ", ".join(f"kt.{t.__name__}" for t in JAX_TRANSFORMS)
        + " and your own stateless kt.GradientTransform (see docs/backends.md). "
        f"Use KERAS_BACKEND=tensorflow for it. Received: {name}={value!r}"
    )


def pop_jax_options(kwargs: dict[str, Any]) -> TapeOpsOptions:
    """Validated options from `compile()`'s kwargs, refusing what JAX lacks.

    Each option that is set and not in `JAX_OPTIONS` raises before anything
    is validated or compiled (its classes may need TensorFlow).

    Args:
        kwargs: `compile()`'s keyword arguments; the option keywords are
            removed, the stock ones stay.

    Returns:
        A `TapeOpsOptions` (only the options in `JAX_OPTIONS` may be set).
    """
    given = {option.name: kwargs.pop(option.name) for option in OPTIONS if option.name in kwargs}
    for option in OPTIONS:
        if option.name not in given or option.name in JAX_OPTIONS:
            continue
        value = given[option.name]
        if option.kind in ("int", "choice"):
            value = option.validate(value)  # TypeError/ValueError for bad input first
        if option.is_set(value):
            _refuse(option.name, value)
    options = TapeOpsOptions(**given)
    for transform in options.gradient_transforms:
        check_jax_transform(transform)
    return options


def check_jax_transform(transform: GradientTransform) -> None:
    """Raises ValueError for a transform the JAX step cannot run.

    Args:
        transform: a `kt.GradientTransform`.
    """
    cls = type(transform)
    if isinstance(transform, JAX_TRANSFORMS):
        return
    stateful = (
        cls.keep_step is not GradientTransform.keep_step
        or cls.after_apply is not GradientTransform.after_apply
    )
    if cls.__module__.startswith("keras_tapeops.") or stateful:
        _refuse("gradient_transforms", [transform], f" with {cls.__name__}")


def check_bound_state(transform: GradientTransform, state: Any) -> None:
    """Raises ValueError when `bind` created training state or metrics (TF only)."""
    if state.variables or state.metrics:
        _refuse(
            "gradient_transforms",
            [transform],
            f" with {type(transform).__name__} (its bind() adds training state or metrics)",
        )
